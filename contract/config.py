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
from typing import Annotated, Any, Callable, Literal, Mapping, Optional, Sequence, Union

import pydantic
import yaml
from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic_core import PydanticCustomError

from contract.validation import describe, did_you_mean, first_error, json_schema, says, where

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

    OFF = "off"  # no document hashed, nothing reported
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


# --------------------------------------------------------------------------- the file's schema
#
# What a user writes, declared once as pydantic models: each key's type, range and allowed values,
# its default, and which keys exist. pydantic validates a parsed file against them, and they are
# published as JSON Schema (:func:`mixture_json_schema`, kept in ``schemas/mixture.schema.json``).
# Each field carries the message its mistakes get (``_says``), so that an error names the key path
# and the bad value in the words of the module docstring; what needs several keys at once (unique
# names, phase order, paths resolved against the file's folder) is :func:`mixture_from_dict`'s.


def _int_message(minimum: int, maximum: Optional[int] = None, above: str = "must be <= {maximum}") -> Callable:
    def say(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an integer, got {v!r}"
        if v < minimum:
            return f"must be >= {minimum}, got {v}"
        return above.format(maximum=maximum) + f", got {v}"

    return say


def _Int(minimum: int, maximum: Optional[int] = None, above: str = "must be <= {maximum}") -> Any:
    return Annotated[StrictInt, Field(ge=minimum, le=maximum), says(_int_message(minimum, maximum, above))]


def _weight_message(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a number, got {v!r}"
    if v != v or v in (float("inf"), float("-inf")):
        return f"must be finite, got {v}"
    return f"must be >= 0, got {v}"


def _enum_message(enum: type[enum.Enum]) -> Callable[[Any], str]:
    allowed = [e.value for e in enum]
    return lambda v: f"must be one of {allowed}, got {v!r}{did_you_mean([v], allowed)}"


_NonEmptyText = Annotated[str, Field(min_length=1)]  # as the JSON Schema of a value before its conversion says it
_NonEmpty = Annotated[StrictStr, Field(min_length=1), says(lambda v: f"must be a non-empty string, got {v!r}")]
_Name = Annotated[StrictStr, Field(min_length=1, pattern=_NAME_RE.pattern),
                  says(lambda v: f"must match {_NAME_RE.pattern}, got {v!r}" if isinstance(v, str) and v else
                        f"must be a non-empty string, got {v!r}")]
_Weight = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False), says(_weight_message)]
_Flag = Annotated[StrictBool, says(lambda v: f"must be true or false, got {v!r}")]
_FILE = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TokenizerFile(pydantic.BaseModel):
    """``tokenizer:``: the SentencePiece model."""

    model_config = _FILE
    path: _NonEmpty
    """the model file; a relative path is relative to the config's folder"""
    sha256: Optional[Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$"),
                               says(lambda v: f"must be 64 lowercase hex digits, got {v!r}")]] = None
    """the model file's expected sha256 (optional but advised: ``train_tokenizer --pin`` writes it)"""
    add_bos: _Flag = False
    add_eos: _Flag = True


class SourceFile(pydantic.BaseModel):
    """One entry of ``sources:``."""

    model_config = _FILE
    name: _Name
    """unique source name (not ``errors`` or ``manifest.json``)"""
    paths: Annotated[list[_NonEmpty], Field(min_length=1),
                     BeforeValidator(lambda v: [v] if isinstance(v, str) else v,
                                     json_schema_input_type=Union[_NonEmptyText, Annotated[list[_NonEmptyText], Field(min_length=1)]]),
                     says(lambda v: f"must be a non-empty list of paths or globs, got {v!r}",
                           when=lambda v: not isinstance(v, (str, list)) or not v)]
    """input paths or globs (absolute, relative to the config's folder, or URLs such as gs://); one string or a list"""
    root: Optional[_NonEmpty] = None
    """the folder document keys are relative to (default: the common folder of ``paths``)"""
    format: Annotated[SourceFormat, says(_enum_message(SourceFormat))]
    text_field: _NonEmpty = "text"
    """the JSON field or Parquet column holding the text"""
    id_field: Optional[_NonEmpty] = "id"
    """the field or column holding the document's own id (a URL, say), kept in each row's provenance; null: none"""
    text_split: Annotated[TextSplit, says(_enum_message(TextSplit))] = TextSplit.FILE
    """text format only: one document per file, or per blank-line separated block"""
    weight: _Weight = 1.0
    """share of rows (before normalization) in the first phase"""

    @pydantic.field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.lower() in _RESERVED_SOURCE_NAMES:
            raise PydanticCustomError("config", f"{name!r} is reserved (the dataset folder holds "
                                      f"{sorted(_RESERVED_SOURCE_NAMES)}); choose another name")
        return name


class PhaseFile(pydantic.BaseModel):
    """One entry of ``phases:``: from global step ``from_step`` on, rows are drawn with ``weights``."""

    model_config = _FILE
    from_step: Annotated[StrictInt, Field(ge=0), says(_int_message(1))]
    """> the previous phase's; 0 only for a first phase that repeats the sources' weights"""
    weights: Annotated[dict[str, _Weight], says(lambda v: f"must be a mapping of source name to weight, got {v!r}",
                                                 when=lambda v: not isinstance(v, Mapping))]
    """by source name; a source left out has weight 0"""


