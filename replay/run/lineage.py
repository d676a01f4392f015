"""Attempts and lineage of a run directory: which attempt wrote each event and log line, and which
steps are the run's current history (DESIGN.md, "The run directory": "Attempts and lineage").

Pure functions over the event log (no JAX, no I/O but :func:`read_superseded`). Glossary::

    attempt a        one start or restore of the training loop, to its crash, kill or end; attempts
                     are numbered 1, 2, ... in the order of their ``start``/``restore`` events (the
                     trainer writes the number as ``attempt`` into every event it logs; an old run
                     directory without it is numbered the same way)
    r_a              the step attempt a starts at: 0 for ``start``, the restored checkpoint for
                     ``restore`` (a checkpoint labelled c holds the state *before* step c)
    e_a              the end (exclusive) of the steps attempt a trained
    cut              a restore at r (or a ``rewind`` to checkpoint r written by ``replay skip`` or a
                     rollback) cuts the history at r: steps >= r trained before it are abandoned
    lineage          the chain of steps that led to the current state: the half-open span
                     [first, end), each step attributed to the one attempt whose training of it
                     was never cut; attempt a's share is [r_a, min(e_a, cuts after a)), one interval
    superseded       steps trained by an attempt and cut afterwards: kept (the trainer moves their
                     log lines to ``superseded/`` and their checkpoints to
                     ``superseded/attempt-<b>/checkpoints/``, b being the attempt that cut them),
                     marked, and never mixed into the checks of the lineage

Example (the case of issue 20): attempt 1 trains 0..14, crashes; attempt 2 restores checkpoint 10
and trains 10..19; the user rolls back to checkpoint 5 (attempt 3), which trains on::

    attempt 1   [0 ............ 15)          lineage [0, 5), superseded [5, 15) by attempt 2 / 3
    attempt 2             [10 ........ 20)   lineage empty,  superseded [10, 20) by attempt 3
    attempt 3       [5 ....................  lineage [5, end)

Attempt 2's ``restore`` at step 10 and its loader stall at step 10 are not lineage events: a scan
of the lineage must neither explain a spike at step 11 by that restore nor miss a stall of attempt
3 at step 10.

Events of a run directory (``replay.run.protocol``) and how they are classified:

- ``start``, ``restore``: begin an attempt; a lineage event when the attempt has lineage steps
  (or is the current attempt).
- ``rewind`` (``replay skip``, or the trainer's ``--from-checkpoint``), ``skip_window`` (``replay
  skip``): requests, run-level: a rewind cuts the lineage at its checkpoint at once (the steps
  past it are superseded, pending until the next attempt restores it), and a requested skip
  window is in force for every later batch.
- every other event of attempt a at step s: a lineage event when ``lo_a <= s <= hi_a`` for its
  lineage share ``[lo_a, hi_a)`` (inclusive at ``hi_a``: a checkpoint, canary or phase change at the
  cut describes the state the next attempt restored).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

from replay.run.protocol import SUPERSEDED_DIR

ATTEMPT_EVENTS = ("start", "restore")
REQUEST_EVENTS = ("rewind", "skip_window")
RESTORE_KINDS = ("start", "resume", "rollback", "rewind")


class LineageError(ValueError):
    """A request on the lineage is impossible (e.g. a rewind past the lineage's end); names the values."""


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of a run (module docstring).

    Attributes:
      id: 1-based attempt number.
      start: ``r_a``, the first step it trained (0 for a fresh start).
      kind: ``"start"``; ``"resume"`` (restored the newest checkpoint of the lineage: only work
        after it was lost); ``"rollback"`` (restored an older checkpoint: a deliberate step back, or
        checkpoints moved aside by hand); ``"rewind"`` (requested by ``replay skip`` or
        ``--from-checkpoint``).
      trained_end: ``e_a``, the end (exclusive) of the steps it trained, or None when the log cannot
        tell (a run directory written before attempts were recorded, for an attempt that was cut).
      lineage: ``(lo, hi)``, its share of the lineage, half-open (``lo >= hi``: none).
      superseded: ``(lo, hi)`` of its steps cut afterwards, or None (none, or unknown).
      superseded_by: the attempt whose restore cut them, 0 for a pending rewind (no attempt has
        restored it yet), None when nothing was cut.
      event: its ``start``/``restore`` event.
      index: position of that event in the event log.
      cuts: ``(step, attempt)`` of each cut that reached it, in log order (attempt 0: a pending
        rewind); step ``s`` of its superseded steps was cut by the first cut at or before ``s``.
    """

    id: int
    start: int
    kind: str
    trained_end: Optional[int]
    lineage: tuple[int, int]
    superseded: Optional[tuple[int, int]]
    superseded_by: Optional[int]
    event: Mapping[str, Any]
    index: int
    cuts: tuple[tuple[int, int], ...] = ()

    def cut_of(self, step: int) -> Optional[int]:
        """The attempt whose cut superseded this attempt's ``step`` (0: a pending rewind), or None
        when ``step`` is not one of its superseded steps."""
        if self.superseded is None or not self.superseded[0] <= step < self.superseded[1]:
            return None
        for at, by in self.cuts:
            if at <= step:
                return by
        return None

    @property
    def lineage_steps(self) -> int:
        return max(0, self.lineage[1] - self.lineage[0])

    @property
    def superseded_steps(self) -> Optional[int]:
        if self.superseded is None:
            return 0 if self.trained_end is not None else None
        return self.superseded[1] - self.superseded[0]

    def to_dict(self) -> dict[str, Any]:
        return {"attempt": self.id, "start": self.start, "kind": self.kind, "trained_end": self.trained_end,
                "lineage": list(self.lineage) if self.lineage_steps else None,
                "superseded": None if self.superseded is None else list(self.superseded),
                "superseded_by": self.superseded_by, "cuts": [list(c) for c in self.cuts]}


@dataclasses.dataclass(frozen=True)
class Lineage:
    """The attempts of a run and its current lineage (module docstring).

    Attributes:
      attempts: every attempt, in order.
      first, end: the lineage is the steps ``[first, end)``.
      events: the lineage's events, in log order (superseded events left out; requests kept).
      superseded_events: the events of superseded steps, in log order.
      requests: ``rewind`` and ``skip_window`` events, in log order.
      pending_rewind: the last ``rewind`` request not yet followed by an attempt, or None.
      skip_windows: the data windows requested by ``skip_window`` events, ``(start, end)``
        inclusive, in request order.
    """

    attempts: tuple[Attempt, ...]
    first: int
    end: int
    events: tuple[Mapping[str, Any], ...]
    superseded_events: tuple[Mapping[str, Any], ...]
    requests: tuple[Mapping[str, Any], ...]
    pending_rewind: Optional[Mapping[str, Any]]
    skip_windows: tuple[tuple[int, int], ...]

    @property
    def current(self) -> Optional[Attempt]:
        """The last attempt, or None (no start event)."""
        return self.attempts[-1] if self.attempts else None

    def attempt_of(self, step: int) -> Optional[int]:
        """The attempt that trained lineage step ``step``, or None (not a lineage step)."""
        if not self.first <= step < self.end:
            return None
        for a in reversed(self.attempts):
            lo, hi = a.lineage
            if lo <= step < hi:
                return a.id
        return None

    def restarts(self) -> list[int]:
        """The steps at which lineage attempts began (their first step waits for the pipeline to fill)."""
        return [a.start for a in self.attempts if a.lineage_steps > 0 or a is self.current]

    def next_attempt(self) -> int:
        """The number the next start or restore takes."""
        return max((a.id for a in self.attempts if a.index >= 0), default=0) + 1

    def writer_of(self, step: int) -> Optional[int]:
        """The attempt whose line of ``step`` the step log holds: the last attempt that trained it (None:
        none did). What a restore tags the lines it moves to ``superseded/`` with."""
        for a in reversed(self.attempts):
            end = a.trained_end if a.trained_end is not None else self.end
            if a.start <= step < max(end, a.lineage[1]):
                return a.id
        return None

    def checkpoint_steps(self) -> list[int]:
        """The steps of the lineage's ``checkpoint`` events, in log order."""
        return [int(e["step"]) for e in self.events if e.get("event") == "checkpoint" and isinstance(e.get("step"), int)]

    def superseded_spans(self) -> list[dict[str, Any]]:
        """Every superseded span: ``{"attempt", "steps": [lo, hi), "cut_by": attempt (0: pending rewind),
        "kind": the cutting attempt's kind ("resume", "rollback", "rewind"; "rewind" when pending)}``."""
        by_id = {a.id: a for a in self.attempts}
        out = []
        for a in self.attempts:
            if a.superseded is None:
                continue
            bound = a.superseded[1]
            for at, by in a.cuts:
                if at < bound:
                    lo = max(at, a.superseded[0])
                    if lo < bound:
                        kind = "rewind" if by == 0 else by_id[by].kind if by in by_id else "resume"
                        out.append({"attempt": a.id, "steps": [lo, bound], "cut_by": by, "kind": kind})
                    bound = at
        return out

    def describe(self) -> list[str]:
        """One sentence per superseded span, e.g. ``steps 10:20 of attempt 2 (resume from checkpoint
        10, trained to step 20) are superseded: attempt 3 rolled back to checkpoint 5``."""
        by_id = {a.id: a for a in self.attempts}
        out = []
        for a in self.attempts:
            if a.trained_end is None and a.cuts:
                out.append(f"attempt {a.id} ({_began(a)}) was cut at step {a.cuts[0][0]}; how far it trained "
                           "is not recorded (a run directory from before attempts were logged)")
        for sp in self.superseded_spans():
            a = by_id[sp["attempt"]]
            lo, hi = sp["steps"]
            if sp["cut_by"] == 0:
                p = self.pending_rewind or {}
                why = (f"a rewind to checkpoint {p.get('checkpoint')} was requested"
                       + (f" ({p.get('reason')})" if p.get("reason") else "") + "; the next training run resumes there")
            else:
                b = by_id.get(sp["cut_by"])
                verb = {"resume": "resumed from", "rollback": "rolled back to", "rewind": "rewound to"}.get(
                    b.kind if b else "", "restored")
                why = f"attempt {sp['cut_by']} {verb} checkpoint {b.start if b else '?'}"
            out.append(f"steps {lo}:{hi} of attempt {a.id} ({_began(a)}, trained to step {a.trained_end}) are "
                       f"superseded: {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "end": self.end, "attempts": [a.to_dict() for a in self.attempts],
                "pending_rewind": None if self.pending_rewind is None else dict(self.pending_rewind),
                "skip_windows_requested": [list(w) for w in self.skip_windows],
                "superseded": self.superseded_spans(), "superseded_events": len(self.superseded_events),
                "cuts": self.describe()}


def _began(a: Attempt) -> str:
    return "started at step 0" if a.kind == "start" else f"{a.kind} from checkpoint {a.start}"


def _int(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def event_attempts(events: Sequence[Mapping[str, Any]]) -> list[Optional[int]]:
    """The attempt of each event: the number of ``start``/``restore`` events up to and including it
    (``None`` before the first), or the event's own ``attempt`` field on a start or restore."""
    out: list[Optional[int]] = []
    current: Optional[int] = None
    seen = 0
    for e in events:
        if e.get("event") in ATTEMPT_EVENTS:
            seen += 1
            current = _int(e.get("attempt")) or max(seen, (current or 0) + 1)
        out.append(current)
    return out


def build_lineage(events: Sequence[Mapping[str, Any]], logged_end: Optional[int], *, logged_first: int = 0,
                  trained_ends: Optional[Mapping[int, int]] = None) -> Lineage:
    """The attempts and lineage of a run from its event log (module docstring).

    Args:
      events: ``events.jsonl`` in log order (dicts with ``event`` and ``step``).
      logged_end: one past the last step of the step logs (``fingerprints.jsonl``), which hold the
        lineage (the trainer moves superseded lines aside); None when nothing is logged.
      logged_first: the first logged step (0 for a run trained from step 0).
      trained_ends: per attempt, one past the last step it logged (from ``superseded/`` files):
        the exact extent of a cut attempt's superseded steps.

    Returns:
      The :class:`Lineage`. A log without a start event (hand-made logs, a user's trainer that
      logs none) gets one attempt from ``logged_first``.

    How far a cut attempt trained comes from, in this order: ``trained_ends``; the ``previous_end``
    that the cutting restore or rewind recorded; for an old run directory, a restore that dropped no
    line (``dropped_fingerprint_lines: 0``: it trained exactly to the restored step); else unknown.
    """
    known = dict(trained_ends or {})
    ids = event_attempts(events)
    heads: dict[int, dict[str, Any]] = {}  # attempt -> start, kind, index, event, lo, hi, end, cut_by
    order: list[int] = []
    open_head: Optional[int] = None  # the attempt still training (its lineage share has no end yet)
    pending = None
    windows: list[tuple[int, int]] = []
    requests = []
    newest_ckpt = None  # newest lineage checkpoint so far (an old restore older than it: a rollback)

    def close_head(at: int, previous_end: Optional[int]) -> None:
        nonlocal open_head
        if open_head is None:
            return
        h = heads[open_head]
        h["hi"] = previous_end if previous_end is not None else max(at, h["lo"])
        if h["end"] is None and previous_end is not None:
            h["end"] = previous_end
        open_head = None

    def cut(at: int, by: int) -> None:
        for a in order:
            h = heads[a]
            reach = max(h["hi"], h["end"] if h["end"] is not None else h["hi"])
            bound = min([c[0] for c in h["cuts"]] + [reach])
            if at < bound:  # a cut at or past an earlier one takes nothing more
                h["hi"] = min(h["hi"], at)
                h["cuts"].append([at, by])

    for i, e in enumerate(events):
        kind, step = e.get("event"), _int(e.get("step"))
        if step is None:
            continue
        if kind in ATTEMPT_EVENTS:
            prev = _int(e.get("previous_end"))
            if prev is None and _int(e.get("dropped_fingerprint_lines")) == 0:
                prev = step
            close_head(step, prev)
            a = ids[i]
            for h in heads.values():  # a pending rewind's cut is now this attempt's
                for c in h["cuts"]:
                    if c[1] == 0:
                        c[1] = a
            rkind = _attempt_kind(e, step, pending is not None, newest_ckpt)
            cut(step, a)
            pending = None
            heads[a] = {"start": step, "kind": rkind, "index": i, "event": e, "lo": step, "hi": step,
                        "end": known.get(a), "cuts": []}
            order.append(a)
            open_head = a
            if newest_ckpt is not None and newest_ckpt > step:
                newest_ckpt = step
        elif kind == "rewind":
            requests.append(e)
            c = _int(e.get("checkpoint"))
            c = step if c is None else c
            close_head(c, _int(e.get("previous_end")) if _int(e.get("previous_end")) is not None else logged_end)
            cut(c, 0)
            pending = e
        elif kind == "skip_window":
            requests.append(e)
            lo, hi = _int(e.get("start")), _int(e.get("end"))
            if lo is not None and hi is not None and (lo, hi) not in windows:
                windows.append((lo, hi))
        elif kind == "checkpoint" and (newest_ckpt is None or step > newest_ckpt):
            newest_ckpt = step
    if not order:  # no start event: one attempt over the logged steps
        heads[1] = {"start": logged_first, "kind": "start", "index": -1, "event": {}, "lo": logged_first,
                    "hi": logged_first, "end": known.get(1), "cuts": []}
        order.append(1)
        open_head = 1
    if open_head is not None:
        h = heads[open_head]
        h["hi"] = max(h["lo"], logged_end if logged_end is not None else h["lo"])
        h["end"] = h["hi"] if h["end"] is None else max(h["end"], h["hi"])
    attempts = [_attempt_of(a, heads[a]) for a in order]
    shares = [a.lineage for a in attempts if a.lineage[1] > a.lineage[0]]
    first = min((lo for lo, _ in shares), default=logged_first)
    end = max((hi for _, hi in shares), default=attempts[-1].start)
    lin_events, sup_events = classify_events(events, ids, attempts)
    return Lineage(attempts=tuple(attempts), first=first, end=end, events=tuple(lin_events),
                   superseded_events=tuple(sup_events), requests=tuple(requests), pending_rewind=pending,
                   skip_windows=tuple(windows))


def _attempt_kind(e: Mapping[str, Any], step: int, pending: bool, newest_ckpt: Optional[int]) -> str:
    """What a ``start`` or ``restore`` event (at ``step``) began: ``start``; the restore's own ``reason`` when it is one
    of :data:`RESTORE_KINDS`; else ``rewind`` after a pending rewind, ``rollback`` to a checkpoint older
    than the newest of the lineage, or ``resume``."""
    why = e.get("reason")
    if e.get("event") == "start":
        return "start"
    if why in RESTORE_KINDS:
        return why
    if pending:
        return "rewind"
    if newest_ckpt is not None and step < newest_ckpt:
        return "rollback"
    return "resume"


def _attempt_of(a: int, h: Mapping[str, Any]) -> Attempt:
    """Attempt ``a`` from its head record (:func:`build_lineage`): its lineage share, superseded span and cuts."""
    lo, hi = h["lo"], h["hi"]
    share_end = hi if hi > lo else h["start"]
    sup = (share_end, h["end"]) if h["end"] is not None and h["end"] > share_end else None
    cuts = tuple((int(at), int(by)) for at, by in h["cuts"])
    by = cuts[0][1] if cuts and (sup is not None or h["end"] is None) else None
    return Attempt(id=a, start=h["start"], kind=h["kind"], trained_end=h["end"], lineage=(lo, hi),
                   superseded=sup, superseded_by=by, event=h["event"], index=h["index"], cuts=cuts)


def classify_events(events: Sequence[Mapping[str, Any]], ids: Sequence[Optional[int]],
                    attempts: Sequence[Attempt]) -> tuple[list, list]:
    """``(lineage events, superseded events)`` (module docstring: the rules per kind of event)."""
    by_id = {a.id: a for a in attempts}
    last = attempts[-1].id if attempts else None
    lin, sup = [], []
    for e, a in zip(events, ids):
        kind, step = e.get("event"), _int(e.get("step"))
        att = by_id.get(a) if a is not None else (attempts[0] if attempts else None)
        if kind in REQUEST_EVENTS or step is None or att is None:
            lin.append(e)
            continue
        lo, hi = att.lineage
        if kind in ATTEMPT_EVENTS:
            keep = hi > lo or att.id == last
        else:
            keep = lo <= step <= hi and (hi > lo or att.id == last)
        (lin if keep else sup).append(e)
    return lin, sup


# ----------------------------------------------------------------------------- superseded files


def superseded_path(run_dir: str, name: str) -> str:
    """``<run_dir>/superseded/<name>``: the step-log lines of superseded steps (each with ``attempt``,
    the attempt that wrote it, and ``superseded_by``)."""
    return os.path.join(run_dir, SUPERSEDED_DIR, name)


def read_superseded(run_dir: str, name: str) -> list[dict[str, Any]]:
    """The superseded lines of step log ``name`` (e.g. ``fingerprints.jsonl``), each once: a line
    moved twice (a kill between the copy and the truncation of the step log) counts once.

    A torn or unparsable line is skipped (these files are history, never judged).
    """
    path = superseded_path(run_dir, name)
    if not os.path.exists(path):
        return []
    out, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                key = (int(d["step"]), d.get("attempt"), d.get("superseded_by"), d.get("device"))
            except (ValueError, KeyError, TypeError):
                continue
            if key in seen:
                continue
            seen.add(key)
            out.append(d)
    return out


def superseded_trained_ends(lines: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Per attempt, one past the last step it logged among ``lines`` (superseded lines with ``attempt``)."""
    out: dict[int, int] = {}
    for d in lines:
        a, s = _int(d.get("attempt")), _int(d.get("step"))
        if a is not None and s is not None:
            out[a] = max(out.get(a, 0), s + 1)
    return out


def lineage_of_run(run_dir: str, events: Sequence[Mapping[str, Any]], logged_steps: Iterable[int]) -> Lineage:
    """:func:`build_lineage` for a run directory: the logged span of its step log and the trained ends
    of cut attempts from ``superseded/fingerprints.jsonl``.

    A cut attempt that was the lineage's head logged up to the step it was cut at plus what was moved
    aside; the lineage steps of an attempt that is not the head are all before the cut.
    """
    steps = sorted(logged_steps)
    sup = read_superseded(run_dir, "fingerprints.jsonl")
    ends = superseded_trained_ends(sup)
    return build_lineage(events, steps[-1] + 1 if steps else None, logged_first=steps[0] if steps else 0,
                         trained_ends=ends or None)


def resume_checkpoint(lineage: Lineage, checkpoints: Sequence[int]) -> Optional[int]:
    """The checkpoint the next attempt starts from: the one a pending rewind names, else the newest of
    ``checkpoints`` (the run's committed checkpoints, ascending); None: a new run.

    Raises:
      LineageError: the pending rewind names no committed checkpoint.
    """
    pending = lineage.pending_rewind
    if pending is None:
        return checkpoints[-1] if checkpoints else None
    checkpoint = int(pending.get("checkpoint", pending["step"]))
    if checkpoint not in checkpoints:
        raise LineageError(f"the rewind to checkpoint {checkpoint} that was recorded ({pending.get('by', 'replay skip')})"
                           f" names no committed checkpoint (checkpoints: {list(checkpoints)})")
    return checkpoint


def validate_rewind(lineage: Lineage, checkpoint: int, checkpoints: Sequence[int]) -> None:
    """Raises :class:`LineageError` unless ``checkpoint`` is a checkpoint of the lineage: present in
    ``checkpoints`` and at or before the lineage's end."""
    if checkpoint not in checkpoints:
        raise LineageError(f"checkpoint {checkpoint}: not a checkpoint of the run (checkpoints: "
                           f"{list(checkpoints) or 'none'})")
    if checkpoint > lineage.end:
        raise LineageError(f"checkpoint {checkpoint} is past the lineage's end {lineage.end} (it belongs to "
                           "superseded steps)")
