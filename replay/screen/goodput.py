"""``replay goodput``: where a run's wall time and tokens went, from its own log, to the step and the token.

The training loop is the recorder (ml-goodput-measurement's split: recorder, calculator, monitor):
it writes timestamps and durations into the run directory (``replay.run.protocol``: every event's
``t``; each start or restore event's ``launched_at`` and ``restore_s``; each step's ``t``,
``step_time_s``, ``compile_s``, ``loader_wait_s``, ``canary_s``, ``checkpoint_s`` and ``tokens`` in
``signals.jsonl``, superseded steps' lines kept in ``superseded/``; the end event's
``final_save_s``). This module is the calculator. It never measures anything itself.

Time. The wall time runs from the first attempt's launch to the last record of the last attempt.
Every instant of it belongs to exactly one part, computed in integer microseconds so that the
parts add up to the wall time exactly::

    launch ──start-up── start/restore event ──step─step─ ... ─step──tail── last record ──gap── next launch
                (restore_s: restore)           each step's interval, from the previous record's t:
                                               loader wait + canary + compile + step compute
                                               + checkpoint save stall + other (the remainder)

    part             what                                               ml-goodput-measurement
    productive       step compute of the lineage's steps                 goodput
    non_finite       lineage steps whose loss was NaN/Inf (badput)       (ours)
    startup          launch to the first step, restores excepted         TPU_INITIALIZATION + TRAINING_PREP
    compile          JAX tracing, lowering, compilation inside steps     PROGRAM_STARTUP
    checkpoint_save  the loop blocked by checkpoint saves                UNPRODUCTIVE_CHECKPOINT_SAVE_TIME
    restore          checkpoint restores                                 UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME
    lost             steps trained, then lost to a crash (resumed)       WASTED_PROGRESS_FROM_DISRUPTION
    rewound          steps abandoned by a rollback or rewind             (ours: a deliberate step back)
    skipped_window   steps trained on data later skipped                 (ours)
    loader_wait      the step waited for its batch                       DATA_LOADING_SYNC
    canary           the periodic canary                                 CUSTOM_BADPUT_EVENTS
    gap              between attempts: scheduling, crash detection, and  INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION
                     an attempt's work after its last record
    other            the loop's own host time (logging, bookkeeping)     OTHER
    unknown          a stretch the log has no timestamps for (an old     -
                     run directory, a trainer that logs no timings)

Clocks. Attempts may run on machines whose clocks disagree. An attempt launched before the previous
attempt's last record (its clock behind, or the two overlapping) is reported as clocks that
disagree, by how much and which attempt, and its times are counted from the previous attempt's last
record (the gap between them unknown); a step stamped before the record before it takes no time; a
step whose logged durations exceed its interval has each part cut to the interval (in the order
compute, loader wait, canary, compile, save stall), the excess reported. So every part is >= 0, and
:func:`audit` checks that, and that the parts add up to the wall time, independently of the split.

Compute of a superseded step counts as lost, rewound or skipped_window by the cut that abandoned
it (``replay.run.lineage``: a resume, a rollback or rewind, and a rewind's requested window);
its loader wait, canary, compile and save stalls keep their own parts.

Tokens. Every trained step is one global batch of ``B`` rows of ``L`` slots (``tokens_per_step``,
logged by the trainer: rows x seq_len). Trained steps split the same way: the lineage's, lost,
rewound, trained on a later-skipped window; plus the data the lineage skipped (rows never
trained). They reconcile with the loader's arithmetic (``loader.index.data_step``): the lineage's
steps and the skipped data steps are exactly the data steps ``[first, data_step(end - 1) + 1)``.
Non-padding tokens come from each step's logged ``tokens`` (unknown where not logged).

Program goodput (MFU): model FLOPs per step (the trainer logs ``flops_per_step``: 6 x active
parameters x tokens for the reference model, Kaplan et al. 2020) over the step's compute time,
the device count and the devices' peak FLOP/s (``--peak-flops``, or :data:`PEAK_FLOPS` by device
kind; on CPU an illustrative nominal figure, said so).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from replay.run.lineage import Attempt
from replay.run.runlog import RunDirError, RunLog

PARTS = ("productive", "non_finite", "startup", "compile", "checkpoint_save", "restore", "lost", "rewound", "skipped_window",
         "loader_wait", "canary", "gap", "other", "unknown")
PART_TEXT = {
    "productive": "productive step compute of the lineage",
    "non_finite": "steps of the lineage with a non-finite loss (NaN/Inf: nothing learned)",
    "startup": "start-up (launch to first step, restores excepted)",
    "compile": "compilation inside steps",
    "checkpoint_save": "checkpoint save stalls",
    "restore": "checkpoint restores",
    "lost": "lost work: steps redone after a crash",
    "rewound": "rewound work: steps abandoned by a rollback or rewind",
    "skipped_window": "steps trained on data later skipped",
    "loader_wait": "input wait (the step waited for its batch)",
    "canary": "canary",
    "gap": "gaps between attempts",
    "other": "other host time in the loop",
    "unknown": "not recorded (no timestamps)",
}
GOODPUT_KIND = {  # ml-goodput-measurement's BadputType for each part (docs/replay.md maps them)
    "productive": "goodput", "non_finite": "(ours; CUSTOM_BADPUT_EVENTS is the nearest)", "startup": "TPU_INITIALIZATION + TRAINING_PREP", "compile": "PROGRAM_STARTUP",
    "checkpoint_save": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME", "restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "lost": "WASTED_PROGRESS_FROM_DISRUPTION", "rewound": "(ours; WASTED_PROGRESS_FROM_DISRUPTION is the nearest)",
    "skipped_window": "(ours)", "loader_wait": "DATA_LOADING_SYNC", "canary": "CUSTOM_BADPUT_EVENTS",
    "gap": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "other": "OTHER", "unknown": "-"}
STEP_PARTS = ("productive", "non_finite", "lost", "rewound", "skipped_window")
REQUESTS = ("rewind", "skip_window")
# Peak dense FLOP/s per device (bf16 unless said), from the vendors' data sheets; a device kind not
# listed needs --peak-flops. "cpu" is a nominal figure so that the demo shows the arithmetic: an
# XLA CPU device is a share of a host's cores, and its MFU is illustrative only.
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
              "TPU v6 lite": 918e12, "TPU v6e": 918e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12,
              "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "cpu": 5e10}


DESIGN_MTBF_S = 8800.0
DESIGN_MTBF_TEXT = ("the seed's design point: 17,920 chips at a per-chip MTBF of about 5 years, a fleet MTBF of "
                    "about 8,800 s")
CLOCK_TOLERANCE_US = 1000  # a step's logged durations may exceed its interval by this (rounding) unreported


class GoodputError(RunDirError):
    """The log holds nothing to account for (no attempt)."""


def _us(x: Any) -> int:
    return int(round(float(x) * 1_000_000))


def _iso_us(text: Any) -> Optional[int]:
    """Microseconds since the epoch of an event's ISO ``time``, or None."""
    import datetime

    try:
        return _us(datetime.datetime.fromisoformat(str(text)).timestamp())
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass
class GoodputReport:
    """What ``replay goodput`` found (``to_dict`` is the JSON report).

    Attributes:
      wall_us: the wall time in microseconds; time_us: per part (:data:`PARTS`), microseconds,
        summing to ``wall_us`` exactly; steps, tokens: per step part (:data:`STEP_PARTS` and
        ``skipped_data``), trained steps and slot tokens; nonpad_tokens: per step part, non-padding
        tokens (None: not logged); reconcile: the loader arithmetic's check; mfu: program goodput;
        attempts: per attempt its span and parts; unknown: why each unknown stretch is unknown;
        young: the checkpoint interval check (:func:`_young`); clocks: where the clocks disagree, a
        dict each (``attempt``, by how much, ``what`` in words); timeline: (time s, cumulative productive s, kind) for
        the picture; events: (time s, event, step) of restores and rewinds.
    """

    run_dir: str
    wall_us: int
    time_us: dict[str, int]
    steps: dict[str, int]
    tokens: dict[str, int]
    nonpad_tokens: dict[str, Optional[int]]
    reconcile: dict[str, Any]
    mfu: dict[str, Any]
    attempts: list[dict[str, Any]]
    unknown: list[str]
    young: dict[str, Any]
    input: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeline: list[tuple[float, float]] = dataclasses.field(default_factory=list, repr=False)
    events: list[tuple[float, str, int]] = dataclasses.field(default_factory=list, repr=False)
    clocks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """:func:`audit` of the time split (empty: every part >= 0 and they add up to the wall time)."""
        return audit(self.time_us, self.wall_us)

    @property
    def goodput(self) -> float:
        """Productive time over wall time (0 to 1)."""
        return self.time_us["productive"] / self.wall_us if self.wall_us else math.nan

    @property
    def token_goodput(self) -> float:
        """The lineage's tokens over every token trained (0 to 1)."""
        trained = sum(self.tokens[p] for p in STEP_PARTS)
        return self.tokens["productive"] / trained if trained else math.nan

    def to_dict(self) -> dict[str, Any]:
        wall = self.wall_us
        return {
            "kind": "goodput", "run": self.run_dir, "wall_s": wall / 1e6,
            "goodput": round(self.goodput, 6) if wall else None,
            "token_goodput": round(self.token_goodput, 6) if not math.isnan(self.token_goodput) else None,
            "time": {p: {"s": self.time_us[p] / 1e6, "us": self.time_us[p],
                         "share": round(self.time_us[p] / wall, 6) if wall else None, "what": PART_TEXT[p],
                         "ml_goodput_measurement": GOODPUT_KIND[p]} for p in PARTS},
            "time_adds_up": not self.problems, "problems": self.problems, "clocks": list(self.clocks),
            "steps": dict(self.steps), "tokens": dict(self.tokens), "nonpad_tokens": dict(self.nonpad_tokens),
            "reconcile": self.reconcile, "mfu": self.mfu, "attempts": self.attempts, "unknown": self.unknown,
            "young": self.young, "input": self.input,
        }


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass
class _Step:
    step: int
    attempt: int
    t: Optional[float]
    step_s: Optional[float]
    wait_s: Optional[float]
    compile_s: Optional[float]
    canary_s: Optional[float]
    checkpoint_s: Optional[float]
    tokens: Optional[int]
    stages: Optional[dict[str, float]] = None  # loader_wait_stages: where the wait went
    occupancy: Optional[int] = None  # loader_occupancy: batches ready at the ask


