"""``replay triage``: the walk through a loss spike, in the field's order, cheapest check first.

For a spike at step ``S`` with a window ``W`` (the checks look at steps ``[S - W, S]`` of the
lineage: ``replay.run.lineage``), four checks run in order, each ``clear``, ``suspect`` or ``not
available`` (a signal the run did not log is never ``clear``), with its evidence::

    1 events    lineage events in the window: restores, rescales, mixture phase changes, skipped
                windows, rewinds, config changes, canary mismatches, loader stalls. For every restore,
                the exact restore check: the loader state the restore logged (next step against
                the restored checkpoint) and the logged batch hashes of the steps after it against
                the batches rebuilt from the run's dataset (or, without the dataset, against the
                hashes the lineage and its superseded attempts logged): a restore that repeated or
                skipped data is named with the number of steps. A canary mismatch names devices.
    2 replicas  replay scan's statistics over the window (canary, non-finite counts per device,
                replica gradient-norm spikes and drift); with ``replay=True`` the range replay on
                good devices from the newest checkpoint before the onset, and its verdict
    3 data      the onset's rows (the ``onset_steps`` steps from the spike's onset) against rows
                sampled from earlier in the window: per row unknown-token rate, repeated-n-gram
                rate, mean segment length, byte-fallback share, unigram surprisal
                (``replay.screen.datastats``); outliers counted per shard and per source, the
                shards' files hashed against the manifest; duplicated rows at the onset against the
                baseline's pair rate (:func:`duplicates`), with the manifest's shards that share a
                sha256; the logged batch hashes of the onset must match the rebuilt rows (else the
                rows read are not those trained: not available)
    4 router    per layer, the onset against the steps before it, looking back for a departure
                still going on (:func:`check_router`): entropy drop, dropped-fraction surge,
                max-logit and z-loss growth, expert share outside the band of the run config's
                router_health, a dead expert; non-finite figures are not judged, never clear

An event near the onset may explain a *finite* loss spike; a non-finite loss is never explained
by an event. The conclusion (:func:`conclude`, one small pure function) takes the first suspect
cause in the order restart fault, hardware, data, router, else an optimization event, with a
confidence, the next command and its own exit code (``replay.run.codes.ExitCode``)::

    cause          exit  next
    restart        11    roll back to the checkpoint of the faulty restore and resume
    hardware       10    the range replay on good devices (or, convicted, quarantine and canary)
    data           12    replay inspect of the onset, then replay skip of the window (outlier or
                         duplicated rows)
    router         13    a sentence (lower the router's learning rate, restore the z-loss), and scan
    optimization    0    rewind to checkpoint C and skip the window [A, B): the exact replay skip

Replica findings that are only one-step norm spikes at steps whose rows the data check flags are
data, not hardware (garbage rows make their replica's gradient an outlier).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from replay.run.codes import ExitCode
from replay.run.runlog import RunDirError, RunLog
from replay.screen import datastats as ds
from replay.screen import screening as sc

CHECKS = ("events", "replicas", "data", "router")
MIN_SOURCE_ROWS = 8  # a source's own baseline rows needed to judge its rows against them (else: all rows)
MIN_ROUTER_BASE = 3  # router: baseline steps needed before a departure looked back for (check_router)
CAUSE_CODES = {"hardware": ExitCode.TRIAGE_HARDWARE, "restart": ExitCode.TRIAGE_RESTART,
               "data": ExitCode.TRIAGE_DATA, "router": ExitCode.TRIAGE_ROUTER,
               "optimization": ExitCode.OPTIMIZATION_EVENT}
EXPLAINING = ("restore", "start", "phase_change", "skipped_window", "skip_window_added", "config_change", "rescale")


class TriageConfigError(ValueError):
    """A triage threshold is out of range; names the field and the allowed range."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TriageConfig:
    """Thresholds of ``replay triage`` (defaults chosen on the drills of ``replay drill --scenario``).

    Attributes:
      window: steps before the spike the checks look at, >= 1.
      onset_steps: data: the steps whose rows are judged: the first ones of the spike from its onset,
        or, when the loss check finds no spike at the step, the last ones up to it; >= 1.
      baseline_steps: data: earlier steps of the window sampled as the baseline, >= 1.
      near_steps: an event at most this many steps before the onset may explain a finite spike, >= 0.
      fence: data: a row is an outlier beyond ``Q1 - fence * IQR`` or ``Q3 + fence * IQR`` of its
        source's baseline rows on a content statistic (Tukey's far-out fences at 3), > 0.
      shard_share, shard_rows: data: a shard is suspect when at least this share of its onset rows,
        and at least ``shard_rows`` rows, are outliers (a clean corpus has scattered outlier rows:
        about 1 in 100 of the demo's code rows), in (0, 1] and >= 1.
      hash_steps: steps after a restore whose batch hashes are checked, >= 1.
      search_steps: how far (in steps, either way) a shifted batch is looked for, >= 1.
      entropy_drop: router: a relative drop of a layer's entropy below the lowest of the window
        before the onset, in (0, 1).
      logit_growth, z_loss_growth: router: the onset's largest max logit and z-loss over the
        largest of the window before, > 1.
      dropped_surge: router: the onset's dropped fraction above the run's limit and this factor of
        the window's largest, > 1.
      share_growth: router: the busiest expert's share times E (over ``router_health.window_steps``)
        above the run's band and this factor past the window's largest, > 1 (routing concentrating on
        one expert; an expert starved for a few steps, which ``replay scan`` reports against the band,
        happens in small batches without instability).
      dead_share: router: an expert is dead when its mean share over the judged steps, times E, is below
        this floor while it was at or above it before, in (0, 1) (0.05: under 1/20 of its uniform share;
        a healthy expert's share over 4 steps of a small batch stays far above it).
      duplicate_alpha: data: the onset's identical row pairs are a finding when a Poisson count at the
        baseline's pair rate reaches them with probability below this (:func:`duplicates`), in (0, 1).
      router_lookback: router: steps before the judged ones where a departure that is still going on may
        have begun (:func:`check_router`), >= 0.

    The router thresholds separate the two drills that move the router: a router learning rate x100
    grows the max logit 1.8x to 3x and the z-loss 3x to 9x within a few steps, while a learning-rate
    jump of the whole model x20 (an optimization event) moves the entropy (to -47%) and the shares but
    the max logit by at most 1.23x and the z-loss by 1.65x.
    """

    window: int = 1000
    onset_steps: int = 4
    baseline_steps: int = 32
    near_steps: int = 2
    fence: float = 3.0
    shard_share: float = 0.5
    shard_rows: int = 2
    hash_steps: int = 4
    search_steps: int = 16
    entropy_drop: float = 0.5
    logit_growth: float = 1.5
    z_loss_growth: float = 2.0
    dropped_surge: float = 3.0
    share_growth: float = 3.0
    dead_share: float = 0.05  # replay.screen.scan.DEAD_SHARE, the board's floor
    duplicate_alpha: float = 1e-3
    router_lookback: int = 16

    def __post_init__(self):
        def need(ok, field, allowed):
            if not ok:
                raise TriageConfigError(f"triage.{field}: must be {allowed}, got {getattr(self, field)!r}")

        for f in ("window", "onset_steps", "baseline_steps", "hash_steps", "search_steps", "shard_rows"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 1, f, "an int >= 1")
        need(isinstance(self.near_steps, int) and self.near_steps >= 0, "near_steps", "an int >= 0")
        need(isinstance(self.router_lookback, int) and self.router_lookback >= 0, "router_lookback", "an int >= 0")
        need(0 < self.dead_share < 1, "dead_share", "in (0, 1)")
        need(0 < self.duplicate_alpha < 1, "duplicate_alpha", "in (0, 1)")
        need(self.fence > 0, "fence", "> 0")
        need(0 < self.shard_share <= 1, "shard_share", "in (0, 1]")
        need(0 < self.entropy_drop < 1, "entropy_drop", "in (0, 1)")
        for f in ("logit_growth", "z_loss_growth", "dropped_surge", "share_growth"):
            need(getattr(self, f) > 1, f, "> 1")


@dataclasses.dataclass
class Check:
    """One check's outcome.

    Attributes:
      name: one of :data:`CHECKS`; status: ``"clear"``, ``"suspect"`` or ``"not available"``.
      summary: one line; lines: the evidence in words; evidence: the same as data.
      subject: what it names (``devices``, ``restores``, ``shards``, ``documents``, ``layers``).
      command: the command that takes this check further, or None.
    """

    name: str
    status: str
    summary: str
    lines: list[str] = dataclasses.field(default_factory=list)
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    subject: dict[str, Any] = dataclasses.field(default_factory=dict)
    command: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "summary": self.summary, "lines": self.lines,
                "evidence": self.evidence, "subject": self.subject, "command": self.command}


