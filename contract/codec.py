"""The packed-row record codec: one ArrayRecord record is one packed row.

Written by ``dataprep`` and read by ``loader`` and ``replay``; this module is the only
place that knows the byte layout (docs/design.md, "The dataset contract"). It imports neither
Beam nor JAX.

Layout of format version 2 (all integers little-endian)::

    offset  size            field
    0       4               magic b"MOEP"
    4       1               format version (1 or 2)
    5       1               token width in bytes: 2 (uint16) or 4 (uint32)
    6       2               reserved, 0
    8       4               seq_len (u32)
    12      4               T = number of tokens stored (u32), T <= seq_len
    16      4               S = number of segments (u32)
    20      T * width       tokens, segment after segment; padding is not stored
    ...     S * 4           segment lengths (u32), sum == T
    ...     S * 4           chunk index of each segment (u32): 0 unless the document was split
    ...     S * 4           byte length of each document key (u32)
    ...     S * 4           byte length of each document id (u32; 0: no id)    version 2 only
    ...     sum(key bytes)  document keys, UTF-8, concatenated
    ...     sum(id bytes)   document ids, UTF-8, concatenated                  version 2 only

Versions: a row whose documents carry an id (the source's ``id_field``, e.g. a URL) is
written as version 2; a row without any id as version 1, byte for byte what the writers
before ids wrote. Readers read both (:data:`READABLE_VERSIONS`), so datasets written before
ids existed still read; a version-1 row's documents have no id (``""``).

A row of ``seq_len`` slots holds its segments first and padding after::

    slot:        0 1 2 3 4 5 6 7 8 9
    tokens:      a a a a b b b . . .      (T = 7, seq_len = 10)
    segment_ids: 1 1 1 1 2 2 2 0 0 0      (1-based, 0 = padding)
    positions:   0 1 2 3 0 1 2 0 0 0      (restart at 0 per segment)

Segment ids and positions are derived on read by :func:`segment_ids_and_positions`.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

import numpy as np

FORMAT_VERSION = 2  # the newest version written (a row without ids is still written as version 1)
READABLE_VERSIONS = (1, 2)
MAGIC = b"MOEP"
_HEADER = struct.Struct("<4sBBHIII")
_WIDTH_TO_DTYPE = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


class RecordError(ValueError):
    """A record's bytes do not decode as a packed row (truncated, wrong magic or version)."""


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Returns uint16 when every id of a ``vocab_size`` vocabulary fits, else uint32.

    Raises:
      ValueError: ``vocab_size`` is not in ``[1, 2**32]``.
    """
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclasses.dataclass(frozen=True)
class PackedRow:
    """One packed row as stored.

    Attributes:
      tokens: uint16 or uint32 ``[T]``, the segments' tokens back to back (no padding).
      segment_lengths: int64 ``[S]``, tokens per segment, each >= 1, summing to ``T``.
      doc_keys: ``S`` stable document keys (see ``contract.hashing.document_key``).
      chunk_indices: int64 ``[S]``, which ``seq_len`` chunk of its document each segment
        is (0 for a document that was not split); the segment starts at token
        ``chunk_index * seq_len`` of the document's token stream.
      seq_len: slots in the row; ``T <= seq_len``.
      doc_ids: ``S`` document ids as the input gave them (the source's ``id_field``), ``""``
        where a document has none (and for every segment of a version-1 row); ``()`` is
        taken as ``S`` empty ids.
    """

    tokens: np.ndarray
    segment_lengths: np.ndarray
    doc_keys: tuple[str, ...]
    chunk_indices: np.ndarray
    seq_len: int
    doc_ids: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.doc_ids and self.doc_keys:
            object.__setattr__(self, "doc_ids", ("",) * len(self.doc_keys))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_segments(self) -> int:
        return len(self.doc_keys)

    @property
    def padding(self) -> int:
        return self.seq_len - self.num_tokens

    def segments(self) -> list[np.ndarray]:
        """Returns the tokens of each segment, in order (views into ``tokens``)."""
        bounds = np.cumsum(self.segment_lengths)[:-1]
        return np.split(self.tokens, bounds) if self.num_segments else []


def encode_row(
    tokens_per_segment: Sequence[Sequence[int] | np.ndarray],
    doc_keys: Sequence[str],
    chunk_indices: Sequence[int],
    seq_len: int,
    token_dtype: np.dtype | str,
    doc_ids: Sequence[str] | None = None,
) -> bytes:
    """Encodes one packed row.

    Args:
      tokens_per_segment: ``S`` token sequences, each non-empty, total length <= seq_len.
      doc_keys: ``S`` document keys.
      chunk_indices: ``S`` non-negative chunk indices.
      seq_len: slots in the row, >= 1.
      token_dtype: ``uint16`` or ``uint32``; every token must fit.
      doc_ids: ``S`` document ids (``""``: none), or None. A row with at least one id is
        written as format version 2, else as version 1.

    Returns:
      The record bytes (layout in the module docstring).

    Raises:
      ValueError: lengths disagree, a segment is empty, the row overflows seq_len, a token
        does not fit the dtype, or the dtype is not uint16/uint32.
    """
    dtype = _stored_dtype(token_dtype)
    n_seg = len(tokens_per_segment)
    if not (n_seg == len(doc_keys) == len(chunk_indices)) or (doc_ids is not None and len(doc_ids) != n_seg):
        raise ValueError(
            f"segments ({n_seg}), doc_keys ({len(doc_keys)}), chunk_indices ({len(chunk_indices)})"
            + (f" and doc_ids ({len(doc_ids)})" if doc_ids is not None else "") + " must have the same length"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    # The per-segment fields are a few u32s a row: struct packs them in a call where NumPy took
    # several (a row costs about 5 us instead of 13 on the benchmark's 3-segment rows).
    lengths = [len(s) for s in tokens_per_segment]
    if n_seg and min(lengths) == 0:
        raise ValueError("every segment must hold at least one token")
    total = sum(lengths)
    if total > seq_len:
        raise ValueError(f"row holds {total} tokens, more than seq_len={seq_len}")
    if n_seg and all(isinstance(s, np.ndarray) and s.dtype == dtype and s.flags.c_contiguous
                     for s in tokens_per_segment):
        token_bytes = b"".join(tokens_per_segment)  # already the stored dtype: every id fits; one copy
    else:
        if n_seg:
            flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in tokens_per_segment])
        else:
            flat = np.zeros((0,), np.int64)
        if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(dtype).max):
            raise ValueError(
                f"token ids must be in [0, {np.iinfo(dtype).max}] for {dtype.name}, "
                f"got min {flat.min()} max {flat.max()}"
            )
        token_bytes = flat.astype(dtype).tobytes()
    chunks = [int(c) for c in chunk_indices]
    if chunks and min(chunks) < 0:
        raise ValueError(f"chunk indices must be >= 0, got {min(chunks)}")
    keys = [k.encode("utf-8", "surrogatepass") for k in doc_keys]
    ids = [i.encode("utf-8", "surrogatepass") for i in doc_ids] if doc_ids is not None and any(doc_ids) else None
    words = lengths + [c & 0xFFFFFFFF for c in chunks] + [len(k) for k in keys]  # u32: a chunk index wraps
    if ids is not None:
        words += [len(i) for i in ids]
    parts = [
        _HEADER.pack(MAGIC, 1 if ids is None else 2, dtype.itemsize, 0, seq_len, total, n_seg),
        token_bytes,
        struct.pack(f"<{len(words)}I", *words),
        b"".join(keys),
    ]
    if ids is not None:
        parts.append(b"".join(ids))
    return b"".join(parts)


_STORED_DTYPES: dict = {}


def _stored_dtype(token_dtype: np.dtype | str) -> np.dtype:
    """``token_dtype`` as stored (little-endian uint16 or uint32), cached by the argument.

    Raises:
      ValueError: not uint16 or uint32.
    """
    try:
        return _STORED_DTYPES[token_dtype]
    except (KeyError, TypeError):
        pass
    dtype = np.dtype(token_dtype).newbyteorder("<")
    if dtype.itemsize not in _WIDTH_TO_DTYPE or dtype.kind != "u":
        raise ValueError(f"token_dtype must be uint16 or uint32, got {token_dtype}")
    try:
        _STORED_DTYPES[token_dtype] = dtype
    except TypeError:  # not hashable
        pass
    return dtype


def decode_row(data: bytes) -> PackedRow:
    """Decodes one record produced by :func:`encode_row`.

    Returns:
      The :class:`PackedRow`; ``tokens`` keeps the stored dtype (uint16 or uint32).

    Raises:
      RecordError: the bytes are truncated, have trailing garbage, the wrong magic, an
        unknown format version or token width, or inconsistent lengths.
    """
    if len(data) < _HEADER.size:
        raise RecordError(f"record of {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, width, _, seq_len, total, n_seg = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RecordError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version not in READABLE_VERSIONS:
        raise RecordError(f"record format version {version}, this reader knows {list(READABLE_VERSIONS)}")
    if width not in _WIDTH_TO_DTYPE:
        raise RecordError(f"token width {width} bytes, expected 2 or 4")
    if total > seq_len:
        raise RecordError(f"record holds {total} tokens, more than its seq_len {seq_len}")
    off = _HEADER.size
    words = 3 if version == 1 else 4  # u32 words per segment after the tokens
    fixed = total * width + words * 4 * n_seg
    if len(data) < off + fixed:
        raise RecordError(f"record truncated: {len(data)} bytes, header promises at least {off + fixed}")
    tokens = np.frombuffer(data, _WIDTH_TO_DTYPE[width], total, off)
    off += total * width
    lengths = np.frombuffer(data, "<u4", n_seg, off).astype(np.int64)
    off += 4 * n_seg
    chunks = np.frombuffer(data, "<u4", n_seg, off).astype(np.int64)
    off += 4 * n_seg
    key_lengths = np.frombuffer(data, "<u4", n_seg, off).astype(np.int64)
    off += 4 * n_seg
    id_lengths = np.zeros(n_seg, np.int64)
    if version >= 2:
        id_lengths = np.frombuffer(data, "<u4", n_seg, off).astype(np.int64)
        off += 4 * n_seg
    if int(lengths.sum()) != total or (n_seg and lengths.min() == 0):
        raise RecordError(f"segment lengths {lengths.tolist()} do not partition {total} tokens")
    if len(data) != off + int(key_lengths.sum()) + int(id_lengths.sum()):
        raise RecordError(
            f"record is {len(data)} bytes, layout says {off + int(key_lengths.sum()) + int(id_lengths.sum())}"
        )

    def strings(sizes: np.ndarray) -> tuple[str, ...]:
        nonlocal off
        out = []
        for n in sizes.tolist():
            out.append(data[off : off + n].decode("utf-8", "surrogatepass"))
            off += n
        return tuple(out)

    keys = strings(key_lengths)
    ids = strings(id_lengths)
    return PackedRow(tokens, lengths, keys, chunks, seq_len, ids)


def segment_ids_and_positions(segment_lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Derives segment ids and positions of a row from its segment lengths.

    Args:
      segment_lengths: int ``[S]``, each >= 1, summing to at most ``seq_len``.
      seq_len: slots in the row.

    Returns:
      ``(segment_ids, positions)``, each int32 ``[seq_len]``: segment ids are 1-based with 0
      for padding; positions restart at 0 in each segment and are 0 on padding.

    Raises:
      ValueError: the lengths overflow ``seq_len``.
    """
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total > seq_len:
        raise ValueError(f"segment lengths sum to {total} > seq_len {seq_len}")
    segment_ids = np.zeros((seq_len,), np.int32)
    positions = np.zeros((seq_len,), np.int32)
    if lengths.size:
        segment_ids[:total] = np.repeat(np.arange(1, lengths.size + 1, dtype=np.int32), lengths)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions[:total] = np.arange(total, dtype=np.int64) - starts
    return segment_ids, positions


def dense_row(row: PackedRow, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns ``(tokens, segment_ids, positions)`` of ``row``, each int32 ``[seq_len]``.

    Padding slots hold ``pad_id`` with segment id 0 and position 0.
    """
    tokens = np.full((row.seq_len,), pad_id, np.int32)
    tokens[: row.num_tokens] = row.tokens
    seg, pos = segment_ids_and_positions(row.segment_lengths, row.seq_len)
    return tokens, seg, pos