def _step_of(d: Mapping[str, Any], attempt: int) -> _Step:
    def f(k):
        v = d.get(k)
        return None if v is None else float(v)

    tok = d.get("tokens")
    return _Step(step=int(d["step"]), attempt=attempt, t=f("t"), step_s=f("step_time_s"), wait_s=f("loader_wait_s"),
                 compile_s=f("compile_s"), canary_s=f("canary_s"), checkpoint_s=f("checkpoint_s"),
                 tokens=None if tok is None else int(tok),
                 stages={str(k): float(v) for k, v in d["loader_wait_stages"].items()}
                 if isinstance(d.get("loader_wait_stages"), dict) else None,
                 occupancy=None if d.get("loader_occupancy") is None else int(d["loader_occupancy"]))


def _steps_by_attempt(run: RunLog) -> dict[int, list[_Step]]:
    """Each attempt's logged steps (lineage lines attributed by the lineage, superseded lines by their tag)."""
    import json

    from replay.run import lineage as lin
    from replay.run.protocol import SIGNALS_NAME

    out: dict[int, dict[int, _Step]] = {}
    path = os.path.join(run.run_dir, SIGNALS_NAME)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:  # was: a traceback (scan and triage name the file)
            raise GoodputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): corrupted?") from None
        # A malformed line (a value of the wrong type, say) is the same error as in scan and triage;
        # was: a ValueError traceback from _step_of. A torn last line passes that check and is skipped.
        from replay.screen.scan import read_screening_logs

        read_screening_logs(run.run_dir)
        for line in text.split("\n"):
            try:
                d = json.loads(line)
                s = int(d["step"])
                a = run.lineage.attempt_of(s)
                if a is None:  # past a pending rewind: the lines of the head attempt, superseded
                    a = run.lineage.current.id
                step = _step_of(d, a)
            except (ValueError, KeyError, TypeError):
                continue
            out.setdefault(a, {})[s] = step
    for d in lin.read_superseded(run.run_dir, SIGNALS_NAME):
        a = d.get("attempt")
        try:
            step = _step_of(d, a) if isinstance(a, int) else None
        except (ValueError, KeyError, TypeError):  # history, never judged: skipped as read_superseded skips
            continue
        if step is not None:
            out.setdefault(a, {}).setdefault(step.step, step)
    return {a: [v[s] for s in sorted(v)] for a, v in out.items()}


