"""``replay scan``: screen a run from its logs alone (no recompute) and rank the suspects.

Reads the run directory (``replay.run.runlog.load_run``: run config, env, events, fingerprints) and
the screening logs ``signals.jsonl`` and ``canary.jsonl`` (``replay.run.protocol``), runs the checks
below, and returns a :class:`ScanReport`: every check's status (``found``, ``clear`` or ``not
available`` with the reason: a missing signal is never "clear"), the ranked suspects, and the
range replay to run next. Statistics live in ``replay.screen.screening`` (pure); this module gathers the
numbers and words the findings::

    check         signal                                   suspect
    canary        canary.jsonl: a device's signature       the device, from its first mismatching canary
                  differs from the others' / the golden
    nonfinite     signals.jsonl devices[d].nonfinite       the device whose local gradient had NaN/Inf
                  (fingerprints.jsonl: reduced gradient)   while others had none (all devices: the run)
    norm_spike    replica norms, |robust z| > spike_z      the replica's devices, at that step (under expert
                  or a non-finite norm                      parallelism: the device's expert group, expert_groups)
    norm_drift    replica norms, robust CUSUM              the replica's devices (as norm_spike), from the
                                                            change's onset
    expert_drift  signals.jsonl expert_load[layer]:        the expert device whose probe output differs from
                  probe: each expert device's output for    its twins' bit for bit (from that step; floor one
                  a fixed token; output_sq / received       bit; two twins: the pair), or, with its twins and
                  (expert parallelism)                      their expert groups, one whose output per token
                                                            moved against its twins' (robust CUSUM; floor
                                                            EXPERT_DRIFT_FLOOR, benchmarks/campaign.py)
    router        signals.jsonl router[layer]              the layer (dropped fraction, or an expert's share
                  vs run config router_health               outside its band after warm-up: share_band,
                                                            widened on small runs by the window's rows)
    expert_load   signals.jsonl expert_load[layer]:        the layer, naming its most loaded expert device
                  tokens each expert device received        (max / mean over the layer's devices above
                  (expert parallelism)                      router_health.max_expert_load_ratio after warm-up)
    loss_spike    loss (fingerprints.jsonl loss bits)      the run (unless an event explains it: a phase
                                                            change, skip window or restore at that step)
    loader_stall  signals.jsonl loader_wait_s              the loader (a wait above stall_fraction of the
                                                            median step time; a start or restore excepted)
    input         signals.jsonl loader_occupancy (0 at     the loader, naming the stage that held the
                  the ask: the buffer drained) and          drained steps' waits most (storage reads, decode,
                  loader_wait_stages                        rows, transfer; the same thresholds and budget)

Suspects are ranked by the strength of their best evidence's kind, in the order of the table
(a bit-exact canary disagreement first), then by strength. ``suspect_devices`` (written to
``<run>/suspects.json``) are the devices of device and replica suspects: ``--devices suspect``
picks them (with ``quarantine.txt``), ``--devices good`` leaves them out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from replay.runtime import devices as dv
from replay.run import protocol as proto
from replay.screen import screening as sc
from replay.run.runlog import RunDirError, RunLog

CHECKS = ("canary", "nonfinite", "norm_spike", "norm_drift", "expert_drift", "router", "expert_load", "loss_spike",
          "loader_stall", "input")
DEVICE_CHECKS = ("canary", "nonfinite", "norm_spike", "norm_drift", "expert_drift")
EXPLAINING_EVENTS = ("phase_change", "skipped_window", "skip_window_added", "restore", "start")
STRENGTH_CAP = 1e6  # a non-finite score is reported as this


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One check's finding about one subject.

    Attributes:
      check: the check (``CHECKS``); first_step, last_step: the steps it spans; strength: >= 1 at or
        past the check's threshold; detail: in words.
      onset_range: ``(lo, hi)``, the steps the fault's first step could lie in (a drift's change point
        is an estimate; a canary mismatch says only that the device went wrong since its last clean
        canary), or None when ``first_step`` is exact. Never before scoring began.
      before_scoring: the range starts where the check began scoring: the fault may be older.
    """

    check: str
    first_step: int
    last_step: int
    strength: float
    detail: str
    onset_range: Optional[tuple[int, int]] = None
    before_scoring: bool = False

    @property
    def uncertain(self) -> bool:
        """Whether the first step is an estimate with a range of more than one step (or may be older)."""
        return self.onset_range is not None and (self.onset_range[1] > self.onset_range[0] or self.before_scoring)

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "first_step": self.first_step, "last_step": self.last_step,
                "strength": _num(self.strength), "detail": self.detail,
                "onset_range": None if self.onset_range is None else list(self.onset_range),
                "onset_uncertain": self.uncertain, "before_scoring": self.before_scoring}


@dataclasses.dataclass(frozen=True)
class Suspect:
    """A ranked suspect: a device (or replica), a router layer, the loader or the run.

    Attributes:
      kind: ``"device"``, ``"replica"`` (several devices), ``"layer"``, ``"loader"`` or ``"run"``.
      subject: e.g. ``"device 3"``, ``"layer 1"``.
      devices: the device ids it implicates (empty unless device or replica).
      first_step: the earliest step of its evidence.
      strength: its strongest evidence's strength (>= 1 means at or past that check's threshold).
      evidence: every finding about it, strongest kind first.
      next: what to do about it, ``{"command": str or None, "sentence": str}`` (:func:`next_step`).
    """

    kind: str
    subject: str
    devices: tuple[int, ...]
    first_step: int
    strength: float
    evidence: tuple[Evidence, ...]
    next: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # {"command", "sentence"}: what to do next
    named: tuple[dict, ...] = ()  # its devices as an operator finds them (replay.runtime.devices.name_devices)

    def rank_key(self) -> tuple:
        best = min(CHECKS.index(e.check) for e in self.evidence)
        return (best, -self.strength, self.first_step, self.subject)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "subject": self.subject, "devices": list(self.devices),
                "first_step": self.first_step, "strength": _num(self.strength),
                "evidence": [e.to_dict() for e in self.evidence], "next": dict(self.next),
                "named": list(self.named)}


def nonfinite_onset(suspects: Sequence[Suspect]) -> Optional[dict[str, Any]]:
    """The onset of a run-level non-finite finding (every device's gradient NaN/Inf: a numerical
    divergence): its *first* non-finite step, exact; None without one."""
    found = [e for s in suspects if s.kind == "run" for e in s.evidence if e.check == "nonfinite"]
    if not found:
        return None
    first = min(e.first_step for e in found)
    return {"step": first, "range": [first, first], "uncertain": False, "check": "nonfinite", "devices": []}


def _num(v: float) -> Any:
    return None if v is None else (round(float(v), 4) if math.isfinite(v) else STRENGTH_CAP)


