"""Loading a SentencePiece model through FileSystems, and batch encoding with EOS by id."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np
import sentencepiece as spm

from dataprep import fsutil


def load(path: str, expected_sha256: str | None = None) -> tuple[spm.SentencePieceProcessor, str]:
    """Loads the model at ``path`` (local or any FileSystems URL).

    Returns:
      ``(processor, sha256 hex of the model bytes)``.

    Raises:
      ValueError: the file's sha256 differs from ``expected_sha256``.
      IOError: the file cannot be read.
    """
    data = fsutil.read_bytes(path)
    sha = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and sha != expected_sha256:
        raise ValueError(f"tokenizer {path}: sha256 is {sha}, the config expects {expected_sha256}")
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    return sp, sha


def describe(
    sp: spm.SentencePieceProcessor, path: str, sha256: str, add_bos: bool, add_eos: bool
) -> dict[str, Any]:
    """Returns the manifest's ``tokenizer`` entry (ids are -1 where the model has none)."""
    return {
        "path": path,
        "sha256": sha256,
        "vocab_size": int(sp.vocab_size()),
        "bos_id": int(sp.bos_id()),
        "eos_id": int(sp.eos_id()),
        "pad_id": int(sp.pad_id()),
        "unk_id": int(sp.unk_id()),
        "add_bos": bool(add_bos),
        "add_eos": bool(add_eos),
    }


# SentencePiece's encode holds about 44 bytes of RAM a character of its input (the
# normalizer's alignment and the lattice; measured: 2.1 GB for one 50 MB document, and a
# document may have 256 MiB: 11 GB in one worker). A document longer than LONG_TEXT_CHARS
# (4 Mi characters, about 180 MB to encode whole) is encoded PIECE_CHARS at a time instead,
# cut before a space (see safe_cuts and encode_batch): about 45 MB whatever its length.
LONG_TEXT_CHARS = 1 << 22
PIECE_CHARS = 1 << 20
_WS = "\u2581"  # SentencePiece's whitespace symbol
# Text around a cut that a normalizer could treat differently from the whole text: runs and
# kinds of whitespace, combining marks after a space, characters NFKC turns into a space plus
# a mark, full-width and ligature forms, digits, CJK, emoji, control-like literals.
_PROBE = (
    "The  quick\tbrown fox, \u00a0jumps\u3000over the 12 345 lazy dogs. \u0301e and  e\u0301 \u00a8x "
    "caf\u00e9 \ufb01ne \uff21\uff22 \u2460 \u4e2d\u6587 \u5b57 \U0001f642  </s> <unk>  trailing   "
    "\n\nnew paragraph\r\n  indented line\n\ttabbed   x  y z  "
)


def _cut(text: str, cuts: str, size: int) -> list[str]:
    """``text`` in pieces of at most ``size`` characters, each after the first starting at a
    character of ``cuts`` (the last one in the window); a window without one is not cut."""
    out, i, n = [], 0, len(text)
    while i < n:
        j = i + size
        if j >= n:
            out.append(text[i:])
            break
        k = max(text.rfind(c, i + 1, j + 1) for c in cuts)
        if k <= i:  # no cut in this window: the next one that exists
            found = [t for t in (text.find(c, j + 1) for c in cuts) if t > 0]
            if not found:
                out.append(text[i:])
                break
            k = min(found)
        out.append(text[i:k])
        i = k
    return out


