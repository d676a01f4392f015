"""The packed-row record codec (contract/codec.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.codec import (
    FORMAT_VERSION,
    RecordError,
    decode_row,
    dense_row,
    encode_row,
    segment_ids_and_positions,
    token_dtype_for_vocab,
)


def test_golden_bytes_of_a_small_row():
    data = encode_row([[5, 6, 7], [9]], ["s/a:1", "s/b:2"], [0, 3], 8, "uint16")
    assert (
        data.hex()
        == (
            "4d4f4550"
            "01"
            "02"
            "0000"
            "08000000"
            "04000000"
            "02000000"  # header
            "0500"
            "0600"
            "0700"
            "0900"  # tokens
            "03000000"
            "01000000"  # segment lengths
            "00000000"
            "03000000"  # chunk indices
            "05000000"
            "05000000"  # key lengths
        )
        + b"s/a:1s/b:2".hex()
    )
    row = decode_row(data)
    assert row.tokens.dtype == np.dtype("<u2") and row.tokens.tolist() == [5, 6, 7, 9]
    assert row.doc_keys == ("s/a:1", "s/b:2") and row.chunk_indices.tolist() == [0, 3]
    assert row.padding == 4 and [s.tolist() for s in row.segments()] == [[5, 6, 7], [9]]
    assert row.doc_ids == ("", "")
    # no id anywhere: version 1, the same bytes whether ids are not given or all empty
    assert encode_row([[5, 6, 7], [9]], ["s/a:1", "s/b:2"], [0, 3], 8, "uint16", doc_ids=["", ""]) == data


def test_golden_bytes_of_a_row_with_document_ids():
    """Version 2: a row whose documents carry ids (the source's id_field) adds their lengths and bytes."""
    data = encode_row([[5, 6, 7], [9]], ["s/a:1", "s/b:2"], [0, 3], 8, "uint16", doc_ids=["https://x.org/1", ""])
    assert data.hex() == (
        "4d4f4550" "02" "02" "0000" "08000000" "04000000" "02000000"  # header, version 2
        "0500" "0600" "0700" "0900"  # tokens
        "03000000" "01000000"  # segment lengths
        "00000000" "03000000"  # chunk indices
        "05000000" "05000000"  # key lengths
        "0f000000" "00000000"  # id lengths
    ) + b"s/a:1s/b:2".hex() + b"https://x.org/1".hex()
    row = decode_row(data)
    assert row.doc_keys == ("s/a:1", "s/b:2") and row.doc_ids == ("https://x.org/1", "")
    assert row.tokens.tolist() == [5, 6, 7, 9] and row.chunk_indices.tolist() == [0, 3]
    with pytest.raises(RecordError, match="layout"):
        decode_row(data[:-1] + b"")  # an id byte short
    with pytest.raises(ValueError, match="doc_ids \\(1\\)"):
        encode_row([[5], [9]], ["a", "b"], [0, 0], 8, "uint16", doc_ids=["x"])


def test_docstring_example_of_segment_ids_and_positions():
    seg, pos = segment_ids_and_positions(np.array([4, 3]), 10)
    assert seg.tolist() == [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]
    assert pos.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 0, 0]
    tokens, seg2, _ = dense_row(
        decode_row(encode_row([[1] * 4, [2] * 3], ["a", "b"], [0, 0], 10, "uint32")), pad_id=-1
    )
    assert tokens.tolist() == [1, 1, 1, 1, 2, 2, 2, -1, -1, -1] and seg2.tolist() == seg.tolist()


def test_dtype_choice():
    assert token_dtype_for_vocab(65536) == np.dtype("<u2")
    assert token_dtype_for_vocab(65537) == np.dtype("<u4")
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype_for_vocab(0)


@pytest.mark.parametrize(
    "args, match",
    [
        (([[1, 2, 3]], ["k"], [0], 2, "uint16"), "more than seq_len"),
        (([[70000]], ["k"], [0], 4, "uint16"), "token ids must be in"),
        (([[]], ["k"], [0], 4, "uint16"), "at least one token"),
        (([[1]], ["k", "j"], [0], 4, "uint16"), "same length"),
        (([[1]], ["k"], [0], 4, "int32"), "uint16 or uint32"),
        (([[1]], ["k"], [-1], 4, "uint16"), "chunk indices"),
    ],
)
def test_encode_rejects_bad_rows(args, match):
    with pytest.raises(ValueError, match=match):
        encode_row(*args)


def test_decode_rejects_bad_bytes():
    good = encode_row([[1, 2]], ["k"], [0], 4, "uint32")
    with pytest.raises(RecordError, match="shorter"):
        decode_row(good[:10])
    with pytest.raises(RecordError, match="magic"):
        decode_row(b"XXXX" + good[4:])
    with pytest.raises(RecordError, match="version 3, this reader knows \\[1, 2\\]"):
        decode_row(good[:4] + bytes([FORMAT_VERSION + 1]) + good[5:])
    with pytest.raises(RecordError, match="truncated|layout"):
        decode_row(good[:-1])
    with pytest.raises(RecordError, match="layout"):
        decode_row(good + b"\0")


