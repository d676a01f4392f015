"""The reference trainer's run config and the run directory it fits: config, checks, loader, mesh, trainer.

Run config (YAML; relative paths are resolved against the config file's folder)::

    name: demo
    mixture: ../mixtures/demo.yaml        # mixture config the dataset was packed from
    dataset: ../../build/demo/dataset      # packed dataset folder (manifest.json)
    global_batch: 8                        # rows per step, a multiple of the device count
    seed: 0                                # parameter init and the loader's shuffle
    mesh: {data: -1, expert: 2}            # axes in mesh order; -1 = remaining devices; fixed
                                           # sizes using fewer devices than there are take the
                                           # lowest ids (the rest stay free, e.g. for replay)
    model: {d_model: 64, n_layers: 2, ...} # replay.reference.model.ModelConfig fields;
                                           # vocab_size defaults to the manifest's;
                                           # dispatch: gather | all_to_all (expert parallelism)
    optimizer: {learning_rate: 3.0e-3, ...}  # replay.reference.trainer.OptimizerConfig
    checkpoint_every: 10                   # Orbax checkpoint every K steps (and at 0 and the end)
    skip_windows: [[100, 119]]             # inclusive training-step windows whose data is skipped
    loader: {workers: 0, prefetch: 2}      # Grain worker processes and prefetch depth
    canary: {step: 0, seed: 1234, rows: 1, seq_len: null}  # canary batch = the first rows (and slots)
                                           # of the batch of this step;
                                           # canary weights = fresh init from this seed
    canary_every: 10                       # periodic canary every N steps on every device (0: off)
    canary_action: warn                    # on a canary mismatch: warn (event, warning) or stop
    non_finite: stop                       # a NaN/Inf loss, gradient or state: stop (before any checkpoint
                                           # holds it; exit code 22), skip_step (drop that update) or warn
    router_health: {max_dropped_fraction: 0.01, max_share_ratio: 3.0, warmup_steps: 10,
                    max_expert_load_ratio: 2.0}
    screening: {}                          # replay.screen.screening.ScreeningConfig overrides (replay scan)
    trainer: replay.reference.setup:make_setup  # the factory replay rebuilds the run with (this one when absent)

The full reference table of the fields is in docs/trainer.md ("Run config").

The training loop that trains a run config into a run directory is ``replay.reference.loop``
(:func:`replay.reference.loop.train`); this module holds the run config and the run directory it fits:
the config checks against the directory's own, the loader, the mesh and the trainer it asks for.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Annotated, Any, Literal, Mapping, Optional

import pydantic
import yaml
from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, StrictStr, WithJsonSchema

from contract.validation import RUN_CONFIG, Int, OneOf, adapter, fields_of, problem, refuse, says, section
from replay.reference.model import ModelConfig
from replay.reference.trainer import OptimizerConfig
from replay.run import protocol as proto
from replay.run.setup import REFERENCE_FACTORY
from replay.run.writer import RunDir
from replay.screen.screening import RouterHealth, ScreeningConfig

CANARY_ACTIONS = ("warn", "stop")
NON_FINITE_ACTIONS = ("stop", "skip_step", "warn")
LOADER_DUPLICATES = ("warn", "refuse", "off")


class RunConfigError(ValueError):
    """A run config is malformed or does not fit the run directory; names the field and value."""


# ----------------------------------------------------------------------------- the run config, declared
#
# The run config file is declared once, here and in its sections' own modules (ModelConfig,
# OptimizerConfig, RouterHealth, ScreeningConfig): pydantic validates a parsed file against these
# classes, and their JSON Schema is schemas/run_config.schema.json (replay.schema). Mistakes are said
# with their key path, value and allowed range (contract.validation), in the words the run config
# always used; what needs several keys (canary.rows <= global_batch, expert parallelism's mesh) is
# checked by the field that comes later in the file.

_Count = Int("an int >= 0", ge=0)


@section("canary", RunConfigError)
class CanaryConfig:
    """The canary batch and its weights (the run config's ``canary:``)."""

    step: _Count = 0
    """whose batch is the canary batch (its first rows)"""
    seed: _Count = 1234
    """the seed of the canary weights (a fresh init)"""
    rows: Int("an int >= 1", ge=1) = 1
    """rows of that batch the periodic canary runs (<= global_batch; replay canary takes --rows)"""
    seq_len: Optional[Int("an int >= 2", ge=2)] = None
    """the periodic canary keeps the first seq_len slots of each row, a valid packed prefix, to cost less; null: whole rows"""


@section("loader", RunConfigError)
class LoaderConfig:
    """The run's loader (the run config's ``loader:``; ``loader.build``)."""

    workers: _Count = 0
    """Grain worker processes (0: in the trainer's process)"""
    prefetch: _Count = 2
    """batches the loader keeps ready ahead of the trainer"""
    duplicates: OneOf(LOADER_DUPLICATES, f"one of {list(LOADER_DUPLICATES)} (what duplicated data in the dataset "
                                         "gets)") = "warn"
    """what duplicated data in the dataset gets: warn, refuse (the run does not start) or off"""


def _or_empty(empty: Any) -> BeforeValidator:
    """A section left empty in YAML (``loader:`` with nothing under it) reads as ``empty``."""
    return BeforeValidator(lambda v: empty if v is None else v)


def _pairs_as_mapping(v: Any) -> Any:
    """``RunConfig.mesh`` given as its ``(axis, size)`` pairs (``dataclasses.replace``) reads as the mapping."""
    if isinstance(v, (tuple, list)) and v and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in v):
        return dict(v)
    return v


