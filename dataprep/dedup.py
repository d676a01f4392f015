"""Exact duplicate documents: a stable hash of the normalized text, and which copy is kept.

Pure functions, no Beam and no I/O; the pipeline (``dataprep.pipeline``) calls them.

Glossary:
  normalized text  the text in Unicode NFC, its runs of whitespace (spaces, tabs, line
                   breaks) made one space, leading and trailing whitespace dropped: two
                   documents that differ only there are duplicates.
  text hash        ``blake2b(normalized text as UTF-8, digest_size=16, person=b"moe-dedup-v1")``:
                   16 bytes, the same on every machine; two different texts share it with
                   probability about 2**-128 per pair.
  dedup bucket     ``first 8 bytes of the hash (little-endian) % buckets``: every copy of a
                   text lands in the same bucket, so finding them needs one bucket at a time
                   (a GroupByKey on the bucket, never a set of every hash in one place).
  group            the documents of one text hash, in keep order: (source's position in
                   the mixture config, file, line or row: :func:`contract.hashing.key_position`).
  kept copy        the first of its group; every other member duplicates it, "within" its
                   source when the kept copy is in the same source, else "across".

Worked example, sources ``web`` then ``books`` in the config::

    web/a.jsonl:10  "Call me Ishmael."     hash h1   group h1: web/a.jsonl:2 (kept),
    web/a.jsonl:2   "Call me  Ishmael.\n"  hash h1             web/a.jsonl:10 (within web),
    books/m.txt:0   "Call me Ishmael."     hash h1             books/m.txt:0 (across, of web)

With ``dedup: exact`` the two duplicates are not packed; with ``report`` (the default) they
are packed and counted; ``off`` hashes nothing.
"""

from __future__ import annotations

import hashlib
import struct
import unicodedata
from typing import Sequence

import numpy as np

from contract.hashing import key_position

DIGEST_BYTES = 16
_PERSON = b"moe-dedup-v1"
# One staged record of the dedup step: text hash, source index, tokens of the document;
# RECORD_DTYPE reads many at once.
RECORD = struct.Struct("<16sII")
RECORD_DTYPE = np.dtype([("hash", "V16"), ("source", "<u4"), ("tokens", "<u4")])
_HASH = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)  # copied per text: cheaper than the keywords
NORMALIZATION = "Unicode NFC, runs of whitespace made one space, leading and trailing whitespace dropped"


def normalize(text: str) -> str:
    """The normalized text (module glossary): NFC, whitespace runs as one space, stripped."""
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return " ".join(text.split())


def text_hash(text: str) -> bytes:
    """The 16-byte hash of the normalized ``text`` (module glossary): the reference form, one
    document at a time (:func:`text_hashes` gives the same bytes for many at once)."""
    data = normalize(text).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=_PERSON).digest()


# Whitespace as ``str.split()`` sees it (the normalization's): the ASCII ones (tab to carriage
# return, the four separators 0x1c-0x1f, space) and, of more than one UTF-8 byte, U+0085,
# U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000
# (every c with chr(c).isspace(); a test checks the list against Python's)
WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
              "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_ASCII_RANGES = ((0x09, 0x0D), (0x1C, 0x20))
# the others as integers of their UTF-8 bytes, big-endian (0xC2A0 for U+00A0, 0xE38080 for U+3000)
_WIDE = np.array(sorted(int.from_bytes(w.encode(), "big") for w in WHITESPACE if ord(w) >= 0x80), np.int64)


def _whitespace_bytes(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where ``buf`` (uint8 ``[n]``, UTF-8) holds whitespace characters.

    Returns:
      ``(ws, wide)``: ``ws`` bool ``[n]``, the bytes of whitespace characters (every byte of a
      multi-byte one); ``wide`` int64, where the multi-byte ones start.
    """
    # (b - lo) <= hi - lo in uint8 is lo <= b <= hi
    (lo1, hi1), (lo2, hi2) = _ASCII_RANGES
    ws = (buf - np.uint8(lo1)) <= np.uint8(hi1 - lo1)
    ws |= (buf - np.uint8(lo2)) <= np.uint8(hi2 - lo2)
    wide = []
    # multi-byte ones start with 0xC2 (2 bytes) or 0xE1-0xE3 (3 bytes): only bytes >= 0xC2 are looked at
    n = buf.size
    lead = np.flatnonzero(buf >= 0xC2) if n and int(buf.max()) >= 0xC2 else np.zeros(0, np.int64)
    if lead.size:
        two = lead[(buf[lead] == 0xC2) & (lead + 1 < n)]
        three = lead[((buf[lead] - np.uint8(0xE1)) <= np.uint8(2)) & (lead + 2 < n)]
        code2 = buf[two].astype(np.int64) << 8 | buf[two + 1]
        code3 = buf[three].astype(np.int64) << 16 | buf[three + 1].astype(np.int64) << 8 | buf[three + 2]
        for at, k in ((two[np.isin(code2, _WIDE)], 2), (three[np.isin(code3, _WIDE)], 3)):
            for j in range(k):
                ws[at + j] = True
            wide.append(at)
    return ws, np.concatenate(wide) if wide else np.zeros(0, np.int64)


def text_hashes(texts: Sequence[str]) -> list[bytes]:
    """:func:`text_hash` of every text, the same bytes, for many texts at once.

    The texts (NFC where not ASCII and not already NFC) are joined as UTF-8 with a newline
    after each, in runs of about :data:`JOIN_CHARS` characters, and the normalization is done
    on the joined bytes with NumPy: a whitespace byte is kept (as a space) only when the byte
    before it is not whitespace, so each run of whitespace becomes one space and each text's
    last kept byte is the space of the run that ends it (the newline at the latest), which its
    hash leaves out::

        "a  b", " c\t"   joined   a␣␣b⏎␣c⇥⏎   kept   a␣b␣ c␣   texts   "a b", "c"

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
    ws, wide = _whitespace_bytes(buf)
    keep = np.empty_like(ws)
    keep[0] = not ws[0]  # leading whitespace goes
    np.logical_not(ws[1:] & ws[:-1], out=keep[1:])
    # whitespace as a space: ASCII whitespace is <= 32 and the rest > 32, so max(byte, 32 * ws),
    # and the first byte of a multi-byte one (its others are not kept)
    spaced = np.maximum(buf, ws.view(np.uint8) << np.uint8(5))
    spaced[wide] = 32
    out = memoryview(spaced[keep])
    # each text's end in out (after the space of the run that ends it)
    count = np.uint32 if buf.size < 1 << 32 else np.int64
    ends = np.cumsum(np.add.reduceat(keep.view(np.uint8), np.cumsum(sizes) - sizes, dtype=count), dtype=np.int64)
    digests = []
    begin = 0
    for end in ends.tolist():
        h = _HASH.copy()
        h.update(out[begin: max(begin, end - 1)])
        digests.append(h.digest())
        begin = end
    return digests


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
