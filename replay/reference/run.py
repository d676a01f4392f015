"""A training run of the reference trainer: run config, run directory, resumable loop.

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

The loop (:func:`train`) writes the run directory of ``replay.run.protocol``; killed at any
point and started again with the same arguments it resumes from the last complete
checkpoint, drops fingerprint, signal and canary lines from that step on, and continues: the
resulting ``fingerprints.jsonl`` equals an uninterrupted run's. Each step it appends the step's
fingerprints and its screening signals (``signals.jsonl``: loss, step time, loader wait and
buffer occupancy, per-replica and per-device gradient norms, non-finite counts, per-layer router
health); every ``canary_every`` steps the periodic canary (one ``canary.jsonl`` line per device,
a ``canary_mismatch`` event when a device disagrees); a ``checkpoint`` event only once Orbax has
committed that checkpoint (saves are asynchronous: a kill during a save leaves no event for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, TextIO

import yaml

from replay.reference.model import ModelConfig, did_you_mean
from replay.reference.trainer import OptimizerConfig
from replay.run import protocol as proto
from replay.run.setup import REFERENCE_FACTORY
from replay.run.writer import RunDir, input_signals
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


class NonFiniteStopError(RuntimeError):
    """``non_finite: stop``: a step made a non-finite loss or gradient, or the state to be saved holds
    NaN/Inf; training stopped before a checkpoint held it (``step``: the step, ``what``: what was seen)."""

    def __init__(self, message: str, *, step: int, what: str):
        super().__init__(message)
        self.step, self.what = int(step), what


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


def _write_config(path: str, cfg: Mapping[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)  # a kill never leaves a torn run_config.yaml


def _check_same_config(rd: RunDir, cfg: RunConfig, write_grown: bool = True) -> Optional[list]:
    """Writes run_config.yaml, or checks it against ``cfg`` (only skip windows may grow).

    Returns the new skip windows when they grew (written only with ``write_grown``: :func:`train`
    writes them once the loader has accepted them, so that a refused restart leaves the run's
    config as the run used it).
    """
    path = rd.file(proto.RUN_CONFIG_NAME)
    new = cfg.to_dict()
    if not os.path.exists(path):
        if rd.primary:  # process 0 writes the run's single files
            _write_config(path, new)
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
        if write_grown and rd.primary:
            _write_config(path, new)  # (the mixture path as written: ``new`` has it)
        return new["skip_windows"]
    return None


# ----------------------------------------------------------------------------- the loop


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


def _phase_index(data, step: int) -> int:
    d = data.schedule.data_step(step)
    idx = 0
    for i, p in enumerate(data.schedule.phases):
        if p.from_step <= d:
            idx = i
    return idx


class CanaryMismatchWarning(UserWarning):
    """The periodic canary found a device that disagrees with the others or with the golden value."""


class PeriodicCanary:
    """The periodic canary of a training run (``canary_every``): the fixed canary batch (the first
    ``canary.rows`` rows of the batch of ``canary.step``) and fixed weights (a fresh init from
    ``canary.seed``) through forward and backward on every device of the run at once
    (``ReferenceTrainer.canary_fingerprints``), judged by ``replay.run.canary.decide_canary`` against
    the golden value of this environment in ``<run>/canary/golden.json`` (created from the majority
    of the devices by the first canary of the environment).

    Each run appends one :class:`replay.run.protocol.CanaryRecord` per device to ``canary.jsonl``; a
    device that disagrees is a ``canary_mismatch`` event (naming it) and a
    :class:`CanaryMismatchWarning`.
    """

    def __init__(self, cfg: RunConfig, trainer, mesh, rd: "RunDir", env: Mapping[str, Any]):
        from replay.run import canary as cn

        host = canary_batch(cfg, mesh)
        self.batch = {k: v[: cfg.canary.rows, : cfg.canary.seq_len] for k, v in host.items()}
        self.trainer, self.rd = trainer, rd
        self.params = trainer.init_params(mesh, cfg.canary.seed)
        shape = "x".join(f"{a}{n}" for a, n in zip(mesh.axis_names, mesh.devices.shape))
        if cfg.canary.seq_len is not None:
            shape += f"-seq{self.batch['inputs'].shape[1]}"
        self.spec = cn.CanarySpec(step=cfg.canary.step, rows=cfg.canary.rows, weights=f"init:{cfg.canary.seed}",
                                  batch_sha256=cn.batch_sha256(self.batch), program=f"mesh:{shape}")
        self.env_key = cn.environment_key(self.spec, env)
        self.golden_path = rd.file(cn.GOLDEN_DEFAULT)
        cn.read_golden(self.golden_path)  # a corrupt golden file is reported before training starts

    def run(self, step: int, fault=None, persistent=None):
        """Runs the canary before ``step``; returns ``(CanaryDecision, seconds)``. ``persistent``: the
        training step's drill faults, whose persistent ones fire in the canary program too
        (``ReferenceTrainer.canary_fingerprints``)."""
        import time
        import warnings

        from replay.run import canary as cn
        from replay.run.codes import Verdict

        # Read before the canary's collective program, written by process 0 after it: every process of
        # the run decides from the same golden value.
        golden = (cn.read_golden(self.golden_path).get(self.env_key) or {}).get("signature")
        t0 = time.perf_counter()
        fps = self.trainer.canary_fingerprints(self.params, self.batch, fault, persistent=persistent, step=step)
        seconds = time.perf_counter() - t0
        results = [cn.DeviceResult(d, (cn.fingerprints_signature(f),), f) for d, f in fps.items()]
        decision = cn.decide_canary(results, golden)
        if decision.golden_status == "created" and self.rd.primary:
            try:
                cn.update_golden(self.golden_path, self.env_key,
                                 {"signature": decision.reference, "canary": self.spec.to_dict(),
                                  "created_from": f"majority of {len(results)} device(s) at step {step}"})
            except OSError as e:  # the verdict stands; the next canary tries again
                decision = dataclasses.replace(decision, golden_status="created-not-saved",
                                               explanation=f"{decision.explanation} (golden not saved: {e})")
        for r in results:
            self.rd.append_canary(proto.CanaryRecord(
                step=step, device=r.id, signature=r.signatures[0], status=decision.statuses[r.id],
                golden=decision.golden_status, canary=self.spec.name, seconds=round(seconds, 6)))
        if decision.verdict is not Verdict.ACQUITTED:
            devices = list(decision.odd_devices) or sorted(decision.statuses)
            self.rd.event("canary_mismatch", step, devices=devices, verdict=decision.verdict.value,
                          statuses={str(k): v for k, v in decision.statuses.items()}, canary=self.spec.name,
                          explanation=decision.explanation)
            warnings.warn(CanaryMismatchWarning(f"canary before step {step}: {decision.explanation}"), stacklevel=2)
        return decision, seconds


def train(
    run_dir: str,
    cfg: RunConfig,
    steps: int,
    *,
    trainer=None,
    mesh=None,
    log: Optional[Callable[[str], None]] = None,
    faults: Any = None,
    canary_fault: Any = None,
    progress: Optional[TextIO] = None,
    plot: bool = True,
    on_step: Optional[Callable[[int, float], None]] = None,
    rewind_to: Optional[int] = None,
    rewind_reason: Optional[str] = None,
    launched_at: Optional[float] = None,
    loader_shift: int = 0,
) -> dict[str, Any]:
    """Trains until global step ``steps`` (exclusive), resuming from the run directory's last checkpoint.

    Args:
      run_dir: the run directory (created).
      cfg: the run config.
      steps: the step to stop at (total, not additional: rerunning the same command after
        a kill finishes the same run).
      trainer, mesh: a prepared :class:`ReferenceTrainer` and its mesh (tests reuse the
        compiled step); default from ``cfg``.
      log: warnings of the loop (a canary mismatch; default: stderr).
      progress: the stream of the step progress (``replay.run.progress``: a Rich bar on a terminal, a
        line every ``$REPLAY_PROGRESS_EVERY`` s otherwise, with step, steps/s, tokens/s, step time,
        loss and ETA; and a closing ``train: steps A:B done in ...`` line); default stderr.
      plot: write ``<run_dir>/train.png`` (``replay.run.train_plot.plot_training``: the whole run,
        earlier invocations included) at the end, also when there was nothing to train.
      on_step: called after each step with the step and its loss (benchmarks time steps with it).
      faults: a drill (``replay drill --scenario``): passed to every ``trainer.train_step`` as its
        ``fault`` (``FaultSpec``/``DriftSpec`` or a list of them; each fires at its own steps), and to
        each periodic canary, where a drift active at its step (a device's persistent fault) fires too.
      canary_fault: a drill: a ``FaultSpec`` whose bit is flipped in its device's canary gradient
        at every periodic canary from step ``canary_fault.step`` on.
      rewind_to: roll back: restore this checkpoint of the lineage instead of the newest (a ``rewind``
        event with ``rewind_reason`` is written first; the steps trained past it become a superseded
        attempt, kept in ``superseded/``). A rewind that ``replay skip`` recorded is followed without it.
      launched_at: Unix time the training command started (``time.time()``; default: now), the
        start of the attempt's start-up in ``replay goodput``.
      loader_shift: a drill only (``replay drill --scenario restart``): the resumed loader starts
        ``loader_shift`` steps off the restored checkpoint (a wrong loader state: data repeated when
        negative, skipped when positive), while the ``restore`` event records the checkpoint's own state
        (what a trainer that believes it resumed exactly logs): triage must find the shift from the batches.

    Returns:
      ``{"start": first step run, "end": steps, "losses": {step: loss}, "stopped": None or
      {"step", "reason"}, "canary_seconds": [seconds of each periodic canary], "plot": the path
      of train.png or None, "attempt": this attempt's number}``.

    Raises:
      RunConfigError: ``cfg`` does not fit the run directory, or ``steps`` < 0, or ``rewind_to`` is
        not a checkpoint of the lineage.
      loader errors (``DatasetError``, ``ResumeError``) as raised by ``loader.build``.
    """
    import time

    from replay.run import inputs as run_inputs
    from replay.run import lineage as lin
    from replay.run.env import compare_environment, record_environment
    from replay.run.progress import line_interval, note, step_progress
    from replay.reference import checkpoint as ckpt

    launched_at = time.time() if launched_at is None else float(launched_at)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise RunConfigError(f"steps: must be an int >= 0, got {steps!r}")
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    line_interval()  # a bad $REPLAY_PROGRESS_EVERY is reported before any work
    say = functools.partial(note, "train", stream=progress)  # no silent wait before the first step
    if trainer is None or mesh is None:
        say(f"run config {cfg.name}: starting JAX, building the mesh and the model")
        trainer, mesh, _ = make_trainer(cfg)
    existed = os.path.isdir(run_dir)
    rd = run_dir_of(run_dir, mesh)
    rd.drop_torn_event()
    lineage = _lineage(rd)
    requested = [w for w in lineage.skip_windows if tuple(w) not in {tuple(x) for x in cfg.skip_windows}]
    if requested:  # windows recorded by `replay skip`: in force from now on
        cfg = dataclasses.replace(cfg, skip_windows=tuple(sorted({*cfg.skip_windows, *map(tuple, requested)})))
    grown = _check_same_config(rd, cfg, write_grown=False)
    _check_same_mixture(rd, cfg)
    env = record_environment(mesh)
    env_path = rd.file(proto.ENV_NAME)
    step_logs = (proto.FINGERPRINTS_NAME, proto.SIGNALS_NAME, proto.CANARY_NAME)

    committed = ckpt.all_steps(rd.checkpoints)
    if rewind_to is not None:
        try:
            lin.validate_rewind(lineage, rewind_to, committed)
        except lin.LineageError as e:
            raise RunConfigError(f"--from-checkpoint {rewind_to}: {e}") from None
        rd.event("rewind", rewind_to, checkpoint=rewind_to, previous_end=max(lineage.end, _logged_end(rd)),
                 kind="rollback", reason=rewind_reason or "rollback",
                 by="python -m replay.reference.train --from-checkpoint")
        lineage = _lineage(rd)
    pending = lineage.pending_rewind
    if pending is not None:
        latest = int(pending.get("checkpoint", pending["step"]))
        if latest not in committed:
            raise RunConfigError(f"cannot resume {rd.path}: the rewind to checkpoint {latest} that was recorded "
                                 f"({pending.get('by', 'replay skip')}) names no committed checkpoint "
                                 f"(checkpoints: {committed})")
    else:
        latest = ckpt.latest_step(rd.checkpoints)
    attempt = lineage.next_attempt()
    rd.attempt = attempt
    loader_state = None
    restore_s = 0.0
    if latest is None:
        say(_new_run_note(run_dir, existed, cfg.seed))
        rd.write_whole(proto.ENV_NAME, json.dumps(env, indent=1, sort_keys=True))
        state = trainer.init_state(mesh, cfg.seed)
        start = 0
        for name in step_logs:
            rd.truncate_log(name, 0)
    else:
        recorded = {}
        if os.path.exists(env_path):
            with open(env_path, encoding="utf-8") as f:
                recorded = json.load(f)
        from replay.run.fingerprint import FINGERPRINT_VERSION, version_mismatch

        if recorded and version_mismatch(recorded) is not None:
            got = (recorded.get("versions") or {}).get("fingerprint", 1)
            raise RunConfigError(
                f"cannot resume {rd.path}: its fingerprints.jsonl holds fingerprints of formula version {got!r} "
                f"(env.json versions.fingerprint) and this code computes version {FINGERPRINT_VERSION}, so one log "
                "would mix two formulas that replay cannot compare; finish this run with the toolkit release that "
                "started it, or train on in a new run directory")
        if latest < steps:  # else nothing to do: said at the end
            say(f"resuming {run_dir} from checkpoint {latest}")
        t0 = time.perf_counter()
        try:
            state, loader_state = trainer.restore(rd.path, latest, mesh)
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore report a damaged checkpoint many ways
            ckpt.quiet_aborted_reads()
            first = (str(e).strip().splitlines() or [""])[0][:300]
            older = [c for c in ckpt.all_steps(rd.checkpoints) if c < latest]
            raise RunConfigError(
                f"cannot resume {rd.path}: checkpoint {latest} is damaged ({type(e).__name__}: {first}); move "
                f"{os.path.join(rd.checkpoints, str(latest))} aside to resume from "
                f"{older[-1] if older else 'scratch'}") from None
        check = _verify_restore(rd, latest, state, loader_state)  # a damaged checkpoint is never trained on
        if check.note:
            say(check.note)
        restore_s = time.perf_counter() - t0
        start = latest
    if loader_shift and loader_state is not None:  # a drill: a wrong loader state
        loader_state = _shifted_loader_state(loader_state, start + loader_shift)
    data = build_loader(cfg, mesh, state=loader_state)  # refuses skip windows that rewrite the past
    data_start = start + (loader_shift if loader_state is not None else 0)
    if not loader_shift and loader_state is not None and int(loader_state.get("next_step", start)) != start:
        older = [c for c in committed if c < start]
        raise RunConfigError(
            f"checkpoint {start} holds loader state for step {loader_state['next_step']}, not {start} (the loader "
            f"state saved with it was edited, or written by another trainer), so resuming would "
            f"{'skip' if int(loader_state['next_step']) > start else 'repeat'} data; next: put back the loader state "
            f"Orbax saved ({os.path.join(rd.checkpoints, str(start), 'loader')}), or resume from an earlier "
            f"checkpoint: python -m replay.reference.train --run {rd.path} --from-checkpoint "
            f"{older[-1] if older else 'C'}" + (f" (committed: {older})" if older else " (there is none earlier)"))
    if grown is not None and rd.primary:  # accepted by the loader: now the run's config
        with open(rd.file(proto.RUN_CONFIG_NAME), encoding="utf-8") as f:
            written = yaml.safe_load(f)
        _write_config(rd.file(proto.RUN_CONFIG_NAME), {**cfg.to_dict(), "mixture": written["mixture"]})
    if rd.primary:  # process 0 writes the run's single files
        run_inputs.record_inputs(rd.path, data.mixture, cfg.mixture, cfg.dataset, data.manifest_sha256,
                                 data.schedule.to_dict())
    info = _model_info(trainer, cfg.global_batch, data.seq_len)
    logged_start = start if loader_shift else data_start  # a drill's trainer believes it resumed exactly
    loader_rec = {"next_step": logged_start, "data_step": data.schedule.data_step(logged_start),
                  "fingerprint": data.state().fingerprint}
    common = {"attempt": attempt, "launched_at": round(launched_at, 6), "steps": steps, **info}
    if latest is None:
        rd.event("start", 0, name=cfg.name, mesh=dict(zip(mesh.axis_names, mesh.devices.shape)),
                 loader_state=loader_rec, **common)
    else:
        previous_end = max(lineage.end, _logged_end(rd))
        by_step = _writer_of(lineage)
        moved = rd.supersede(start, by_step, attempt)  # each process its own step-log files
        moved_ckpts = rd.supersede_checkpoints(start, attempt) if rd.primary else []
        from replay.run import distributed

        distributed.sync("replay-train-superseded")  # every process past it before any saves again
        # a restore nobody asked to roll back is a resume, also when newer checkpoints of the lineage are
        # gone (lost or damaged): they are named, and the steps after `start` are lost to the crash
        reason = str(pending.get("kind") or "rewind") if pending is not None else "resume"
        missing = [] if pending is not None else sorted(
            c for c in _lineage_checkpoints(lineage) if c > start and c not in committed)
        if missing:
            say(f"resuming from checkpoint {start}: the lineage's newer checkpoint(s) {missing} are no longer committed "
                "(lost or moved aside); the steps after it are trained again")
        rd.event("restore", start, checkpoint=latest, reason=reason, previous_end=previous_end,
                 **({"checkpoints_missing": missing} if missing else {}),
                 superseded={"steps": [start, previous_end] if previous_end > start else None,
                             "lines": moved, "checkpoints": moved_ckpts},
                 dropped_fingerprint_lines=moved.get(proto.FINGERPRINTS_NAME, 0), restore_s=round(restore_s, 6),
                 loader_state=loader_rec, env_differences=compare_environment(recorded, env),
                 skip_windows_changed=grown, state_check=check.status, **common)
    for ev in data.events:  # e.g. a skip window appended on restore
        name = "skip_window_added" if ev.get("event") == "skip_window" else f"loader_{ev.get('event', 'event')}"
        rd.event(name, ev.get("step", start), **{k: v for k, v in ev.items() if k not in ("event", "step")})
    canary = PeriodicCanary(cfg, trainer, mesh, rd, env) if cfg.canary_every and start < steps else None

    mngr = ckpt.manager(rd.checkpoints)
    pending_saves: list[int] = []  # checkpoints saved (asynchronously), not yet known to have committed
    records: dict[int, Any] = {}  # their state records (replay.run.statefp), written at the commit
    refused: list[dict[str, Any]] = []  # non_finite: stop refused to save a non-finite state
    from replay.run import statefp

    save_started: dict[int, float] = {}  # step -> Unix time its save started (the checkpoint event's save_start_t)

    def save(step_: int) -> float:
        """Fingerprints the state (on the devices) and starts an asynchronous save; returns the seconds
        the loop was blocked by both. A non-finite state under ``non_finite: stop`` is not saved."""
        t_ = time.perf_counter()
        save_started[step_] = time.time()
        loader_now = data.state().to_dict()
        record = _state_record(rd, cfg, state, loader_now, step_, log)
        if not record.finite and cfg.non_finite == "stop":
            refused.append({"step": step_, "nonfinite": record.data["nonfinite"]})
            save_started.pop(step_, None)
            return time.perf_counter() - t_
        path = statefp.write_record(rd.path, record) if rd.primary else None  # before the save: a kill after
        ckpt.save(mngr, step_, state, loader_now)  # Orbax's commit and before the event still leaves it
        pending_saves.append(step_)
        records[step_] = (record, path)
        return time.perf_counter() - t_

    def commit_events(wait: bool) -> None:
        """A ``checkpoint`` event for each pending save that has committed (Orbax's commit: the
        temporary folder renamed, or commit_success.txt written), ``checkpoint_failed`` for one that
        finished without committing; with ``wait``, waits for the saves in flight first."""
        if not pending_saves:
            return
        if wait:
            mngr.wait_until_finished()
        elif mngr.is_saving_in_progress():
            return
        for s_ in pending_saves:
            started = save_started.pop(s_, None)
            times = {"save_start_t": round(started, 6)} if started is not None else {}
            if ckpt.is_committed(rd.checkpoints, s_):
                commit = ckpt.commit_time(mngr, s_)
                rd.event("checkpoint", s_, **times, **({"commit_t": round(commit, 6)} if commit is not None else {}),
                         **_record_fields(records.pop(s_, None)))
            else:
                rd.event("checkpoint_failed", s_, **times)
        pending_saves.clear()

    blocked = save(0) if latest is None else 0.0  # the first step's interval carries the initial save
    losses: dict[int, float] = {}
    canary_seconds: list[float] = []
    stopped = None
    phase = _phase_index(data, data_start) if start < steps else None
    windows = {a: b for a, b in cfg.skip_windows}
    finished = False
    final_wait = 0.0
    bar = contextlib.ExitStack()
    compiled = _CompileClock()
    try:
        if start < steps:
            shown = bar.enter_context(step_progress("train", start, steps, stream=progress,
                                                    first=_compiling_note(canary is not None and start % cfg.canary_every == 0)))
            served = int(data.metrics()["tokens_served"])
            for data_step_, batch in data.iterate(data_start):
                step = data_step_ - (data_start - start)
                metrics = data.metrics()
                p = _phase_index(data, data_step_)
                if p != phase:
                    rd.event("phase_change", step, phase=p, from_data_step=data.schedule.phases[p].from_step)
                    phase = p
                if step in windows:
                    rd.event("skipped_window", step, start=step, end=windows[step],
                             data_step=data.schedule.data_step(step))
                canary_s = 0.0
                if canary is not None and step % cfg.canary_every == 0:
                    hit = canary_fault if canary_fault is not None and step >= canary_fault.step else None
                    decision, seconds = canary.run(step, hit, faults)
                    canary_seconds.append(seconds)
                    canary_s = seconds
                    if decision.verdict.value != "acquitted":
                        log(f"WARNING: canary before step {step}: {decision.explanation}")
                        if cfg.canary_action == "stop":
                            if step not in pending_saves and not ckpt.is_committed(rd.checkpoints, step):
                                save(step)
                            stopped = {"step": step, "reason": decision.explanation}
                            rd.event("stopped", step, reason="canary_mismatch", devices=list(decision.odd_devices))
                            break
                c0 = compiled.seconds
                t0 = time.perf_counter()
                before = state if cfg.non_finite == "skip_step" else None  # kept only to drop an update
                state, fp = trainer.train_step(state, batch, step, faults)
                dt = time.perf_counter() - t0
                bad = non_finite_in(fp)
                if bad is not None:  # non_finite: stop | skip_step | warn, each an event
                    rd.event("non_finite", step, action=cfg.non_finite, what=bad, loss=_json_float(fp.router["loss"]))
                    log(f"WARNING: step {step}: {bad} (non_finite: {cfg.non_finite})")
                    if cfg.non_finite == "skip_step":
                        state = before  # the update is dropped: the next step starts from the state before it
                compile_s = compiled.seconds - c0
                rd.append_fingerprints(fp)
                losses[step] = fp.router["loss"]
                dropped_max = max((r.dropped_fraction for r in fp.signals.router), default=fp.router["dropped_fraction"]) \
                    if fp.signals is not None else fp.router["dropped_fraction"]
                now_served = int(metrics["tokens_served"])
                nxt = step + 1
                if bad is not None and cfg.non_finite == "stop":
                    refused.append({"step": nxt, "nonfinite": bad})
                elif nxt % cfg.checkpoint_every == 0 or nxt == steps:
                    blocked += save(nxt)
                commit_events(wait=False)
                if fp.signals is not None:
                    rd.append_signals(dataclasses.replace(
                        fp.signals, step_time_s=round(dt, 6), **input_signals(metrics), t=round(time.time(), 6),
                        compile_s=round(min(compile_s, dt), 6), canary_s=round(canary_s, 6),
                        checkpoint_s=round(blocked, 6), tokens=now_served - served))
                blocked = 0.0
                shown.update(step, tokens=now_served - served, step_s=dt, loss=fp.router["loss"], dropped=dropped_max)
                served = now_served
                if on_step is not None:
                    on_step(step, fp.router["loss"])
                if refused:
                    stopped = _non_finite_stop(rd, step, refused[0])
                    break
                if nxt >= steps:
                    break
        t_wait = time.perf_counter()
        commit_events(wait=True)
        final_wait = time.perf_counter() - t_wait
        finished = True
    except BaseException:
        bar.__exit__(*sys.exc_info())
        raise
    else:
        bar.close()
    finally:
        compiled.close()
        try:
            mngr.close()  # waits for a save in flight
            commit_events(wait=False)
        except Exception:  # noqa: BLE001
            if finished:
                raise  # else already failing: the original error is the one to see
    rd.event("end", max(start, steps) if stopped is None else stopped["step"], final_save_s=round(final_wait, 6))
    picture = None
    if plot and rd.primary:
        from replay.run.train_plot import plot_training

        picture = plot_training(rd.path, title=f"training run {cfg.name} ({rd.path})")
    return {"start": start, "end": steps, "losses": losses, "stopped": stopped, "canary_seconds": canary_seconds,
            "plot": picture, "attempt": attempt}


def non_finite_in(fp) -> Optional[str]:
    """What was non-finite in a step (``StepFingerprints``): its loss, its gradient norm, or the
    gradient leaves and devices the signals count (``StepSignals.devices[d]["nonfinite"]``); None when
    everything is finite."""
    import math

    import numpy as np

    what = []
    loss = float(fp.router.get("loss", 0.0))
    if not math.isfinite(loss):
        what.append(f"loss {loss}")
    norm = float(np.asarray(fp.grad_norm_bits, np.uint32).view(np.float32))
    if not math.isfinite(norm):
        what.append(f"gradient norm {norm}")
    if fp.signals is not None:
        counts: dict[str, int] = {}
        for d, rec in sorted(fp.signals.devices.items()):
            for leaf, n in (rec.get("nonfinite") or {}).items():
                counts[f"{leaf} on device {d}"] = int(n)
        if counts:
            first = list(counts.items())[:3]
            what.append(f"non-finite gradient elements ({', '.join(f'{k}: {v}' for k, v in first)}"
                        + (f", {len(counts) - 3} more" if len(counts) > 3 else "") + ")")
    return "; ".join(what) if what else None


def _json_float(v: float):
    import math

    return v if math.isfinite(v) else str(v)


def _verify_restore(rd: RunDir, step: int, state, loader_state):
    """The restored checkpoint against its state record (``replay.run.statefp.verify_restored``):
    raises ``DamagedCheckpointError`` / ``PoisonedCheckpointError``; a checkpoint without a record
    (a run from before records) comes back ``unverified`` with a note."""
    from replay.run import statefp

    return statefp.verify_restored(rd.path, step, state, loader_state)


def _state_record(rd: RunDir, cfg: RunConfig, state, loader_state, step: int, log) -> Any:
    """The state record of checkpoint ``step`` (on the devices, every process); replicas that disagree
    are a ``state_replicas_disagree`` event naming device, leaf and shard, a non-finite state a
    ``non_finite_state`` event."""
    from replay.run import statefp

    record = statefp.record_state(state, loader_state, step)
    if not record.replicas_agree:
        first = record.data["disagree"][0]
        rd.event("state_replicas_disagree", step, devices=record.odd_devices(), disagree=record.data["disagree"][:20],
                 shards=len(record.data["disagree"]))
        log(f"WARNING: checkpoint {step} is poisoned: the copies of {first['leaf']} shard {first['shard']} disagree, "
            f"{statefp.disagreement_text(first)} (silent data corruption in the update or in "
            f"memory); no restore will take it as healthy: run 'replay certify --run {rd.path}'")
    if not record.finite:
        rd.event("non_finite_state", step, action=cfg.non_finite, nonfinite=record.data["nonfinite"])
    return record


def _record_fields(saved) -> dict[str, Any]:
    """The ``checkpoint`` event's ``state`` fields of a ``(record, path)`` written at the save (or none)."""
    from replay.run import statefp

    return {} if saved is None else statefp.event_fields(*saved)


def _non_finite_stop(rd: RunDir, step: int, refused: Mapping[str, Any]) -> dict[str, Any]:
    """``non_finite: stop``: the ``stopped`` event and the loop's summary of it."""
    what = refused["nonfinite"]
    what = what if isinstance(what, str) else f"the state holds NaN/Inf ({dict(list(what.items())[:3])})"
    reason = (f"step {step}: {what}; stopped before checkpoint {refused['step']} could hold it (non_finite: stop)")
    rd.event("stopped", step + 1, reason="non_finite", detail=reason, checkpoint_refused=refused["step"])
    return {"step": step + 1, "reason": reason, "kind": "non_finite", "first_step": step}


class _CompileClock:
    """Seconds of JAX tracing, lowering and XLA compilation since it was made, from JAX's own
    monitoring events (``jax.monitoring``: ``/jax/core/compile/*_duration``), whatever thread compiles."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        import jax

        self.seconds = 0.0

        def listen(event, duration, **_):
            if event in self.EVENTS:
                self.seconds += float(duration)

        self._listen = listen
        jax.monitoring.register_event_duration_secs_listener(listen)

    def close(self) -> None:
        import jax

        try:
            jax.monitoring.unregister_event_duration_listener(self._listen)
        except (AssertionError, ValueError):  # already gone
            pass


def _lineage(rd: RunDir):
    """The run directory's lineage (``replay.run.lineage``) from its events and step log."""
    from replay.run import lineage as lin

    events = proto.read_events(rd.path) if os.path.exists(rd.file(proto.EVENTS_NAME)) else []
    steps = _logged_steps(rd)
    return lin.lineage_of_run(rd.path, events, steps)


def _logged_steps(rd: RunDir) -> list[int]:
    path = rd.file(proto.FINGERPRINTS_NAME)
    out = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
    return out


def _logged_end(rd: RunDir) -> int:
    steps = _logged_steps(rd)
    return max(steps) + 1 if steps else 0


def _writer_of(lineage) -> Callable[[int], Optional[int]]:
    """``step -> the attempt whose line of that step the step log holds``: the last attempt that trained it."""
    def writer(step: int) -> Optional[int]:
        for a in reversed(lineage.attempts):
            end = a.trained_end if a.trained_end is not None else lineage.end
            if a.start <= step < max(end, a.lineage[1]):
                return a.id
        return None

    return writer


def _lineage_checkpoints(lineage) -> list[int]:
    return [int(e["step"]) for e in lineage.events if e.get("event") == "checkpoint" and isinstance(e.get("step"), int)]


def _shifted_loader_state(state: Mapping[str, Any], next_step: int) -> dict[str, Any]:
    """A drill's wrong loader state: ``state`` with another ``next_step`` (fingerprint unchanged: it covers
    the schedule, not the step)."""
    if next_step < 0:
        raise RunConfigError(f"loader_shift: the shifted loader state would start at step {next_step} < 0")
    return {**dict(state), "next_step": int(next_step)}


def _model_info(trainer, global_batch: int, seq_len: int) -> dict[str, Any]:
    """What ``replay goodput`` needs of the model, logged in the start and restore events: ``params``,
    ``active_params`` (per token), ``tokens_per_step`` (global batch x seq_len slots) and
    ``flops_per_step`` = ``6 * active_params * tokens_per_step``, the usual estimate of a decoder's
    training FLOPs (forward 2, backward 4 per parameter and token: Kaplan et al. 2020, eq. 2.1;
    attention's share is left out)."""
    try:
        counts = _parameter_counts(trainer.model)
    except AttributeError:  # a trainer without a reference model: no FLOPs logged
        return {}
    tokens = int(global_batch) * int(seq_len)
    return {"params": counts["total"], "active_params": counts["active"], "tokens_per_step": tokens,
            "flops_per_step": 6 * counts["active"] * tokens}


def _parameter_counts(model) -> dict[str, int]:
    """``{"total", "active"}`` parameters of the reference model: an expert's weights count toward the
    active parameters with the share ``top_k / n_experts`` (each token runs top_k of the experts)."""
    import jax
    import numpy as np

    from replay.reference.model import init_params

    abstract = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    total = active = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        n = int(np.prod(leaf.shape))
        total += n
        name = jax.tree_util.keystr(path)
        expert = leaf.ndim >= 1 and leaf.shape[0] == model.n_experts and ("w_in" in name or "w_out" in name
                                                                              or "expert" in name)
        active += n * model.top_k // model.n_experts if expert else n
    return {"total": total, "active": active}


def _check_same_mixture(rd: RunDir, cfg: RunConfig) -> None:
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


def _new_run_note(run_dir: str, existed: bool, seed: int) -> str:
    """The line a new run starts with; for a folder that was not there, the nearest existing run
    directory (a typo in ``--run`` would otherwise start a new run from step 0 without a word)."""
    from replay.run.runlog import nearest_run_dir

    near = None if existed else nearest_run_dir(run_dir)
    where = (f"new run directory {run_dir} (it did not exist; the nearest existing run directory is {near}, in "
             "case --run meant it)" if near else f"new run in {run_dir}")
    return f"{where}: initializing the parameters (seed {seed}) and saving checkpoint 0"


def _compiling_note(canary: bool) -> str:
    """What the first step of an invocation waits for: XLA compiling its programs (or loading them
    from JAX's persistent compilation cache, when one is set)."""
    import jax

    cached = bool(getattr(jax.config, "jax_compilation_cache_dir", None))
    what = "the train step" + (" and the periodic canary" if canary else "")
    return (f"compiling {what}" + (" (or loading from JAX's compilation cache)" if cached else "")
            + ": the first step takes longer, the steps after it run at speed")


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


def run_dir_of(path: str, mesh) -> RunDir:
    """The run directory as this process writes it: process 0 the run's single files, each process its
    own devices' step-log entries (``replay.run.writer``)."""
    import jax

    me = jax.process_index()
    local = [int(d.id) for d in mesh.devices.reshape(-1) if d.process_index == me]
    count = jax.process_count()
    return RunDir(path, process_index=me, process_count=count, local_devices=local if count > 1 else None)