def _mesh_axes(mesh: dict[str, int]) -> tuple[tuple[str, int], ...]:
    if not mesh:
        raise refuse(f"must be a mapping axis -> size, got {mesh!r}")
    for need in ("data", "expert"):
        if need not in mesh:
            raise refuse(f"needs axis {need!r}, got {list(mesh)}")
    return tuple(mesh.items())


def _window(w: tuple[int, int]) -> tuple[int, int]:
    if w[1] < w[0]:
        raise refuse(f"end {w[1]} < start {w[0]}")
    return w


_Path = Annotated[StrictStr, Field(min_length=1), says(lambda v: f"must be a path string, got {v!r}")]
_MeshSize = Annotated[int, Field(strict=True), AfterValidator(lambda v: _mesh_size(v)),
                      says(lambda v: f"must be an int >= 1 or -1, got {v!r}"),
                      WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}]})]
_Window = Annotated[tuple[_Count, _Count], AfterValidator(_window),
                    says(lambda v: f"must be [start, end], got {v!r}",
                         when=lambda v: not isinstance(v, (list, tuple)) or len(v) != 2)]


def _mesh_size(v: int) -> int:
    if v >= 1 or v == -1:
        return v
    raise ValueError(f"mesh size {v}")


class _ModelSchema:
    """The JSON Schema of ``model:``: :class:`ModelConfig`'s, ``vocab_size`` optional (the manifest's)."""

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        out = handler.resolve_ref_schema(handler(adapter(ModelConfig).core_schema))
        out = {**out, "required": [r for r in out.get("required", []) if r != "vocab_size"]}
        out["properties"] = {**out["properties"], "vocab_size": {
            **out["properties"]["vocab_size"], "description": "default: the dataset manifest's vocab size"}}
        return out


