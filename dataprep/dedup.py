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
NORMALIZATION = "Unicode NFC, runs of whitespace made one space, leading and trailing whitespace dropped"


def normalize(text: str) -> str:
    """The normalized text (module glossary): NFC, whitespace runs as one space, stripped."""
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return " ".join(text.split())


def text_hash(text: str) -> bytes:
    """The 16-byte hash of the normalized ``text`` (module glossary)."""
    data = normalize(text).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=_PERSON).digest()


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
