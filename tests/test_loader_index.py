"""Index arithmetic of the loader: tables and hypothesis (no JAX, no I/O)."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import index as ix


def schedule(weights, records, B=4, phases=(), seed=0, skip=()):
    names = tuple(f"s{k}" for k in range(len(weights)))
    ph = (ix.PhaseSpec(0, tuple(weights)),) + tuple(ix.PhaseSpec(s, tuple(w)) for s, w in phases)
    return ix.Schedule(names, tuple(records), ph, B, seed, tuple(skip))


@pytest.mark.parametrize(
    "weights, quotas, period",
    [
        ((1.0, 1.0), (1, 1), 2),
        ((0.3, 0.7), (3, 7), 10),
        ((0.001, 0.999), (1, 999), 1000),
        ((2, 0, 6), (1, 0, 3), 4),
        ((0.5, 0.25, 0.25), (2, 1, 1), 4),
    ],
)
def test_quotas_table(weights, quotas, period):
    assert ix.quotas(weights) == (quotas, period)


def test_quotas_rounded_when_period_too_large():
    a, D = ix.quotas((1 / 3, 2 / 3, 1e-9), max_period=1000)
    assert (a, D) == ((333, 666, 1), 1000)
    a, D = ix.quotas((1, 1, 1.0000001), max_period=1000)  # exact period 30000001 > 1000
    assert (a, D) == ((333, 333, 334), 1000)


@pytest.mark.parametrize("bad", [(-1.0, 1.0), (0.0, 0.0), (float("nan"), 1.0), (float("inf"), 1.0)])
def test_bad_weights_raise(bad):
    with pytest.raises(ix.ScheduleError):
        ix.exact_weights(bad)


@pytest.mark.parametrize(
    "weights, prefix",
    [
        ((0.3, 0.7), [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]),
        ((1, 1), [0, 1]),
        ((1, 2, 3, 4, 5), [4, 3, 2, 4, 1, 3, 4, 2, 3, 4, 0, 1, 2, 3, 4]),
    ],
)
def test_interleave_golden(weights, prefix):
    """Pinned order: a change here silently changes every run's data order."""
    src, _ = ix.interleave_period(ix.quotas(weights)[0])
    assert src[: len(prefix)].tolist() == prefix


weights_st = st.lists(
    st.one_of(st.just(0.0), st.floats(0.001, 1000.0, allow_nan=False), st.integers(1, 50).map(float)),
    min_size=1, max_size=7,
).filter(lambda w: any(x > 0 for x in w))


@settings(max_examples=60, deadline=None)
@given(weights_st)
def test_every_prefix_within_one_row(weights):
    """Tijdeman's bound: |n_k(t) - w_k t| < 1 for every source and prefix t (exact rationals)."""
    a, D = ix.quotas(weights, max_period=5000)
    src, draw = ix.interleave_period(a)
    t = np.arange(1, D + 1)
    K = sum(1 for q in a if q > 0)
    for k, q in enumerate(a):
        nk = np.cumsum(src == k)
        assert np.all(np.abs(nk * D - q * t) < D)
        if K >= 2:  # Tijdeman's sharper bound: |n_k(t) - w_k t| <= 1 - 1/(2K-2)
            assert np.all((2 * K - 2) * np.abs(nk * D - q * t) <= (2 * K - 3) * D)
        if q == 0:
            assert nk[-1] == 0  # zero weight draws nothing
        # draw counts of source k are 0, 1, 2, ... in order
        assert draw[src == k].tolist() == list(range(q))


@settings(max_examples=40, deadline=None)
@given(weights_st, st.integers(1, 5), st.integers(0, 10**6))
def test_counts_closed_form_matches_table(weights, B, rows):
    a, D = ix.quotas(weights, max_period=3000)
    src, _ = ix.interleave_period(a)
    q, s = divmod(rows, D)
    want = q * np.asarray(a) + np.bincount(src[:s], minlength=len(a))
    assert ix.interleave_counts(a, rows).tolist() == want.tolist()
    # and within one row of weight x rows
    exact = [Fraction(x, D) * rows for x in a]
    assert all(abs(c - e) < 1 for c, e in zip(ix.interleave_counts(a, rows).tolist(), exact))


