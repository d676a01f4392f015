"""The replay engine: an opened run (:class:`Session`) and range replay (:func:`replay_range`).

Canary, inspect and drill build on the session in ``replay.verify.canary``, ``replay.screen.forensics`` and
``replay.drill``. The command line (``replay.cli``) is a thin layer over these library
functions; tests call them directly.

Range replay (issue 5, points 2 to 4)::

    run dir --load_run--> RunLog (config, env, events, fingerprints, checkpoints, quarantine)
    run config's trainer: --make_setup--> RunSetup (trainer, mesh, loader: the run's factory)
    device spec --select_devices--> good devices --independent_assignments--> placements M_1, M_2
    c .. stop-1 --plan.segments--> checkpoint segments; --plan.rounds--> the onset's first
    for each round:
        for each lane of placements (threads; in each process, the placements holding its devices):
          for each repeat, placement M_i of the lane, segment [s, e) of the round:
            state = checkpoint s                   restored read-only (Orbax) onto M_i
            for step in s .. e-1:                  steps before the range are checked too
                batch = loader batch of step       rebuilt on M_i (batch_at, or the prefetching
                                                   iterate for long stretches), skip windows followed
                state, fp = trainer.train_step(state, batch, step)
                diff = compare_step(log[step], fp) bit-exact / per-shard / tolerance
                a divergence ends the segment (the rest of it is contaminated)
        gather the round's fingerprints across processes; decide(outcomes) -> verdict
        a conviction after a targeted first round ends the replay (unless exhaustive)

Honesty about "independent devices": on one host of 8 CPU devices the devices share the same
physical CPU, so two device sets are independent only as XLA devices. What the engine
guarantees is that the two replays place *different devices on every mesh position* (disjoint
sets when there are enough good devices, a rotation of them otherwise), so every device shard
of the original run is recomputed by two devices neither of which computed it in the other
replay. On an accelerator pod these are different chips.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from replay.verify import compare as cmp
from replay.verify import plan
from replay.runtime import devices as dv
from replay.run.protocol import FaultSpec, StepFingerprints
from replay.run.runlog import RunDirError, RunLog
from replay.run.codes import Verdict
from replay.run.setup import RunSetup
from replay.verify.localize import describe_site
from replay.verify.verdict import (Cause, Decision, Evidence, ReplayOutcome, decide, limit_to_consistent_log,
                                   limit_to_poisoned_state)

PREFETCH_MIN_STEPS = 8  # stretches this long read batches through the loader's prefetch


class CheckpointCorruptError(RunDirError):
    """A checkpoint of the run exists but cannot be restored (truncated or damaged Orbax files)."""


class EnvDriftError(RuntimeError):
    """The environment differs from the run's and a bit-exact comparison was asked for."""

    def __init__(self, differences: Sequence[str]):
        self.differences = list(differences)
        hint = ""
        if any(d.startswith("backend.collectives") for d in self.differences):
            hint = ("\nthe collectives sum an all-reduce in their own order, so they decide the bits: replay a run that "
                    "reduced in-process as one process without jax.distributed, and a run that reduced with gloo "
                    "under jax.distributed (one process or several)")
        super().__init__(
            "the environment differs from the run's env.json:\n  " + "\n  ".join(self.differences) + hint
            + "\nrefusing a bit-exact claim; pass --allow-env-drift to replay anyway (the report lists the "
            "differences), or --tolerance RTOL for a weaker comparison"
        )


# ----------------------------------------------------------------------------- run set-up


def default_setup(run: RunLog) -> RunSetup:
    """The run's :class:`RunSetup`, from the trainer factory its run config names (``trainer:``; the
    reference trainer's when it names none): ``replay.run.setup.make_setup``.

    Raises:
      replay.run.setup.TrainerFactoryError: the factory cannot be imported or returns the wrong type.
      RunDirError: the factory cannot rebuild the run (invalid config, missing dataset, no mesh recorded).
    """
    from replay.run.setup import make_setup

    return make_setup(run)


# ----------------------------------------------------------------------------- session