@dataclasses.dataclass
class ScanReport:
    """What ``replay scan`` found (``to_dict`` is the JSON report and ``suspects.json``)."""

    run_dir: str
    steps: tuple[int, int]
    checks: dict[str, dict[str, str]]
    suspects: list[Suspect]
    explained: list[dict[str, Any]]
    suggestion: Optional[str]
    figures: dict[str, Any]
    series: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    limits: dict[str, Any] = dataclasses.field(default_factory=dict)
    lineage: list[str] = dataclasses.field(default_factory=list)  # the superseded attempts, a sentence each

    @property
    def suspect_devices(self) -> list[int]:
        return sorted({d for s in self.suspects if s.kind in ("device", "replica") for d in s.devices})

    @property
    def onset(self) -> Optional[dict[str, Any]]:
        """Where a range replay should look first: the top device suspect's earliest evidence, its first
        step and the range it could lie in (``replay.verify.plan.Onset``), or None without one."""
        top = next((s for s in self.suspects if s.kind in ("device", "replica")), None)
        if top is None:
            return nonfinite_onset(self.suspects)
        e = min(top.evidence, key=lambda x: x.first_step)
        lo, hi = e.onset_range or (e.first_step, e.first_step)
        return {"step": e.first_step, "range": [lo, hi], "uncertain": e.uncertain, "check": e.check,
                "devices": list(top.devices)}

    @property
    def exit_code(self) -> int:
        from replay.run.codes import ExitCode

        return int(ExitCode.SUSPECTS if self.suspects else ExitCode.CLEAN)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "scan", "run": self.run_dir, "steps": {"start": self.steps[0], "stop": self.steps[1]},
            "verdict": "suspects" if self.suspects else "clean", "exit_code": self.exit_code,
            "suspect_devices": self.suspect_devices,
            "suspects": [dict(s.to_dict(), rank=i + 1) for i, s in enumerate(self.suspects)],
            "checks": self.checks, "explained": self.explained, "suggested_replay": self.suggestion,
            "onset": self.onset,
            "figures": self.figures, "limits": self.limits, "lineage": self.lineage,
        }


# ----------------------------------------------------------------------------- reading


def read_screening_logs(run_dir: str) -> tuple[Optional[dict[int, proto.StepSignals]], Optional[list[proto.CanaryRecord]]]:
    """``(signals or None, canary records or None)``: None where the file is absent.

    Raises:
      RunDirError: a file is unreadable or has a malformed line (other than a torn last line).
    """
    out = []
    for name, reader in ((proto.SIGNALS_NAME, proto.read_signals), (proto.CANARY_NAME, proto.read_canary)):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            out.append(None)
            continue
        try:
            out.append(reader(run_dir))
        except proto.StepLogLineError as e:  # names the file and line itself
            raise RunDirError(str(e)) from None
        except (ValueError, OSError) as e:
            raise RunDirError(f"{path}: unreadable ({e})") from None
    return out[0], out[1]


def lineage_screening_logs(run: RunLog) -> tuple[Optional[dict[int, proto.StepSignals]],
                                                  Optional[list[proto.CanaryRecord]]]:
    """:func:`read_screening_logs` cut to the run's lineage: no step at or past its end (steps past a
    pending rewind are superseded: ``replay.run.lineage``), no canary after it."""
    signals, canary = read_screening_logs(run.run_dir)
    end = run.lineage.end if run.lineage is not None else None
    if end is not None:
        signals = None if signals is None else {s: v for s, v in signals.items() if s < end}
        canary = None if canary is None else [c for c in canary if c.step <= end]
    return signals, canary


def _run_thresholds(run: RunLog) -> tuple[sc.RouterHealth, sc.ScreeningConfig]:
    try:
        return (sc.RouterHealth.from_dict(run.config.get("router_health")),
                sc.ScreeningConfig.from_dict(run.config.get("screening")))
    except (sc.ScreeningConfigError, TypeError) as e:
        raise RunDirError(f"{os.path.join(run.run_dir, 'run_config.yaml')}: {e}") from None


# ----------------------------------------------------------------------------- checks


def _device_names(devs) -> str:
    return ("device " if len(devs) == 1 else "devices ") + ",".join(str(d) for d in devs)


def _canary(canary: Optional[list[proto.CanaryRecord]], start: int, stop: int):
    if canary is None:
        return {"status": "not available", "detail": "no canary.jsonl: the run's canary_every is 0 (or it "
                                                      "predates the periodic canary)"}, [], []
    recs = [c for c in canary if c.step < stop]
    bad: dict[int, list[int]] = {}
    ambiguous = []
    for c in recs:
        if c.status in ("differs_from_golden", "differs_from_majority", "repeats_disagree"):
            bad.setdefault(c.device, []).append(c.step)
        elif c.status == "no_majority":
            ambiguous.append(c.step)
    found = []
    for dev, steps in sorted(bad.items()):
        if max(steps) < start:
            continue
        total = len({c.step for c in recs if c.device == dev})
        clean = [c.step for c in recs if c.device == dev and c.status == "ok" and c.step < min(steps)]
        since = max(clean) if clean else None  # the device went wrong after its last clean canary
        found.append((("device", (dev,)), dataclasses.replace(_evidence(
            "canary", min(steps), max(steps), float(len(steps)),
            f"canary differs from the others' bits at {len(steps)} of {total} canaries (first before step "
            f"{min(steps)}" + (f"; clean before step {since}" if since is not None else "") + ")"),
            onset_range=None if since is None else (since, min(steps)))))
    run_level = []
    if ambiguous and max(ambiguous) >= start:
        run_level.append((("run", ()), _evidence("canary", min(ambiguous), max(ambiguous), float(len(ambiguous)),
                         "no majority among the devices' canary results (an environment change, or several "
                         "devices wrong)")))
    n = len({c.step for c in recs})
    status = "found" if found or run_level else "clear"
    return {"status": status, "detail": f"{n} canaries on {len({c.device for c in recs})} devices"}, found, run_level


def _evidence(check, first, last, strength, detail) -> Evidence:
    return Evidence(check=check, first_step=int(first), last_step=int(last), strength=float(strength), detail=detail)


def _nonfinite(run: RunLog, signals, steps: list[int], start: int):
    found, run_level = [], []
    per_dev: dict[int, dict[str, Any]] = {}
    all_dev_steps = []
    if signals is not None:
        for s in steps:
            sig = signals[s]
            hit = {d: v["nonfinite"] for d, v in sig.devices.items() if v.get("nonfinite")}
            if hit and len(hit) == len(sig.devices) and len(sig.devices) > 1:
                all_dev_steps.append(s)
                continue
            for d, leaves in hit.items():
                e = per_dev.setdefault(d, {"steps": [], "count": 0, "leaves": set()})
                e["steps"].append(s)
                e["count"] += sum(leaves.values())
                e["leaves"].update(leaves)
    reduced = [s for s in steps if s in run.fingerprints
               and any(v.get("nan", 0) or v.get("inf", 0) for v in run.fingerprints[s].leaves.values())]
    for d, e in sorted(per_dev.items()):
        if max(e["steps"]) < start:
            continue
        leaves = sorted(e["leaves"])
        found.append((("device", (d,)), _evidence(
            "nonfinite", min(e["steps"]), max(e["steps"]), 1.0 + math.log10(max(e["count"], 1)),
            f"{e['count']} NaN/Inf gradient element(s) in its local contribution at {len(e['steps'])} step(s), "
            f"leaves {leaves[:3]}{' ...' if len(leaves) > 3 else ''}, while the other devices had none")))
    if all_dev_steps and max(all_dev_steps) >= start:
        run_level.append((("run", ()), _evidence("nonfinite", min(all_dev_steps), max(all_dev_steps),
                                                   float(len(all_dev_steps)),
                                                   "every device's local gradient had NaN/Inf: a numerical "
                                                   "divergence of the run, not one device")))
    if signals is None:
        if reduced and max(reduced) >= start:
            run_level.append((("run", ()), _evidence("nonfinite", min(reduced), max(reduced), float(len(reduced)),
                                                     "the reduced gradient had NaN/Inf (per-device counts not "
                                                     "available: no signals.jsonl)")))
        return ({"status": "found" if run_level else "not available",
                 "detail": "per-device counts need signals.jsonl; reduced-gradient counts from fingerprints.jsonl"},
                found, run_level)
    return ({"status": "found" if found or run_level else "clear",
             "detail": f"per leaf and device over {len(steps)} steps; reduced gradient non-finite at "
                       f"{len(reduced)} step(s)"}, found, run_level)