# ----------------------------------------------------------------------------- calculator


def non_finite_steps(run: RunLog) -> frozenset[int]:
    """Lineage steps whose logged loss is NaN or Inf: trained, but nothing was learned (their own badput
    part, ``non_finite``, never goodput)."""
    return frozenset(s for s, fp in run.fingerprints.items()
                     if not math.isfinite(float(np.asarray(fp.loss_bits, np.uint32).view(np.float32))))


def step_part(run: RunLog, attempt_id: int, step: int, non_finite: frozenset[int] = frozenset()) -> str:
    """The part a step's compute belongs to (module docstring); ``non_finite``: :func:`non_finite_steps`."""
    lineage = run.lineage
    if lineage.attempt_of(step) == attempt_id:
        return "non_finite" if step in non_finite else "productive"
    att = next(a for a in lineage.attempts if a.id == attempt_id)
    by = att.cut_of(step)
    if by is None:
        return "rewound" if lineage.pending_rewind is not None else "lost"
    kind = "rewind" if by == 0 else next((a.kind for a in lineage.attempts if a.id == by), "resume")
    if kind == "resume":
        return "lost"
    if any(a <= step <= b for a, b in lineage.skip_windows):
        return "skipped_window"
    return "rewound"


@dataclasses.dataclass
class _Books:
    """What :func:`account` has summed so far, attempt by attempt (microseconds on the first attempt's
    clock, counted from ``t_first``; the lists are :class:`GoodputReport`'s)."""

    time_us: dict[str, int] = dataclasses.field(default_factory=lambda: {p: 0 for p in PARTS})
    unknown: list[str] = dataclasses.field(default_factory=list)
    attempts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    timeline: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    marks: list[tuple[float, str, int]] = dataclasses.field(default_factory=list)
    clocks: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # module docstring: "Clocks"
    step_compute: dict[int, int] = dataclasses.field(default_factory=dict)  # lineage step -> compute us (MFU)
    t_first: Optional[int] = None
    prev_last: Optional[int] = None  # the previous attempt's last record
    prev_id: Optional[int] = None
    untimed: Optional[int] = None  # an attempt before this one whose time is not recorded
    productive_so_far: int = 0


