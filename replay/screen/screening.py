"""Screening statistics of ``replay scan``: pure functions over the run log's numbers (NumPy only;
no JAX, no I/O).

Layer 1 of SDC detection (docs/design.md, "Screening and triage") is continuous and nearly free: the
gradient norm of each data-parallel replica's local contribution, before the reduction. The
replicas see different rows, so their norms never match; what a faulty replica changes is the
*distribution of its ratio to the others*. Glossary and formulas::

    n[t, r]      float32 ||g_r||^2 of replica r at step t (signals.jsonl)
    x[t, r]      = 0.5 * (ln n[t, r] - median_r' ln n[t, r'])      log-ratio of r's norm to the
                   cross-replica median norm at step t (scale-free: the loss scale, the learning
                   rate and the phase of training cancel); the median leaves out replicas that
                   have alarmed (a named drifter no longer moves the others' reference)
    b[t, r]      = median of x[t-W .. t-1, r]                       r's own baseline (rolling median,
                   W = baseline_window): a replica whose rows are systematically different keeps
                   its offset without alarm
    s[t]         = robust_sigma of the residuals x[u, r'] - b[u, r'] of every replica's last W
                   accepted steps: their RMS winsorized at clip_z MAD-sigmas (1.4826 * MAD
                   estimates sigma for a normal law, Rousseeuw & Croux 1993; the winsorized RMS
                   also follows the heavier tails of log-ratios against a median of a few
                   replicas); floored at sigma_floor
    z[t, r]      = (x[t, r] - b[t, r]) / s[t]                        robust z-score, with one s per
                   side (the residuals above the baseline scale the positive scores, those below
                   the negative ones: log gradient norms are right-skewed)

    drift (persistent): a two-sided CUSUM (Page 1954) of the clipped scores
        S+[t] = max(0, S+[t-1] + min(z, c) - k),   S-[t] = max(0, S-[t-1] - max(z, -c) - k)
      alarms when S > h; its onset is the maximum-likelihood change point of the scores before
      the alarm, from the first scored step on, with the range it could lie in (``change_point_range``:
      Hinkley 1971, 1970), its strength S / h. While a replica's CUSUM is above zero its baseline is
      frozen (the rolling median must not absorb the drift it is measuring).
    spike (intermittent): |z| > spike_z, or a non-finite norm: that step only.

With fewer than 3 replicas the cross-replica median cannot tell which replica moved (with two,
both log-ratios move by the same amount in opposite directions): drift and spikes are then
reported for the pair, never for one device.

The other checks of the scan: loss spikes (a robust derivative: the loss minus its rolling
median, over the rolling MAD of those differences), router health per layer (thresholds
:class:`RouterHealth`), loader stalls (a wait above ``stall_fraction`` of the median step time and
above ``stall_min_s``), non-finite counts per leaf and device, canary mismatches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from contract.validation import Int, IntUpTo, Number, section

MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): MAD * this estimates sigma for a normal law


class ScreeningConfigError(ValueError):
    """A screening or router-health threshold is out of range; names the field and the range."""


@section("router_health", ScreeningConfigError)
class RouterHealth:
    """Router health thresholds (the run config's ``router_health:``; these are the defaults).

    Attributes:
      max_dropped_fraction: per layer, the most assignments that may be dropped past expert
        capacity at a step after warm-up (a healthy MoE drops under about 1%, flat), in [0, 1].
      max_share_ratio: every expert's share of a layer's assignments must lie within
        ``[1 / (ratio * E), ratio / E]`` after warm-up, i.e. within ``ratio`` times uniform; >= 1.
      warmup_steps: steps before the thresholds apply (a fresh router is not yet balanced), >= 0.
      window_steps: the expert shares judged at a step are the mean of the last ``window_steps``
        steps' shares (1: that step's alone). A small global batch makes one step's shares follow
        its rows' mix of sources; a window of steps judges the router rather than the batch.
        The dropped fraction is judged step by step. >= 1.
      max_expert_load_ratio: under expert parallelism (``model.dispatch: all_to_all``), per layer,
        the tokens the most loaded expert device received over the mean of the layer's devices
        (:func:`expert_load_ratio`, over the same ``window_steps``), after warm-up: the slowest
        expert group, in counts. >= 1.
    """

    max_dropped_fraction: Number("in [0, 1]", ge=0, le=1) = 0.01
    max_share_ratio: Number(">= 1", ge=1) = 3.0
    warmup_steps: Int("an int >= 0", ge=0) = 10
    window_steps: Int("an int >= 1", ge=1) = 1
    max_expert_load_ratio: Number(">= 1", ge=1) = 2.0


@section("screening", ScreeningConfigError)
class ScreeningConfig:
    """Thresholds of the scan's statistics (the run config's ``screening:``; these are the defaults,
    chosen so that clean runs give no suspect: ``benchmarks/screening.py`` measures the false-alarm
    rate and the detection floor with them).

    Attributes:
      baseline_window: W, steps of a replica's own history in its rolling median baseline and in
        the rolling MAD, >= 3.
      min_history: steps of history before a replica is judged at all, in [3, W].
      sigma_floor: the smallest robust sigma of the log-ratios used (guards a run whose replicas
        agree to the last bits, e.g. identical rows), > 0.
      cusum_k: CUSUM reference value k in sigma units (detects shifts of about 2k best), >= 0.
      cusum_h: CUSUM alarm threshold h in sigma units, > 0.
      clip_z: scores are clipped to +-clip_z before the CUSUM (one outlier adds at most this:
        spikes are the spike test's), > 0.
      freeze: a replica's baseline stops taking values while its CUSUM is above ``freeze * h``,
        in (0, 1].
      spike_z: |z| above this at one step is a spike, > 0. The default sits well above the tail of
        clean replicas' scores, which is heavy: one row of rare tokens can lift a replica's norm
        several times over the others' for a step (``benchmarks/screening.py`` reports the largest
        score of replicas without a fault: 14.2 in its clean runs, ``clean.max_abs_z``, and 22.8
        in its drift drills, ``drift_drills.other_replicas_max_abs_z``; 2 rows a replica).
        A finite one-step excursion below it cannot be told from such a row by the logs alone; the
        canary and a range replay are the tests for those. A flipped high exponent bit gives a
        non-finite or an enormous norm, a spike at any threshold.
      loss_window: steps of the loss's rolling median and MAD, >= 3.
      loss_spike_z: a loss above its rolling median by more than this many robust sigmas is a
        spike, > 0.
      loss_min_rise: ... and by more than this relative amount of the median, >= 0.
      stall_fraction: a loader wait above this fraction of the median step time is a stall, > 0.
      stall_min_s: ... and above this many seconds, >= 0.
      stall_budget: stalls are a finding when their waits add up to more than this fraction of
        the steps' time (isolated waits of a busy host are not), >= 0.
      expert_cusum_h: the CUSUM alarm threshold of ``replay scan``'s ``expert_drift`` check (each expert
        device's output per token against its twins'), > 0: lower than ``cusum_h``, because the twins'
        difference has no expert dynamics in it (``benchmarks/campaign.py`` measures its floor and its
        clean runs' alarms).
    """

    baseline_window: Int("an int >= 3", ge=3) = 40
    min_history: IntUpTo(3, "baseline_window") = 10
    sigma_floor: Number("> 0", gt=0) = 1e-3
    cusum_k: Number(">= 0", ge=0) = 0.5
    cusum_h: Number("> 0", gt=0) = 14.0
    clip_z: Number("> 0", gt=0) = 4.0
    freeze: Number("in (0, 1]", gt=0, le=1) = 0.5
    spike_z: Number("> 0", gt=0) = 40.0
    loss_window: Int("an int >= 3", ge=3) = 10
    loss_spike_z: Number("> 0", gt=0) = 6.0
    loss_min_rise: Number(">= 0", ge=0) = 0.05
    stall_fraction: Number("> 0", gt=0) = 0.25
    stall_min_s: Number(">= 0", ge=0) = 0.05
    stall_budget: Number(">= 0", ge=0) = 0.05
    expert_cusum_h: Number("> 0", gt=0) = 10.0


DEFAULT_SCREENING = ScreeningConfig()


# ----------------------------------------------------------------------------- expert load


def expert_load_ratio(received: np.ndarray) -> tuple[float, int]:
    """The load of a layer's most loaded expert device over the mean: ``(max_d m_d / mean_d m_d,
    argmax d)`` with ``m_d`` the mean over the window's steps of the tokens device ``d`` received.

    Args:
      received: float ``[W, n]``: tokens each of the ``n`` expert devices received at each of ``W``
        steps (NaN where a device was not logged).

    Returns:
      ``(ratio, index of the most loaded device)``; ``(0.0, -1)`` when no token was received.
    """
    m = np.nanmean(np.asarray(received, np.float64), axis=0) if np.size(received) else np.zeros(0)
    m = np.where(np.isfinite(m), m, 0.0)
    mean = float(m.mean()) if m.size else 0.0
    if mean <= 0:
        return 0.0, -1
    top = int(np.argmax(m))
    return float(m[top] / mean), top


# ----------------------------------------------------------------------------- replica norms


def log_ratios(norm_sq: np.ndarray) -> np.ndarray:
    """``x[t, r] = 0.5 * (ln n[t, r] - median_r' ln n[t, r'])``: each replica's gradient norm against
    the cross-replica median norm, in log units (module docstring).

    Args:
      norm_sq: float ``[T, R]`` squared norms; NaN where a replica was not logged.

    Returns:
      float64 ``[T, R]``; NaN where ``norm_sq`` is NaN, not finite or <= 0, or where fewer than
      two replicas of the step have a usable norm. The median is over the usable replicas.
    """
    n = np.asarray(norm_sq, np.float64)
    if n.ndim != 2:
        raise ValueError(f"norm_sq must be [steps, replicas], got shape {n.shape}")
    ok = np.isfinite(n) & (n > 0)
    logn = np.where(ok, np.log(np.where(ok, n, 1.0)), np.nan)
    out = np.full(n.shape, np.nan)
    usable = ok.sum(axis=1) >= 2
    if usable.any():
        med = np.nanmedian(logn[usable], axis=1, keepdims=True)
        out[usable] = 0.5 * (logn[usable] - med)
    return out


@dataclasses.dataclass(frozen=True)
class DriftAlarm:
    """A replica whose log-ratio moved persistently.

    Attributes:
      replica: column index in the input.
      onset: index of the estimated first step of the change (:func:`change_point`).
      alarm: index of the step at which the CUSUM crossed ``h``.
      direction: +1 (the replica's norm grew against the others) or -1.
      strength: the CUSUM's largest value over ``h`` (>= 1).
      shift: the median score from the onset on (sigma units), and shift_log: the median of the
        log-ratio's departure from the baseline from the onset on (``~ ln(1 + relative error)``
        for a scaled gradient).
      onset_lo, onset_hi: the range the onset could lie in (:func:`change_point_range`), indices;
        scoring_start: the index of the replica's first scored step (no onset is placed before it).
    """

    replica: int
    onset: int
    alarm: int
    direction: int
    strength: float
    shift: float
    shift_log: float
    onset_lo: Optional[int] = None
    onset_hi: Optional[int] = None
    scoring_start: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Spike:
    """One step at which one replica's log-ratio was an outlier (or its norm not finite).

    Attributes: step index, replica column, z (the robust score; ``inf`` for a non-finite norm).
    """

    index: int
    replica: int
    z: float


@dataclasses.dataclass(frozen=True)
class ReplicaScreen:
    """What :func:`screen_replicas` found.

    Attributes:
      drifts: at most one :class:`DriftAlarm` per replica (the first).
      spikes: every :class:`Spike`.
      z: float ``[T, R]`` robust scores (NaN where not judged: too little history, a missing or
        non-finite norm).
      sigma: float ``[T]`` the robust sigma used at each step (NaN before any was available).
      judged: how many (step, replica) cells were scored.
    """

    drifts: tuple[DriftAlarm, ...]
    spikes: tuple[Spike, ...]
    z: np.ndarray
    sigma: np.ndarray
    judged: int


def robust_sigma(values: np.ndarray, clip: float, floor: float = 0.0) -> float:
    """A robust standard deviation: the RMS of ``values`` winsorized at ``+-clip`` MAD-sigmas
    (``s0 = 1.4826 * median |v|``; ``s = sqrt(mean(clip(v, -clip*s0, clip*s0)^2))``), at least ``floor``.

    The MAD alone underestimates the spread of heavy-tailed residuals (log-ratios against a
    median of a few replicas are), which would inflate every score; winsorizing keeps the body
    and moderate tails of the distribution while a few wild values (bit flips) cannot move it by
    more than ``clip * s0`` each. Values are deviations from a centre already (residuals).
    NaN when ``values`` is empty.
    """
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return math.nan
    s0 = MAD_TO_SIGMA * float(np.median(np.abs(v)))
    v = np.clip(v, -clip * s0, clip * s0)  # s0 = 0 (most values exactly 0): every value counts as 0
    return max(float(np.sqrt(np.mean(v * v))), floor)


def screen_replicas(norm_sq: np.ndarray, present: Optional[np.ndarray] = None,
                    config: ScreeningConfig = DEFAULT_SCREENING) -> ReplicaScreen:
    """Screens replicas' squared gradient norms for persistent drift and one-step spikes
    (formulas in the module docstring).

    Args:
      norm_sq: float ``[T, R]``, steps in order.
      present: bool ``[T, R]``: whether replica r logged a norm at step t (default: where
        ``norm_sq`` is not NaN; pass it to tell a logged NaN, which is a finding, from a gap).
      config: thresholds.

    Returns:
      :class:`ReplicaScreen`; empty (no drift, no spike, ``judged`` 0) with fewer than 3
      replicas, where no single replica can be told from the others. Cost O(T * R * W) time,
      O(R * W) memory besides the inputs and the scores.

    Raises:
      ValueError: ``norm_sq`` is not 2-D, or ``present`` has another shape.
    """
    n = np.asarray(norm_sq, np.float64)
    if n.ndim != 2:
        raise ValueError(f"norm_sq must be [steps, replicas], got shape {n.shape}")
    present = ~np.isnan(n) if present is None else np.asarray(present, bool)
    if present.shape != n.shape:
        raise ValueError(f"present has shape {present.shape}, norm_sq {n.shape}")
    T, R = n.shape
    z_all = np.full((T, R), np.nan)
    resid = np.full((T, R), np.nan)
    sigma = np.full(T, np.nan)
    if R < 3:
        return ReplicaScreen((), (), z_all, sigma, 0)
    good = present & np.isfinite(n) & (n > 0)
    logn = 0.5 * np.log(np.where(good, n, 1.0))
    bad = present & ~np.isfinite(n)  # a NaN or Inf norm: a non-finite gradient, or one that overflowed
    W, m = int(config.baseline_window), int(config.min_history)
    k, h, c = config.cusum_k, config.cusum_h, config.clip_z
    buf = np.full((W, R), np.nan)  # each replica's accepted history of x (a ring)
    res = np.full((W, R), np.nan)  # the residuals of those entries, pooled for sigma
    pos = np.zeros(R, np.int64)
    cnt = np.zeros(R, np.int64)
    sp, sm = np.zeros(R), np.zeros(R)
    onset_p, onset_m = np.zeros(R, np.int64), np.zeros(R, np.int64)
    peak = np.zeros(R)
    alarmed = np.zeros(R, bool)
    first: dict[int, tuple[int, int, int]] = {}
    spikes: list[Spike] = []
    judged = 0
    for t in range(T):
        # the log-ratio against the median of the replicas not (yet) alarmed: a drifting replica,
        # once named, no longer moves the others' reference
        ref = good[t] & ~alarmed
        if ref.sum() < 2:
            ref = good[t]
        xt = np.where(good[t], logn[t] - (np.median(logn[t][ref]) if ref.sum() >= 2 else np.nan), np.nan)
        if good[t].sum() >= 2:  # others of the step are healthy: this replica alone went non-finite
            spikes.extend(Spike(t, int(r), math.inf) for r in np.nonzero(bad[t])[0])
        b = _column_medians(buf, np.minimum(cnt, W))
        pooled = res[~np.isnan(res)]
        if cnt.max() > m and pooled.size >= 2 * m:
            # one sigma per side: log gradient norms are right-skewed (a row of rare, high-loss
            # tokens lifts a replica's norm more often than anything lowers it)
            s_up = robust_sigma(np.concatenate([pooled[pooled > 0], -pooled[pooled > 0]]), config.clip_z,
                                config.sigma_floor)
            s_dn = robust_sigma(np.concatenate([pooled[pooled < 0], -pooled[pooled < 0]]), config.clip_z,
                                config.sigma_floor)
        else:
            s_up = s_dn = np.nan
        sigma[t] = s = 0.5 * (s_up + s_dn)
        live = np.isfinite(xt)
        score = (cnt >= m) & live & np.isfinite(b) & np.isfinite(s)
        d = xt - b
        z = np.where(score, d / np.where(d > 0, s_up, s_dn), np.nan)
        resid[t] = np.where(score, d, np.nan)
        z_all[t] = z
        judged += int(score.sum())
        spike = score & (np.abs(np.nan_to_num(z)) > config.spike_z)
        spikes.extend(Spike(t, int(r), float(z[r])) for r in np.nonzero(spike)[0])
        zc = np.where(score & ~spike, np.clip(np.nan_to_num(z), -c, c), 0.0)
        on = score & ~spike  # a spike is the spike test's; it does not move the CUSUM
        was_p, was_m = sp > 0, sm > 0
        sp = np.where(on, np.maximum(0.0, sp + zc - k), sp)
        sm = np.where(on, np.maximum(0.0, sm - zc - k), sm)
        onset_p = np.where(on & ~was_p & (sp > 0), t, onset_p)
        onset_m = np.where(on & ~was_m & (sm > 0), t, onset_m)
        for r in np.nonzero(on & ((sp > h) | (sm > h)))[0]:
            up = bool(sp[r] >= sm[r])
            if not alarmed[r]:
                alarmed[r] = True
                first[int(r)] = (t, int(onset_p[r] if up else onset_m[r]), 1 if up else -1)
            peak[r] = max(peak[r], max(sp[r], sm[r]) / h)
        # The baseline takes a value unless the replica is on a significant excursion (S above
        # freeze * h: a rolling median must not absorb the drift it measures) or has alarmed.
        # Freezing only then, not whenever S > 0, keeps the accepted values unselected (S > 0
        # half of the time on clean data: accepting only S == 0 would keep the small ones and
        # shrink sigma).
        frozen = (np.maximum(sp, sm) > config.freeze * h) | alarmed
        accept = live & ~spike & ~frozen
        for r in np.nonzero(accept)[0]:
            buf[pos[r], r] = xt[r]
            res[pos[r], r] = xt[r] - b[r] if np.isfinite(b[r]) else np.nan
            pos[r] = (pos[r] + 1) % W
            cnt[r] += 1
    drifts = []
    for r, (alarm, onset, direction) in sorted(first.items()):
        onset, lo, hi = change_point_range(direction * z_all[:, r], alarm, W, onset, c)
        span, dspan = z_all[onset:, r], resid[onset:, r]
        shift = float(np.median(span[np.isfinite(span)])) if np.isfinite(span).any() else 0.0
        shift_log = float(np.median(dspan[np.isfinite(dspan)])) if np.isfinite(dspan).any() else 0.0
        scored = np.nonzero(np.isfinite(z_all[:, r]))[0]
        drifts.append(DriftAlarm(replica=r, onset=onset, alarm=alarm, direction=direction,
                                 strength=float(peak[r]), shift=shift, shift_log=shift_log, onset_lo=lo,
                                 onset_hi=hi, scoring_start=int(scored[0]) if scored.size else onset))
    return ReplicaScreen(drifts=tuple(drifts), spikes=tuple(spikes), z=z_all, sigma=sigma, judged=judged)


CHANGE_POINT_KAPPA = 3.0  # log-likelihood units: the onset range holds every step within this of the best


def change_point(z: np.ndarray, alarm: int, lookback: int, default: int, clip: float = math.inf) -> int:
    """The most likely first step of an upward mean shift in the scores ``z`` that alarmed at ``alarm``
    (:func:`change_point_range`'s estimate)."""
    return change_point_range(z, alarm, lookback, default, clip)[0]


def change_point_range(z: np.ndarray, alarm: int, lookback: int, default: int, clip: float = math.inf,
                       kappa: float = CHANGE_POINT_KAPPA) -> tuple[int, int, int]:
    """``(tau, lo, hi)``: the most likely first step ``tau`` of an upward mean shift in the scores ``z`` that
    alarmed at ``alarm``, and the range ``[lo, hi]`` it could lie in.

    The estimate is Hinkley's (1971): for a shift from 0 to ``d`` at ``tau``, the log-likelihood ratio of
    the scores up to the alarm is ``d * sum_{t >= tau} (z_t - d/2)``, largest where the cumulative sum
    of ``z - d/2`` is smallest just before ``tau``. ``d`` is the median score from the current ``tau``
    (first ``default``, the CUSUM's own onset) to the alarm, and the two are refined in turn (up to 3
    rounds); scores are clipped to ``+-clip``. Using ``d/2`` rather than 0 matters: the scores' mean is
    not exactly 0 before a change (they are median-centred and log norms are skewed), and a cumulative
    sum of raw scores drifts away from the true onset.

    The search covers ``[alarm - lookback, alarm]`` *from the first scored step on*: before it the
    scores are NaN (no baseline yet), which is no evidence of a change, and a search over them put the
    onset of a drift that began after scoring started at the first step of the run. ``[lo, hi]`` is
    the likelihood-ratio set of the change point (Hinkley 1970): every ``t`` whose log-likelihood is
    within ``kappa`` of the best's (``d * (c[t] - c[tau]) <= kappa``, ``c`` the cumulative sum above; the
    scores are in sigma units). It never starts before scoring began; when it starts there the
    change may be older than the scores can tell.
    """
    lo0 = max(0, alarm - lookback)
    window = np.asarray(z[lo0:alarm + 1], np.float64)
    finite = np.nonzero(np.isfinite(window))[0]
    if not finite.size:
        t = min(max(default, lo0), alarm)
        return t, t, t
    lo = lo0 + int(finite[0])  # scoring began here
    seg = np.clip(np.asarray(z[lo:alarm + 1], np.float64), -clip, clip)
    tau = min(max(default, lo), alarm)
    d, c = 0.0, np.zeros(seg.size + 1)
    for _ in range(3):  # estimate d from the scores after tau, then tau from d (each improves the other)
        post = seg[tau - lo:]
        post = post[np.isfinite(post)]
        if not post.size:
            return tau, tau, tau
        d = max(float(np.median(post)), 0.0)
        inc = np.where(np.isfinite(seg), seg - d / 2, 0.0)
        c = np.concatenate([[0.0], np.cumsum(inc)])  # c[i] = sum of inc[:i]
        new = lo + int(np.argmin(c[:-1]))
        if new == tau:
            break
        tau = new
    within = np.nonzero(d * (c[:-1] - c[tau - lo]) <= kappa)[0]
    return tau, lo + int(within.min()), lo + int(within.max())


def _column_medians(buf: np.ndarray, filled: np.ndarray) -> np.ndarray:
    """Per column, the median of its first ``filled[c]`` non-NaN entries (NaN sorts last); NaN for
    an empty column. (``np.nanmedian`` goes through masked arrays: ~20x slower here.)"""
    srt = np.sort(buf, axis=0)
    cols = np.arange(buf.shape[1])
    f = np.clip(filled, 1, buf.shape[0])
    med = 0.5 * (srt[(f - 1) // 2, cols] + srt[f // 2, cols])
    return np.where(filled > 0, med, np.nan)


# ----------------------------------------------------------------------------- loss, loader


def loss_spikes(loss: np.ndarray, config: ScreeningConfig = DEFAULT_SCREENING) -> list[tuple[int, float]]:
    """Steps whose loss jumps above its recent level (a robust derivative).

    For each step ``t`` with at least 3 finite losses among the previous ``loss_window``:
    ``rise = loss[t] - median(previous)``, ``s = robust_sigma`` of the previous steps' one-step
    differences (about their median), ``z = rise / s``; a spike when ``z > loss_spike_z`` and
    ``rise > loss_min_rise * |median|``. A non-finite loss (NaN or Inf) after finite ones is a
    spike with ``z = inf``.

    Args:
      loss: float ``[T]``, the logged losses in step order (leave unlogged steps out).

    Returns:
      ``[(index, z)]`` in order.
    """
    x = np.asarray(loss, np.float64)
    W = int(config.loss_window)
    out = []
    for t in range(len(x)):
        hist = x[max(0, t - W):t]
        hist = hist[np.isfinite(hist)]
        if hist.size < 3:
            continue
        if not np.isfinite(x[t]):
            out.append((t, math.inf))
            continue
        med = float(np.median(hist))
        d = np.diff(hist)
        s = robust_sigma(d - np.median(d), config.clip_z, 1e-6 * max(abs(med), 1e-12))
        rise = float(x[t]) - med
        z = rise / s
        if z > config.loss_spike_z and rise > config.loss_min_rise * abs(med):
            out.append((t, z))
    return out


def loader_stalls(wait_s: np.ndarray, step_s: np.ndarray, skip: Optional[np.ndarray] = None,
                  config: ScreeningConfig = DEFAULT_SCREENING) -> list[int]:
    """Steps that waited for data: ``wait > max(stall_fraction * median step time, stall_min_s)``.

    Args:
      wait_s: float ``[T]`` seconds each step waited for its batch (NaN: not logged).
      step_s: float ``[T]`` seconds of each train step (their median sets the scale).
      skip: bool ``[T]``: steps not judged (the first step after a start or restore waits for the
        pipeline to fill by design).

    Returns:
      indices of the stalled steps, in order.
    """
    w = np.asarray(wait_s, np.float64)
    st = np.asarray(step_s, np.float64)
    med = float(np.nanmedian(st)) if np.isfinite(st).any() else 0.0
    limit = max(config.stall_fraction * med, config.stall_min_s)
    bad = np.isfinite(w) & (w > limit)
    if skip is not None:
        bad &= ~np.asarray(skip, bool)
    return [int(i) for i in np.nonzero(bad)[0]]