def test_extreme_weights_small_source_never_out_of_range():
    sch = schedule((0.001, 0.999), (5, 1000), B=10)
    loc = sch.locate(np.arange(0, 20_000))
    assert loc.record[loc.source == 0].max() < 5 and loc.record[loc.source == 1].max() < 1000
    counts = np.bincount(loc.source, minlength=2)
    assert counts.tolist() == [20, 19_980]
    assert loc.record.min() >= 0


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=2, max_size=4),
    st.lists(st.integers(1, 9), min_size=2, max_size=4),
    st.integers(1, 6), st.integers(1, 7), st.integers(1, 13),
)
def test_phase_change_continues_each_source(w0, w1, B, S, n_records):
    """Across a phase change no row of a source is repeated or skipped: the draw counts of each
    source over the run are exactly 0, 1, 2, ... and epochs are full permutations."""
    K = min(len(w0), len(w1))
    w0, w1 = w0[:K], w1[:K]
    sch = schedule(w0, [n_records] * K, B=B, phases=[(S, w1)])
    rows = np.arange(0, (S + 8) * B)
    loc = sch.locate(rows)
    for k in range(K):
        d = loc.draw[loc.source == k]
        assert d.tolist() == list(range(len(d)))
        full = (len(d) // n_records) * n_records
        recs = loc.record[loc.source == k][:full].reshape(-1, n_records)
        for epoch in recs:
            assert sorted(epoch.tolist()) == list(range(n_records))
    assert np.all(loc.phase[: S * B] == 0) and np.all(loc.phase[S * B:] == 1)
    # counts are O(1) closed form and agree with the rows
    assert sch.source_counts(len(rows)).tolist() == np.bincount(loc.source, minlength=K).tolist()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 5), st.integers(1, 6),
    st.integers(1, 11), st.lists(st.integers(0, 200), min_size=0, max_size=40),
)
def test_locate_any_row_order_equals_one_row_at_a_time(w, B, S, n_records, rows):
    """``locate`` groups rows by phase and by (source, epoch) to shuffle each group at once; rows in
    any order, repeated, across a phase change and several epochs, get what each row gets alone."""
    sch = schedule(w, [n_records] * len(w), B=B, phases=[(S, list(reversed(w)))], seed=3)
    loc = sch.locate(np.asarray(rows, np.int64))
    for i, g in enumerate(rows):
        one = sch.locate([g])
        got = [int(getattr(loc, f)[i]) for f in ("global_row", "phase", "source", "draw", "epoch", "record")]
        assert got == [int(getattr(one, f)[0]) for f in ("global_row", "phase", "source", "draw", "epoch", "record")]
        assert got[-1] == ix.shuffled_record(int(one.index_in_epoch[0]), n_records, 3, f"s{got[2]}", got[4])


@pytest.mark.parametrize(
    "windows, step, expected",
    [
        ((), 5, 5),
        (((3, 4),), 2, 2),
        (((3, 4),), 3, 5),
        (((3, 4),), 10, 12),
        (((3, 4), (10, 10)), 9, 11),
        (((3, 4), (10, 10)), 10, 13),
        (((0, 0),), 0, 1),
    ],
)
def test_skip_windows_table(windows, step, expected):
    w = ix.check_skip_windows(windows)
    assert ix.data_step(step, w) == expected


@pytest.mark.parametrize("bad", [((5, 4),), ((-1, 2),), ((3, 4), (3, 5)), ((5, 6), (1, 2))])
def test_bad_skip_windows(bad):
    with pytest.raises(ix.ScheduleError):
        ix.check_skip_windows(bad)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 50), st.integers(0, 20), st.integers(0, 100))