def account(run: RunLog, *, peak_flops: Optional[float] = None, mtbf_s: Optional[float] = None) -> GoodputReport:
    """The goodput of ``run`` (module docstring).

    Args:
      run: a loaded run directory (its lineage: ``RunLog.lineage``).
      peak_flops: peak FLOP/s of one device (default: :data:`PEAK_FLOPS` by the env.json device kind).
      mtbf_s: the fleet's mean time between failures for Young's interval, seconds (default: the run
        config's ``mtbf_s``, else :data:`DESIGN_MTBF_S`, the seed's design point).

    Raises:
      GoodputError: the log has no attempt to account for, or the MTBF is not a number > 0.
    """
    lineage = run.lineage
    attempts = [a for a in lineage.attempts if a.index >= 0]
    if not attempts:
        raise GoodputError(f"{run.run_dir}: no start or restore event: nothing to account for")
    from replay.run.lineage import event_attempts

    events = run.all_events
    ids = event_attempts(events)
    per_steps = _steps_by_attempt(run)
    bad = non_finite_steps(run)
    books = _Books()
    for a in attempts:
        _account_attempt(books, run, a, events, ids, per_steps.get(a.id, []), bad)
    for e in lineage.requests:
        if isinstance(e.get("t"), (int, float)) and books.t_first is not None:
            books.marks.append(((_us(e["t"]) - books.t_first) / 1e6, e.get("event", "?"), int(e.get("step", 0))))
    if books.t_first is None:  # nothing timed (a run directory from before timings were logged): the events' clock
        _untimed_wall(books, events)
    t_first, prev_last, time_us = books.t_first, books.prev_last, books.time_us
    wall = (prev_last - t_first) if t_first is not None and prev_last is not None else 0
    steps, tokens, nonpad, rec = _ledger(run, per_steps, bad)
    return GoodputReport(run_dir=run.run_dir, wall_us=wall, time_us=time_us, steps=steps, tokens=tokens,
                         nonpad_tokens=nonpad, reconcile=rec, mfu=_mfu(run, books.step_compute, peak_flops),
                         attempts=books.attempts, unknown=books.unknown, young=_young(run, time_us, mtbf_s),
                         timeline=books.timeline, events=books.marks, clocks=books.clocks,
                         input=input_wait(per_steps, time_us["loader_wait"]))


def _account_attempt(books: _Books, run: RunLog, a: Attempt, events: Sequence[Mapping[str, Any]],
                     ids: Sequence[Optional[int]], steps: Sequence[_Step], bad: frozenset[int]) -> None:
    """Adds attempt ``a`` (``steps``: its lines of signals.jsonl; ``ids``: each event's attempt) to
    ``books``: the gap before it, its start-up and restore, its steps' parts and its tail."""
    ev = a.event
    parts = {p: 0 for p in PARTS}
    if ev.get("t") is None:
        books.unknown.append(f"attempt {a.id}: its {ev.get('event')} event has no 't' (a run directory from before "
                             "timings were logged): its time is not split, and lies in the unknown part")
        books.attempts.append({"attempt": a.id, "kind": a.kind, "start": a.start, "split": False})
        books.untimed = a.id
        return
    begin, shift, t0_us = _attempt_start(books, a, parts)
    books.marks.append(((begin - (books.t_first or begin)) / 1e6, ev.get("event", "?"), a.start))
    cursor, split = _attempt_steps(books, run, a.id, steps, shift, t0_us, parts, bad)
    # an attempt's own records: requests (a rewind, a skip window) are written by a command or by
    # the next attempt's start-up, not by this attempt's work
    mine = [e for e, i in zip(events, ids) if i == a.id and e.get("event") not in REQUESTS]
    ends = [e for e in mine if e.get("event") in ("end", "stopped") and isinstance(e.get("t"), (int, float))]
    tail_end = max([cursor] + [_us(e["t"]) + shift for e in mine if isinstance(e.get("t"), (int, float))])
    if not split:
        parts["unknown"] += tail_end - cursor
    else:
        final = min(sum(_us(e.get("final_save_s") or 0) for e in ends), max(0, tail_end - cursor))
        parts["checkpoint_save"] += final
        parts["other"] += tail_end - cursor - final
    for p in PARTS:
        books.time_us[p] += parts[p]
    books.prev_last, books.prev_id = tail_end, a.id
    t_first = books.t_first
    books.attempts.append({"attempt": a.id, "kind": a.kind, "start": a.start, "trained_end": a.trained_end,
                           "lineage": list(a.lineage) if a.lineage_steps else None, "split": split,
                           "begin_s": (begin - t_first) / 1e6, "end_s": (tail_end - t_first) / 1e6,
                           "clock_shift_s": shift / 1e6,
                           "ended": bool(ends), "time_s": {p: parts[p] / 1e6 for p in PARTS if parts[p]}})