class MixtureFile(pydantic.BaseModel):
    """A mixture config file (YAML): what goes into one dataset version (contract/config.py)."""

    model_config = _FILE
    name: _Name
    """dataset name"""
    version: _Int(1)
    """bump on any change that alters the packed output"""
    seq_len: _Int(1, 2**31 - 1, "must be < 2**31") = DEFAULT_SEQ_LEN
    """slots per packed row"""
    seed: _Int(0) = 0
    """seeds bucketing here and shuffling in the loader"""
    shards_per_source: Annotated[
        Optional[Annotated[StrictInt, Field(ge=1, le=MAX_SHARDS)]],
        BeforeValidator(lambda v: None if v == "auto" else v,
                        json_schema_input_type=Union[Annotated[int, Field(ge=1, le=MAX_SHARDS)], Literal["auto"], None]),
        says(lambda v: (f"must be an integer >= 1, or auto (or left out) for counts from the input sizes and "
                         f"target_shard_tokens, got {v!r}") if isinstance(v, str) else _int_message(1, MAX_SHARDS)(v)),
    ] = None
    """exactly this many shards per source; auto or left out: from the input sizes and target_shard_tokens"""
    target_shard_tokens: _Int(1) = DEFAULT_TARGET_SHARD_TOKENS
    """tokens a shard holds at most (>= seq_len)"""
    max_segments_per_row: _Int(1) = 256
    """cap on documents (segments) packed into one row"""
    max_rejected_fraction: Annotated[
        float, Field(ge=0, le=1, strict=True, allow_inf_nan=False),
        says(lambda v: f"must be a number in [0, 1] (1 accepts any loss), got {v!r}")] = DEFAULT_MAX_REJECTED_FRACTION
    """a source rejecting more of its documents fails the pack"""
    dedup: Annotated[DedupMode, BeforeValidator(lambda v: DedupMode.OFF.value if v is False else v,  # YAML 1.1: off
                                                json_schema_input_type=Union[DedupMode, Literal[False]]),
                     says(_enum_message(DedupMode))] = DedupMode.REPORT
    """exact duplicate documents: off, report (found and reported, all packed) or exact (dropped)"""
    tokenizer: TokenizerFile
    sources: Annotated[list[SourceFile], Field(min_length=1)]
    phases: Optional[list[PhaseFile]] = None
    """optional: from step S, these weights"""


def mixture_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a mixture config file, from :class:`MixtureFile`."""
    return json_schema(MixtureFile, "mixture config")


def _message(errors: list[dict[str, Any]], raw: Mapping[str, Any]) -> str:
    """The first problem of pydantic's ``errors`` (``contract.validation.first_error``: in the order a
    reader of the file meets them), said in the mixture's words."""
    err = first_error(errors, MixtureFile)
    loc = err["loc"]
    if "[key]" in loc and loc[0] == "phases":  # a phase's weight under a name that is no string
        i, w = loc[1], raw["phases"][loc[1]]["weights"]
        names = {s.get("name") for s in raw["sources"] if isinstance(s, Mapping)}
        unknown = sorted(set(w) - names, key=repr)
        return (f"phases[{i}].weights: unknown source(s) {unknown}{did_you_mean(unknown, map(str, names))}; "
                f"sources are {sorted(names, key=repr)}")
    if err["type"] == "missing" and loc[0] == "phases" and len(loc) > 1:
        return f"{where(loc[:-1])}: needs from_step and weights"
    if err["type"] in ("model_type", "dict_type", "model_attributes_type") and tuple(loc) == ("tokenizer",):
        return f"tokenizer: must be a mapping with path and sha256, got {err['input']!r}"
    if err["type"] in ("list_type", "too_short") and tuple(loc) in (("sources",), ("phases",)):
        return f"{where(loc)}: must be a {'non-empty ' if loc[0] == 'sources' else ''}list, got {err['input']!r}"
    return describe(err, errors, MixtureFile)


def _check_weights(where: str, weights: Mapping[str, float]) -> None:
    if not any(w > 0 for w in weights.values()):
        raise ConfigError(f"{where}: all weights are zero; at least one source needs weight > 0")


