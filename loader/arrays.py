"""Record bytes -> host arrays: the one implementation the loader runs (numpy, no JAX, no I/O).

:func:`pack_records` parses a step's encoded rows (``contract.codec``, format versions 1 and 2)
straight from their bytes into tokens, segment ids and positions, and, for a loader that
derives the targets on the host, all six trainer arrays (:data:`BATCH_KEYS`) in the same
pass, in one 64-byte-aligned block from :class:`AlignedPool`. Its parts, each over the whole
step at once: :func:`_parse` (headers and segment tables, checked), :func:`_copy_tokens`,
:func:`_check_vocab`, :func:`_ids_and_positions` (one ``np.repeat`` per array over the
step's runs of segments and padding). A record that fails a check is explained
(:func:`_explain`) by decoding it with ``contract.codec``.

Two more functions, each for one case: :func:`derive_packed` makes the six arrays of the
narrower tokens, ids and positions that Grain worker processes send (a quarter of the
bytes through shared memory), and :func:`decode_all` turns records into
``contract.codec.PackedRow`` objects (tokens and document keys) for inspection.

The slower per-row reference forms the tests compare against (``pack_inputs``,
``derive_batch``, ``dense_batch``) live in ``loader.testing``.

May import: ``loader.shards`` (for ``DatasetError``) and ``contract``.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from contract import codec
from loader.shards import DatasetError

BATCH_KEYS = (
    "inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position",
)


def decode_all(records: Sequence[bytes], where: Mapping[int, str] | None = None) -> list[codec.PackedRow]:
    """Decodes records with ``contract.codec.decode_row``.

    Raises:
      DatasetError: a record does not decode (``where[i]`` names it when given).
    """
    out = []
    for i, data in enumerate(records):
        try:
            out.append(codec.decode_row(data))
        except codec.RecordError as e:
            raise DatasetError(f"{_name(where, i)}: {e}") from None
    return out


def derive_packed(packed: np.ndarray) -> dict[str, np.ndarray]:
    """The six int32 ``[n, L]`` trainer arrays of a ``packed`` host batch ``[n, 3, L]`` (tokens,
    segment ids, positions; uint16 or int32, as ``StepSource`` makes it for Grain workers to
    send: a quarter of the six keys' bytes): the host twin of ``loader.device.derive_packed``,
    for a loader that derives the targets on the host (``loader.device.Placement``). The same
    values as ``loader.testing.derive_batch``, bit for bit (tests check it)."""
    inputs = packed[:, 0].astype(np.int32)
    seg = packed[:, 1].astype(np.int32)
    pos = packed[:, 2].astype(np.int32)
    n, L = seg.shape
    valid = np.zeros((n, L), bool)
    np.equal(seg[:, 1:], seg[:, :-1], out=valid[:, :-1])
    valid[:, :-1] &= seg[:, :-1] != 0
    targets = np.zeros((n, L), np.int32)
    np.multiply(inputs[:, 1:], valid[:, :-1], out=targets[:, :-1])
    return {
        "inputs": inputs,
        "targets": targets,
        "inputs_segmentation": seg,
        "targets_segmentation": seg * valid,
        "inputs_position": pos,
        "targets_position": pos * valid,
    }


# The record header of contract.codec (format versions 1 and 2), read as five little-endian
# u32 words without building PackedRow objects (the loader's hot path only needs tokens and
# segment lengths): magic, version | width << 8 | reserved << 16, seq_len, tokens, segments.
_HEADER = struct.Struct("<4sBBHIII")
assert _HEADER.size == codec._HEADER.size == 20  # noqa: SLF001 - same layout as the codec
_MAGIC_WORD = int.from_bytes(codec.MAGIC, "little")
# u32 words per segment after the tokens (lengths, chunk indices, key lengths; version 2 adds
# id lengths), by format version; 0 for a version this reader does not know.
_SEGMENT_WORDS = np.zeros(256, np.int64)
for _v in codec.READABLE_VERSIONS:
    _SEGMENT_WORDS[_v] = 3 if _v == 1 else 4


class _Rows(NamedTuple):
    """What :func:`pack_records` parsed of a step's records (``n`` rows, ``s`` segments in all),
    every field int64: ``T``, ``S``, ``W`` ``[n]`` the tokens, segments and token width of each
    row; ``row``, ``rank``, ``lengths`` ``[s]`` the row of each segment (row after row), its
    index in that row and its length; ``starts`` ``[s]`` its first slot in its row."""

    T: np.ndarray
    S: np.ndarray
    W: np.ndarray
    row: np.ndarray
    rank: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray


def pack_records(
    records: Sequence[bytes], seq_len: int, token_width: int, pad_id: int = 0,
    out_dtype: np.dtype | str = np.int32, vocab_size: int | None = None,
    where: Mapping[int, str] | None = None, six: bool = False, out: np.ndarray | None = None,
    stamps: list[float] | None = None,
) -> tuple[np.ndarray | dict[str, np.ndarray], int]:
    """Tokens, segment ids and positions of encoded rows, straight from the record bytes.

    The loader's per-step path: the same values as the per-row reference
    ``loader.testing.pack_inputs(decode_all(records), ...)`` without building
    :class:`contract.codec.PackedRow` objects: the records' headers and segment tables are
    joined and parsed as arrays (:func:`_parse`), the tokens copied in one conversion
    (:func:`_copy_tokens`), and ids and positions written run by run (:func:`_ids_and_positions`);
    no work per row in Python beyond slicing its bytes.

    Checks every record as ``contract.codec.decode_row`` does (magic, version, width,
    ``T <= seq_len``, lengths partition the tokens, no truncation or trailing bytes; the
    document keys' bytes are counted, not decoded), and also that its seq_len is
    ``seq_len``, its token width is ``token_width`` (``None``: 2 or 4 bytes, but not
    wider than ``out_dtype``: a wider token would be silently narrowed) and, when
    ``vocab_size`` is given, that every token is below it.

    Legend: ``n`` records, ``L = seq_len``.

    Returns:
      ``(packed, tokens)``: ``packed`` ``[n, 3, L]`` of ``out_dtype``: tokens (``pad_id`` on
      padding), 1-based segment ids, positions restarting at 0 per segment (both 0 on
      padding); ``tokens`` the number of non-padding tokens. With ``six=True``, ``packed``
      is instead the dict of the six int32 ``[n, L]`` trainer arrays (what
      ``loader.testing.derive_batch`` gives, built in the same pass; ``out_dtype`` is ignored), views
      of ``out`` (int32 ``[6, n, L]``, overwritten; allocated when ``None``) in
      ``BATCH_KEYS`` order (when ``None``, a 64-byte-aligned block that nothing else
      uses, from :class:`AlignedPool`). Reusing ``out`` spares the fresh pages (page faults) of
      megabytes of new arrays every step.

    When ``stamps`` is given, ``time.perf_counter()`` is appended to it once every record
    is decoded and checked (tokens copied, segment lengths read), before the rows' ids,
    positions and targets are built: the boundary of the "decode" and "rows" stages of
    ``DataLoader.metrics()["wait_stages_s"]``.

    Raises:
      DatasetError: a record fails a check; ``where[i]`` (or "record i") names it.
      ValueError: ``out`` is not int32 ``[6, n, L]``.
    """
    n, L = len(records), int(seq_len)
    out_dtype = np.dtype(np.int32 if six else out_dtype)
    if six:
        if out is None:  # aligned: XLA's CPU devices then alias it instead of copying
            out = _POOL.take((6, n, L), np.int32)
        elif out.shape != (6, n, L) or out.dtype != np.int32:
            raise ValueError(f"out must be int32 [6, {n}, {L}], got {out.dtype} {list(out.shape)}")
        if n == 0:
            return dict(zip(BATCH_KEYS, out)), 0
        tok = out[0]
    else:
        packed = np.zeros((n, 3, L), out_dtype)
        tok = packed[:, 0]
        if n == 0:
            return packed, 0
    # token_width None: each record's own width (2 or 4), as long as out_dtype holds it
    widths = (token_width,) if token_width else tuple(w for w in (2, 4) if w <= max(out_dtype.itemsize, 2))
    rows = _parse(records, L, widths, where)
    _copy_tokens(records, tok, rows.T, rows.W, _HEADER.size, pad_id, pad_rows=six or bool(pad_id))
    if vocab_size is not None:
        _check_vocab(tok, rows.T, vocab_size, where)
    if stamps is not None:
        stamps.append(time.perf_counter())
    if not six:
        seg, pos = _ids_and_positions(rows, n, L)
        packed[:, 1] = seg
        packed[:, 2] = pos
        return packed, int(rows.T.sum())
    _ids_and_positions(rows, n, L, out[2], out[4])
    # The targets keys (loader.testing.derive_batch): slot j has a target when slot j + 1 holds a token of
    # the same segment, i.e. unless j is the last slot of a segment or padding. Ids and
    # positions are already 0 on padding; so are the shifted tokens when pad_id is 0.
    ends_row, ends = rows.row, rows.starts + rows.lengths - 1  # last slot of every segment
    targets = out[1]
    targets[:, :-1] = tok[:, 1:]
    targets[:, -1] = 0
    if pad_id:
        targets[_columns(n, L) >= rows.T[:, None]] = 0
    targets[ends_row, ends] = 0
    for ids, kept in ((out[2], out[3]), (out[4], out[5])):
        np.copyto(kept, ids)
        kept[ends_row, ends] = 0
    return dict(zip(BATCH_KEYS, out)), int(rows.T.sum())


def _parse(records: Sequence[bytes], L: int, widths: tuple[int, ...], where) -> _Rows:
    """Headers and segment tables of every record, checked (:func:`pack_records`), as arrays.

    Two joins of byte slices, one of the 20-byte headers and one of the ``M x S`` u32 words
    after each row's tokens (segment lengths, chunk indices, key lengths, and id lengths in
    version 2); everything else over the whole step at once. Raises DatasetError through
    :func:`_explain` for the first record that fails a check.
    """
    n, hsize = len(records), _HEADER.size
    # All headers at once (a record shorter than a header makes the joined size wrong).
    heads = b"".join([rec[:hsize] for rec in records])
    if len(heads) != hsize * n:
        _explain(records, next(i for i, r in enumerate(records) if len(r) < hsize), L, widths, where)
    words = np.frombuffer(heads, "<u4").reshape(n, 5).astype(np.int64)
    T, S = words[:, 3], words[:, 4]
    version, W = words[:, 1] & 0xFF, (words[:, 1] >> 8) & 0xFF
    M = _SEGMENT_WORDS[version]  # u32 words per segment after the tokens; 0: unknown version
    size = np.fromiter(map(len, records), np.int64, n)
    meta_at = hsize + T * W
    meta_end = meta_at + 4 * M * S
    bad = ((words[:, 0] != _MAGIC_WORD) | (M == 0) | (words[:, 2] != L) | (W != widths[0]) & (W != widths[-1])
           | (T > L) | (size < meta_end))
    if bad.any():
        _explain(records, int(np.argmax(bad)), L, widths, where)
    # lengths, chunk indices, key lengths (and id lengths, v2): M x S u32 of every row, back to back
    meta = np.frombuffer(b"".join([rec[a:b] for rec, a, b in zip(records, meta_at.tolist(), meta_end.tolist())]),
                         "<u4")
    row = np.repeat(np.arange(n), S)
    first = np.cumsum(S) - S  # first segment of each row (of the step's segments)
    rank = np.arange(row.size) - first[row]  # segment index within its row
    base = (np.cumsum(M * S) - M * S)[row] + rank  # word of its length
    lengths = meta[base].astype(np.int64)
    Sr = S[row]
    strings = meta[base + 2 * Sr].astype(np.int64)  # key lengths
    if M.max() == 4:
        v2 = np.flatnonzero(M[row] == 4)
        strings[v2] += meta[base[v2] + 3 * Sr[v2]]  # id lengths
    # per-row sums as differences of running sums at the rows' first segments
    at = np.concatenate([first, [row.size]])
    run = np.concatenate([[0], np.cumsum(lengths)])
    text = np.concatenate([[0], np.cumsum(strings)])
    bad = (run[at[1:]] - run[at[:-1]] != T) | (meta_end + text[at[1:]] - text[at[:-1]] != size)
    if row.size and lengths.min() == 0:
        bad[row[lengths == 0]] = True
    if bad.any():
        _explain(records, int(np.argmax(bad)), L, widths, where)
    return _Rows(T, S, W, row, rank, lengths, run[:-1] - run[first][row])


def _check_vocab(tok: np.ndarray, T: np.ndarray, vocab_size: int, where) -> None:
    """Raises DatasetError naming the first row of ``tok`` ``[n, L]`` with a token (of its first
    ``T`` slots) >= ``vocab_size``, compared unsigned: a 4-byte token >= 2**31 is negative in
    int32 and would slip below it."""
    utok = tok.view(np.uint32) if tok.dtype == np.int32 else tok
    if int(utok.max()) >= vocab_size:
        over = (utok >= vocab_size) & (_columns(*tok.shape) < T[:, None])
        if over.any():
            i = int(np.argmax(over.any(axis=1)))
            raise DatasetError(f"{_name(where, i)}: token {int(utok[i][over[i]].max())} >= vocab_size {vocab_size}")


def _ids_and_positions(rows: _Rows, n: int, L: int, seg: np.ndarray | None = None,
                       pos: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions, int32 ``[n, L]``, written into ``seg`` and ``pos`` (allocated
    when ``None``) run by run: each row is its segments, then its padding (possibly empty)::

        lengths 3, 2 in L = 7:   runs     [a a a][b b][. .]
        ids        np.repeat([1, 2, 0], [3, 2, 2])         -> 1 1 1 2 2 0 0
        positions  column - np.repeat([0, 3, 7], [3, 2, 2]) -> 0 1 2 0 1 -2 -1
                   then 0 where np.repeat([F, F, T], ...)  -> 0 1 2 0 1 0 0

    One ``np.repeat`` per array over the step's runs (no running sum, no loop over rows).
    """
    seg = np.empty((n, L), np.int32) if seg is None else seg
    pos = np.empty((n, L), np.int32) if pos is None else pos
    k = rows.row.size
    at_seg = np.arange(k) + rows.row  # run of each segment: one padding run per earlier row
    at_pad = np.cumsum(rows.S) + np.arange(n)  # padding run of each row
    run_len = np.empty(k + n, np.int64)
    run_len[at_seg] = rows.lengths
    run_len[at_pad] = L - rows.T
    ids = np.zeros(k + n, np.int32)
    ids[at_seg] = rows.rank + 1
    begin = np.full(k + n, L, np.int32)
    begin[at_seg] = rows.starts
    padding = np.zeros(k + n, bool)
    padding[at_pad] = True
    seg[...] = np.repeat(ids, run_len).reshape(n, L)
    np.subtract(_columns(n, L), np.repeat(begin, run_len).reshape(n, L), out=pos)
    np.copyto(pos, 0, where=np.repeat(padding, run_len).reshape(n, L))
    return seg, pos


_COLUMNS: dict[tuple[int, int], np.ndarray] = {}


def _columns(n: int, L: int) -> np.ndarray:
    """The column index of every slot, int32 ``[n, L]`` (``np.arange(L)`` in every row),
    read-only, kept per shape (a subtraction of same-shape arrays is twice as fast as a
    broadcast one)."""
    hit = _COLUMNS.get((n, L))
    if hit is None:
        hit = np.tile(np.arange(L, dtype=np.int32), (n, 1))
        hit.flags.writeable = False
        if len(_COLUMNS) > 8:
            _COLUMNS.clear()
        _COLUMNS[(n, L)] = hit
    return hit


def aligned_empty(shape: Sequence[int], dtype: np.dtype | str = np.int32, align: int = 64) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``align``-byte boundary.

    XLA's CPU client aliases (does not copy) a host buffer handed to ``device_put`` when
    it is aligned to 64 bytes; numpy only guarantees 16. So on CPU devices, a batch built
    in such a block reaches the devices without a copy (measured in
    ``benchmarks/load.py``). Device slices of whole rows stay aligned when a row's bytes
    are a multiple of ``align``.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return _aligned_view(np.empty(nbytes + align, np.uint8), shape, dtype, nbytes, align)


def _aligned_view(raw: np.ndarray, shape, dtype: np.dtype, nbytes: int, align: int = 64) -> np.ndarray:
    start = (-raw.__array_interface__["data"][0]) % align
    return raw[start: start + nbytes].view(dtype).reshape(tuple(shape))


class AlignedPool:
    """Aligned blocks (:func:`aligned_empty`) handed out again once nothing uses them.

    A batch built in a fresh block every step costs its pages anew (page faults and the
    kernel's zeroing of megabytes a step), and a block may not simply be
    overwritten, because the CPU devices alias it while any array of that batch lives. A
    block is reused only when the pool holds the sole reference to it: every numpy view of
    it (and so every device buffer aliasing it, which keeps its view alive) is gone.
    Thread-safe; at most ``keep`` idle blocks are kept.
    """

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: np.dtype | str = np.int32, align: int = 64) -> np.ndarray:
        """An uninitialized aligned array of ``shape``/``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        need = nbytes + align
        with self._lock:
            blocks, chosen = self._blocks, None
            # idle: only the pool's list and getrefcount's argument refer to the block
            idle = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) <= 2]
            for i in idle:
                if blocks[i].nbytes == need:
                    chosen = blocks[i]
                    break
            spare = [i for i in idle if blocks[i] is not chosen]
            for i in reversed(spare[: max(0, len(spare) - self.keep + (chosen is None))]):
                del blocks[i]  # the oldest idle blocks beyond keep
            if chosen is None:
                chosen = np.empty(need, np.uint8)
                blocks.append(chosen)
            return _aligned_view(chosen, shape, dtype, nbytes, align)


_POOL = AlignedPool()


_PAD_BYTES: dict = {}


def _copy_tokens(records, tok: np.ndarray, T: np.ndarray, W: np.ndarray, hsize: int, pad_id: int,
                 pad_rows: bool) -> None:
    """Writes each record's tokens into its row of ``tok`` ``[n, L]`` (and ``pad_id`` after
    them when ``pad_rows``; else the padding slots are left as they are).

    When every record has the same token width and ``pad_id`` fits it, the rows' token
    bytes and padding are joined into one buffer and converted in a single copy; otherwise
    row by row.
    """
    n, L = tok.shape
    Tl = T.tolist()
    w = int(W[0]) if n else 2
    if n and (W == w).all() and 0 <= pad_id < 1 << (8 * w):  # (writing the padding is harmless)
        pad = _PAD_BYTES.get((pad_id, w, L))
        if pad is None:
            pad = _PAD_BYTES[(pad_id, w, L)] = memoryview(pad_id.to_bytes(w, "little") * L)
        parts = []
        for rec, t in zip(records, Tl):
            parts.append(memoryview(rec)[hsize: hsize + w * t])
            parts.append(pad[: w * (L - t)])
        np.copyto(tok, np.frombuffer(b"".join(parts), {2: "<u2", 4: "<u4"}[w]).reshape(n, L), casting="unsafe")
        return
    tdt = {2: "<u2", 4: "<u4"}
    for i, (rec, t, wi) in enumerate(zip(records, Tl, W.tolist())):
        tok[i, :t] = np.frombuffer(rec, tdt[wi], t, hsize)
        if pad_rows and t < L:
            tok[i, t:] = pad_id


def _name(where, i: int) -> str:
    return where.get(i, f"record {i}") if where else f"record {i}"


def _explain(records, i: int, seq_len: int, widths: tuple[int, ...], where) -> None:
    """Raises the DatasetError for record ``i``, which a fast check of :func:`pack_records` failed."""
    name = _name(where, i)
    try:
        row = codec.decode_row(records[i])
    except codec.RecordError as e:
        raise DatasetError(f"{name}: {e}") from None
    if row.seq_len != seq_len:
        raise DatasetError(f"{name}: record has seq_len {row.seq_len}, the dataset's is {seq_len}")
    width = row.tokens.dtype.itemsize
    if width not in widths:
        raise DatasetError(f"{name}: record has {width}-byte tokens, expected {' or '.join(map(str, widths))} "
                           "(the dataset's token_dtype)")
    raise DatasetError(f"{name}: record does not decode")  # pragma: no cover - the checks above agree