def _attempt_start(books: _Books, a: Attempt, parts: dict[str, int]) -> tuple[int, int, int]:
    """The gap before attempt ``a`` (timed: its start or restore event has a ``t``), its restore and its
    start-up, added to ``parts``. Returns ``(begin, shift, t0)`` in microseconds: its launch, what its clock
    is moved by (a launch before the previous attempt's last record), and its start or restore event's time."""
    ev = a.event
    launched = ev.get("launched_at")
    t0 = ev.get("t")
    prev_last, prev_id, untimed = books.prev_last, books.prev_id, books.untimed
    begin = _us(launched) if launched is not None else _us(t0)
    shift = 0  # microseconds added to this attempt's clock (its launch before the previous record)
    if prev_last is not None and begin < prev_last:
        shift = prev_last - begin
        books.clocks.append({"attempt": a.id, "previous_attempt": prev_id, "behind_s": shift / 1e6,
                             "what": f"attempt {a.id}'s launch is {shift / 1e6:.3f} s before attempt {prev_id}'s last "
                                     "record: the clocks disagree (or the attempts overlapped); its times are counted "
                                     f"from attempt {prev_id}'s last record, and the gap between them is not known"})
        books.unknown.append(f"attempt {a.id}: the gap before it is not known (its clock runs {shift / 1e6:.3f} s "
                             f"behind attempt {prev_id}'s)")
        begin += shift
    if books.t_first is None:
        books.t_first = begin
    t0_us = _us(t0) + shift
    if t0_us < begin:  # the start or restore event stamped before its own launch
        books.clocks.append({"attempt": a.id, "behind_s": (begin - t0_us) / 1e6,
                             "what": f"attempt {a.id}'s {ev.get('event')} event is stamped {(begin - t0_us) / 1e6:.3f} "
                                     "s before its launched_at: the clocks disagree; its start-up is counted as 0"})
        t0_us = begin
    if prev_last is not None:
        gap = begin - prev_last
        known = launched is not None and untimed is None
        parts["gap" if known else "unknown"] += gap
        if not known:
            books.unknown.append(f"attempt {a.id}: the {gap / 1e6:.3f} s before its {ev.get('event')} event are a "
                                 "gap, " + ("its start-up (no launched_at)" if launched is None else
                                            f"or attempt {untimed}'s untimed work") + ", not told apart")
    books.untimed = None
    if launched is not None:
        restore = min(_us(ev.get("restore_s") or 0.0), t0_us - begin)
        parts["restore"] += restore
        parts["startup"] += t0_us - begin - restore
    else:
        books.unknown.append(f"attempt {a.id}: no launched_at: its start-up is not known")
    return begin, shift, t0_us


def _attempt_steps(books: _Books, run: RunLog, attempt_id: int, steps: Sequence[_Step], shift: int, cursor: int,
                   parts: dict[str, int], bad: frozenset[int]) -> tuple[int, bool]:
    """Each step's interval of an attempt (from ``cursor``, its start or restore event, microseconds)
    split into ``parts`` (:func:`split_interval`), with the clocks' disagreements. Returns ``(cursor,
    split)``: the last record's time, and whether every step had a ``t`` (else nothing is split)."""
    split = all(s.t is not None for s in steps)
    if not split:
        books.unknown.append(f"attempt {attempt_id}: steps without a 't' in signals.jsonl: its steps' time is not split")
    backward, over = [], []
    for s in steps if split else []:
        t = _us(s.t) + shift
        if t < cursor:  # a step stamped before the previous record: no time of its own
            backward.append((s.step, cursor - t))
            t = cursor
        comp = {"loader_wait": _us(s.wait_s or 0), "canary": _us(s.canary_s or 0),
                "compile": _us(s.compile_s or 0), "checkpoint_save": _us(s.checkpoint_s or 0)}
        part = step_part(run, attempt_id, s.step, bad)
        got, excess = split_interval(t - cursor, _us(s.step_s or 0) - comp["compile"], comp)
        if excess > CLOCK_TOLERANCE_US:
            over.append((s.step, excess))
        for k, v in got.items():
            parts[part if k == "compute" else k] += v
        if part == "productive":
            books.productive_so_far += got["compute"]
            books.step_compute[s.step] = got["compute"]
        cursor = t
        books.timeline.append(((t - books.t_first) / 1e6, books.productive_so_far / 1e6))
    if backward:
        worst = max(backward, key=lambda x: x[1])
        books.clocks.append({"attempt": attempt_id, "steps": len(backward), "behind_s": worst[1] / 1e6,
                             "what": f"attempt {attempt_id}: {len(backward)} step(s) stamped before the record "
                                     f"before them (worst: step {worst[0]}, {worst[1] / 1e6:.3f} s back); counted as "
                                     "taking no time"})
    if over:
        worst = max(over, key=lambda x: x[1])
        books.clocks.append({"attempt": attempt_id, "steps": len(over), "excess_s": sum(x for _, x in over) / 1e6,
                             "what": f"attempt {attempt_id}: at {len(over)} step(s) the logged durations exceed the "
                                     f"time between the step's records (worst: step {worst[0]}, by "
                                     f"{worst[1] / 1e6:.3f} s); each part is cut to the interval"})
    return cursor, split


