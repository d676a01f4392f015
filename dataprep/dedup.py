"""Exact duplicate documents: a stable hash of what the model will read, and which copy is kept.

Pure functions, no Beam and no I/O; the pipeline (``dataprep.pipeline``) calls them.

Glossary:
  document hash    what decides that two documents are duplicates:
                   * its token hash, for a document whose ids hold no unknown piece (every
                     document with a byte-fallback tokenizer): two documents are duplicates
                     when they encode to the same token ids, the same training tokens. The
                     text is compared as the tokenizer normalized it (``nmt_nfkc``, the
                     default: Unicode NFKC, runs of whitespace one space, leading and
                     trailing whitespace dropped; ``identity``: as it is, but for
                     SentencePiece's whitespace symbol U+2581, which reads as a space);
                   * its unknown hash, for a document whose ids hold the unknown id
                     (different unknown characters read as the same id, so the ids alone do
                     not tell two texts apart): the ids and the normalized text (below) both
                     compared. Two such documents are duplicates only when both are equal:
                     never two whose ids differ (the text normalization alone would merge
                     ``"a.\x0bb"`` and ``"a. b"``, which ``nmt_nfkc`` reads as ``a.b`` and
                     ``a. b``), nor two whose unknown characters differ.
                   The pipeline hashes ids it already holds: about 0.05 ns a byte of tokens,
                   where normalizing the text costs about 2 ns a byte of text
                   (``benchmarks/dedup_hash.py``); only documents with an unknown piece pay
                   both.
  token hash       ``xxh3_128(ids, seed=TOKEN_HASH_SEED)``: the document's ids as packed (BOS
                   and EOS by the config), little-endian in the dataset's token dtype
                   (``uint16`` or ``uint32``: the manifest's), hashed by the ``xxhash`` library
                   (its canonical big-endian digest): 16 bytes, the same on every machine and
                   every xxhash release (XXH3's output is frozen since xxHash 0.8.0). The
                   seed keeps token hashes apart from text hashes (a text whose UTF-8 bytes
                   equal some ids' bytes is no duplicate of them).
  unknown hash     ``xxh3_128(text hash + ids, seed=UNKNOWN_HASH_SEED)``: the 16 bytes of the
                   document's text hash followed by its ids' bytes as in the token hash.
  normalized text  the text in Unicode NFC, its runs of whitespace (spaces, tabs, line
                   breaks) made one space, leading and trailing whitespace dropped.
  text hash        ``xxh3_128(normalized text as UTF-8)`` (seed 0). Two different documents
                   share a document hash with probability about 2**-128 per pair (a trillion
                   documents: about 1.5e-15 that any two do). Not a cryptographic hash: a
                   corpus built to collide could make two chosen texts duplicates.
                   (Manifests written before 2026-12-07 used blake2b, person
                   ``moe-dedup-v1``, and the text hash of every document; the manifest's
                   ``hash`` says which.)
  dedup bucket     ``first 8 bytes of the hash (little-endian) % buckets``: every copy of a
                   document lands in the same bucket, so finding them needs one bucket at a
                   time (a GroupByKey on the bucket, never a set of every hash in one place).
  group            the documents of one document hash, in keep order: (source's position in
                   the mixture config, file, line or row: :func:`contract.hashing.key_position`).
  kept copy        the first of its group; every other member duplicates it, "within" its
                   source when the kept copy is in the same source, else "across".

Worked example, sources ``web`` then ``books`` in the config, an ``nmt_nfkc`` tokenizer::

    web/a.jsonl:10  "Call me Ishmael."     ids i1   group i1: web/a.jsonl:2 (kept),
    web/a.jsonl:2   "Call me  Ishmael.\n"  ids i1             web/a.jsonl:10 (within web),
    books/m.txt:0   "Call me Ishmael."     ids i1             books/m.txt:0 (across, of web)

With ``dedup: exact`` the two duplicates are not packed; with ``report`` (the default) they
are packed and counted; ``off`` hashes nothing.
"""

