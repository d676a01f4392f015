"""Pictures that explain themselves (issue 23, item 6): train.png, scan.png and replay.png, built from
hand-made series (no training), checked through their matplotlib figures: what each panel says,
its limits, its legend's place, its tick labels."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from replay import report  # noqa: E402
from replay.run.train_plot import say_if_all_zero  # noqa: E402


def _texts(ax):
    return [t.get_text() for t in ax.texts]


# ----------------------------------------------------------------------------- train.png


def test_a_panel_whose_values_are_all_zero_says_so():
    fig, (a, b) = plt.subplots(2)
    assert say_if_all_zero(a, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], "dropped fraction") is True
    assert _texts(a) == ["dropped fraction: all 0 (3 steps)"]
    assert say_if_all_zero(b, [[0.0, 0.0], [0.0, 1e-6]], "dropped fraction") is False
    assert say_if_all_zero(b, [], "loss") is False and _texts(b) == []
    plt.close(fig)


def test_train_png_says_all_zero_on_the_dropped_panel(tmp_path, monkeypatch):
    from replay.run import train_plot as plot
    from replay.run import protocol as proto

    for s in range(4):
        layers = tuple(proto.RouterLayerStats(entropy=1.0, expert_share=(0.5, 0.5), dropped_fraction=0.0,
                                              max_logit=1.0, z_loss=0.0, aux_loss=0.0) for _ in range(2))
        proto.append_line(str(tmp_path / proto.SIGNALS_NAME),
                          proto.StepSignals(step=s, loss=5.0 - s / 10, grad_norm=1.0, router=layers).to_json())
    said = []
    real = plot.say_if_all_zero
    monkeypatch.setattr(plot, "say_if_all_zero", lambda ax, series, what: said.append((what, real(ax, series, what))))
    path = plot.plot_training(str(tmp_path), title="t")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert said == [("loss", False), ("norm", False), ("dropped fraction", True)]


# ----------------------------------------------------------------------------- scan.png


def _scan(tmp_path, *, suspects=(), spike_z=40.0):
    from replay.screen.scan import ScanReport

    steps = list(range(30))
    rng = np.random.default_rng(0)
    z = rng.normal(0, 1.5, (30, 4))
    z[:10] = np.nan  # not scored before min_history
    each = np.abs(rng.normal(3, 1, (30, 2))) + 1
    each[:10] = 5.0  # above the limit during warm-up
    each[15, 1] = 2000.0  # a single step far above the limit
    window = np.full((30, 2), np.nan)
    window[10:] = 1.5  # the judged window stays under it
    series = {
        "replicas": {"steps": steps, "replicas": [0, 1, 2, 3], "devices": [[0], [1], [2], [3]],
                     "log_ratio": z / 10, "z": z, "sigma": np.full(30, 0.1)},
        "router": {"steps": steps, "dropped": np.zeros((30, 2)), "share_ratio": each, "share_ratio_window": window,
                   "window": 10},
        "loss": {"steps": steps, "loss": list(np.linspace(9.6, 6.5, 30))},
        "loader": {"steps": steps, "wait": list(np.full(30, 1e-4)), "step_time": list(np.full(30, 8.0))},
        "canary": [],
    }
    checks = {n: {"status": "clear", "detail": ""} for n in ("canary", "norm_spike", "norm_drift", "router")}
    with open(tmp_path / "events.jsonl", "w") as f:
        for e in ({"event": "start", "step": 0}, {"event": "phase_change", "step": 25, "phase": 1}):
            f.write(json.dumps(e) + "\n")
    return ScanReport(run_dir=str(tmp_path), steps=(0, 30), checks=checks, suspects=list(suspects), explained=[],
                      suggestion=None, figures={}, series=series,
                      limits={"max_dropped_fraction": 0.01, "max_share_ratio": 3.0, "warmup_steps": 10,
                              "window_steps": 10, "screening": {"spike_z": spike_z, "min_history": 10}})


def test_scan_png_explains_itself(tmp_path):
    fig = report.scan_figure(_scan(tmp_path))
    fig.canvas.draw()
    replicas, loss, dropped, shares, loader = fig.axes[:5]
    assert fig._suptitle.get_text() == f"replay scan of {tmp_path}, steps 0:30: CLEAN: no check found anything"
    # the dropped fraction from 0, with its limit in view, and "all 0" on the panel
    assert dropped.get_ylim()[0] == 0 and dropped.get_ylim()[1] >= 0.01
    assert "dropped fraction, every layer: all 0 (30 steps)" in _texts(dropped)
    # the replica panel's spike threshold
    spike = [ln for ln in replicas.get_lines() if ln.get_label() == "spike threshold (|z| 40)"]
    assert len(spike) == 1 and list(spike[0].get_ydata()) == [40, 40]
    assert replicas.get_ylim()[1] >= 40 and replicas.get_ylim()[0] <= -40
    # the phase change at step 25 on every panel, and in every legend
    for ax in (replicas, loss, dropped, shares, loader):
        assert any(list(ln.get_xdata()) == [25, 25] for ln in ax.get_lines()), ax.get_title()
        assert "phase change" in [t.get_text() for t in ax.get_legend().get_texts()]
    # every legend right of its axes: it covers no data
    for ax in (replicas, loss, dropped, shares, loader):
        assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1
    # log-scale tick labels as people read them
    assert [t.get_text() for t in shares.get_yticklabels() if t.get_text()][:3] == ["1x", "10x", "100x"]
    labels = [t.get_text() for t in loader.get_yticklabels() if t.get_text()]
    assert "1 ms" in labels and "1 s" in labels and "10 s" in labels
    # single steps far above the limit under a CLEAN title: explained on the panel, in a box no line crosses
    note = "\n".join(_texts(shares))
    assert note == (
        "before step 10 (warm-up) nothing is judged\n"
        "thin lines above the 3x limit are single steps, not judged: one step's shares follow the sources of its "
        "few rows\njudged: the mean over 10 steps (thick) after warm-up, under the limit: router check clear")
    box = shares.texts[0].get_window_extent()
    for ln in shares.get_lines():
        xy = shares.transData.transform(np.column_stack([ln.get_xdata(), ln.get_ydata()]).astype(float))
        inside = (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
        assert not inside.any(), ln.get_label()
    plt.close(fig)


def test_scan_png_names_what_was_not_available(tmp_path):
    scan = _scan(tmp_path)
    scan.checks["canary"] = {"status": "not available", "detail": "no canary.jsonl"}
    fig = report.scan_figure(scan)
    assert " ".join(fig._suptitle.get_text().split()).endswith(  # a long title wraps
        "CLEAN: no check found anything (canary not available)")
    plt.close(fig)


# ----------------------------------------------------------------------------- replay.png


@pytest.mark.parametrize("n", [10, 60])
def test_replay_png_names_the_run_and_range_and_keeps_step_labels_level(n):
    steps = [{"step": s, "ok": True, "kind": None, "devices": {}} for s in range(100, 100 + n)]
    rep = {"run": "build/demo/run", "steps": {"start": 105, "stop": 100 + n}, "checkpoint": 100,
           "run_devices": [0, 1, 2, 3], "verdict": "acquitted", "cause": "reproduced",
           "replays": [{"index": 0, "assignment": [0, 1, 2, 3], "steps": steps},
                       {"index": 1, "assignment": [4, 5, 6, 7], "steps": steps}]}
    fig = report.range_figure(rep)
    fig.canvas.draw()
    assert fig._suptitle.get_text() == (f"replay of build/demo/run, steps 105:{100 + n} (from checkpoint 100): "
                                        "ACQUITTED (reproduced)")
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(t.get_rotation() == 0 for t in labels)
        boxes = [t.get_window_extent() for t in labels]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))  # level and apart, not overlapping
    plt.close(fig)