def _untimed_wall(books: _Books, events: Sequence[Mapping[str, Any]]) -> None:
    """No attempt was timed (a run directory from before timings were logged): the wall time from the
    events' ISO ``time`` (whole seconds), all of it unknown."""
    stamps = [_iso_us(e.get("time")) for e in events]
    stamps = [x for x in stamps if x is not None]
    if stamps:
        books.t_first, books.prev_last = min(stamps), max(stamps)
        books.time_us["unknown"] = books.prev_last - books.t_first
        books.unknown.append("the wall time comes from the events' 'time' (whole seconds): the run logged no "
                             "timestamps to split it by")


def split_interval(interval_us: int, compute_us: int, comp: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """One step's interval (microseconds from the previous record to the step's ``t``, >= 0) split into
    its logged parts: ``compute`` (step time less compilation), then ``comp``'s parts in their order
    (``loader_wait``, ``canary``, ``compile``, ``checkpoint_save``), each cut to what is left of the
    interval, and ``other``, the remainder. Returns ``(parts, excess)``: every part >= 0 and summing to
    ``interval_us``; ``excess``, the microseconds of logged durations that did not fit (clocks that
    disagree)."""
    left = max(0, int(interval_us))
    out: dict[str, int] = {}
    excess = 0
    for k, v in (("compute", compute_us), *comp.items()):
        v = max(0, int(v))
        out[k] = min(v, left)
        excess += v - out[k]
        left -= out[k]
    out["other"] = left
    return out, excess


def audit(time_us: Mapping[str, int], wall_us: int) -> list[str]:
    """What is wrong with a time split, in words (empty: nothing): a part below 0, or parts that do not
    add up to the wall time (which :func:`account` takes from the first launch and the last record, not
    from the parts)."""
    bad = [f"{p} is negative ({v / 1e6:.6f} s)" for p, v in time_us.items() if v < 0]
    total = sum(time_us.values())
    if total != wall_us:
        bad.append(f"the parts add up to {total / 1e6:.6f} s, the wall time is {wall_us / 1e6:.6f} s "
                   f"({(total - wall_us) / 1e6:+.6f} s)")
    return bad


INPUT_PARTS = ("index", "read", "decode", "rows", "transfer", "other", "handoff", "not_split")
INPUT_TEXT = {"index": "index arithmetic", "read": "storage reads", "decode": "decoding the records",
              "rows": "building the rows", "transfer": "transfer to the devices",
              "other": "no stage running (queued, the GIL, a worker's hand-off)",
              "handoff": "hand-off of batches that were ready", "not_split": "not split (no stages logged)"}


def input_wait(per_steps: Mapping[int, Sequence[_Step]], charged_us: int) -> dict[str, Any]:
    """The input wait part (``loader_wait``) split by where it went, from each step's logged
    ``loader_wait_stages`` (the loader's ``metrics()["wait_stages_s"]``).

    Charged exactly as :func:`account` charges ``loader_wait``: every logged step (superseded
    ones included) of the attempts whose steps all have a ``t``, each step's ``loader_wait_s``
    in integer microseconds. A step that waited is split by its stages (the microseconds its
    rounded stages miss or exceed go to ``other``); a step whose batch was ready (stages
    ``{}``) is the ``handoff``; one with no stages logged is ``not_split``. So the parts add up
    to ``charged_us``.

    Returns:
      ``{"charged_us", "us": {part: microseconds} (:data:`INPUT_PARTS`), "adds_up": bool,
      "drained_steps": steps with 0 batches ready at the ask, "steps_with_occupancy",
      "worst": [(step, wait s, stage that held it most)] of the 5 longest waits}``.
    """
    us = {p: 0 for p in INPUT_PARTS}
    drained = with_occ = 0
    waits = []
    for steps in per_steps.values():
        if not all(s.t is not None for s in steps):
            continue  # account() leaves such an attempt's time unknown
        for s in steps:
            w = _us(s.wait_s or 0)
            if s.occupancy is not None:
                with_occ += 1
                drained += s.occupancy == 0
            if s.stages is None:
                us["not_split"] += w
            elif not s.stages:
                us["handoff"] += w
            else:
                part = {k: _us(v) for k, v in s.stages.items() if k in INPUT_PARTS}
                part["other"] = part.get("other", 0) + w - sum(part.values())
                for k, v in part.items():
                    us[k] += v
                waits.append((w, s.step, max(part, key=part.get)))
    worst = [(step, w / 1e6, stage) for w, step, stage in sorted(waits, reverse=True)[:5]]
    return {"charged_us": charged_us, "us": us, "adds_up": sum(us.values()) == charged_us,
            "drained_steps": drained, "steps_with_occupancy": with_occ, "worst": worst}


def _tokens_per_step(run: RunLog) -> tuple[Optional[int], str]:
    """``(global batch x seq_len, where it came from)``."""
    for e in run.all_events:
        if e.get("event") in ("start", "restore") and isinstance(e.get("tokens_per_step"), int):
            return int(e["tokens_per_step"]), "the trainer's start event (tokens_per_step)"
    gb = run.config.get("global_batch")
    try:
        from contract.config import load_mixture

        seq = load_mixture(str(run.config.get("mixture"))).seq_len
    except Exception:  # noqa: BLE001 - a missing or invalid mixture: unknown
        seq = None
    if isinstance(gb, int) and seq:
        return gb * seq, "run config global_batch x the mixture's seq_len"
    return None, "not known: no tokens_per_step logged and no mixture to read seq_len from"


def _ledger(run: RunLog, per_steps: Mapping[int, Sequence[_Step]], bad: frozenset[int] = frozenset()
            ) -> tuple[dict, dict, dict, dict]:
    """Steps and tokens per part, and the reconciliation with the loader's arithmetic."""
    from loader import index as ix

    lineage = run.lineage
    steps = {p: 0 for p in STEP_PARTS}
    steps["non_finite"] = sum(1 for s in bad if lineage.first <= s < lineage.end)
    steps["productive"] = max(0, lineage.end - lineage.first) - steps["non_finite"]
    for a in lineage.attempts:
        if a.superseded is None:
            continue
        for s in range(*a.superseded):
            steps[step_part(run, a.id, s)] += 1
    windows = sorted((int(w[0]), int(w[1])) for w in run.config.get("skip_windows") or [])
    passed = [(lo, hi) for lo, hi in windows if lo < lineage.end]
    steps["skipped_data"] = sum(hi - lo + 1 for lo, hi in passed)
    tps, source = _tokens_per_step(run)
    tokens = {p: (n * tps if tps is not None else None) for p, n in steps.items()}
    nonpad: dict[str, Optional[int]] = {p: 0 for p in STEP_PARTS}
    nonpad["skipped_data"] = None  # never read by the trainer; the loader's rows would tell
    for a, ss in per_steps.items():
        for s in ss:
            p = step_part(run, a, s.step, bad)
            if nonpad[p] is not None:
                nonpad[p] = None if s.tokens is None else nonpad[p] + s.tokens
    trained = sum(steps[p] for p in STEP_PARTS)
    by_attempts = sum((a.trained_end or a.start) - a.start for a in lineage.attempts)
    last = lineage.end - 1
    data_end = ix.data_step(last, [ix.SkipWindow(lo, hi) for lo, hi in windows]) + 1 if last >= 0 else 0
    rec = {"tokens_per_step": tps, "tokens_per_step_from": source,
           "trained_steps": trained, "trained_steps_by_attempt": by_attempts,
           "trained_adds_up": trained == by_attempts if all(a.trained_end is not None for a in lineage.attempts)
           else None,
           "lineage_data_steps": [lineage.first, data_end],
           "data_steps_add_up": data_end - lineage.first == steps["productive"] + steps["non_finite"]
           + steps["skipped_data"],
           "formula": "data_step(end - 1) + 1 - first == lineage steps (finite + non-finite) + skipped data steps "
                      "(loader.index.data_step)"}
    return steps, tokens, nonpad, rec


def _mfu(run: RunLog, compute_us: Mapping[int, int], peak_flops: Optional[float]) -> dict[str, Any]:
    flops = next((e.get("flops_per_step") for e in run.all_events if e.get("event") in ("start", "restore")
                  and isinstance(e.get("flops_per_step"), (int, float))), None)
    kind = ((run.env.get("backend") or {}).get("device_kind") or "")
    devices = run.mesh_size or len(run.mesh.get("device_ids") or []) or None
    illustrative = peak_flops is None and kind.lower().startswith("cpu")
    peak = peak_flops if peak_flops is not None else PEAK_FLOPS.get(kind) or PEAK_FLOPS.get(kind.lower())
    out: dict[str, Any] = {"flops_per_step": flops, "device_kind": kind, "devices": devices, "peak_flops": peak,
                           "peak_from": "--peak-flops" if peak_flops is not None else (
                               "the table of known device kinds" if peak else None),
                           "illustrative": bool(illustrative)}
    if flops is None or not peak or not devices or not compute_us:
        out["status"] = "not available: " + ", ".join(
            w for w, ok in (("no flops_per_step logged by the trainer", flops is not None),
                            (f"no peak FLOP/s for device kind {kind!r} (give --peak-flops)", bool(peak)),
                            ("no device count in env.json", bool(devices)),
                            ("no timed lineage step", bool(compute_us))) if not ok)
        return out
    per = {s: flops / (us / 1e6) / (devices * peak) for s, us in compute_us.items() if us > 0}
    vals = np.asarray(list(per.values()))
    out.update(status="ok", median=float(np.median(vals)), mean=float(np.mean(vals)),
               per_step={str(s): round(v, 6) for s, v in sorted(per.items())},
               formula="flops_per_step / (step compute s x devices x peak FLOP/s per device)")
    if illustrative:
        out["note"] = ("illustrative only: on CPU devices the peak is a nominal 5e10 FLOP/s per XLA device "
                       "(a share of the host's cores), not a measured or vendor figure")
    return out


def _young(run: RunLog, time_us: Mapping[str, int], mtbf_s: Optional[float]) -> dict[str, Any]:
    """Young's optimal checkpoint interval ``tau* = sqrt(2 * C * M)`` (Young 1974) and the overhead of
    an interval ``tau``, ``C / tau + tau / (2 * M)`` (the saves' cost plus, on average, half an interval
    of work lost per failure), with:

    - C, the measured cost of one save: the loop's checkpoint save stalls (the ``checkpoint_save``
      part, an asynchronous save's blocking part and the final wait) over the committed checkpoints;
    - M, the fleet MTBF: ``mtbf_s``, else the run config's ``mtbf_s``, else :data:`DESIGN_MTBF_S`
      (the seed's design point, named as such in the report); the MTBF this run's own crashes give
      (wall time over restores that resumed) is reported beside it, never used;
    - the run's interval, measured: the median time between consecutive saves' starts
      (``save_start_t`` of the checkpoint events) within an attempt; a run whose events carry no
      ``save_start_t`` gets ``checkpoint_every`` x the median step time, said so.
    Each save's latency (``commit_t - save_start_t``: until it is durable) is reported too.

    Raises:
      GoodputError: the MTBF is not a number > 0.
    """
    saves = [e for e in run.all_events if e.get("event") == "checkpoint"]
    crashes = sum(1 for a in run.lineage.attempts if a.kind == "resume")
    m_from = "replay goodput --mtbf"
    if mtbf_s is None and run.config.get("mtbf_s") is not None:
        mtbf_s, m_from = run.config["mtbf_s"], "the run config's mtbf_s"
    elif mtbf_s is None:
        mtbf_s, m_from = DESIGN_MTBF_S, DESIGN_MTBF_TEXT
    if isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float)) or not math.isfinite(mtbf_s) or mtbf_s <= 0:
        raise GoodputError(f"{m_from}: the MTBF must be a number of seconds > 0, got {mtbf_s!r}")
    out: dict[str, Any] = {"checkpoints": len(saves), "crashes": crashes, "mtbf_s": float(mtbf_s), "mtbf_from": m_from,
                           "formula": "tau* = sqrt(2 * C * MTBF); overhead(tau) = C / tau + tau / (2 * MTBF)"}
    if crashes:
        wall = sum(time_us.values())
        out["observed_mtbf_s"] = wall / 1e6 / crashes
    latency = [float(e["commit_t"]) - float(e["save_start_t"]) for e in saves
               if isinstance(e.get("commit_t"), (int, float)) and isinstance(e.get("save_start_t"), (int, float))]
    if latency:
        out["save_latency_s"] = float(np.median(latency))
    starts: dict[Any, list[float]] = {}
    for e in saves:
        if isinstance(e.get("save_start_t"), (int, float)):
            starts.setdefault(e.get("attempt"), []).append(float(e["save_start_t"]))
    gaps = [b - a for v in starts.values() for a, b in zip(sorted(v), sorted(v)[1:]) if b > a]
    if gaps:
        out["interval_s"], out["interval_from"] = float(np.median(gaps)), "measured: the median time between saves' starts"
    else:
        every, st = run.config.get("checkpoint_every"), _median_step(run)
        if isinstance(every, int) and st:
            out["interval_s"], out["interval_from"] = every * st[0], ("estimated: checkpoint_every x the median step "
                                                                      "time (the checkpoint events carry no save_start_t)")
    if not saves:
        out["status"] = "not available: no committed checkpoint"
        return out
    cost = time_us["checkpoint_save"] / 1e6 / len(saves)
    out["checkpoint_cost_s"] = cost
    if cost <= 0:
        out["status"] = "not available: the saves cost the loop no measured time (no checkpoint_s logged)"
        return out
    tau = math.sqrt(2 * cost * mtbf_s)
    out.update(status="ok", optimal_interval_s=tau, overhead_at_optimum=cost / tau + tau / (2 * mtbf_s))
    if out.get("interval_s"):
        out["overhead_at_interval"] = cost / out["interval_s"] + out["interval_s"] / (2 * mtbf_s)
    return out