class Session:
    """A run opened for replay: caches meshes, loaders, compiled steps and restored checkpoints.

    The devices are every device of the replay job (``jax.devices()``: with several processes, those
    of every process); a process computes only on placements that hold some of its own devices
    (:meth:`participates`). The caches are safe to use from several threads (placements on disjoint
    devices replay concurrently: :func:`replay_range`).

    Args:
      run: the loaded run directory.
      setup: how to rebuild trainer and loader (default: :func:`default_setup`, the run's trainer factory).
    """

    def __init__(self, run: RunLog, setup: Optional[RunSetup] = None):
        import threading

        import jax

        self.run = run
        self.setup = setup or default_setup(run)
        self.jax_devices = {d.id: d for d in jax.devices()}
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self._meshes: dict[tuple[int, ...], Any] = {}
        self._loaders: dict[Any, Any] = {}
        self._states: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._batches: dict[tuple[int, tuple[int, ...]], Any] = {}
        self._lock = threading.RLock()
        self._restore_lock = threading.Lock()  # one Orbax restore at a time
        self.restore_seconds = 0.0
        self.unverified: set[int] = set()  # checkpoints restored without a state record to check them against

    def device_infos(self) -> list[dv.DeviceInfo]:
        """The replay job's devices as an operator finds them (host, process, local index, global id)."""
        from replay.runtime import distributed

        hosts = distributed.process_hosts()
        by_proc: dict[int, list[int]] = {}
        for i in sorted(self.jax_devices):
            by_proc.setdefault(self.jax_devices[i].process_index, []).append(i)
        out = []
        for i, d in self.jax_devices.items():
            p = int(d.process_index)
            out.append(dv.DeviceInfo(i, p, d.device_kind, hosts[p] if p < len(hosts) else "", by_proc[p].index(i)))
        return out

    def device_table(self) -> dict[int, dv.DeviceInfo]:
        """``device_infos`` by id: names the replay job's devices (canary, placements)."""
        return {d.id: d for d in self.device_infos()}

    def chosen_devices(self, device_spec: str, minimum: int) -> list[dv.DeviceInfo]:
        """The replay job's devices that ``device_spec`` names (``replay.runtime.devices``; ``good`` and
        ``suspect`` against the devices the run holds suspect), at least ``minimum`` of them.

        Raises:
          replay.runtime.devices.DeviceSpecError: a bad spec or too few devices.
        """
        return dv.select_devices(device_spec, self.device_infos(), self.run.held_suspect, minimum=minimum)

    def placements(self, device_spec: str, count: Optional[int] = None
                   ) -> tuple[list[int], list[tuple[int, ...]], tuple[int, ...]]:
        """``(ids, assignments, home)``: the devices ``device_spec`` names (at least the run's mesh size),
        ``count`` independent placements of the run's mesh on them (``replay.runtime.devices
        .independent_assignments``; None: as many disjoint ones as fit), and the placement this process
        builds host-side state on (the first when it takes part in it, else :meth:`home_assignment`).

        Raises:
          replay.runtime.devices.DeviceSpecError: a bad spec or too few devices.
        """
        size = self.setup.mesh_size
        ids = [d.id for d in self.chosen_devices(device_spec, size)]
        count = max(1, len(ids) // size) if count is None else count
        assignments = [tuple(a) for a in dv.independent_assignments(ids, size, count)]
        home = assignments[0] if self.participates(assignments[0]) else self.home_assignment()
        return ids, assignments, home

    def my_lanes(self, assignments: Sequence[Sequence[int]]) -> list[list[int]]:
        """This process's lanes (``replay.verify.plan.lanes``): the indices of the placements that hold one
        of its devices, grouped so that no two lanes share a device (lanes run at the same time)."""
        process_of = {i: d.process_index for i, d in self.jax_devices.items()}
        mine = [[i for i in lane if self.participates(assignments[i])] for lane in plan.lanes(assignments, process_of)]
        return [lane for lane in mine if lane]

    def run_device_table(self) -> dict[int, dv.DeviceInfo]:
        """The run's devices as its env.json recorded them: names a convicted device of the original run."""
        return dv.device_table(self.run.env)

    def is_local(self, device: int) -> bool:
        """Whether ``device`` is one of this process's devices."""
        return self.jax_devices[int(device)].process_index == self.process_index

    def participates(self, assignment: Sequence[int]) -> bool:
        """Whether this process holds a device of ``assignment`` (and so runs the placement's programs)."""
        return any(self.is_local(d) for d in assignment)

    def mesh(self, assignment: Sequence[int]):
        """The run's mesh shape with ``assignment`` (device ids, row-major) placed on it."""
        from jax.sharding import Mesh

        key = tuple(assignment)
        with self._lock:
            if key not in self._meshes:
                devs = np.asarray([self.jax_devices[i] for i in key], dtype=object).reshape(self.setup.shape)
                self._meshes[key] = Mesh(devs, self.setup.axis_names)
            return self._meshes[key]

    def local_mesh(self):
        """A mesh of the run's axes on one device of this process (``(1, 1, ...)``): for host-side work
        every process can do alone (lookups, canary weights)."""
        import jax
        from jax.sharding import Mesh

        with self._lock:
            if "local" not in self._meshes:
                first = jax.local_devices()[0]
                self._meshes["local"] = Mesh(np.asarray([first], dtype=object).reshape(
                    (1,) * len(self.setup.axis_names)), self.setup.axis_names)
            return self._meshes["local"]

    def loader(self, assignment: Sequence[int]):
        key = tuple(assignment)
        with self._lock:
            if key not in self._loaders:
                self._loaders[key] = self.setup.make_loader(self.mesh(key))
            return self._loaders[key]

    def lookup_loader(self):
        """A loader for lookups only (``rows_at``, ``read_rows``, whole host batches: ``replay inspect``,
        the canary), on a one-device mesh of this process (:meth:`local_mesh`), so it works on any
        machine whatever its device count, in any process of a replay job."""
        with self._lock:
            if "lookup" not in self._loaders:
                self._loaders["lookup"] = self.setup.make_loader(self.local_mesh())
            return self._loaders["lookup"]

    def batch(self, step: int, assignment: Sequence[int]):
        key = (step, tuple(assignment))
        with self._lock:
            hit = self._batches.get(key)
        if hit is None:
            hit = self.loader(assignment).batch_at(step)
            with self._lock:
                if len(self._batches) > 256:
                    self._batches.clear()
                self._batches[key] = hit
        return hit

    def run_coords(self) -> dict[int, Any]:
        """``device id -> mesh position`` of the run, from env.json (for logs without ``device_coords``)."""
        raw = self.run.mesh.get("device_coords") or {}
        return {int(d): cmp.position_key(c) for d, c in raw.items()}

    def home_assignment(self) -> tuple[int, ...]:
        """The run's own device order when this job has those devices, else the first devices."""
        ids = tuple(self.setup.run_device_ids)
        if ids and all(i in self.jax_devices for i in ids):
            return ids
        avail = sorted(self.jax_devices)
        if len(avail) < self.setup.mesh_size:
            raise dv.DeviceSpecError(
                f"this replay has {len(avail)} device(s), the run's mesh needs {self.setup.mesh_size}")
        return tuple(avail[: self.setup.mesh_size])

    def numpy_batch(self, step: int, assignment: Sequence[int] = ()) -> dict[str, np.ndarray]:
        """The global batch of ``step`` as host NumPy arrays (int32 ``[B, L]``), read whole by this
        process (:meth:`lookup_loader`; a batch is a pure function of the step, whatever the mesh)."""
        return {k: np.asarray(v, np.int32) for k, v in self.lookup_loader().host_batch(step).items()}

    def canary_batch(self, step: Optional[int] = None, rows: Optional[int] = None,
                     seq_len: Optional[int] = None) -> dict[str, np.ndarray]:
        """The canary batch: the first ``rows`` rows of step ``step``'s batch, each cut to its first
        ``seq_len`` slots (defaults: the set-up's ``canary_*``; the whole batch and whole rows)."""
        s = self.setup
        step = s.canary_step if step is None else step
        rows = min(s.canary_rows or s.global_batch, s.global_batch) if rows is None else rows
        seq_len = s.canary_seq_len if seq_len is None else seq_len
        return {k: v[:rows, :seq_len] for k, v in self.numpy_batch(step).items()}

    def init_state(self, assignment: Any, seed: int):
        """The trainer's initialization from ``seed`` on ``assignment``'s mesh, or on :meth:`local_mesh`
        when ``assignment`` is ``"local"`` (cached)."""
        key = (-1 - seed, assignment if assignment == "local" else tuple(assignment))
        with self._lock:
            hit = self._states.get(key)
        if hit is None:
            mesh = self.local_mesh() if assignment == "local" else self.mesh(assignment)
            hit = self.setup.trainer.init_state(mesh, seed)
            with self._lock:
                self._states[key] = hit
        return hit

    def restore(self, checkpoint: int, assignment: Any, *, allow_poisoned: bool = False):
        """The train state of ``checkpoint`` on ``assignment``'s mesh (``"local"``: :meth:`local_mesh`),
        restored once, checked against the checkpoint's state record (``replay.run.statefp``), then cached
        (a state that passed with ``allow_poisoned`` false also serves a later call with it true).

        The reference trainer's step does not donate its input, so a cached state stays valid. A
        checkpoint without a record (a run from before records) is used with a note, once, that it
        cannot be verified (:attr:`unverified`).

        Raises:
          replay.run.statefp.DamagedCheckpointError: the restored state does not match its record.
          replay.run.statefp.PoisonedCheckpointError: its record says the replicas disagreed at the save
            (``allow_poisoned``: restored anyway, for the comparisons that judge such a state).
        """
        key = (checkpoint, assignment if assignment == "local" else tuple(assignment), allow_poisoned)
        with self._lock:
            hit = self._states.get(key)
        if hit is not None:
            return hit
        mesh = self.local_mesh() if assignment == "local" else self.mesh(assignment)
        with self._restore_lock:
            t0 = time.perf_counter()
            try:
                state, loader_state = self.setup.trainer.restore(self.run.run_dir, checkpoint, mesh)
            except FileNotFoundError as e:
                raise RunDirError(str(e)) from None
            except Exception as e:  # noqa: BLE001 - Orbax/TensorStore report a damaged checkpoint many ways
                from replay.runtime.quiet import quiet_aborted_reads

                quiet_aborted_reads()
                first = (str(e).strip().splitlines() or [""])[0][:400]
                older = [c for c in self.run.checkpoints if c < checkpoint]
                raise CheckpointCorruptError(
                    f"checkpoint {checkpoint} of {self.run.run_dir} cannot be restored: it is damaged or "
                    f"incomplete, or does not fit the model of run_config.yaml ({type(e).__name__}: {first})"
                    + (f"; replay from an older checkpoint ({older}) with --steps C:B" if older else "")
                ) from None
            self._verify(checkpoint, state, loader_state, allow_poisoned)
            self.restore_seconds += time.perf_counter() - t0
        with self._lock:
            if len(self._states) > 16:
                self._states.clear()
            self._states[key] = state
            if not allow_poisoned:  # it passed every check: good for a caller that allows poisoned ones too
                self._states[key[:2] + (True,)] = state
        return state

    def restore_files(self, checkpoint: int, assignment: Any) -> Optional[Any]:
        """The train state checkpoint ``checkpoint``'s files hold, on ``assignment``'s mesh, *not* checked
        against its state record (to tell a damaged record from damaged files), or None when Orbax cannot
        restore them. Not cached."""
        mesh = self.local_mesh() if assignment == "local" else self.mesh(assignment)
        with self._restore_lock:
            try:
                return self.setup.trainer.restore(self.run.run_dir, checkpoint, mesh)[0]
            except Exception:  # noqa: BLE001 - Orbax/TensorStore report damaged files many ways
                from replay.runtime.quiet import quiet_aborted_reads

                quiet_aborted_reads()
                return None

    def _verify(self, checkpoint: int, state: Any, loader_state: Any, allow_poisoned: bool) -> None:
        """The restored ``state`` against its state record; a checkpoint with none is noted once."""
        from replay.run import statefp

        check = statefp.verify_restored(self.run.run_dir, checkpoint, state, loader_state, allow_poisoned=allow_poisoned)
        if check.status == "unverified" and checkpoint not in self.unverified:
            self.unverified.add(checkpoint)
            import sys

            print(f"note: {check.note}", file=sys.stderr, flush=True)

    def run_dir_writer(self, path: str, assignment: Sequence[int]):
        """A ``replay.run.writer.RunDir`` for ``path`` as this process writes it, with ``assignment``'s
        devices split among the processes (drills write runs through it)."""
        from replay.run.writer import RunDir

        local = [d for d in assignment if self.is_local(d)]
        return RunDir(path, process_index=self.process_index, process_count=self.process_count,
                      local_devices=local if self.process_count > 1 else None)

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
        fps, diffs, kept = [], [], {}
        bounds = [checkpoint, *sorted(c for c in checkpoints if checkpoint < c < stop), stop]
        for a, b in zip(bounds, bounds[1:]):
            f, d, k = self.replay_segment(assignment, a, b, log=log, tolerance=tolerance, fault=fault,
                                          advance=advance, keep_state_at=keep_state_at)
            fps += f
            diffs += d
            kept.update(k)
            advance(b - a - len(f))
        return fps, diffs, kept

    def replay_segment(self, assignment: Sequence[int], checkpoint: int, stop: int, *,
                       log: Optional[Mapping[int, StepFingerprints]] = None, tolerance: Optional[float] = None,
                       fault: Any = None, advance: Callable[[int], None] = lambda n=1: None,
                       keep_state_at: Optional[int] = None, start_state: Any = None,
                       ) -> tuple[list[StepFingerprints], list[cmp.StepDiff], dict[int, Any]]:
        """Replays the checkpoint segment ``checkpoint .. stop-1`` on ``assignment``: restores checkpoint
        ``checkpoint`` (or starts from ``start_state``, a state of that step on ``assignment``'s mesh)
        and steps until ``stop``, or until the first step that differs from ``log`` (the rest of the
        segment is contaminated by the wrong state)."""
        trainer = self.setup.trainer
        state = self.restore(checkpoint, assignment) if start_state is None else start_state
        dropped = self.run.dropped_updates()
        fps, diffs, kept = [], [], {}
        batches = self.batches(checkpoint, stop, assignment)
        try:
            for step, batch in batches:
                before = state if step in dropped else None
                state, fp = trainer.train_step(state, batch, step, fault)
                if step in dropped:  # the run dropped this step's update (non_finite: skip_step): so does replay
                    state = before
                fps.append(fp)
                advance(1)
                if keep_state_at is not None and step == keep_state_at:
                    kept[step] = state
                if log is None:
                    continue
                diff = self.compare(log[step], fp, tolerance)
                diffs.append(diff)
                if not diff.ok:
                    break
        finally:
            batches.close()
        return fps, diffs, kept

    def compare(self, logged: StepFingerprints, fp: StepFingerprints, tolerance: Optional[float]) -> cmp.StepDiff:
        """The logged step against its replay, devices paired by mesh position (pure)."""
        pairing = cmp.pair_devices(cmp.coords_of(logged) or self.run_coords(), cmp.coords_of(fp))
        return cmp.compare_step(logged, fp, pairing, tolerance)

    def batches(self, start: int, stop: int, assignment: Sequence[int]) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` for ``start .. stop-1``: through the loader's prefetching ``iterate`` for
        long stretches (data overlaps compute, as in training), one cached ``batch_at`` each otherwise."""
        if stop - start >= PREFETCH_MIN_STEPS:
            it = self.loader(assignment).iterate(start)  # one placement's loader: one thread uses it
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

    _batches_from = batches  # the former name


# ----------------------------------------------------------------------------- environment


def environment_differences(run: RunLog, mesh: Any) -> list[str]:
    """Differences that decide bits between the run's env.json and this process (replay.run.env).

    The mesh's device ids are left out (replaying on other devices is the point; the mesh
    shape and axis names still count), and informational notes are dropped.
    """
    from replay.run import env as envmod

    return envmod.replay_differences(run.env, envmod.record_environment(mesh))


def check_mesh_shape(run: RunLog, setup: RunSetup) -> None:
    """Refuses a replay whose set-up has another mesh shape than the run recorded (env.json), before any
    work and whatever ``--allow-env-drift`` says: per-device fingerprints pair by mesh position, and
    another shape gives each device other rows and the gradient's reduction another tree (a psum over 2
    data replicas or over 4), so its sums round differently on every device; no bit-for-bit comparison
    exists, and a comparison that cannot pair devices must not judge them.

    Raises:
      replay.verify.compare.PairingError: the shapes or axis names differ (both named).
    """
    rec = run.mesh or {}
    if not (rec.get("shape") and rec.get("axis_names")):
        return  # no mesh recorded: mesh_record reports that
    want = dict(zip(rec.get("axis_names") or (), (int(n) for n in rec["shape"])))
    got = dict(zip(setup.axis_names, (int(n) for n in setup.shape)))
    if list(want.items()) != list(got.items()):
        raise cmp.PairingError(
            f"the run's mesh is {want} (env.json) and this replay's set-up builds {got}: devices pair by mesh "
            "position, and another shape gives every device other rows and the gradient's sum another reduction "
            "order, so no bit-for-bit comparison exists; replay on the run's mesh shape (its trainer factory "
            "must return RunSetup(shape=...) from replay.run.setup.mesh_record)")


def cpu_threads_hint(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> Optional[str]:
    """What to tell an operator when every device's bits differ on CPU and the run's processes had
    another XLA:CPU thread count than this one (``replay.run.env.cpu_threads``); None otherwise
    (another platform, the same count, or a record from before the field).

    Args:
      recorded, current: env.json records (``replay.run.env.record_environment``).
    """
    rb, cb = recorded.get("backend") or {}, current.get("backend") or {}
    if cb.get("platform") != "cpu" or rb.get("platform") != "cpu":
        return None
    rt, ct = rb.get("cpu_threads"), cb.get("cpu_threads")
    if rt is None or ct is None or int(rt) == int(ct):
        return None
    per = rb.get("local_device_count")
    procs = rb.get("process_count") or 1
    how = (f"XLA_FLAGS=--xla_force_host_platform_device_count={per} in each of {procs} process(es), "
           if per else "")
    return (f"on CPU the run's processes ran XLA with {rt} intra-op threads and this replay with {ct} (the "
            "larger of a process's CPUs and its local devices), and XLA:CPU splits the sum of a long matrix "
            "product over its threads, so every device's bits can differ without a fault: replay with the "
            f"run's threads ({how}on CPUs as many as the run's) to compare bit for bit")


# ----------------------------------------------------------------------------- range replay


@dataclasses.dataclass
class ReplayRun:
    """One replay of a range on one device assignment (its replayed segments, in step order)."""

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
            "steps_replayed": len(self.fingerprints),
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
    segments: list[plan.Segment] = dataclasses.field(default_factory=list)
    replayed_in_round: dict[int, int] = dataclasses.field(default_factory=dict)  # segment index -> round
    onset: Optional[plan.Onset] = None
    exhaustive: bool = False
    concurrent: bool = True
    placements: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    convicted: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def verdict(self) -> Verdict:
        return self.decision.verdict

    @property
    def exit_code(self) -> int:
        from replay.run.codes import ExitCode

        if self.decision.cause is Cause.LINK_FAULT:
            return int(ExitCode.LINK_CONVICTED)
        if self.decision.cause is Cause.STATE_POISONED:
            return int(ExitCode.POISONED_CHECKPOINT)
        return int(self.decision.verdict.exit_code)

    @property
    def unreplayed(self) -> list[plan.Segment]:
        """Segments the replay left out (it stopped at a conviction in an earlier round)."""
        return [s for i, s in enumerate(self.segments) if i not in self.replayed_in_round]

    def steps_per_placement(self) -> dict[int, int]:
        """Steps replayed on each placement (summed over repeats), by placement index."""
        out: dict[int, int] = {}
        for r in self.replays:
            out[self.replay_placement(r)] = out.get(self.replay_placement(r), 0) + len(r.fingerprints)
        return out

    def replay_placement(self, r: ReplayRun) -> int:
        for p in self.placements:
            if tuple(p["devices"]) == r.assignment:
                return int(p["index"])
        return r.index
    def _site_leaves(self) -> tuple[str, ...]:
        """The localized leaves of the first divergence (a local-gradient site's layer comes from them)."""
        for r in self.replays:
            for diff in r.diffs:
                if diff.step == self.decision.step and diff.localization is not None:
                    return diff.localization.leaves
        return ()

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        unreplayed = self.unreplayed
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
            "placements": self.placements,
            "replays": [r.to_dict() for r in self.replays],
            "replay_disagreement": self.disagreement,
            "verdict": d.verdict.value,
            "exit_code": self.exit_code,
            "cause": d.cause.value,
            "explanation": d.explanation,
            "first_divergent_step": d.step,
            "convicted_devices": list(d.devices),
            "convicted_links": [list(x) for x in getattr(d, "links", ())],
            "convicted": self.convicted,
            "first_divergent_site": None if d.site is None else {
                **describe_site(d.site, self._site_leaves()),
                # which of the three it is (replay.verify.localize): a link, a device that sent wrong, a gradient
                "finding": "link" if d.links else ("local_gradient" if d.site == "local_gradient" else "sent")},
            "reached_devices": list(d.reached),
            "leaves": list(d.leaves),
            "differing_elements": self.differing_elements,
            "independent_replays": d.independent_replays,
            "relogged_conflicts": self.relogged_conflicts,
            "skip_windows": [list(w) for w in self.skip_windows],
            "phase_changes": self.phase_changes,
            "segments": [{"start": s.start, "stop": s.stop, "round": self.replayed_in_round.get(i),
                          "replayed": i in self.replayed_in_round} for i, s in enumerate(self.segments)],
            "targeted": None if self.onset is None else self.onset.to_dict(),
            "exhaustive": self.exhaustive,
            "stopped_early": bool(unreplayed),
            "unreplayed_segments": [[s.start, s.stop] for s in unreplayed],
            "concurrent": self.concurrent,
            "timing": {"restore_s": round(self.restore_seconds, 4), "replay_s": round(self.replay_seconds, 4),
                       "wall_s": round(self.wall_seconds, 4),
                       "steps_replayed": sum(len(r.fingerprints) for r in self.replays),
                       "steps_replayed_per_placement": {str(k): v for k, v in self.steps_per_placement().items()}},
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


def scan_onset(run: RunLog, start: int, stop: int) -> Optional[plan.Onset]:
    """The onset ``replay scan`` left in the run's suspects.json (its ``onset``: the top device suspect's
    first step and the range it could lie in), when it falls in ``[start, stop)``; else None."""
    import json

    path = os.path.join(run.run_dir, "suspects.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = (json.load(f) or {}).get("onset")
        if not rec:
            return None
        lo, hi = (int(x) for x in rec.get("range") or (rec["step"], rec["step"]))
        onset = plan.Onset(int(rec["step"]), lo, hi, f"suspects.json: {rec.get('check', 'scan')} of "
                           f"device(s) {rec.get('devices', [])}", tuple(int(d) for d in rec.get("devices", [])))
    except (ValueError, KeyError, TypeError, OSError):
        return None  # read_suspects reports a malformed suspects.json; a missing onset only means no targeting
    return onset if onset.hi >= start and onset.lo < stop else None


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
    onset: Any = "auto",
    exhaustive: bool = False,
    concurrent: bool = True,
) -> RangeReport:
    """Replays steps ``[start, stop)`` of the run on the devices of ``device_spec`` and judges them.

    The range is cut into checkpoint segments (``replay.verify.plan``), each replayed from its own
    checkpoint on every placement (and repeat); placements on disjoint devices run at the same time
    (threads in one process; in a multi-process replay each process runs the placements that hold its
    devices, and the results are gathered after each round). With an onset (``onset``), the segments
    around it replay first and a conviction there ends the replay (``exhaustive``: replay everything).

    Args:
      session: the opened run.
      start, stop: the half-open step range (must be logged).
      device_spec: see ``replay.runtime.devices``; must leave at least the run's mesh size.
      repeats: how many times each independent assignment replays (flaky hardware is often
        inconsistent), >= 1.
      tolerance: relative tolerance: compare loss and norm only (weaker evidence).
      allow_env_drift: replay bit-exactly even when the environment differs (listed).
      log: the fingerprints to judge (default: the run's fingerprints.jsonl; drills pass theirs).
      progress: ``total -> advance`` factory for a progress bar (total: this process's steps).
      replays: independent device assignments, >= 1 (a conviction needs 2).
      full_comparison: when a checkpoint follows the first divergent step, restore it and count
        the parameters that differ from the replay's (``differing_elements``).
      onset: a ``replay.verify.plan.Onset`` to start from; ``"auto"``: ``replay scan``'s onset from the
        run's suspects.json (:func:`scan_onset`), if any; None: no targeting.
      exhaustive: replay every segment even after a conviction.
      concurrent: run independent placements at the same time (False: one after the other).

    Raises:
      replay.run.runlog.StepRangeError, MissingCheckpointError: the range is not logged / has no
        checkpoint at or before it.
      replay.runtime.devices.DeviceSpecError: a bad spec or too few devices.
      EnvDriftError: environment drift without ``allow_env_drift`` or ``tolerance``.
      RunDirError: the run logged another fingerprint formula (``versions.fingerprint``).
      replay.verify.compare.PairingError: the set-up's mesh shape is not the run's (:func:`check_mesh_shape`).
      ValueError: ``repeats`` or ``replays`` < 1.
    """
    from replay.run import env as envmod

    if repeats < 1 or replays < 1:
        raise ValueError(f"repeats and replays must be >= 1, got {repeats} and {replays}")
    run, setup = session.run, session.setup
    log = run.fingerprints if log is None else log
    check_mesh_shape(run, setup)
    ckpt = run.replay_checkpoint(start, stop, log)
    ids, assignments, home = session.placements(device_spec, replays)
    mesh = session.mesh(home)
    if onset == "auto":
        onset = scan_onset(run, ckpt, stop)
    current_env = envmod.record_environment(mesh)
    diffs_env = envmod.replay_differences(run.env, current_env)  # as environment_differences
    if diffs_env and not allow_env_drift and tolerance is None:
        raise EnvDriftError(diffs_env)
    segs = plan.segments(ckpt, stop, run.checkpoints)
    order = plan.rounds(segs, onset, exhaustive)
    t0, restore0 = time.perf_counter(), session.restore_seconds
    rounds = _Rounds(session, assignments, segs, order, log, tolerance, repeats)
    runs, decision = rounds.run(progress, exhaustive, concurrent)
    decision = limit_to_consistent_log(_poisoned_state_check(session, decision), run.relogged_conflicts)
    wall = time.perf_counter() - t0
    disagreement = _disagreement(session, runs)
    differing = None
    if full_comparison and decision.step is not None and (decision.step + 1) in run.checkpoints:
        differing = _full_comparison(session, assignments[0], decision.step)
    replay_s = time.perf_counter() - t0 - (session.restore_seconds - restore0)
    if decision.verdict is Verdict.AMBIGUOUS and decision.cause is Cause.UNLOCALIZED:
        hint = cpu_threads_hint(run.env or {}, current_env)
        if hint:
            decision = dataclasses.replace(decision, explanation=f"{decision.explanation}; {hint}")
    table, run_table = session.device_table(), session.run_device_table()
    coords = {int(k): dict(v) for k, v in (run.mesh.get("device_coords") or {}).items()}
    return RangeReport(
        run_dir=run.run_dir, start=start, stop=stop, checkpoint=ckpt,
        checkpoints=[c for c in run.checkpoints if ckpt <= c < stop],
        device_spec=device_spec, devices=ids, quarantine=sorted(run.quarantine),
        run_devices=list(setup.run_device_ids),
        mesh={"axis_names": list(setup.axis_names), "shape": list(setup.shape)},
        env_differences=diffs_env, allow_env_drift=allow_env_drift, tolerance=tolerance,
        replays=runs, decision=decision, disagreement=disagreement, differing_elements=differing,
        relogged_conflicts=list(run.relogged_conflicts), skip_windows=run.skip_windows(),
        phase_changes=run.phase_changes(), restore_seconds=session.restore_seconds - restore0,
        replay_seconds=replay_s, scan_suspects=sorted(getattr(run, "suspects", ())),
        segments=segs, replayed_in_round=rounds.replayed, onset=onset, exhaustive=exhaustive, concurrent=concurrent,
        placements=[dv.placement_record(i, a, table) for i, a in enumerate(assignments)],
        convicted=dv.name_devices(decision.devices, run_table, coords), wall_seconds=wall,
    )


class _Rounds:
    """The rounds of a range replay (``replay.verify.plan.rounds``): each round replays its segments on
    every placement and repeat (this process's lanes on threads; with several processes the round's
    results are gathered), then the verdict so far is decided; a conviction ends the replay unless it
    is exhaustive."""

    def __init__(self, session: Session, assignments, segs, order, log, tolerance, repeats: int):
        self.session, self.assignments, self.segs, self.order = session, assignments, segs, order
        self.log, self.tolerance, self.repeats = log, tolerance, repeats
        self.replayed: dict[int, int] = {}  # segment -> the round that replayed it
        self.results: dict[tuple[int, int, int], tuple[list[StepFingerprints], list[cmp.StepDiff], float]] = {}

    def run(self, progress, exhaustive: bool, concurrent: bool):
        """``(runs, decision)``: one :class:`ReplayRun` per repeat and placement, and the verdict."""
        session, setup = self.session, self.session.setup
        suspected = sorted(set(getattr(session.run, "held_suspect", ())) & set(setup.run_device_ids))
        mine = session.my_lanes(self.assignments)
        # This process's tasks: (repeat, placement, segment), a lane's in a fixed order (the same in every
        # process that shares it), lanes on threads.
        local_steps = sum(self.segs[k].steps for rnd in self.order for k in rnd) * self.repeats \
            * sum(len(x) for x in mine)
        advance = _locked(progress(local_steps) if progress is not None else (lambda n=1: None))
        runs, decision = [], None
        order = [list(r) for r in self.order]
        rnd = -1
        while rnd + 1 < len(order):
            rnd += 1
            seg_ids = order[rnd]
            self.results.update(run_lanes(mine, functools.partial(self._lane, seg_ids=seg_ids, advance=advance),
                                          concurrent, "replay-lane"))
            if session.process_count > 1:
                self.results.update(_gather_round(session, self.assignments, self.results, self.log, self.tolerance,
                                                  set(seg_ids)))
            for k in seg_ids:
                self.replayed[k] = rnd
            runs = _assemble(self.results, self.assignments, self.repeats, self.segs)
            decision = decide([x.outcome() for x in runs], setup.mesh_size, suspected=suspected)
            if decision.verdict is Verdict.CONVICTED and not exhaustive:
                back = walk_back(self.segs, decision.step, self.replayed)
                if back is None:
                    break
                order = order[:rnd + 1] + [[back]] + [[k for k in r if k != back] for r in order[rnd + 1:]]
                order = [r for r in order if r]
        return runs, decision

    def _lane(self, lane, *, seg_ids, advance) -> dict:
        """One lane's tasks of a round: every repeat, placement and segment, in that order."""
        out = {}
        for r in range(self.repeats):
            for i in lane:
                for k in seg_ids:
                    seg = self.segs[k]
                    t1 = time.perf_counter()
                    fps, diffs, _ = self.session.replay_segment(self.assignments[i], seg.start, seg.stop, log=self.log,
                                                                tolerance=self.tolerance, advance=advance)
                    advance(seg.steps - len(fps))
                    out[(r, i, k)] = (fps, diffs, time.perf_counter() - t1)
        return out


def _disagreement(session: Session, runs: Sequence[ReplayRun]) -> Optional[dict[str, Any]]:
    """Where the first replay and the first other one that differs from it disagree
    (``replay.verify.compare.disagreement``), its suspects named; None when every replay agrees."""
    for other in runs[1:]:
        found = cmp.disagreement(runs[0].fingerprints, other.fingerprints, runs[0].coords(), other.coords())
        if found:
            found.update(replay_a=runs[0].index, replay_b=other.index,
                         suspects_named=dv.name_devices(found["suspects"], session.device_table()))
            return found
    return None


def _poisoned_state_check(session: Session, decision: Decision) -> Decision:
    """A conviction at step S against the state record of the first checkpoint after S
    (``verdict.limit_to_poisoned_state``): when its copies disagree, the state was corrupted in an update
    before S, and only a device holding a wrong copy may be convicted."""
    from replay.run import statefp

    if decision.verdict is not Verdict.CONVICTED or decision.step is None:
        return decision
    after = [c for c in session.run.checkpoints if c > decision.step]
    if not after:
        return decision
    try:
        record = statefp.read_record(session.run.run_dir, after[0])
    except statefp.DamagedCheckpointError:
        return decision
    if record is None or record.replicas_agree:
        return decision
    disputes = record.disputes()
    what = statefp.dispute_text(disputes[0]) if disputes else "its replicated state disagreed"
    return limit_to_poisoned_state(decision, after[0], record.odd_devices(), record.suspect_devices(), what)


def walk_back(segs: Sequence[plan.Segment], step: Optional[int], replayed: Mapping[int, int]) -> Optional[int]:
    """The segment a targeted replay must replay before a conviction at ``step`` stands, or None.

    A conviction at the first step of its segment says only that the state restored there was healthy and
    the device went wrong at once: a persistent fault may have begun earlier, before that checkpoint, so
    the segment before it (not yet replayed) is replayed too, and the verdict taken again; the first step
    any replay differs at is the one named. This keeps an onset estimate that falls a segment late (a
    drift's change point, a canary's window) from naming a later step than the fault's first."""
    if step is None:
        return None
    k = next((i for i, sg in enumerate(segs) if sg.start <= step < sg.stop), None)
    if k is None or k == 0 or segs[k].start != step or (k - 1) in replayed:
        return None
    return k - 1


def run_lanes(lanes: Sequence[Any], work: Callable[[Any], Mapping], concurrent: bool, name: str) -> dict:
    """The merged results of ``work(lane)`` for each lane: lanes never share a device, so with
    ``concurrent`` (and more than one lane) each runs in a thread of its own (``name``: the threads'
    prefix); otherwise one after the other. An exception of a lane is raised here."""
    out: dict = {}
    if concurrent and len(lanes) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix=name) as pool:
            for part in [pool.submit(work, lane) for lane in lanes]:
                out.update(part.result())
    else:
        for lane in lanes:
            out.update(work(lane))
    return out


def _locked(advance: Callable[[int], None]) -> Callable[[int], None]:
    """``advance`` callable from several threads (one lock around it)."""
    import threading

    lock = threading.Lock()

    def call(n: int = 1) -> None:
        if n:
            with lock:
                advance(n)

    return call


def _assemble(results, assignments, repeats, segs) -> list[ReplayRun]:
    """One :class:`ReplayRun` per (repeat, placement), its replayed segments in step order."""
    runs = []
    for r in range(repeats):
        for i, a in enumerate(assignments):
            fps, diffs, seconds = [], [], 0.0
            for k in range(len(segs)):
                hit = results.get((r, i, k))
                if hit is not None:
                    fps += hit[0]
                    diffs += hit[1]
                    seconds += hit[2]
            runs.append(ReplayRun(len(runs), r, tuple(a), fps, diffs, seconds))
    return runs


def _gather_round(session: Session, assignments, results, log, tolerance, seg_ids) -> dict:
    """Every process's results of this round's segments (a collective: every process calls it after the
    round). Each task is reported by the lowest process of its placement; the diffs are recomputed from
    the fingerprints (pure), so that only fingerprints cross processes."""
    from replay.runtime import distributed

    process_of = {i: d.process_index for i, d in session.jax_devices.items()}
    mine = []
    for (r, i, k), (fps, _, seconds) in results.items():
        if k in seg_ids and min(process_of[d] for d in assignments[i]) == session.process_index:
            mine.append([r, i, k, [fp.to_dict() for fp in fps], seconds])
    out = {}
    for part in distributed.gather_json(mine):
        for r, i, k, fps_raw, seconds in part:
            fps = [StepFingerprints.from_dict(x) for x in fps_raw]
            out[(r, i, k)] = (fps, [session.compare(log[fp.step], fp, tolerance) for fp in fps], seconds)
    return out


def _full_comparison(session: Session, assignment: Sequence[int], step: int) -> Optional[dict[str, int]]:
    """Per leaf, the elements of the run's checkpoint ``step + 1`` that differ from the replay's state after
    ``step`` (the run's own faulty state against a healthy one), or None when that checkpoint cannot be
    restored. Computed by the processes of ``assignment`` when it is local to one process; shared with the
    others."""
    from replay.runtime import distributed

    run = session.run
    out = None
    local = all(session.is_local(d) for d in assignment)
    if local:
        seg = max(c for c in run.checkpoints if c <= step)
        from replay.run.statefp import DamagedCheckpointError

        try:  # the faulty run's own state: its replicas may disagree (poisoned), which is what is counted
            logged_state = session.restore(step + 1, assignment, allow_poisoned=True)
        except (RunDirError, DamagedCheckpointError):  # a damaged checkpoint after the step: no full comparison
            logged_state = None
        if logged_state is not None:
            _, _, kept = session.run_steps(assignment, seg, step + 1, keep_state_at=step)
            out = count_differing(kept[step], logged_state)
    if session.process_count > 1:
        parts = [p for p in distributed.gather_json(out) if p is not None]
        out = parts[0] if parts else None
    return out
