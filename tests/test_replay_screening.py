"""The screening statistics of `replay scan` (replay.screen.screening): pure NumPy, tables and hypothesis."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.screen import screening as sc

CFG = sc.ScreeningConfig()


def _clean(seed, T=120, R=8, sigma=0.1):
    """Squared norms whose log-ratios are iid normal (sd ``sigma`` in norm units), plus a common
    factor per step (the loss scale moving), which the log-ratio must cancel."""
    rng = np.random.default_rng(seed)
    log_norm = rng.normal(0, sigma, (T, R)) + rng.normal(0, 1.0, (T, 1)) + np.linspace(2, -1, T)[:, None]
    return np.exp(2 * log_norm)


# ----------------------------------------------------------------------------- log-ratios


def test_log_ratio_table():
    n = np.array([[1.0, 4.0, 16.0], [2.0, 2.0, np.nan], [1.0, np.inf, 0.0]])
    x = sc.log_ratios(n)
    # step 0: norms 1, 2, 4 -> median 2 -> ln(1/2), 0, ln 2
    np.testing.assert_allclose(x[0], [-math.log(2), 0.0, math.log(2)])
    np.testing.assert_allclose(x[1, :2], [0.0, 0.0])
    assert np.isnan(x[1, 2])
    assert np.isnan(x[2]).all()  # one usable norm only: no ratio


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(1e-3, 1e3), st.permutations(range(5)))
def test_log_ratios_are_scale_free_and_permute_with_the_replicas(seed, scale, perm):
    n = _clean(seed, T=6, R=5)
    x = sc.log_ratios(n)
    np.testing.assert_allclose(sc.log_ratios(n * scale), x, atol=1e-9)
    np.testing.assert_allclose(sc.log_ratios(n[:, list(perm)]), x[:, list(perm)], atol=1e-12)


# ----------------------------------------------------------------------------- robust pieces


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=3, max_size=60), st.floats(0.01, 100))
def test_robust_sigma_scales_and_bounds_an_outlier(values, scale):
    v = np.asarray(values)
    s = sc.robust_sigma(v, 4.0)
    assert sc.robust_sigma(v * scale, 4.0) == pytest.approx(s * scale, rel=1e-9, abs=1e-12)
    s0 = sc.MAD_TO_SIGMA * np.median(np.abs(v))
    wild = sc.robust_sigma(np.append(v, 1e12), 4.0)  # one wild value moves it by a bounded amount
    bound = sc.MAD_TO_SIGMA * np.median(np.abs(np.append(v, 1e12)))
    assert wild <= math.sqrt((np.sum(np.minimum(v * v, (4 * bound) ** 2)) + (4 * bound) ** 2) / (v.size + 1)) + 1e-9
    assert s <= max(np.max(np.abs(v)), 4 * s0) + 1e-9


def test_robust_sigma_of_a_normal_sample_is_its_sigma():
    v = np.random.default_rng(0).normal(0, 3.0, 20_000)
    assert sc.robust_sigma(v, 4.0) == pytest.approx(3.0, rel=0.02)
    assert math.isnan(sc.robust_sigma(np.array([]), 4.0))
    assert sc.robust_sigma(np.zeros(5), 4.0, floor=0.5) == 0.5


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(1, 5), st.integers(0, 10_000))
def test_column_medians_equal_nanmedian(W, R, seed):
    rng = np.random.default_rng(seed)
    buf = np.full((W, R), np.nan)
    filled = rng.integers(0, W + 1, R)
    for c in range(R):
        buf[: filled[c], c] = rng.normal(size=filled[c])
        rng.shuffle(buf[:, c])
    got = sc._column_medians(buf, filled)
    want = [np.median(buf[~np.isnan(buf[:, c]), c]) if filled[c] else np.nan for c in range(R)]
    np.testing.assert_allclose(got, want, equal_nan=True)


def test_change_point_of_a_step():
    z = np.r_[np.random.default_rng(1).normal(0.3, 1.0, 50), np.random.default_rng(2).normal(3.0, 1.0, 10)]
    # the alarm fires at 55; the CUSUM's own onset may be early (the scores' mean before is 0.3)
    assert sc.change_point(z, 55, 40, 42) == 50


# ----------------------------------------------------------------------------- replicas


@pytest.mark.parametrize("seed", range(6))
def test_clean_replicas_raise_no_alarm(seed):
    res = sc.screen_replicas(_clean(seed))
    assert res.drifts == () and res.spikes == ()
    assert res.judged == sum(max(0, 120 - CFG.min_history - 1) for _ in range(8)) or res.judged > 800
    assert np.nanstd(res.z) == pytest.approx(1.0, abs=0.2)  # the robust sigma is the scores' spread


@pytest.mark.parametrize("replica,start,rel", [(0, 40, 0.3), (5, 70, 0.3), (7, 55, -0.25), (3, 30, 1.0)])
def test_a_persistent_shift_names_the_replica_and_its_onset(replica, start, rel):
    n = _clean(11 + replica)
    n[start:, replica] *= (1 + rel) ** 2  # a scaled gradient: its norm grows by (1 + rel)
    res = sc.screen_replicas(n)
    assert [a.replica for a in res.drifts] == [replica]
    a = res.drifts[0]
    assert abs(a.onset - start) <= 3 and a.alarm >= a.onset and a.direction == (1 if rel > 0 else -1)
    assert a.strength >= 1.0
    assert math.expm1(a.shift_log) == pytest.approx(rel, abs=0.1)


def test_a_spike_and_a_non_finite_norm_are_one_step_findings():
    n = _clean(3)
    n[60, 2] *= 1e6  # one step, one replica: a flipped exponent bit
    n[80, 4] = np.inf  # an overflowing norm
    res = sc.screen_replicas(n)
    assert [(s.index, s.replica) for s in res.spikes] == [(60, 2), (80, 4)]
    assert math.isinf(res.spikes[1].z) and res.spikes[0].z > CFG.spike_z
    assert res.drifts == ()


def test_a_step_of_unusual_rows_is_not_a_spike_but_a_flipped_exponent_is():
    """The spike threshold clears the heavy tail of clean scores: a replica whose norm is 8x the
    others' for one step (a row of rare tokens; z about 21 at sigma 0.1, the size seen on clean
    drill runs) is not a finding, a norm 1000x the others' is."""
    n = _clean(5)
    n[70, 3] *= 8.0 ** 2  # norm_sq: the norm 8x
    n[90, 6] *= 1000.0 ** 2
    res = sc.screen_replicas(n)
    assert 15 < res.z[70, 3] < CFG.spike_z
    assert [(s.index, s.replica) for s in res.spikes] == [(90, 6)]
    assert res.drifts == ()


