"""``train.png``: a training run's loss, gradient norm, router dropped fraction and input buffer per step.

Read from the run directory's ``signals.jsonl`` (one line per step, kept whole across resumes:
a resumed run drops the lines from its checkpoint on and appends them again), so the picture
covers the whole run whatever number of invocations trained it. Phase changes, skipped windows,
restores and canary mismatches from ``events.jsonl`` are drawn as vertical lines. No JAX.

Any trainer's run directory can be drawn (:func:`plot_training`); the reference trainer draws
it at the end of every invocation.
"""

from __future__ import annotations

import os
from typing import Optional

from common import figures
from replay.run import protocol as proto

TRAIN_PNG = "train.png"

_EVENT_STYLE = {  # event -> (colour, line style, legend label)
    "phase_change": ("tab:purple", "--", "phase change"),
    "skipped_window": ("tab:gray", ":", "skipped data window"),
    "restore": ("tab:green", "-.", "resumed from checkpoint"),
    "canary_mismatch": ("tab:red", "-", "canary mismatch"),
}


def training_series(run_dir: str) -> dict[str, list]:
    """The per-step series of ``train.png`` from ``<run_dir>/signals.jsonl``.

    Returns:
      ``{"steps": [int], "loss": [float], "grad_norm": [float], "dropped": [[float] per MoE layer],
      "occupancy": [batches ready at the ask, or None], "occupancy_min": [lowest level, or None],
      "wait_s": [loader wait s, or None]}``, steps ascending (each logged step once); empty lists
      when nothing is logged yet.

    Raises:
      OSError, ValueError: signals.jsonl is unreadable or malformed (``replay.run.protocol.read_signals``).
    """
    signals = proto.read_signals(run_dir) if os.path.exists(os.path.join(run_dir, proto.SIGNALS_NAME)) else {}
    steps = sorted(signals)
    layers = max((len(signals[s].router) for s in steps), default=0)
    return {
        "steps": steps,
        "loss": [signals[s].loss for s in steps],
        "grad_norm": [signals[s].grad_norm for s in steps],
        "dropped": [[signals[s].router[i].dropped_fraction if len(signals[s].router) > i else float("nan")
                     for s in steps] for i in range(layers)],
        "occupancy": [signals[s].loader_occupancy for s in steps],
        "occupancy_min": [signals[s].loader_occupancy_min for s in steps],
        "wait_s": [signals[s].loader_wait_s for s in steps],
    }


def plot_training(run_dir: str, path: Optional[str] = None, title: Optional[str] = None) -> str:
    """Writes the training picture of ``run_dir`` (module docstring); returns its path.

    Four panels over the training step (x): the loss (nats per target token), the global
    gradient norm (L2 of the reduced gradient, log scale), each MoE layer's router dropped
    fraction (assignments past expert capacity / all assignments, in [0, 1]) and the input
    side: the loader's prefetch buffer level when the trainer asked for the step's batch and
    its lowest level over the step (batches; 0 at the ask: the step waited), with the wait
    (ms, right axis).

    Args:
      run_dir: a run directory (``replay.run.protocol`` layout).
      path: the PNG to write (default ``<run_dir>/train.png``); written under a temporary name,
        then renamed, so a reader never sees half a file.
      title: the figure's title (default: the run's name from ``run_config.yaml`` and its folder).

    Raises:
      OSError: the PNG cannot be written. A run with no signal lines yet gives a picture that
        says so, not an error.
    """
    plt = figures.pyplot()
    run_dir = os.path.abspath(run_dir)
    path = path or os.path.join(run_dir, TRAIN_PNG)
    series = training_series(run_dir)
    steps = series["steps"]
    if title is None:
        title = f"training run {_run_name(run_dir)} ({run_dir})"
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True, height_ratios=(1, 1, 1, 0.9))
    fig.suptitle(title + (f": steps 0:{steps[-1] + 1}" if steps else ": no step logged yet"), fontsize=10)
    loss_ax, norm_ax, drop_ax, input_ax = axes
    if steps:
        loss_ax.plot(steps, series["loss"], color="black", linewidth=1, label="loss")
        norm_ax.plot(steps, series["grad_norm"], color="tab:blue", linewidth=1, label="gradient norm")
        norms = [v for v in series["grad_norm"] if v == v and v != float("inf")]
        if norms and min(norms) > 0 and max(norms) / min(norms) > 20:  # a spike: keep the rest visible
            norm_ax.set_yscale("log")
        for i, dropped in enumerate(series["dropped"]):
            drop_ax.plot(steps, dropped, linewidth=1, label=f"layer {i}")
        for ax, values, what in ((loss_ax, [series["loss"]], "loss"), (norm_ax, [series["grad_norm"]], "norm"),
                                 (drop_ax, series["dropped"], "dropped fraction")):
            say_if_all_zero(ax, values, what)
    else:
        loss_ax.text(0.5, 0.5, f"no lines in {proto.SIGNALS_NAME} yet", ha="center", transform=loss_ax.transAxes)
    _plot_input(input_ax, series)
    _mark_events(run_dir, axes, steps)
    loss_ax.set_ylabel("loss (nats / token)")
    loss_ax.set_title("training loss", fontsize=9)
    norm_ax.set_ylabel("gradient norm (L2)")
    norm_ax.set_title("global gradient norm (reduced gradient)", fontsize=9)
    drop_ax.set_ylabel("dropped fraction")
    drop_ax.set_title("router: assignments dropped past expert capacity, per MoE layer", fontsize=9)
    drop_ax.set_ylim(bottom=0)
    input_ax.set_xlabel("training step")
    from matplotlib.ticker import MaxNLocator

    input_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, never 2.5
    for ax in axes:
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if len(handles) > 1:
            ax.legend(fontsize=7, loc="upper right", ncol=min(4, len(handles)))
    fig.tight_layout()
    return figures.save(fig, path, dpi=100)