def mixture_from_dict(raw: Any, base_dir: Optional[str] = None, path: Optional[str] = None) -> MixtureConfig:
    """Validates a parsed YAML/JSON mapping and returns the :class:`MixtureConfig`.

    Each key is checked by the file's schema (:class:`MixtureFile`, pydantic); then what ties keys
    together: unique source names, ``target_shard_tokens >= seq_len``, phases in increasing steps
    over known sources, some weight > 0; paths are resolved against ``base_dir``.

    Args:
      raw: the parsed document.
      base_dir: folder that relative paths are resolved against (the config's folder).
      path: where the config was read from, kept for messages.

    Raises:
      ConfigError: the first problem found, naming the key path (``sources[1].weight``) and the
        bad value, with the nearest allowed name for an unknown one.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: must be a mapping, got {type(raw).__name__}")
    try:
        f = MixtureFile.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(_message(e.errors(include_url=False), raw)) from None
    if f.target_shard_tokens < f.seq_len:
        given = "" if "target_shard_tokens" in raw else " (the default)"
        raise ConfigError(
            f"target_shard_tokens: must be >= seq_len ({f.seq_len}), got {f.target_shard_tokens}{given}; a shard holds "
            f"whole rows: set target_shard_tokens to at least {f.seq_len}"
        )
    tokenizer = TokenizerConfig(path=resolve_path(f.tokenizer.path, base_dir), sha256=f.tokenizer.sha256,
                                add_bos=f.tokenizer.add_bos, add_eos=f.tokenizer.add_eos)
    sources = [_source(f"sources[{i}]", s, base_dir, f.sources[:i]) for i, s in enumerate(f.sources)]
    base_weights = {s.name: s.weight for s in sources}
    _check_weights("sources[*].weight", base_weights)
    return MixtureConfig(
        name=f.name,
        version=f.version,
        seq_len=f.seq_len,
        seed=f.seed,
        shards_per_source=f.shards_per_source,
        target_shard_tokens=f.target_shard_tokens,
        max_segments_per_row=f.max_segments_per_row,
        max_rejected_fraction=float(f.max_rejected_fraction),
        dedup=f.dedup,
        tokenizer=tokenizer,
        sources=tuple(sources),
        phases=_phases(f.phases or [], base_weights),
        path=path,
    )


def _source(where: str, s: SourceFile, base_dir: Optional[str], before: Sequence[SourceFile]) -> SourceConfig:
    """One source, its name checked against the sources ``before`` it and its paths resolved."""
    seen = {b.name for b in before}
    if s.name in seen:
        raise ConfigError(f"{where}.name: duplicate source name {s.name!r}")
    twin = next((n for n in seen if n.lower() == s.name.lower()), None)
    if twin is not None:  # one folder on a case-insensitive file system (macOS, Windows)
        raise ConfigError(f"{where}.name: {s.name!r} differs from source {twin!r} only in case")
    paths = tuple(resolve_path(p, base_dir) for p in s.paths)
    # The default value is accepted on any format, so that ``to_dict()`` (which writes it for
    # every source, e.g. into manifest.json) reads back through this function.
    if "text_split" in s.model_fields_set and s.format is not SourceFormat.TEXT and s.text_split is not TextSplit.FILE:
        raise ConfigError(f"{where}.text_split: only applies to format 'text', not {s.format.value!r}")
    if s.root is not None:
        root = resolve_path(s.root, base_dir)
    else:
        roots = {_glob_root(p) for p in paths}
        root = os.path.commonpath(sorted(roots)) if not any(map(_is_url, roots)) else sorted(roots)[0]
        if len(roots) > 1 and any(map(_is_url, roots)):
            raise ConfigError(f"{where}.root: required when paths span several URL folders {sorted(roots)}")
    return SourceConfig(name=s.name, paths=paths, root=root.rstrip("/") or "/", format=s.format,
                        text_field=s.text_field, id_field=s.id_field, text_split=s.text_split, weight=float(s.weight))


def _phases(given: Sequence[PhaseFile], base_weights: Mapping[str, float]) -> tuple[PhaseConfig, ...]:
    """The step-0 phase of the sources' weights, then the config's phases, checked in order."""
    names = set(base_weights)
    phases = [PhaseConfig(from_step=0, weights=dict(base_weights))]
    for i, p in enumerate(given):
        where = f"phases[{i}]"
        unknown = sorted(set(p.weights) - names, key=repr)
        if i == 0 and p.from_step == 0:
            # ``to_dict()`` writes the step-0 phase (the sources' weights) first; accept it back
            # when it says the same as the sources, so that a normalized config round-trips.
            if unknown:
                raise ConfigError(f"{where}.weights: unknown source(s) {unknown}; sources are {sorted(names)}")
            w0 = {n: float(p.weights.get(n, 0.0)) for n in base_weights}
            if w0 != base_weights:
                raise ConfigError(f"{where}: a phase at step 0 must repeat the sources' weights {dict(base_weights)}, "
                                  f"got {w0!r}; set sources[*].weight instead")
            continue
        if p.from_step < 1:
            raise ConfigError(f"{where}.from_step: must be >= 1, got {p.from_step}")
        if p.from_step <= phases[-1].from_step:
            raise ConfigError(
                f"{where}.from_step: must be greater than the previous phase's {phases[-1].from_step}, got {p.from_step}"
            )
        if unknown:
            raise ConfigError(f"{where}.weights: unknown source(s) {unknown}{did_you_mean(unknown, names)}; "
                              f"sources are {sorted(names)}")
        weights = {n: float(p.weights.get(n, 0.0)) for n in base_weights}
        _check_weights(f"{where}.weights", weights)
        phases.append(PhaseConfig(from_step=p.from_step, weights=weights))
    return tuple(phases)


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