@dataclasses.dataclass(frozen=True)
class Conclusion:
    """Attributes: cause (``CAUSE_CODES`` key), confidence (``high``, ``medium``, ``low``),
    explanation, subject, command (the next command or None), advice (a sentence), exit_code,
    also (other suspect checks, a line each)."""

    cause: str
    confidence: str
    explanation: str
    subject: Mapping[str, Any]
    command: Optional[str]
    advice: str
    exit_code: int
    also: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "confidence": self.confidence, "explanation": self.explanation,
                "subject": dict(self.subject), "command": self.command, "advice": self.advice,
                "exit_code": self.exit_code, "also": list(self.also)}


@dataclasses.dataclass
class TriageReport:
    """What ``replay triage`` found (``to_dict`` is the JSON report)."""

    run_dir: str
    step: int
    onset: int
    window: tuple[int, int]
    loss: Optional[float]
    checks: dict[str, Check]
    conclusion: Conclusion
    lineage: list[str]
    skip_plan: Optional[dict[str, Any]]
    judged: tuple[int, int] = (0, 0)
    series: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    spike_found: Optional[bool] = None  # the loss check found a spike at ``step`` or just before it

    @property
    def exit_code(self) -> int:
        return self.conclusion.exit_code

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "triage", "run": self.run_dir, "step": self.step, "onset": self.onset,
                "window": {"start": self.window[0], "stop": self.window[1]},
                "judged_steps": {"start": self.judged[0], "stop": self.judged[1] + 1},
                "loss": None if self.loss is None or not math.isfinite(self.loss) else self.loss,
                "loss_finite": self.loss is not None and math.isfinite(self.loss),
                "checks": {k: c.to_dict() for k, c in self.checks.items()},
                "conclusion": self.conclusion.to_dict(), "cause": self.conclusion.cause,
                "exit_code": self.exit_code, "lineage": self.lineage, "skip_plan": self.skip_plan,
                "spike_found": self.spike_found}


# ----------------------------------------------------------------------------- helpers


def _loss_of(run: RunLog, step: int) -> float:
    fp = run.fingerprints.get(step)
    return float(np.uint32(fp.loss_bits).view(np.float32)) if fp is not None else math.nan


def find_onset(run: RunLog, lo: int, step: int, cfg: sc.ScreeningConfig, onset_steps: int) -> tuple[int, list[int]]:
    """``(onset, spike steps)``: the first step of the run of loss-spike steps (``screening.loss_spikes``)
    that ends at ``step`` (or at the latest spike among the ``onset_steps`` steps up to it); ``step``
    itself when the loss check finds no spike there."""
    steps = [s for s in range(lo, step + 1) if s in run.fingerprints]
    loss = np.asarray([_loss_of(run, s) for s in steps])
    spikes = {steps[i] for i, _ in sc.loss_spikes(loss, cfg)}
    near = [s for s in spikes if step - onset_steps < s <= step]
    if not near:
        return step, sorted(spikes)
    onset = max(near)
    while onset - 1 in spikes:
        onset -= 1
    return onset, sorted(spikes)


def batch_hash(loader: Any, step: int) -> str:
    """The batch hash of training step ``step`` as the trainer logs it (``StepFingerprints.batch_hash``:
    the fingerprint of the global ``inputs``), from the rows the loader rebuilds."""
    from replay.run import fingerprint as fpm

    return fpm.fingerprint_hex(fpm.fingerprint_np(loader.host_batch(step)["inputs"]))


class Rebuilt:
    """Batch hashes of rebuilt steps (cached); ``available`` is False when the loader cannot be built
    (``reason`` says why)."""

    def __init__(self, make_loader: Optional[Callable[[], Any]]):
        self.loader, self.reason, self._cache = None, None, {}
        if make_loader is None:
            self.reason = "no loader"
            return
        try:
            self.loader = make_loader()
        except (RunDirError, FileNotFoundError, ValueError) as e:
            self.reason = str(e)

    @property
    def available(self) -> bool:
        return self.loader is not None

    def __call__(self, step: int) -> Optional[str]:
        if self.loader is None or step < 0:
            return None
        if step not in self._cache:
            self._cache[step] = batch_hash(self.loader, step)
        return self._cache[step]


# ----------------------------------------------------------------------------- 1. events


def restore_check(run: RunLog, event: Mapping[str, Any], rebuilt: Rebuilt, cfg: TriageConfig) -> dict[str, Any]:
    """The exact restore check of one ``restore`` event (module docstring).

    Returns:
      ``{"step", "checkpoint", "attempt", "reason", "loader_next_step", "offset" (steps of data the
      restored run is shifted by: trained step s got the data of s + offset; 0: exact; None: not
      checkable), "verdict" ("exact", "repeated", "skipped", "differs" or "not checkable"),
      "hashes": [{"step", "logged", "expected", "source"}], "detail"}``.
    """
    r = int(event["step"])
    out: dict[str, Any] = {"step": r, "checkpoint": event.get("checkpoint", r), "attempt": event.get("attempt"),
                           "reason": event.get("reason")}
    ls = event.get("loader_state") or {}
    shift = None
    if isinstance(ls.get("next_step"), int):
        out["loader_next_step"] = ls["next_step"]
        shift = int(ls["next_step"]) - r
    hashes, offsets = [], set()
    sup = _superseded_hashes(run)
    for s in range(r, min(r + cfg.hash_steps, run.lineage.end if run.lineage else r + cfg.hash_steps)):
        fp = run.fingerprints.get(s)
        if fp is None:
            continue
        logged = fp.batch_hash
        expected, source = rebuilt(s), "rebuilt from the dataset"
        if expected is None:
            expected, source = sup.get(s), "the superseded attempt's log"
        rec = {"step": s, "logged": logged, "expected": expected, "source": source if expected else None}
        if expected is not None and logged != expected:
            j = _find_offset(run, s, logged, rebuilt, sup, cfg.search_steps)
            rec["found_at_offset"] = j
            if j is not None:
                offsets.add(j)
        elif expected is not None:
            offsets.add(0)
        hashes.append(rec)
    out["hashes"] = hashes
    mism = [h for h in hashes if h["expected"] is not None and h["logged"] != h["expected"]]
    if mism:
        known = sorted(o for o in offsets if o != 0)
        out["offset"] = known[0] if len(known) == 1 else (shift if shift else None)
    elif hashes and any(h["expected"] is not None for h in hashes):
        out["offset"] = 0 if not shift else shift
    else:
        out["offset"] = shift
    off = out["offset"]
    if off is None:
        out["verdict"] = "differs" if mism else "not checkable"
    elif off == 0:
        out["verdict"] = "exact"
    else:
        out["verdict"] = "repeated" if off < 0 else "skipped"
    checked = sum(1 for h in hashes if h["expected"] is not None)
    if out["verdict"] == "exact":
        out["detail"] = (f"restore at step {r} (checkpoint {out['checkpoint']}): exact: the loader resumed at step "
                         f"{out.get('loader_next_step', '?')} and {checked} batch hash(es) after it match")
    elif out["verdict"] in ("repeated", "skipped"):
        n = abs(off)
        what = (f"data of steps {r + off}..{r - 1} trained twice" if off < 0 else
                f"data of steps {r}..{r + off - 1} never trained")
        out["detail"] = (f"restore at step {r} (checkpoint {out['checkpoint']}) {out['verdict']} {n} step(s) of data: "
                         f"the loader resumed at step {out.get('loader_next_step', r + off)} instead of {r} ({what}; "
                         f"{len(mism)} of {checked} batch hash(es) after it differ)")
    elif out["verdict"] == "differs":
        out["detail"] = (f"restore at step {r}: the batches after it are not the lineage's data ({len(mism)} of "
                         f"{checked} hashes differ, found at no offset within {cfg.search_steps} steps)")
    else:
        out["detail"] = (f"restore at step {r}: not checkable (no loader state logged, and no batch to compare "
                         f"with: {rebuilt.reason or 'dataset not available'})")
    return out


def _superseded_hashes(run: RunLog) -> dict[int, str]:
    from replay.run import lineage as lin

    return {int(d["step"]): str(d.get("batch_hash")) for d in lin.read_superseded(run.run_dir, "fingerprints.jsonl")
            if "batch_hash" in d}


