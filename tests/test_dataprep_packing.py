"""Packing invariants of dataprep.packing (pure functions, no Beam)."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataprep import packing, testing


def _docs(lengths):
    """Documents with distinct token values so that every token can be traced."""
    out, nxt = {}, 0
    for i, n in enumerate(lengths):
        out[f"src/f.jsonl:{i + 1}"] = np.arange(nxt, nxt + n, dtype=np.uint32)
        nxt += n
    return out


def _pack(docs, seq_len, max_segments):
    """Rows of chunks: the object form of what the packing step does with its columns
    (``chunk_columns``, then ``pack_rows``)."""
    ordered = packing.sort_for_packing(c for k, t in docs.items() for c in packing.split_into_chunks(k, t, seq_len))
    return [[ordered[i] for i in row] for row in packing.pack_rows([len(c) for c in ordered], seq_len, max_segments)]


def test_worked_example_from_the_docstring():
    docs = {"A": np.arange(9), "B": np.arange(5), "C": np.arange(3), "D": np.arange(2), "E": np.arange(1)}
    rows = _pack(docs, seq_len=8, max_segments=3)
    assert [[(c.key, c.index, len(c)) for c in row] for row in rows] == [
        [("A", 0, 8)],
        [("B", 0, 5), ("C", 0, 3)],
        [("D", 0, 2), ("A", 1, 1), ("E", 0, 1)],
    ]
    assert packing.fill(20, len(rows), 8) == 20 / 24


def test_exactly_seq_len_gives_one_row_with_one_segment():
    rows = _pack({"k": np.arange(8)}, seq_len=8, max_segments=4)
    assert len(rows) == 1 and len(rows[0]) == 1
    assert rows[0][0].index == 0 and rows[0][0].tokens.tolist() == list(range(8))


@pytest.mark.parametrize("n, expected", [(9, [8, 1]), (16, [8, 8]), (8, [8]), (1, [1]), (17, [8, 8, 1])])
def test_split_lengths(n, expected):
    chunks = packing.split_into_chunks("k", np.arange(n), 8)
    assert [len(c) for c in chunks] == expected
    assert [c.index for c in chunks] == list(range(len(expected)))
    assert np.concatenate([c.tokens for c in chunks]).tolist() == list(range(n))


def test_nine_and_sixteen_token_documents_at_seq_len_8():
    rows = _pack({"a": np.arange(9), "b": np.arange(100, 116)}, seq_len=8, max_segments=8)
    layout = [[(c.key, c.index, len(c)) for c in row] for row in rows]
    # three full chunks (sorted by key, chunk), then the 1-token tail of "a" alone.
    assert layout == [[("a", 0, 8)], [("b", 0, 8)], [("b", 1, 8)], [("a", 1, 1)]]


def test_final_partial_row_is_flushed_and_counted():
    rows = _pack({"a": np.arange(3)}, seq_len=8, max_segments=2)
    assert len(rows) == 1 and sum(len(c) for c in rows[0]) == 3


def test_bad_items_and_cap_raise():
    with pytest.raises(ValueError, match="not in \\[1, 8\\]"):
        packing.best_fit_decreasing([9], 8, 2)
    with pytest.raises(ValueError, match="max_segments"):
        packing.best_fit_decreasing([1], 8, 0)
    with pytest.raises(ValueError, match="no tokens"):
        packing.split_into_chunks("k", np.zeros(0), 8)


def test_bucket_is_stable_and_in_range():
    # pinned values: a change to the hash or its encoding changes every dataset.
    assert [packing.bucket_of(0, "web", f"web/a.jsonl:{i}", 4) for i in range(1, 9)] == [
        1,
        2,
        0,
        3,
        1,
        2,
        3,
        0,
    ]
    assert all(0 <= packing.bucket_of(s, "x", "k", 7) < 7 for s in range(20))
    counts = collections.Counter(packing.bucket_of(0, "x", f"k{i}", 4) for i in range(4000))
    assert min(counts.values()) > 850  # roughly uniform


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=0, max_size=60),
    seq_len=st.integers(1, 16),
    max_segments=st.integers(1, 6),
)
def test_packing_invariants(lengths, seq_len, max_segments):
    docs = _docs(lengths)
    rows = _pack(docs, seq_len, max_segments)
    for row in rows:
        assert 1 <= len(row) <= max_segments
        assert sum(len(c) for c in row) <= seq_len
    # every token exactly once, in document order within its segment and across chunks
    seen = collections.defaultdict(dict)
    for row in rows:
        for c in row:
            assert c.index not in seen[c.key]
            seen[c.key][c.index] = c.tokens
    for key, tokens in docs.items():
        got = np.concatenate([seen[key][i] for i in sorted(seen[key])])
        assert sorted(seen[key]) == list(range(len(seen[key])))
        assert got.tolist() == tokens.tolist()
    assert set(seen) == set(docs)
    # no row could have taken a later-opened row's first item (best fit opens rows only when needed)
    total = sum(lengths)
    assert sum(len(c) for row in rows for c in row) == total
    if max_segments >= 16:
        assert len(rows) <= 2 * -(-total // seq_len) + 1


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=200), max_segments=st.integers(1, 300))
def test_best_fit_matches_a_plain_reference(lengths, max_segments):
    """The bisect implementation equals the obvious O(n * rows) best fit."""
    seq_len = 64
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    items = [lengths[i] for i in order]
    rows_ref, room = [], []
    for i, n in enumerate(items):
        best = None
        for r, left in enumerate(room):
            if n <= left and len(rows_ref[r]) < max_segments and (best is None or left < room[best]):
                best = r
        if best is None:
            rows_ref.append([])
            room.append(seq_len)
            best = len(rows_ref) - 1
        rows_ref[best].append(i)
        room[best] -= n
    assert packing.best_fit_decreasing(items, seq_len, max_segments) == rows_ref


def test_input_order_does_not_matter():
    docs = _docs([5, 12, 3, 3, 7, 20, 1, 9])
    a = _pack(docs, 8, 3)
    b = _pack(dict(reversed(list(docs.items()))), 8, 3)
    assert [[(c.key, c.index) for c in r] for r in a] == [[(c.key, c.index) for c in r] for r in b]


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(min_size=1, max_size=6), st.integers(1, 40), min_size=0, max_size=40),
    st.integers(1, 12),
)
def test_chunk_columns_equal_split_then_sort(docs, seq_len):
    """The packing step's NumPy columns give the chunks sort_for_packing gives, in its order."""
    keys = list(docs)
    tokens = {k: np.arange(n) for k, n in docs.items()}
    expected = packing.sort_for_packing(c for k in keys for c in packing.split_into_chunks(k, tokens[k], seq_len))
    doc, chunk, start, length = packing.chunk_columns(keys, np.array([docs[k] for k in keys], np.int64), seq_len)
    got = [(keys[d], c, s, n) for d, c, s, n in zip(doc.tolist(), chunk.tolist(), start.tolist(), length.tolist())]
    assert got == [(c.key, c.index, int(c.tokens[0]), len(c)) for c in expected]


