"""Reports: a Rich table in the terminal, a JSON file, and a PNG plot (steps x devices).

Everything here reads the plain report dicts the engine returns (``RangeReport.to_dict()``,
``CanaryReport.to_dict()``, ``InspectReport.to_dict()``), so a JSON report written earlier can be
rendered or plotted again. No JAX.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from replay.run.writer import write_json  # noqa: F401  (reports are written with report.write_json)

_VERDICT_STYLE = {"convicted": "bold red", "acquitted": "bold green", "ambiguous": "bold yellow"}
PIPED_WIDTH = 160  # columns of a table when the output is a pipe or a file (which have no width)


def _save(fig: Any, path: str, dpi: int) -> None:
    """Writes a matplotlib figure to ``path`` (its folder made) and closes it."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def make_console(stderr: bool = False) -> Console:
    """The console of every message and report of the ``replay`` command: one width policy.

    Message lines are never wrapped (``soft_wrap``), so that paths and commands stay whole for copy
    and paste, on a terminal or not; tables and panels fit the terminal's width, or are
    ``PIPED_WIDTH`` columns when the output is not a terminal (Rich would otherwise assume 80).
    """
    console = Console(stderr=stderr, soft_wrap=True)
    if not console.is_terminal:
        console.width = PIPED_WIDTH
    return console


def _verdict_panel(report: Mapping[str, Any]) -> Panel:
    verdict = report["verdict"]
    lines = [(f"[{_VERDICT_STYLE[verdict]}]{verdict.upper()}[/] (exit code {report['exit_code']}): "
              f"{report['explanation']}")]
    if report.get("convicted_devices"):
        lines.append(f"convicted device(s): {report['convicted_devices']} at step {report['first_divergent_step']}")
    if report.get("leaves"):
        lines.append(f"leaves: {', '.join(report['leaves'][:6])}" + (" ..." if len(report["leaves"]) > 6 else ""))
    if report.get("differing_elements"):
        lines.append("differing elements (replayed vs checkpointed parameters): "
                     + ", ".join(f"{k}: {v}" for k, v in report["differing_elements"].items()))
    if "evidence" in report:
        lines.append(f"evidence: {report['evidence']}; independent replays: {report.get('independent_replays')}")
    if "device_spec" in report and "devices" in report:
        q = report.get("quarantine") or []
        lines.append(f"devices: {report['device_spec']!r} -> {report['devices']}; "
                     + (f"quarantined (left out of 'good'): {q}" if q else "no device quarantined"))
    return Panel("\n".join(lines), title="verdict")


def render_environment(env: Mapping[str, Any], console: Console) -> None:
    diffs = env.get("differences") or []
    if not diffs:
        console.print("environment: matches the run's record")
        return
    table = Table(title="environment differences from the run's env.json")
    table.add_column("difference")
    for d in diffs:
        table.add_row(d)
    console.print(table)


def render_range(report: Mapping[str, Any], console: Optional[Console] = None, max_rows: int = 60) -> None:
    """Prints a range replay report: one row per replayed step, one column per replay, then the verdict."""
    console = console or make_console()
    render_environment(report.get("environment", {}), console)
    replays = report["replays"]
    table = Table(title=f"replay of steps {report['steps']['start']}:{report['steps']['stop']} "
                        f"from checkpoint(s) {report.get('checkpoints')}")
    table.add_column("step", justify="right")
    table.add_column("loss (logged)", justify="right")
    for r in replays:
        table.add_column(f"replay {r['index']} on {r['assignment']}")
    rows: dict[int, list[str]] = {}
    losses: dict[int, str] = {}
    for col, r in enumerate(replays):
        for s in r["steps"]:
            cell = "[green]match[/]" if s["ok"] else (
                f"[red]{s['kind']}[/]" + (f" dev {[int(k) for k in s['devices']]}" if s["devices"] else ""))
            rows.setdefault(s["step"], [""] * len(replays))[col] = cell
            losses[s["step"]] = f"{s['loss']['logged']}"
    steps = sorted(rows)
    shown = steps if len(steps) <= max_rows else [
        s for s in steps if any("match" not in c for c in rows[s])][:max_rows] or steps[:max_rows]
    for s in shown:
        table.add_row(str(s), losses[s], *rows[s])
    if len(shown) < len(steps):
        table.caption = f"{len(steps) - len(shown)} matching steps not shown"
    console.print(table)
    dis = report.get("replay_disagreement")
    if dis:
        line = (f"[yellow]replays {dis.get('replay_a')} and {dis.get('replay_b')} disagree[/] at step {dis['step']}, "
                f"mesh position(s) {dis['positions']}: devices {dis['devices_a']} vs {dis['devices_b']}")
        if dis.get("suspects"):
            line += f"; suspect device(s) (on both sides): {dis['suspects']}"
        console.print(line)
    console.print(_verdict_panel(report), soft_wrap=False)  # a panel wraps its lines inside its border