def _find_offset(run: RunLog, step: int, logged: str, rebuilt: Rebuilt, sup: Mapping[int, str],
                 search: int) -> Optional[int]:
    """The ``j`` with the logged batch of ``step`` equal to the batch of ``step + j`` (nearest first)."""
    for k in range(1, search + 1):
        for j in (-k, k):
            other = rebuilt(step + j)
            if other is None:  # no dataset: the lineage's own earlier steps, the superseded later ones
                fp = run.fingerprints.get(step + j) if j < 0 else None
                other = fp.batch_hash if fp is not None else sup.get(step + j)
            if other == logged:
                return j
    return None


def check_events(run: RunLog, lo: int, step: int, onset: int, loss_finite: bool, rebuilt: Rebuilt,
                 stalls: Sequence[Mapping[str, Any]], cfg: TriageConfig) -> Check:
    """Check 1 (module docstring)."""
    if not run.all_events and not run.events:
        return Check("events", "not available", "no events.jsonl: the run logged no events")
    inside = [e for e in run.events if isinstance(e.get("step"), int) and lo <= e["step"] <= step]
    counts: dict[str, int] = {}
    lines, evidence = [], {"events": [], "restores": [], "canary_mismatches": [], "loader_stalls": list(stalls)}
    for e in inside:
        kind = e.get("event")
        if kind in ("checkpoint", "end"):
            continue
        if kind == "restore" and _is_rescale(e):
            kind = "rescale"
        counts[kind] = counts.get(kind, 0) + 1
        evidence["events"].append({"event": kind, "step": e["step"], "attempt": e.get("attempt")})
    faults, devices = [], set()
    for e in inside:
        if e.get("event") == "restore":
            res = restore_check(run, e, rebuilt, cfg)
            evidence["restores"].append(res)
            lines.append(res["detail"])
            if res["verdict"] in ("repeated", "skipped", "differs"):
                faults.append(res)
        if e.get("event") == "canary_mismatch":
            devs = [int(d) for d in e.get("devices") or []]
            devices.update(devs)
            evidence["canary_mismatches"].append({"step": e["step"], "devices": devs, "verdict": e.get("verdict")})
            lines.append(f"canary mismatch before step {e['step']}: device(s) {devs} ({e.get('verdict')})")
    for st in stalls:
        lines.append(f"loader stall: {st['detail']}")
    near = [e for e in inside if e.get("event") in EXPLAINING and onset - cfg.near_steps <= e["step"] <= onset]
    explains = []
    for e in near:
        kind = "rescale" if e.get("event") == "restore" and _is_rescale(e) else e["event"]
        if e.get("event") == "restore" and any(f["step"] == e["step"] for f in faults):
            continue
        if loss_finite:
            explains.append(f"{kind} at step {e['step']}")
            lines.append(f"{kind} at step {e['step']}, {onset - e['step']} step(s) before the onset: may explain "
                         "a finite loss spike (no fault of its own found)")
        else:
            lines.append(f"{kind} at step {e['step']}: cannot explain a non-finite loss")
    evidence["may_explain"] = explains
    listed = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none but checkpoints"
    subject: dict[str, Any] = {}
    if faults:
        subject["restores"] = [{"step": f["step"], "checkpoint": f["checkpoint"], "offset": f.get("offset"),
                                "verdict": f["verdict"]} for f in faults]
    if devices:
        subject["devices"] = sorted(devices)
    status = "suspect" if faults or devices else "clear"
    summary = (f"events in steps {lo}..{step}: {listed}"
               + (f"; {len(faults)} restore(s) repeated or skipped data" if faults else "")
               + (f"; canary mismatch on device(s) {sorted(devices)}" if devices else ""))
    return Check("events", status, summary, lines, evidence, subject)


def _is_rescale(e: Mapping[str, Any]) -> bool:
    diffs = e.get("env_differences") or []
    return any(str(d).startswith(("mesh", "backend.device_count", "backend.process_count")) for d in diffs)


# ----------------------------------------------------------------------------- 2. replicas


def check_replicas(run: RunLog, scan: Any, lo: int, step: int, onset: int, replay: Optional[Any]) -> Check:
    """Check 2 (module docstring). ``scan``: ``scan_run(run, lo, step + 1)``; ``replay``: a range
    report (``replay.verify.engine.RangeReport``) or None."""
    keys = ("canary", "nonfinite", "norm_spike", "norm_drift")
    statuses = {k: scan.checks[k]["status"] for k in keys}
    sus = [s for s in scan.suspects if s.kind in ("device", "replica")]
    start = min([s.first_step for s in sus] + [onset])
    start = max(start, lo)
    command = f"replay --run {shlex.quote(run.run_dir)} --steps {start}:{step + 1} --devices good"
    lines = [f"{k}: {v} ({scan.checks[k].get('detail', '')})" for k, v in statuses.items()]
    evidence: dict[str, Any] = {"checks": {k: scan.checks[k] for k in keys},
                                "suspects": [s.to_dict() for s in sus], "replay_command": command}
    devices = sorted({d for s in sus for d in s.devices})
    kinds = sorted({e.check for s in sus for e in s.evidence})
    subject: dict[str, Any] = {"devices": devices, "first_step": min((s.first_step for s in sus), default=None),
                               "evidence": kinds} if sus else {}
    if replay is not None:
        rep = replay.to_dict()
        evidence["replay"] = {k: rep[k] for k in ("verdict", "cause", "explanation", "first_divergent_step",
                                                   "convicted_devices", "leaves", "steps", "exit_code")}
        lines.append(f"range replay of steps {rep['steps']['start']}:{rep['steps']['stop']} on good devices: "
                     f"{rep['verdict'].upper()}: {rep['explanation']}")
        if rep["verdict"] == "convicted":
            subject = {"devices": list(rep["convicted_devices"]), "first_step": rep["first_divergent_step"],
                       "evidence": sorted(set(kinds) | {"replay"}), "convicted": True}
            return Check("replicas", "suspect", f"convicted by the range replay: device(s) "
                                                f"{rep['convicted_devices']} at step {rep['first_divergent_step']}",
                         lines, evidence, subject, None)
        if rep["verdict"] == "acquitted":
            return Check("replicas", "clear", "the range replay on good devices reproduced the log: no device "
                                              "computed wrong bits" + (f" (the logs had named {devices})" if devices
                                                                       else ""), lines, evidence, {}, None)
    if sus:
        return Check("replicas", "suspect", f"device(s) {devices} named by the replica checks ({', '.join(kinds)}) "
                                            f"from step {subject['first_step']}", lines, evidence, subject, command)
    if all(v == "not available" for v in statuses.values()):
        return Check("replicas", "not available", "no per-replica signals or canary logged", lines, evidence,
                     {}, command)
    return Check("replicas", "clear", "no device or replica stands out" + (
        "" if replay is not None else " (the logs alone; the range replay is the test)"), lines, evidence, {}, command)


# ----------------------------------------------------------------------------- 3. data


def judged_steps(lo: int, step: int, onset: int, cfg: TriageConfig) -> tuple[int, int]:
    """``(first, last)`` of the steps the data and router checks judge against the steps before them:
    the first ``onset_steps`` steps of the spike from its onset, or, when the loss check finds no
    spike at ``step`` (``onset == step``), the last ``onset_steps`` steps up to it."""
    first = onset if onset < step else max(lo, step - cfg.onset_steps + 1)
    return first, min(step, first + cfg.onset_steps - 1)


def _byte_pieces(tokenizer_path: Optional[str], vocab: int) -> Optional[np.ndarray]:
    if not tokenizer_path or not os.path.isfile(tokenizer_path):
        return None
    try:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
    except (RuntimeError, OSError):
        return None
    n = min(vocab, sp.get_piece_size())
    out = np.zeros(vocab, bool)
    out[:n] = [sp.is_byte(i) for i in range(n)]
    return out


def _sample(steps: Sequence[int], k: int) -> list[int]:
    if len(steps) <= k:
        return list(steps)
    idx = np.linspace(0, len(steps) - 1, k).round().astype(int)
    return sorted({steps[i] for i in idx})


@dataclasses.dataclass
class _RowScores:
    """The rows of the judged and the baseline steps, ``(step, position, ref, row)`` each, scored
    (``replay.screen.datastats``): the features of the onset's rows ``f_on`` and the robust z-scores
    ``z_on`` / ``z_base`` (rows x ``ds.FEATURES``), against each source's baseline; ``out_on`` /
    ``out_base``: the outlier rows; ``pieces``: the tokenizer's byte pieces, or None."""

    onset_rows: list
    base_rows: list
    baselines: dict[str, Any]
    f_on: np.ndarray
    z_on: np.ndarray
    out_on: np.ndarray
    out_base: np.ndarray
    pieces: Optional[np.ndarray]


