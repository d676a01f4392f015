"""The replay engine: an opened run (:class:`Session`) and range replay (:func:`replay_range`).

Canary, inspect and drill build on the session in ``replay.verify.canary``, ``replay.screen.forensics`` and
``replay.drill``. The command line (``replay.cli``) is a thin layer over these library
functions; tests call them directly.

Range replay (issue 5, points 2 to 4)::

    run dir --load_run--> RunLog (config, env, events, fingerprints, checkpoints, quarantine)
    device spec --select_devices--> good devices --independent_assignments--> meshes M_1, M_2
    for each mesh M_i (and each repeat):
        c   = newest checkpoint <= start           restored read-only (Orbax) onto M_i
        for step in c .. stop-1:                   steps before the range are checked too
            batch = loader batch of step           rebuilt on M_i (batch_at, or the prefetching
                                                   iterate for long stretches), skip windows followed
            state, fp = trainer.train_step(state, batch, step)
            diff = compare_step(log[step], fp)     bit-exact / per-shard / tolerance
            a divergence ends the checkpoint segment: the replay jumps to the next
            checkpoint in the range (the rest of the segment is contaminated)
    decide(outcomes) -> verdict (replay.verify.verdict)

Honesty about "independent devices": on one host of 8 CPU devices the devices share the same
physical CPU, so two device sets are independent only as XLA devices. What the engine
guarantees is that the two replays place *different devices on every mesh position* (disjoint
sets when there are enough good devices, a rotation of them otherwise), so every device shard
of the original run is recomputed by two devices neither of which computed it in the other
replay. On an accelerator pod these are different chips.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from replay.verify import compare as cmp
from replay.run import devices as dv
from replay.run.protocol import FaultSpec, StepFingerprints
from replay.run.runlog import RunDirError, RunLog, missing_steps
from replay.run.codes import Verdict
from replay.run.setup import RunSetup
from replay.verify.localize import describe_site
from replay.verify.verdict import Decision, Evidence, ReplayOutcome, decide

PREFETCH_MIN_STEPS = 8  # stretches this long read batches through the loader's prefetch


class CheckpointCorruptError(RunDirError):
    """A checkpoint of the run exists but cannot be restored (truncated or damaged Orbax files)."""


class EnvDriftError(RuntimeError):
    """The environment differs from the run's and a bit-exact comparison was asked for."""

    def __init__(self, differences: Sequence[str]):
        self.differences = list(differences)
        super().__init__(
            "the environment differs from the run's env.json:\n  " + "\n  ".join(self.differences)
            + "\nrefusing a bit-exact claim; pass --allow-env-drift to replay anyway (the report lists the "
            "differences), or --tolerance RTOL for a weaker comparison"
        )


# ----------------------------------------------------------------------------- run set-up


def skip_windows(run: RunLog) -> list[tuple[int, int]]:
    """Inclusive training-step windows whose data the run skipped, from events.jsonl and the run config.

    The run config's ``skip_windows: [[A, B], ...]`` (what the loader is built with) plus events of
    kind ``skipped_window`` with ``start`` and ``end`` fields (for the report).
    """
    out = []
    for w in run.config.get("skip_windows", []) or []:
        out.append((int(w[0]), int(w[1])))
    for e in run.events_of("skipped_window"):
        lo, hi = e.get("start"), e.get("end")
        if lo is not None and hi is not None and (int(lo), int(hi)) not in out:
            out.append((int(lo), int(hi)))
    return sorted(out)


def phase_changes(run: RunLog) -> list[dict[str, Any]]:
    """The run's logged mixture phase changes (events of kind ``phase``/``phase_change``)."""
    return run.events_of("phase", "phase_change", "mixture_phase")


