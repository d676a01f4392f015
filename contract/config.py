"""The versioned mixture config: schema, YAML loading and validation.

A mixture config names a dataset version and says what goes into it::

    name: demo                 # dataset name
    version: 1                 # bump on any change that alters the packed output
    seq_len: 8192              # slots per packed row (default 8192)
    seed: 0                    # seeds bucketing here and shuffling in the loader
    target_shard_tokens: 268435456  # 2**28 (default): shards per source follow from input size
    shards_per_source: 4       # optional override of that: exactly this many shards per source (auto: not set)
    max_segments_per_row: 256  # cap on documents (segments) packed into one row
    max_rejected_fraction: 0.5 # a source rejecting more of its documents fails the pack
    dedup: report              # exact duplicate documents: off | report (default) | exact (drop them)
    tokenizer:
      path: ../../build/demo/tokenizer.model   # relative paths: to this file's folder
      sha256: 3f1a...          # expected sha256 of the model file (optional but advised)
      add_bos: false
      add_eos: true
    sources:
      - name: docs
        paths: [../../build/demo/inputs/docs/*.jsonl]
        root: ../../build/demo/inputs/docs     # optional; keys are relative to it
        format: jsonl          # jsonl | jsonl.gz | jsonl.zst | parquet | text
        text_field: text
        id_field: id           # optional: the document's own id (e.g. a URL), kept in each row's provenance
        text_split: file       # text format only: file | blank_lines
        weight: 0.3
    phases:                    # optional: from step S, these weights
      - from_step: 1000
        weights: {docs: 0.5, code: 0.5}

Relative paths are resolved against the folder of the config file (URLs such as
``gs://...`` are kept as they are). Validation here is pure: it checks the schema, the
values and their consistency. Checks that touch files (globs that match nothing, the
tokenizer's sha256) belong to the caller, which has a file system (``dataprep`` uses
Beam's ``FileSystems``).

Every mistake raises :class:`ConfigError` naming the field, e.g.
``sources[1].weight: must be >= 0, got -0.5``; an unknown key names the near allowed one
(``unknown key(s) ['wieght'] (did you mean 'weight' for 'wieght'?)``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import yaml

DEFAULT_SEQ_LEN = 8192
# 2**28 tokens a shard: 512 MiB of uint16 tokens for the packing step that holds one bucket
# on a distributed runner; 56k shards for 15T tokens (docs/dataprep.md, "Sizing").
DEFAULT_TARGET_SHARD_TOKENS = 2**28
DEFAULT_MAX_REJECTED_FRACTION = 0.5
MAX_SHARDS = 99999  # shard names have five digits (contract.manifest.shard_name)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A mixture config is malformed; the message names the field and the bad value."""


class SourceFormat(str, enum.Enum):
    JSONL = "jsonl"
    JSONL_GZ = "jsonl.gz"
    JSONL_ZST = "jsonl.zst"
    PARQUET = "parquet"
    TEXT = "text"


class DedupMode(str, enum.Enum):
    """What the pack does with exact duplicate documents (``dataprep.dedup``)."""

    OFF = "off"  # no text hash, nothing reported
    REPORT = "report"  # found and reported (manifest, summary, report.png), all packed
    EXACT = "exact"  # found, reported, and every copy but the first dropped before packing


