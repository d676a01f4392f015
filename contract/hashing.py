"""Stable hashing and document keys shared by every part of the toolkit.

Every pseudo-random choice in the toolkit is seeded from these functions, never from
Python's salted ``hash()``, set order, time or an unseeded RNG (docs/design.md, "Determinism
rules"). The hash is ``hashlib.blake2b`` over an unambiguous encoding of the parts, so the
value is the same on every machine, Python version and process.
"""

from __future__ import annotations

import hashlib
from typing import Union

Part = Union[str, int, bytes]


def _encode_part(part: Part) -> bytes:
    if isinstance(part, bool):  # bool is an int subclass: refuse the ambiguity.
        raise TypeError(f"stable_hash parts must be str, int or bytes, got bool {part!r}")
    if isinstance(part, bytes):
        tag, body = b"b", part
    elif isinstance(part, str):
        tag, body = b"s", part.encode("utf-8", "surrogatepass")
    elif isinstance(part, int):
        tag, body = b"i", str(part).encode("ascii")
    else:
        raise TypeError(f"stable_hash parts must be str, int or bytes, got {type(part).__name__}")
    return tag + len(body).to_bytes(8, "little") + body


def stable_hash64(*parts: Part) -> int:
    """Returns a 64-bit unsigned hash of ``parts``, identical on every machine.

    Args:
      *parts: str, int or bytes values; each is length-prefixed and type-tagged, so
        ``("ab", "c")`` and ``("a", "bc")`` hash differently.

    Returns:
      int in ``[0, 2**64)``: the first 8 bytes (little-endian) of ``blake2b(digest_size=8)``.

    Raises:
      TypeError: a part is not str, int or bytes.
    """
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(_encode_part(part))
    return int.from_bytes(h.digest(), "little")


def derive_seed(*parts: Part) -> int:
    """Returns a 32-bit seed derived from ``parts`` (e.g. ``(seed, source, epoch)``).

    Returns:
      int in ``[0, 2**31)``, suitable for NumPy, Grain's ``index_shuffle`` and JAX PRNG keys.
    """
    return stable_hash64("seed", *parts) & 0x7FFF_FFFF


def document_key(source: str, relpath: str, locator: Union[int, str]) -> str:
    """Returns the stable key of one document: ``"<source>/<relpath>:<locator>"``.

    Args:
      source: the source name from the mixture config.
      relpath: path of the input file relative to the source root, with ``/`` separators.
      locator: where in the file the document starts: the 1-based line number for JSONL,
        the 0-based row for Parquet, the 0-based block for blank-line separated text, ``0``
        for a whole-file document.

    Raises:
      ValueError: ``source`` is empty or contains ``/``.
    """
    if not source or "/" in source:
        raise ValueError(f"source name must be non-empty and contain no '/', got {source!r}")
    return f"{source}/{relpath}:{locator}"


def key_position(key: str) -> tuple[str, int, int]:
    """Where the document of ``key`` (:func:`document_key`) lies in its input: a sort key.

    Returns ``(relpath, 0, locator)`` for a numeric locator (line, row or block) and
    ``(relpath, 1, 0)`` for a whole-file one (``file``: a file-level dead letter, after the
    lines read before it), so sorting by it gives file order, line 2 before line 10 (the
    plain string order of keys puts ``:10`` before ``:2``). A key that is not
    ``<source>/<relpath>:<locator>`` sorts by itself: ``(key, 1, 0)``.
    """
    head, sep, locator = key.rpartition(":")
    _, slash, rel = head.partition("/")
    if not sep or not slash:
        return (key, 1, 0)
    return (rel, 0, int(locator)) if locator.isdigit() and locator.isascii() else (rel, 1, 0)