def safe_cuts(sp: spm.SentencePieceProcessor) -> str:
    """The characters before which this model may cut a long text into pieces to encode.

    A cut must not change the text the pieces stand for. Two conditions, both checked on the
    model itself (a model brought by a user may be trained or normalized otherwise): no
    piece holds the whitespace symbol after its first character (no piece spans a word
    boundary: SentencePiece's default ``split_by_whitespace``, not
    ``treat_whitespace_as_suffix``), and for each candidate (space, newline) a probe text
    with every kind of whitespace and mark around the cuts, cut at every position, encodes
    to the ids of the whole probe (this holds with ``nmt_nfkc``'s dummy prefix and whitespace
    removal; not with ``identity`` normalization, nor before a newline that the model keeps
    as a character).

    Returns:
      The cut characters, ``""`` when none is safe (long texts are then encoded whole).
    """
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)) and _WS in sp.id_to_piece(i)[1:]:
            return ""
    out = ""
    for c in (" ", "\n"):
        probe = _PROBE * 3
        whole = sp.encode(probe)
        if all(sum(sp.encode(_cut(probe, c, size)), []) == whole for size in (1, 2, 3, 5, 8, 13, 40)):
            out += c
    return out


def _encode_long(sp: spm.SentencePieceProcessor, text: str, cuts: str, dtype: np.dtype) -> np.ndarray:
    """The ids of ``text``, encoded :data:`PIECE_CHARS` at a time, cut before a character of ``cuts``."""
    parts = [sp.encode(p, return_type="numpy").astype(dtype, copy=False) for p in _cut(text, cuts, PIECE_CHARS)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def encode_batch(
    sp: spm.SentencePieceProcessor,
    texts: Sequence[str],
    add_bos: bool,
    add_eos: bool,
    dtype: np.dtype | str = np.uint32,
    cuts: str = "",
) -> list[np.ndarray]:
    """Encodes ``texts`` in one SentencePiece call; BOS/EOS are added by id, not as text.

    Text is encoded as plain text: a literal ``"</s>"`` in a document is split into ordinary
    pieces, never the EOS control id (SentencePiece does not parse control symbols). The
    ids come back as NumPy arrays (``return_type="numpy"``, SentencePiece >= 0.2.1): no
    Python list of ints is built.

    Texts longer than :data:`LONG_TEXT_CHARS` are encoded :data:`PIECE_CHARS` at a time,
    each piece cut before the last character of ``cuts`` in its window (:func:`safe_cuts` of
    this model; ``""``: never cut), so that memory stays bounded. The ids are a function of
    the text alone (the same on every run and machine) and decode to the same text, but
    where SentencePiece's scores of two segmentations nearly tie they can differ from one
    ``encode`` of the whole text (its float sums depend on all the text before a word;
    measured on a 5 MB document: 8 of 1.3 M ids with the shared corpora's model, none with
    the test model).

    Returns:
      One array ``[n_i]`` of ``dtype`` (uint32 by default; uint16 when the vocabulary fits,
      which halves what the pipeline moves between steps) per text. A text with no pieces
      gives an empty array even when BOS/EOS are on (the caller rejects it as empty).

    Raises:
      ValueError: ``add_bos``/``add_eos`` is set but the model has no such id.
    """
    bos, eos = sp.bos_id(), sp.eos_id()
    if add_bos and bos < 0:
        raise ValueError("add_bos is set but the tokenizer has no BOS id")
    if add_eos and eos < 0:
        raise ValueError("add_eos is set but the tokenizer has no EOS id")
    dtype = np.dtype(dtype)
    if cuts and any(len(t) > LONG_TEXT_CHARS for t in texts):
        long = {i for i, t in enumerate(texts) if len(t) > LONG_TEXT_CHARS}
        short = sp.encode([t for i, t in enumerate(texts) if i not in long], num_threads=1, return_type="numpy")
        it = iter(short)
        pieces = [_encode_long(sp, t, cuts, dtype) if i in long else next(it) for i, t in enumerate(texts)]
    else:
        pieces = sp.encode(list(texts), num_threads=1, return_type="numpy")
    head, tail = int(add_bos), int(add_eos)
    out = []
    for ids in pieces:
        n = int(ids.size)
        if not n:
            out.append(np.zeros((0,), dtype))
            continue
        tokens = np.empty((head + n + tail,), dtype)
        tokens[head : head + n] = ids
        if head:
            tokens[0] = bos
        if tail:
            tokens[-1] = eos
        out.append(tokens)
    return out
