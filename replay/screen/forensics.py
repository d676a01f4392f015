"""Data forensics (``replay inspect``): which documents were in the batches of a step range.

A batch is a pure function of the step (docs/design.md), so this is a lookup, with no pass over
earlier data: the loader says where each row of a step comes from (``rows_at``: phase, source,
epoch, shuffled record, shard, record in shard) and reads the stored rows (``read_rows``: tokens,
segment lengths, document keys, chunk indices). For each row this lists its documents::

    row tokens:  a a a a b b b . .        segment lengths [4, 3], seq_len 9
    documents:   key_a chunk 0 span 0:4,  key_b chunk 2 span 4:7   (span: slots in the row)

``chunk`` says which ``seq_len`` piece of a long document the segment is (the segment starts at
token ``chunk * seq_len`` of the document). A per-source summary and the shards and records
touched follow, so that a bad shard or input file can be found; ``text=True`` decodes each
segment with the dataset's SentencePiece tokenizer, and ``token_ids=True`` carries each segment's
token ids (the exact stored tokens: decoded text is the tokenizer's normalization of the original
text, not its bytes; docs/dataprep.md, "Decoded text is the normalized text").
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Optional

import numpy as np


class TokenizerUnavailableError(ValueError):
    """``--text`` was asked but the dataset's tokenizer model cannot be found or loaded."""


def load_tokenizer(path: str):
    """A ``sentencepiece.SentencePieceProcessor`` for ``path``.

    Raises:
      TokenizerUnavailableError: the file is missing or not a SentencePiece model.
    """
    import sentencepiece as spm

    if not os.path.isfile(path):
        raise TokenizerUnavailableError(f"--text: the dataset's tokenizer {path} is not there")
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise TokenizerUnavailableError(f"--text: {path} is not a SentencePiece model ({e})") from None


@dataclasses.dataclass
class InspectReport:
    start: int
    stop: int
    rows: list[dict[str, Any]]
    sources: dict[str, dict[str, int]]
    shards: dict[str, list[int]]
    dataset: Optional[str]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "inspect", "steps": {"start": self.start, "stop": self.stop}, "dataset": self.dataset,
                "rows": self.rows, "sources": self.sources, "shards": self.shards}


def inspect_steps(data: Any, start: int, stop: int, *, text: bool = False, tokenizer_path: Optional[str] = None,
                  dataset: Optional[str] = None, token_ids: bool = False) -> InspectReport:
    """Lists the documents of every row of steps ``[start, stop)``.

    Args:
      data: a loader (``loader.build(...)``) with ``rows_at(step)`` and ``read_rows(step)``.
      start, stop: the half-open step range.
      text: decode each segment's tokens (needs ``tokenizer_path``). The text is the tokenizer's
        normalization of the original (e.g. NFKC: ``ﬁ`` -> ``fi``), not its bytes, and a segment
        cut inside a multi-byte character decodes to U+FFFD at the cut.
      tokenizer_path: the dataset's SentencePiece model.
      dataset: the dataset directory, recorded in the report.
      token_ids: carry each segment's token ids (``token_ids``, a list of int, ``tokens`` long).

    Returns:
      The report; ``rows[i]`` has ``step``, ``position`` (row in the batch), ``global_row``,
      ``phase``, ``source``, ``epoch``, ``record``, ``shard``, ``record_in_shard``, ``tokens``,
      ``padding`` and ``documents`` (each ``key``, ``chunk``, ``span`` ``[begin, end)`` in row
      slots, ``tokens`` (a count), ``id`` (str: the document's own id, the source's ``id_field``, when the
      dataset carries one), optionally ``text`` (str) and ``token_ids`` (list of int)).

    Raises:
      TokenizerUnavailableError: ``text`` without a usable tokenizer.
    """
    sp = None
    if text:
        if tokenizer_path is None:
            raise TokenizerUnavailableError("--text: the dataset names no tokenizer")
        sp = load_tokenizer(tokenizer_path)
    rows, shards = [], collections.defaultdict(set)
    sources: dict[str, dict[str, int]] = collections.defaultdict(
        lambda: {"rows": 0, "documents": 0, "tokens": 0, "padding": 0, "split_documents": 0})
    for step in range(start, stop):
        refs = data.rows_at(step)
        packed = data.read_rows(step)
        for pos, (ref, row) in enumerate(zip(refs, packed)):
            ends = np.cumsum(row.segment_lengths)
            docs = []
            for i, key in enumerate(row.doc_keys):
                b, e = int(ends[i] - row.segment_lengths[i]), int(ends[i])
                doc = {"key": key, "chunk": int(row.chunk_indices[i]), "span": [b, e], "tokens": e - b}
                if row.doc_ids[i]:  # the document's own id (the source's id_field), as the input gave it
                    doc["id"] = row.doc_ids[i]
                ids = [int(t) for t in row.tokens[b:e]] if sp is not None or token_ids else None
                if sp is not None:
                    doc["text"] = sp.decode(ids)
                if token_ids:
                    doc["token_ids"] = ids
                docs.append(doc)
            rows.append({"step": step, "position": pos, **ref.to_dict(), "tokens": row.num_tokens,
                         "padding": row.padding, "documents": docs})
            s = sources[ref.source]
            s["rows"] += 1
            s["documents"] += row.num_segments
            s["tokens"] += row.num_tokens
            s["padding"] += row.padding
            s["split_documents"] += int(np.count_nonzero(row.chunk_indices))
            shards[ref.shard].add(int(ref.record_in_shard))
    return InspectReport(start, stop, rows, dict(sources), {k: sorted(v) for k, v in sorted(shards.items())},
                         dataset)
