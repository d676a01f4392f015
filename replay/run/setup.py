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
import importlib
import os
import re
import sys
from typing import Any, Callable, Optional

import numpy as np

from replay.run.runlog import RunDirError

TRAINER_KEY = "trainer"
REFERENCE_FACTORY = "replay.reference.setup:make_setup"
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_TRAINER_METHODS = ("init_state", "restore", "train_step")


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
    if setup.run_device_ids and len(tuple(setup.run_device_ids)) != setup.mesh_size:
        raise TrainerFactoryError(
            f"{where}: trainer: {name} returned run_device_ids {list(setup.run_device_ids)} for a mesh of "
            f"{setup.mesh_size} devices")
    return setup


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
    try:
        setup = factory(run)
    except RunDirError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory can fail in any way: name it
        raise TrainerFactoryError(f"{where}: trainer: {name} raised {type(e).__name__}: {e}") from e
    setup = check_setup(setup, name, where)
    if setup.factory is None:
        setup = dataclasses.replace(setup, factory=name)
    return setup