def test_skip_window_shifts_batches(a, length, s):
    base = schedule((1, 2), (7, 11), B=3)
    skipped = schedule((1, 2), (7, 11), B=3, skip=[(a, a + length)])
    want = base.step_rows(s + (length + 1) if s >= a else s)
    assert skipped.step_rows(s).tolist() == want.tolist()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.integers(0, 10**9))
def test_record_to_shard(records_per_shard, seed):
    off = ix.shard_offsets(records_per_shard)
    total = int(off[-1])
    if total == 0:
        return
    rec = np.random.default_rng(seed).integers(0, total, size=20)
    shard, in_shard = ix.record_to_shard(rec, off)
    for r, s, j in zip(rec, shard, in_shard):
        assert 0 <= j < records_per_shard[s] and off[s] + j == r


def test_shuffle_is_a_permutation_reseeded_per_epoch():
    perms = [[ix.shuffled_record(i, 50, 0, "web", e) for i in range(50)] for e in range(3)]
    for p in perms:
        assert sorted(p) == list(range(50))
    assert perms[0] != perms[1] != perms[2]
    assert perms[0] != [ix.shuffled_record(i, 50, 1, "web", 0) for i in range(50)]
    assert perms[0] != [ix.shuffled_record(i, 50, 0, "code", 0) for i in range(50)]


def test_golden_order():
    """Pinned global order (source, record) of the first two steps: guards silent changes."""
    sch = schedule((0.3, 0.7), (5, 12), B=8)
    loc = sch.locate(np.arange(16))
    got = list(zip(loc.source.tolist(), loc.record.tolist()))
    assert got == GOLDEN


GOLDEN = [(1, 10), (0, 3), (1, 7), (1, 0), (0, 2), (1, 8), (1, 9), (1, 6),
          (0, 1), (1, 11), (1, 4), (0, 0), (1, 1), (1, 5), (0, 4), (1, 3)]


def test_late_step_is_closed_form():
    """batch_at(10**7) is computed without iterating from 0: same answer as the formula."""
    sch = schedule((1, 2, 3), (101, 203, 307), B=16, phases=[(1000, (3, 2, 1))])
    step = 10**7
    loc = sch.locate(sch.step_rows(step))
    before = sch.source_counts(step * 16)
    for k in range(3):
        d = loc.draw[loc.source == k]
        assert d.tolist() == list(range(before[k], before[k] + len(d)))


@pytest.mark.parametrize("hosts", [1, 2, 3, 4])
def test_host_slices_disjoint_union(hosts):
    B = 12
    sch = schedule((1, 1), (3, 2), B=B)  # fewer shards/records than hosts is fine
    for step in range(5):
        rows = sch.step_rows(step)
        parts = [rows[list(ix.host_rows(B, hosts, h))] for h in range(hosts)]
        assert all(len(p) == B // hosts for p in parts)
        assert np.concatenate(parts).tolist() == rows.tolist()


def test_paper_scale_17920_chips():
    """4,480 hosts, global batch 4,480 rows of 8,192 tokens, one row per host per step; then 2,240 hosts."""
    B = 4480
    sch = schedule((0.5, 0.3, 0.2), (10**7, 3 * 10**6, 10**6), B=B, phases=[(500_000, (0.2, 0.3, 0.5))])
    for step in (0, 123_456, 799_999):
        rows = sch.step_rows(step)
        for hosts in (4480, 2240):
            per = [rows[list(ix.host_rows(B, hosts, h))] for h in range(hosts)]
            assert all(len(p) == B // hosts for p in per)
            union = np.concatenate(per)
            assert len(np.unique(union)) == B and union.tolist() == rows.tolist()
        loc = sch.locate(rows)
        assert loc.record.max() < 10**7 and np.all(np.bincount(loc.source, minlength=3) > 0)


def test_schedule_errors_name_values():
    with pytest.raises(ix.ScheduleError, match="global_batch"):
        schedule((1,), (3,), B=0)
    with pytest.raises(ix.ScheduleError, match="no records"):
        schedule((1, 1), (3, 0))
    with pytest.raises(ix.ScheduleError, match="step must be >= 0"):
        schedule((1,), (3,)).step_rows(-1)
