"""The schema layer's shared parts: files and records declared once on pydantic v2, their mistakes
said the way a reader of the file meets them.

Every config file and every record of the toolkit (the mixture config, the manifest, the run config and
its sections, the run-log records) is declared as pydantic classes; pydantic validates a parsed file
against them and publishes them as JSON Schema (``schemas/``). This module holds what those declarations
share, so that each says its mistakes alike:

* :func:`says`: a field's own message for a value its type rejects (``must be an int >= 1, got 0``);
* :func:`problem`: the first of pydantic's errors, in the order a reader meets them (a mapping's unknown
  keys, then its missing ones, then each value in the declaration's order), as ``<key path>: <what is
  wrong>``, with the nearest allowed name for an unknown key (:func:`did_you_mean`);
* :func:`section`: a config section as a frozen pydantic dataclass that raises its own error class,
  with ``from_dict`` and ``to_dict``.

Why pydantic rather than msgspec: both validate and both give a JSON Schema, but pydantic already holds
this toolkit's mixture and manifest declarations, lets a field carry its own message and a validator see
the keys before it (``top_k <= n_experts``), keeps a wrong value's key path in its errors, and is in
Apache Beam's worker container already (docs/design.md, "One schema layer"). msgspec is faster at
decoding JSON, which the run log does not need: its lines are parsed by the standard library and only
validated here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping, NamedTuple, Optional, Sequence

import pydantic
from pydantic import ConfigDict, Field, StrictInt, WrapValidator
from pydantic_core import PydanticCustomError

UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument", "invalid_key")
MISSING = ("missing", "missing_argument", "missing_keyword_only_argument", "missing_positional_only_argument")


def did_you_mean(unknown: Sequence[Any], allowed: Iterable[str]) -> str:
    """`` (did you mean 'a' for 'b'?)`` for the unknown names near an allowed one, else ``""``."""
    pairs = [(k, m[0]) for k in unknown if (m := difflib.get_close_matches(str(k), sorted(allowed), n=1))]
    if not pairs:
        return ""
    return " (did you mean " + ", ".join(f"{m!r} for {k!r}" for k, m in pairs) + "?)"


def says(message: Callable[[Any], str], when: Optional[Callable[[Any], bool]] = None) -> WrapValidator:
    """The field's own message for a value its type rejects: ``message(value)`` (only ``when(value)``:
    else the error of the part inside, an item of a list say, stands)."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except pydantic.ValidationError:
            if when is not None and not when(value):
                raise
            raise PydanticCustomError("config", message(value)) from None

    return WrapValidator(check)


def refuse(message: str, at: Sequence[Any] = (), whole: bool = False) -> PydanticCustomError:
    """The error a validator raises for a value that needs other keys to judge: ``message`` said at the
    field's key path, extended by ``at`` (``("rows",)``: the ``rows`` key of the section validated);
    ``whole``: ``message`` is a whole message already, key path included (a section's own problem)."""
    return PydanticCustomError("config", "{message}", {"message": message, "at": tuple(at), "whole": whole})


def is_number(v: Any) -> bool:
    """An int or a float, not a bool (YAML's true is no number)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def Int(allowed: str, **constraints: Any) -> Any:
    """An int field (a bool is none) with pydantic's ``constraints`` (``ge=1``), whose mistakes say
    ``must be <allowed>, got <value>`` (``allowed``: ``"an int >= 1"``)."""
    return Annotated[StrictInt, Field(**constraints), says(lambda v: f"must be {allowed}, got {v!r}")]


def Number(allowed: str, **constraints: Any) -> Any:
    """A number field (an int is taken as a float; a bool or a string is no number) with pydantic's
    ``constraints`` (``gt=0``), whose mistakes say ``must be a number, got 'x'`` or ``must be <allowed>,
    got <value>`` (``allowed``: ``"> 0"``)."""
    return Annotated[float, Field(strict=True, **constraints),
                     says(lambda v: f"must be {allowed}, got {v!r}" if is_number(v) else f"must be a number, got {v!r}")]


def IntUpTo(minimum: int, key: str) -> Any:
    """An int field in ``[minimum, <the value of the earlier field key>]`` (``top_k <= n_experts``), whose
    mistakes say ``must be an int in [1, n_experts=4], got 9``."""

    def check(v: Any, handler: Callable[[Any], Any], info: pydantic.ValidationInfo) -> int:
        top = info.data.get(key, key)
        said = f"must be an int in [{minimum}, {key}={top}], got {v!r}"
        try:
            v = handler(v)
        except pydantic.ValidationError:
            raise refuse(said) from None
        if isinstance(top, int) and v > top:
            raise refuse(said)
        return v

    return Annotated[StrictInt, Field(ge=minimum), WrapValidator(check)]


def OneOf(values: Sequence[str], allowed: Optional[str] = None) -> Any:
    """A string field that takes one of ``values``; its mistakes say ``must be <allowed>, got <value>``
    (``allowed`` default: ``one of [...]``), with the nearest of ``values``."""
    allowed = allowed or f"one of {list(values)}"
    return Annotated[Literal[tuple(values)], says(lambda v: f"must be {allowed}, got {v!r}{did_you_mean([v], values)}")]


class Wording(NamedTuple):
    """How one kind of file words its mistakes (the mixture config and the run config grew apart).

    ``root``: the name of the whole mapping (``"config"``; ``""``: unnamed); ``unknown`` and ``allowed``:
    the words before the unknown keys and the allowed ones; ``missing``: ``None`` says each missing key
    as ``<key>: required``, else the words before the list of all of a mapping's missing keys."""

    root: str = "config"
    unknown: str = "unknown key(s)"
    allowed: str = "allowed keys are"
    missing: Optional[str] = None


