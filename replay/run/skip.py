"""``replay skip``: record a rewind to a checkpoint and a data window to skip, for the next training
run to follow.

After a loss spike that no fault explains (an optimization event), large runs rewind to a
checkpoint before the spike and skip the batches that fed it (PaLM: restart about 100 steps
before the spike, skip 200 to 500 batches). Here that is two events appended to ``events.jsonl``,
never an edit of a file by hand::

    {"event": "skip_window", "step": A, "start": A, "end": B - 1, "stop": B, "checkpoint": C, ...}
    {"event": "rewind", "step": C, "checkpoint": C, "previous_end": E, "skip": [A, B], ...}

The window is in training steps: from step ``A`` on, step ``s`` trains on the data the unskipped
schedule had for ``s + (B - A)`` (``loader.index``: skip windows), so no batch id is renumbered and
the decision survives any number of restarts. Readers follow both at once (``replay.run.lineage``):
the lineage ends at ``C`` until training resumes, and the loader of ``replay inspect`` and of range
replay skips the window. ``python -m replay.reference.train --run DIR`` then restores checkpoint
``C``, moves the steps ``C .. E - 1`` it abandons to ``superseded/`` (history is never rewritten:
they stay, marked as a superseded attempt), adds the window to the run config and trains on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from replay.run.runlog import RunLog
from replay.run.writer import RunDir


class SkipError(ValueError):
    """The requested window or checkpoint does not fit the run; the message names the value and what fits."""


@dataclasses.dataclass(frozen=True)
class SkipRequest:
    """A validated rewind and skip.

    Attributes:
      start, stop: the half-open window of training steps whose data is skipped.
      checkpoint: the checkpoint training resumes from (``<= start``).
      reason: why (recorded).
      lineage_end: the lineage's end now; steps ``checkpoint .. lineage_end - 1`` become superseded.
      windows: the skip windows in force after it (inclusive ``[a, b]``, as the loader takes them).
    """

    start: int
    stop: int
    checkpoint: int
    reason: str
    lineage_end: int
    windows: tuple[tuple[int, int], ...]

    @property
    def superseded_steps(self) -> int:
        return max(0, self.lineage_end - self.checkpoint)

    def to_dict(self) -> dict[str, Any]:
        return {"skip": {"start": self.start, "stop": self.stop}, "checkpoint": self.checkpoint,
                "reason": self.reason, "lineage_end": self.lineage_end, "superseded_steps": self.superseded_steps,
                "skip_windows": [list(w) for w in self.windows]}


def plan(run: RunLog, start: int, stop: int, reason: str, checkpoint: Optional[int] = None) -> SkipRequest:
    """Validates a rewind and skip of the data of steps ``[start, stop)`` (module docstring).

    Raises:
      SkipError: the window is empty, not inside the lineage's steps, overlaps or precedes a skip
        window the run already has (windows only append), a rewind is already pending, or there
        is no checkpoint at or before ``start`` (or ``checkpoint`` is not one).
    """
    lineage = run.lineage
    if lineage is None:
        raise SkipError("the run's lineage is unknown")
    if lineage.pending_rewind is not None:
        p = lineage.pending_rewind
        raise SkipError(f"a rewind to checkpoint {p.get('checkpoint')} is already recorded and not yet followed "
                        f"({p.get('reason') or 'no reason given'}): resume training first (python -m "
                        f"replay.reference.train --run {run.run_dir})")
    if stop <= start:
        raise SkipError(f"--steps {start}:{stop}: an empty window")
    if not lineage.first <= start < lineage.end:
        raise SkipError(f"--steps {start}:{stop}: step {start} is not a step of the run's lineage "
                        f"{lineage.first}:{lineage.end} (skip data the run trained on, from a step it reached)")
    windows = sorted((int(a), int(b)) for a, b in (run.config.get("skip_windows") or []))
    for a, b in windows:
        if start <= b:
            raise SkipError(f"--steps {start}:{stop}: the run already skips the data of steps {a}..{b}; a new "
                            f"window must start after step {b} (windows only append, in order)")
    ckpts = sorted(c for c in run.checkpoints if c <= start)
    if checkpoint is None:
        if not ckpts:
            raise SkipError(f"no checkpoint at or before step {start} to rewind to (checkpoints: {run.checkpoints})")
        checkpoint = ckpts[-1]
    elif checkpoint not in ckpts:
        raise SkipError(f"--checkpoint {checkpoint}: must be a checkpoint of the run at or before step {start}; "
                        f"those are {ckpts or 'none'}")
    return SkipRequest(start=start, stop=stop, checkpoint=int(checkpoint), reason=reason, lineage_end=lineage.end,
                       windows=tuple(windows + [(start, stop - 1)]))


def record(run: RunLog, req: SkipRequest, by: str = "replay skip") -> list[dict[str, Any]]:
    """Appends the ``skip_window`` and ``rewind`` events of ``req`` to the run's ``events.jsonl``;
    returns them."""
    current = run.lineage.current if run.lineage is not None else None
    rd = RunDir(run.run_dir, attempt=current.id if current is not None and current.index >= 0 else None)
    a = rd.event("skip_window", req.start, start=req.start, end=req.stop - 1, stop=req.stop,
                 checkpoint=req.checkpoint, reason=req.reason, by=by)
    b = rd.event("rewind", req.checkpoint, checkpoint=req.checkpoint, previous_end=req.lineage_end, kind="rewind",
                 skip=[req.start, req.stop], reason=req.reason, by=by)
    return [a, b]
