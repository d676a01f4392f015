"""Packing documents into fixed-length rows: chunking, bucketing and best-fit-decreasing.

Pure functions, no Beam and no I/O, so that they can be tested exhaustively (see
``tests/test_dataprep_packing.py``). The Beam pipeline (``dataprep.pipeline``) calls them.

Glossary:
  seq_len   slots per packed row.
  chunk     a piece of one document's token stream of at most ``seq_len`` tokens; chunk
            ``c`` starts at token ``c * seq_len`` of the document.
  segment   one chunk placed in a row.
  bucket    the output shard a document goes to: ``stable_hash64(seed, "bucket", key) %
            num_shards``; all chunks of a document share a bucket.
  fill      tokens / (rows * seq_len), the non-padding fraction of all row slots.

Worked example, ``seq_len = 8``, ``max_segments = 3``, documents (already tokenized,
EOS included) ``A`` of 9 tokens, ``B`` of 5, ``C`` of 3, ``D`` of 2, ``E`` of 1::

    1. chunk:  A -> A#0 (8 tokens) + A#1 (1 token); B, C, D, E are one chunk each.
    2. sort by (length desc, key, chunk):  A#0:8  B:5  C:3  D:2  A#1:1  E:1
    3. best fit: put each chunk in the open row whose remaining room is the smallest
       that still fits it (ties: the oldest row); open a new row when none fits.

       A#0:8 -> row 0  |A A A A A A A A|   room 0 (closed)
       B:5   -> row 1  |B B B B B . . .|   room 3
       C:3   -> row 1  |B B B B B C C C|   room 0 (closed)
       D:2   -> row 2  |D D . . . . . .|   room 6
       A#1:1 -> row 2  |D D A . . . . .|   room 5
       E:1   -> row 2  |D D A E . . . .|   3 segments = max_segments (closed)

    rows: 3, tokens: 20, slots: 24, fill: 20/24; the final partial row is kept.

Best fit over a sorted list of (room, row) pairs found with ``bisect`` makes each
placement O(log R) search plus one list insertion (R = open rows).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Sequence

import numpy as np

from contract.hashing import stable_hash64


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk of a document's token stream.

    Attributes:
      key: the document's stable key.
      index: chunk index (0 for the first or only chunk).
      tokens: int ``[n]``, ``1 <= n <= seq_len``.
    """

    key: str
    index: int
    tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def split_into_chunks(key: str, tokens: np.ndarray, seq_len: int) -> list[Chunk]:
    """Splits one document's tokens into chunks of ``seq_len`` (the last may be shorter).

    A 9-token document at ``seq_len`` 8 gives chunks of 8 and 1; a 16-token document gives
    8 and 8; an 8-token document gives one chunk.

    Raises:
      ValueError: ``tokens`` is empty or ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = int(len(tokens))
    if n == 0:
        raise ValueError(f"document {key!r} has no tokens; reject it before packing")
    return [Chunk(key, c, tokens[start : start + seq_len]) for c, start in enumerate(range(0, n, seq_len))]


def bucket_of(seed: int, source: str, key: str, num_buckets: int) -> int:
    """Returns the bucket (output shard) of a document, in ``[0, num_buckets)``.

    ``stable_hash64(seed, "bucket", source, key) % num_buckets``: the same on every machine.

    Raises:
      ValueError: ``num_buckets < 1``.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    return stable_hash64(seed, "bucket", source, key) % num_buckets


class BucketOf:
    """``bucket_of(seed, source, key, num_buckets)`` for many keys of one source, faster.

    The hash of the fixed parts ``(seed, "bucket", source)`` is computed once and copied per
    key (``hashlib`` state copy), so each call hashes only the key; the value is exactly
    :func:`bucket_of`'s.

    Raises:
      ValueError: ``num_buckets < 1``.
    """

    def __init__(self, seed: int, source: str, num_buckets: int):
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        import hashlib

        from contract.hashing import _encode_part

        self._prefix = hashlib.blake2b(digest_size=8)
        for part in (seed, "bucket", source):
            self._prefix.update(_encode_part(part))
        self._n = num_buckets

    def __call__(self, key: str) -> int:
        h = self._prefix.copy()
        body = key.encode("utf-8", "surrogatepass")
        h.update(b"s" + len(body).to_bytes(8, "little") + body)
        return int.from_bytes(h.digest(), "little") % self._n