from __future__ import annotations

import operator
import struct
import unicodedata
from typing import Sequence

import numpy as np
import xxhash

from contract.hashing import key_position

DIGEST_BYTES = 16
# One staged record of the dedup step: document hash, source index, tokens of the document;
# RECORD_DTYPE reads many at once.
RECORD = struct.Struct("<16sII")
RECORD_DTYPE = np.dtype([("hash", "V16"), ("source", "<u4"), ("tokens", "<u4")])
_DIGEST = xxhash.xxh3_128_digest  # bytes-like in (and a seed), 16 bytes out (0.05 ns a byte, 60 ns a call)
_DTYPE = operator.attrgetter("dtype")


HASH_NAME = "xxh3_128-token-ids"
"""The manifest's ``duplicates.hash``: the document hash of the module glossary (token hash, or the
unknown hash with an unknown id). Manifests of 2026-12-07 say ``xxh3_128`` (the text hash of every
document), older ones nothing (blake2b)."""
TOKEN_HASH_SEED = 0x7E4B  # any fixed value but 0, the text hash's
UNKNOWN_HASH_SEED = 0x7E4C  # and one of its own for the documents with an unknown piece
NORMALIZATION = ("the tokenizer's (documents with the same token ids are duplicates); with an unknown piece, the "
                 "same ids and the same text in Unicode NFC, runs of whitespace made one space, leading and "
                 "trailing whitespace dropped")


def text_hash_of_normalized(data: bytes) -> bytes:
    """The 16-byte text hash of ``data``, a text already normalized and encoded as UTF-8."""
    return _DIGEST(data)


def _little_endian(ids: np.ndarray) -> np.ndarray:
    """``ids`` C-contiguous in its dtype's little-endian form (no copy when it already is)."""
    return np.ascontiguousarray(ids, ids.dtype.newbyteorder("<"))


def token_hash(ids: np.ndarray) -> bytes:
    """The 16-byte token hash of one document (module glossary).

    Args:
      ids: ``[n]`` uint16 or uint32, the document's ids as packed (BOS/EOS included as the
        config adds them), any strides.

    Returns:
      ``xxh3_128`` of the ids' little-endian bytes, seed :data:`TOKEN_HASH_SEED`.
    """
    return _DIGEST(_little_endian(ids), seed=TOKEN_HASH_SEED)


def unknown_hash(text: str, ids: np.ndarray) -> bytes:
    """The 16-byte unknown hash of one document whose ids hold the unknown id (module glossary):
    ``xxh3_128(text_hash(text) + ids as little-endian bytes, seed=UNKNOWN_HASH_SEED)``."""
    return _DIGEST(text_hash(text) + _little_endian(ids).tobytes(), seed=UNKNOWN_HASH_SEED)