def _median_step(run: RunLog) -> list[float]:
    from replay.screen.scan import lineage_screening_logs

    signals, _ = lineage_screening_logs(run)
    st = [s.step_time_s for s in (signals or {}).values() if s.step_time_s is not None]
    return [float(np.median(st))] if st else []


def headline(report: Mapping[str, Any]) -> str:
    """The one line that sums a goodput report (``GoodputReport.to_dict()``) up, e.g. ``goodput 71.2%
    of 134.0 s; 100.0% of the tokens trained are in the lineage; MFU 3.10% (illustrative on CPU);
    effective 2.21% (MFU x goodput)``."""
    wall = report["wall_s"]
    g = report.get("goodput")
    out = f"goodput {g:.1%} of {wall:.1f} s" if g is not None and report.get("wall_s") else \
        "goodput not available (no timestamps)"
    if report.get("token_goodput") is not None:
        out += f"; {report['token_goodput']:.1%} of the tokens trained are in the lineage"
    mfu = report.get("mfu") or {}
    if mfu.get("status") == "ok":
        out += f"; MFU {mfu['median']:.2%}" + (" (illustrative on CPU)" if mfu.get("illustrative") else "")
        if g is not None:
            out += f"; effective {mfu['median'] * g:.2%} (MFU x goodput)"
    return out