MIXTURE = Wording()
"""The mixture config's words (``contract.config``)."""
RUN_CONFIG = Wording(root="", unknown="unknown keys", allowed="allowed:", missing="missing keys")
"""The run config's words (``replay.reference.run``; its sections: model, optimizer, router_health, ...)."""


# --------------------------------------------------------------------------- where a key is declared


def _unwrap(annotation: Any) -> Any:
    """``annotation`` without ``Annotated[...]`` and without ``None`` of an ``Optional``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def fields_of(cls: Any) -> dict[str, Any]:
    """The declared fields (name -> annotation, in declaration order) of a pydantic model, a dataclass
    (pydantic's or the standard library's) or a ``TypedDict``; ``{}`` for anything else."""
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        return {n: f.annotation for n, f in cls.model_fields.items()}
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        own = getattr(cls, "__pydantic_fields__", None)
        if isinstance(own, dict):
            return {n: f.annotation for n, f in own.items()}
        hints = _hints(cls)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}
    if typing.is_typeddict(cls):
        return dict(_hints(cls))
    return {}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def model_at(root: Any, loc: Sequence[Any]) -> Any:
    """The model class declared at key path ``loc`` under ``root`` (through lists, tuples, mappings and
    ``Optional``), or ``None`` where the path reaches no model."""
    annotation: Any = root
    for part in loc:
        annotation = _unwrap(annotation)
        fields = fields_of(annotation)
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if fields:
            annotation = fields.get(part) if isinstance(part, str) else None
        elif origin in (list, tuple, set, frozenset) or _is_abc(origin, "Sequence"):
            if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
                annotation = args[part] if isinstance(part, int) and part < len(args) else None
            else:
                annotation = args[0] if args else None
        elif origin is dict or _is_abc(origin, "Mapping"):
            annotation = (args[0] if part == "[key]" else args[1]) if len(args) == 2 else None
        else:
            return None
    annotation = _unwrap(annotation)
    return annotation if fields_of(annotation) else None


def _is_abc(origin: Any, name: str) -> bool:
    import collections.abc

    return origin is getattr(collections.abc, name)


def field_names(cls: Any) -> list[str]:
    return list(fields_of(cls)) if cls is not None else []


# --------------------------------------------------------------------------- the first problem, said


def where(loc: Sequence[Any], prefix: str = "") -> str:
    """``("sources", 1, "weight")`` -> ``"sources[1].weight"``, under ``prefix`` when given (``"model"``:
    ``"model.top_k"``)."""
    out = prefix
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _loc(err: Mapping[str, Any]) -> tuple:
    ctx = err.get("ctx") or {}
    return tuple(err["loc"]) + tuple(ctx.get("at", ()))


def first_error(errors: list[dict[str, Any]], root: Any) -> dict[str, Any]:
    """The error a reader of the file meets first: by key path, each mapping's unknown keys before its
    missing ones before its values, keys in the declaration's order (``root``: the declared class)."""
    for e in errors:  # a key that is no string (YAML's 1: 2) is an unknown key like any other
        if e["type"] == "invalid_key":
            e["type"] = "extra_forbidden"

    def rank(err: dict[str, Any]) -> tuple:
        loc, key = _loc(err), []
        for depth in range(len(loc) + 1):
            parent, here = loc[:depth], loc[depth] if depth < len(loc) else None
            if isinstance(here, int) or here is None:
                key.append((0, here or 0))
                continue
            fields = field_names(model_at(root, parent))
            last = depth == len(loc) - 1
            kind = 0 if last and err["type"] in UNKNOWN else 1 if last and err["type"] in MISSING else 2
            key.append((kind, fields.index(here) if here in fields else len(fields)))
        return tuple(key)

    return min(errors, key=rank)


