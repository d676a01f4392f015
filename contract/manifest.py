"""The dataset manifest: the schema of ``manifest.json``, shared by writer and readers.

A packed dataset version is one folder::

    <dataset>/
      <source>/data-00000-of-00004.array_record   # ArrayRecord, group_size:1, one row a record
      ...
      manifest.json                               # written last: its presence commits the dataset
      errors/<source>-SSSSS-of-NNNNN.jsonl        # dead letters: rejected documents with reasons

``manifest.json`` (keys sorted, 2-space indent, no timestamps so reruns are byte-identical)::

    {
      "manifest_version": 1,
      "record_format_version": 1,
      "name": "demo", "version": 1,
      "config": {...normalized mixture config...}, "config_sha256": "...",
      "tokenizer": {"sha256": ..., "vocab_size": ..., "bos_id": ..., "eos_id": ...,
                    "pad_id": ..., "unk_id": ..., "add_bos": ..., "add_eos": ...},
      "seq_len": 8192, "token_dtype": "uint16",
      "sources": {
        "<source>": {
          "shards": [{"path": "<source>/data-00000-of-00004.array_record", "records": ...,
                      "tokens": ..., "padding": ..., "documents": ..., "segments": ...,
                      "sha256": ..., "bytes": ...}, ...],
          "totals": {"records": ..., "tokens": ..., "padding": ..., "documents": ...,
                     "segments": ..., "bytes": ...},
          "ledger": {"read": ..., "packed": ..., "rejected": {"<reason>": n, ...},
                     "duplicates_dropped": ..., "tokens_in": ..., "tokens_packed": ...,
                     "tokens_dropped": ..., "docs_split": ...}
        }
      },
      "duplicates": {"mode": "report", "normalization": "...", "hash": "xxh3_128",
                     "documents": ..., "tokens": ...,
                     "by_source": {"<source>": {"documents": ..., "tokens": ...,
                                                "of": {"<source of the kept copy>": n, ...}}},
                     "examples": [{"hash": "<32 hex>", "copies": n, "keys": [...]}, ...]},
      "tools": {"python": "...", "apache_beam": "...", ...}
    }

``documents`` of a shard counts the documents whose chunk 0 is in that shard, so the
shard documents of a source sum to its ``ledger.packed``.

The ledger reconciles as ``read = packed + sum(rejected) + duplicates_dropped`` and
``tokens_in = tokens_packed + tokens_dropped``; the two ``dropped`` fields are 0 unless the
config says ``dedup: exact`` (and absent from manifests written before they existed, read as
0). ``duplicates`` (absent with ``dedup: off`` and in older manifests): per source, its
documents whose token ids an earlier document has (``dataprep.dedup``: the first by source
order in the config, then file and line; a document holding the unknown id: whose normalized
text), and the sources of those earlier copies; ``examples``: the groups with the most copies
(ties: the kept copy's keep order), up to 5, with up to 5 keys each; ``hash``: the hash
function (``xxh3_128-token-ids``; ``xxh3_128`` in manifests of 2026-12-07: the normalized text
of every document; absent before, whose hex is blake2b's and whose examples are the groups of
the smallest hashes).

The schema is declared once, by the dataclasses below: pydantic validates ``manifest.json``
against them (:meth:`Manifest.from_dict`) and publishes them as JSON Schema
(:func:`manifest_json_schema`, kept in ``schemas/manifest.schema.json``). A reader ignores keys
it does not know, so that an older reader still reads a manifest with an added field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional

import pydantic
from pydantic import StrictInt, StrictStr

from contract.validation import adapter, json_schema

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
ERRORS_DIR = "errors"


class ManifestError(ValueError):
    """manifest.json is missing a field, has a bad value, or does not reconcile."""


class NewerManifestError(ManifestError):
    """manifest.json has a ``manifest_version`` above :data:`MANIFEST_VERSION` (a newer toolkit wrote it)."""


def shard_name(index: int, num_shards: int) -> str:
    """Returns ``data-SSSSS-of-NNNNN.array_record`` for shard ``index`` of ``num_shards``.

    Raises:
      ValueError: ``index`` is not in ``[0, num_shards)``.
    """
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} not in [0, {num_shards})")
    return f"data-{index:05d}-of-{num_shards:05d}.array_record"


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One ArrayRecord shard. ``path`` is relative to the dataset folder; sizes in bytes."""

    path: StrictStr
    records: StrictInt
    tokens: StrictInt
    padding: StrictInt
    documents: StrictInt
    segments: StrictInt
    sha256: StrictStr
    bytes: StrictInt


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Where every document read went: ``read == packed + sum(rejected.values()) + duplicates_dropped``.

    ``duplicates_dropped`` / ``tokens_dropped``: documents (and their tokens) left out as
    exact duplicates of an earlier one (``dedup: exact``); 0 otherwise.
    """

    read: StrictInt
    packed: StrictInt
    rejected: Mapping[str, StrictInt]  # by reason (dataprep.readers.Reason)
    tokens_in: StrictInt
    tokens_packed: StrictInt
    docs_split: StrictInt
    duplicates_dropped: StrictInt = 0  # absent in manifests written before dedup: 0
    tokens_dropped: StrictInt = 0

    def problems(self) -> list[str]:
        """Returns what does not reconcile (empty when all is well)."""
        out = []
        rejected = sum(self.rejected.values())
        dropped = f" + duplicates dropped {self.duplicates_dropped}" if self.duplicates_dropped else ""
        if self.read != self.packed + rejected + self.duplicates_dropped:
            out.append(f"documents read {self.read} != packed {self.packed} + rejected {rejected}{dropped}")
        if self.tokens_in != self.tokens_packed + self.tokens_dropped:
            out.append(f"tokens in {self.tokens_in} != tokens packed {self.tokens_packed}"
                       + (f" + tokens dropped {self.tokens_dropped}" if self.tokens_dropped else ""))
        return out


@dataclasses.dataclass(frozen=True)
class SourceEntry:
    """One source's shards and ledger (``manifest.json`` also holds their ``totals``, derived)."""

    shards: tuple[ShardInfo, ...]
    ledger: Ledger

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    def totals(self) -> dict[str, int]:
        keys = ("records", "tokens", "padding", "documents", "segments", "bytes")
        return {k: sum(getattr(s, k) for s in self.shards) for k in keys}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A parsed, checked ``manifest.json`` (see the module docstring for the fields)."""

    name: StrictStr
    version: StrictInt
    record_format_version: StrictInt
    config: dict[str, Any]  # the normalized mixture config (contract.config.MixtureConfig.to_dict)
    config_sha256: StrictStr
    tokenizer: dict[str, Any]  # sha256, vocab_size, bos/eos/pad/unk ids, add_bos, add_eos
    seq_len: StrictInt
    token_dtype: StrictStr
    sources: Mapping[str, SourceEntry]
    tools: dict[str, Any]  # versions of the tools that shaped the bytes
    manifest_version: StrictInt = MANIFEST_VERSION
    duplicates: Optional[dict[str, Any]] = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (pydantic's, of the fields above), with each source's derived ``totals``;
        ``duplicates`` left out when there are none (``dedup: off``)."""
        out = adapter(Manifest).dump_python(self, mode="json", exclude_none=True)
        for name, entry in self.sources.items():
            out["sources"][name]["totals"] = entry.totals()
        return out

    def to_json(self) -> str:
        """Canonical JSON text: sorted keys, 2-space indent, trailing newline."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=True) + "\n"

    def problems(self) -> list[str]:
        """Returns every inconsistency: ledgers that do not reconcile, totals that disagree."""
        out = []
        for name, entry in sorted(self.sources.items()):
            out += [f"source {name!r}: {p}" for p in entry.ledger.problems()]
            docs = sum(s.documents for s in entry.shards)
            if docs != entry.ledger.packed:
                out.append(f"source {name!r}: shard documents {docs} != ledger packed {entry.ledger.packed}")
            toks = sum(s.tokens for s in entry.shards)
            if toks != entry.ledger.tokens_packed:
                out.append(f"source {name!r}: shard tokens {toks} != ledger tokens_packed {entry.ledger.tokens_packed}")
            for s in entry.shards:
                if s.tokens + s.padding != s.records * self.seq_len:
                    out.append(f"shard {s.path}: tokens + padding != records * seq_len")
        return out

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parses and checks manifest JSON text.

        Raises:
          ManifestError: not JSON, a field missing or of the wrong type.
        """
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any) -> "Manifest":
        """Checks a parsed ``manifest.json`` against the schema (pydantic) and returns it.

        Raises:
          NewerManifestError: ``manifest_version`` is above :data:`MANIFEST_VERSION`.
          ManifestError: a field is missing or of the wrong type; the message gives its path
            (``manifest.sources.web.ledger: missing field 'tokens_in'``).
        """
        if not isinstance(raw, Mapping) or "manifest_version" not in raw:
            raise ManifestError("manifest: missing field 'manifest_version'")
        mv = raw["manifest_version"]
        if isinstance(mv, bool) or not isinstance(mv, int):
            raise ManifestError(f"manifest.manifest_version: expected an integer, got {mv!r}")
        if mv != MANIFEST_VERSION:
            raise (NewerManifestError if mv > MANIFEST_VERSION else ManifestError)(f"manifest_version {mv}, this reader knows {MANIFEST_VERSION}")
        try:
            return adapter(Manifest).validate_python(raw)
        except pydantic.ValidationError as e:
            raise ManifestError(_first_problem(e)) from None


_EXPECTED = {"int": "an integer", "string": "a string", "dict": "an object", "list": "a list", "tuple": "a list",
             "dataclass": "an object", "model": "an object", "mapping": "an object"}


def _first_problem(e: pydantic.ValidationError) -> str:
    """pydantic's first error as ``manifest.<path>: missing field 'x'`` or ``manifest.<path>: expected ..., got ...``."""
    err = e.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if p != "[key]"]
    path = "manifest" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1])
    last = loc[-1] if loc else ""
    if err["type"] == "missing":
        return f"{path}: missing field {last!r}"
    where = path + (f"[{last}]" if isinstance(last, int) else f".{last}" if loc else "")
    kind = err["type"].split("_")[0]
    return f"{where}: expected {_EXPECTED.get(kind, err['msg'].lower())}, got {err['input']!r}"


def manifest_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``manifest.json``, from the dataclasses above."""
    return json_schema(Manifest, "manifest.json", "The manifest of a packed dataset version (contract/manifest.py).")
