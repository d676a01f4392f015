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
from typing import Any, Mapping, Optional, Sequence

import yaml

from replay.reference.model import ModelConfig, did_you_mean
from replay.reference.trainer import OptimizerConfig
from replay.run import protocol as proto
from replay.run.setup import REFERENCE_FACTORY
from replay.run.writer import RunDir
from replay.screen.screening import RouterHealth, ScreeningConfig

_KEYS = {
    "name", "mixture", "dataset", "global_batch", "seed", "mesh", "model", "optimizer", "checkpoint_every",
    "skip_windows", "loader", "canary", "canary_every", "canary_action", "router_health", "screening", "trainer",
    "mtbf_s",
    "non_finite",
}
CANARY_ACTIONS = ("warn", "stop")
NON_FINITE_ACTIONS = ("stop", "skip_step", "warn")
_REQUIRED = ("name", "mixture", "dataset", "global_batch")


class RunConfigError(ValueError):
    """A run config is malformed or does not fit the run directory; names the field and value."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    """Attributes: step (int >= 0: whose batch is the canary batch), seed (int >= 0: canary weights),
    rows (int >= 1: rows of that batch the periodic canary runs; ``replay canary`` takes ``--rows``),
    seq_len (int >= 2 or None: the periodic canary keeps the first ``seq_len`` slots of each row, a
    valid packed prefix, to cost less; None: whole rows)."""

    step: int = 0
    seed: int = 1234
    rows: int = 1
    seq_len: Optional[int] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A validated run config (module docstring). Paths are absolute."""

    name: str
    mixture: str
    dataset: str
    global_batch: int
    seed: int = 0
    mesh: tuple[tuple[str, int], ...] = (("data", -1), ("expert", 2))
    model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint_every: int = 10
    skip_windows: tuple[tuple[int, int], ...] = ()
    loader_workers: int = 0
    loader_prefetch: int = 2
    loader_duplicates: str = "warn"  # loader.build's duplicates: warn, refuse or off
    canary: CanaryConfig = CanaryConfig()
    canary_every: int = 0
    canary_action: str = "warn"
    non_finite: str = "stop"
    router_health: RouterHealth = RouterHealth()
    screening: ScreeningConfig = ScreeningConfig()
    mtbf_s: Optional[float] = None  # the fleet's MTBF for replay goodput's Young interval (None: the design point)

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

    def to_dict(self) -> dict[str, Any]:
        """The config as written to ``<run>/run_config.yaml`` (absolute paths)."""
        return {
            "name": self.name,
            "mixture": self.mixture,
            "dataset": self.dataset,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "mesh": dict(self.mesh),
            "model": dict(self.model),
            "optimizer": dataclasses.asdict(self.optimizer),
            "checkpoint_every": self.checkpoint_every,
            "skip_windows": [list(w) for w in self.skip_windows],
            "loader": {"workers": self.loader_workers, "prefetch": self.loader_prefetch,
                       **({"duplicates": self.loader_duplicates} if self.loader_duplicates != "warn" else {})},
            "canary": dataclasses.asdict(self.canary),
            "canary_every": self.canary_every,
            "canary_action": self.canary_action,
            "non_finite": self.non_finite,
            "router_health": self.router_health.to_dict(),
            "screening": self.screening.to_dict(),
            "trainer": REFERENCE_FACTORY,
            **({"mtbf_s": self.mtbf_s} if self.mtbf_s is not None else {}),
        }


def _int(raw, field, lo):
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < lo:
        raise RunConfigError(f"{field}: must be an int >= {lo}, got {raw!r}")
    return raw