def describe(err: dict[str, Any], errors: list[dict[str, Any]], root: Any, wording: Wording = MIXTURE,
             prefix: str = "") -> str:
    """``err`` (one of pydantic's ``errors`` of a file declared by ``root``) as ``<key path>: <what is
    wrong>``: the unknown keys of its mapping (with :func:`did_you_mean` and the allowed keys), its
    missing keys, a value that is no mapping, or the field's own message (:func:`says`). ``prefix``: the
    key path of ``root`` itself (``"model"`` for the run config's ``model:`` built alone)."""
    loc = _loc(err)
    parent = loc[:-1]
    if (err.get("ctx") or {}).get("whole"):
        return err["msg"]
    head = where(parent, prefix) or wording.root
    if err["type"] in UNKNOWN:
        unknown = sorted((e["loc"][-1] for e in errors if e["type"] in UNKNOWN and tuple(e["loc"][:-1]) == parent),
                         key=repr)  # keys of mixed types (1, "x") still sort
        allowed = set(field_names(model_at(root, parent)))
        return (f"{head + ': ' if head else ''}{wording.unknown} {unknown}{did_you_mean(unknown, allowed)}; "
                f"{wording.allowed} {sorted(allowed)}")
    if err["type"] in MISSING:
        if wording.missing is None:
            return f"{where(loc, prefix)}: required"
        missing = [f for f in field_names(model_at(root, parent))
                   if any(e["type"] in MISSING and tuple(e["loc"]) == (*parent, f) for e in errors)]
        return f"{head + ': ' if head else ''}{wording.missing} {missing}"
    if err["type"] in ("model_type", "dict_type", "model_attributes_type", "dataclass_type", "dataclass_args_type"):
        return f"{where(loc, prefix) or wording.root}: must be a mapping, got {err['input']!r}"
    return f"{where(loc, prefix) or wording.root}: {err['msg']}"


def problem(e: pydantic.ValidationError, root: Any, wording: Wording = MIXTURE, prefix: str = "") -> str:
    """The first problem of ``e`` (:func:`first_error`), said by :func:`describe`."""
    errors = e.errors(include_url=False)
    return describe(first_error(errors, root), errors, root, wording, prefix)


# --------------------------------------------------------------------------- config sections

SECTION = ConfigDict(extra="forbid", use_attribute_docstrings=True, ser_json_inf_nan="constants")  # frozen: the dataclass's


def section(name: str, error: type[Exception], wording: Wording = RUN_CONFIG) -> Callable[[type], type]:
    """A class decorator: the class as a frozen, keyword-only pydantic dataclass (unknown keys refused)
    that is the section ``name`` of a config file, raising ``error`` (a ``ValueError`` subclass) with the
    key path under ``name`` (``optimizer.b2: must be in [0, 1), got 1.5``) wherever it is built:
    ``Cls(**fields)``, ``dataclasses.replace``, or ``Cls.from_dict(mapping)``. ``Cls.to_dict()`` (unless the
    class defines its own) gives its fields as plain values (pydantic's serialization: tuples as lists,
    NaN and infinities kept).

    The same class is a field of the file's declaration (the run config's ``optimizer:``): there pydantic
    validates it in place and the file's :func:`problem` says its mistakes with the same key path."""

    def decorate(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=SECTION)(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except pydantic.ValidationError as e:
                raise error(problem(e, cls, wording, name)) from None

        def from_dict(klass: type, d: Optional[Mapping[str, Any]]) -> Any:
            """An instance from a parsed mapping (``None``: the defaults).

            Raises:
              the section's error: an unknown key (the nearest allowed one named), a missing one, a value
                out of range (key path, value and the allowed range)."""
            if d is not None and not isinstance(d, Mapping):
                raise error(f"{name}: must be a mapping, got {d!r}")
            try:
                return adapter(klass).validate_python(dict(d or {}))
            except pydantic.ValidationError as e:
                raise error(problem(e, klass, wording, name)) from None

        def to_dict(self: Any) -> dict[str, Any]:
            """The section as written to a file: plain values, keys in the declaration's order."""
            return adapter(type(self)).dump_python(self, mode="json")

        cls.__init__ = __init__
        cls.from_dict = classmethod(from_dict)
        if "to_dict" not in cls.__dict__:  # a section that writes itself otherwise keeps its own
            cls.to_dict = to_dict
        return cls

    return decorate


@functools.cache
def adapter(cls: Any) -> pydantic.TypeAdapter:
    """The (cached) ``TypeAdapter`` of a declared class."""
    return pydantic.TypeAdapter(cls)


def json_schema(cls: Any, title: str, description: Optional[str] = None, mode: str = "validation") -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a declared class, titled."""
    out = {"$schema": "https://json-schema.org/draft/2020-12/schema", **adapter(cls).json_schema(mode=mode),
           "title": title}
    if description:
        out["description"] = description
    return out