class TextSplit(str, enum.Enum):
    FILE = "file"  # one document per file
    BLANK_LINES = "blank_lines"  # one document per blank-line separated block


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Attributes: path (str), sha256 (hex or None), add_bos, add_eos (bool)."""

    path: str
    sha256: Optional[str] = None
    add_bos: bool = False
    add_eos: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One source of the mixture.

    Attributes:
      name: unique source name, ``[A-Za-z0-9][A-Za-z0-9_.-]*``.
      paths: input paths or globs (absolute, or URLs such as ``gs://``).
      root: folder that document keys are made relative to.
      format: the input format.
      text_field: JSON field or Parquet column holding the text.
      id_field: JSON field or Parquet column holding the document's own id (a URL, say),
        carried into the provenance of every packed row; None: no id.
      text_split: for ``text`` sources, whole files or blank-line separated blocks.
      weight: share of rows (before normalization) in the first phase, >= 0.
    """

    name: str
    paths: tuple[str, ...]
    root: str
    format: SourceFormat
    text_field: str = "text"
    id_field: Optional[str] = "id"
    text_split: TextSplit = TextSplit.FILE
    weight: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseConfig:
    """From global step ``from_step`` on, rows are drawn with ``weights`` (by source name)."""

    from_step: int
    weights: Mapping[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    """A validated mixture config (see the module docstring for the YAML form).

    ``phases`` always starts with the phase at step 0 built from the sources' weights,
    followed by the config's own phases in increasing ``from_step``.

    ``shards_per_source`` is ``None`` unless the config sets it: then ``dataprep`` derives
    each source's shard count from the listed sizes of its input files and
    ``target_shard_tokens`` (``dataprep.sizing``). ``max_rejected_fraction`` in ``[0, 1]``:
    a source whose rejected documents exceed this share of those read fails the pack.
    ``dedup``: exact duplicate documents are reported (the default), dropped (``exact``)
    or not looked for (``off``); see ``dataprep.dedup``.
    """

    name: str
    version: int
    seq_len: int = DEFAULT_SEQ_LEN
    seed: int = 0
    shards_per_source: Optional[int] = None  # None: from the input size and target_shard_tokens
    target_shard_tokens: int = DEFAULT_TARGET_SHARD_TOKENS
    max_segments_per_row: int = 256
    max_rejected_fraction: float = DEFAULT_MAX_REJECTED_FRACTION
    dedup: DedupMode = DedupMode.REPORT
    tokenizer: TokenizerConfig
    sources: tuple[SourceConfig, ...]
    phases: tuple[PhaseConfig, ...]
    path: Optional[str] = None  # where it was loaded from; not part of its identity

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def source(self, name: str) -> SourceConfig:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"no source {name!r}; sources are {list(self.source_names)}")

    def to_dict(self) -> dict[str, Any]:
        """Returns the normalized config as plain JSON-able values (paths resolved).

        ``dedup`` is left out at its default (``report``), so that configs written before it
        existed keep their :meth:`sha256`.
        """
        out = {
            "name": self.name,
            "version": self.version,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shards_per_source": self.shards_per_source,
            "target_shard_tokens": self.target_shard_tokens,
            "max_segments_per_row": self.max_segments_per_row,
            "max_rejected_fraction": self.max_rejected_fraction,
            "tokenizer": dataclasses.asdict(self.tokenizer),
            "sources": [
                {
                    "name": s.name,
                    "paths": list(s.paths),
                    "root": s.root,
                    "format": s.format.value,
                    "text_field": s.text_field,
                    "id_field": s.id_field,
                    "text_split": s.text_split.value,
                    "weight": s.weight,
                }
                for s in self.sources
            ],
            "phases": [
                {"from_step": p.from_step, "weights": {k: p.weights[k] for k in sorted(p.weights)}}
                for p in self.phases
            ],
        }
        if self.dedup is not DedupMode.REPORT:
            out["dedup"] = self.dedup.value
        return out

    def sha256(self) -> str:
        """Returns the sha256 of the canonical JSON of :meth:`to_dict`."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


_TOP_KEYS = {
    "name", "version", "seq_len", "seed", "shards_per_source", "target_shard_tokens",
    "max_segments_per_row", "max_rejected_fraction", "dedup", "tokenizer", "sources", "phases",
}
_TOKENIZER_KEYS = {"path", "sha256", "add_bos", "add_eos"}
_SOURCE_KEYS = {"name", "paths", "root", "format", "text_field", "id_field", "text_split", "weight"}
_PHASE_KEYS = {"from_step", "weights"}
# Names that a source's folder in the dataset would collide with (compared lower-cased, for
# case-insensitive file systems): the dead-letter folder and the manifest.
_RESERVED_SOURCE_NAMES = {"errors", "manifest.json"}


def _is_url(path: str) -> bool:
    return "://" in path


def resolve_path(path: str, base_dir: Optional[str]) -> str:
    """Returns ``path`` made absolute against ``base_dir`` (URLs and absolute paths unchanged)."""
    path = os.path.expanduser(path)
    if _is_url(path) or os.path.isabs(path) or base_dir is None:
        return path if _is_url(path) else os.path.normpath(os.path.abspath(path))
    return os.path.normpath(os.path.join(base_dir, path))


def _glob_root(pattern: str) -> str:
    """The longest leading folder of ``pattern`` without glob characters."""
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    if head == pattern:  # no glob: the file's folder
        return pattern.rsplit("/", 1)[0] if "/" in pattern else "."
    return head.rsplit("/", 1)[0] if "/" in head else "."


def did_you_mean(unknown: Sequence[Any], allowed: Iterable[str]) -> str:
    """`` (did you mean 'a' for 'b'?)`` for the unknown names near an allowed one, else ``""``."""
    import difflib

    pairs = [(k, m[0]) for k in unknown if (m := difflib.get_close_matches(str(k), sorted(allowed), n=1))]
    if not pairs:
        return ""
    return " (did you mean " + ", ".join(f"{m!r} for {k!r}" for k, m in pairs) + "?)"


def _check_keys(where: str, got: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(got) - allowed, key=repr)  # keys of mixed types (1, "x") still sort
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}{did_you_mean(unknown, allowed)}; allowed keys are {sorted(allowed)}"
        )


def _int(where: str, value: Any, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")
    return value


def _weight(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{where}: must be finite, got {value}")
    if value < 0:
        raise ConfigError(f"{where}: must be >= 0, got {value}")
    return float(value)


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty string, got {value!r}")
    return value


def _check_weights(where: str, weights: Mapping[str, float]) -> None:
    if not any(w > 0 for w in weights.values()):
        raise ConfigError(f"{where}: all weights are zero; at least one source needs weight > 0")


def mixture_from_dict(raw: Any, base_dir: Optional[str] = None, path: Optional[str] = None) -> MixtureConfig:
    """Validates a parsed YAML/JSON mapping and returns the :class:`MixtureConfig`.

    Args:
      raw: the parsed document.
      base_dir: folder that relative paths are resolved against (the config's folder).
      path: where the config was read from, kept for messages.

    Raises:
      ConfigError: the first problem found, naming the field.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: must be a mapping, got {type(raw).__name__}")
    _check_keys("config", raw, _TOP_KEYS)
    for key in ("name", "version", "tokenizer", "sources"):
        if key not in raw:
            raise ConfigError(f"{key}: required")
    name = _str("name", raw["name"])
    if not _NAME_RE.match(name):
        raise ConfigError(f"name: must match {_NAME_RE.pattern}, got {name!r}")
    version = _int("version", raw["version"], 1)
    seq_len = _int("seq_len", raw.get("seq_len", DEFAULT_SEQ_LEN), 1)
    if seq_len > 2**31 - 1:
        raise ConfigError(f"seq_len: must be < 2**31, got {seq_len}")
    seed = _int("seed", raw.get("seed", 0), 0)
    shards = raw.get("shards_per_source")  # null (as to_dict() writes it) or "auto" = not set
    if shards == "auto":
        shards = None
    if shards is not None:
        if isinstance(shards, str):
            raise ConfigError(
                f"shards_per_source: must be an integer >= 1, or auto (or left out) for counts from the input "
                f"sizes and target_shard_tokens, got {shards!r}"
            )
        shards = _int("shards_per_source", shards, 1)
        if shards > MAX_SHARDS:
            raise ConfigError(f"shards_per_source: must be <= {MAX_SHARDS}, got {shards}")
    target = _int("target_shard_tokens", raw.get("target_shard_tokens", DEFAULT_TARGET_SHARD_TOKENS), 1)
    if target < seq_len:
        given = "" if "target_shard_tokens" in raw else " (the default)"
        raise ConfigError(
            f"target_shard_tokens: must be >= seq_len ({seq_len}), got {target}{given}; a shard holds whole rows: "
            f"set target_shard_tokens to at least {seq_len}"
        )
    max_segments = _int("max_segments_per_row", raw.get("max_segments_per_row", 256), 1)
    max_rejected = raw.get("max_rejected_fraction", DEFAULT_MAX_REJECTED_FRACTION)
    if isinstance(max_rejected, bool) or not isinstance(max_rejected, (int, float)) or not (
        0.0 <= max_rejected <= 1.0
    ):
        raise ConfigError(
            f"max_rejected_fraction: must be a number in [0, 1] (1 accepts any loss), got {max_rejected!r}"
        )

    dedup = raw.get("dedup", DedupMode.REPORT.value)
    if dedup is False:  # YAML 1.1 reads a bare off as false
        dedup = DedupMode.OFF.value
    try:
        dedup = DedupMode(dedup)
    except ValueError:
        allowed = [d.value for d in DedupMode]
        raise ConfigError(f"dedup: must be one of {allowed}, got {dedup!r}{did_you_mean([dedup], allowed)}") from None

    tok_raw = raw["tokenizer"]
    if not isinstance(tok_raw, Mapping):
        raise ConfigError(f"tokenizer: must be a mapping with path and sha256, got {tok_raw!r}")
    _check_keys("tokenizer", tok_raw, _TOKENIZER_KEYS)
    if "path" not in tok_raw:
        raise ConfigError("tokenizer.path: required")
    sha = tok_raw.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise ConfigError(f"tokenizer.sha256: must be 64 lowercase hex digits, got {sha!r}")
    for flag in ("add_bos", "add_eos"):
        if flag in tok_raw and not isinstance(tok_raw[flag], bool):
            raise ConfigError(f"tokenizer.{flag}: must be true or false, got {tok_raw[flag]!r}")
    tokenizer = TokenizerConfig(
        path=resolve_path(_str("tokenizer.path", tok_raw["path"]), base_dir),
        sha256=sha,
        add_bos=tok_raw.get("add_bos", False),
        add_eos=tok_raw.get("add_eos", True),
    )

    src_raw = raw["sources"]
    if not isinstance(src_raw, list) or not src_raw:
        raise ConfigError(f"sources: must be a non-empty list, got {src_raw!r}")
    sources = []
    seen: set[str] = set()
    for i, s in enumerate(src_raw):
        where = f"sources[{i}]"
        if not isinstance(s, Mapping):
            raise ConfigError(f"{where}: must be a mapping, got {s!r}")
        _check_keys(where, s, _SOURCE_KEYS)
        for key in ("name", "paths", "format"):
            if key not in s:
                raise ConfigError(f"{where}.{key}: required")
        sname = _str(f"{where}.name", s["name"])
        if not _NAME_RE.match(sname):
            raise ConfigError(f"{where}.name: must match {_NAME_RE.pattern}, got {sname!r}")
        if sname.lower() in _RESERVED_SOURCE_NAMES:
            raise ConfigError(
                f"{where}.name: {sname!r} is reserved (the dataset folder holds "
                f"{sorted(_RESERVED_SOURCE_NAMES)}); choose another name"
            )
        if sname in seen:
            raise ConfigError(f"{where}.name: duplicate source name {sname!r}")
        twin = next((n for n in seen if n.lower() == sname.lower()), None)
        if twin is not None:  # one folder on a case-insensitive file system (macOS, Windows)
            raise ConfigError(f"{where}.name: {sname!r} differs from source {twin!r} only in case")
        seen.add(sname)
        paths = s["paths"]
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list) or not paths:
            raise ConfigError(f"{where}.paths: must be a non-empty list of paths or globs, got {paths!r}")
        paths = tuple(resolve_path(_str(f"{where}.paths[{j}]", p), base_dir) for j, p in enumerate(paths))
        try:
            fmt = SourceFormat(s["format"])
        except ValueError:
            allowed = [f.value for f in SourceFormat]
            raise ConfigError(
                f"{where}.format: must be one of {allowed}, got {s['format']!r}{did_you_mean([s['format']], allowed)}"
            ) from None
        try:
            split = TextSplit(s.get("text_split", TextSplit.FILE.value))
        except ValueError:
            raise ConfigError(
                f"{where}.text_split: must be one of {[t.value for t in TextSplit]}, got {s['text_split']!r}"
            ) from None
        # The default value is accepted on any format, so that ``to_dict()`` (which writes it for
        # every source, e.g. into manifest.json) reads back through this function.
        if "text_split" in s and fmt is not SourceFormat.TEXT and split is not TextSplit.FILE:
            raise ConfigError(f"{where}.text_split: only applies to format 'text', not {fmt.value!r}")
        if "root" in s:
            root = resolve_path(_str(f"{where}.root", s["root"]), base_dir)
        else:
            roots = {_glob_root(p) for p in paths}
            root = os.path.commonpath(sorted(roots)) if not any(map(_is_url, roots)) else sorted(roots)[0]
            if len(roots) > 1 and any(map(_is_url, roots)):
                raise ConfigError(f"{where}.root: required when paths span several URL folders {sorted(roots)}")
        id_field = s.get("id_field", "id")
        if id_field is not None:
            id_field = _str(f"{where}.id_field", id_field)
        sources.append(
            SourceConfig(
                name=sname,
                paths=paths,
                root=root.rstrip("/") or "/",
                format=fmt,
                text_field=_str(f"{where}.text_field", s.get("text_field", "text")),
                id_field=id_field,
                text_split=split,
                weight=_weight(f"{where}.weight", s.get("weight", 1.0)),
            )
        )
    base_weights = {s.name: s.weight for s in sources}
    _check_weights("sources[*].weight", base_weights)
    phases = [PhaseConfig(from_step=0, weights=base_weights)]
    ph_raw = raw.get("phases", []) or []
    if not isinstance(ph_raw, list):
        raise ConfigError(f"phases: must be a list, got {ph_raw!r}")
    for i, p in enumerate(ph_raw):
        where = f"phases[{i}]"
        if not isinstance(p, Mapping):
            raise ConfigError(f"{where}: must be a mapping, got {p!r}")
        _check_keys(where, p, _PHASE_KEYS)
        if "from_step" not in p or "weights" not in p:
            raise ConfigError(f"{where}: needs from_step and weights")
        if i == 0 and p["from_step"] == 0 and not isinstance(p["from_step"], bool):
            # ``to_dict()`` writes the step-0 phase (the sources' weights) first; accept it back
            # when it says the same as the sources, so that a normalized config round-trips.
            w0 = p["weights"]
            if isinstance(w0, Mapping):
                unknown = sorted(set(w0) - seen, key=repr)
                if unknown:
                    raise ConfigError(
                        f"{where}.weights: unknown source(s) {unknown}; sources are {sorted(seen)}"
                    )
                w0 = {n: _weight(f"{where}.weights.{n}", w0.get(n, 0.0)) for n in base_weights}
            if not isinstance(w0, Mapping) or w0 != base_weights:
                raise ConfigError(f"{where}: a phase at step 0 must repeat the sources' weights {base_weights}, "
                                  f"got {w0!r}; set sources[*].weight instead")
            continue
        step = _int(f"{where}.from_step", p["from_step"], 1)
        if step <= phases[-1].from_step:
            raise ConfigError(
                f"{where}.from_step: must be greater than the previous phase's {phases[-1].from_step}, got {step}"
            )
        w = p["weights"]
        if not isinstance(w, Mapping):
            raise ConfigError(f"{where}.weights: must be a mapping of source name to weight, got {w!r}")
        unknown = sorted(set(w) - seen, key=repr)
        if unknown:
            raise ConfigError(
                f"{where}.weights: unknown source(s) {unknown}{did_you_mean(unknown, seen)}; sources are {sorted(seen)}"
            )
        weights = {n: _weight(f"{where}.weights.{n}", w.get(n, 0.0)) for n in base_weights}
        _check_weights(f"{where}.weights", weights)
        phases.append(PhaseConfig(from_step=step, weights=weights))
    return MixtureConfig(
        name=name,
        version=version,
        seq_len=seq_len,
        seed=seed,
        shards_per_source=shards,
        target_shard_tokens=target,
        max_segments_per_row=max_segments,
        max_rejected_fraction=float(max_rejected),
        dedup=dedup,
        tokenizer=tokenizer,
        sources=tuple(sources),
        phases=tuple(phases),
        path=path,
    )


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping.

    Plain YAML loading keeps the last value silently, so ``weight: 0.9`` followed further
    down by ``weight: 0.1`` would be a mistake nobody sees.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r} (first at line {seen[key].line + 1})", key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_mixture(path: str) -> MixtureConfig:
    """Reads and validates a mixture config from a local YAML file.

    Raises:
      ConfigError: the file is missing, is not YAML (or repeats a key in one mapping), or
        fails validation.
    """
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return mixture_from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)), path=path)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