def expert_groups(devs: Sequence[int], coords: Mapping[int, Mapping[str, int]], axis: str = "expert"
                  ) -> dict[int, tuple[int, ...]]:
    """Per device, its expert group: the devices that share its position on every mesh axis but ``axis``
    (itself included), which exchange tokens with it at every all-to-all of an MoE layer. Empty without
    ``axis`` in the coordinates."""
    out = {}
    for d in devs:
        mine = coords.get(d) or {}
        if axis not in mine:
            continue
        key = tuple(sorted((a, i) for a, i in mine.items() if a != axis))
        out[d] = tuple(sorted(e for e in devs if tuple(sorted((a, i) for a, i in (coords.get(e) or {}).items()
                                                              if a != axis)) == key and axis in (coords.get(e) or {})))
    return out


def _norm_subject(devs: Sequence[int], groups: Mapping[int, tuple[int, ...]]) -> tuple[str, tuple[int, ...], str]:
    """``(kind, devices, note)`` a norm finding about replica ``devs`` names. Under expert parallelism
    (``groups``: :func:`expert_groups`) a device's local gradient moves with anything its expert group
    computes (its tokens go to their experts and back at every MoE layer, forward and backward), so a norm
    cannot say which device of the group went wrong: the group is named, and a range replay tells which."""
    group = tuple(sorted({e for d in devs for e in groups.get(d, (d,))}))
    if len(group) > len(devs):
        return "replica", group, (f" (expert parallelism: devices {list(group)} exchange tokens at every MoE layer, "
                                  "so any of them can move this norm; a range replay tells which)")
    return ("device" if len(devs) == 1 else "replica"), tuple(devs), ""


def _replicas(signals, steps: list[int], start: int, cfg: sc.ScreeningConfig,
              groups: Optional[Mapping[int, tuple[int, ...]]] = None):
    """Drift and spike checks over the replicas' norms; returns (status_spike, status_drift, findings, series).
    ``groups``: under expert parallelism, each device's expert group (:func:`_norm_subject`)."""
    groups = groups or {}
    na = {"status": "not available"}
    if signals is None:
        msg = "no signals.jsonl (per-replica gradient norms are not logged)"
        return dict(na, detail=msg), dict(na, detail=msg), [], {}
    reps = sorted({(r.replica, r.devices) for s in steps for r in signals[s].replicas})
    index = {rid: i for i, (rid, _) in enumerate(reps)}
    devs = {rid: d for rid, d in reps}
    if len(reps) < 3:
        msg = f"{len(reps)} replica(s): at least 3 are needed to tell which one moved"
        return dict(na, detail=msg), dict(na, detail=msg), [], {}
    T, R = len(steps), len(reps)
    n = np.full((T, R), np.nan)
    present = np.zeros((T, R), bool)
    for t, s in enumerate(steps):
        for r in signals[s].replicas:
            n[t, index[r.replica]] = r.norm_sq
            present[t, index[r.replica]] = True
    res = sc.screen_replicas(n, present, cfg)
    rid_of = [rid for rid, _ in reps]
    found = []
    spikes_by: dict[int, list[sc.Spike]] = {}
    for sp in res.spikes:
        spikes_by.setdefault(sp.replica, []).append(sp)
    for r, sps in sorted(spikes_by.items()):
        st = [steps[sp.index] for sp in sps]
        if max(st) < start:
            continue
        zmax = max(abs(sp.z) for sp in sps)
        kind, subject, note = _norm_subject(devs[rid_of[r]], groups)
        worst = "non-finite norm" if math.isinf(zmax) else f"|z| up to {zmax:.1f}"
        found.append(((kind, subject), _evidence(
            "norm_spike", min(st), max(st), zmax / cfg.spike_z,
            f"replica {rid_of[r]}'s gradient norm was an outlier against the other replicas at {len(st)} step(s) "
            f"{st[:5]}{' ...' if len(st) > 5 else ''} ({worst}; threshold {cfg.spike_z:g}){note}")))
    for a in res.drifts:
        onset, alarm = steps[a.onset], steps[a.alarm]  # a drift lasts to the last step: it reaches the range
        lo = steps[a.onset if a.onset_lo is None else a.onset_lo]
        hi = steps[a.onset if a.onset_hi is None else a.onset_hi]
        scored = steps[a.scoring_start] if a.scoring_start is not None else lo
        older = lo <= scored and scored > steps[0]  # the range starts where scoring began
        kind, subject, note = _norm_subject(devs[rid_of[a.replica]], groups)
        rel = math.expm1(a.shift_log)
        where = f"from step {onset}"
        if hi > lo or older:
            where += (f" (uncertain: between steps {lo} and {hi}" + (f", or earlier: scoring began at step {scored}"
                                                                      if older else "") + ")")
        found.append(((kind, subject), dataclasses.replace(_evidence(
            "norm_drift", onset, steps[-1], a.strength,
            f"replica {rid_of[a.replica]}'s gradient norm {'rose' if a.direction > 0 else 'fell'} against the "
            f"other replicas {where} (alarm at step {alarm}; shift {a.shift:+.1f} sigma, about "
            f"{rel:+.1%} in norm){note}"), onset_range=(lo, hi), before_scoring=older)))
    judged = f"{res.judged} replica-steps scored ({R} replicas, {T} steps; scoring starts once the replicas " \
             f"have more than min_history {cfg.min_history} accepted steps of their own history; robust sigma " \
             f"of the log-ratio " \
             f"{np.nanmedian(res.sigma) if np.isfinite(res.sigma).any() else float('nan'):.3g})"
    spike_st = {"status": "found" if any(e.check == "norm_spike" for _, e in found) else "clear", "detail": judged}
    drift_st = {"status": "found" if any(e.check == "norm_drift" for _, e in found) else "clear", "detail": judged}
    if res.judged == 0:
        spike_st = drift_st = {"status": "not available",
                               "detail": f"too few steps ({T}) for a baseline of {cfg.min_history}"}
    series = {"steps": steps, "replicas": rid_of, "devices": [list(devs[r]) for r in rid_of],
              "log_ratio": sc.log_ratios(np.where(present, n, np.nan)),
              "z": res.z, "sigma": res.sigma}
    return spike_st, drift_st, found, series


EXPERT_DRIFT_FLOOR = 0.05
"""The stated floor of ``expert_drift``'s output-per-token statistic: a persistent x(1 + delta) drift of one
expert device's output with delta >= this is named within 20 steps from the logged norms alone
(``benchmarks/campaign.py`` measures it on the fixed grid 0.01-0.2 with the probes removed,
``scan_expert_drift_statistic_named_fraction``). With the probes logged (the reference trainer's), any drift
that changes one bit of a device's probe output is named from its first step."""


