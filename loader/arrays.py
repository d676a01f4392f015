"""Record bytes -> host arrays: the one implementation the loader runs (numpy, no JAX, no I/O).

:func:`pack_records` parses a step's encoded rows (``contract.codec``, format versions 1 and 2)
straight from their bytes into tokens, segment ids and positions, and, for a loader that
derives the targets on the host, all six trainer arrays (:data:`BATCH_KEYS`) in the same
pass, in one 64-byte-aligned block from :class:`AlignedPool`. It checks every record as it
goes; a record that fails a check is explained (:func:`_explain`) by decoding it with
``contract.codec``.

Two more functions, each for one case: :func:`derive_packed` makes the six arrays of the
narrower tokens, ids and positions that Grain worker processes send (a quarter of the
bytes through shared memory), and :func:`decode_all` turns records into
``contract.codec.PackedRow`` objects (tokens and document keys) for inspection.

The slower per-row reference forms the tests compare against (``pack_inputs``,
``derive_batch``, ``dense_batch``) live in ``loader.testing``.

May import: ``loader.shards`` (for ``DatasetError``) and ``contract``.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence

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


# The record header of contract.codec (format versions 1 and 2), parsed here without building
# PackedRow objects: the loader's hot path only needs tokens and segment lengths.
_HEADER = struct.Struct("<4sBBHIII")
assert _HEADER.size == codec._HEADER.size  # noqa: SLF001 - same layout as the codec


_HEADER_DTYPE = np.dtype([("magic", "S4"), ("version", "u1"), ("width", "u1"), ("reserved", "<u2"),
                          ("seq_len", "<u4"), ("tokens", "<u4"), ("segments", "<u4")])
assert _HEADER_DTYPE.itemsize == _HEADER.size


def pack_records(
    records: Sequence[bytes], seq_len: int, token_width: int, pad_id: int = 0,
    out_dtype: np.dtype | str = np.int32, vocab_size: int | None = None,
    where: Mapping[int, str] | None = None, six: bool = False, out: np.ndarray | None = None,
    stamps: list[float] | None = None,
) -> tuple[np.ndarray | dict[str, np.ndarray], int]:
    """Tokens, segment ids and positions of encoded rows, straight from the record bytes.

    The loader's per-step path: the same values as the per-row reference
    ``loader.testing.pack_inputs(decode_all(records), ...)`` without building :class:`contract.codec.PackedRow` objects (one header unpack and two
    ``np.frombuffer`` per row; everything else over the whole step at once).

    Checks every record as ``contract.codec.decode_row`` does (magic, version, width,
    ``T <= seq_len``, lengths partition the tokens, no truncation or trailing bytes; the
    document keys' bytes are counted, not decoded), and also that its seq_len is
    ``seq_len``, its token width is ``token_width`` (``None``: 2 or 4 bytes, but not
    wider than ``out_dtype``: a wider token would be silently narrowed) and, when ``vocab_size`` is given, that every token is below it.

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
    hsize = _HEADER.size
    # All headers at once (a record shorter than a header makes the joined size wrong).
    heads = b"".join([rec[:hsize] for rec in records])
    if len(heads) != hsize * n:
        _explain(records, next(i for i, r in enumerate(records) if len(r) < hsize), L, widths, where)
    hdr = np.frombuffer(heads, _HEADER_DTYPE)
    T = hdr["tokens"].astype(np.int64)
    S = hdr["segments"].astype(np.int64)
    W = hdr["width"].astype(np.int64)
    size = np.fromiter(map(len, records), np.int64, n)
    meta_at = hsize + T * W
    version = hdr["version"].astype(np.int64)
    M = np.where(version == 1, 3, 4)  # u32 words per segment after the tokens (v2 adds id lengths)
    bad = ((hdr["magic"] != codec.MAGIC) | ~np.isin(version, codec.READABLE_VERSIONS) | (hdr["seq_len"] != L)
           | (W != widths[0]) & (W != widths[-1]) | (T > L) | (size < meta_at + 4 * M * S))
    if bad.any():
        _explain(records, int(np.argmax(bad)), L, widths, where)
    _copy_tokens(records, tok, T, W, hsize, pad_id, pad_rows=six or bool(pad_id))
    # lengths, chunk indices, key lengths (and id lengths, v2): M x S u32 of every row, back to back
    meta = [rec[a: a + 4 * m * sg] for rec, a, m, sg in zip(records, meta_at.tolist(), M.tolist(), S.tolist())]
    # Segment lengths and key and id lengths of every segment of the step, row after row.
    allmeta = np.frombuffer(b"".join(meta), "<u4").astype(np.int64)
    n_seg = int(S.sum())
    seg_first = np.cumsum(S) - S  # first segment of each row
    row = np.repeat(np.arange(n), S)
    rank = np.arange(n_seg) - seg_first[row]  # segment index within its row
    base = (np.cumsum(M * S) - M * S)[row] + rank
    lengths = allmeta[base]
    keylens = allmeta[base + 2 * S[row]]
    strings = np.bincount(row, keylens, minlength=n)
    v2 = M[row] == 4
    if v2.any():
        strings += np.bincount(row[v2], allmeta[base[v2] + 3 * S[row[v2]]], minlength=n)
    bad = (np.bincount(row, lengths, minlength=n) != T) | (meta_at + 4 * M * S + strings != size)
    if n_seg and lengths.min() == 0:
        bad[row[lengths == 0]] = True
    if bad.any():
        _explain(records, int(np.argmax(bad)), L, widths, where)
    # compared unsigned: a 4-byte token >= 2**31 is negative in int32 and would slip below vocab_size
    utok = tok.view(np.uint32) if tok.dtype == np.int32 else tok
    if vocab_size is not None and int(utok.max()) >= vocab_size:
        over = (utok >= vocab_size) & (np.arange(L) < T[:, None])
        if over.any():
            i = int(np.argmax(over.any(axis=1)))
            raise DatasetError(f"{_name(where, i)}: token {int(utok[i][over[i]].max())} >= vocab_size {vocab_size}")
    if stamps is not None:
        stamps.append(time.perf_counter())
    # Segment ids and positions: one running sum of marks per row (int32, then narrowed).
    starts = np.cumsum(lengths) - lengths - np.repeat(np.cumsum(T) - T, S)  # start slot in its row
    seg = out[2] if six else np.empty((n, L), np.int32)
    pos = out[4] if six else np.empty((n, L), np.int32)
    marks = _scratch(n, L)  # reused per thread: no fresh pages every step
    later = np.flatnonzero(rank > 0)
    # ids: +1 at each segment start, -S at the first padding slot (column L when full)
    marks.fill(0)
    marks[row, starts] = 1
    marks[np.arange(n), T] -= S.astype(np.int32)
    np.cumsum(marks[:, :L], axis=1, dtype=np.int32, out=seg)
    # positions: +1 per token after the first, 1 - previous length at a later start; in
    # rows with padding, minus the last position at the first padding slot and 0 after it
    marks.fill(1)
    marks[:, 0] = 0
    short = np.flatnonzero(T < L)
    if short.size:
        for i, t in zip(short.tolist(), T[short].tolist()):  # a slice a row: 4-5x a mask's speed
            marks[i, t + 1:] = 0
        has = short[S[short] > 0]
        marks[has, T[has]] = 1 - lengths[np.cumsum(S)[has] - 1]
    marks[row[later], starts[later]] = 1 - lengths[later - 1]
    np.cumsum(marks[:, :L], axis=1, dtype=np.int32, out=pos)
    if not six:
        packed[:, 1] = seg
        packed[:, 2] = pos
        return packed, int(T.sum())
    # The targets keys (loader.testing.derive_batch): slot j has a target when slot j + 1 holds a token of
    # the same segment, i.e. unless j is the last slot of a segment or padding. Ids and
    # positions are already 0 on padding; so are the shifted tokens when pad_id is 0.
    ends_row, ends = row, starts + lengths - 1  # last slot of every segment
    targets = out[1]
    targets[:, :-1] = tok[:, 1:]
    targets[:, -1] = 0
    if pad_id:
        targets[np.arange(L) >= T[:, None]] = 0
    targets[ends_row, ends] = 0
    out[3] = seg
    out[3][ends_row, ends] = 0
    out[5] = pos
    out[5][ends_row, ends] = 0
    return dict(zip(BATCH_KEYS, out)), int(T.sum())


def aligned_empty(shape: Sequence[int], dtype: np.dtype | str = np.int32, align: int = 64) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``align``-byte boundary.

    XLA's CPU client aliases (does not copy) a host buffer handed to ``device_put`` when
    it is aligned to 64 bytes; numpy only guarantees 16. So on CPU devices, a batch built
    in such a block reaches the devices without a copy (measured in
    ``benchmarks/load.py``). Device slices of whole rows stay aligned when a row's bytes
    are a multiple of ``align``.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return _aligned_view(np.empty(nbytes + align, np.uint8), shape, dtype, align)


def _aligned_view(raw: np.ndarray, shape, dtype: np.dtype, align: int = 64) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    start = (-raw.ctypes.data) % align
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
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + align
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
            return _aligned_view(chosen, shape, dtype, align)


_POOL = AlignedPool()


_SCRATCH = threading.local()


def _scratch(n: int, L: int) -> np.ndarray:
    """Per-thread work array of :func:`pack_records`: int32 ``[n, L + 1]`` marks (contents undefined)."""
    have = getattr(_SCRATCH, "marks", None)
    if have is None or have.shape != (n, L + 1):
        have = _SCRATCH.marks = np.empty((n, L + 1), np.int32)
    return have


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