def sort_for_packing(chunks: Iterable[Chunk]) -> list[Chunk]:
    """Returns the chunks sorted by (length desc, key, chunk index): a total, stable order."""
    return sorted(chunks, key=lambda c: (-len(c), c.key, c.index))


def chunk_columns(
    keys: Sequence[str], num_tokens: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every chunk of a bucket's documents as columns, in :func:`sort_for_packing`'s order.

    What :func:`split_into_chunks` then :func:`sort_for_packing` give, without a Python
    object a chunk (the packing step of a bucket of short documents would hold several
    times their tokens in tuples).

    Args:
      keys: ``D`` distinct document keys.
      num_tokens: int ``[D]``, tokens of each document, each >= 1.
      seq_len: chunk length, >= 1.

    Returns:
      ``(document, chunk, start, length)``, int64 ``[C]`` each: for the ``C`` chunks in
      (length desc, key, chunk index) order, the document's index in ``keys``, the chunk
      index, its first token in the document (``chunk * seq_len``) and its length.

    Raises:
      ValueError: ``seq_len < 1``, a document has no token, or lengths disagree.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    num_tokens = np.asarray(num_tokens, np.int64)
    if num_tokens.shape != (len(keys),) or (num_tokens.size and num_tokens.min() < 1):
        raise ValueError(f"need one token count >= 1 for each of the {len(keys)} keys")
    per_doc = -(-num_tokens // seq_len)
    document = np.repeat(np.arange(len(keys), dtype=np.int64), per_doc)
    chunk = np.arange(len(document), dtype=np.int64) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
    start = chunk * seq_len
    length = np.minimum(seq_len, num_tokens[document] - start)
    rank = np.empty(len(keys), np.int64)  # keys ranked by Python's string order, as sorted() does
    rank[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys))
    order = np.lexsort((chunk, rank[document], -length))  # last key first
    return document[order], chunk[order], start[order], length[order]


def best_fit_decreasing(lengths: Sequence[int], seq_len: int, max_segments: int) -> list[list[int]]:
    """Assigns items to rows by best fit, in the order given (sort them decreasing first).

    Args:
      lengths: item lengths in tokens, each in ``[1, seq_len]``, in packing order.
      seq_len: row capacity in tokens.
      max_segments: at most this many items per row, >= 1.

    Returns:
      Rows in the order they were opened, each the list of item indices it holds, in the
      order they were placed.

    Raises:
      ValueError: an item is empty or longer than ``seq_len``; ``max_segments < 1``.
    """
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[tuple[int, int]] = []  # sorted (remaining room, row index)
    bisect_left, insort, pop = bisect.bisect_left, bisect.insort, open_rows.pop  # hot loop: local names
    for i, n in enumerate(lengths):
        if not 1 <= n <= seq_len:
            raise ValueError(f"item {i} has length {n}, not in [1, {seq_len}]")
        j = bisect_left(open_rows, (n, -1))
        if j < len(open_rows):
            r = pop(j)[1]
            row = rows[r]
        else:
            r = len(rows)
            row = []
            rows.append(row)
            room.append(seq_len)
        row.append(i)
        left = room[r] = room[r] - n
        if left > 0 and len(row) < max_segments:
            insort(open_rows, (left, r))
    return rows


def pack_chunks(chunks: Iterable[Chunk], seq_len: int, max_segments: int) -> list[list[Chunk]]:
    """Sorts chunks by (length desc, key, chunk) and packs them by best fit.

    Returns:
      Rows (lists of chunks) in a deterministic order: the order they were opened.
    """
    ordered = sort_for_packing(chunks)
    rows = best_fit_decreasing([len(c) for c in ordered], seq_len, max_segments)
    return [[ordered[i] for i in row] for row in rows]


def fill(tokens: int, rows: int, seq_len: int) -> float:
    """Returns ``tokens / (rows * seq_len)``, or 0.0 when there are no rows."""
    return tokens / (rows * seq_len) if rows else 0.0