def run_config_from_dict(raw: Mapping[str, Any], base_dir: str = ".") -> RunConfig:
    """Validates a run config mapping; relative paths are resolved against ``base_dir``.

    Raises:
      RunConfigError: unknown or missing keys, wrong types, out-of-range values (the
        model and optimizer sections raise their own ``ValueError`` subclasses, wrapped).
    """
    if not isinstance(raw, Mapping):
        raise RunConfigError(f"run config must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise RunConfigError(f"unknown keys {unknown}{did_you_mean(unknown, _KEYS)}; allowed: {sorted(_KEYS)}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise RunConfigError(f"missing keys {missing}")

    def path(field):
        v = raw[field]
        if not isinstance(v, str) or not v:
            raise RunConfigError(f"{field}: must be a path string, got {v!r}")
        return v if "://" in v else os.path.normpath(os.path.join(base_dir, v))

    mesh_raw = raw.get("mesh", {"data": -1, "expert": 2})
    if not isinstance(mesh_raw, Mapping) or not mesh_raw:
        raise RunConfigError(f"mesh: must be a mapping axis -> size, got {mesh_raw!r}")
    mesh = []
    for k, v in mesh_raw.items():
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise RunConfigError(f"mesh.{k}: must be an int >= 1 or -1, got {v!r}")
        mesh.append((str(k), v))
    for need in ("data", "expert"):
        if need not in dict(mesh):
            raise RunConfigError(f"mesh: needs axis {need!r}, got {list(dict(mesh))}")
    windows = []
    for i, w in enumerate(raw.get("skip_windows", []) or []):
        if not isinstance(w, Sequence) or len(w) != 2:
            raise RunConfigError(f"skip_windows[{i}]: must be [start, end], got {w!r}")
        a, b = _int(w[0], f"skip_windows[{i}][0]", 0), _int(w[1], f"skip_windows[{i}][1]", 0)
        if b < a:
            raise RunConfigError(f"skip_windows[{i}]: end {b} < start {a}")
        windows.append((a, b))
    loader = dict(raw.get("loader", {}) or {})
    bad = sorted(set(loader) - {"workers", "prefetch", "duplicates"})
    if bad:
        raise RunConfigError(f"loader: unknown keys {bad}{did_you_mean(bad, {'duplicates', 'prefetch', 'workers'})}; "
                             "allowed: ['duplicates', 'prefetch', 'workers']")
    if loader.get("duplicates", "warn") not in ("warn", "refuse", "off"):
        raise RunConfigError(f"loader.duplicates: must be one of ['warn', 'refuse', 'off'] (what duplicated data in the "
                             f"dataset gets), got {loader['duplicates']!r}")
    canary_raw = dict(raw.get("canary", {}) or {})
    bad = sorted(set(canary_raw) - {"step", "seed", "rows", "seq_len"})
    if bad:
        raise RunConfigError(f"canary: unknown keys {bad}{did_you_mean(bad, {'rows', 'seed', 'seq_len', 'step'})}; "
                             "allowed: ['rows', 'seed', 'seq_len', 'step']")
    canary_seq = canary_raw.get("seq_len")
    if canary_seq is not None:
        canary_seq = _int(canary_seq, "canary.seq_len", 2)
    action = raw.get("canary_action", "warn")
    if action not in CANARY_ACTIONS:
        raise RunConfigError(f"canary_action: must be one of {list(CANARY_ACTIONS)}, got {action!r}")
    non_finite = raw.get("non_finite", "stop")
    if non_finite not in NON_FINITE_ACTIONS:
        raise RunConfigError(f"non_finite: must be one of {list(NON_FINITE_ACTIONS)}, got {non_finite!r}")
    model = dict(raw.get("model", {}) or {})
    try:
        mc = ModelConfig.from_dict({"vocab_size": 2, **model} if "vocab_size" not in model else model)
        experts_axis = dict(mesh)["expert"]
        if mc.dispatch == "all_to_all" and experts_axis != -1 and mc.n_experts % experts_axis:
            raise RunConfigError(f"model.dispatch all_to_all: model.n_experts {mc.n_experts} must divide by the mesh's "
                                 f"expert axis size {experts_axis} (each device holds n_experts / expert experts); "
                                 "change one of them, or use dispatch: gather")
        opt = OptimizerConfig.from_dict(dict(raw.get("optimizer", {}) or {}))
        health = RouterHealth.from_dict(raw.get("router_health"))
        screening = ScreeningConfig.from_dict(raw.get("screening"))
    except (ValueError, TypeError) as e:
        raise RunConfigError(str(e)) from None
    global_batch = _int(raw["global_batch"], "global_batch", 1)
    canary_rows = _int(canary_raw.get("rows", 1), "canary.rows", 1)
    if canary_rows > global_batch:
        raise RunConfigError(f"canary.rows: must be <= global_batch {global_batch}, got {canary_rows}")
    if raw.get("trainer", REFERENCE_FACTORY) != REFERENCE_FACTORY:
        raise RunConfigError(f"trainer: this is the reference trainer's run config, whose factory is "
                             f"{REFERENCE_FACTORY!r} (or leave the key out), got {raw['trainer']!r}")
    name = raw["name"]
    if not isinstance(name, str) or not name:
        raise RunConfigError(f"name: must be a non-empty string, got {name!r}")
    return RunConfig(
        name=name,
        mixture=path("mixture"),
        dataset=path("dataset"),
        global_batch=global_batch,
        seed=_int(raw.get("seed", 0), "seed", 0),
        mesh=tuple(mesh),
        model=model,
        optimizer=opt,
        checkpoint_every=_int(raw.get("checkpoint_every", 10), "checkpoint_every", 1),
        skip_windows=tuple(windows),
        loader_workers=_int(loader.get("workers", 0), "loader.workers", 0),
        loader_prefetch=_int(loader.get("prefetch", 2), "loader.prefetch", 0),
        loader_duplicates=loader.get("duplicates", "warn"),
        canary=CanaryConfig(
            step=_int(canary_raw.get("step", 0), "canary.step", 0), seed=_int(canary_raw.get("seed", 1234), "canary.seed", 0),
            rows=canary_rows, seq_len=canary_seq,
        ),
        canary_every=_int(raw.get("canary_every", 0), "canary_every", 0),
        canary_action=action,
        non_finite=non_finite,
        router_health=health,
        screening=screening,
        mtbf_s=_mtbf(raw.get("mtbf_s")),
    )


def _mtbf(raw: Any) -> Optional[float]:
    """The run config's ``mtbf_s`` (seconds > 0, or absent)."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise RunConfigError(f"mtbf_s: must be a number of seconds > 0 (the fleet's mean time between failures), "
                             f"got {raw!r}")
    return float(raw)


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
    import math

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