def expert_output_per_token(signals, steps: list[int]) -> tuple[list[int], np.ndarray]:
    """``(devices, x [T, D])``: per step and expert device, the sum over MoE layers of the squared output of
    its experts divided by the slots they filled (``ExpertLoad.output_sq / received``); NaN where not
    logged. The mean squared output per token moves by ``(1 + delta)^2`` when a device's experts compute
    ``x(1 + delta)``, whatever its load."""
    devs = sorted({d for s in steps for L in signals[s].expert_load for d in L.output_sq})
    x = np.full((len(steps), len(devs)), np.nan)
    for t, s in enumerate(steps):
        for j, d in enumerate(devs):
            vals = [L.output_sq[d] / max(L.received.get(d, 0), 1) for L in signals[s].expert_load if d in L.output_sq]
            if vals:
                x[t, j] = float(np.sum(vals))
    return devs, x


def expert_twins(devs: list[int], coords: Mapping[int, Mapping[str, int]], axis: str = "expert") -> dict[int, list[int]]:
    """Per device, the other devices that hold the same experts (same index on ``axis``, another on the
    data axes): its twins, which compute the same expert weights on other tokens."""
    out = {}
    for d in devs:
        mine = (coords.get(d) or {}).get(axis)
        out[d] = [e for e in devs if e != d and mine is not None and (coords.get(e) or {}).get(axis) == mine]
    return out