@section("", RunConfigError)
class RunConfig:
    """A validated run config (module docstring): what ``run_config.yaml`` holds, key for key. Paths are
    absolute (:func:`run_config_from_dict` resolves them); ``mesh`` is its ``(axis, size)`` pairs in mesh
    order and ``model`` the mapping as written (``vocab_size`` from the manifest unless set:
    :meth:`model_config`). Built or changed (``dataclasses.replace``), a bad value is a
    :class:`RunConfigError` naming the key."""

    name: Annotated[StrictStr, Field(min_length=1), says(lambda v: f"must be a non-empty string, got {v!r}")]
    """the run's name"""
    mixture: _Path
    """the mixture config the dataset was packed from (relative: to the run config's folder)"""
    dataset: _Path
    """the packed dataset folder (manifest.json); relative: to the run config's folder"""
    global_batch: Int("an int >= 1", ge=1)
    """rows per step, a multiple of the device count"""
    seed: _Count = 0
    """parameter init and the loader's shuffle"""
    mesh: Annotated[dict[str, _MeshSize], BeforeValidator(_pairs_as_mapping, json_schema_input_type=dict[str, _MeshSize]),
                    AfterValidator(_mesh_axes), PlainSerializer(dict),
                    Field(json_schema_extra={"default": {"data": -1, "expert": 2}}),
                    says(lambda v: f"must be a mapping axis -> size, got {v!r}", when=lambda v: not isinstance(v, Mapping))
                    ] = (("data", -1), ("expert", 2))
    """axes in mesh order (data and expert needed); -1: the remaining devices; fixed sizes using fewer devices than there are take the lowest ids"""
    model: Annotated[dict[str, Any], _or_empty({}), _ModelSchema] = dataclasses.field(default_factory=dict)
    """replay.reference.model.ModelConfig fields; vocab_size defaults to the manifest's"""
    optimizer: Annotated[OptimizerConfig, _or_empty({})] = OptimizerConfig()
    checkpoint_every: Int("an int >= 1", ge=1) = 10
    """an Orbax checkpoint every K steps (and at 0 and the end)"""
    skip_windows: Annotated[tuple[_Window, ...], _or_empty(())] = ()
    """inclusive training-step windows [start, end] whose data is skipped"""
    loader: Annotated[LoaderConfig, _or_empty({})] = LoaderConfig()
    canary: Annotated[CanaryConfig, _or_empty({})] = CanaryConfig()
    canary_every: _Count = 0
    """the periodic canary every N steps on every device (0: off)"""
    canary_action: OneOf(CANARY_ACTIONS) = "warn"
    """on a canary mismatch: warn (an event and a warning) or stop"""
    non_finite: OneOf(NON_FINITE_ACTIONS) = "stop"
    """a NaN/Inf loss, gradient or state: stop (before any checkpoint holds it; exit code 22), skip_step (drop that update) or warn"""
    router_health: Annotated[RouterHealth, _or_empty({})] = RouterHealth()
    screening: Annotated[ScreeningConfig, _or_empty({})] = ScreeningConfig()
    trainer: Annotated[Literal[REFERENCE_FACTORY],
                       says(lambda v: f"this is the reference trainer's run config, whose factory is "
                                      f"{REFERENCE_FACTORY!r} (or leave the key out), got {v!r}")] = REFERENCE_FACTORY
    """the factory replay rebuilds the run with (replay.run.setup); this trainer's"""
    mtbf_s: Annotated[Optional[float], Field(strict=True, gt=0, allow_inf_nan=False),
                      says(lambda v: f"must be a number of seconds > 0 (the fleet's mean time between failures), "
                                     f"got {v!r}")] = None
    """the fleet's MTBF for replay goodput's Young interval (null: the design point)"""

    @pydantic.field_validator("model")
    @classmethod
    def _model_fits_the_mesh(cls, model: dict[str, Any], info: pydantic.ValidationInfo) -> dict[str, Any]:
        try:
            mc = adapter(ModelConfig).validate_python({"vocab_size": 2, **model})
        except pydantic.ValidationError as e:
            raise refuse(problem(e, ModelConfig, RUN_CONFIG, "model"), whole=True) from None
        experts = dict(info.data.get("mesh") or {}).get("expert", -1)
        if mc.dispatch == "all_to_all" and experts != -1 and mc.n_experts % experts:
            raise refuse(f"all_to_all: model.n_experts {mc.n_experts} must divide by the mesh's expert axis size "
                         f"{experts} (each device holds n_experts / expert experts); change one of them, or use "
                         "dispatch: gather", at=("dispatch",))
        return model

    @pydantic.field_validator("canary")
    @classmethod
    def _canary_rows_in_the_batch(cls, canary: CanaryConfig, info: pydantic.ValidationInfo) -> CanaryConfig:
        batch = info.data.get("global_batch")
        if batch is not None and canary.rows > batch:
            raise refuse(f"must be <= global_batch {batch}, got {canary.rows}", at=("rows",))
        return canary

    def to_dict(self) -> dict[str, Any]:
        """The config as written to ``<run>/run_config.yaml``: every key (defaults filled in, paths absolute),
        but ``loader.duplicates`` at its default and an unset ``mtbf_s``, which runs before them lack."""
        out = adapter(RunConfig).dump_python(self, mode="json")
        if self.loader.duplicates == "warn":
            del out["loader"]["duplicates"]
        if self.mtbf_s is None:
            del out["mtbf_s"]
        return out

    @property
    def loader_workers(self) -> int:
        return self.loader.workers

    @property
    def loader_prefetch(self) -> int:
        return self.loader.prefetch

    @property
    def loader_duplicates(self) -> str:
        return self.loader.duplicates

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model config, ``vocab_size`` from the manifest unless the run config sets it.

        Raises:
          RunConfigError: the config's vocab_size is smaller than the dataset's.
        """
        d = dict(self.model)
        v = d.setdefault("vocab_size", vocab_size)
        if v < vocab_size:
            raise RunConfigError(f"model.vocab_size: must be >= the dataset's vocab size {vocab_size}, got {v}")
        return ModelConfig.from_dict(d)


_KEYS = frozenset(fields_of(RunConfig))


def run_config_from_dict(raw: Mapping[str, Any], base_dir: str = ".") -> RunConfig:
    """Validates a run config mapping (:class:`RunConfig`); relative paths are resolved against ``base_dir``.

    Raises:
      RunConfigError: the first problem in the file's order (``contract.validation``): unknown keys (with
        the nearest allowed one), missing keys, wrong types, out-of-range values, each with its key path
        (``model.top_k: must be an int in [1, n_experts=4], got 9``).
    """
    if not isinstance(raw, Mapping):
        raise RunConfigError(f"run config must be a mapping, got {type(raw).__name__}")
    given = dict(raw)
    for key in ("mixture", "dataset"):
        v = given.get(key)
        if isinstance(v, str) and v and "://" not in v:
            given[key] = os.path.normpath(os.path.join(base_dir, v))
    return RunConfig.from_dict(given)


def load_run_config(path: str) -> RunConfig:
    """Reads and validates a run config YAML file (relative paths against its folder).

    Raises:
      FileNotFoundError: no such file.
      RunConfigError: invalid YAML or content.
    """
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise RunConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return run_config_from_dict(raw, os.path.dirname(os.path.abspath(path)))
    except RunConfigError as e:
        raise RunConfigError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- run directory


def write_config(path: str, cfg: Mapping[str, Any]) -> None:
    """Writes ``cfg`` as YAML to ``path`` through a temporary name."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)  # a kill never leaves a torn run_config.yaml