def _score_rows(data: Any, onset_steps: Sequence[int], base_steps: Sequence[int], cfg: TriageConfig) -> _RowScores:
    """Each onset and baseline row of the loader ``data`` scored against its source's baseline rows (its
    own when it has :data:`MIN_SOURCE_ROWS`, else all of them)."""
    manifest = data.manifest
    vocab = int(manifest.tokenizer.get("vocab_size") or 0)
    unk = manifest.tokenizer.get("unk_id")
    tok_path = getattr(getattr(data.mixture, "tokenizer", None), "path", None)
    pieces = _byte_pieces(tok_path, vocab) if vocab else None

    def rows_of(steps):
        out = []
        for s in steps:
            for pos, (ref, row) in enumerate(zip(data.rows_at(s), data.read_rows(s))):
                out.append((s, pos, ref, row))
        return out

    base_rows, onset_rows = rows_of(base_steps), rows_of(onset_steps)
    by_source: dict[str, list] = {}
    for rec in base_rows:
        by_source.setdefault(rec[2].source, []).append(rec)
    judged_by = {}  # source -> the baseline rows it is judged against: its own when it has enough
    for name in {rec[2].source for rec in onset_rows + base_rows}:
        own = by_source.get(name, [])
        judged_by[name] = own if len(own) >= MIN_SOURCE_ROWS else base_rows
    counts = {name: ds.unigram_counts([rec[3].tokens for rec in recs], vocab) if vocab else None
              for name, recs in judged_by.items()}

    def feats(rec, baseline_row=False):
        r = rec[3]
        return ds.row_features(r.tokens, r.segment_lengths, unk_id=unk, byte_pieces=pieces,
                               counts=counts[rec[2].source], leave_out=baseline_row)

    f_base = {id(rec): feats(rec, True) for rec in base_rows}
    baselines = {name: ds.baseline(ds.feature_matrix([f_base[id(rec)] for rec in recs]))
                 for name, recs in judged_by.items()}
    f_on = ds.feature_matrix([feats(rec) for rec in onset_rows])
    z_on = np.asarray([ds.scores(f_on[i:i + 1], baselines[rec[2].source], cfg.fence)[0]
                       for i, rec in enumerate(onset_rows)]).reshape(-1, len(ds.FEATURES))
    z_base = np.asarray([ds.scores(ds.feature_matrix([f_base[id(rec)]]), baselines[rec[2].source], cfg.fence)[0]
                         for rec in base_rows]).reshape(-1, len(ds.FEATURES))
    return _RowScores(onset_rows, base_rows, baselines, f_on, z_on, ds.outliers(z_on), ds.outliers(z_base), pieces)


def _tally(sc: _RowScores) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(shards, sources)``: per shard and per source its onset and baseline rows, their outliers and
    shares; per source also its onset's mean segment length against its baseline's median."""
    onset_rows, base_rows = sc.onset_rows, sc.base_rows
    shards: dict[str, dict[str, Any]] = {}
    sources: dict[str, dict[str, Any]] = {}
    for table, rows, flags, key in ((shards, onset_rows, sc.out_on, "onset"),
                                    (shards, base_rows, sc.out_base, "baseline"),
                                    (sources, onset_rows, sc.out_on, "onset"),
                                    (sources, base_rows, sc.out_base, "baseline")):
        for (_, _, ref, _), bad in zip(rows, flags):
            name = ref.shard if table is shards else ref.source
            e = table.setdefault(name, {"onset_rows": 0, "onset_outliers": 0, "baseline_rows": 0,
                                        "baseline_outliers": 0})
            e[f"{key}_rows"] += 1
            e[f"{key}_outliers"] += int(bad)
    for table in (shards, sources):
        for e in table.values():
            e["onset_share"] = round(e["onset_rows"] / max(len(onset_rows), 1), 4)
            e["baseline_share"] = round(e["baseline_rows"] / max(len(base_rows), 1), 4)
    seg = ds.FEATURES.index("mean_segment_length")
    for name, e in sources.items():
        on = [sc.f_on[i, seg] for i, rec in enumerate(onset_rows) if rec[2].source == name]
        e["mean_segment_length"] = {"onset": round(float(np.mean(on)), 2) if on else None,
                                    "baseline_median": ds._r(sc.baselines[name].median[seg])
                                    if name in sc.baselines else None}
    return shards, sources


def _outlier_documents(sc: _RowScores) -> list[dict[str, Any]]:
    """The onset's outlier rows, furthest beyond a fence first: where each is, its first documents, and
    the features beyond their fences (values, and by how many IQR)."""
    f_on, z_on = sc.f_on, sc.z_on
    docs = []
    order = np.argsort(-np.nanmax(np.abs(np.nan_to_num(z_on, nan=0.0)), axis=1)) if len(sc.onset_rows) else []
    for i in order:
        if not sc.out_on[i]:
            continue
        s, pos, ref, row = sc.onset_rows[i]
        worst = {f: round(float(f_on[i, j]), 4) for j, f in enumerate(ds.FEATURES)
                 if f in ds.ROW_FEATURES and np.isfinite(z_on[i, j]) and z_on[i, j] != 0}
        docs.append({"step": s, "row": pos, "source": ref.source, "shard": ref.shard,
                     "record_in_shard": ref.record_in_shard, "documents": list(row.doc_keys)[:4], "values": worst,
                     "beyond_fence": {f: round(float(z_on[i, j]), 2) for j, f in enumerate(ds.FEATURES)
                                      if f in worst}})
    return docs


def check_data(run: RunLog, rebuilt: Rebuilt, lo: int, step: int, onset: int, cfg: TriageConfig) -> Check:
    """Check 3 (module docstring)."""
    if not rebuilt.available:
        return Check("data", "not available", f"the run's batches cannot be rebuilt: {rebuilt.reason}")
    data = rebuilt.loader
    first, last = judged_steps(lo, step, onset, cfg)
    onset_steps = [s for s in range(first, last + 1) if s in run.fingerprints]
    base_steps = _sample([s for s in range(lo, first) if s in run.fingerprints], cfg.baseline_steps)
    if not base_steps:
        return Check("data", "not available", f"no earlier step in the window {lo}..{step} for a baseline "
                                              f"(onset {onset}): give a longer --window or a later --step")
    differ = [s for s in onset_steps + base_steps if run.fingerprints[s].batch_hash != rebuilt(s)]
    if any(s in onset_steps for s in differ):
        return Check("data", "not available",
                     f"the rows the loader rebuilds are not those trained: the logged batch hashes differ at steps "
                     f"{differ[:8]} (a data-order fault: see the events check)", evidence={"hash_mismatch": differ})
    sc = _score_rows(data, onset_steps, base_steps, cfg)
    onset_rows, base_rows, out_on, out_base = sc.onset_rows, sc.base_rows, sc.out_on, sc.out_base
    shards, sources = _tally(sc)
    bad_shards = sorted((n for n, e in shards.items()
                         if e["onset_outliers"] >= cfg.shard_rows and e["onset_outliers"] >= cfg.shard_share * e["onset_rows"]),
                        key=lambda n: (-shards[n]["onset_outliers"], n))
    altered = _altered_shards(data, bad_shards)
    docs = _outlier_documents(sc)
    dup = duplicates(onset_rows, base_rows, cfg.duplicate_alpha)
    dup_rows, dup_docs = dup["rows"], dup["documents"]
    copies = {sh: f.message for f in _copied_shards(data) for sh in f.shards}
    evidence = {"onset_steps": onset_steps, "baseline_steps": base_steps,
                "baseline": {n: b.to_dict() for n, b in sc.baselines.items()},
                "rows": {"onset": len(onset_rows), "baseline": len(base_rows)},
                "outliers": {"onset": int(out_on.sum()), "baseline": int(out_base.sum())},
                "shards": shards, "sources": sources, "suspect_shards": bad_shards, "altered_shards": altered,
                "outlier_documents": docs[:20], "duplicate_rows": dup_rows, "duplicate_documents": dup_docs,
                "duplicates": {k: dup[k] for k in ("onset", "baseline", "p", "suspect", "shards")},
                "shard_copies": sorted({sh for sh in dup["shards"] if sh in copies}),
                "byte_fallback": "available" if sc.pieces is not None else "not available (no SentencePiece model)"}
    lines = [f"{len(onset_rows)} rows of steps {onset_steps[0] if onset_steps else onset}.."
             f"{onset_steps[-1] if onset_steps else step} against {len(base_rows)} rows of {len(base_steps)} earlier "
             f"steps: {int(out_on.sum())} outlier row(s) (baseline: {int(out_base.sum())})"]
    lines += _data_lines(shards, bad_shards, altered, docs, dup, copies)
    subject = {"shards": bad_shards, "documents": [k for d in docs[:10] for k in d["documents"]],
               "sources": sorted({d["source"] for d in docs})} if bad_shards else {}
    if dup["suspect"] and not bad_shards:  # duplicated rows: the shards and documents they came from
        subject = {"shards": dup["shards"], "documents": sorted({k for d in dup_rows for k in d["documents"]})[:10],
                   "sources": sorted({sh.split("/")[0] for sh in dup["shards"]}), "duplicated": True}
    a, b = (onset_steps[0], onset_steps[-1] + 1) if onset_steps else (onset, step + 1)
    command = f"replay inspect --run {shlex.quote(run.run_dir)} --steps {a}:{b} --text"
    if bad_shards:
        summary = (f"shard(s) {', '.join(bad_shards[:3])} gave {sum(shards[n]['onset_outliers'] for n in bad_shards)}"
                   f" outlier row(s) at the onset")
        return Check("data", "suspect", summary, lines, evidence, subject, command)
    if dup["suspect"]:
        summary = (f"duplicated rows at the onset: {dup['onset']['pairs']} identical pair(s) among "
                   f"{dup['onset']['rows']} rows, above the baseline's {dup['baseline']['pairs']} among "
                   f"{dup['baseline']['rows']} (p {dup['p']:.2g}), from shard(s) {', '.join(dup['shards'][:3])}"
                   + (" (copies of other shards: the same sha256)" if evidence["shard_copies"] else ""))
        return Check("data", "suspect", summary, lines, evidence, subject, command)
    return Check("data", "clear", f"the onset's {len(onset_rows)} rows look like the {len(base_rows)} baseline rows"
                                  + (f" ({int(out_on.sum())} scattered outlier row(s))" if out_on.sum() else ""),
                 lines, evidence, {}, command)


def _data_lines(shards: Mapping[str, Mapping[str, Any]], bad_shards: Sequence[str], altered: Sequence[str],
                docs: Sequence[Mapping[str, Any]], dup: Mapping[str, Any], copies: Mapping[str, str]) -> list[str]:
    """The data check's evidence in words after its first line: the suspect shards, the first outlier
    rows, the duplicated rows and the shards that are copies of others."""
    lines = []
    for n in bad_shards:
        e = shards[n]
        lines.append(f"shard {n}: {e['onset_outliers']} of its {e['onset_rows']} onset row(s) are outliers"
                     + (" ; its file's sha256 differs from the manifest's (altered after packing)" if n in altered
                        else ""))
    for d in docs[:5]:
        lines.append(f"step {d['step']} row {d['row']} ({d['shard']} record {d['record_in_shard']}): "
                     f"{', '.join(d['documents'])}: {d['values']} (beyond the fences by {d['beyond_fence']} IQR)")
    if dup["onset"]["pairs"] or dup["baseline"]["pairs"]:
        rate = lambda d: f"{d['pairs']} identical pair(s) among {d['rows']} rows"  # noqa: E731
        lines.append(f"duplicated rows: {rate(dup['onset'])} at the onset against {rate(dup['baseline'])} of the "
                     f"baseline (p {dup['p']:.2g} under the baseline's pair rate"
                     + ("; above it" if dup["suspect"] else "") + ")")
    for sh in dup["shards"]:
        if sh in copies:
            lines.append(f"shard {sh}: {copies[sh]}")
    if dup["suspect"]:
        for d in dup["rows"][:5]:
            lines.append(f"step {d['step']} row {d['row']} ({d['shard']} record {d['record_in_shard']}) repeats step "
                         f"{d['same_as'][0]} row {d['same_as'][1]}: {', '.join(d['documents'])}")
    return lines


def _copied_shards(data: Any) -> list[Any]:
    """The manifest's shards that share a sha256 (``contract.duplicates``: the same rows stored again)."""
    from contract import duplicates as cdup

    return [f for f in cdup.find(data.manifest, 1.0) if f.kind == "shared_sha256"]


