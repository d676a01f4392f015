"""What replay needs to rebuild a run: its trainer, mesh and loader (:class:`RunSetup`), and the run's
trainer factory that makes it.

A trainer, the reference one or a user's, hands replay one :class:`RunSetup`; every ``replay``
command rebuilds batches and steps through it. Replay finds it through the run config's
``trainer:`` key, which names a *factory* ``"package.module:function"``::

    # <run>/run_config.yaml of a user's trainer
    trainer: mypackage.replay_setup:make_setup

    # mypackage/replay_setup.py
    from replay.run.setup import RunSetup, mesh_record

    def make_setup(run) -> RunSetup:           # run: replay.run.runlog.RunLog (config, env, run_dir)
        axis_names, shape, device_ids = mesh_record(run)
        return RunSetup(trainer=MyTrainer(**run.config["model"]), axis_names=axis_names, shape=shape,
                        run_device_ids=device_ids, make_loader=lambda mesh: my_loader(run.config, mesh),
                        seed=run.config["seed"], global_batch=run.config["global_batch"])

A run config without ``trainer:`` is a run of the reference trainer (its factory
:data:`REFERENCE_FACTORY`, ``replay.reference.setup:make_setup``). The factory is imported by name
(``importlib``), so the rooms of ``replay`` that read runs (``verify``, ``screen``) never import a
trainer: the trainer sits above them, like a user's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
import types
import typing
from typing import Annotated, Any, Callable, Mapping, Optional

import numpy as np
import pydantic
from typing_extensions import NotRequired, TypedDict  # pydantic's TypedDict before Python 3.12 (a pydantic dependency)

from contract.validation import MISSING, UNKNOWN, adapter, did_you_mean, first_error, where
from replay.run.runlog import RunDirError

TRAINER_KEY = "trainer"
REFERENCE_FACTORY = "replay.reference.setup:make_setup"
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_TRAINER_METHODS = ("init_state", "restore", "train_step")


class RunConfigError(RunDirError):
    """A run config that a trainer's config class cannot take (:func:`config_from`): not a mapping, an
    unknown or missing key, a value of the wrong type; the message names the file and the key."""


class TrainerFactoryError(RunDirError):
    """The run's trainer factory cannot be imported, is not callable, fails, or returns something
    other than a :class:`RunSetup`; the message names the factory, the run config and what to do."""


@dataclasses.dataclass
class RunSetup:
    """How to rebuild a run's trainer, mesh and loader (read from its run config once).

    Attributes:
      trainer: an object implementing ``replay.run.protocol.Trainer`` (``init_state``, ``restore``,
        ``train_step``; drills also use ``leaf_paths``, ``leaf_sizes``, ``leaf_dtypes``, and ``replay
        canary`` uses ``single_device_fingerprints``).
      axis_names: the run's mesh axes; shape: their sizes.
      run_device_ids: global device ids (``jax.Device.id``) of the run's mesh, row-major.
      make_loader: ``mesh -> loader`` (``loader.build(...)`` with the run's mixture, dataset,
        global batch, seed, data axes and skip windows).
      seed: the run's seed.
      global_batch: rows per step.
      mixture, dataset: the mixture config path and the packed dataset folder.
      canary_step, canary_seed: the canary batch's step and the seed of the canary weights.
      canary_rows, canary_seq_len: the default canary batch of ``replay canary``: its first
        ``canary_rows`` rows (None: the whole global batch), each cut to its first
        ``canary_seq_len`` slots (None: whole rows), the run config's ``canary.rows`` and
        ``canary.seq_len``.
      canary_every: the run's periodic canary period in steps (0: none; ``replay drill --scenario``
        keeps it in the drilled run).
      retrain: optional, for screening drills (``replay drill --scenario``): ``retrain(out_dir,
        stop, *, trainer, mesh, faults, canary_fault, canary_every, log)`` trains the run copied into
        ``out_dir`` (its checkpoint ``c`` and the logs before ``c``) from ``c`` to ``stop`` with the
        drill's faults, through the trainer's own training loop. None: replay retrains through the
        trainer protocol (``train_step``) and the public writer (``replay.run.writer``).
      factory: the factory that made this set-up (``"package.module:function"``), for reports.
    """

    trainer: Any
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    run_device_ids: tuple[int, ...]
    make_loader: Callable[[Any], Any]
    seed: int
    global_batch: int
    mixture: Any = None
    dataset: Optional[str] = None
    canary_step: int = 0
    canary_seed: int = 0
    canary_rows: Optional[int] = None
    canary_seq_len: Optional[int] = None
    canary_every: int = 0
    retrain: Optional[Callable[..., Any]] = None
    factory: Optional[str] = None

    @property
    def mesh_size(self) -> int:
        return int(np.prod(self.shape))


def config_from(cls: type, raw: Any, where: str) -> Any:
    """An instance of the dataclass ``cls`` (a trainer's run config: its fields are the keys) from ``raw``,
    the run config read from ``where``; the ``trainer:`` key (replay's, written by ``RunWriter``) is left
    out. The trainer's loop and its factory both read the config through it, so a bad key is refused the
    same way at training and at replay.

    The keys and their types are ``cls``'s fields, validated by pydantic (:func:`file_model`): a field
    typed ``int``, ``float``, ``str`` or ``bool`` (or ``Optional[...]`` of one) takes only a value of that
    type (an ``int`` is a ``float``; a ``bool`` is not an ``int``; YAML's ``1e-3``, a string, is no
    float); a field of another type pydantic knows (``tuple[int, ...]``, ``dict[str, float]``) takes what
    converts to it (a YAML list for a tuple); others are passed as given. ``cls.__post_init__`` may raise
    ``ValueError`` for the rest.

    Args:
      cls: a dataclass (the standard library's).
      raw: the parsed YAML; where: its path, for messages.

    Raises:
      RunConfigError: ``raw`` is not a mapping; an unknown key (with the keys ``cls`` takes); a missing
        required key; a value of the wrong type (the key, the value and the type wanted); or the
        ``ValueError``/``TypeError`` of ``cls(...)``, each message starting with ``where``.
    """
    if not isinstance(raw, Mapping):
        raise RunConfigError(f"{where}: a run config is a mapping of keys to values, got {type(raw).__name__}")
    given = {str(k): v for k, v in raw.items() if k != TRAINER_KEY}
    declared = file_model(cls)
    try:
        values = adapter(declared).validate_python(given)
    except pydantic.ValidationError as e:
        raise RunConfigError(f"{where}: {_config_problem(e, cls, declared)}") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise RunConfigError(f"{where}: {e}") from None


@functools.cache
def file_model(cls: type) -> type:
    """The pydantic declaration (a ``TypedDict``) of the run config file of a trainer's config dataclass
    ``cls``: one key a field, unknown keys refused, plain values strict (:func:`config_from`)."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, Any)
        hint = Annotated[hint, pydantic.Strict()] if _simple_type(hint) else hint
        try:
            pydantic.TypeAdapter(hint)
        except (pydantic.PydanticSchemaGenerationError, TypeError):
            hint = Any  # a type pydantic cannot check: passed as given, for cls to judge
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        keys[f.name] = hint if required else NotRequired[hint]
    declared = TypedDict(f"{cls.__name__}File", keys)  # noqa: UP013 - the keys are the dataclass's fields
    declared.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
    return declared


def _config_problem(e: pydantic.ValidationError, cls: type, model: type) -> str:
    """The first problem of a trainer's run config (:func:`contract.validation.first_error`), in its words."""
    errors = e.errors(include_url=False)
    err = first_error(errors, model)
    names = list(typing.get_type_hints(model))
    if err["type"] in UNKNOWN:
        unknown = sorted(str(x["loc"][0]) for x in errors if x["type"] in UNKNOWN and len(x["loc"]) == 1)
        s, them = ("s", "them") if len(unknown) > 1 else ("", "it")
        return (f"unknown key{s} {', '.join(unknown)}{did_you_mean(unknown, names)}: {cls.__name__} takes "
                f"{', '.join(names)} (and trainer:); remove {them} or add a field to {cls.__name__}")
    if err["type"] in MISSING:
        missing = [n for n in names if any(x["type"] in MISSING and x["loc"] == (n,) for x in errors)]
        s, them = ("s", "them") if len(missing) > 1 else ("", "it")
        return f"missing key{s} {', '.join(missing)} ({cls.__name__} has no default for {them})"
    key, value = err["loc"][0], err["input"]
    want = _simple_type(typing.get_type_hints(cls).get(key)) if len(err["loc"]) == 1 else None
    if want is not None:
        names_of = " or ".join("null" if t is type(None) else t.__name__ for t in want)
        return f"{key}: expected {names_of}, got {value!r} ({type(value).__name__})"
    return f"{where(err['loc'])}: {err['msg']}, got {value!r}"


def _simple_type(hint: Any) -> Optional[tuple[type, ...]]:
    """The types a value of annotation ``hint`` may have, for ``int``/``float``/``str``/``bool`` and
    ``Optional`` of one; None for anything else."""
    simple = (int, float, str, bool)
    if hint in simple:
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if all(a in simple or a is type(None) for a in args):
            return tuple(args)
    return None


def checked_loader(run: Any, data: Any) -> Any:
    """``data`` (a loader rebuilt for ``run`` by a factory's ``make_loader``) once its dataset and mixture
    schedule are checked to be those the run trained with (``replay.run.inputs.check_rebuilt``: its
    ``inputs.json``, or for an old run its first checkpoint's loader state); every trainer's
    ``make_loader`` should return it through this.

    Raises:
      RunDirError: the dataset's manifest or the schedule differs (each difference named).
    """
    from replay.run import inputs as run_inputs

    try:
        run_inputs.check_rebuilt(run.run_dir, data.manifest_sha256, data.schedule.to_dict(), data.dataset,
                                 run.checkpoints)
    except run_inputs.InputsChangedError as e:
        raise RunDirError(str(e)) from None
    return data


def mesh_record(run: Any) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """``(axis_names, shape, device ids row-major)`` of the run's mesh, from its env.json
    (``replay.run.env.record_environment``'s ``mesh``): what every factory puts in its set-up.

    Raises:
      RunDirError: no mesh recorded, or a malformed one (names env.json and the values).
    """
    env_path = os.path.join(run.run_dir, "env.json")
    rec = run.mesh
    if not (rec.get("axis_names") and rec.get("shape")):
        raise RunDirError(f"{env_path}: no mesh recorded (axis_names, shape)")
    try:
        axis_names = tuple(str(a) for a in rec["axis_names"])
        shape = tuple(int(s) for s in rec["shape"])
        ids = tuple(int(i) for i in rec.get("device_ids", ()) or ())
    except (TypeError, ValueError) as e:
        raise RunDirError(f"{env_path}: malformed mesh record {dict(rec)!r} ({e})") from None
    if len(axis_names) != len(shape) or any(s < 1 for s in shape):
        raise RunDirError(f"{env_path}: malformed mesh record: axis_names {list(axis_names)}, shape {list(shape)}")
    if ids and len(ids) != int(np.prod(shape)):
        raise RunDirError(f"{env_path}: mesh device_ids {list(ids)} do not fill the mesh shape {list(shape)}")
    return axis_names, shape, ids


def factory_name(config: Any) -> str:
    """The run config's ``trainer:`` factory, or :data:`REFERENCE_FACTORY` when it names none."""
    name = config.get(TRAINER_KEY) if isinstance(config, dict) else None
    return REFERENCE_FACTORY if name is None else name


def load_factory(name: Any, where: str = "run_config.yaml") -> Callable[[Any], Any]:
    """Imports the factory ``"package.module:function"`` (``function`` may be dotted: ``Class.method``).

    Args:
      name: the factory's name, as the run config's ``trainer:`` gives it.
      where: the run config's path, for messages.

    Raises:
      TrainerFactoryError: ``name`` is not of that form, its module cannot be imported (the
        message says which module failed and how to make it importable), it lacks the
        attribute, or the attribute is not callable.
    """
    if not isinstance(name, str) or not _FACTORY_RE.match(name.strip()):
        raise TrainerFactoryError(
            f"{where}: trainer: {name!r} is not a factory name; expected 'package.module:function' (e.g. "
            f"'mypackage.replay_setup:make_setup', a function that takes the run and returns a "
            f"replay.run.setup.RunSetup)")
    module_name, attr = name.strip().split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        ours = missing == module_name or module_name.startswith(missing + ".")  # the module or its package
        head = (f"module {module_name!r} is not importable" if ours
                else f"importing module {module_name!r} failed: it imports {missing!r}, which is not installed")
        raise TrainerFactoryError(
            f"{where}: trainer: {name}: {head} from this Python ({sys.executable}); install the package that "
            f"holds it in this environment, or add its folder to PYTHONPATH, then rerun") from None
    except Exception as e:  # noqa: BLE001 - a user's module can fail to import in any way
        raise TrainerFactoryError(
            f"{where}: trainer: {name}: importing module {module_name!r} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise TrainerFactoryError(
                f"{where}: trainer: {name}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                f"{attr!r}; its callables: {public[:12]}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TrainerFactoryError(f"{where}: trainer: {name}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def check_setup(setup: Any, name: str, where: str = "run_config.yaml") -> RunSetup:
    """``setup`` when it is a usable :class:`RunSetup`, else a :class:`TrainerFactoryError` naming the
    factory and what is wrong (another type, a trainer without the protocol's methods, a mesh whose
    axes and sizes do not match)."""
    if not isinstance(setup, RunSetup):
        raise TrainerFactoryError(
            f"{where}: trainer: {name} returned a {type(setup).__module__}.{type(setup).__qualname__}, not a "
            f"replay.run.setup.RunSetup; the factory must return RunSetup(trainer=..., axis_names=..., shape=..., "
            f"run_device_ids=..., make_loader=..., seed=..., global_batch=...)")
    lacking = [m for m in _TRAINER_METHODS if not callable(getattr(setup.trainer, m, None))]
    if lacking:
        raise TrainerFactoryError(
            f"{where}: trainer: {name} returned a RunSetup whose trainer ({type(setup.trainer).__name__}) lacks "
            f"{lacking}: a trainer implements replay.run.protocol.Trainer (init_state, restore, train_step)")
    if len(tuple(setup.axis_names)) != len(tuple(setup.shape)) or any(int(s) < 1 for s in setup.shape):
        raise TrainerFactoryError(
            f"{where}: trainer: {name} returned a RunSetup with axis_names {list(setup.axis_names)} and shape "
            f"{list(setup.shape)}: one size >= 1 per axis")
    if not callable(setup.make_loader):
        raise TrainerFactoryError(f"{where}: trainer: {name} returned a RunSetup whose make_loader is not callable")
    for field, value, ok, want in _field_checks(setup):
        if not ok:
            raise TrainerFactoryError(
                f"{where}: trainer: {name} returned a RunSetup whose {field} is {value!r} ({type(value).__name__}): "
                f"{want}")
    if setup.run_device_ids and len(tuple(setup.run_device_ids)) != setup.mesh_size:
        raise TrainerFactoryError(
            f"{where}: trainer: {name} returned run_device_ids {list(setup.run_device_ids)} for a mesh of "
            f"{setup.mesh_size} devices")
    return setup


def _field_checks(setup: RunSetup) -> list[tuple[str, Any, bool, str]]:
    """``(field, value, ok, what it must be)`` of each :class:`RunSetup` field a factory can get wrong."""
    def whole(v: Any, low: int) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and int(v) >= low

    def opt(v: Any, low: int) -> bool:
        return v is None or whole(v, low)

    return [
        ("axis_names", setup.axis_names, all(isinstance(a, str) for a in setup.axis_names), "a tuple of str"),
        ("shape", setup.shape, all(whole(v, 1) for v in setup.shape), "a tuple of ints >= 1"),
        ("run_device_ids", setup.run_device_ids, all(whole(v, 0) for v in setup.run_device_ids),
         "a tuple of jax.Device.id ints (replay.run.setup.mesh_record(run) gives them)"),
        ("seed", setup.seed, whole(setup.seed, 0), "an int >= 0"),
        ("global_batch", setup.global_batch, whole(setup.global_batch, 1), "an int >= 1 (rows per step)"),
        ("canary_step", setup.canary_step, whole(setup.canary_step, 0), "an int >= 0"),
        ("canary_seed", setup.canary_seed, whole(setup.canary_seed, 0), "an int >= 0"),
        ("canary_rows", setup.canary_rows, opt(setup.canary_rows, 1), "None or an int >= 1"),
        ("canary_seq_len", setup.canary_seq_len, opt(setup.canary_seq_len, 2), "None or an int >= 2"),
        ("canary_every", setup.canary_every, whole(setup.canary_every, 0), "an int >= 0 (0: no periodic canary)"),
        ("retrain", setup.retrain, setup.retrain is None or callable(setup.retrain), "None or a function"),
    ]


def _no_trainer_key(where: str) -> str:
    return (f"; {where} names no trainer: factory, so replay rebuilt the run as the reference trainer's "
            f"({REFERENCE_FACTORY}). A run of your own trainer names its factory there: trainer: "
            f"package.module:make_setup (replay.run.writer.RunWriter(..., trainer=...) writes it)")


def make_setup(run: Any) -> RunSetup:
    """The run's :class:`RunSetup`, from the factory its run config names (:func:`factory_name`).

    Args:
      run: a loaded run directory (``replay.run.runlog.RunLog``).

    Raises:
      TrainerFactoryError: the factory cannot be imported, raises something other than a
        ``RunDirError``, or returns the wrong type (:func:`load_factory`, :func:`check_setup`).
      RunDirError: the factory's own report of a run it cannot rebuild (a missing dataset, ...).
    """
    where = os.path.join(run.run_dir, "run_config.yaml")
    name = factory_name(run.config)
    factory = load_factory(name, where)
    hint = "" if isinstance(run.config, dict) and run.config.get(TRAINER_KEY) is not None else _no_trainer_key(where)
    try:
        setup = factory(run)
    except RunDirError as e:
        if not hint:
            raise
        raise RunDirError(f"{e}{hint}", nearest=e.nearest) from None
    except Exception as e:  # noqa: BLE001 - a user's factory can fail in any way: name it
        raise TrainerFactoryError(f"{where}: trainer: {name} raised {type(e).__name__}: {e}{hint}") from e
    setup = check_setup(setup, name, where)
    if setup.factory is None:
        setup = dataclasses.replace(setup, factory=name)
    return setup
