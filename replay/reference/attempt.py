"""The attempt planner of the reference training loop: which attempt this is, the step it starts at,
the state it starts from, and the loader it reads.

Each start or restore of the loop begins an attempt (``replay.run.lineage``). Before any step runs::

    plan_attempt           the lineage (skip windows that `replay skip` recorded join the config), the
                           run config and mixture checked against the run directory's, a rewind followed
                           (one the command asks for, Launch.rewind_to, written as a ``rewind`` event
                           first; or one that `replay skip` recorded), and the state: checkpoint 0
                           initialized, or the newest committed checkpoint of the lineage restored and
                           verified against its state record (a damaged checkpoint is never trained on)
    AttemptPlan.open_inputs  the loader at the attempt's step (its restored state checked: a loader state
                           of another step would repeat or skip data), the grown skip windows written
                           into run_config.yaml once the loader accepted them, the inputs record
    AttemptPlan.record     the ``start`` event, or the ``restore`` event after the steps and checkpoints
                           past the restored one were moved to ``superseded/``; the loader's own events

Every refusal is a :class:`replay.reference.run.RunConfigError` naming what to do next, raised before
anything of the run directory changed but what the refusal itself records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping, Optional

from replay.reference import checkpoint as ckpt
from replay.reference.run import (
    RunConfig,
    RunConfigError,
    build_loader,
    check_same_config,
    check_same_mixture,
    write_grown_windows,
)
from replay.run import protocol as proto
from replay.run.writer import RunDir
from replay.runtime.quiet import quiet_aborted_reads

STEP_LOGS = (proto.FINGERPRINTS_NAME, proto.SIGNALS_NAME, proto.CANARY_NAME)  # truncated at a new run


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """What the training command asks of this attempt.

    Attributes:
      rewind_to: roll back: restore this checkpoint of the lineage instead of the newest (a ``rewind``
        event with ``rewind_reason`` is written first; the steps trained past it become a superseded
        attempt, kept in ``superseded/``). A rewind that ``replay skip`` recorded is followed without it.
      rewind_reason: why (the ``rewind`` event's ``reason``; default ``"rollback"``).
      launched_at: Unix time the training command started (``time.time()``; None: now), the start of
        the attempt's start-up in ``replay goodput``.
    """

    rewind_to: Optional[int] = None
    rewind_reason: Optional[str] = None
    launched_at: Optional[float] = None


@dataclasses.dataclass
class Inputs:
    """The attempt's loader: ``data`` (``loader.build``), ``data_start`` (the step it reads first) and
    ``logged_start`` (the step its state is logged at: ``data_start``, except under a drill's shifted
    loader state, where the trainer believes it resumed exactly)."""

    data: Any
    data_start: int
    logged_start: int


@dataclasses.dataclass
class AttemptPlan:
    """An attempt of the run in ``rd`` as planned by :func:`plan_attempt`: where it starts and from what.

    Attributes:
      rd: the run directory as this process writes it (its ``attempt`` set to :attr:`number`).
      number: the attempt's number (``replay.run.lineage``; 1 for a new run).
      cfg: the run config in force (with the skip windows ``replay skip`` recorded).
      start: the first step to train (the restored checkpoint, or 0).
      restored: the checkpoint restored, or None for a new run.
      state: the train state to start from (on the mesh); loader_state: the restored loader state
        (``LoaderState.to_dict()``) or None.
      lineage: the run's ``replay.run.lineage.Lineage`` before this attempt; logged_end: the end of its
        fingerprints.jsonl; pending: the recorded rewind followed, or None.
      committed: the committed checkpoints when the attempt started.
      grown: the skip windows when they grew (written once the loader accepts them), or None.
      env: this attempt's environment record; recorded_env: the run's env.json (a resume), or {}.
      check: the restored state's ``replay.run.statefp.Verification``, or None.
      restore_s: seconds restoring and verifying took; launched_at: Unix time the command started.
    """

    rd: RunDir
    number: int
    cfg: RunConfig
    lineage: Any
    logged_end: int
    pending: Optional[Mapping[str, Any]]
    committed: list[int]
    grown: Optional[list]
    env: dict[str, Any]
    launched_at: float
    restored: Optional[int] = None
    start: int = 0
    state: Any = None
    loader_state: Optional[dict[str, Any]] = None
    recorded_env: dict[str, Any] = dataclasses.field(default_factory=dict)
    check: Any = None
    restore_s: float = 0.0

    def open_inputs(self, mesh, loader_shift: int = 0) -> Inputs:
        """The attempt's loader (module docstring); ``loader_shift``: a drill's wrong loader state
        (``replay.reference.drills.DrillHooks.loader_shift``).

        Raises:
          RunConfigError: the restored loader state is of another step; a skip window rewrites the past.
          loader errors (``DatasetError``, ``ResumeError``) as raised by ``loader.build``.
        """
        cfg, start, loader_state = self.cfg, self.start, self.loader_state
        if loader_shift and loader_state is not None:  # a drill: a wrong loader state
            loader_state = _shifted_loader_state(loader_state, start + loader_shift)
        data = build_loader(cfg, mesh, state=loader_state)  # refuses skip windows that rewrite the past
        data_start = start + (loader_shift if loader_state is not None else 0)
        if not loader_shift and loader_state is not None and int(loader_state.get("next_step", start)) != start:
            raise RunConfigError(self._loader_state_refused(int(loader_state["next_step"])))
        if self.grown is not None:  # accepted by the loader: now the run's config
            write_grown_windows(self.rd, cfg)
        if self.rd.primary:  # process 0 writes the run's single files
            from replay.run import inputs as run_inputs

            run_inputs.record_inputs(self.rd.path, data.mixture, cfg.mixture, cfg.dataset, data.manifest_sha256,
                                     data.schedule.to_dict())
        return Inputs(data=data, data_start=data_start, logged_start=start if loader_shift else data_start)

    def _loader_state_refused(self, next_step: int) -> str:
        start, rd = self.start, self.rd
        older = [c for c in self.committed if c < start]
        return (f"checkpoint {start} holds loader state for step {next_step}, not {start} (the loader "
                f"state saved with it was edited, or written by another trainer), so resuming would "
                f"{'skip' if next_step > start else 'repeat'} data; next: put back the loader state "
                f"Orbax saved ({os.path.join(rd.checkpoints, str(start), 'loader')}), or resume from an earlier "
                f"checkpoint: python -m replay.reference.train --run {rd.path} --from-checkpoint "
                f"{older[-1] if older else 'C'}" + (f" (committed: {older})" if older else " (there is none earlier)"))

    def record(self, inputs: Inputs, trainer, mesh, steps: int, say: Callable[[str], None]) -> None:
        """The attempt's ``start`` or ``restore`` event (a restore first moves the steps and checkpoints past
        the restored one to ``superseded/``, every process its own step-log files), then the loader's
        events (e.g. a skip window appended on restore)."""
        rd, data, start = self.rd, inputs.data, self.start
        loader_rec = {"next_step": inputs.logged_start, "data_step": data.schedule.data_step(inputs.logged_start),
                      "fingerprint": data.state().fingerprint}
        common = {"attempt": self.number, "launched_at": round(self.launched_at, 6), "steps": steps,
                  **_model_info(trainer, self.cfg.global_batch, data.seq_len)}
        if self.restored is None:
            rd.event("start", 0, name=self.cfg.name, mesh=dict(zip(mesh.axis_names, mesh.devices.shape)),
                     loader_state=loader_rec, **common)
        else:
            self._record_restore(loader_rec, common, say)
        for ev in data.events:  # e.g. a skip window appended on restore
            name = "skip_window_added" if ev.get("event") == "skip_window" else f"loader_{ev.get('event', 'event')}"
            rd.event(name, ev.get("step", start), **{k: v for k, v in ev.items() if k not in ("event", "step")})

    def _record_restore(self, loader_rec: Mapping[str, Any], common: Mapping[str, Any],
                        say: Callable[[str], None]) -> None:
        from replay.run.env import compare_environment
        from replay.runtime import distributed

        rd, start, lineage, pending = self.rd, self.start, self.lineage, self.pending
        previous_end = max(lineage.end, self.logged_end)
        moved = rd.supersede(start, lineage.writer_of, self.number)  # each process its own step-log files
        moved_ckpts = rd.supersede_checkpoints(start, self.number) if rd.primary else []
        distributed.sync("replay-train-superseded")  # every process past it before any saves again
        # a restore nobody asked to roll back is a resume, also when newer checkpoints of the lineage are
        # gone (lost or damaged): they are named, and the steps after `start` are lost to the crash
        reason = str(pending.get("kind") or "rewind") if pending is not None else "resume"
        missing = [] if pending is not None else sorted(
            c for c in lineage.checkpoint_steps() if c > start and c not in self.committed)
        if missing:
            say(f"resuming from checkpoint {start}: the lineage's newer checkpoint(s) {missing} are no longer "
                "committed (lost or moved aside); the steps after it are trained again")
        rd.event("restore", start, checkpoint=self.restored, reason=reason, previous_end=previous_end,
                 **({"checkpoints_missing": missing} if missing else {}),
                 superseded={"steps": [start, previous_end] if previous_end > start else None,
                             "lines": moved, "checkpoints": moved_ckpts},
                 dropped_fingerprint_lines=moved.get(proto.FINGERPRINTS_NAME, 0),
                 restore_s=round(self.restore_s, 6), loader_state=loader_rec,
                 env_differences=compare_environment(self.recorded_env, self.env),
                 skip_windows_changed=self.grown, state_check=self.check.status, **common)


def plan_attempt(run_dir: str, cfg: RunConfig, trainer, mesh, steps: int, launch: Launch, *,
                 say: Callable[[str], None], new_run_note: str) -> AttemptPlan:
    """Plans this attempt of the run in ``run_dir`` (module docstring): reads and decides first, then
    writes (a rollback's ``rewind`` event, a new run's env.json), so that a refused plan leaves the run
    directory as it was (a new run's run_config.yaml aside). Sets ``rd.attempt``, which every later event
    carries. ``say`` shows what is done before the first step: ``new_run_note`` for a new run, else that
    ``run_dir`` resumes.

    Raises:
      RunConfigError: ``cfg`` does not fit the run directory, ``launch.rewind_to`` is not a checkpoint of
        the lineage, a recorded rewind names no committed checkpoint, the checkpoint to resume from
        holds fingerprints of another formula or cannot be read.
      replay.run.statefp.DamagedCheckpointError, PoisonedCheckpointError: the restored state does not
        match its record.
    """
    from replay.run import lineage as lin
    from replay.run.env import record_environment

    launched_at = time.time() if launch.launched_at is None else float(launch.launched_at)
    rd = RunDir.for_mesh(run_dir, mesh)
    rd.drop_torn_event()
    logged = rd.logged_steps()
    events = proto.read_events(rd.path) if os.path.exists(rd.file(proto.EVENTS_NAME)) else []
    lineage = lin.lineage_of_run(rd.path, events, logged)
    requested = [w for w in lineage.skip_windows if tuple(w) not in {tuple(x) for x in cfg.skip_windows}]
    if requested:  # windows recorded by `replay skip`: in force from now on
        cfg = dataclasses.replace(cfg, skip_windows=tuple(sorted({*cfg.skip_windows, *map(tuple, requested)})))
    grown = check_same_config(rd, cfg)
    check_same_mixture(rd, cfg)
    env = record_environment(mesh)
    committed = ckpt.all_steps(rd.checkpoints)
    logged_end = max(logged) + 1 if logged else 0
    rewind = None
    if launch.rewind_to is not None:  # a rollback: the lineage as it reads once its rewind event is written
        try:
            lin.validate_rewind(lineage, launch.rewind_to, committed)
        except lin.LineageError as e:
            raise RunConfigError(f"--from-checkpoint {launch.rewind_to}: {e}") from None
        rewind = {"checkpoint": launch.rewind_to, "previous_end": max(lineage.end, logged_end), "kind": "rollback",
                  "reason": launch.rewind_reason or "rollback", "by": "python -m replay.reference.train --from-checkpoint"}
        lineage = lin.lineage_of_run(rd.path, [*events, {"event": "rewind", "step": int(launch.rewind_to), **rewind}],
                                     logged)
    plan = AttemptPlan(rd=rd, number=lineage.next_attempt(), cfg=cfg, lineage=lineage, logged_end=logged_end,
                       pending=lineage.pending_rewind, committed=committed, grown=grown, env=env,
                       launched_at=launched_at)
    try:
        plan.restored = lin.resume_checkpoint(lineage, committed)
    except lin.LineageError as e:
        raise RunConfigError(f"cannot resume {rd.path}: {e}") from None
    if rewind is not None:
        rd.event("rewind", launch.rewind_to, **rewind)
    rd.attempt = plan.number
    if plan.restored is None:
        say(new_run_note)
        rd.write_env(env)
        for name in STEP_LOGS:
            rd.truncate_log(name, 0)
        plan.state = trainer.init_state(mesh, cfg.seed)
    else:
        note = f"resuming {run_dir} from checkpoint {plan.restored}" if plan.restored < steps else None
        _restore(plan, trainer, mesh, say, note)  # else nothing to do: said at the end
    return plan


def _restore(plan: AttemptPlan, trainer, mesh, say: Callable[[str], None], note: Optional[str]) -> None:
    """Restores checkpoint ``plan.restored`` into ``plan`` (saying ``note`` once the run's fingerprint
    formula is known to be this one) and checks it against its state record."""
    from replay.run import statefp
    from replay.run.fingerprint import FINGERPRINT_VERSION, version_mismatch

    rd, latest = plan.rd, plan.restored
    env_path = rd.file(proto.ENV_NAME)
    if os.path.exists(env_path):
        with open(env_path, encoding="utf-8") as f:
            plan.recorded_env = json.load(f)
    recorded = plan.recorded_env
    if recorded and version_mismatch(recorded) is not None:
        got = (recorded.get("versions") or {}).get("fingerprint", 1)
        raise RunConfigError(
            f"cannot resume {rd.path}: its fingerprints.jsonl holds fingerprints of formula version {got!r} "
            f"(env.json versions.fingerprint) and this code computes version {FINGERPRINT_VERSION}, so one log "
            "would mix two formulas that replay cannot compare; finish this run with the toolkit release that "
            "started it, or train on in a new run directory")
    if note:
        say(note)
    t0 = time.perf_counter()
    try:
        state, loader_state = trainer.restore(rd.path, latest, mesh)
    except Exception as e:  # noqa: BLE001 - Orbax/TensorStore report a damaged checkpoint many ways
        quiet_aborted_reads()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        older = [c for c in ckpt.all_steps(rd.checkpoints) if c < latest]
        raise RunConfigError(
            f"cannot resume {rd.path}: checkpoint {latest} is damaged ({type(e).__name__}: {first}); move "
            f"{os.path.join(rd.checkpoints, str(latest))} aside to resume from "
            f"{older[-1] if older else 'scratch'}") from None
    # a damaged checkpoint is never trained on: DamagedCheckpointError / PoisonedCheckpointError; a
    # checkpoint without a record (a run from before records) comes back ``unverified`` with a note
    plan.check = statefp.verify_restored(rd.path, latest, state, loader_state)
    if plan.check.note:
        say(plan.check.note)
    plan.restore_s = time.perf_counter() - t0
    plan.state, plan.loader_state, plan.start = state, loader_state, latest


def _shifted_loader_state(state: Mapping[str, Any], next_step: int) -> dict[str, Any]:
    """A drill's wrong loader state: ``state`` with another ``next_step`` (fingerprint unchanged: it covers
    the schedule, not the step)."""
    if next_step < 0:
        raise RunConfigError(f"loader_shift: the shifted loader state would start at step {next_step} < 0")
    return {**dict(state), "next_step": int(next_step)}


# ----------------------------------------------------------------------------- what the events say


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
