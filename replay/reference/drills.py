"""How a drill's faults reach the reference training loop: one hooks object, never a parameter of ``train``.

The training command never makes a :class:`DrillHooks`; drills do (``replay drill --scenario`` through
:func:`retrainer`, the triage drills of ``replay.triage_drill``), and so do tests and benchmarks.
``replay.reference.loop.train(..., drill=DrillHooks(...))`` passes each field where the fault belongs::

    faults        every train_step's ``fault``: inside the step's program, on its device (FaultSpec,
                  DriftSpec or a list of them, each firing at its own steps)
    canary_fault  a FaultSpec whose bit is flipped in its device's canary gradient at every periodic
                  canary from ``canary_fault.step`` on
    loader_shift  a restart drill (``replay drill --scenario restart`` of the triage drills): the resumed
                  loader starts ``loader_shift`` steps off the restored checkpoint (data repeated when
                  negative, skipped when positive), while the ``restore`` event records the checkpoint's
                  own state, as a trainer that believes it resumed exactly logs it: triage must find the
                  shift from the batches
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrillHooks:
    """A drill's faults for one training invocation (module docstring)."""

    faults: Any = None
    canary_fault: Any = None
    loader_shift: int = 0

    def canary_fault_at(self, step: int) -> Any:
        """The canary fault in force at the periodic canary before ``step`` (from its own step on), or None."""
        f = self.canary_fault
        return f if f is not None and step >= f.step else None


def retrainer(cfg: Any) -> Callable[..., Any]:
    """``RunSetup.retrain`` of a reference-trainer run (``replay.reference.setup``): the screening drills'
    retraining through the reference training loop (``replay.reference.loop.train``), with periodic
    canaries, signals with timings and events as the run itself wrote them, the drill's faults as a
    :class:`DrillHooks`."""

    def retrain(out_dir: str, stop: int, *, trainer: Any, mesh: Any, faults: Any = None, canary_fault: Any = None,
                canary_every: Optional[int] = None, log: Optional[Callable[[str], None]] = None) -> None:
        import yaml

        from replay.reference import hooks, loop

        new = cfg if canary_every is None else dataclasses.replace(cfg, canary_every=canary_every)
        with open(os.path.join(out_dir, "run_config.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(new.to_dict(), f, sort_keys=False)
        with warnings.catch_warnings():  # the drill's own canary mismatches are its point, not news
            warnings.simplefilter("ignore", hooks.CanaryMismatchWarning)
            loop.train(out_dir, new, stop, trainer=trainer, mesh=mesh,
                       output=loop.Output(log=log or (lambda s: None), plot=False),
                       drill=DrillHooks(faults=faults, canary_fault=canary_fault))

    return retrain
