"""The reference trainer's training loop: a plan, a loader, and a plain step loop that calls hooks.

:func:`train` writes the run directory of ``replay.run.protocol``; killed at any point and started
again with the same arguments it resumes from the last complete checkpoint, drops fingerprint, signal
and canary lines from that step on, and continues: the resulting ``fingerprints.jsonl`` equals an
uninterrupted run's. In order::

    plan_attempt, open_inputs, record            replay.reference.attempt: lineage, rewind, restore
                                                 and its check; the loader and the inputs record; the
                                                 start or restore event
    for each step                                StepLoop: the hooks of replay.reference.hooks before
                                                 the step (data events, periodic canary), the step,
                                                 its fingerprints, the hooks after it (non-finite,
                                                 checkpoint), its signals, progress
    end event, train.png

Each step appends the step's fingerprints and its screening signals (``signals.jsonl``: loss, step
time, loader wait and buffer occupancy, per-replica and per-device gradient norms, non-finite counts,
per-layer router health); every ``canary_every`` steps the periodic canary (one ``canary.jsonl`` line
per device, a ``canary_mismatch`` event when a device disagrees); a ``checkpoint`` event only once
Orbax has committed that checkpoint (saves are asynchronous: a kill during a save leaves no event for
it). Drills reach the loop through one object, ``replay.reference.drills.DrillHooks``, which the
training command never makes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from typing import Any, Callable, Optional, TextIO

from replay.reference import hooks
from replay.reference.attempt import AttemptPlan, Inputs, Launch, plan_attempt
from replay.reference.run import RunConfig, RunConfigError, make_trainer
from replay.run.writer import input_signals

__all__ = ["Launch", "Output", "StepLoop", "train"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Output:
    """What the loop tells its caller.

    Attributes:
      log: the loop's warnings (a canary mismatch, a non-finite step, a poisoned checkpoint; None:
        stderr).
      progress: the stream of the step progress (``replay.runtime.progress``: a Rich bar on a terminal, a
        line every ``$REPLAY_PROGRESS_EVERY`` s otherwise, with step, steps/s, tokens/s, step time, loss
        and ETA; and a closing ``train: steps A:B done in ...`` line); None: stderr.
      plot: write ``<run_dir>/train.png`` (``replay.run.train_plot.plot_training``: the whole run,
        earlier invocations included) at the end, also when there was nothing to train.
      on_step: called after each step with the step and its loss (benchmarks time steps with it).
    """

    log: Optional[Callable[[str], None]] = None
    progress: Optional[TextIO] = None
    plot: bool = True
    on_step: Optional[Callable[[int, float], None]] = None


def train(run_dir: str, cfg: RunConfig, steps: int, *, trainer=None, mesh=None, launch: Optional[Launch] = None,
          output: Optional[Output] = None, drill: Any = None) -> dict[str, Any]:
    """Trains until global step ``steps`` (exclusive), resuming from the run directory's last checkpoint.

    Args:
      run_dir: the run directory (created).
      cfg: the run config (``replay.reference.run``).
      steps: the step to stop at (total, not additional: rerunning the same command after a kill
        finishes the same run).
      trainer, mesh: a prepared :class:`ReferenceTrainer` and its mesh (tests reuse the compiled step);
        default from ``cfg``.
      launch: what the command asks of this attempt (:class:`Launch`: a rollback, when it started).
      output: what the loop tells its caller (:class:`Output`: warnings, progress, train.png, each step).
      drill: a drill's ``replay.reference.drills.DrillHooks`` (faults in the step and the canary, a wrong
        loader state); None for training.

    Returns:
      ``{"start": first step run, "end": steps, "losses": {step: loss}, "stopped": None or
      {"step", "reason"}, "canary_seconds": [seconds of each periodic canary], "plot": the path
      of train.png or None, "attempt": this attempt's number}``. A run already at ``steps`` (its newest
      checkpoint at or past it, no rewind pending, no skip window added) is restored and verified, but
      nothing is trained and nothing is written to its log: ``losses`` empty, ``attempt`` None.

    Raises:
      RunConfigError: ``cfg`` does not fit the run directory, or ``steps`` < 0, or ``launch.rewind_to`` is
        not a checkpoint of the lineage.
      loader errors (``DatasetError``, ``ResumeError``) as raised by ``loader.build``.
    """
    from replay.runtime.progress import line_interval, note

    launch, output = launch or Launch(), output or Output()
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise RunConfigError(f"steps: must be an int >= 0, got {steps!r}")
    log = output.log or (lambda s: print(s, file=sys.stderr, flush=True))
    line_interval()  # a bad $REPLAY_PROGRESS_EVERY is reported before any work
    say = functools.partial(note, "train", stream=output.progress)  # no silent wait before the first step
    if trainer is None or mesh is None:
        say(f"run config {cfg.name}: starting JAX, building the mesh and the model")
        trainer, mesh, _ = make_trainer(cfg)
    new_run_note = _new_run_note(run_dir, os.path.isdir(run_dir), cfg.seed)
    attempt = plan_attempt(run_dir, cfg, trainer, mesh, steps, launch, say=say, new_run_note=new_run_note)
    rd = attempt.rd
    if attempt.restored is not None and attempt.start >= steps and attempt.pending is None \
            and launch.rewind_to is None and not attempt.grown:  # nothing to do: the log is left as it is
        return {"start": attempt.start, "end": steps, "losses": {}, "stopped": None, "canary_seconds": [],
                "plot": _plot(rd, cfg, output), "attempt": None}
    inputs = attempt.open_inputs(mesh, loader_shift=drill.loader_shift if drill is not None else 0)
    attempt.record(inputs, trainer, mesh, steps, say)
    loop = StepLoop(attempt, inputs, trainer, mesh, steps, log=log, output=output, drill=drill)
    stopped = loop.run()
    rd.event("end", max(attempt.start, steps) if stopped is None else stopped["step"],
             final_save_s=round(loop.final_wait, 6))
    return {"start": attempt.start, "end": steps, "losses": loop.losses, "stopped": stopped,
            "canary_seconds": loop.canary.seconds if loop.canary is not None else [], "plot": _plot(rd, cfg, output),
            "attempt": attempt.number}


def _plot(rd, cfg: RunConfig, output: Output) -> Optional[str]:
    """``train.png`` of the run (loss, gradient norm, router drops per step), or None without ``output.plot``
    or on a process other than the primary."""
    if not (output.plot and rd.primary):
        return None
    from replay.run.train_plot import plot_training

    return plot_training(rd.path, title=f"training run {cfg.name} ({rd.path})")


def _new_run_note(run_dir: str, existed: bool, seed: int) -> str:
    """The line a new run starts with; for a folder that was not there, the nearest existing run
    directory (a typo in ``--run`` would otherwise start a new run from step 0 without a word)."""
    from replay.run.runlog import nearest_run_dir

    near = None if existed else nearest_run_dir(run_dir)
    where = (f"new run directory {run_dir} (it did not exist; the nearest existing run directory is {near}, in "
             "case --run meant it)" if near else f"new run in {run_dir}")
    return f"{where}: initializing the parameters (seed {seed}) and saving checkpoint 0"



class StepLoop:
    """The steps of one attempt, ``attempt.start .. steps - 1``, each with its hooks (module docstring).

    Attributes (after :meth:`run`): ``losses`` ``{step: loss}``, ``final_wait`` (seconds waiting for the
    last saves to commit), ``canary`` (the :class:`hooks.PeriodicCanary`, or None when off).
    """

    def __init__(self, attempt: AttemptPlan, inputs: Inputs, trainer, mesh, steps: int, *,
                 log: Callable[[str], None], output: Output, drill: Any = None):
        cfg, rd = attempt.cfg, attempt.rd
        self.rd, self.attempt, self.data, self.trainer, self.steps = rd, attempt, inputs.data, trainer, steps
        self.log, self.output, self.drill = log, output, drill
        self.state, self.start, self.data_start = attempt.state, attempt.start, inputs.data_start
        self.canary = hooks.PeriodicCanary(cfg, trainer, mesh, rd, attempt.env) \
            if cfg.canary_every and attempt.start < steps else None
        self.checkpoints = hooks.Checkpoints(rd, cfg, self.data, steps, log)
        self.non_finite = hooks.NonFinite(rd, cfg.non_finite, log)
        self.events = hooks.DataEvents(rd, self.data, cfg.skip_windows, self.data_start) \
            if attempt.start < steps else None
        self.losses: dict[int, float] = {}
        self.final_wait = 0.0

    def run(self) -> Optional[dict[str, Any]]:
        """Runs the steps; returns the ``stopped`` summary (canary or non-finite stop) or None. Saves
        checkpoint 0 of a new run first, and waits for every save to commit at the end."""
        blocked = self.checkpoints.save(0, self.state) if self.attempt.restored is None else 0.0
        stopped, finished = None, False
        bar = contextlib.ExitStack()
        self.compiled = hooks.CompileClock()
        try:
            if self.start < self.steps:
                first = hooks.compiling_note(self.canary is not None and self.start % self.canary.every == 0)
                shown = bar.enter_context(self._progress(first))
                stopped = self._steps(shown, blocked)
            t_wait = time.perf_counter()
            self.checkpoints.commit_events(wait=True)
            self.final_wait = time.perf_counter() - t_wait
            finished = True
        except BaseException:
            bar.__exit__(*sys.exc_info())
            raise
        else:
            bar.close()
        finally:
            self.compiled.close()
            self.checkpoints.close(finished)
        return stopped

    def _progress(self, first: str):
        from replay.runtime.progress import step_progress

        return step_progress("train", self.start, self.steps, stream=self.output.progress, first=first)

    def _steps(self, shown, blocked: float) -> Optional[dict[str, Any]]:
        """The loop over the batches from the attempt's step; ``blocked``: the seconds the initial save
        blocked (carried by the first step's signals)."""
        served = int(self.data.metrics()["tokens_served"])
        for data_step, batch in self.data.iterate(self.data_start):
            step = data_step - (self.data_start - self.start)
            metrics = self.data.metrics()
            self.events.before_step(step, data_step)
            canary_s = 0.0
            if self.canary is not None:
                canary_fault = self.drill.canary_fault_at(step) if self.drill is not None else None
                faults = self.drill.faults if self.drill is not None else None
                canary_s, stopped = self.canary.before_step(step, canary_fault, self.checkpoints, self.state, self.log,
                                                            persistent=faults)
                if stopped is not None:
                    return stopped
            fp, timing = self._train_step(step, batch)
            now_served = int(metrics["tokens_served"])
            blocked += self.checkpoints.after_step(step, self.state, timing["nonfinite"])
            if fp.signals is not None:
                self.rd.append_signals(dataclasses.replace(
                    fp.signals, step_time_s=round(timing["step_s"], 6), **input_signals(metrics),
                    t=round(time.time(), 6), compile_s=round(min(timing["compile_s"], timing["step_s"]), 6),
                    canary_s=round(canary_s, 6), checkpoint_s=round(blocked, 6), tokens=now_served - served))
            blocked = 0.0
            shown.update(step, tokens=now_served - served, step_s=timing["step_s"], loss=fp.router["loss"],
                         dropped=_dropped_max(fp))
            served = now_served
            if self.output.on_step is not None:
                self.output.on_step(step, fp.router["loss"])
            if self.checkpoints.refused:
                return self.non_finite.stopped(step, self.checkpoints.refused[0])
            if step + 1 >= self.steps:
                return None
        return None

    def _train_step(self, step: int, batch) -> tuple[Any, dict[str, Any]]:
        """One step (a drill's faults passed in), its non-finite check and its fingerprints' line; returns
        the fingerprints and ``{"step_s", "compile_s", "nonfinite"}``."""
        c0 = self.compiled.seconds
        t0 = time.perf_counter()
        before = self.non_finite.keep_before(self.state)  # kept only to drop an update
        faults = self.drill.faults if self.drill is not None else None
        self.state, fp = self.trainer.train_step(self.state, batch, step, faults)
        step_s = time.perf_counter() - t0
        self.state, bad = self.non_finite.after_step(step, fp, self.state, before)
        compile_s = self.compiled.seconds - c0
        self.rd.append_fingerprints(fp)
        self.losses[step] = fp.router["loss"]
        return fp, {"step_s": step_s, "compile_s": compile_s, "nonfinite": bad}


def _dropped_max(fp) -> float:
    """The step's largest per-layer dropped fraction (the progress line shows it)."""
    if fp.signals is None:
        return fp.router["dropped_fraction"]
    return max((r.dropped_fraction for r in fp.signals.router), default=fp.router["dropped_fraction"])