def document_hashes(texts: Sequence[str], ids: Sequence[np.ndarray], unk_id: int) -> list[bytes]:
    """The document hash of each document (module glossary): its :func:`token_hash`, or its
    :func:`unknown_hash` where its ids hold ``unk_id``.

    Args:
      texts: ``N`` texts as read.
      ids: ``N`` arrays ``[n_i]`` of one dtype (uint16 or uint32), each text's ids as packed.
      unk_id: the tokenizer's unknown id (``sp.unk_id()``; negative: none).

    Returns:
      ``N`` 16-byte digests, in order: the same bytes as :func:`token_hash` / :func:`unknown_hash`
      one document at a time. Cost: the ids joined once and searched once for the unknown id
      (no NumPy call a document: a short document costs a hash call, about 0.2 us), plus
      :func:`text_hashes` of the documents that hold an unknown piece only.

    Raises:
      ValueError: ``texts`` and ``ids`` differ in length, or the arrays in dtype.
    """
    n = len(ids)
    if len(texts) != n:
        raise ValueError(f"{len(texts)} texts but {n} id arrays")
    if not n:
        return []
    dtypes = set(map(_DTYPE, ids))
    if len(dtypes) > 1:
        raise ValueError(f"the id arrays have dtypes {sorted(map(str, dtypes))}; one is needed (the dataset's)")
    flat = _little_endian(np.concatenate(ids))
    ends = np.cumsum(np.fromiter(map(len, ids), np.int64, n))
    unknown: list[int] = []
    if unk_id >= 0 and 0 <= unk_id <= np.iinfo(flat.dtype).max:
        at = np.flatnonzero(flat == unk_id)
        if at.size:
            unknown = np.unique(np.searchsorted(ends, at, side="right")).tolist()
    data, bounds = memoryview(flat).cast("B"), (ends * flat.dtype.itemsize).tolist()
    out = [_DIGEST(data[begin:end], TOKEN_HASH_SEED) for begin, end in zip([0] + bounds[:-1], bounds)]
    for i, digest in zip(unknown, text_hashes([texts[i] for i in unknown])):
        out[i] = _DIGEST(digest + data[bounds[i - 1] if i else 0: bounds[i]], seed=UNKNOWN_HASH_SEED)
    return out


def normalize(text: str) -> str:
    """The normalized text (module glossary): NFC, whitespace runs as one space, stripped."""
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return " ".join(text.split())


def text_hash(text: str) -> bytes:
    """The 16-byte hash of the normalized ``text`` (module glossary): the reference form, one
    document at a time (:func:`text_hashes` gives the same bytes for many at once)."""
    return text_hash_of_normalized(normalize(text).encode("utf-8", "surrogatepass"))


# Whitespace as ``str.split()`` sees it (the normalization's): the ASCII ones (tab to carriage
# return, the four separators 0x1c-0x1f, space) and, of more than one UTF-8 byte, U+0085,
# U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000
# (every c with chr(c).isspace(); a test checks the list against Python's)
WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
              "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_ASCII_RANGES = ((0x09, 0x0D), (0x1C, 0x20))
# the others as integers of their UTF-8 bytes, big-endian (0xC2A0 for U+00A0, 0xE38080 for U+3000)
_WIDE = np.array(sorted(int.from_bytes(w.encode(), "big") for w in WHITESPACE if ord(w) >= 0x80), np.int64)


def _is_wide(codes: np.ndarray) -> np.ndarray:
    """Which of ``codes`` (int64, UTF-8 bytes as big-endian integers) are in :data:`_WIDE`
    (a sorted search: ``np.isin`` costs about 50 us a call, a few times a join)."""
    at = np.minimum(np.searchsorted(_WIDE, codes), _WIDE.size - 1)
    return _WIDE[at] == codes


_SPACES = np.full(1 << 20, 32, np.uint8)


def _spaces(n: int) -> np.ndarray:
    """``n`` bytes of 32 (uint8), a view of a module array grown as needed (never written)."""
    global _SPACES
    if _SPACES.size < n:
        _SPACES = np.full(max(n, 2 * _SPACES.size), 32, np.uint8)
    return _SPACES[:n]