def test_a_logged_nan_is_a_finding_but_a_gap_is_not():
    n = _clean(4)
    present = np.ones(n.shape, bool)
    n[50, 1] = np.nan  # logged NaN
    n[51, 1], present[51, 1] = np.nan, False  # not logged
    res = sc.screen_replicas(n, present)
    assert [(s.index, s.replica) for s in res.spikes] == [(50, 1)]


def test_fewer_than_three_replicas_are_not_judged():
    res = sc.screen_replicas(_clean(0, R=2))
    assert res.judged == 0 and res.drifts == () and res.spikes == ()


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.permutations(range(5)))
def test_screening_permutes_with_the_replicas(seed, perm):
    n = _clean(seed, T=60, R=5)
    n[30:, 1] *= 2.0
    a, b = sc.screen_replicas(n), sc.screen_replicas(n[:, list(perm)])
    inv = {new: old for new, old in enumerate(perm)}
    assert sorted((inv[d.replica], d.onset, d.alarm) for d in b.drifts) == sorted(
        (d.replica, d.onset, d.alarm) for d in a.drifts)
    np.testing.assert_allclose(b.z, a.z[:, list(perm)], equal_nan=True)


# ----------------------------------------------------------------------------- loss, loader


def test_loss_spikes_table():
    loss = np.r_[np.linspace(8, 5, 30), [5.0, 4.98, 6.5, 4.97, 4.96, np.nan, 4.95, np.inf]]
    loss = loss + np.random.default_rng(0).normal(0, 0.01, loss.size)
    spikes = sc.loss_spikes(loss)
    assert [i for i, _ in spikes] == [32, 35, 37]  # the jump, the NaN loss and the infinite one
    assert math.isinf(spikes[1][1]) and math.isinf(spikes[2][1]) and spikes[0][1] > 6


def test_loader_stalls_table():
    wait = np.array([0.5, 0.001, 0.002, 0.3, 0.001, 0.06, 0.02])
    step = np.full(7, 0.1)
    skip = np.array([True, False, False, False, False, False, False])
    # limit max(0.25 * 0.1, 0.05) = 0.05: steps 3 and 5; step 0 is the start (skipped)
    assert sc.loader_stalls(wait, step, skip) == [3, 5]


# ----------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize("cls,raw,match", [
    (sc.RouterHealth, {"max_dropped_fraction": 2}, r"router_health.max_dropped_fraction: must be in \[0, 1\], got 2"),
    (sc.RouterHealth, {"max_share_ratio": 0.5}, r"max_share_ratio: must be >= 1"),
    (sc.RouterHealth, {"warmup": 3}, r"router_health: unknown keys \['warmup'\]"),
    (sc.ScreeningConfig, {"min_history": 50}, r"screening.min_history: must be an int in \[3, baseline_window=40\]"),
    (sc.ScreeningConfig, {"cusum_h": "high"}, r"screening.cusum_h: must be a number, got 'high'"),
])
def test_threshold_errors_name_the_field(cls, raw, match):
    with pytest.raises(sc.ScreeningConfigError, match=match):
        cls.from_dict(raw)


def test_threshold_defaults_round_trip():
    assert sc.RouterHealth.from_dict(None) == sc.RouterHealth()
    assert sc.RouterHealth().to_dict() == {"max_dropped_fraction": 0.01, "max_share_ratio": 3.0, "warmup_steps": 10,
                                           "window_steps": 1, "max_expert_load_ratio": 2.0}
    assert sc.ScreeningConfig.from_dict(sc.ScreeningConfig().to_dict()) == sc.ScreeningConfig()