def probe_mismatches(signals, steps: list[int], coords: Mapping[int, Mapping[str, int]]
                     ) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Where twins' probe fingerprints (``ExpertLoad.probe``: each expert device's output for a fixed token)
    differ: ``{named devices: [(step, layer), ...]}``. Twins hold bit-identical weights and run one program,
    so a healthy device's probe equals its twins' bit for bit. In a group of twins that differ, the devices
    outside a strict majority of equal values are named; with no strict majority (two twins, or a split
    in halves) the whole group is, since nothing says which is right."""
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for s in steps:
        for layer, L in enumerate(signals[s].expert_load):
            if not L.probe:
                continue
            devs = sorted(L.probe)
            twins = expert_twins(devs, coords)
            seen = set()
            for d in devs:
                group = tuple(sorted([d, *twins[d]]))
                if group in seen or len(group) < 2:
                    continue
                seen.add(group)
                counts: dict[int, list[int]] = {}
                for e in group:
                    counts.setdefault(L.probe[e], []).append(e)
                if len(counts) == 1:
                    continue
                best = max(counts.values(), key=len)
                named = tuple(e for e in group if e not in best) if 2 * len(best) > len(group) else group
                out.setdefault(named, []).append((s, layer))
    return out


def _probe_evidence(signals, steps: list[int], start: int, coords: Mapping[int, Mapping[str, int]]):
    """The probe part of ``expert_drift``: ``(findings, compared)`` (``compared``: device-steps with a probe)."""
    compared = sum(len(L.probe) for s in steps for L in signals[s].expert_load)
    found = []
    for named, where in sorted(probe_mismatches(signals, steps, coords).items()):
        at = sorted({st for st, _ in where})
        if at[-1] < start:
            continue
        layers = sorted({layer for _, layer in where})
        if len(named) == 1:
            who = f"device {named[0]}'s experts computed another output for the probe token than its twins'"
        else:
            who = (f"devices {list(named)} hold the same experts and computed different outputs for the probe "
                   "token with no majority among them: one of them is wrong, and a range replay from the step tells "
                   "which")
        found.append((("device" if len(named) == 1 else "replica", named), _evidence(
            "expert_drift", at[0], at[-1], float(len(at)),
            f"{who} (bit for bit, at {len(at)} step(s) from step {at[0]}, layer(s) {layers}; floor: one bit of the "
            "probe's output)")))
    return found, compared


def expert_drift_scope(devs: Sequence[int], coords: Mapping[int, Mapping[str, int]], device: int) -> set[int]:
    """The devices an output-per-token finding on ``device`` can point at: the device, its twins, and the
    expert groups of all of them. The statistic compares a device with its twins, and its tokens come from
    its expert group, whose outputs in an earlier layer shape them: a drifting device moves its own
    output per token, and, one layer later, that of the other experts its tokens go to (measured: a 0.05
    drift of device 5 on ``{data: 4, expert: 2}`` moved healthy device 6's statistic past its alarm,
    through device 4, 5's group partner and 6's twin)."""
    twins = expert_twins(list(devs), coords).get(device, [])
    groups = expert_groups(list(devs), coords)
    return {device, *twins} | {e for x in (device, *twins) for e in groups.get(x, (x,))}


def _expert_drift(signals, steps: list[int], start: int, cfg: sc.ScreeningConfig,
                  coords: Optional[Mapping[int, Mapping[str, int]]] = None):
    """Expert-device screening (issue 27 item 4). Under expert parallelism one device's drifting expert
    output moves every data replica's gradient together, so the replica norms cannot see it. Each expert
    device's output per token (:func:`expert_output_per_token`) is compared with its *twins'* (the devices
    holding the same experts on the other data replicas, :func:`expert_twins`): the expert's own training
    dynamics move twins together and cancel; a chip's ``x(1 + delta)`` does not. The log-difference is
    judged with the replicas' statistics (``screening.screen_replicas``: robust z against its own history,
    CUSUM). A device whose statistic alarms need not be the faulty one: its twins move it too, and so does
    a device of their expert groups whose wrong output, one layer earlier, changed the tokens it computes
    on; so a statistical finding names all of those (:func:`expert_drift_scope`), one suspect, and a range
    replay from the onset tells which. Without twins (one data replica) every expert device is compared
    with the median of all, which the experts' own dynamics can move: weaker.
    Before that statistic, the probe (when the trainer logs it, ``ExpertLoad.probe``): each expert device's
    output for a fixed token, compared with its twins' bit for bit at every step (:func:`probe_mismatches`):
    any drift that changes one bit of it is named from its first step, alone among three or more twins,
    as the pair with two (nothing says which of two is right). A statistical alarm whose scope holds a
    device the probe named is explained by it and not reported again.
    Returns ``(status, findings, series)``."""
    coords = coords or {}
    probed, compared = ([], 0) if signals is None else _probe_evidence(signals, steps, start, coords)
    if signals is None or not any(L.output_sq for s in steps for L in signals[s].expert_load):
        return {"status": "not available",
                "detail": "no expert output norms in signals.jsonl (expert_load[].output_sq): the run does not put "
                          "experts on their own devices, or predates the signal"}, [], {}
    devs, x = expert_output_per_token(signals, steps)
    if len(devs) < 3:
        return {"status": "not available", "detail": f"{len(devs)} expert device(s): at least 3 are needed"}, [], {}
    twins = expert_twins(devs, coords)
    cfg = dataclasses.replace(cfg, cusum_h=cfg.expert_cusum_h)
    with np.errstate(divide="ignore", invalid="ignore"):
        lx = np.where(np.isfinite(x) & (x > 0), np.log(np.where(x > 0, x, 1.0)), np.nan)
    paired = all(twins[d] for d in devs)
    if paired:  # each device against the mean of its twins (log units of the squared output)
        idx = {d: j for j, d in enumerate(devs)}
        with warnings.catch_warnings():  # a step where every twin's value is missing: NaN, not scored
            warnings.simplefilter("ignore", RuntimeWarning)
            y = np.stack([lx[:, idx[d]] - np.nanmean(lx[:, [idx[e] for e in twins[d]]], axis=1) for d in devs],
                         axis=1)
        res = sc.screen_replicas(np.exp(y), np.isfinite(y), cfg)
    else:
        res = sc.screen_replicas(x, np.isfinite(x), cfg)
    found, named = [], set()
    probe_named = {d for (_, subject), _ in probed for d in subject}
    for a in sorted(res.drifts, key=lambda a: -a.strength):
        dev, how = devs[a.replica], "against the median of every expert device"
        group = sorted([dev] + twins[dev]) if paired else [dev]
        if tuple(group) in named:
            continue
        named.add(tuple(group))
        if paired:
            how = (f"against its twin {twins[dev][0]} (two data replicas: either of the two moved)"
                   if len(group) == 2 else f"against its {len(group) - 1} twins (the same experts on the other data "
                                            "replicas)")
        scope = expert_drift_scope(devs, coords, dev)
        if steps[-1] < start or scope & probe_named:
            continue  # explained by a probe finding in its scope: that names the device
        onset, alarm = steps[a.onset], steps[a.alarm]
        lo = steps[a.onset if a.onset_lo is None else a.onset_lo]
        hi = steps[a.onset if a.onset_hi is None else a.onset_hi]
        rel = math.expm1(abs(a.shift_log))
        subject = tuple(sorted(scope))
        found.append((("device" if len(subject) == 1 else "replica", subject), dataclasses.replace(_evidence(
            "expert_drift", onset, steps[-1], a.strength,
            f"device {dev}'s expert output per token moved {how}, from step {onset} (alarm at step {alarm}; about "
            f"{rel:.1%} in output norm); a device moves so when it or its twins compute wrong, or when a device "
            f"of their expert groups sends them other tokens in a later layer, so the devices named are all of "
            f"those ({list(subject)}): a range replay from the onset tells which"), onset_range=(lo, hi))))
    detail = (f"{res.judged} device-steps scored ({len(devs)} expert devices, {len(steps)} steps, "
              + ("each against its twins" if paired else "each against all (no twins: one data replica)")
              + f"); stated floor x(1 + {EXPERT_DRIFT_FLOOR:g})")
    if compared:
        detail = (f"probe: {compared} device-steps compared with their twins bit for bit (floor: one bit); "
                  f"output per token: {detail}")
    found = probed + found
    status = "found" if found else ("clear" if res.judged or compared else "not available")
    return {"status": status, "detail": detail}, found, {"steps": steps, "devices": devs, "z": res.z}


def share_ratio(shares) -> float:
    """How far the most unequal expert is from uniform: ``max(max_e s_e * E, 1 / (min_e s_e * E))``
    (1 = uniform; ``inf`` when an expert got nothing)."""
    E = len(shares)
    hi, lo = max(shares) * E, min(shares) * E
    return max(hi, 1.0 / lo if lo > 0 else math.inf)


# the share band's small-run floor (share_band): shares within this many standard errors of uniform. A
# balanced router leaves p +- 3.5 sigma with probability about 5e-4 per expert and window (normal
# approximation), so a 30-step, 2-layer, 4-expert run's 240 judged expert-windows raise about 0.1 false alarm
ROUTER_Z = 3.5
DEAD_SHARE = 0.05  # an expert under this fraction of its uniform share (share x E) is dead on a run of any size


def share_band(experts: int, health: sc.RouterHealth, rows: Optional[int]) -> tuple[float, float, str]:
    """``(low, high)``: the expert shares (of a layer's assignments, over ``window_steps`` steps) the
    router board accepts, and the rule in words.

    The band is ``max_share_ratio`` times uniform either way (``[1 / (r * E), r / E]``), widened on
    small runs to the shares a balanced router shows by its batches' rows alone: a row's tokens go
    together (one document), so a window of ``n = rows * window_steps`` rows gives a share the
    standard error ``sigma = sqrt(p * (1 - p) / n)`` about ``p = 1 / E`` (binomial over rows), and
    the band is at least ``p +- ROUTER_Z * sigma``. Its low edge never drops below
    ``DEAD_SHARE / E``, the floor under which an expert is dead whatever the run's size.
    ``rows``: the global batch (rows a step); None: the band alone, unwidened.
    """
    E = max(int(experts), 1)
    p, r = 1.0 / E, float(health.max_share_ratio)
    lo, hi = 1.0 / (r * E), r / E
    rule = f"within {r:g}x of uniform 1/{E}"
    if rows:
        n = int(rows) * max(int(health.window_steps), 1)
        sigma = math.sqrt(p * (1 - p) / n)
        if p - ROUTER_Z * sigma < lo or p + ROUTER_Z * sigma > hi:
            rule += (f", widened to uniform +- {ROUTER_Z:g} standard errors of a {n}-row window "
                     f"({E} experts, {int(health.window_steps)} step(s) of {int(rows)} rows: sigma {sigma:.3f})")
        lo, hi = min(lo, p - ROUTER_Z * sigma), max(hi, p + ROUTER_Z * sigma)
    dead = DEAD_SHARE / E
    if lo < dead:
        lo = dead
        rule += f", never below the dead-expert floor {DEAD_SHARE:g}/E"
    return lo, hi, f"shares in [{lo:.4f}, {hi:.4f}] ({rule})"


def _router(signals, steps, start, health: sc.RouterHealth, rows: Optional[int] = None):
    if signals is None or not any(signals[s].router for s in steps):
        return {"status": "not available", "detail": "no per-layer router figures in signals.jsonl"}, [], {}
    layers = max(len(signals[s].router) for s in steps)
    judged = [s for s in steps if s >= health.warmup_steps]
    out = []
    series = {"steps": steps, "dropped": np.full((len(steps), layers), np.nan),
              "share_ratio": np.full((len(steps), layers), np.nan),
              "share_ratio_window": np.full((len(steps), layers), np.nan), "window": int(health.window_steps)}
    worst_all, bands = {}, {}
    share_limit = series["share_limit"] = np.full((layers, 2), np.nan)
    for t, s in enumerate(steps):
        for i, L in enumerate(signals[s].router):
            series["dropped"][t, i] = L.dropped_fraction
            series["share_ratio"][t, i] = share_ratio(L.expert_share)
    W = int(health.window_steps)
    for i in range(layers):
        bad = []
        worst_drop, worst_ratio = 0.0, 1.0
        E = max((len(signals[s].router[i].expert_share) for s in steps if i < len(signals[s].router)), default=1)
        lo, hi, rule = bands[i] = share_band(E, health, rows)
        share_limit[i] = (hi * E, 1.0 / (lo * E))  # the band as ratios to uniform: most-used, least-used expert
        for t, s in enumerate(steps):
            if s < health.warmup_steps or i >= len(signals[s].router):
                continue
            L = signals[s].router[i]
            window = [signals[u].router[i].expert_share for u in steps[max(0, t - W + 1):t + 1]
                      if i < len(signals[u].router)]
            mean = np.mean(np.asarray(window, np.float64), axis=0) if W > 1 else np.asarray(L.expert_share, np.float64)
            ratio = share_ratio(mean)
            series["share_ratio_window"][t, i] = ratio
            worst_drop, worst_ratio = max(worst_drop, L.dropped_fraction), max(worst_ratio, ratio)
            if L.dropped_fraction > health.max_dropped_fraction or mean.max() > hi or mean.min() < lo:
                bad.append(s)
        worst_all[i] = (worst_drop, worst_ratio)
        if bad and max(bad) >= start:
            limit = max(hi * E, 1.0 / (lo * E))  # the band as a ratio to uniform, the figure's scale
            strength = max(worst_drop / health.max_dropped_fraction if health.max_dropped_fraction else math.inf,
                           worst_ratio / limit)
            out.append((("layer", ()), i, _evidence(
                "router", min(bad), max(bad), strength,
                f"layer {i}: {len(bad)} of {len(judged)} steps after warm-up out of bounds (worst dropped "
                f"{worst_drop:.3f} vs {health.max_dropped_fraction:g}; worst expert share {worst_ratio:.2f}x "
                f"uniform; {rule})")))
    detail = "; ".join(f"layer {i}: max dropped {d:.4f}, worst share {r:.2f}x uniform"
                       for i, (d, r) in sorted(worst_all.items()))
    detail += f" (after {health.warmup_steps} warm-up steps; limits {health.max_dropped_fraction:g} dropped and " + \
              "; ".join(sorted({b[2] for b in bands.values()})) + (f", shares over {W}-step windows" if W > 1 else "") + ")"
    return {"status": "found" if out else "clear", "detail": detail}, out, series


def _expert_load(signals, steps, start, health: sc.RouterHealth, dispatch: Optional[str] = None):
    """Per MoE layer, the tokens each expert device received (``StepSignals.expert_load``), judged as the
    most loaded device's share over the mean (``screening.expert_load_ratio``, over ``window_steps``).
    ``dispatch``: the run config's ``model.dispatch`` (None: not known), for the reason when absent."""
    if signals is None or not any(signals[s].expert_load for s in steps):
        if dispatch == "all_to_all":
            why = ("the run config's model.dispatch is all_to_all, but its trainer logged no expert-load "
                   "figures (a trainer or toolkit release from before them, or a trainer that does not log them)")
        elif dispatch is not None:
            why = f"the run's experts are not on their own devices (model.dispatch is {dispatch}, not all_to_all)"
        else:
            why = ("the run config names no model.dispatch: its experts are not on their own devices, or its "
                   "trainer does not log the figures")
        return {"status": "not available", "detail": f"no expert-load figures in signals.jsonl: {why}"}, [], {}
    layers = max(len(signals[s].expert_load) for s in steps)
    W, limit = int(health.window_steps), health.max_expert_load_ratio
    series = {"steps": steps, "ratio": np.full((len(steps), layers), np.nan),
              "each": np.full((len(steps), layers), np.nan), "window": W}
    out, worst_all = [], {}
    for i in range(layers):
        devs = sorted({d for s in steps if i < len(signals[s].expert_load) for d in signals[s].expert_load[i].received})
        counts = np.array([[signals[s].expert_load[i].received.get(d, np.nan) if i < len(signals[s].expert_load)
                            else np.nan for d in devs] for s in steps], np.float64)
        bad, worst = [], (0.0, -1, -1)
        for t, s in enumerate(steps):
            ratio, top = sc.expert_load_ratio(counts[max(0, t - W + 1):t + 1])
            series["ratio"][t, i] = ratio
            series["each"][t, i] = sc.expert_load_ratio(counts[t:t + 1])[0]
            if s < health.warmup_steps:
                continue
            if ratio > worst[0]:
                worst = (ratio, devs[top] if top >= 0 else -1, s)
            if ratio > limit:
                bad.append(s)
        worst_all[i] = worst
        if bad and max(bad) >= start:
            out.append((("layer", ()), i, _evidence(
                "expert_load", min(bad), max(bad), worst[0] / limit,
                f"layer {i}: the expert devices' load was out of bounds at {len(bad)} step(s) after warm-up (worst: "
                f"device {worst[1]} received {worst[0]:.2f}x the mean of the layer's {len(devs)} expert devices at "
                f"step {worst[2]}; limit {limit:g}x)")))
    detail = "; ".join(f"layer {i}: worst {r:.2f}x the mean (device {d})" for i, (r, d, _) in sorted(worst_all.items()))
    detail += f" (after {health.warmup_steps} warm-up steps; limit {limit:g}x" + \
              (f", over {W}-step windows" if W > 1 else "") + ")"
    return {"status": "found" if out else "clear", "detail": detail}, out, series


def _loss(run: RunLog, steps, start, cfg: sc.ScreeningConfig, explaining: Mapping[int, str]):
    loss = np.array([np.uint32(run.fingerprints[s].loss_bits).view(np.float32) if s in run.fingerprints else np.nan
                     for s in steps], np.float64)
    spikes = sc.loss_spikes(loss, cfg)
    found, explained = [], []
    for i, z in spikes:
        s = steps[i]
        if s < start:
            continue
        why = explaining.get(s) or explaining.get(s - 1)
        rec = {"check": "loss_spike", "step": s, "loss": float(loss[i]), "z": _num(z)}
        if why and math.isfinite(loss[i]):  # an event may explain a finite spike, never a NaN or Inf loss
            explained.append(dict(rec, explained_by=why))
        else:
            found.append(rec)
    out = []
    if found:
        out.append((("run", ()), _evidence(
            "loss_spike", found[0]["step"], found[-1]["step"], max(f["z"] for f in found) / cfg.loss_spike_z,
            f"loss spike(s) at step(s) {[f['step'] for f in found][:6]} (robust derivative above "
            f"{cfg.loss_spike_z:g} sigma and {cfg.loss_min_rise:.0%} above its rolling median)")))
    status = {"status": "found" if out else "clear",
              "detail": f"{len(steps)} steps" + (f"; {len(explained)} spike(s) at a logged event" if explained else "")}
    return status, out, explained, {"steps": steps, "loss": loss}


def _loader(signals, steps, start, cfg: sc.ScreeningConfig, restarts: set[int]):
    if signals is None or all(signals[s].loader_wait_s is None for s in steps):
        return {"status": "not available", "detail": "no loader wait times in signals.jsonl"}, [], {}
    wait = np.array([signals[s].loader_wait_s if signals[s].loader_wait_s is not None else np.nan for s in steps])
    st = np.array([signals[s].step_time_s if signals[s].step_time_s is not None else np.nan for s in steps])
    skip = np.array([s in restarts for s in steps])
    stalls = sc.loader_stalls(wait, st, skip, cfg)
    out = []
    stall_steps = [steps[i] for i in stalls if steps[i] >= start]
    total = float(sum(wait[i] for i in stalls if steps[i] >= start))
    step_total = float(np.nansum([x for x, s in zip(st, steps) if s >= start]))
    budget = cfg.stall_budget * step_total
    if stall_steps and total > budget:
        out.append((("loader", ()), _evidence(
            "loader_stall", stall_steps[0], stall_steps[-1], total / max(cfg.stall_min_s, 1e-9),
            f"the step waited for data at {len(stall_steps)} step(s) {stall_steps[:6]} ({total:.2f} s in all, "
            f"over {cfg.stall_budget:.0%} of the steps' {step_total:.1f} s; median step "
            f"{np.nanmedian(st):.3f} s)")))
    return ({"status": "found" if out else "clear",
             "detail": f"median wait {np.nanmedian(wait) * 1e3:.2f} ms, median step {np.nanmedian(st):.3f} s; "
                       f"{len(stall_steps)} waiting step(s), {total:.2f} s"},
            out, {"steps": steps, "wait": wait, "step_time": st})


STAGE_WORDS = {"index": "index arithmetic", "read": "storage reads", "decode": "decoding the records",
               "rows": "building the rows", "transfer": "the transfer to the devices",
               "other": "no loader stage (the step's read not begun: queued behind earlier steps, or the GIL)"}
STAGE_ADVICE = {
    "read": "storage latency: a deeper prefetch hides a burst and more read threads hide a steady latency "
            "(docs/loader.md, 'Input stalls': depth >= (burst + latency x reads a step + CPU a step) / step time), "
            "or read_mode='batched' on a network file system",
    "decode": "the loader's CPU: more workers (Grain processes) or read threads",
    "rows": "the loader's CPU: more workers (Grain processes) or read threads",
    "index": "the loader's CPU (a new epoch's shuffle table): more workers or read threads",
    "transfer": "the host-to-device transfer: look at the host's memory bandwidth and the devices' queues",
    "other": "the loader's thread was busy with earlier steps: more read threads or workers",
}


def input_stages(signals, steps) -> dict[str, float]:
    """Seconds per loader stage (``loader_wait_stages``) summed over ``steps``."""
    total: dict[str, float] = {}
    for s in steps:
        for k, v in (signals[s].loader_wait_stages or {}).items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def _input(signals, steps, start, cfg: sc.ScreeningConfig, restarts: set[int]):
    """The ``input`` check: steps whose buffer was empty at the ask (``loader_occupancy`` 0) and
    that waited past the stall threshold, a finding when their waits exceed the stall budget;
    the detail names the stage that held them most."""
    if signals is None or all(signals[s].loader_occupancy is None for s in steps):
        return {"status": "not available", "detail": "no buffer occupancy in signals.jsonl"}, [], {}
    occ = np.array([np.nan if signals[s].loader_occupancy is None else signals[s].loader_occupancy for s in steps],
                   np.float64)
    wait = np.array([signals[s].loader_wait_s if signals[s].loader_wait_s is not None else np.nan for s in steps])
    st = np.array([signals[s].step_time_s if signals[s].step_time_s is not None else np.nan for s in steps])
    skip = np.array([s in restarts for s in steps]) | ~(occ == 0)
    drained = [steps[i] for i in sc.loader_stalls(wait, st, skip, cfg) if steps[i] >= start]
    total = float(sum(signals[s].loader_wait_s for s in drained))
    step_total = float(np.nansum([x for x, s in zip(st, steps) if s >= start]))
    stages = input_stages(signals, drained)
    split = sum(stages.values())
    top = max(stages, key=stages.get) if stages else None
    where = (f"{STAGE_WORDS.get(top, top)} held {stages[top] / split:.0%} of it" if top else
             "where it went is not logged (no loader_wait_stages)")
    empty = int(np.sum(occ[[s >= start for s in steps]] == 0))
    out = []
    if drained and total > cfg.stall_budget * step_total:
        out.append((("loader", ()), _evidence(
            "input", drained[0], drained[-1], total / max(cfg.stall_min_s, 1e-9),
            f"the prefetch buffer was empty at the ask and the step waited at {len(drained)} step(s) "
            f"{drained[:6]} ({total:.2f} s in all): {where}"
            + (f"; {STAGE_ADVICE[top]}" if top in STAGE_ADVICE else ""))))
    detail = (f"buffer empty at {empty} of {int(np.sum(np.isfinite(occ)))} asks; "
              f"{len(drained)} drained step(s) waited past the threshold, {total:.2f} s"
              + (f" ({where})" if drained else ""))
    return ({"status": "found" if out else "clear", "detail": detail}, out,
            {"steps": steps, "occupancy": occ,
             "occupancy_min": np.array([np.nan if signals[s].loader_occupancy_min is None
                                        else signals[s].loader_occupancy_min for s in steps], np.float64),
             "stages": stages})


# ----------------------------------------------------------------------------- scan


def scan_run(run: RunLog, start: Optional[int] = None, stop: Optional[int] = None, *,
             screening_logs: Optional[tuple] = None) -> ScanReport:
    """Screens ``run`` from its logs (module docstring). Steps before ``start`` serve as history;
    findings must reach into ``[start, stop)``.

    Args:
      run: a loaded run directory.
      start, stop: the half-open range to report on (default: every logged step).
      screening_logs: ``(signals, canary records)`` to screen instead of the run's files (a drill's logs
        in memory: ``replay.verify.faults``); default: read from the run directory.

    Raises:
      RunDirError: a screening log is malformed, or the run config's thresholds are invalid.
      StepRangeError: ``[start, stop)`` holds no logged step.
    """
    from replay.run.runlog import StepRangeError

    health, cfg = _run_thresholds(run)
    signals, canary = lineage_screening_logs(run) if screening_logs is None else screening_logs
    first, end = run.logged_steps
    start = first if start is None else start
    stop = end if stop is None else stop
    if start >= end or stop <= first:
        raise StepRangeError.outside(start, stop, first, end, run.run_dir)
    steps_fp = sorted(s for s in run.fingerprints if s < stop)
    steps_sig = sorted(s for s in (signals or {}) if s < stop)
    explaining = {}
    for e in run.events:  # the lineage's events: a superseded attempt's restore explains nothing
        if e.get("event") in EXPLAINING_EVENTS and isinstance(e.get("step"), int):
            explaining.setdefault(int(e["step"]), e["event"])
    restarts = {int(e["step"]) for e in run.events if e.get("event") in ("start", "restore")
                and isinstance(e.get("step"), int)}

    checks: dict[str, dict[str, str]] = {}
    findings: list[tuple[tuple[str, tuple[int, ...]], Any]] = []
    checks["canary"], dev, runl = _canary(canary, start, stop)
    findings += dev + runl
    checks["nonfinite"], dev, runl = _nonfinite(run, signals, steps_sig or steps_fp, start)
    findings += dev + runl
    sig = signals if steps_sig else None
    coords = {int(k): dict(v) for k, v in (run.mesh.get("device_coords") or {}).items()}
    ep = sig is not None and any(L.received for s in steps_sig for L in sig[s].expert_load)
    groups = expert_groups(sorted(coords), coords) if ep else {}
    checks["norm_spike"], checks["norm_drift"], dev, rep_series = _replicas(sig, steps_sig, start, cfg, groups)
    findings += dev
    checks["expert_drift"], dev, expert_series = _expert_drift(sig, steps_sig, start, cfg, coords)
    findings += dev
    rows = run.config.get("global_batch")
    checks["router"], layer_found, router_series = _router(sig, steps_sig, start, health,
                                                           rows if isinstance(rows, int) and rows > 0 else None)
    model = run.config.get("model") if isinstance(run.config.get("model"), Mapping) else {}
    dispatch = model.get("dispatch", "gather" if model else None)  # the reference model's default: gather
    checks["expert_load"], load_found, load_series = _expert_load(sig, steps_sig, start, health,
                                                                  dispatch if isinstance(dispatch, str) else None)
    layer_found += load_found
    checks["loss_spike"], loss_found, explained, loss_series = _loss(run, steps_fp, start, cfg, explaining)
    findings += loss_found
    checks["loader_stall"], loader_found, loader_series = _loader(sig, steps_sig, start, cfg, restarts)
    findings += loader_found
    checks["input"], input_found, input_series = _input(sig, steps_sig, start, cfg, restarts)
    findings += input_found

    grouped: dict[tuple[str, str], list[Evidence]] = {}
    devices_of: dict[tuple[str, str], tuple[int, ...]] = {}
    for (kind, devs), ev in findings:
        subject = _device_names(devs) if kind in ("device", "replica") else kind
        grouped.setdefault((kind, subject), []).append(ev)
        devices_of[(kind, subject)] = tuple(devs)
    for _, layer, ev in layer_found:
        grouped.setdefault(("layer", f"layer {layer}"), []).append(ev)
        devices_of[("layer", f"layer {layer}")] = ()
    table = dv.device_table(run.env)
    coords = {int(k): dict(v) for k, v in (run.mesh.get("device_coords") or {}).items()}
    suspects = []
    for (kind, subject), evs in grouped.items():
        evs = sorted(evs, key=lambda e: (CHECKS.index(e.check), -e.strength))
        suspects.append(Suspect(kind=kind, subject=subject, devices=devices_of[(kind, subject)],
                                named=tuple(dv.name_devices(devices_of[(kind, subject)], table, coords)),
                                first_step=min(e.first_step for e in evs), strength=max(e.strength for e in evs),
                                evidence=tuple(evs)))
    suspects.sort(key=Suspect.rank_key)
    suspects = [dataclasses.replace(x, next=next_step(run, x)) for x in suspects]
    report = ScanReport(run_dir=run.run_dir, steps=(start, stop), checks=checks, suspects=suspects,
                        explained=explained, suggestion=None,
                        figures=_figures(sig, steps_sig, canary),
                        series={"replicas": rep_series, "router": router_series, "expert_load": load_series,
                                "expert_drift": expert_series,
                                "loss": loss_series,
                                "loader": loader_series, "input": input_series, "canary": canary or []},
                        limits={**health.to_dict(), "screening": cfg.to_dict()},
                        lineage=run.lineage.describe() if run.lineage is not None else [])
    report.suggestion = suggest_replay(run, report)
    return report


def _figures(signals, steps, canary) -> dict[str, Any]:
    out: dict[str, Any] = {"steps_with_signals": len(steps)}
    if signals is not None and steps:
        st = [signals[s].step_time_s for s in steps if signals[s].step_time_s is not None]
        if st:
            out["median_step_s"] = round(float(np.median(st)), 6)
    if canary:
        by_step: dict[int, float] = {}
        for c in canary:
            by_step[c.step] = c.seconds
        secs = sorted(by_step.values())
        out["canaries"] = len(by_step)
        out["median_canary_s"] = round(float(np.median(secs)), 6)
    return out


def next_step(run: RunLog, suspect: Suspect) -> dict[str, Any]:
    """What to do about a suspect: ``{"command": a command or None, "sentence": what it is for}``.

    A device or replica: the range replay of its checkpoint segment on good devices (a conviction
    names the device). A router layer or a loss spike: ``replay triage`` at its last step (events,
    replicas, data and router, in order). The loader: a sentence (the loader is fed too slowly).
    """
    import shlex

    quoted = shlex.quote(run.run_dir)
    last = max(e.last_step for e in suspect.evidence)
    nonfinite = [e.first_step for e in suspect.evidence if e.check == "nonfinite"]
    if suspect.kind == "run" and nonfinite:  # a divergence: triage its first non-finite step, not its last
        last = min(nonfinite)
    if suspect.kind in ("device", "replica"):
        first, end = run.logged_steps
        a = max(suspect.first_step, first)
        later = [c for c in run.checkpoints if c > a]
        b = max(min(later[0] if later else end, end), min(a + 1, end))
        return {"command": f"replay --run {quoted} --steps {a}:{b} --devices good",
                "sentence": f"replay the steps from {a} on good devices: a conviction names the device, step and "
                            f"tensor; then quarantine {_device_names(suspect.devices)}"}
    if suspect.kind == "layer":
        return {"command": f"replay triage --run {quoted} --step {last}",
                "sentence": f"{suspect.subject}'s routing is out of bounds from step {suspect.first_step}: triage "
                            "tells router instability (lower the router's learning rate or restore its z-loss, and "
                            "rewind) from a data or hardware cause"}
    if suspect.kind == "loader":
        return {"command": None,
                "sentence": "the trainer waited for data: raise the loader's prefetch or workers, or look at the "
                            "storage's read latency at those steps (the data is not wrong, only late)"}
    return {"command": f"replay triage --run {quoted} --step {last}",
            "sentence": f"walk the spike at step {last}: events, replicas, data and router, in order; with no "
                        "cause found it prints the rewind and skip"}


def suggest_replay(run: RunLog, report: ScanReport) -> Optional[str]:
    """The range replay to run for the top device suspect: from the start of its onset's range (never
    before scoring began) to the end of the checkpoint segment holding the range's end, on the good
    devices (the replay starts with the onset's segment: suspects.json carries the onset); None
    without a device suspect."""
    onset = report.onset
    if onset is None:
        return None
    first, end = run.logged_steps
    a = max(onset["range"][0], first)
    later = [c for c in run.checkpoints if c > max(onset["range"][1], a)]
    b = min(later[0] if later else end, end)
    if b <= a:
        b = min(a + 1, end)
    return f"replay --run {run.run_dir} --steps {a}:{b} --devices good"


def write_suspects(report: ScanReport) -> str:
    """Writes ``<run>/suspects.json`` (atomically) and returns its path."""
    from replay.run.writer import write_json

    path = os.path.join(report.run_dir, proto.SUSPECTS_NAME)
    write_json(report.to_dict(), path)
    return path


# ----------------------------------------------------------------------------- follow


def suspect_key(s: Mapping[str, Any]) -> tuple:
    """A suspect's identity across looks at a growing run (its subject and kinds of evidence)."""
    return (s["kind"], s["subject"], tuple(sorted({e["check"] for e in s["evidence"]})))


def follow(run_dir: str, *, on_new: Any, on_first: Any = None, interval: float = 2.0, timeout: Optional[float] = None,
           on_look: Any = None, sleep: Any = None, clock: Any = None) -> dict[str, Any]:
    """Watches a run directory as it grows (``replay scan --follow``): each time new steps have landed,
    scans the lineage again and reports each suspect not seen before.

    Args:
      on_new: called with ``(suspect dict, report dict)`` for each new suspect.
      on_first: called once, with the first suspect ever seen and the report (``--on-suspect``).
      interval: seconds between looks; timeout: stop after this many seconds (None: when the run ends).
      on_look: called with ``(report dict or None, steps scored)`` after each look that scanned.
      sleep, clock: ``time.sleep`` and ``time.monotonic`` (tests pass their own).

    Returns:
      ``{"looks", "steps", "suspects" (every suspect seen, in order), "ended" (the run logged its end),
      "report" (the last scan's dict or None)}``.

    The run has ended when the lineage's current attempt logged ``end`` or ``stopped`` at or after
    its last step; a directory that is not a run yet (no step logged) is waited for.
    """
    import time

    from replay.run.runlog import load_run

    sleep = sleep or time.sleep
    clock = clock or time.monotonic
    t0 = clock()
    seen: dict[tuple, dict[str, Any]] = {}
    last_steps, looks, last, ended, first_done = -1, 0, None, False, False
    while True:
        looks += 1
        try:
            run = load_run(run_dir)
        except RunDirError:
            run = None
        if run is not None:
            steps = len(run.fingerprints)
            if steps != last_steps:
                last_steps = steps
                last = scan_run(run).to_dict()
                for sus in last["suspects"]:
                    key = suspect_key(sus)
                    if key in seen:
                        continue
                    seen[key] = sus
                    on_new(sus, last)
                    if on_first is not None and not first_done:
                        first_done = True
                        on_first(sus, last)
                if on_look is not None:
                    on_look(last, steps)
            cur = run.lineage.current if run.lineage else None
            ends = [e for e in run.events if e.get("event") in ("end", "stopped")
                    and (cur is None or e.get("attempt") in (None, cur.id))]
            ended = bool(ends) and max(int(e["step"]) for e in ends) >= run.logged_steps[1] - 1
            if ended:
                break
        if timeout is not None and clock() - t0 >= timeout:
            break
        sleep(interval)
    return {"looks": looks, "steps": max(last_steps, 0), "suspects": list(seen.values()), "ended": ended,
            "report": last}