def check_same_config(rd: RunDir, cfg: RunConfig) -> Optional[list]:
    """Writes run_config.yaml, or checks it against ``cfg`` (only skip windows may grow).

    Returns the new skip windows when they grew, not written yet: :func:`write_grown_windows` writes
    them once the loader has accepted them, so that a refused restart leaves the run's config as the
    run used it.

    Raises:
      RunConfigError: the run directory's config is unreadable, or differs in another key.
    """
    path = rd.file(proto.RUN_CONFIG_NAME)
    new = cfg.to_dict()
    if not os.path.exists(path):
        if rd.primary:  # process 0 writes the run's single files
            write_config(path, new)
        return None
    try:
        with open(path, encoding="utf-8") as f:
            old = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RunConfigError(f"{path}: the run directory's config is unreadable ({e}); use a new --run") from None
    if not isinstance(old, Mapping):
        raise RunConfigError(f"{path}: the run directory's config is not a mapping; use a new --run")
    old = {"trainer": REFERENCE_FACTORY, "non_finite": "stop", **old}  # a run started before the keys were written
    if os.path.abspath(str(new["mixture"])) == rd.file(proto.MIXTURE_COPY_NAME):
        new["mixture"] = old.get("mixture")  # the run's own copy stands for the path it was copied from
    diffs = sorted(k for k in set(old) | set(new) if k != "skip_windows" and old.get(k) != new.get(k))
    if diffs:
        raise RunConfigError(
            f"run directory {rd.path} was started with another config (differs in {diffs}); use a new --run"
        )
    if old.get("skip_windows") != new["skip_windows"]:
        return new["skip_windows"]
    return None


def write_grown_windows(rd: RunDir, cfg: RunConfig) -> None:
    """Writes ``cfg`` (whose skip windows grew, accepted by the loader) as the run's config, keeping the
    mixture path as written (process 0)."""
    if not rd.primary:
        return
    with open(rd.file(proto.RUN_CONFIG_NAME), encoding="utf-8") as f:
        written = yaml.safe_load(f)
    write_config(rd.file(proto.RUN_CONFIG_NAME), {**cfg.to_dict(), "mixture": written["mixture"]})


def check_same_mixture(rd: RunDir, cfg: RunConfig) -> None:
    """Refuses to resume with a mixture config that is not the one the run kept (``replay.run.inputs``)."""
    from replay.run import inputs as run_inputs

    rec = run_inputs.read_inputs(rd.path)
    if rec is None:
        return
    copy = os.path.join(rd.path, rec["mixture"].get("copy") or proto.MIXTURE_COPY_NAME)
    if os.path.abspath(cfg.mixture) == os.path.abspath(copy):
        return
    now = run_inputs.mixture_sha256(cfg.mixture)
    if now != rec["mixture"]["sha256"]:
        raise RunConfigError(
            f"the mixture config {cfg.mixture} is not the one run {rd.path} trained with (sha256 "
            f"{rec['mixture']['sha256'][:12]} then, {(now or 'unreadable')[:12]} now): the run kept its own copy, "
            f"{copy}; resume with 'python -m replay.reference.train --run {rd.path}' (its own config and copy), "
            "or train the new mixture in a new run directory")