# --------------------------------------------------------------------------- both limits


def _check_rows(rows, lengths, seq_len, max_segments):
    """Every item exactly once; no row over seq_len tokens or max_segments segments."""
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for row in rows:
        assert 1 <= len(row) <= max_segments
        assert sum(lengths[i] for i in row) <= seq_len


def _cap_binds(rows, lengths, seq_len, max_segments):
    return any(len(r) == max_segments and sum(lengths[i] for i in r) < seq_len for r in rows)


def test_the_cap_aware_worked_example_from_the_docstring():
    lengths = [4, 4, 2, 2, 1, 1, 1, 1]  # A B C D E F G H
    assert packing.best_fit_decreasing(lengths, 8, 4) == [[0, 1], [2, 3, 4, 5], [6, 7]]
    assert packing.small_threshold(lengths, 8, 4, rows=2) == 4
    assert packing.pack_rows(lengths, 8, 4) == [[7, 5, 3, 0], [6, 4, 2, 1]]  # H F D A, G E C B


def test_pack_rows_refuses_lengths_out_of_packing_order():
    with pytest.raises(ValueError, match="decreasing order"):
        packing.pack_rows([1, 2], 8, 4)


def _lengths(draw_lengths, seq_len):
    return sorted((min(x, seq_len) for x in draw_lengths), reverse=True)


