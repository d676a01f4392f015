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


def encode_batch(
    sp: spm.SentencePieceProcessor,
    texts: Sequence[str],
    add_bos: bool,
    add_eos: bool,
    dtype: np.dtype | str = np.uint32,
) -> list[np.ndarray]:
    """Encodes ``texts`` in one SentencePiece call; BOS/EOS are added by id, not as text.

    Text is encoded as plain text: a literal ``"</s>"`` in a document is split into ordinary
    pieces, never the EOS control id (SentencePiece does not parse control symbols). The
    ids come back as NumPy arrays (``return_type="numpy"``, SentencePiece >= 0.2.1): no
    Python list of ints is built.

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