@settings(max_examples=200, deadline=None)
@given(
    segs=st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20), max_size=8),
    keys=st.lists(st.text(max_size=12), min_size=8, max_size=8),
    chunks=st.lists(st.integers(0, 1000), min_size=8, max_size=8),
    extra=st.integers(0, 10),
    ids=st.none() | st.lists(st.text(max_size=12), min_size=8, max_size=8),
)
def test_round_trip(segs, keys, chunks, extra, ids):
    n = len(segs)
    seq_len = sum(map(len, segs)) + extra or 1
    dtype = "uint16" if all(t < 2**16 for s in segs for t in s) else "uint32"
    data = encode_row(segs, keys[:n], chunks[:n], seq_len, dtype, doc_ids=None if ids is None else ids[:n])
    row = decode_row(data)
    assert data[4] == (2 if ids is not None and any(ids[:n]) else 1)
    assert [s.tolist() for s in row.segments()] == segs
    assert row.doc_keys == tuple(keys[:n]) and row.chunk_indices.tolist() == chunks[:n]
    assert row.doc_ids == (tuple(ids[:n]) if ids is not None else ("",) * n)
    assert row.seq_len == seq_len and row.padding == extra + (0 if segs or extra else 1)
    seg_ids, pos = segment_ids_and_positions(row.segment_lengths, seq_len)
    for i, s in enumerate(segs):
        start = sum(map(len, segs[:i]))
        assert seg_ids[start : start + len(s)].tolist() == [i + 1] * len(s)
        assert pos[start : start + len(s)].tolist() == list(range(len(s)))
    assert (seg_ids[row.num_tokens :] == 0).all()


def _reference_encode_row(tokens_per_segment, doc_keys, chunk_indices, seq_len, token_dtype, doc_ids=None):
    """encode_row as it was written before its struct packing (2026-12-07), NumPy for every field:
    the bytes the new form must give for every valid row."""
    import struct

    dtype = np.dtype(token_dtype).newbyteorder("<")
    lengths = np.array([len(s) for s in tokens_per_segment], dtype="<u4")
    total = int(lengths.sum())
    flat = (np.concatenate([np.asarray(s, dtype=np.int64) for s in tokens_per_segment])
            if tokens_per_segment else np.zeros((0,), np.int64))
    chunks = np.asarray(chunk_indices, dtype=np.int64)
    keys = [k.encode("utf-8", "surrogatepass") for k in doc_keys]
    key_lengths = np.array([len(k) for k in keys], dtype="<u4")
    ids = [i.encode("utf-8", "surrogatepass") for i in doc_ids] if doc_ids is not None and any(doc_ids) else None
    parts = [
        struct.pack("<4sBBHIII", b"MOEP", 1 if ids is None else 2, dtype.itemsize, 0, seq_len, total,
                    len(tokens_per_segment)),
        flat.astype(dtype, copy=False).tobytes(), lengths.tobytes(), chunks.astype("<u4").tobytes(),
        key_lengths.tobytes(),
    ]
    if ids is None:
        parts.append(b"".join(keys))
    else:
        parts += [np.array([len(i) for i in ids], dtype="<u4").tobytes(), b"".join(keys), b"".join(ids)]
    return b"".join(parts)


@settings(max_examples=200, deadline=None)
@given(
    segs=st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20), max_size=8),
    keys=st.lists(st.text(max_size=12), min_size=8, max_size=8),
    chunks=st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8),
    extra=st.integers(0, 10),
    ids=st.none() | st.lists(st.text(max_size=12), min_size=8, max_size=8),
    form=st.sampled_from(["lists", "stored arrays", "strided arrays", "int64 arrays"]),
)
def test_encode_row_gives_the_bytes_of_its_reference_form(segs, keys, chunks, extra, ids, form):
    """Every input form (lists; arrays of the stored dtype, contiguous or strided; wider arrays) gives
    the reference form's bytes, chunk indices up to 2**32 - 1 included."""
    n = len(segs)
    seq_len = sum(map(len, segs)) + extra or 1
    dtype = "uint16" if all(t < 2**16 for s in segs for t in s) else "uint32"
    if form == "stored arrays":
        given_segs = [np.array(s, dtype=dtype) for s in segs]
    elif form == "strided arrays":
        given_segs = [np.repeat(np.array(s, dtype=dtype), 2)[::2] for s in segs]
    elif form == "int64 arrays":
        given_segs = [np.array(s, dtype=np.int64) for s in segs]
    else:
        given_segs = segs
    doc_ids = None if ids is None else ids[:n]
    assert encode_row(given_segs, keys[:n], chunks[:n], seq_len, dtype, doc_ids=doc_ids) == \
        _reference_encode_row(segs, keys[:n], chunks[:n], seq_len, dtype, doc_ids=doc_ids)