def render_canary(report: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints a canary report: one row per device, its repeats' agreement, the golden value."""
    console = console or make_console()
    table = Table(title=f"canary {report['canary']['name']} v{report['canary']['version']} "
                        f"(golden: {report['golden']['status']})")
    table.add_column("device", justify="right")
    table.add_column("fingerprint")
    table.add_column("repeats agree")
    table.add_column("status")
    for d in report["devices"]:
        style = "green" if d["status"] == "ok" else "red"
        runs = len(d.get("signatures") or [d["signature"]])
        agree = f"{d['repeats_agree']} ({runs} runs)" if runs > 1 else "n/a (1 run)"
        table.add_row(str(d["id"]), d["signature"][:16], agree, f"[{style}]{d['status']}[/]")
    console.print(table)
    verdict = report["verdict"]
    console.print(Panel(f"[{_VERDICT_STYLE[verdict]}]{verdict.upper()}[/] (exit code {report['exit_code']}): "
                        f"{report['explanation']}", title="canary verdict"), soft_wrap=False)


def render_inspect(report: Mapping[str, Any], console: Optional[Console] = None, max_rows: int = 200) -> None:
    """Prints an inspect report: documents per step and row, a per-source summary, shards touched."""
    console = console or make_console()
    table = Table(title=f"documents in steps {report['steps']['start']}:{report['steps']['stop']}")
    for col in ("step", "row", "source", "document key", "chunk", "span", "shard", "record"):
        table.add_column(col, overflow="fold")
    with_text = any("text" in d for r in report["rows"] for d in r["documents"])
    if with_text:
        table.add_column("text")
    n = 0
    for r in report["rows"]:
        for d in r["documents"]:
            if n >= max_rows:
                break
            cells = [str(r["step"]), str(r["position"]), r["source"], d["key"], str(d["chunk"]),
                     f"{d['span'][0]}:{d['span'][1]}", r["shard"], str(r["record_in_shard"])]
            if with_text:
                text = repr(d.get("text", ""))  # a repr: newlines and control characters stay visible
                cells.append(text if len(text) <= 80 else text[:79] + "…")
            table.add_row(*cells)
            n += 1
    console.print(table)
    total = sum(len(r["documents"]) for r in report["rows"])
    if total > n:
        console.print(f"showing the first {n} of {total} documents: --max-rows {total} shows all, "
                      "--json OUT writes every document with its token ids")
    summary = Table(title="per source")
    for col in ("source", "rows", "documents", "tokens", "padding"):
        summary.add_column(col, justify="right")
    for name, s in sorted(report["sources"].items()):
        summary.add_row(name, str(s["rows"]), str(s["documents"]), str(s["tokens"]), str(s["padding"]))
    console.print(summary)
    shards = Table(title="shards and records touched")
    shards.add_column("shard")
    shards.add_column("records")
    for path, recs in sorted(report["shards"].items()):
        shards.add_row(path, ", ".join(map(str, recs[:20])) + (" ..." if len(recs) > 20 else ""))
    console.print(shards)


def plot_range(report: Mapping[str, Any], path: str) -> None:
    """Writes a PNG: steps (x) by devices of the original run (y), one panel per replay.

    Cells: green = the device's contribution matches the log; red with an ``x`` = it differs;
    orange column = the batch hash differs (data/order); grey = not compared. The first
    divergent step is marked with a vertical line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    replays = report["replays"]
    devices = sorted(report["run_devices"])
    steps = sorted({s["step"] for r in replays for s in r["steps"]})
    if not steps:
        steps = [report["steps"]["start"]]
    fig, axes = plt.subplots(len(replays) or 1, 1, figsize=(max(6, 0.25 * len(steps) + 2), 1.5 + 0.35 * len(devices) * max(1, len(replays))),
                             squeeze=False)
    cmap = ListedColormap(["#d0d0d0", "#4caf50", "#e53935", "#fb8c00"])
    for ax, r in zip(axes[:, 0], replays or [None]):
        grid = np.zeros((len(devices), len(steps)), np.int8)
        marks = []
        if r is not None:
            for s in r["steps"]:
                x = steps.index(s["step"])
                bad = {int(d) for d in s["devices"]}
                for y, d in enumerate(devices):
                    if s["kind"] == "data":
                        grid[y, x] = 3
                    elif d in bad:
                        grid[y, x] = 2
                        marks.append((x, y))
                    else:
                        grid[y, x] = 1
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
        for x, y in marks:
            ax.plot(x, y, "kx", markersize=8)
        if report.get("first_divergent_step") in steps:
            ax.axvline(steps.index(report["first_divergent_step"]), color="black", linewidth=1)
        ax.set_yticks(range(len(devices)), [str(d) for d in devices])
        ticks = range(0, len(steps), max(1, len(steps) // 20))
        ax.set_xticks(list(ticks), [str(steps[i]) for i in ticks], rotation=90)
        ax.set_ylabel("device (run)")
        title = "" if r is None else f"replay {r['index']} on devices {r['assignment']}"
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("step")
    from matplotlib.patches import Patch

    legend = [Patch(color=c, label=t) for c, t in zip(cmap.colors, ("not compared", "matches the log",
                                                                    "differs from the log", "batch differs (data)"))]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    title = f"{report['verdict'].upper()}"
    if report.get("cause"):
        title += f" ({report['cause']})"
    if report.get("first_divergent_step") is not None:
        title += f": first divergent step {report['first_divergent_step']}"
    if report.get("convicted_devices"):
        title += f", device(s) {report['convicted_devices']}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _save(fig, path, dpi=100)


_CHECK_STYLE = {"found": "bold red", "clear": "green", "not available": "yellow"}


def render_scan(report: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints a scan report: each check's status, the ranked suspects, and the replay to run next."""
    console = console or make_console()
    checks = Table(title=f"replay scan of steps {report['steps']['start']}:{report['steps']['stop']}")
    checks.add_column("check")
    checks.add_column("status")
    checks.add_column("detail", overflow="fold")
    for name, c in report["checks"].items():
        checks.add_row(name, f"[{_CHECK_STYLE.get(c['status'], '')}]{c['status']}[/]", c.get("detail", ""))
    console.print(checks)
    if report["suspects"]:
        table = Table(title="suspects (ranked)")
        for col in ("rank", "suspect", "first step", "strength", "evidence", "next"):
            table.add_column(col, overflow="fold")
        for s in report["suspects"]:
            ev = "\n".join(escape(f"[{e['check']}] {e['detail']}") for e in s["evidence"])
            nxt = s.get("next") or {}
            table.add_row(str(s["rank"]), s["subject"], str(s["first_step"]), f"{s['strength']:.2f}", ev,
                          escape(nxt.get("sentence") or ""))
        console.print(table)
    for e in report.get("explained", []):
        console.print(f"loss spike at step {e['step']} coincides with a logged {e['explained_by']} (not a suspect)")
    if report["suspects"]:
        lines = [f"[bold red]SUSPECTS[/] (exit code {report['exit_code']}): "
                 f"{', '.join(s['subject'] for s in report['suspects'])}"]
    else:
        lines = [f"[bold green]CLEAN[/] (exit code {report['exit_code']}): no check found anything"
                 + ("; some checks were not available (above)"
                    if any(c["status"] == "not available" for c in report["checks"].values()) else "")]
    console.print(Panel("\n".join(lines), title="scan"), soft_wrap=False)
    if report["suspects"] and report.get("suggested_replay"):  # outside the panel: a command is never broken
        console.print(f"next: {escape(report['suggested_replay'])}")
    for s in report["suspects"]:
        cmd = (s.get("next") or {}).get("command")
        if s["kind"] not in ("device", "replica") and cmd:
            console.print(f"next for {escape(s['subject'])}: {escape(cmd)}")


def plot_scan(scan: Any, path: str) -> None:
    """Writes a PNG of a ``replay.screen.scan.ScanReport`` (it needs the per-step series, which the JSON
    report leaves out): the replicas' log-ratio to the cross-replica median norm (suspect devices
    drawn thick, a drift's onset marked, canary mismatches as red crosses), the loss, each layer's
    dropped fraction and its worst expert share against the router-health limits, and the loader
    wait per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rep, rout, loss, load = (scan.series.get(k) or {} for k in ("replicas", "router", "loss", "loader"))
    fig, axes = plt.subplots(5, 1, figsize=(10, 13), sharex=True)
    suspects = set(scan.suspect_devices)
    ax = axes[0]
    if rep:
        steps = np.asarray(rep["steps"])
        for i, rid in enumerate(rep["replicas"]):
            y = rep["log_ratio"][:, i]
            thick = rid in suspects
            ax.plot(steps, y, linewidth=2.2 if thick else 0.8, alpha=1.0 if thick else 0.6,
                    label=f"replica {rid}" + (" (suspect)" if thick else ""), zorder=3 if thick else 2)
        for s in scan.suspects:
            for e in s.evidence:
                if e.check == "norm_drift":
                    ax.axvline(e.first_step, color="red", linestyle="--", linewidth=1)
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    else:
        ax.text(0.5, 0.5, "per-replica norms not available", ha="center", transform=ax.transAxes)
    bad = [(c.step, c.device) for c in scan.series.get("canary", []) if c.status != "ok"]
    if bad:
        ax2 = ax.twinx()
        ax2.plot([b[0] for b in bad], [b[1] for b in bad], "rx", markersize=9, label="canary mismatch")
        ax2.set_ylabel("canary mismatch: device", color="red")
    ax.set_ylabel("log(norm / median norm)")
    ax.set_title("per-replica gradient norm against the cross-replica median", fontsize=9)
    ax = axes[1]
    if loss:
        ax.plot(loss["steps"], loss["loss"], color="black", linewidth=1)
    ax.set_ylabel("loss")
    ax.set_title("loss (the loss-spike check)", fontsize=9)
    health = scan.checks.get("router", {})
    for ax, key, label in ((axes[2], "dropped", "dropped fraction"),
                           (axes[3], "share_ratio", "worst expert vs uniform (x, either way)")):
        if rout:
            for i in range(rout[key].shape[1]):
                line, = ax.plot(rout["steps"], rout[key][:, i], linewidth=0.8 if key == "share_ratio" else 1.4,
                                linestyle="-" if key == "share_ratio" else ("-", "--", "-.", ":")[i % 4],
                                label=f"layer {i}" + (" (each step)" if key == "share_ratio" else ""))
                if key == "share_ratio" and rout.get("window", 1) > 1:
                    ax.plot(rout["steps"], rout["share_ratio_window"][:, i], color=line.get_color(), linewidth=2.2,
                            label=f"layer {i} (over {rout['window']} steps: judged)")
            if key == "share_ratio":
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "router figures not available", ha="center", transform=ax.transAxes)
        ax.set_ylabel(label)
    limits = getattr(scan, "limits", None) or {}
    if "max_dropped_fraction" in limits:
        axes[2].axhline(limits["max_dropped_fraction"], color="red", linestyle=":", label="limit")
        axes[3].axhline(limits["max_share_ratio"], color="red", linestyle=":", label="limit")
        for ax in axes[2:4]:
            ax.axvline(limits["warmup_steps"], color="grey", linestyle=":", linewidth=1, label="end of warm-up")
            if rout:
                ax.legend(fontsize=7)
    axes[2].set_title(f"router health ({health.get('status', 'n/a')}): dropped fraction per layer", fontsize=9)
    axes[3].set_title("expert shares: max(share x E, 1 / (min share x E)); thin: each step, thick: the judged "
                      "window", fontsize=9)
    ax = axes[4]
    if load:
        ax.plot(load["steps"], np.asarray(load["wait"]) * 1e3, label="loader wait")
        ax.plot(load["steps"], np.asarray(load["step_time"]) * 1e3, label="step time", alpha=0.6)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("loader wait against step time (the loader-stall check)", fontsize=9)
    ax.set_xlabel("step")
    verdict = "SUSPECTS: " + ", ".join(s.subject for s in scan.suspects[:4]) if scan.suspects else "CLEAN"
    fig.suptitle(f"replay scan of {scan.run_dir}: {verdict}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    _save(fig, path, dpi=90)


_TRIAGE_STYLE = {"suspect": "bold red", "clear": "green", "not available": "yellow"}
_CAUSE_TEXT = {"hardware": "HARDWARE", "restart": "RESTART OR DATA-ORDER FAULT", "data": "DATA",
               "router": "ROUTER INSTABILITY", "optimization": "OPTIMIZATION EVENT"}


def render_triage(report: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints a triage report: one panel per check in the order run, then the conclusion panel and the
    next command (outside the panel, whole)."""
    console = console or make_console()
    w = report["window"]
    loss = report.get("loss")
    j = report.get("judged_steps") or {"start": report["onset"], "stop": report["step"] + 1}
    console.print(f"triage of step {report['step']} (onset {report['onset']}; steps {j['start']}..{j['stop'] - 1} judged "
                  f"against the window {w['start']}..{j['start'] - 1}; "
                  f"loss {'non-finite' if not report.get('loss_finite') else f'{loss:.4f}'})")
    for line in report.get("lineage") or []:
        console.print(f"lineage: {escape(line)}")
    for n, (name, c) in enumerate(report["checks"].items(), 1):
        style = _TRIAGE_STYLE.get(c["status"], "")
        body = [escape(c["summary"])] + [f"  {escape(x)}" for x in c.get("lines", [])[:12]]
        if len(c.get("lines", [])) > 12:
            body.append(f"  ... {len(c['lines']) - 12} more line(s) in the JSON report")
        if c.get("command") and c["status"] != "clear":
            body.append(f"  to go further: {escape(c['command'])}")
        console.print(Panel("\n".join(body), title=f"{n}. {name}: [{style}]{c['status'].upper()}[/]",
                            title_align="left"), soft_wrap=False)
    con = report["conclusion"]
    style = "bold green" if con["cause"] == "optimization" else "bold red"
    lines = [f"[{style}]{_CAUSE_TEXT[con['cause']]}[/] (exit code {con['exit_code']}, confidence "
             f"{con['confidence']}): {escape(con['explanation'])}", f"advice: {escape(con['advice'])}"]
    lines += [f"also: {escape(a)}" for a in con.get("also", [])]
    console.print(Panel("\n".join(lines), title="conclusion", title_align="left"), soft_wrap=False)
    if con.get("command"):
        console.print(f"next: {escape(con['command'])}")


def plot_triage(rep: Any, path: str) -> None:
    """Writes the triage dashboard of a ``replay.screen.triage.TriageReport`` over its window: the loss
    (onset shaded), the per-replica gradient-norm ratio, each layer's router entropy and dropped
    fraction, an expert-share heatmap (layers x experts over steps), the canary timeline and the
    loader wait; lineage events as vertical lines on every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sig = rep.series.get("signals") or {}
    lo, hi = rep.window
    steps = [s for s in range(lo, hi) if s in sig]
    fig, axes = plt.subplots(7, 1, figsize=(11, 17), sharex=True)
    events = [e for e in rep.series.get("events", []) if e.get("event") not in ("checkpoint", "end")]
    colors = {"restore": "tab:green", "phase_change": "tab:purple", "skipped_window": "tab:gray",
              "skip_window_added": "tab:gray", "canary_mismatch": "tab:red", "config_change": "tab:orange",
              "rewind": "tab:brown", "start": "tab:green"}

    def mark(ax):
        for e in events:
            ax.axvline(e["step"], color=colors.get(e["event"], "tab:blue"), linestyle="--", linewidth=1, alpha=0.8)
        ax.axvspan(rep.judged[0] - 0.5, rep.judged[1] + 0.5, color="red", alpha=0.08)

    ax = axes[0]
    loss = rep.series.get("loss") or {}
    xs = sorted(loss)
    ax.plot(xs, [loss[s] for s in xs], color="black", linewidth=1)
    bad = [s for s in xs if not np.isfinite(loss[s])]
    if bad:
        ax.plot(bad, [np.nanmax([v for v in loss.values() if np.isfinite(v)] or [0])] * len(bad), "rv",
                label="non-finite loss")
    for e in events:
        ax.text(e["step"], 1.0, e["event"], rotation=90, va="top", ha="right", fontsize=7,
                transform=ax.get_xaxis_transform(), color=colors.get(e["event"], "tab:blue"))
    ax.set_ylabel("loss")
    ax.set_title(f"loss; shaded: the steps judged against the window before them ({rep.judged[0]}..{rep.judged[1]}; "
                 f"spike onset {rep.onset}); events as dashed lines", fontsize=9)
    ax = axes[1]
    scan = rep.series.get("scan")
    series = (scan.series.get("replicas") if scan is not None else None) or {}
    sus = set(rep.conclusion.subject.get("devices") or [])
    if series:
        for i, rid in enumerate(series["replicas"]):
            thick = bool(set(series["devices"][i]) & sus)
            ax.plot(series["steps"], series["log_ratio"][:, i], linewidth=2.2 if thick else 0.8,
                    label=f"replica {rid} (devices {series['devices'][i]})" + (" suspect" if thick else ""))
        ax.legend(fontsize=6, ncol=4)
    else:
        ax.text(0.5, 0.5, "per-replica norms not available", ha="center", transform=ax.transAxes)
    ax.set_ylabel("log(norm / median)")
    ax.set_title("per-replica gradient norm against the cross-replica median", fontsize=9)
    layers = max((len(sig[s].router) for s in steps), default=0)
    for ax, field, label in ((axes[2], "entropy", "router entropy (nats)"),
                             (axes[3], "dropped_fraction", "dropped fraction")):
        for i in range(layers):
            ax.plot(steps, [sig[s].router[i].__getattribute__(field) if i < len(sig[s].router) else np.nan
                            for s in steps], label=f"layer {i}")
        if layers:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "router figures not available", ha="center", transform=ax.transAxes)
        ax.set_ylabel(label)
    axes[2].set_title("router entropy per layer (a collapse drops it)", fontsize=9)
    axes[3].set_title("router dropped fraction per layer (assignments past expert capacity)", fontsize=9)
    ax = axes[4]
    if layers and steps:
        rows, labels = [], []
        for i in range(layers):
            E = len(sig[steps[0]].router[i].expert_share)
            for e_ in range(E):
                rows.append([sig[s].router[i].expert_share[e_] * E if i < len(sig[s].router) else np.nan
                             for s in steps])
                labels.append(f"L{i} e{e_}")
        im = ax.imshow(np.asarray(rows), aspect="auto", cmap="viridis", interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5))
        ax.set_xlim(lo - 0.5, hi - 0.5)
        ax.set_yticks(range(len(labels)), labels, fontsize=5 if len(labels) > 24 else 7)
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="share x E (1: uniform)")
    else:
        ax.text(0.5, 0.5, "expert shares not available", ha="center", transform=ax.transAxes)
    ax.set_title("expert share heatmap (each layer's experts; 1 = uniform)", fontsize=9)
    ax = axes[5]
    canary = [c for c in rep.series.get("canary", []) if lo <= c.step < hi]
    if canary:
        ok = [(c.step, c.device) for c in canary if c.status == "ok"]
        badc = [(c.step, c.device) for c in canary if c.status != "ok"]
        if ok:
            ax.plot(*zip(*ok), "g.", label="agrees")
        if badc:
            ax.plot(*zip(*badc), "rx", markersize=9, label="mismatch")
        ax.legend(fontsize=7)
        ax.set_ylabel("device")
    else:
        ax.text(0.5, 0.5, "no canary in the window (canary_every 0?)", ha="center", transform=ax.transAxes)
    ax.set_title("periodic canary per device", fontsize=9)
    ax = axes[6]
    waits = [(s, sig[s].loader_wait_s) for s in steps if sig[s].loader_wait_s is not None]
    if waits:
        ax.plot([w[0] for w in waits], [max(w[1], 1e-6) * 1e3 for w in waits], label="loader wait")
        st = [(s, sig[s].step_time_s) for s in steps if sig[s].step_time_s is not None]
        if st:
            ax.plot([w[0] for w in st], [w[1] * 1e3 for w in st], alpha=0.6, label="step time")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "loader waits not available", ha="center", transform=ax.transAxes)
    ax.set_ylabel("ms")
    ax.set_title("loader wait against step time", fontsize=9)
    ax.set_xlabel("step")
    for ax in axes:
        mark(ax)
    con = rep.conclusion
    fig.suptitle(f"replay triage of step {rep.step} in {rep.run_dir}\n{_CAUSE_TEXT[con.cause]} "
                 f"({con.confidence}): {con.explanation[:140]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _save(fig, path, dpi=85)


def render_triage_drills(res: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints the table of ``replay drill --scenario`` triage drills: per scenario, expected, found and
    correct over the seeds."""
    console = console or make_console()
    table = Table(title=f"triage drills: {res['correct']} of {res['total']} correct "
                        f"({res.get('seconds', 0):.0f} s)")
    for col in ("scenario", "expected", "found (per seed)", "correct"):
        table.add_column(col, overflow="fold")
    for name, sc in res["scenarios"].items():
        found = "; ".join(f"seed {r['seed']}: {r['found_text']}" for r in sc["runs"])
        style = "green" if sc["correct"] == sc["total"] else "red"
        table.add_row(name, escape(sc["expected_text"]), escape(found), f"[{style}]{sc['correct']}/{sc['total']}[/]")
    console.print(table)


def _dur(s: float) -> str:
    return f"{s:.3f} s" if abs(s) < 120 else f"{s / 60:.1f} min" if abs(s) < 7200 else f"{s / 3600:.2f} h"


def render_goodput(report: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints a goodput report: the time table (every part, seconds, share of the wall time and
    ml-goodput-measurement's kind), the step and token ledger, MFU, and the headline line last."""
    console = console or make_console()
    wall = report["wall_s"]
    table = Table(title=f"where the wall time went ({_dur(wall)}, first launch to last record)")
    for col, j in (("part", "left"), ("time", "right"), ("share", "right"), ("ml-goodput-measurement", "left")):
        table.add_column(col, justify=j)
    for name, p in report["time"].items():
        if not p["us"] and name not in ("productive", "unknown"):
            continue
        style = "bold green" if name == "productive" else ("yellow" if name == "unknown" else "")
        share = "" if p["share"] is None else f"{p['share']:.1%}"
        table.add_row(f"[{style}]{escape(p['what'])}[/]" if style else escape(p["what"]), _dur(p["s"]), share,
                      p["ml_goodput_measurement"])
    table.caption = ("the parts add up to the wall time exactly" if report["time_adds_up"] else
                     "THE PARTS DO NOT ADD UP (a bug: please report)")
    console.print(table)
    ledger = Table(title="steps and tokens trained (tokens: global batch x seq_len slots)")
    for col in ("part", "steps", "tokens", "non-padding tokens"):
        ledger.add_column(col, justify="left" if col == "part" else "right")
    names = {"productive": "the lineage (kept)", "lost": "lost to crashes (redone after a resume)",
             "rewound": "rewound (rollback or rewind)", "skipped_window": "trained on data later skipped",
             "skipped_data": "data skipped by the lineage (never trained)"}
    for k, label in names.items():
        tok = report["tokens"].get(k)
        npad = report["nonpad_tokens"].get(k)
        ledger.add_row(label, str(report["steps"].get(k, 0)), "unknown" if tok is None else f"{tok:,}",
                       "unknown" if npad is None else f"{npad:,}")
    rec = report["reconcile"]
    ledger.caption = (f"reconciles with the loader's arithmetic: {rec['data_steps_add_up']} "
                      f"(data steps {rec['lineage_data_steps'][0]}:{rec['lineage_data_steps'][1]} = lineage + "
                      "skipped data); trained steps by attempt: "
                      f"{rec['trained_steps_by_attempt']} = {rec['trained_steps']}")
    console.print(ledger)
    for line in report.get("unknown") or []:
        console.print(f"[yellow]unknown:[/] {escape(line)}")
    mfu = report["mfu"]
    if mfu.get("status") == "ok":
        console.print(f"MFU (median of the lineage's steps): {mfu['median']:.2%} ({mfu['devices']} x "
                      f"{mfu['device_kind']} at {mfu['peak_flops']:.3g} FLOP/s, {mfu['flops_per_step']:.3g} model "
                      "FLOPs a step)" + (f"; {mfu['note']}" if mfu.get("note") else ""))
    else:
        console.print(f"MFU: {escape(mfu.get('status', 'not available'))}")
    y = report["young"]
    if y.get("status") == "ok":
        console.print(f"Young's checkpoint interval sqrt(2 x {y['checkpoint_cost_s']:.3f} s x MTBF {_dur(y['mtbf_s'])}) "
                      f"= {_dur(y['optimal_interval_s'])}" + (f"; this run checkpoints every {_dur(y['interval_s'])}"
                                                               if y.get("interval_s") else ""))
    else:
        console.print(f"Young's checkpoint interval: {escape(y.get('status', 'not available'))}")
    from replay.screen.goodput import headline

    headline = f"[bold]{escape(headline(report))}[/]"
    console.print(Panel(headline, title="goodput"), soft_wrap=False)


def plot_goodput(rep: Any, path: str) -> None:
    """Writes a ``replay.screen.goodput.GoodputReport``'s picture: the waterfall (100% of the wall time,
    each part that is not productive taken off in turn, to the net goodput) and goodput over time
    (productive time so far over elapsed time) with restores and rewinds as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from replay.screen.goodput import PART_TEXT, PARTS

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 9.5))
    wall = rep.wall_us or 1
    level = 100.0
    labels, bottoms, heights, colors = ["wall time"], [0.0], [100.0], ["#4c72b0"]
    for p in PARTS:
        if p == "productive" or not rep.time_us[p]:
            continue
        share = 100.0 * rep.time_us[p] / wall
        level -= share
        labels.append(PART_TEXT[p].split(":")[0].split(" (")[0])
        bottoms.append(level)
        heights.append(share)
        colors.append("#c44e52" if p not in ("unknown",) else "#cccccc")
    labels.append("goodput")
    bottoms.append(0.0)
    heights.append(100.0 * rep.time_us["productive"] / wall)
    colors.append("#55a868")
    xs = range(len(labels))
    ax1.bar(xs, heights, bottom=bottoms, color=colors)
    for x, b, h in zip(xs, bottoms, heights):
        ax1.text(x, b + h + 0.8, f"{h:.1f}%", ha="center", fontsize=8)
    ax1.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("% of the wall time")
    ax1.set_ylim(0, 108)
    ax1.set_title(f"waterfall: 100% of {rep.wall_us / 1e6:.1f} s, each badput part taken off, to the goodput "
                  f"{100 * rep.goodput:.1f}%" if rep.wall_us else "no wall time recorded", fontsize=10)
    if rep.timeline:
        t = [x for x, _ in rep.timeline]
        g = [100.0 * p / x if x > 0 else 0.0 for x, p in rep.timeline]
        ax2.plot(t, g, color="#55a868", linewidth=1.5, label="goodput so far (productive / elapsed)")
        ax2.legend(fontsize=8, loc="lower right")
    else:
        ax2.text(0.5, 0.5, "no per-step timestamps logged", ha="center", transform=ax2.transAxes)
    ax2.set_ylim(0, 100)
    for x, kind, step in rep.events:
        color = {"start": "tab:green", "restore": "tab:orange", "rewind": "tab:red", "skip_window": "tab:purple"}.get(
            kind, "tab:gray")
        ax2.axvline(x, color=color, linestyle="--", linewidth=1)
        ax2.text(x, 98, f"{kind} {step}", rotation=90, va="top", ha="right", fontsize=7, color=color)
    ax2.set_xlabel("seconds since the first launch")
    ax2.set_ylabel("goodput so far (%)")
    ax2.set_title("goodput over time; starts, restores, rewinds and skip windows as dashed lines", fontsize=10)
    fig.suptitle(f"replay goodput of {rep.run_dir}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _save(fig, path, dpi=90)