def checked_loader(run: RunLog, data: Any) -> Any:
    """``data`` (a loader rebuilt for ``run``) once its dataset and mixture schedule are checked to be
    those the run trained with (``replay.run.inputs.check_rebuilt``); every trainer's ``make_loader``
    should return it through this.

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


def default_setup(run: RunLog) -> RunSetup:
    """Builds the :class:`RunSetup` of a reference-trainer run from its run config and env.json.

    The trainer, model sizes (vocab size from the dataset's manifest), optimizer, loader
    arguments and skip windows are those ``replay.reference.run`` trains with; the mesh shape,
    axis names and device order are the run's record in env.json.

    Raises:
      RunDirError: the run config is invalid, names a dataset that is missing, or no mesh was recorded.
    """
    from loader.dataset import read_manifest
    from replay.reference import run as ref_run
    from replay.reference.trainer import ReferenceTrainer

    where = os.path.join(run.run_dir, "run_config.yaml")
    try:
        cfg = ref_run.run_config_from_dict(run.config, run.run_dir)
        manifest, _ = read_manifest(cfg.dataset)
        model = cfg.model_config(int(manifest.tokenizer["vocab_size"]))
    except ValueError as e:  # RunConfigError, DatasetError, ModelConfigError
        raise RunDirError(f"{where}: cannot rebuild the run: {e}") from None
    mesh_rec = run.mesh
    if not (mesh_rec.get("axis_names") and mesh_rec.get("shape")):
        raise RunDirError(f"{os.path.join(run.run_dir, 'env.json')}: no mesh recorded (axis_names, shape)")
    env_path = os.path.join(run.run_dir, "env.json")
    try:
        axis_names = tuple(str(a) for a in mesh_rec["axis_names"])
        shape = tuple(int(s) for s in mesh_rec["shape"])
        run_ids = tuple(int(i) for i in mesh_rec.get("device_ids", ()) or ())
    except (TypeError, ValueError) as e:
        raise RunDirError(f"{env_path}: malformed mesh record {dict(mesh_rec)!r} ({e})") from None
    if len(axis_names) != len(shape) or any(s < 1 for s in shape):
        raise RunDirError(f"{env_path}: malformed mesh record: axis_names {list(axis_names)}, shape {list(shape)}")
    if run_ids and len(run_ids) != int(np.prod(shape)):
        raise RunDirError(f"{env_path}: mesh device_ids {list(run_ids)} do not fill the mesh shape {list(shape)}")
    trainer = ReferenceTrainer(model, cfg.optimizer)

    def make_loader(mesh):
        return checked_loader(run, ref_run.build_loader(cfg, mesh))

    return RunSetup(trainer=trainer, axis_names=axis_names, shape=shape, run_device_ids=run_ids,
                    make_loader=make_loader, seed=cfg.seed, global_batch=cfg.global_batch, mixture=cfg.mixture,
                    dataset=cfg.dataset, canary_step=cfg.canary.step, canary_seed=cfg.canary.seed,
                    canary_rows=cfg.canary.rows, canary_seq_len=cfg.canary.seq_len)


# ----------------------------------------------------------------------------- session


class Session:
    """A run opened for replay: caches meshes, loaders, compiled steps and restored checkpoints.

    Args:
      run: the loaded run directory.
      setup: how to rebuild trainer and loader (default: :func:`default_setup`).
    """

    def __init__(self, run: RunLog, setup: Optional[RunSetup] = None):
        import jax

        self.run = run
        self.setup = setup or default_setup(run)
        self.jax_devices = {d.id: d for d in jax.devices()}
        self._meshes: dict[tuple[int, ...], Any] = {}
        self._loaders: dict[Any, Any] = {}
        self._states: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._batches: dict[tuple[int, tuple[int, ...]], Any] = {}
        self.restore_seconds = 0.0

    def device_infos(self) -> list[dv.DeviceInfo]:
        return [dv.DeviceInfo(d.id, d.process_index, d.device_kind) for d in self.jax_devices.values()]

    def mesh(self, assignment: Sequence[int]):
        """The run's mesh shape with ``assignment`` (device ids, row-major) placed on it."""
        from jax.sharding import Mesh

        key = tuple(assignment)
        if key not in self._meshes:
            devs = np.asarray([self.jax_devices[i] for i in key], dtype=object).reshape(self.setup.shape)
            self._meshes[key] = Mesh(devs, self.setup.axis_names)
        return self._meshes[key]

    def loader(self, assignment: Sequence[int]):
        key = tuple(assignment)
        if key not in self._loaders:
            self._loaders[key] = self.setup.make_loader(self.mesh(key))
        return self._loaders[key]

    def lookup_loader(self):
        """A loader for lookups only (``rows_at``, ``read_rows``: ``replay inspect``), on a mesh of the
        run's axes with one device, so it works on any machine whatever its device count."""
        from jax.sharding import Mesh

        if "lookup" not in self._loaders:
            first = self.jax_devices[min(self.jax_devices)]
            mesh = Mesh(np.asarray([first], dtype=object).reshape((1,) * len(self.setup.axis_names)),
                        self.setup.axis_names)
            self._loaders["lookup"] = self.setup.make_loader(mesh)
        return self._loaders["lookup"]

    def batch(self, step: int, assignment: Sequence[int]):
        key = (step, tuple(assignment))
        if key not in self._batches:
            if len(self._batches) > 256:
                self._batches.clear()
            self._batches[key] = self.loader(assignment).batch_at(step)
        return self._batches[key]

    def run_coords(self) -> dict[int, Any]:
        """``device id -> mesh position`` of the run, from env.json (for logs without ``device_coords``)."""
        raw = self.run.mesh.get("device_coords") or {}
        return {int(d): cmp.position_key(c) for d, c in raw.items()}

    def home_assignment(self) -> tuple[int, ...]:
        """The run's own device order when this process has those devices, else the first devices."""
        ids = tuple(self.setup.run_device_ids)
        if ids and all(i in self.jax_devices for i in ids):
            return ids
        avail = sorted(self.jax_devices)
        if len(avail) < self.setup.mesh_size:
            raise dv.DeviceSpecError(
                f"this process has {len(avail)} device(s), the run's mesh needs {self.setup.mesh_size}")
        return tuple(avail[: self.setup.mesh_size])

    def numpy_batch(self, step: int, assignment: Sequence[int]) -> dict[str, np.ndarray]:
        """The global batch of ``step`` as host NumPy arrays (int32 ``[B, L]``)."""
        import jax

        return {k: np.array(jax.device_get(v)) for k, v in self.batch(step, assignment).items()}

    def init_state(self, assignment: Sequence[int], seed: int):
        """The trainer's initialization from ``seed`` on ``assignment``'s mesh (cached)."""
        key = (-1 - seed, tuple(assignment))
        if key not in self._states:
            self._states[key] = self.setup.trainer.init_state(self.mesh(assignment), seed)
        return self._states[key]

    def restore(self, checkpoint: int, assignment: Sequence[int]):
        """The train state of ``checkpoint`` on ``assignment``'s mesh (restored once, then cached).

        The reference trainer's step does not donate its input, so a cached state stays valid.
        """
        key = (checkpoint, tuple(assignment))
        if key not in self._states:
            t0 = time.perf_counter()
            try:
                state, _ = self.setup.trainer.restore(self.run.run_dir, checkpoint, self.mesh(assignment))
            except FileNotFoundError as e:
                raise RunDirError(str(e)) from None
            except Exception as e:  # noqa: BLE001 - Orbax/TensorStore report a damaged checkpoint many ways
                from replay.reference.checkpoint import quiet_aborted_reads

                quiet_aborted_reads()
                first = (str(e).strip().splitlines() or [""])[0][:400]
                older = [c for c in self.run.checkpoints if c < checkpoint]
                raise CheckpointCorruptError(
                    f"checkpoint {checkpoint} of {self.run.run_dir} cannot be restored: it is damaged or "
                    f"incomplete, or does not fit the model of run_config.yaml ({type(e).__name__}: {first})"
                    + (f"; replay from an older checkpoint ({older}) with --steps C:B" if older else "")
                ) from None
            self.restore_seconds += time.perf_counter() - t0
            if len(self._states) > 16:
                self._states.clear()
            self._states[key] = state
        return self._states[key]

    def run_steps(
        self,
        assignment: Sequence[int],
        checkpoint: int,
        stop: int,
        *,
        log: Optional[Mapping[int, StepFingerprints]] = None,
        tolerance: Optional[float] = None,
        fault: Optional[FaultSpec] = None,
        checkpoints: Sequence[int] = (),
        advance: Callable[[int], None] = lambda n=1: None,
        keep_state_at: Optional[int] = None,
    ) -> tuple[list[StepFingerprints], list[cmp.StepDiff], dict[int, Any]]:
        """Replays steps ``checkpoint .. stop-1`` on ``assignment``, comparing each with ``log``.

        A divergence ends its checkpoint segment: later steps up to the next checkpoint in
        ``checkpoints`` are skipped (their state is contaminated) and the replay resumes there.

        Returns:
          ``(replayed fingerprints, diffs against log, {step: state after that step})`` where the
          last holds only ``keep_state_at`` when given.
        """
        trainer = self.setup.trainer
        state = self.restore(checkpoint, assignment)
        fps, diffs, kept = [], [], {}
        later = sorted(c for c in checkpoints if checkpoint < c < stop)
        step = checkpoint
        while step < stop:
            batches = self._batches_from(step, stop, assignment)
            try:
                for step, batch in batches:
                    state, fp = trainer.train_step(state, batch, step, fault)
                    fps.append(fp)
                    advance(1)
                    if keep_state_at is not None and step == keep_state_at:
                        kept[step] = state
                    if log is None:
                        continue
                    logged = log[step]
                    pairing = cmp.pair_devices(cmp.coords_of(logged) or self.run_coords(), cmp.coords_of(fp))
                    diff = cmp.compare_step(logged, fp, pairing, tolerance)
                    diffs.append(diff)
                    if not diff.ok:
                        break
                else:
                    step = stop
                    continue
            finally:
                batches.close()
            nxt = [c for c in later if c > step]
            if not nxt:
                break
            advance(nxt[0] - step - 1)
            step = nxt[0]
            state = self.restore(step, assignment)
        return fps, diffs, kept

    def _batches_from(self, start: int, stop: int, assignment: Sequence[int]) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` for ``start .. stop-1``: through the loader's prefetching ``iterate`` for
        long stretches (data overlaps compute, as in training), one cached ``batch_at`` each otherwise."""
        if stop - start >= PREFETCH_MIN_STEPS:
            it = self.loader(assignment).iterate(start)
            try:
                for step, batch in it:
                    if step >= stop:
                        return
                    yield step, batch
            finally:
                it.close()
        else:
            for step in range(start, stop):
                yield step, self.batch(step, assignment)


# ----------------------------------------------------------------------------- environment


def environment_differences(run: RunLog, mesh: Any) -> list[str]:
    """Differences that decide bits between the run's env.json and this process (replay.run.env).

    The mesh's device ids are left out (replaying on other devices is the point; the mesh
    shape and axis names still count), and informational notes are dropped.
    """
    from replay.run import env as envmod

    current = envmod.record_environment(mesh)
    diffs = envmod.compare_environment(run.env, current)
    return [d for d in diffs if not d.startswith("note: ") and not d.startswith("mesh.device_ids")
            and not d.startswith("backend.process_index")]


# ----------------------------------------------------------------------------- range replay


@dataclasses.dataclass
class ReplayRun:
    """One replay of a range on one device assignment."""

    index: int
    repeat: int
    assignment: tuple[int, ...]
    fingerprints: list[StepFingerprints]
    diffs: list[cmp.StepDiff]
    seconds: float

    @property
    def evidence(self) -> Evidence:
        order = list(Evidence)
        return max((d.evidence for d in self.diffs), key=order.index, default=Evidence.BIT_EXACT)

    def coords(self) -> dict[int, Any]:
        return cmp.coords_of(self.fingerprints[0]) if self.fingerprints else {}

    def outcome(self) -> ReplayOutcome:
        return ReplayOutcome(self.assignment, self.evidence, cmp.first_divergence(self.diffs),
                             cmp.signature(self.fingerprints, self.coords()))

    def to_dict(self) -> dict[str, Any]:
        div = cmp.first_divergence(self.diffs)
        return {
            "index": self.index,
            "repeat": self.repeat,
            "assignment": list(self.assignment),
            "evidence": self.evidence.value,
            "divergence": None if div is None else {
                "step": div.step, "kind": div.kind.value, "devices": list(div.devices), "leaves": list(div.leaves)},
            "signature": self.outcome().signature,
            "steps": [d.to_dict() for d in self.diffs],
            "seconds": round(self.seconds, 4),
        }


@dataclasses.dataclass
class RangeReport:
    """Everything a range replay found (``to_dict`` is the JSON report)."""

    run_dir: str
    start: int
    stop: int
    checkpoint: int
    checkpoints: list[int]
    device_spec: str
    devices: list[int]
    quarantine: list[int]
    run_devices: list[int]
    mesh: dict[str, Any]
    env_differences: list[str]
    allow_env_drift: bool
    tolerance: Optional[float]
    replays: list[ReplayRun]
    decision: Decision
    disagreement: Optional[dict[str, Any]]
    differing_elements: Optional[dict[str, int]]
    relogged_conflicts: list[int]
    skip_windows: list[tuple[int, int]]
    phase_changes: list[dict[str, Any]]
    restore_seconds: float
    replay_seconds: float
    scan_suspects: list[int] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        return self.decision.verdict

    @property
    def exit_code(self) -> int:
        return int(self.decision.verdict.exit_code)

    def _site_leaves(self) -> tuple[str, ...]:
        """The localized leaves of the first divergence (a local-gradient site's layer comes from them)."""
        for r in self.replays:
            for diff in r.diffs:
                if diff.step == self.decision.step and diff.localization is not None:
                    return diff.localization.leaves
        return ()

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "kind": "range",
            "run": self.run_dir,
            "steps": {"start": self.start, "stop": self.stop},
            "checkpoint": self.checkpoint,
            "checkpoints": self.checkpoints,
            "replayed_steps": {"start": self.checkpoint, "stop": self.stop},
            "device_spec": self.device_spec,
            "devices": self.devices,
            "quarantine": self.quarantine,
            "scan_suspects": self.scan_suspects,
            "run_devices": self.run_devices,
            "mesh": self.mesh,
            "environment": {"differences": self.env_differences, "drift": bool(self.env_differences),
                            "allow_env_drift": self.allow_env_drift},
            "tolerance": self.tolerance,
            "evidence": d.evidence.value,
            "replays": [r.to_dict() for r in self.replays],
            "replay_disagreement": self.disagreement,
            "verdict": d.verdict.value,
            "exit_code": self.exit_code,
            "cause": d.cause.value,
            "explanation": d.explanation,
            "first_divergent_step": d.step,
            "convicted_devices": list(d.devices),
            "first_divergent_site": describe_site(d.site, self._site_leaves()),
            "reached_devices": list(d.reached),
            "leaves": list(d.leaves),
            "differing_elements": self.differing_elements,
            "independent_replays": d.independent_replays,
            "relogged_conflicts": self.relogged_conflicts,
            "skip_windows": [list(w) for w in self.skip_windows],
            "phase_changes": self.phase_changes,
            "timing": {"restore_s": round(self.restore_seconds, 4), "replay_s": round(self.replay_seconds, 4),
                       "steps_replayed": sum(len(r.fingerprints) for r in self.replays)},
        }


def count_differing(a: Any, b: Any) -> dict[str, int]:
    """Per leaf path, how many elements of two pytrees of arrays differ bit for bit (only leaves that do)."""
    import jax

    out = {}
    fa = jax.tree_util.tree_flatten_with_path(a)[0]
    fb = jax.tree_util.tree_leaves(b)
    for (path, x), y in zip(fa, fb):
        x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        if x.dtype.kind == "f":
            x, y = x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}")
        n = int(np.count_nonzero(x != y))
        if n:
            out[jax.tree_util.keystr(path)] = n
    return out


def replay_range(
    session: Session,
    start: int,
    stop: int,
    *,
    device_spec: str = "good",
    repeats: int = 1,
    tolerance: Optional[float] = None,
    allow_env_drift: bool = False,
    log: Optional[Mapping[int, StepFingerprints]] = None,
    progress: Optional[Callable[[int], Callable[[int], None]]] = None,
    replays: int = 2,
    full_comparison: bool = True,
) -> RangeReport:
    """Replays steps ``[start, stop)`` of the run on the devices of ``device_spec`` and judges them.

    Args:
      session: the opened run.
      start, stop: the half-open step range (must be logged).
      device_spec: see ``replay.run.devices``; must leave at least the run's mesh size.
      repeats: how many times each independent assignment replays (flaky hardware is often
        inconsistent), >= 1.
      tolerance: relative tolerance: compare loss and norm only (weaker evidence).
      allow_env_drift: replay bit-exactly even when the environment differs (listed).
      log: the fingerprints to judge (default: the run's fingerprints.jsonl; drills pass theirs).
      progress: ``total -> advance`` factory for a progress bar.
      replays: independent device assignments, >= 1 (a conviction needs 2).
      full_comparison: when a checkpoint follows the first divergent step, restore it and count
        the parameters that differ from the replay's (``differing_elements``).

    Raises:
      replay.run.runlog.StepRangeError, MissingCheckpointError: the range is not logged / has no
        checkpoint at or before it.
      replay.run.devices.DeviceSpecError: a bad spec or too few devices.
      EnvDriftError: environment drift without ``allow_env_drift`` or ``tolerance``.
      RunDirError: the run logged another fingerprint formula (``versions.fingerprint``).
      ValueError: ``repeats`` or ``replays`` < 1.
    """
    from replay.run.fingerprint import version_mismatch

    if repeats < 1 or replays < 1:
        raise ValueError(f"repeats and replays must be >= 1, got {repeats} and {replays}")
    run, setup = session.run, session.setup
    problem = version_mismatch(run.env)  # other formula: every leaf would differ, a false conviction
    if problem:
        raise RunDirError(f"{os.path.join(run.run_dir, 'env.json')}: {problem}")
    log = run.fingerprints if log is None else log
    run.check_range(start, stop)
    ckpt = run.checkpoint_for(start)
    bad = sorted(s for s in getattr(run, "malformed", {}) if ckpt <= s < start and s not in log)
    if bad:
        raise RunDirError(f"step {bad[0]} (between checkpoint {ckpt} and {start}, replayed and checked too): "
                          f"its logged fingerprints are malformed ({run.malformed[bad[0]]})")
    missing = missing_steps(log, ckpt, start)
    if missing:
        raise RunDirError(f"steps {missing[:10]} between checkpoint {ckpt} and {start} have no logged fingerprints")
    chosen = dv.select_devices(device_spec, session.device_infos(), run.held_suspect, minimum=setup.mesh_size)
    ids = [d.id for d in chosen]
    assignments = dv.independent_assignments(ids, setup.mesh_size, replays)
    diffs_env = environment_differences(run, session.mesh(assignments[0]))
    if diffs_env and not allow_env_drift and tolerance is None:
        raise EnvDriftError(diffs_env)
    total = (stop - ckpt) * len(assignments) * repeats
    advance = progress(total) if progress is not None else (lambda n=1: None)
    runs: list[ReplayRun] = []
    t0 = time.perf_counter()
    restore0 = session.restore_seconds
    for r in range(repeats):
        for a in assignments:
            t1 = time.perf_counter()
            fps, diffs, _ = session.run_steps(a, ckpt, stop, log=log, tolerance=tolerance,
                                              checkpoints=run.checkpoints, advance=advance)
            runs.append(ReplayRun(len(runs), r, tuple(a), fps, diffs, time.perf_counter() - t1))
    decision = decide([x.outcome() for x in runs], setup.mesh_size,
                      suspected=sorted(set(getattr(run, "held_suspect", ())) & set(setup.run_device_ids)))
    disagreement = None
    for other in runs[1:]:
        disagreement = cmp.disagreement(runs[0].fingerprints, other.fingerprints, runs[0].coords(), other.coords())
        if disagreement:
            disagreement.update(replay_a=runs[0].index, replay_b=other.index)
            break
    differing = None
    if full_comparison and decision.step is not None and (decision.step + 1) in run.checkpoints:
        s = decision.step
        seg = max(c for c in run.checkpoints if c <= s)
        try:
            logged_state = session.restore(s + 1, assignments[0])
        except RunDirError:  # a damaged checkpoint after the step: no full comparison (null), still a verdict
            logged_state = None
        if logged_state is not None:
            _, _, kept = session.run_steps(assignments[0], seg, s + 1, keep_state_at=s)
            differing = count_differing(kept[s], logged_state)
    replay_s = time.perf_counter() - t0 - (session.restore_seconds - restore0)
    return RangeReport(
        run_dir=run.run_dir, start=start, stop=stop, checkpoint=ckpt,
        checkpoints=[c for c in run.checkpoints if ckpt <= c < stop],
        device_spec=device_spec, devices=ids, quarantine=sorted(run.quarantine),
        run_devices=list(setup.run_device_ids),
        mesh={"axis_names": list(setup.axis_names), "shape": list(setup.shape)},
        env_differences=diffs_env, allow_env_drift=allow_env_drift, tolerance=tolerance,
        replays=runs, decision=decision, disagreement=disagreement, differing_elements=differing,
        relogged_conflicts=list(run.relogged_conflicts), skip_windows=skip_windows(run),
        phase_changes=phase_changes(run), restore_seconds=session.restore_seconds - restore0,
        replay_seconds=replay_s, scan_suspects=sorted(getattr(run, "suspects", ())),
    )
