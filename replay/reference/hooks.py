"""The hooks the reference training loop calls around each step (``replay.reference.loop``).

Each hook does one thing and keeps its own state; the loop only calls them in order::

    before the step   DataEvents.before_step      phase_change and skipped_window events
                      PeriodicCanary.before_step  every canary_every steps: the canary on every device
                                                  (canary_action: stop ends the loop, checkpoint saved)
    after the step    NonFinite.after_step        a NaN/Inf loss, gradient norm or gradient element: an
                                                  event and a warning; skip_step drops the update
                      Checkpoints.after_step      every checkpoint_every steps (and at the end) the
                                                  state record and an asynchronous Orbax save; the
                                                  ``checkpoint`` event once the save has committed
    around the loop   CompileClock                seconds of XLA compilation (the signals' compile_s)

A drill reaches the loop through one object, ``replay.reference.drills.DrillHooks``: its faults go to
``train_step``, its canary fault to :meth:`PeriodicCanary.run`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Optional

from replay.reference import checkpoint as ckpt
from replay.reference.run import RunConfig, canary_batch
from replay.run import protocol as proto
from replay.run.writer import RunDir


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

    def __init__(self, cfg: RunConfig, trainer, mesh, rd: RunDir, env: Mapping[str, Any]):
        from replay.run import canary as cn

        host = canary_batch(cfg, mesh)
        self.batch = {k: v[: cfg.canary.rows, : cfg.canary.seq_len] for k, v in host.items()}
        self.trainer, self.rd = trainer, rd
        self.every, self.action = cfg.canary_every, cfg.canary_action
        self.params = trainer.init_params(mesh, cfg.canary.seed)
        shape = "x".join(f"{a}{n}" for a, n in zip(mesh.axis_names, mesh.devices.shape))
        if cfg.canary.seq_len is not None:
            shape += f"-seq{self.batch['inputs'].shape[1]}"
        self.spec = cn.CanarySpec(step=cfg.canary.step, rows=cfg.canary.rows, weights=f"init:{cfg.canary.seed}",
                                  batch_sha256=cn.batch_sha256(self.batch), program=f"mesh:{shape}")
        self.env_key = cn.environment_key(self.spec, env)
        self.golden_path = rd.file(cn.GOLDEN_DEFAULT)
        cn.read_golden(self.golden_path)  # a corrupt golden file is reported before training starts
        self.seconds: list[float] = []  # of each periodic canary run

    def before_step(self, step: int, fault, checkpoints: "Checkpoints", state, log: Callable[[str], None],
                    persistent=None) -> tuple[float, Optional[dict[str, Any]]]:
        """The canary before ``step`` when it is due (``fault``: a drill's canary fault, or None;
        ``persistent``: the drill's training faults, whose persistent ones fire in the canary too, as a
        faulty device's would in every program it runs: :meth:`run`); returns its seconds
        (0 when not due) and, under ``canary_action: stop`` after a mismatch, the loop's ``stopped``
        summary (checkpoint ``step`` saved from ``state`` first, a ``stopped`` event written)."""
        if step % self.every:
            return 0.0, None
        decision, seconds = self.run(step, fault, persistent)
        self.seconds.append(seconds)
        if decision.verdict.value == "acquitted":
            return seconds, None
        log(f"WARNING: canary before step {step}: {decision.explanation}")
        if self.action != "stop":
            return seconds, None
        if not checkpoints.holds(step):
            checkpoints.save(step, state)
        self.rd.event("stopped", step, reason="canary_mismatch", devices=list(decision.odd_devices))
        return seconds, {"step": step, "reason": decision.explanation}

    def run(self, step: int, fault=None, persistent=None):
        """Runs the canary before ``step``; returns ``(CanaryDecision, seconds)``. ``persistent``: the
        training step's drill faults, whose persistent ones fire in the canary program too
        (``ReferenceTrainer.canary_fingerprints``)."""
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
            warnings.warn(CanaryMismatchWarning(f"canary before step {step}: {decision.explanation}"), stacklevel=3)
        return decision, seconds


class Checkpoints:
    """The loop's checkpoints: each save fingerprints the state on the devices (its state record,
    ``replay.run.statefp``, written before the save) and starts an asynchronous Orbax save; the
    ``checkpoint`` event follows only once Orbax has committed it (a kill during a save leaves no event
    for it), ``checkpoint_failed`` for a save that finished without committing. Under
    ``non_finite: stop`` a non-finite state is never saved: the refusal is kept in :attr:`refused`
    and ends the loop."""

    def __init__(self, rd: RunDir, cfg: RunConfig, data, steps: int, log: Callable[[str], None]):
        self.rd, self.cfg, self.data, self.steps, self.log = rd, cfg, data, steps, log
        self.mngr = ckpt.manager(rd.checkpoints)
        self.pending: list[int] = []  # checkpoints saved (asynchronously), not yet known to have committed
        self.records: dict[int, Any] = {}  # their state records (replay.run.statefp), written at the commit
        self.refused: list[dict[str, Any]] = []  # non_finite: stop refused to save a non-finite state
        self.started: dict[int, float] = {}  # step -> Unix time its save started (the event's save_start_t)

    def holds(self, step: int) -> bool:
        """Whether checkpoint ``step`` is saved or being saved."""
        return step in self.pending or ckpt.is_committed(self.rd.checkpoints, step)

    def save(self, step: int, state) -> float:
        """Fingerprints ``state`` (on the devices) and starts an asynchronous save as checkpoint ``step``;
        returns the seconds the loop was blocked by both. A non-finite state under ``non_finite: stop``
        is not saved."""
        from replay.run import statefp

        t = time.perf_counter()
        self.started[step] = time.time()
        loader_now = self.data.state().to_dict()
        record = _state_record(self.rd, self.cfg, state, loader_now, step, self.log)
        if not record.finite and self.cfg.non_finite == "stop":
            self.refused.append({"step": step, "nonfinite": record.data["nonfinite"]})
            self.started.pop(step, None)
            return time.perf_counter() - t
        path = statefp.write_record(self.rd.path, record) if self.rd.primary else None  # before the save: a kill
        ckpt.save(self.mngr, step, state, loader_now)  # after Orbax's commit and before the event still leaves it
        self.pending.append(step)
        self.records[step] = (record, path)
        return time.perf_counter() - t

    def after_step(self, step: int, state, nonfinite: Optional[str]) -> float:
        """After ``step``: checkpoint ``step + 1`` when it is due (every ``checkpoint_every`` steps, and the
        last), refused when the step was non-finite under ``non_finite: stop``; then the events of the saves
        that have committed. Returns the seconds the loop was blocked."""
        nxt, blocked = step + 1, 0.0
        if nonfinite is not None and self.cfg.non_finite == "stop":
            self.refused.append({"step": nxt, "nonfinite": nonfinite})
        elif nxt % self.cfg.checkpoint_every == 0 or nxt == self.steps:
            blocked = self.save(nxt, state)
        self.commit_events(wait=False)
        return blocked

    def commit_events(self, wait: bool) -> None:
        """A ``checkpoint`` event for each pending save that has committed (Orbax's commit: the
        temporary folder renamed, or commit_success.txt written), ``checkpoint_failed`` for one that
        finished without committing; with ``wait``, waits for the saves in flight first."""
        if not self.pending:
            return
        if wait:
            self.mngr.wait_until_finished()
        elif self.mngr.is_saving_in_progress():
            return
        for s in self.pending:
            started = self.started.pop(s, None)
            times = {"save_start_t": round(started, 6)} if started is not None else {}
            if ckpt.is_committed(self.rd.checkpoints, s):
                commit = ckpt.commit_time(self.mngr, s)
                self.rd.event("checkpoint", s, **times, **({"commit_t": round(commit, 6)} if commit is not None else {}),
                              **_record_fields(self.records.pop(s, None)))
            else:
                self.rd.event("checkpoint_failed", s, **times)
        self.pending.clear()

    def close(self, finished: bool) -> None:
        """Waits for a save in flight and writes its event; an error here is raised only when the loop
        ``finished`` (else the loop's own error is the one to see)."""
        try:
            self.mngr.close()
            self.commit_events(wait=False)
        except Exception:  # noqa: BLE001
            if finished:
                raise


def _state_record(rd: RunDir, cfg: RunConfig, state, loader_state, step: int, log) -> Any:
    """The state record of checkpoint ``step`` (on the devices, every process); replicas that disagree
    are a ``state_replicas_disagree`` event naming device, leaf and shard, a non-finite state a
    ``non_finite_state`` event."""
    from replay.run import statefp

    record = statefp.record_state(state, loader_state, step)
    if not record.replicas_agree:
        rd.event("state_replicas_disagree", step, **statefp.disagree_event(record))
        log(statefp.poisoned_warning(record, rd.path))
    if not record.finite:
        rd.event("non_finite_state", step, action=cfg.non_finite, nonfinite=record.data["nonfinite"])
    return record


def _record_fields(saved) -> dict[str, Any]:
    """The ``checkpoint`` event's ``state`` fields of a ``(record, path)`` written at the save (or none)."""
    from replay.run import statefp

    return {} if saved is None else statefp.event_fields(*saved)


class NonFinite:
    """``non_finite``: a step whose loss, gradient norm or gradient elements are NaN/Inf is a
    ``non_finite`` event and a warning, whatever the action; ``skip_step`` drops its update (the next
    step starts from the state before it); ``stop`` ends the loop before a checkpoint holds it
    (:meth:`Checkpoints.after_step` refuses the save, :meth:`stopped` says so)."""

    def __init__(self, rd: RunDir, action: str, log: Callable[[str], None]):
        self.rd, self.action, self.log = rd, action, log

    def keep_before(self, state):
        """The state to keep before the step: only ``skip_step`` needs it (to drop an update)."""
        return state if self.action == "skip_step" else None

    def after_step(self, step: int, fp, state, before) -> tuple[Any, Optional[str]]:
        """``(the state to go on from, what was non-finite or None)`` after ``step``."""
        bad = non_finite_in(fp)
        if bad is None:
            return state, None
        self.rd.event("non_finite", step, action=self.action, what=bad, loss=_json_float(fp.router["loss"]))
        self.log(f"WARNING: step {step}: {bad} (non_finite: {self.action})")
        return (before if self.action == "skip_step" else state), bad

    def stopped(self, step: int, refused: Mapping[str, Any]) -> dict[str, Any]:
        """``non_finite: stop``: the ``stopped`` event and the loop's summary of it."""
        what = refused["nonfinite"]
        what = what if isinstance(what, str) else f"the state holds NaN/Inf ({dict(list(what.items())[:3])})"
        reason = (f"step {step}: {what}; stopped before checkpoint {refused['step']} could hold it (non_finite: stop)")
        self.rd.event("stopped", step + 1, reason="non_finite", detail=reason, checkpoint_refused=refused["step"])
        return {"step": step + 1, "reason": reason, "kind": "non_finite", "first_step": step}


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


class DataEvents:
    """The data's events, before the step that first meets them: ``phase_change`` (the mixture's phase of
    the step's data differs from the previous step's) and ``skipped_window`` (a skip window starts)."""

    def __init__(self, rd: RunDir, data, skip_windows, first_data_step: int):
        self.rd, self.data = rd, data
        self.windows = {a: b for a, b in skip_windows}
        self.phase = self.phase_of(first_data_step)

    def phase_of(self, data_step: int) -> int:
        d = self.data.schedule.data_step(data_step)
        idx = 0
        for i, p in enumerate(self.data.schedule.phases):
            if p.from_step <= d:
                idx = i
        return idx

    def before_step(self, step: int, data_step: int) -> None:
        p = self.phase_of(data_step)
        if p != self.phase:
            self.rd.event("phase_change", step, phase=p, from_data_step=self.data.schedule.phases[p].from_step)
            self.phase = p
        if step in self.windows:
            self.rd.event("skipped_window", step, start=step, end=self.windows[step],
                          data_step=self.data.schedule.data_step(step))


class CompileClock:
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


def compiling_note(canary: bool) -> str:
    """What the first step of an invocation waits for: XLA compiling its programs (or loading them
    from JAX's persistent compilation cache, when one is set)."""
    import jax

    cached = bool(getattr(jax.config, "jax_compilation_cache_dir", None))
    what = "the train step" + (" and the periodic canary" if canary else "")
    return (f"compiling {what}" + (" (or loading from JAX's compilation cache)" if cached else "")
            + ": the first step takes longer, the steps after it run at speed")