def _plot_input(ax, series) -> None:
    """The input panel: buffer levels (batches, left) and the loader wait (ms, right), per step."""
    from matplotlib.ticker import MaxNLocator

    steps, occ = series["steps"], series.get("occupancy") or []
    ax.set_title("input: prefetch buffer when the trainer asked (0 = drained: the step waited for its batch)",
                 fontsize=9)
    ax.set_ylabel("batches ready")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    known = [(s, o) for s, o in zip(steps, occ) if o is not None]
    if not known:
        ax.text(0.5, 0.5, "buffer occupancy not logged (loader_occupancy)", ha="center", va="center",
                transform=ax.transAxes, fontsize=10, color="dimgray")
        return
    xs, ys = zip(*known)
    ax.step(xs, ys, where="mid", color="tab:green", linewidth=1.2, label="ready at the ask")
    low = [(s, o) for s, o in zip(steps, series.get("occupancy_min") or []) if o is not None]
    if low:
        ax.step(*zip(*low), where="mid", color="tab:olive", linestyle=":", linewidth=1, label="lowest over the step")
    drained = [s for s, o in known if o == 0]
    if drained:
        ax.plot(drained, [0] * len(drained), "v", color="tab:red", markersize=5,
                label=f"drained at the ask ({len(drained)} step{'s' if len(drained) != 1 else ''})")
    ax.set_ylim(bottom=-0.3, top=max(ys) + 0.8)
    waits = [(s, w * 1e3) for s, w in zip(steps, series.get("wait_s") or []) if w is not None]
    if waits:
        right = ax.twinx()
        right.plot(*zip(*waits), color="tab:red", linewidth=0.8, alpha=0.6)
        right.set_ylabel("wait (ms)", color="tab:red")
        right.set_ylim(bottom=0)
        right.tick_params(axis="y", colors="tab:red")


def say_if_all_zero(ax, series, what: str) -> bool:
    """Writes ``all 0`` on the panel ``ax`` when every value of ``series`` (lists of numbers) is 0, so
    that a flat line on the axis does not read as missing data; returns whether it did.

    ``what`` names the values (``"dropped fraction"``): the panel says ``dropped fraction: all 0 (N
    steps)``."""
    values = [v for s in series for v in s]
    if not values or any(v != 0 for v in values):
        return False
    steps = max(len(s) for s in series)
    ax.text(0.5, 0.55, f"{what}: all 0 ({steps} step{'s' if steps != 1 else ''})", ha="center", va="center",
            transform=ax.transAxes, fontsize=11, color="dimgray",
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "lightgray"})
    return True


def _run_name(run_dir: str) -> str:
    import yaml

    try:
        with open(os.path.join(run_dir, proto.RUN_CONFIG_NAME), encoding="utf-8") as f:
            return str((yaml.safe_load(f) or {}).get("name") or os.path.basename(run_dir))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return os.path.basename(run_dir)


def _mark_events(run_dir: str, axes, steps) -> None:
    """Vertical lines at the steps of the events in ``_EVENT_STYLE`` (one legend entry each kind)."""
    if not steps or not os.path.exists(os.path.join(run_dir, proto.EVENTS_NAME)):
        return
    try:
        events = proto.read_events(run_dir)
    except (OSError, ValueError):  # informational only: a picture without marks
        return
    seen, drawn = set(), set()
    for e in events:
        style = _EVENT_STYLE.get(e.get("event"))
        key = (e.get("event"), e.get("step"))
        if style is None or key in drawn or not steps[0] <= int(e.get("step", -1)) <= steps[-1]:
            continue
        drawn.add(key)
        colour, ls, label = style
        for i, ax in enumerate(axes):
            ax.axvline(int(e["step"]), color=colour, linestyle=ls, linewidth=0.9, alpha=0.8,
                       label=label if i == 0 and label not in seen else None)
        seen.add(label)