def _altered_shards(data: Any, shards: Sequence[str]) -> list[str]:
    """Of ``shards``, those whose file's sha256 is not the manifest's (local datasets only)."""
    from loader.dataset import file_sha256

    out = []
    want = {sh.path: sh.sha256 for e in data.manifest.sources.values() for sh in e.shards}
    for n in shards:
        path = os.path.join(str(data.dataset), n)
        if n in want and os.path.isfile(path) and file_sha256(path) != want[n]:
            out.append(n)
    return out


def _row_key(row) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(row.tokens).tobytes())
    h.update(np.asarray(row.segment_lengths, np.int64).tobytes())
    return h.hexdigest()


def poisson_tail(k: int, lam: float) -> float:
    """``P(X >= k)`` for ``X ~ Poisson(lam)`` (1.0 for ``k <= 0``)."""
    if k <= 0:
        return 1.0
    if lam <= 0:
        return 0.0
    term = total = math.exp(-lam)
    for i in range(1, k):
        term *= lam / i
        total += term
    return max(0.0, 1.0 - total)


def duplicates(onset_rows: Sequence, base_rows: Sequence, alpha: float) -> dict[str, Any]:
    """Rows repeated at the onset against the baseline's rate (check 3).

    A row is duplicated when its tokens and segment lengths equal another row's of the same set (the
    onset's rows, or the baseline's). The sets differ in size, so each is judged by its pair rate:
    identical pairs over ``n (n - 1) / 2`` pairs. The onset's identical pairs are set against a
    Poisson count with the baseline's rate (``(pairs + 0.5) / possible pairs``: half a pair, so a
    baseline with none does not make one repeat significant); ``p`` below ``alpha`` with at least 2
    pairs is a finding. Documents repeat when one (document key, chunk index) is in two rows: the
    chunks of one split document are different pieces, never duplicates of each other.

    Args:
      onset_rows, base_rows: ``(step, position, RowRef, row)`` each (``contract.codec`` rows).

    Returns:
      ``{"onset": {"rows", "pairs", "rate"}, "baseline": {...}, "p", "suspect", "rows" (each onset row
      that repeats an earlier row: step, row, same_as, shard, documents), "documents" (each repeated
      (key, chunk) with its rows), "shards" (of the repeated onset rows, most first)}``.
    """
    def pairs(rows):
        seen: dict[str, list] = {}
        for rec in rows:
            seen.setdefault(_row_key(rec[3]), []).append(rec)
        return seen, sum(len(v) * (len(v) - 1) // 2 for v in seen.values())

    on_groups, k_on = pairs(onset_rows)
    base_groups, k_b = pairs(base_rows)
    n_on, n_b = len(onset_rows), len(base_rows)
    possible_on, possible_b = n_on * (n_on - 1) // 2, n_b * (n_b - 1) // 2
    q0 = (k_b + 0.5) / possible_b if possible_b else 1.0
    p = poisson_tail(k_on, q0 * possible_on)
    rows, shards = [], {}
    for group in on_groups.values():
        for rec in group[1:]:
            s, pos, ref, row = rec
            rows.append({"step": s, "row": pos, "same_as": [group[0][0], group[0][1]], "shard": ref.shard,
                         "record_in_shard": ref.record_in_shard, "documents": list(row.doc_keys)[:4]})
        if len(group) > 1:
            for rec in group:
                shards[rec[2].shard] = shards.get(rec[2].shard, 0) + 1
    keys: dict[tuple[str, int], list] = {}
    for s, pos, _, row in list(base_rows) + list(onset_rows):
        for key, chunk in zip(row.doc_keys, np.asarray(row.chunk_indices).tolist()):
            keys.setdefault((key, int(chunk)), []).append([s, pos])
    docs = [{"document": k, "chunk": c, "rows": v} for (k, c), v in keys.items() if len(v) > 1]
    return {"onset": {"rows": n_on, "pairs": k_on, "rate": k_on / possible_on if possible_on else None},
            "baseline": {"rows": n_b, "pairs": k_b, "rate": k_b / possible_b if possible_b else None},
            "p": p, "suspect": k_on >= 2 and p < alpha, "rows": sorted(rows, key=lambda r: (r["step"], r["row"])),
            "documents": docs[:20], "shards": sorted(shards, key=lambda n: (-shards[n], n))}


# ----------------------------------------------------------------------------- 4. router


def _router_figure(signals: Mapping[int, Any], s: int, i: int, f: str) -> float:
    return float(getattr(signals[s].router[i], f))


def _judge_layer(signals: Mapping[int, Any], i: int, base: Sequence[int], on: Sequence[int], health: sc.RouterHealth,
                 cfg: TriageConfig) -> tuple[dict[str, Any], list[str], float, Optional[int]]:
    """Layer ``i``'s steps ``on`` against the steps ``base`` before them (module docstring, check 4):
    ``(evidence, reasons in words, strength, first step of on that departs or None)``."""
    W = max(int(health.window_steps), 1)  # shares judged over the run config's window, as replay scan does

    def col(steps, f):
        return np.asarray([_router_figure(signals, s, i, f) for s in steps if i < len(signals[s].router)], float)

    # the onset's worst against the baseline's worst: a router's logits and confidence drift as it
    # learns, and only a departure past anything the steps before saw is instability
    ent_b, ent_o = float(np.nanmin(col(base, "entropy"))), float(np.nanmin(col(on, "entropy")))
    lg_b, lg_o = float(np.nanmax(col(base, "max_logit"))), float(np.nanmax(col(on, "max_logit")))
    z_b, z_o = float(np.nanmax(col(base, "z_loss"))), float(np.nanmax(col(on, "z_loss")))
    dr_b, dr_o = float(np.nanmax(col(base, "dropped_fraction"))), float(np.nanmax(col(on, "dropped_fraction")))

    def mean_shares(end):  # each expert's mean share over the window ending at ``end``
        span = [s for s in range(end - W + 1, end + 1) if s in signals and i < len(signals[s].router)]
        return np.mean([signals[s].router[i].expert_share for s in span], axis=0)

    def windowed(end):  # the busiest expert's share x E over the window (1: uniform, E: all to one)
        shares = mean_shares(end)
        return float(np.max(shares) * len(shares))

    ratio = windowed(on[-1])
    base_ratio = float(np.max([windowed(b) for b in base]))
    on_shares = np.mean([signals[s].router[i].expert_share for s in on if i < len(signals[s].router)], axis=0)
    base_shares = np.mean([signals[s].router[i].expert_share for s in base if i < len(signals[s].router)], axis=0)
    E = len(on_shares)
    dead = [e for e in range(E) if on_shares[e] * E < cfg.dead_share and base_shares[e] * E >= cfg.dead_share]
    drop = 1 - ent_o / ent_b if ent_b > 0 else 0.0
    growth = lg_o / lg_b if lg_b > 0 else math.inf
    zg = z_o / z_b if z_b > 0 else math.inf
    rec = {"entropy": [round(ent_b, 4), round(ent_o, 4)], "max_logit": [round(lg_b, 4), round(lg_o, 4)],
           "z_loss": [round(z_b, 4), round(z_o, 4)], "dropped_fraction": [round(dr_b, 5), round(dr_o, 5)],
           "share_ratio": [round(base_ratio, 3) if math.isfinite(base_ratio) else None,
                           round(ratio, 3) if math.isfinite(ratio) else None],
           "expert_share_x_E": [[round(float(x) * E, 4) for x in base_shares], [round(float(x) * E, 4) for x in on_shares]],
           "baseline_steps": [base[0], base[-1]], "judged_steps": [on[0], on[-1]],
           "compared": "baseline worst, onset worst"}
    why, strength = [], 0.0
    if drop > cfg.entropy_drop:
        why.append(f"entropy fell {drop:.0%} below the lowest of steps {base[0]}..{base[-1]} ({ent_b:.3f} -> "
                   f"{ent_o:.3f} nats)")
        strength = max(strength, drop / cfg.entropy_drop)
    if growth > cfg.logit_growth:
        why.append(f"max router logit {growth:.1f}x the largest of steps {base[0]}..{base[-1]} ({lg_b:.2f} -> {lg_o:.2f})")
        strength = max(strength, growth / cfg.logit_growth)
    if zg > cfg.z_loss_growth:
        why.append(f"z-loss {zg:.1f}x the largest of steps {base[0]}..{base[-1]} ({z_b:.3g} -> {z_o:.3g})")
        strength = max(strength, zg / cfg.z_loss_growth)
    if dr_o > health.max_dropped_fraction and dr_o > cfg.dropped_surge * dr_b:
        why.append(f"dropped fraction surged to {dr_o:.3f} (the most before: {dr_b:.3f}, limit "
                   f"{health.max_dropped_fraction:g})")
        strength = max(strength, dr_o / max(health.max_dropped_fraction, 1e-9))
    if ratio > health.max_share_ratio and ratio > cfg.share_growth * base_ratio:
        why.append(f"one expert takes {ratio:.1f}x its uniform share over the last {W} step(s) (band "
                   f"{health.max_share_ratio:g}x; the most before: {base_ratio:.1f}x)")
        strength = max(strength, ratio / health.max_share_ratio)
    for e in dead:
        why.append(f"expert {e} is dead: {on_shares[e] * E:.3f}x its uniform share over steps {on[0]}..{on[-1]} "
                   f"(floor {cfg.dead_share:g}x; {base_shares[e] * E:.2f}x before)")
        strength = max(strength, 1.0 + cfg.dead_share / max(on_shares[e] * E, 1e-9) / 10)

    def departs(s):
        L = signals[s].router[i] if i < len(signals[s].router) else None
        return L is not None and bool(
            L.entropy < (1 - cfg.entropy_drop) * ent_b or L.max_logit > cfg.logit_growth * lg_b
            or L.z_loss > cfg.z_loss_growth * z_b
            or L.dropped_fraction > max(health.max_dropped_fraction, cfg.dropped_surge * dr_b)
            or windowed(s) > max(health.max_share_ratio, cfg.share_growth * base_ratio)
            or any(mean_shares(s)[e] * E < cfg.dead_share for e in dead))

    first_bad = next((s for s in on if departs(s)), on[0]) if why else None
    rec["departs"] = [s for s in on if departs(s)] if why else []
    return rec, why, strength, first_bad


def check_router(signals: Optional[Mapping[int, Any]], lo: int, step: int, onset: int, health: sc.RouterHealth,
                 cfg: TriageConfig) -> Check:
    """Check 4 (module docstring): the steps of :func:`judged_steps` against the steps before them.

    The baseline is the window's steps before the judged ones; when that finds nothing, the departure
    may have begun before the judged steps (a fault that hides itself once it is in the baseline):
    for each step ``c`` of the ``router_lookback`` steps before them (earliest first, with at least
    ``MIN_ROUTER_BASE`` steps before it), the steps from ``c`` on are judged against the steps before
    ``c``, and a layer whose every step from ``c`` to the last judged one departs is a finding from
    step ``c`` (also when the judged steps alone depart from their first one: the departure is dated
    from where it began). Judged steps whose router figures are not finite (NaN entropy, an infinite max logit)
    are never within bounds: the check says they are not judged."""
    if not signals or not any(signals[s].router for s in signals if lo <= s <= step):
        return Check("router", "not available", "no per-layer router figures in signals.jsonl")
    first, last = judged_steps(lo, step, onset, cfg)
    base = [s for s in range(max(lo, health.warmup_steps), first) if s in signals and signals[s].router]
    on = [s for s in range(first, last + 1) if s in signals and signals[s].router]
    if not base or not on:
        if lo > health.warmup_steps:  # the window cut the baseline off: a longer one reaches it
            fix = "give a longer --window"
        else:  # the judged steps start within the warm-up: no window reaches a baseline
            fix = (f"the judged steps {first}..{last} start at or before the end of the router's warm-up, so "
                   f"no longer --window helps; triage a step after {health.warmup_steps + cfg.onset_steps - 1} "
                   f"(or lower router_health.warmup_steps in the run config)")
        return Check("router", "not available", f"no router baseline before step {first} after warm-up "
                                                f"(warmup_steps {health.warmup_steps}): {fix}")
    layers = max(len(signals[s].router) for s in on)
    figures = ("entropy", "max_logit", "z_loss", "dropped_fraction")
    bad = {(s, i): [f for f in figures if not math.isfinite(_router_figure(signals, s, i, f))]
           for s in on for i in range(len(signals[s].router))}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        steps_bad = sorted({s for s, _ in bad})
        (s0, i0), fs = min(bad.items())
        vals = ", ".join(f"{f} {_router_figure(signals, s0, i0, f)}" for f in fs)
        return Check("router", "not available",
                     f"router figures are not finite at step(s) {steps_bad[:8]} (layer {i0} at step {s0}: {vals}): "
                     "not judged, never within bounds; a non-finite forward pass makes every figure so",
                     [f"layer {i} at step {s}: not finite: {', '.join(f)}" for (s, i), f in sorted(bad.items())][:8],
                     {"nonfinite": [{"step": s, "layer": i, "figures": f} for (s, i), f in sorted(bad.items())]})
    finite_base = [s for s in base if all(math.isfinite(_router_figure(signals, s, i, f)) for i in
                                          range(len(signals[s].router)) for f in figures)]
    base = finite_base or base
    found, evidence = [], {}
    for i in range(layers):
        rec, why, strength, first_bad = _judge_layer(signals, i, base, on, health, cfg)
        if not why or first_bad == on[0]:  # the departure may have begun before the judged steps (docstring)
            for c in [s for s in base[MIN_ROUTER_BASE:] if s >= first - cfg.router_lookback]:
                base_c = [s for s in base if s < c]
                span = [s for s in base if s >= c] + list(on)
                r2, w2, st2, _ = _judge_layer(signals, i, base_c, span, health, cfg)
                if w2 and r2["departs"] == span:
                    rec, why, strength, first_bad = r2, w2, st2, c
                    rec["looked_back"] = True
                    break
        evidence[f"layer {i}"] = rec
        if why:
            rec["first_step"] = first_bad
            found.append((strength, i, why, first_bad))
    found.sort(key=lambda x: (-x[0], x[1]))
    lines = [f"layer {i} from step {f}: {'; '.join(w)}" for _, i, w, f in found] or [
        f"{layers} layer(s) within bounds over steps {on[0]}..{on[-1]} against {len(base)} baseline steps, and no "
        f"departure began in the {cfg.router_lookback} steps before them"]
    if found:
        return Check("router", "suspect", f"layer(s) {[i for _, i, _, _ in found]} unstable from step {found[0][3]}: "
                                          f"{found[0][2][0]}", lines, evidence,
                     {"layers": [i for _, i, _, _ in found], "first_step": found[0][3],
                      "strength": round(found[0][0], 3)})
    return Check("router", "clear", f"{layers} layer(s) within bounds at the onset", lines, evidence)


# ----------------------------------------------------------------------------- conclusion


def check_input(signals: Optional[Mapping[int, Any]], lo: int, step: int, onset: int,
                cfg: sc.ScreeningConfig) -> Check:
    """Whether the steps from the onset to ``step`` met a drained input buffer: the loader's
    ``loader_occupancy`` 0 at the ask and a wait past the stall threshold (``replay scan``'s
    ``input`` check), naming the loader stage that held those waits most. ``suspect`` then
    says the step was slow because its data was late (the pipeline, not the model); it is no
    cause of a loss spike and :func:`conclude` does not weigh it."""
    from replay.screen.scan import STAGE_ADVICE, STAGE_WORDS, input_stages

    steps = [s for s in range(lo, step + 1) if signals and s in signals]
    if not steps or all(signals[s].loader_occupancy is None for s in steps):
        return Check("input", "not available", "no buffer occupancy in signals.jsonl (an older trainer or writer)")
    wait = np.array([np.nan if signals[s].loader_wait_s is None else signals[s].loader_wait_s for s in steps])
    st = np.array([np.nan if signals[s].step_time_s is None else signals[s].step_time_s for s in steps])
    skip = np.array([not (signals[s].loader_occupancy == 0 and s >= onset) for s in steps])
    drained = [steps[i] for i in sc.loader_stalls(wait, st, skip, cfg)]
    if not drained:
        return Check("input", "clear", f"the buffer held a batch at every ask from step {onset} to {step} "
                                       "(or the waits were under the stall threshold)")
    stages = input_stages(signals, drained)
    top = max(stages, key=stages.get) if stages else None
    total = float(sum(signals[s].loader_wait_s for s in drained))
    where = (f"{STAGE_WORDS.get(top, top)} held {stages[top] / sum(stages.values()):.0%} of the wait" if top
             else "where the wait went is not logged")
    return Check("input", "suspect",
                 f"the input buffer was empty at {len(drained)} step(s) {drained[:6]}, {total:.2f} s waited: {where}",
                 lines=[f"step {s}: waited {signals[s].loader_wait_s:.3f} s, buffer empty at the ask" for s in drained[:6]]
                 + ([STAGE_ADVICE[top]] if top in STAGE_ADVICE else []),
                 evidence={"drained_steps": drained, "wait_s": total, "stages_s": stages},
                 subject={"stage": top, "steps": drained})


def skip_plan(run: RunLog, onset: int, step: int) -> Optional[dict[str, Any]]:
    """The rewind and skip of an optimization event: the newest lineage checkpoint ``C <= onset`` and
    the data window ``[A, B)`` = ``[onset, step + 1 + (step + 1 - onset))`` (the data that fed the spike
    and as many steps again, the PaLM recipe scaled to the spike's length), starting after the run's
    last skip window; None when no checkpoint precedes the onset. Only checkpoints before the onset whose
    state record says finite and agreeing count (:func:`trustworthy_checkpoints`)."""
    ckpts = trustworthy_checkpoints(run, onset)
    if not ckpts:
        return None
    windows = [tuple(w) for w in run.config.get("skip_windows") or []]
    a = max([onset] + [int(w[1]) + 1 for w in windows])
    b = max(a + 1, step + 1 + (step + 1 - onset))
    c = ckpts[-1]
    return {"checkpoint": c, "start": a, "stop": b, "steps_rewound": max(0, run.lineage.end - c) if run.lineage else None}


def trustworthy_checkpoints(run: RunLog, onset: int) -> list[int]:
    """The lineage checkpoints a rewind may target before ``onset``: strictly before it (a checkpoint at
    the onset holds the state the bad step started from), with a state record (``checkpoint`` event's
    ``state``: a run from before records has none, so nothing vouches for it) that says its state was
    finite and its replicas agreed; ascending. A restore checks the files against the same record."""
    state = {int(e["step"]): e.get("state") for e in run.events
             if e.get("event") == "checkpoint" and isinstance(e.get("step"), int)}
    return [c for c in run.checkpoints if c < onset and isinstance(state.get(c), Mapping)
            and state[c].get("finite") is True and state[c].get("replicas_agree", True) is True]


def skip_command(run_dir: str, plan: Mapping[str, Any], step: int) -> str:
    return shlex.join(["replay", "skip", "--run", run_dir, "--steps", f"{plan['start']}:{plan['stop']}",
                       "--checkpoint", str(plan["checkpoint"]),
                       "--reason", f"loss spike at step {step}: replay triage found no fault (optimization event)"])


def conclude(checks: Mapping[str, Check], *, run_dir: str, step: int, onset: int, loss_finite: bool,
             plan: Optional[Mapping[str, Any]], spike_found: bool = True) -> Conclusion:
    """The cause, its confidence and the next command from the four checks (module docstring: the
    order restart fault, hardware, data, router, optimization event). With no cause found and no loss
    spike at ``step`` (``spike_found`` False, a finite loss), nothing is advised: a rewind only pays for a
    real spike, so the next command is ``replay scan``, which lists the spikes."""
    ev, rep, data, router = (checks[k] for k in CHECKS)
    suspects = [c for c in (ev, rep, data, router) if c.status == "suspect"]
    also = []
    quoted = shlex.quote(run_dir)
    restores = ev.subject.get("restores") or []
    hw_devices = rep.subject.get("devices") or ev.subject.get("devices") or []
    spikes_only = rep.status == "suspect" and set(rep.subject.get("evidence", [])) <= {"norm_spike"}
    hardware = (rep.status == "suspect" and not (spikes_only and data.status == "suspect")) or \
        bool(ev.subject.get("devices"))
    if restores:
        f = restores[0]
        cause, conf = "restart", "high"
        n = abs(f["offset"]) if f.get("offset") else None
        how = f"{f['verdict']} {n} step(s) of data" if n else "resumed with data that is not the lineage's"
        expl = (f"the restore at step {f['step']} (checkpoint {f['checkpoint']}) {how}: a restart or data-order "
                "fault, found by the exact restore check")
        cmd = shlex.join(["python", "-m", "replay.reference.train", "--run", run_dir, "--from-checkpoint",
                          str(f["checkpoint"]), "--reason", f"restore at step {f['step']} {f['verdict']} data"])
        advice = (f"roll back to checkpoint {f['checkpoint']} and resume with the loader state saved with it (the "
                  "trainer that restored it must restore the loader's state with the model's)")
        subject = {"restores": restores}
    elif hardware:
        cause = "hardware"
        convicted = rep.subject.get("convicted")
        conf = "high" if convicted or ev.subject.get("devices") else "medium"
        first = rep.subject.get("first_step")
        expl = (f"device(s) {hw_devices} " + ("convicted by the range replay" if convicted else
                                               "named by " + ("the canary" if ev.subject.get("devices") else
                                                              "the replica checks"))
                + (f" from step {first}" if first is not None else ""))
        if convicted:
            cmd = f"replay canary --run {quoted} --devices all --repeats 3"
            advice = (f"quarantine device(s) {hw_devices} (echo {' '.join(map(str, hw_devices))} >> "
                      f"{os.path.join(run_dir, 'quarantine.txt')}), check the others with the canary, and resume "
                      "from a checkpoint before the first divergent step on good devices")
        else:
            cmd = rep.command or f"replay --run {quoted} --steps {onset}:{step + 1} --devices good"
            advice = "replay the range on good devices: a conviction names the device, step and tensor"
        subject = {"devices": hw_devices, "first_step": first}
    elif data.status == "suspect":
        cause = "data"
        conf = "high" if data.evidence.get("altered_shards") or data.evidence.get("shard_copies") else "medium"
        shards = data.subject.get("shards", [])
        expl = (("duplicated rows" if data.subject.get("duplicated") else "outlier rows")
                + f" from shard(s) {', '.join(shards[:3])} at the onset"
                + ("; shard(s) " + ", ".join(data.evidence["shard_copies"][:3]) + " share a sha256 with other shards "
                   "(the same rows stored again)" if data.evidence.get("shard_copies") else "")
                + ("; " + ", ".join(data.evidence["altered_shards"]) + " altered after packing (sha256 differs "
                   "from the manifest)" if data.evidence.get("altered_shards") else ""))
        cmd = data.command
        advice = (("read the duplicated documents" if data.subject.get("duplicated") else "read the outlier documents")
                  + "; then skip the window (" + (skip_command(run_dir, plan, step) if plan else "replay skip")
                  + ") or repack the shard")
        subject = dict(data.subject)
    elif router.status == "suspect":
        cause, conf = "router", "medium"
        layers = router.subject.get("layers", [])
        expl = (f"router instability in layer(s) {layers} from step {router.subject.get('first_step', onset)}: "
                f"{router.summary.split(': ', 1)[-1]}")
        cmd = f"replay scan --run {quoted} --steps {max(0, onset - 50)}:{step + 1} --plot router.png"
        advice = (f"lower the router's learning rate or restore its z-loss for layer {layers[0]}, then rewind to "
                  + (f"checkpoint {plan['checkpoint']}" if plan else "a checkpoint before the onset")
                  + " (python -m replay.reference.train --run DIR --from-checkpoint C)")
        subject = {"layers": layers}
    else:
        cause = "optimization"
        missing = [c.name for c in checks.values() if c.status == "not available"]
        conf = "low" if missing else "medium"
        expl = ("no check found a cause: an optimization event"
                + ("" if loss_finite else " (a non-finite loss: a numerical divergence)")
                + (f"; not available: {', '.join(missing)}" if missing else "")
                + (f"; {ev.evidence['may_explain'][0]} may explain it" if loss_finite and ev.evidence.get(
                   "may_explain") else ""))
        if not spike_found and loss_finite:  # a healthy step: nothing to undo
            expl += f"; and no loss spike at step {step}"
            cmd = f"replay scan --run {quoted}"
            advice = ("no rewind: the loss check finds no spike here, and a rewind only pays for a real one; "
                      "'replay scan' lists the run's loss spikes: triage one of those")
            subject = {}
        else:
            cmd = skip_command(run_dir, plan, step) if plan else None
            advice = (f"rewind to checkpoint {plan['checkpoint']} and skip the data of steps {plan['start']}.."
                      f"{plan['stop'] - 1}" if plan else "no checkpoint before the onset whose state record says it "
                      "is finite and verified to rewind to (run 'replay certify' on the run)")
            subject = dict(plan or {})
    for c in suspects:
        if c.name not in {"restart": "events", "hardware": "replicas", "data": "data", "router": "router"}.get(cause, ""):
            if not (cause == "hardware" and c.name == "events" and ev.subject.get("devices")):
                also.append(f"{c.name}: {c.summary}")
    return Conclusion(cause=cause, confidence=conf, explanation=expl, subject=subject, command=cmd, advice=advice,
                      exit_code=int(CAUSE_CODES[cause]), also=tuple(also))


# ----------------------------------------------------------------------------- triage


def triage_run(run: RunLog, step: int, *, window: Optional[int] = None, replay: bool = False,
               device_spec: str = "good", session: Any = None, config: TriageConfig = TriageConfig(),
               progress: Optional[Callable[[int], Callable[[int], None]]] = None) -> TriageReport:
    """Walks the spike at ``step`` (module docstring).

    Args:
      run: a loaded run directory (its lineage).
      step: the spike's step (a lineage step).
      window: steps before ``step`` to look at (default ``config.window``).
      replay: run the range replay on ``device_spec`` devices (needs a ``session``, built when None).
      session: a ``replay.verify.engine.Session`` (its loader rebuilds batches; default: built from the run).
      progress: a ``total -> advance`` factory for the range replay's progress.

    Raises:
      StepRangeError: ``step`` is not a logged step of the lineage, or its line is malformed or damaged.
      RunDirError: a malformed log or run config.
    """
    from replay.run.runlog import StepRangeError
    from replay.screen.scan import _run_thresholds, lineage_screening_logs, scan_run

    first, end = run.logged_steps
    if not first <= step < end:
        raise StepRangeError.outside(step, step + 1, first, end, run.run_dir)
    if step in run.malformed:  # its loss is not known: judged as a missing line it would read as non-finite
        raise StepRangeError(f"step {step}: its logged fingerprints are malformed ({run.malformed[step]}); triage "
                             "cannot judge it (a damaged log, not a device fault): triage a step whose line is intact")
    w = config.window if window is None else int(window)
    if w < 1:
        raise TriageConfigError(f"--window: must be >= 1, got {w}")
    lo = max(first, step - w)
    health, scfg = _run_thresholds(run)
    onset, spikes = find_onset(run, lo, step, scfg, config.onset_steps)
    spike_found = any(step - config.onset_steps < s <= step for s in spikes)
    loss = _loss_of(run, step)
    onset_loss = [_loss_of(run, s) for s in range(onset, step + 1) if s in run.fingerprints]
    finite = all(math.isfinite(x) for x in onset_loss)
    if session is None:
        from replay.verify import engine

        def make():
            return engine.Session(run).lookup_loader()
    else:
        make = session.lookup_loader
    rebuilt = Rebuilt(make)
    scan = scan_run(run, lo, step + 1)
    stalls = [{"steps": [e.first_step, e.last_step], "detail": e.detail} for s in scan.suspects if s.kind == "loader"
              for e in s.evidence]
    checks = {"events": check_events(run, lo, step, onset, finite, rebuilt, stalls, config)}
    rep_report = None
    if replay:
        from replay.verify import engine

        sess = session or engine.Session(run)
        sus = [s for s in scan.suspects if s.kind in ("device", "replica")]
        a = max(lo, min([s.first_step for s in sus] + [onset]))
        rep_report = engine.replay_range(sess, a, step + 1, device_spec=device_spec, allow_env_drift=True,
                                         progress=progress)
    checks["replicas"] = check_replicas(run, scan, lo, step, onset, rep_report)
    checks["data"] = check_data(run, rebuilt, lo, step, onset, config)
    signals, canary = lineage_screening_logs(run)
    checks["router"] = check_router(signals, lo, step, onset, health, config)
    checks["input"] = check_input(signals, lo, step, onset, scfg)  # reported beside the others; not a cause
    begin = min([onset] + [c.subject["first_step"] for c in checks.values()
                           if c.status == "suspect" and isinstance(c.subject.get("first_step"), int)])
    plan = skip_plan(run, begin, step)  # a checkpoint before the first sign of trouble
    conclusion = conclude(checks, run_dir=run.run_dir, step=step, onset=onset, loss_finite=finite, plan=plan,
                          spike_found=spike_found)
    series = {"scan": scan, "signals": signals or {}, "canary": canary or [], "spikes": spikes,
              "events": [e for e in run.events if isinstance(e.get("step"), int) and lo <= e["step"] <= step],
              "loss": {s: _loss_of(run, s) for s in range(lo, step + 1) if s in run.fingerprints}}
    return TriageReport(run_dir=run.run_dir, step=step, onset=onset, window=(lo, step + 1), loss=loss, checks=checks,
                        conclusion=conclusion, lineage=run.lineage.describe() if run.lineage else [],
                        skip_plan=plan, judged=judged_steps(lo, step, onset, config), series=series,
                        spike_found=spike_found)
