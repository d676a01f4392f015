"""Packing documents into fixed-length rows: chunking, bucketing, and packing with two limits.

Pure functions, no Beam and no I/O, so that they can be tested exhaustively (see
``tests/test_dataprep_packing.py``). The Beam pipeline (``dataprep.pipeline``) calls them.

Glossary:
  seq_len   slots per packed row (the token limit of a row).
  cap       ``max_segments``: at most this many segments per row (the segment limit).
  chunk     a piece of one document's token stream of at most ``seq_len`` tokens; chunk
            ``c`` starts at token ``c * seq_len`` of the document. Only a document longer
            than ``seq_len`` has more than one chunk.
  item      a chunk to place; items are given in packing order (length desc, key, chunk).
  segment   one chunk placed in a row.
  bucket    the output shard a document goes to: ``stable_hash64(seed, "bucket", key) %
            num_shards``; all chunks of a document share a bucket.
  fill      tokens / (rows * seq_len), the non-padding fraction of all row slots.
  lower bound  ``max(ceil(tokens / seq_len), ceil(items / cap))`` rows: no packing has fewer.

Worked example of best fit decreasing, ``seq_len = 8``, ``max_segments = 3``, documents
(already tokenized, EOS included) ``A`` of 9 tokens, ``B`` of 5, ``C`` of 3, ``D`` of 2,
``E`` of 1::

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

When the cap binds. Best fit decreasing places the tiniest items last; once the gaps of
earlier rows are full, rows made only of them reach the cap half empty (a corpus of
paragraphs, median 34 tokens, packed at 94.5%). :func:`pack_rows` then also builds rows
that hold a share of the small items from the start, and keeps whichever packing has the
fewest rows. ``seq_len = 8``, ``max_segments = 4``, items ``A B`` of 4 tokens, ``C D`` of
2, ``E F G H`` of 1 (16 tokens: 2 rows at best)::

    best fit decreasing                       deal_first (the small items dealt first)
    row 0 |A A A A B B B B|  full             row 0 |H F D D A A A A|  4 segments, full
    row 1 |C C D D E F . .|  4 segments       row 1 |G E C C B B B B|  4 segments, full
    row 2 |G H . . . . . .|

(``t`` is 4 here: ``C``-``H`` are dealt, smallest first and the last in packing order
first, over the 2 rows of the lower bound; then ``A`` and ``B`` go by best fit.)

Small items are those below the threshold ``t`` of :func:`small_threshold`: the least
length such that rows holding an even share of the items below it can still be filled to
``seq_len`` by items of length ``t`` or more within the cap. Two ways of giving every row
its share are tried (:func:`deal_first`, :func:`reserve_then_deal`); each places the small
items smallest first, round robin over the rows, so that the 1-token items are spread
over all rows instead of left for the last ones.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Optional, Sequence

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


def chunk_lengths(num_tokens: Iterable[int], seq_len: int) -> list[int]:
    """Lengths of the chunks of documents of ``num_tokens`` tokens each, in decreasing order.

    The lengths :func:`chunk_columns` gives, without keys (for tests and benchmarks): a
    document of ``n`` tokens gives ``n // seq_len`` chunks of ``seq_len`` and one of
    ``n % seq_len`` when that is not 0.
    """
    out: list[int] = []
    for n in num_tokens:
        full, rest = divmod(int(n), seq_len)
        out += [seq_len] * full + ([rest] if rest else [])
    return sorted(out, reverse=True)


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


def best_fit_decreasing(lengths: Sequence[int], seq_len: int, max_segments: int,
                        items: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Assigns items to rows by best fit, in the order given (sort them decreasing first).

    Args:
      lengths: item lengths in tokens, each in ``[1, seq_len]``, in packing order.
      seq_len: row capacity in tokens.
      max_segments: at most this many items per row, >= 1.
      items: ``list(range(len(lengths)))`` to share between packings (its int objects are
        what the rows hold; :func:`pack_rows` passes one list to every packing it builds).

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
    for i, n in zip(items if items is not None else range(len(lengths)), lengths):
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


def _best_fit_into(
    lengths: Sequence[int], items: Iterable[int], rows: list[list[int]], room: list[int], slots: list[int],
    open_row,
) -> None:
    """Best fit of ``items`` (indices into ``lengths``, in that order) into ``rows``.

    ``room[r]`` and ``slots[r]`` are row ``r``'s free tokens and free segments; a row with
    either at 0 takes nothing more. ``open_row(length)`` opens a row for an item that fits
    nowhere and returns its index (it appends to ``rows``, ``room`` and ``slots``).
    """
    open_rows = sorted((room[r], r) for r in range(len(rows)) if room[r] > 0 and slots[r] > 0)
    bisect_left, insort, pop = bisect.bisect_left, bisect.insort, open_rows.pop  # hot loop: local names
    for i in items:
        n = lengths[i]
        j = bisect_left(open_rows, (n, -1))
        r = pop(j)[1] if j < len(open_rows) else open_row(n)
        rows[r].append(i)
        left = room[r] = room[r] - n
        free = slots[r] = slots[r] - 1
        if left > 0 and free > 0:
            insort(open_rows, (left, r))


def _deal(lengths: Sequence[int], items: Iterable[int], rows: list[list[int]], room: list[int], slots: list[int],
          order: Sequence[int]) -> list[int]:
    """Deals ``items`` (smallest first) round robin over the rows ``order``; returns those left over.

    A row leaves the round once it cannot take the current item (no free segment, or less
    room than the item): the items grow, so it could take no later one either. O(items + rows).
    """
    active = list(order)
    left: list[int] = []
    k = 0
    for i in items:
        n = lengths[i]
        while active:
            if k >= len(active):
                k = 0
            r = active[k]
            if room[r] >= n and slots[r] > 0:
                rows[r].append(i)
                room[r] -= n
                slots[r] -= 1
                if room[r] and slots[r]:
                    k += 1
                else:
                    active.pop(k)
                break
            active.pop(k)
        else:
            left.append(i)
    return left


def _first_below(lengths: Sequence[int], t: int) -> int:
    """The first index of the decreasing ``lengths`` whose length is below ``t`` (``len`` if none)."""
    lo, hi = 0, len(lengths)
    while lo < hi:
        mid = (lo + hi) // 2
        if lengths[mid] >= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


def lower_bound(num_tokens: int, num_items: int, seq_len: int, max_segments: int) -> int:
    """``max(ceil(num_tokens / seq_len), ceil(num_items / max_segments))``: no packing has fewer rows."""
    return max(-(-num_tokens // seq_len), -(-num_items // max_segments))


def small_threshold(lengths: Sequence[int], seq_len: int, max_segments: int, rows: int) -> int:
    """The least item length ``t`` that can fill rows holding a share of the items below it.

    With ``rows`` rows, each holding ``1/rows`` of the items shorter than ``t`` (``c`` of
    them, ``x`` tokens in all), a row made of items of length ``t`` reaches ``seq_len``
    within the cap when ``t * (max_segments * rows - c) >= seq_len * rows - x``. The scan
    goes up the distinct lengths, so it is O(items).

    Args:
      lengths: item lengths in packing order (decreasing).
      seq_len, max_segments: the row limits.
      rows: the row count the shares are taken over (:func:`lower_bound`), >= 1.

    Returns:
      ``t``, or ``max(lengths) + 1`` when no length qualifies (every item is small).
    """
    count = tokens = 0
    i = len(lengths) - 1
    while i >= 0:
        t = lengths[i]
        if t * (max_segments * rows - count) >= seq_len * rows - tokens:
            return t
        while i >= 0 and lengths[i] == t:
            count += 1
            tokens += t
            i -= 1
    return (lengths[0] + 1) if len(lengths) else 1


def deal_first(lengths: Sequence[int], seq_len: int, max_segments: int, t: int, rows: int,
               items: Optional[list[int]] = None) -> list[list[int]]:
    """Deals the items below ``t`` over ``rows`` new rows first, then best fit of the others.

    Good when small items carry most of the tokens. Returns rows as lists of item indices
    (empty rows dropped), in the order they were opened. ``items``: as :func:`best_fit_decreasing`.
    """
    items = items if items is not None else list(range(len(lengths)))
    split = _first_below(lengths, t)  # items [split, n) are below t
    out: list[list[int]] = [[] for _ in range(rows)]
    room, slots = [seq_len] * rows, [max_segments] * rows

    def open_row(_: int) -> int:
        out.append([])
        room.append(seq_len)
        slots.append(max_segments)
        return len(out) - 1

    left = _deal(lengths, reversed(items[split:]), out, room, slots, range(rows))
    _best_fit_into(lengths, items[:split], out, room, slots, open_row)
    _best_fit_into(lengths, sorted(left), out, room, slots, open_row)
    return [row for row in out if row]


def reserve_then_deal(
    lengths: Sequence[int], seq_len: int, max_segments: int, t: int, share: int,
    items: Optional[list[int]] = None,
) -> tuple[list[list[int]], int]:
    """Best fit of the items of length ``t`` or more, each new row keeping room for small items.

    A row opened by an item of length ``l`` keeps ``min(share, seq_len - l)`` tokens and a
    proportional number of segments free while the large items are placed; then the items
    below ``t`` are dealt, smallest first, round robin over the rows that kept room, and
    what is left goes by best fit (new rows last). Good when large items fill most rows.

    Returns:
      ``(rows, kept)``: rows as lists of item indices in the order they were opened, and the
      tokens kept free in all (the caller raises ``share`` when they fall short).
    ``items``: as :func:`best_fit_decreasing`.
    """
    n = len(lengths)
    items = items if items is not None else list(range(n))
    split = _first_below(lengths, t)
    small_tokens = sum(lengths[split:])
    small_items = n - split
    out: list[list[int]] = []
    room: list[int] = []
    slots: list[int] = []
    kept: list[tuple[int, int, int]] = []  # (row, tokens, segments) kept free

    def plain_row(_: int) -> int:
        out.append([])
        room.append(seq_len)
        slots.append(max_segments)
        return len(out) - 1

    def reserving_row(length: int) -> int:
        r = plain_row(length)
        keep = max(0, min(share, seq_len - length))
        if keep and small_tokens:
            segs = min(max_segments - 1, -(-small_items * keep // small_tokens))
            room[r] -= keep
            slots[r] -= segs
            kept.append((r, keep, segs))
        return r

    _best_fit_into(lengths, items[:split], out, room, slots, reserving_row)
    for r, keep, segs in kept:
        room[r] += keep
        slots[r] += segs
    left = _deal(lengths, reversed(items[split:]), out, room, slots, [r for r, _, _ in kept])
    _best_fit_into(lengths, sorted(left), out, room, slots, plain_row)
    return out, sum(keep for _, keep, _ in kept)


# Rounds of reserve_then_deal, each keeping more room when the last kept too little.
RESERVE_ROUNDS = 3


def pack_rows(lengths: Sequence[int], seq_len: int, max_segments: int) -> list[list[int]]:
    """Packs items into rows under both limits, ``seq_len`` tokens and ``max_segments`` segments.

    First :func:`best_fit_decreasing`. When no row of it stopped at the cap with room left
    (the cap did not bind), that is the answer, unchanged. Otherwise the packings that
    spread the small items (module docstring) are built too: :func:`deal_first` over
    :func:`lower_bound` rows, and :func:`reserve_then_deal` with a share of
    ``ceil(small tokens / rows)``, raised by the shortfall for up to
    :data:`RESERVE_ROUNDS` rounds. The packing with the fewest rows wins (ties: the earlier
    one, in that order), so a result never has more rows than best fit decreasing.

    Deterministic: a function of ``lengths`` and the limits only. Cost: O(n log n) per
    packing, at most ``2 + RESERVE_ROUNDS`` packings when the cap binds.

    Args:
      lengths: item lengths in tokens, each in ``[1, seq_len]``, in packing order (length
        decreasing; :func:`chunk_columns`).
      seq_len: row capacity in tokens.
      max_segments: at most this many items per row, >= 1.

    Returns:
      Rows in the order they were opened, each the list of item indices it holds.

    Raises:
      ValueError: an item is empty or longer than ``seq_len``; ``max_segments < 1``; the
        lengths are not in decreasing order.
    """
    lengths = list(lengths)
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("lengths must be in decreasing order (chunk_columns gives that order)")
    items = list(range(len(lengths)))  # one int object an item, shared by every packing built
    best = best_fit_decreasing(lengths, seq_len, max_segments, items)
    if not any(len(row) == max_segments and sum(lengths[i] for i in row) < seq_len for row in best):
        return best  # the cap did not bind
    floor = lower_bound(sum(lengths), len(lengths), seq_len, max_segments)
    if len(best) == floor:
        return best
    t = small_threshold(lengths, seq_len, max_segments, floor)
    candidate = deal_first(lengths, seq_len, max_segments, t, floor, items)
    if len(candidate) < len(best):
        best = candidate
    small_tokens = sum(x for x in lengths if x < t)
    share = -(-small_tokens // floor)
    for _ in range(RESERVE_ROUNDS):
        if not small_tokens or share >= seq_len or len(best) == floor:
            break
        candidate, kept = reserve_then_deal(lengths, seq_len, max_segments, t, share, items)
        if len(candidate) < len(best):
            best = candidate
        if not kept or kept >= small_tokens:
            break
        share = -(-share * small_tokens // kept)
    return best


def fill(tokens: int, rows: int, seq_len: int) -> float:
    """Returns ``tokens / (rows * seq_len)``, or 0.0 when there are no rows."""
    return tokens / (rows * seq_len) if rows else 0.0