def _whitespace_bytes(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Where ``buf`` (uint8 ``[n]``, UTF-8) holds whitespace characters, and ``buf`` with each
    whitespace character's first byte made a space.

    Returns:
      ``(ws, spaced, plain)``: ``ws`` bool ``[n]``, the bytes of whitespace characters (every
      byte of a multi-byte one); ``spaced`` uint8 ``[n]``, ``buf`` with 32 at the first byte of
      each (the other bytes of a multi-byte one left as they are); ``plain``: ``buf`` has no
      byte below 32 but whitespace, so ``spaced`` has none at all.
    """
    # The ASCII whitespace bytes are 9-13 and 28-32. With no other byte below 32 (the common
    # case: no control character but tab, newline, carriage return), max(byte, 32) makes exactly
    # them spaces and ws is where the result is 32: 2 passes of about 0.03 ns a byte (max against
    # an array of 32s: against the scalar NumPy takes 10x longer). Bytes 0-8 are 247-255 less 9
    # (valid UTF-8 has no byte above 0xF4, 235 less 9), bytes 14-27 are 0-13 less 14.
    plain = int((buf - np.uint8(14)).min(initial=255)) >= 14 and int((buf - np.uint8(9)).max(initial=0)) < 247
    if not plain:
        # (b - lo) <= hi - lo in uint8 is lo <= b <= hi
        (lo1, hi1), (lo2, hi2) = _ASCII_RANGES
        ws = (buf - np.uint8(lo1)) <= np.uint8(hi1 - lo1)
        ws |= (buf - np.uint8(lo2)) <= np.uint8(hi2 - lo2)
        spaced = np.maximum(buf, ws.view(np.uint8) << np.uint8(5))  # ASCII whitespace is <= 32, the rest > 32
    else:
        spaced = np.maximum(buf, _spaces(buf.size))
        ws = spaced == np.uint8(32)
    # multi-byte ones start with 0xC2 (2 bytes) or 0xE1-0xE3 (3 bytes): only bytes >= 0xC2 are looked at
    n = buf.size
    lead = np.flatnonzero(buf >= 0xC2) if n and int(buf.max()) >= 0xC2 else np.zeros(0, np.int64)
    if lead.size:
        two = lead[(buf[lead] == 0xC2) & (lead + 1 < n)]
        three = lead[((buf[lead] - np.uint8(0xE1)) <= np.uint8(2)) & (lead + 2 < n)]
        code2 = buf[two].astype(np.int64) << 8 | buf[two + 1]
        code3 = buf[three].astype(np.int64) << 16 | buf[three + 1].astype(np.int64) << 8 | buf[three + 2]
        for at, k in ((two[_is_wide(code2)], 2), (three[_is_wide(code3)], 3)):
            for j in range(k):
                ws[at + j] = True
            spaced[at] = 32
    return ws, spaced, plain


def text_hashes(texts: Sequence[str]) -> list[bytes]:
    """:func:`text_hash` of every text, the same bytes, for many texts at once.

    The texts (NFC where not ASCII and not already NFC) are joined as UTF-8 with a newline
    after each, in runs of about :data:`JOIN_CHARS` characters, and the normalization is done
    on the joined bytes with NumPy. Each text's newline becomes a byte 0 that is not
    whitespace (a separator); a whitespace byte is kept (as a space) only when the byte before
    it is not whitespace, so each run of whitespace becomes one space, and a text's kept bytes
    between two separators lose the space that starts or ends them, if any::

        "a  b", " c\t"   joined   a␣␣b⏎␣c⇥⏎   kept   a␣b0␣c␣0   texts   "a b", "c"

    Most joins hold no byte below 32 but whitespace: then ``max(byte, 32)`` is all the
    whitespace test ASCII needs, and the separators are the kept bytes that are 0.

    No Python object per word (``" ".join(text.split())`` makes one): half of
    :func:`text_hash`'s CPU time on the benchmark corpus (``benchmarks/dedup_hash.py``).

    Returns:
      ``len(texts)`` 16-byte digests, in order.
    """
    digests: list[bytes] = []
    start, chars = 0, 0
    for i, t in enumerate(texts):
        chars += len(t)
        if chars >= JOIN_CHARS or i == len(texts) - 1:
            digests += _joined_hashes(texts[start: i + 1])
            start, chars = i + 1, 0
    return digests


JOIN_CHARS = 1 << 18
"""Characters :func:`text_hashes` joins at a time: its arrays (about 4 bytes a character) stay
in a core's cache (measured: 16% faster than 1 MB joins)."""


def _joined_hashes(texts: Sequence[str]) -> list[bytes]:
    """:func:`text_hashes` of one join (see there)."""
    parts = [t.encode("utf-8", "surrogatepass") if t.isascii() or unicodedata.is_normalized("NFC", t)
             else unicodedata.normalize("NFC", t).encode("utf-8", "surrogatepass") for t in texts]
    sizes = np.fromiter(map(len, parts), np.int64, len(parts)) + 1  # each with its newline
    parts.append(b"")
    buf = np.frombuffer(b"\n".join(parts), np.uint8)  # a newline after each text
    ws, spaced, plain = _whitespace_bytes(buf)
    # each text's newline becomes a byte 0 that is no whitespace: kept, and the first byte of the
    # whitespace runs on both sides of it too (one space each, dropped below)
    seps = np.cumsum(sizes) - 1
    ws[seps] = False
    spaced[seps] = 0
    keep = np.empty_like(ws)
    keep[0] = True
    np.logical_not(ws[1:] & ws[:-1], out=keep[1:])  # of a whitespace run (or a multi-byte one) its first byte
    out = spaced[keep]
    if plain:  # spaced has no other 0
        ends = np.flatnonzero(out == 0)
    else:  # the kept bytes up to each newline
        count = np.uint32 if buf.size < 1 << 32 else np.int64
        ends = np.cumsum(np.add.reduceat(keep.view(np.uint8), seps + 1 - sizes, dtype=count), dtype=np.int64) - 1
    # each text is out[begin:end], less a leading and a trailing space (its whitespace at either end)
    begins = np.concatenate([[0], ends[:-1] + 1])
    begins += out[begins] == 32  # out[begin] is at most the 0 at end
    ends -= (out[ends - 1] == 32) & (ends > begins)
    out = memoryview(out)
    return [_DIGEST(out[begin:end]) for begin, end in zip(begins.tolist(), ends.tolist())]


def example_rank(copies: int, kept_source: int, kept_key: str) -> tuple:
    """Sort key of a duplicate group among the report's examples: most copies first, then the
    kept copy's keep order (source index in the config, then :func:`contract.hashing.key_position`).

    The examples a manifest shows are the groups of the smallest rank: a function of the
    groups alone, never of the hash, so a change of hash function changes no example but its
    hex. Two groups never tie: a document is the kept copy of one group at most.
    """
    return (-copies, kept_source, key_position(kept_key), kept_key)


def dedup_bucket(digest: bytes, num_buckets: int) -> int:
    """The dedup bucket of a text hash, in ``[0, num_buckets)``.

    Raises:
      ValueError: ``num_buckets < 1``.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    return int.from_bytes(digest[:8], "little") % num_buckets


def groups(keys: Sequence[str], digests: Sequence[bytes] | np.ndarray, sources: Sequence[int]) -> list[list[int]]:
    """The groups of documents that share a text hash, two or more members each.

    Args:
      keys: ``N`` document keys (distinct).
      digests: ``N`` text hashes (:func:`text_hash`), as bytes or a ``V16`` array.
      sources: ``N`` source indices (position in the mixture config).

    Returns:
      Each group as indices into ``keys``, in keep order (source index, then
      :func:`contract.hashing.key_position`); groups in increasing hash order. Documents
      whose hash is unique are in no group. Cost: a NumPy sort of the hashes, then Python
      work for the duplicates only.
    """
    n = len(keys)
    if n < 2:
        return []
    if isinstance(digests, np.ndarray):
        flat = digests.view(np.dtype((np.void, DIGEST_BYTES)))
    else:
        flat = np.frombuffer(b"".join(digests), np.dtype((np.void, DIGEST_BYTES)), n)
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return []
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    ends = np.concatenate([starts[1:], [n]])
    out = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        if b - a > 1:
            members = order[a:b].tolist()
            out.append(sorted(members, key=lambda i: (int(sources[i]), key_position(keys[i]))))
    return out