@settings(max_examples=400, deadline=None)
@given(
    raw=st.lists(st.integers(1, 64), min_size=0, max_size=120),
    seq_len=st.integers(1, 64),
    max_segments=st.integers(1, 12),
)
def test_pack_rows_invariants(raw, seq_len, max_segments):
    """Both limits hold, every item is placed once, never more rows than best fit decreasing,
    never fewer than the lower bound; where the cap does not bind, best fit's rows exactly."""
    lengths = _lengths(raw, seq_len)
    rows = packing.pack_rows(lengths, seq_len, max_segments)
    _check_rows(rows, lengths, seq_len, max_segments)
    bfd = packing.best_fit_decreasing(lengths, seq_len, max_segments)
    assert len(rows) <= len(bfd)
    assert len(rows) >= packing.lower_bound(sum(lengths), len(lengths), seq_len, max_segments)
    if not _cap_binds(bfd, lengths, seq_len, max_segments):
        assert rows == bfd
    assert packing.pack_rows(lengths, seq_len, max_segments) == rows  # deterministic


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(st.integers(1, 64), min_size=0, max_size=120), seq_len=st.integers(1, 64))
def test_where_the_cap_cannot_bind_rows_equal_best_fit_decreasing(raw, seq_len):
    lengths = _lengths(raw, seq_len)
    max_segments = max(1, len(lengths))  # a row can never reach the cap with room left... or holds every item
    assert packing.pack_rows(lengths, seq_len, max_segments) == packing.best_fit_decreasing(
        lengths, seq_len, max_segments)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.lists(st.integers(1, 64), min_size=1, max_size=120),
    seq_len=st.integers(1, 64),
    max_segments=st.integers(1, 12),
    t_shift=st.integers(-3, 3),
    extra_rows=st.integers(0, 3),
    share=st.integers(0, 70),
)
def test_each_spreading_packing_alone_keeps_both_limits(raw, seq_len, max_segments, t_shift, extra_rows, share):
    """deal_first and reserve_then_deal are valid packings for any threshold, row count and share."""
    lengths = _lengths(raw, seq_len)
    floor = packing.lower_bound(sum(lengths), len(lengths), seq_len, max_segments)
    t = max(1, packing.small_threshold(lengths, seq_len, max_segments, floor) + t_shift)
    _check_rows(packing.deal_first(lengths, seq_len, max_segments, t, floor + extra_rows), lengths, seq_len,
                max_segments)
    rows, kept = packing.reserve_then_deal(lengths, seq_len, max_segments, t, share)
    _check_rows(rows, lengths, seq_len, max_segments)
    assert kept >= 0


def test_short_documents_fill_rows_at_seq_len_8192():
    """Heavy-tailed lengths, median 30 tokens (the shape of a corpus of paragraphs): best fit
    decreasing leaves rows of tiny items at the cap; pack_rows reaches the lower bound. Pinned counts: a change to the packing changes them."""
    lengths = packing.chunk_lengths(testing.heavy_tailed_token_counts(20_000, 30, 1.6, seed=0), 8192)
    tokens = sum(lengths)
    assert (len(lengths), tokens) == (20_004, 2_157_764)
    bfd = packing.best_fit_decreasing(lengths, 8192, 256)
    rows = packing.pack_rows(lengths, 8192, 256)
    _check_rows(rows, lengths, 8192, 256)
    assert packing.lower_bound(tokens, len(lengths), 8192, 256) == 264
    assert (len(bfd), len(rows)) == (287, 264)  # 91.8% and 99.77%; 264 is the lower bound
    assert packing.fill(tokens, len(rows), 8192) > 0.995 > packing.fill(tokens, len(bfd), 8192)
