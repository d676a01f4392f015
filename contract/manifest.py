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
      "duplicates": {"mode": "report", "normalization": "...", "documents": ..., "tokens": ...,
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
documents whose normalized text an earlier document has (``dataprep.dedup``: the first by
source order in the config, then file and line), and the sources of those earlier copies;
``examples``: the groups of the smallest text hashes, up to 5, with up to 5 keys each.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

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

    path: str
    records: int
    tokens: int
    padding: int
    documents: int
    segments: int
    sha256: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Where every document read went: ``read == packed + sum(rejected.values()) + duplicates_dropped``.

    ``duplicates_dropped`` / ``tokens_dropped``: documents (and their tokens) left out as
    exact duplicates of an earlier one (``dedup: exact``); 0 otherwise.
    """

    read: int
    packed: int
    rejected: Mapping[str, int]
    tokens_in: int
    tokens_packed: int
    docs_split: int
    duplicates_dropped: int = 0
    tokens_dropped: int = 0

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

    name: str
    version: int
    record_format_version: int
    config: Mapping[str, Any]
    config_sha256: str
    tokenizer: Mapping[str, Any]
    seq_len: int
    token_dtype: str
    sources: Mapping[str, SourceEntry]
    tools: Mapping[str, str]
    manifest_version: int = MANIFEST_VERSION
    duplicates: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest_version": self.manifest_version,
            "record_format_version": self.record_format_version,
            "name": self.name,
            "version": self.version,
            "config": self.config,
            "config_sha256": self.config_sha256,
            "tokenizer": dict(self.tokenizer),
            "seq_len": self.seq_len,
            "token_dtype": self.token_dtype,
            "sources": {
                name: {
                    "shards": [dataclasses.asdict(s) for s in entry.shards],
                    "totals": entry.totals(),
                    "ledger": dataclasses.asdict(entry.ledger),
                }
                for name, entry in sorted(self.sources.items())
            },
            "tools": dict(self.tools),
        } | ({"duplicates": self.duplicates} if self.duplicates is not None else {})

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
        def need(d: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
            if not isinstance(d, Mapping) or key not in d:
                raise ManifestError(f"manifest{where}: missing field {key!r}")
            v = d[key]
            if not isinstance(v, typ) or (isinstance(v, bool) and typ is int):
                raise ManifestError(f"manifest{where}.{key}: expected {typ}, got {v!r}")
            return v

        mv = need(raw, "manifest_version", int, "")
        if mv != MANIFEST_VERSION:
            raise (NewerManifestError if mv > MANIFEST_VERSION else ManifestError)(f"manifest_version {mv}, this reader knows {MANIFEST_VERSION}")
        sources = {}
        for name, entry in need(raw, "sources", dict, "").items():
            where = f".sources.{name}"
            shards = []
            for i, s in enumerate(need(entry, "shards", list, where)):
                fields = {}
                for f in dataclasses.fields(ShardInfo):
                    fields[f.name] = need(s, f.name, str if f.name in ("path", "sha256") else int,
                                          f"{where}.shards[{i}]")
                shards.append(ShardInfo(**fields))
            led = need(entry, "ledger", dict, where)
            ledger = Ledger(
                read=need(led, "read", int, f"{where}.ledger"),
                packed=need(led, "packed", int, f"{where}.ledger"),
                rejected=dict(need(led, "rejected", dict, f"{where}.ledger")),
                tokens_in=need(led, "tokens_in", int, f"{where}.ledger"),
                tokens_packed=need(led, "tokens_packed", int, f"{where}.ledger"),
                docs_split=need(led, "docs_split", int, f"{where}.ledger"),
                **{k: need(led, k, int, f"{where}.ledger") for k in ("duplicates_dropped", "tokens_dropped")
                   if k in led},  # absent in manifests written before dedup: 0
            )
            sources[name] = SourceEntry(tuple(shards), ledger)
        return cls(
            manifest_version=mv,
            record_format_version=need(raw, "record_format_version", int, ""),
            name=need(raw, "name", str, ""),
            version=need(raw, "version", int, ""),
            config=need(raw, "config", dict, ""),
            config_sha256=need(raw, "config_sha256", str, ""),
            tokenizer=need(raw, "tokenizer", dict, ""),
            seq_len=need(raw, "seq_len", int, ""),
            token_dtype=need(raw, "token_dtype", str, ""),
            sources=sources,
            tools=need(raw, "tools", dict, ""),
            duplicates=need(raw, "duplicates", dict, "") if "duplicates" in raw else None,
        )