# ----------------------------------------------------------------------------- the loader, the mesh, the trainer


def build_loader(cfg: RunConfig, mesh, state: Optional[Mapping[str, Any]] = None):
    """``loader.build`` with the run's mixture, dataset, batch, seed, skip windows (batch over all mesh axes)."""
    import loader

    return loader.build(
        mixture=cfg.mixture, dataset=cfg.dataset, global_batch=cfg.global_batch, mesh=mesh, seed=cfg.seed,
        data_axes=tuple(mesh.axis_names), skip_windows=[list(w) for w in cfg.skip_windows],
        workers=cfg.loader_workers, prefetch=cfg.loader_prefetch, state=state, duplicates=cfg.loader_duplicates,
    )


def run_devices(axes: Mapping[str, int]) -> list:
    """The devices a run with mesh ``axes`` trains on, in ascending id order.

    All devices when a size is ``-1``; otherwise the ``prod(sizes)`` lowest ids, so that a run
    may leave devices free (the demo trains on 4 of 8 CPU devices and replays on the other 4).

    Raises:
      RunConfigError: the fixed sizes need more devices than there are.
    """

    import jax

    devices = sorted(jax.devices(), key=lambda d: d.id)
    axes = dict(axes)  # a mapping, or RunConfig.mesh's ((axis, size), ...) pairs
    sizes = [int(v) for v in axes.values()]
    if -1 in sizes:
        return devices
    need = math.prod(sizes)
    if need > len(devices):
        raise RunConfigError(f"mesh: {dict(axes)} needs {need} devices, {len(devices)} available")
    chosen = devices[:need]
    idle = sorted({d.process_index for d in devices} - {d.process_index for d in chosen})
    if idle:  # a process without a device in the mesh would have no part in the run
        raise RunConfigError(
            f"mesh: {dict(axes)} takes the {need} lowest device ids, all on process(es) "
            f"{sorted({d.process_index for d in chosen})}: process(es) {idle} would have no device in it; use all "
            f"{len(devices)} devices of the {len({d.process_index for d in devices})} processes (a size of -1), or "
            f"start each process with fewer devices (XLA_FLAGS=--xla_force_host_platform_device_count on CPU)")
    return chosen


def make_trainer(cfg: RunConfig, *, fingerprints: bool = True):
    """``(ReferenceTrainer, mesh, vocab_size)`` for a run config (reads only the manifest)."""
    from loader.dataset import read_manifest
    from replay.reference.trainer import ReferenceTrainer, make_mesh

    manifest, _ = read_manifest(cfg.dataset, cfg.mixture)
    vocab = int(manifest.tokenizer["vocab_size"])
    model = cfg.model_config(vocab)
    mesh = make_mesh(dict(cfg.mesh), run_devices(dict(cfg.mesh)))
    if cfg.global_batch % mesh.size:
        raise RunConfigError(f"global_batch: must be a multiple of the device count {mesh.size}, got {cfg.global_batch}")
    trainer = ReferenceTrainer(model, cfg.optimizer, fingerprints=fingerprints)
    try:
        trainer.expert_parallel(mesh)  # dispatch all_to_all: the experts must split over the mesh's expert axis
    except ValueError as e:
        raise RunConfigError(str(e)) from None
    return trainer, mesh, vocab


def canary_batch(cfg: RunConfig, mesh) -> dict[str, Any]:
    """The canary batch of the run: the global batch of step ``cfg.canary.step`` (host NumPy, int32 ``[B, S]``).

    Read through a loader on a one-device mesh of one of this process's devices (the batch is a pure
    function of the step, whatever the mesh), so that every process of a multi-process run has the
    whole batch without gathering it.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    local = [d for d in mesh.devices.reshape(-1) if d.process_index == jax.process_index()] or jax.local_devices()
    one = Mesh(np.asarray(local[:1], dtype=object).reshape((1,) * len(mesh.axis_names)), mesh.axis_names)
    return {k: np.asarray(v, np.int32) for k, v in build_loader(cfg, one).host_batch(cfg.canary.step).items()}
