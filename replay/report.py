"""Reports: a Rich table in the terminal, a JSON file, and a PNG plot (steps x devices).

Everything here reads the plain report dicts the engine returns (``RangeReport.to_dict()``,
``CanaryReport.to_dict()``, ``InspectReport.to_dict()``), so a JSON report written earlier can be
rendered or plotted again. No JAX.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from common import figures
from replay.runtime.progress import loss_text
from replay.run.writer import write_json  # noqa: F401  (reports are written with report.write_json)

_VERDICT_STYLE = {"convicted": "bold red", "acquitted": "bold green", "ambiguous": "bold yellow"}
PIPED_WIDTH = 160  # columns of a table when the output is a pipe or a file (which have no width)


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
    if report.get("convicted"):
        for dev in report["convicted"]:
            lines.append(f"convicted: {dev['label']} at step {report['first_divergent_step']}")
    elif report.get("convicted_devices"):
        lines.append(f"convicted device(s): {report['convicted_devices']} at step {report['first_divergent_step']}")
    for a, b in report.get("convicted_links") or ():  # sent right, received wrong: neither chip alone
        lines.append(f"convicted link: device {a} -> device {b} at step {report['first_divergent_step']} "
                     "(the sender sent it right, the receiver got something else)")
    site = report.get("first_divergent_site")
    if site:
        lines.append(f"first divergent buffer: {site['label']}" + (f" (layer {site['layer']})" if site.get("layer")
                     is not None and site.get("collective") is None else "")
                     + (f"; devices that differ at the step: {report.get('reached_devices')}"
                        if report.get("reached_devices") else ""))
    if report.get("leaves"):
        lines.append(f"leaves: {', '.join(report['leaves'][:6])}" + (" ..." if len(report["leaves"]) > 6 else ""))
    if report.get("differing_elements"):
        lines.append("differing elements (replayed vs checkpointed parameters): "
                     + ", ".join(f"{k}: {v}" for k, v in report["differing_elements"].items()))
    if "evidence" in report:
        lines.append(f"evidence: {evidence_text(report)}; independent replays: {report.get('independent_replays')}")
    if "device_spec" in report and "devices" in report:
        q = report.get("quarantine") or []
        lines.append(f"devices: {report['device_spec']!r} -> {report['devices']}; "
                     + (f"quarantined (left out of 'good'): {q}" if q else "no device quarantined"))
    lines += segment_lines(report)
    return Panel("\n".join(lines), title="verdict")


def evidence_text(report: Mapping[str, Any]) -> str:
    """The comparison's strength in words: the report's (the weakest replay's) when every replay has it,
    else each placement's, e.g. ``bit-exact on [0, 1, 2, 3] (the run's own devices), per-shard on [4, 5, 6, 7]``."""
    per: dict[tuple, str] = {}
    for r in report.get("replays") or []:
        if r.get("evidence"):
            per.setdefault(tuple(r["assignment"]), r["evidence"])
    if len(set(per.values())) <= 1:
        return str(report["evidence"])
    own = tuple(report.get("run_devices") or ())
    return ", ".join(f"{ev} on {list(a)}" + (" (the run's own devices)" if a == own else "") for a, ev in per.items())


def segment_lines(report: Mapping[str, Any]) -> list[str]:
    """What a range replay replayed: the onset it started from, the segments per round, those left out."""
    segs = report.get("segments") or []
    if not segs:
        return []
    out = []
    onset = report.get("targeted")
    if onset:
        where = (f"{onset['step']}" if not onset.get("uncertain")
                 else f"{onset['step']} (uncertain: steps {onset['range'][0]}..{onset['range'][1]})")
        out.append(f"onset: step {where}, from {onset['source']}")
    rounds: dict[int, list[str]] = {}
    for s in segs:
        if s["replayed"]:
            rounds.setdefault(s["round"], []).append(f"{s['start']}:{s['stop']}")
    for r in sorted(rounds):
        out.append(f"segments replayed{f' in round {r + 1}' if len(rounds) > 1 or onset else ''}: "
                   f"{', '.join(rounds[r])}")
    left = report.get("unreplayed_segments") or []
    if left:
        out.append(f"not replayed (stopped at the conviction): {', '.join(f'{a}:{b}' for a, b in left)}; "
                   f"--exhaustive replays them")
    per = (report.get("timing") or {}).get("steps_replayed_per_placement") or {}
    if per:
        out.append("steps replayed per placement: " + ", ".join(f"{k}: {v}" for k, v in sorted(per.items())))
    return out


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
    where = {tuple(p["devices"]): p for p in report.get("placements") or []}
    for r in replays:
        p = where.get(tuple(r["assignment"]))
        procs = f" (process{'es' if p and len(p['processes']) > 1 else ''} {','.join(map(str, p['processes']))})" \
            if p and p.get("processes") else ""
        table.add_column(f"replay {r['index']} on {r['assignment']}{procs}")
    rows: dict[int, list[str]] = {}
    losses: dict[int, str] = {}
    for col, r in enumerate(replays):
        for s in r["steps"]:
            kind = str(s["kind"]).replace("_", " ")  # "device [2]", "all devices [0, 1, 2, 3]", "data"
            cell = "[green]match[/]" if s["ok"] else (
                f"[red]{kind}[/]" + (f" {[int(k) for k in s['devices']]}" if s["devices"] else ""))
            rows.setdefault(s["step"], [""] * len(replays))[col] = cell
            losses[s["step"]] = loss_text(s["loss"]["logged"])  # a float, or "nan"/"inf" (JSON)
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
            named = "; ".join(n["label"] for n in dis.get("suspects_named") or []) or dis["suspects"]
            line += f"; suspect device(s) (on both sides): {named}"
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
        table.add_row(d.get("label") or str(d["id"]), d["signature"][:16], agree, f"[{style}]{d['status']}[/]")
    console.print(table)
    verdict = report["verdict"]
    odd = "".join(f"\nodd device: {o['label']}" for o in report.get("odd") or [])
    console.print(Panel(f"[{_VERDICT_STYLE[verdict]}]{verdict.upper()}[/] (exit code {report['exit_code']}): "
                        f"{report['explanation']}{odd}", title="canary verdict"), soft_wrap=False)


INSPECT_TEXT_CHARS = 80  # characters of a document's text (its repr) shown in the inspect table


def _whole_cells_width(columns: list[list[str]], shrinkable: int = 0) -> int:
    """Columns a Rich table (default box, padding 1) needs for these cells unbroken, plus
    ``shrinkable`` columns' minimum widths (the text column)."""
    from rich.cells import cell_len

    return sum(max(map(cell_len, col)) + 3 for col in columns) + 1 + shrinkable


def _print_whole(console: Console, renderable: Any, width: int) -> None:
    """Prints ``renderable`` laid out ``width`` columns wide, wider than the console when need be
    (``Console.print(width=)`` never exceeds the console's width), lines never cropped."""
    from rich.segment import Segments

    if width <= console.width:
        console.print(renderable)
        return
    console.print(Segments(console.render(renderable, console.options.update_width(width))), crop=False)


def render_inspect(report: Mapping[str, Any], console: Optional[Console] = None, max_rows: int = 200) -> None:
    """Prints an inspect report: documents per step and row, a per-source summary, shards touched.

    Keys and paths are never broken or cut, on a terminal or in a pipe: their columns do not wrap,
    and a table wider than the console is printed at its own width (a terminal folds such lines
    where it likes, a pipe or ``less -S`` keeps each whole). Only the text column (``--text``, the
    first ``INSPECT_TEXT_CHARS`` characters of each document's repr) is cut, with ``…``; a line
    under the table says how to see the whole text (``--json OUT``).
    """
    console = console or make_console()
    with_ids = any("id" in d for r in report["rows"] for d in r["documents"])
    heads = ("step", "row", "source", "document key", *(("document id",) if with_ids else ()), "chunk", "span",
             "shard", "record")
    with_text = any("text" in d for r in report["rows"] for d in r["documents"])
    rows, texts, cut = [], [], False
    for r in report["rows"]:
        for d in r["documents"]:
            if len(rows) >= max_rows:
                break
            rows.append([str(r["step"]), str(r["position"]), r["source"], d["key"],
                         *([d.get("id", "")] if with_ids else []), str(d["chunk"]),
                         f"{d['span'][0]}:{d['span'][1]}", r["shard"], str(r["record_in_shard"])])
            if with_text:
                text = repr(d.get("text", ""))  # a repr: newlines and control characters stay visible
                cut = cut or len(text) > INSPECT_TEXT_CHARS
                texts.append(text if len(text) <= INSPECT_TEXT_CHARS else text[:INSPECT_TEXT_CHARS - 1] + "…")
    columns = [[h, *(row[i] for row in rows)] for i, h in enumerate(heads)]
    text_min = 24 + 3 if with_text else 0
    need = _whole_cells_width(columns, text_min)
    width = max(console.width, need)
    table = Table(title=f"documents in steps {report['steps']['start']}:{report['steps']['stop']}")
    for h in heads:
        table.add_column(h, no_wrap=True, justify="right" if h in ("step", "row", "chunk", "record") else "left")
    if with_text:  # the rest of the width, at most the text's: cut with "…", never wrapped
        room = min(max(width - need + text_min - 3, 24), max((len(x) for x in texts), default=4))
        table.add_column("text", no_wrap=True, overflow="ellipsis", width=max(room, 4))
    for n, row in enumerate(rows):
        table.add_row(*row, *([texts[n]] if with_text else []))
    _print_whole(console, table, width)
    total = sum(len(r["documents"]) for r in report["rows"])
    if total > len(rows):
        console.print(f"showing the first {len(rows)} of {total} documents: --max-rows {total} shows all, "
                      "--json OUT writes every document with its token ids")
    if with_text and (cut or any(len(x) > room for x in texts)):
        console.print("text: the start of each document's piece in that row (a document split over rows starts mid-text in "
                      "the later rows; its repr, cut with …); --json OUT writes each whole, with its token ids")
    if console.is_terminal and need > console.width:
        console.print(f"(the table is {need} columns wide and this terminal {console.width}: keys and paths are "
                      "whole; pipe through 'less -S' to see it unfolded)")
    summary = Table(title="per source")
    for col in ("source", "rows", "documents", "tokens", "padding"):
        summary.add_column(col, justify="right", no_wrap=True)
    for name, s in sorted(report["sources"].items()):
        summary.add_row(name, str(s["rows"]), str(s["documents"]), str(s["tokens"]), str(s["padding"]))
    console.print(summary)
    shards = Table(title="shards and records touched")
    shards.add_column("shard", no_wrap=True)
    shards.add_column("records")
    paths = sorted(report["shards"])
    for path in paths:
        recs = report["shards"][path]
        shards.add_row(path, ", ".join(map(str, recs[:20])) + (" ..." if len(recs) > 20 else ""))
    need = _whole_cells_width([["shard", *paths]], 12 + 3)
    _print_whole(console, shards, need)


def plot_range(report: Mapping[str, Any], path: str) -> None:
    """Writes the PNG of :func:`range_figure` to ``path``."""
    figures.save(range_figure(report), path, dpi=100)


def range_figure(report: Mapping[str, Any]):
    """A range replay's picture: steps (x) by devices of the original run (y), one panel per replay;
    the title names the run, the range (and the checkpoint it was replayed from) and the verdict.

    Cells: green = the device's contribution matches the log; red with an ``x`` = it differs;
    orange column = the batch hash differs (data/order); grey = not compared. The first
    divergent step is marked with a vertical line.
    """
    plt = figures.pyplot()
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
        every = max(1, -(-len(steps) * max(len(str(steps[-1])), 2) // 90))  # about 90 characters of labels a row
        ticks = range(0, len(steps), every)
        ax.set_xticks(list(ticks), [str(steps[i]) for i in ticks])
        ax.set_ylabel("device (run)")
        title = "" if r is None else f"replay {r['index']} on devices {r['assignment']}"
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("step")
    from matplotlib.patches import Patch

    legend = [Patch(color=c, label=t) for c, t in zip(cmap.colors, ("not compared", "matches the log",
                                                                    "differs from the log", "batch differs (data)"))]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    where = f"replay of {report['run']}, " if report.get("run") else "replay of "
    where += f"steps {report['steps']['start']}:{report['steps']['stop']}"
    if report.get("checkpoint") is not None and report["checkpoint"] < report["steps"]["start"]:
        where += f" (from checkpoint {report['checkpoint']})"
    title = f"{where}: {report['verdict'].upper()}"
    if report.get("cause"):
        title += f" ({report['cause'].replace('_', ' ')})"
    if report.get("first_divergent_step") is not None:
        title += f": first divergent step {report['first_divergent_step']}"
    if report.get("convicted_devices"):
        title += f", device(s) {report['convicted_devices']}"
    if report.get("convicted_links"):
        title += ", link(s) " + ", ".join(f"{a} -> {b}" for a, b in report["convicted_links"])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


_CHECK_STYLE = {"found": "bold red", "clear": "green", "not available": "yellow"}


def render_scan(report: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints a scan report: each check's status, the ranked suspects, and the replay to run next."""
    console = console or make_console()
    for line in report.get("lineage") or []:  # what was trained and abandoned: never mixed into the checks
        console.print(f"lineage: {escape(line)}")
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
            who = "\n".join(n["label"] for n in s.get("named") or []) or s["subject"]
            table.add_row(str(s["rank"]), who, str(s["first_step"]), f"{s['strength']:.2f}", ev,
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


_MARKED_EVENTS = {"phase_change": ("tab:purple", "--", "phase change"),
                  "skipped_window": ("tab:gray", ":", "skipped data window"),
                  "restore": ("tab:green", "-.", "resumed from checkpoint")}


def _legend_outside(ax) -> None:
    """The panel's legend to the right of its axes, where it covers no data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  frameon=False)


def _note(ax, text: str, y: float = 0.96) -> None:
    """A boxed explanation inside the panel, top left."""
    ax.text(0.01, y, text, transform=ax.transAxes, ha="left", va="top", fontsize=7.5, zorder=10,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "lightgray", "alpha": 0.92})


def _times_label(v: float, _pos=None) -> str:
    return f"{v:g}x"


def _ms_label(v: float, _pos=None) -> str:
    """A duration tick given in ms: ``0.1 ms``, ``10 ms``, ``1 s``, ``10 s``."""
    return f"{v / 1e3:g} s" if v >= 1e3 else f"{v:g} ms"


def _log_ticks(ax, label) -> None:
    """Labelled ticks on a log axis: 1, 10, 100 ... over a wide range; 1, 2, 5, 10, 20 ... when the
    range spans under two decades (else a panel may show a single label); no minor labels."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.figure.canvas.draw_idle()
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 100:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    elif lo > 0 and math.log10(hi / lo) > 6:
        ax.yaxis.set_major_locator(LogLocator(base=10, numticks=8))
    ax.yaxis.set_major_formatter(FuncFormatter(label))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _scan_marks(run_dir: str, start: int, stop: int) -> list[tuple[int, str]]:
    """``(step, event)`` of the phase changes, skipped windows and restores inside ``[start, stop)``
    (events.jsonl; none when it cannot be read: the marks are informational)."""
    from replay.run import protocol as proto

    try:
        events = proto.read_events(run_dir)
    except (OSError, ValueError):
        return []
    out = []
    for e in events:
        step = e.get("step")
        if e.get("event") in _MARKED_EVENTS and isinstance(step, int) and start <= step < stop:
            out.append((step, e["event"]))
    return sorted(set(out))


def plot_scan(scan: Any, path: str) -> None:
    """Writes the PNG of :func:`scan_figure` (a ``replay.screen.scan.ScanReport``) to ``path``."""
    figures.save(scan_figure(scan), path, dpi=90)


def scan_figure(scan: Any):
    """The matplotlib figure of a ``replay.screen.scan.ScanReport`` (it needs the per-step series, which
    the JSON report leaves out). Five panels over the step, each with its limit where the scan has one and
    its legend outside the axes:

    - each replica's robust z-score of its gradient norm against the other replicas (what the spike
      and drift checks score; symmetric log scale), with the spike threshold ``+-spike_z``; suspect
      replicas drawn thick, a drift's onset marked, canary mismatches as red crosses;
    - the loss;
    - each layer's router dropped fraction (from 0) against ``max_dropped_fraction``;
    - each layer's worst expert share (x uniform, log scale) against ``max_share_ratio``: thin lines
      single steps, thick the window that is judged; a box on the panel says which values are not
      judged when they pass the limit (single steps, warm-up);
    - under expert parallelism, each layer's most loaded expert device over the mean of its devices
      (thin: single steps, thick: the judged window) against ``max_expert_load_ratio``: the slowest
      expert group (a sixth panel, only when the run logged the expert load);
    - the loader's wait against the step time (log scale, ms and s).

    Phase changes, skipped windows and restores (events.jsonl) are vertical lines on every panel.
    A panel whose values are all 0 says so.
    """
    plt = figures.pyplot()
    from matplotlib.ticker import MaxNLocator

    limits = getattr(scan, "limits", None) or {}
    experts = scan.series.get("expert_load") or {}
    fig, axes = plt.subplots(6 if experts else 5, 1, figsize=(12, 16.5 if experts else 14), sharex=True)
    _plot_scan_replicas(axes[0], scan, limits.get("screening") or {})
    ax = axes[1]
    loss = scan.series.get("loss") or {}
    if loss:
        ax.plot(loss["steps"], loss["loss"], color="black", linewidth=1, label="loss")
    ax.set_ylabel("loss")
    ax.set_title("loss (the loss-spike check)", fontsize=9)
    _plot_scan_router(axes[2], axes[3], scan.series.get("router") or {}, limits, scan.checks.get("router", {}))
    if experts:
        _plot_expert_load(axes[4], experts, limits, scan.checks.get("expert_load", {}).get("status", "n/a"))
    _plot_scan_loader(axes[-1], scan.series.get("loader") or {})
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    seen = set()
    for step, event in _scan_marks(scan.run_dir, *scan.steps):
        colour, style, label = _MARKED_EVENTS[event]
        for ax in axes:
            ax.axvline(step, color=colour, linestyle=style, linewidth=1.1, label=label if label not in seen else None)
        seen.add(label)
    for ax in axes:
        ax.grid(alpha=0.3)
        _legend_outside(ax)
    if scan.suspects:
        verdict = "SUSPECTS: " + ", ".join(s.subject for s in scan.suspects[:4])
    else:
        unavailable = [n for n, c in scan.checks.items() if c.get("status") == "not available"]
        verdict = "CLEAN: no check found anything" + (f" ({', '.join(unavailable)} not available)" if unavailable else "")
    import textwrap

    fig.suptitle(textwrap.fill(f"replay scan of {scan.run_dir}, steps {scan.steps[0]}:{scan.steps[1]}: {verdict}",
                               width=150), fontsize=11)  # a long run path or verdict wraps, never runs off the page
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    return fig


def _plot_scan_replicas(ax, scan: Any, screening: Mapping[str, Any]) -> None:
    """The scan's first panel: each replica's robust z-score of its gradient norm (symmetric log), the
    spike threshold, the drift onsets, the steps not scored yet and the canary's mismatches."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rep = scan.series.get("replicas") or {}
    suspects = set(scan.suspect_devices)
    if rep:
        steps = np.asarray(rep["steps"])
        z = np.asarray(rep["z"], float)
        for i, rid in enumerate(rep["replicas"]):
            thick = bool(set(rep["devices"][i]) & suspects)
            ax.plot(steps, z[:, i], linewidth=2.2 if thick else 0.9, alpha=1.0 if thick else 0.7,
                    label=f"replica {rid}" + (" (suspect)" if thick else ""), zorder=3 if thick else 2)
        for s in scan.suspects:
            for e in s.evidence:
                if e.check == "norm_drift":
                    ax.axvline(e.first_step, color="red", linestyle="--", linewidth=1, label="drift onset")
        spike = float(screening.get("spike_z", 0) or 0)
        top = max(spike * 1.3, float(np.nanmax(np.abs(z[np.isfinite(z)]), initial=1.0)) * 1.2)
        ax.set_yscale("symlog", linthresh=5)
        ax.set_ylim(-top, top)
        if spike:
            for sign in (1, -1):
                ax.axhline(sign * spike, color="red", linestyle=":", linewidth=1.2,
                           label=f"spike threshold (|z| {spike:g})" if sign == 1 else None)
            ax.set_yticks(sorted({0, 5, -5, spike, -spike}))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        scored = np.flatnonzero(np.isfinite(z).any(axis=1))
        if scored.size and scored[0] > 0:
            ax.axvspan(steps[0] - 0.5, steps[scored[0]] - 0.5, color="0.92", zorder=0,
                       label=f"not scored yet (min_history {screening.get('min_history', '?')})")
        elif not scored.size:
            _note(ax, "no step scored yet: each replica needs min_history steps of its own history first")
    else:
        ax.text(0.5, 0.5, "per-replica norms not available", ha="center", transform=ax.transAxes)
    bad = [(c.step, c.device) for c in scan.series.get("canary", []) if c.status != "ok"]
    if bad:
        ax2 = ax.twinx()
        ax2.plot([b[0] for b in bad], [b[1] for b in bad], "rx", markersize=9, label="canary mismatch")
        ax2.set_ylabel("canary mismatch: device", color="red")
    ax.set_ylabel("robust z of log(norm / median)\n(symmetric log: linear within +-5)" if rep
                  else "robust z of log(norm / median)")
    ax.set_title("per-replica gradient norm against the other replicas: robust z-score (spike and drift checks)",
                 fontsize=9)


def _plot_scan_router(ax_dropped, ax_share, rout: Mapping[str, Any], limits: Mapping[str, Any],
                      health: Mapping[str, Any]) -> None:
    """The scan's router panels: each layer's dropped fraction (from 0) and worst expert share (log,
    thin: each step, thick: the judged window), with their limits and the end of warm-up."""
    import numpy as np

    from replay.run.train_plot import say_if_all_zero

    warmup = limits.get("warmup_steps")
    for ax, key, label in ((ax_dropped, "dropped", "dropped fraction"),
                           (ax_share, "share_ratio", "worst expert vs uniform")):
        if rout:
            for i in range(rout[key].shape[1]):
                line, = ax.plot(rout["steps"], rout[key][:, i], linewidth=0.8 if key == "share_ratio" else 1.4,
                                linestyle="-" if key == "share_ratio" else ("-", "--", "-.", ":")[i % 4],
                                label=f"layer {i}" + (" (each step)" if key == "share_ratio" else ""))
                if key == "share_ratio" and rout.get("window", 1) > 1:
                    ax.plot(rout["steps"], rout["share_ratio_window"][:, i], color=line.get_color(), linewidth=2.2,
                            label=f"layer {i} (over {rout['window']} steps: judged)")
        else:
            ax.text(0.5, 0.5, "router figures not available", ha="center", transform=ax.transAxes)
        ax.set_ylabel(label)
    if "max_dropped_fraction" in limits:
        ax_dropped.axhline(limits["max_dropped_fraction"], color="red", linestyle=":", label="limit")
        high, low = _share_limits(rout, limits)
        if high == low:
            ax_share.axhline(high, color="red", linestyle=":", label="limit")
        else:  # the band widened for this run's rows: each side its own limit
            ax_share.axhline(high, color="red", linestyle=":", label=f"limit, most-used expert ({high:.3g}x)")
            ax_share.axhline(low, color="darkred", linestyle="--", linewidth=0.9,
                             label=f"limit, least-used expert ({low:.3g}x)")
        for ax in (ax_dropped, ax_share):
            ax.axvline(warmup, color="grey", linestyle=":", linewidth=1, label="end of warm-up")
    top = limits.get("max_dropped_fraction", 0.01) * 1.5
    if rout and np.isfinite(rout["dropped"]).any():
        top = max(top, float(np.nanmax(rout["dropped"])) * 1.1)
        say_if_all_zero(ax_dropped, [[v for v in rout["dropped"][:, i] if v == v]
                                     for i in range(rout["dropped"].shape[1])], "dropped fraction, every layer")
    ax_dropped.set_ylim(0, top)
    if rout:
        ax_share.set_yscale("log")
        if "max_share_ratio" in limits:  # first: it may make room above the lines for its box
            _explain_unjudged(ax_share, rout, limits, health.get("status", "n/a"))
        _log_ticks(ax_share, _times_label)
    ax_dropped.set_title(f"router health ({health.get('status', 'n/a')}): dropped fraction per layer", fontsize=9)
    ax_share.set_title("expert shares: max(share x E, 1 / (min share x E)), x uniform; thin: each step, thick: the "
                       "judged window", fontsize=9)


def _plot_scan_loader(ax, load: Mapping[str, Any]) -> None:
    """The scan's last panel: the loader's wait against the step time (log scale, ms and s)."""
    import numpy as np

    if load:
        ax.plot(load["steps"], np.asarray(load["wait"]) * 1e3, label="loader wait")
        ax.plot(load["steps"], np.asarray(load["step_time"]) * 1e3, label="step time", alpha=0.6)
        ax.set_yscale("log")
        _log_ticks(ax, _ms_label)
    ax.set_ylabel("time per step")
    ax.set_title("loader wait against step time (the loader-stall check)", fontsize=9)
    ax.set_xlabel("step")


def _plot_expert_load(ax, series: Mapping[str, Any], limits: Mapping[str, Any], status: str) -> None:
    """The scan's expert-load panel: per layer the most loaded expert device over the mean, for
    each step (thin) and over the judged window (thick), with the limit and the end of warm-up."""
    import numpy as np

    steps = series["steps"]
    each, judged = np.asarray(series["each"], float), np.asarray(series["ratio"], float)
    for i in range(judged.shape[1]):
        line, = ax.plot(steps, each[:, i], linewidth=0.8, label=f"layer {i} (each step)")
        if series.get("window", 1) > 1:
            ax.plot(steps, judged[:, i], color=line.get_color(), linewidth=2.2,
                    label=f"layer {i} (over {series['window']} steps: judged)")
    if "max_expert_load_ratio" in limits:
        ax.axhline(limits["max_expert_load_ratio"], color="red", linestyle=":", label="limit")
        ax.axvline(limits.get("warmup_steps", 0), color="grey", linestyle=":", linewidth=1, label="end of warm-up")
    ax.set_ylabel("most loaded / mean")
    ax.set_title(f"expert load ({status}): tokens the most loaded expert device received over the mean of the "
                 "layer's devices (the slowest expert group)", fontsize=9)


def _share_limits(rout: Mapping[str, Any], limits: Mapping[str, Any]) -> tuple[float, float]:
    """The expert-share limits the router check judged, as ratios to uniform: ``(most-used expert's
    share x E, 1 / (least-used expert's share x E))`` at the edges of ``scan.share_band`` (widened on
    small runs, the dead-expert floor under it; the largest over the layers) when the scan gives them,
    else the config's ``max_share_ratio`` both ways. The panel's curve is the larger of the two ratios,
    so a value between the two lines is judged by the side it comes from."""
    import numpy as np

    band = np.asarray((rout or {}).get("share_limit", []), float).reshape(-1, 2)
    band = band[np.isfinite(band).all(axis=1)]
    if not band.size:
        r = float(limits["max_share_ratio"])
        return r, r
    return float(band[:, 0].max()), float(band[:, 1].max())


def _explain_unjudged(ax, rout: Mapping[str, Any], limits: Mapping[str, Any], status: str) -> None:
    """On the expert-share panel: why values above the limit did not make the check fail (or
    which did), in a box on the panel itself."""
    import numpy as np

    steps = np.asarray(rout["steps"])
    limit, warmup, window = min(_share_limits(rout, limits)), limits.get("warmup_steps", 0), int(rout.get("window", 1))
    after = steps >= warmup
    each = np.nan_to_num(np.asarray(rout["share_ratio"], float), nan=0.0)
    judged = np.nan_to_num(np.asarray(rout["share_ratio_window"], float), nan=0.0)
    lines = []
    if (each[~after] > limit).any():
        lines.append(f"before step {warmup} (warm-up) nothing is judged")
    if window > 1 and (each[after] > limit).any():
        lines.append(f"thin lines above the {limit:g}x limit are single steps, not judged: one step's shares "
                     "follow the sources of its few rows")
    if lines:
        over = (judged[after] > limit).any()
        lines.append(("judged: " + (f"the mean over {window} steps (thick)" if window > 1 else "each step")
                      + f" after warm-up, {'above' if over else 'under'} the limit: router check {status}"))
        values = np.concatenate([each[each > 0], judged[judged > 0], [limit]])
        lo, hi = float(values.min()), float(values.max())
        ax.set_ylim(lo / 1.3, hi * (hi / lo) ** 0.6)  # the top third left free for the box: it covers no line
        _note(ax, "\n".join(lines))


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
    if report.get("spike_found") is False:
        console.print(f"[yellow]note[/]: the loss check finds no loss spike at step {report['step']} or in the "
                      f"{j['stop'] - j['start'] - 1} steps before it; the checks below judge steps "
                      f"{j['start']}..{j['stop'] - 1} all the same, and a rewind only pays for a real spike "
                      f"(replay scan lists the loss spikes it finds)")
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
    plt = figures.pyplot()
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
    figures.save(fig, path, dpi=85)


def render_triage_drills(res: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints the table of ``replay drill --scenario`` triage drills: per scenario, expected, found and
    correct over the seeds."""
    console = console or make_console()
    table = Table(title=f"triage drills: {res['correct']} of {res['total']} correct "
                        f"({res.get('seconds', 0):.0f} s)")
    for col in ("scenario", "expected", "found (per drill)", "correct by magnitude", "correct"):
        table.add_column(col, overflow="fold")
    for name, sc in res["scenarios"].items():
        found = "; ".join(f"seed {r['seed']} at {r['planted'].get('magnitude')}: {r['found_text']}" for r in sc["runs"])
        by_mag = ", ".join(f"{m}: {e['correct']}/{e['total']}" for m, e in (sc.get("by_magnitude") or {}).items())
        style = "green" if sc["correct"] == sc["total"] else "red"
        table.add_row(name, escape(sc["expected_text"]), escape(found), escape(by_mag),
                      f"[{style}]{sc['correct']}/{sc['total']}[/]")
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
    table.caption = ("every part >= 0, and the parts add up to the wall time exactly" if report["time_adds_up"] else
                     "THE PARTS DO NOT ADD UP (a bug: please report): " + "; ".join(report.get("problems") or []))
    console.print(table)
    for c in report.get("clocks") or []:
        console.print(f"[yellow]clocks disagree:[/] {escape(c['what'])}")
    ledger = Table(title="steps and tokens trained (tokens: global batch x seq_len slots)")
    for col in ("part", "steps", "tokens", "non-padding tokens"):
        ledger.add_column(col, justify="left" if col == "part" else "right")
    names = {"productive": "the lineage (kept)", "non_finite": "the lineage's steps with a NaN/Inf loss", "lost": "lost to crashes (redone after a resume)",
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
    _render_input_wait(report.get("input") or {}, console)
    mfu = report["mfu"]
    if mfu.get("status") == "ok":
        console.print(f"MFU (median of the lineage's steps): {mfu['median']:.2%} ({mfu['devices']} x "
                      f"{mfu['device_kind']} at {mfu['peak_flops']:.3g} FLOP/s, {mfu['flops_per_step']:.3g} model "
                      "FLOPs a step)" + (f"; {mfu['note']}" if mfu.get("note") else ""))
    else:
        console.print(f"MFU: {escape(mfu.get('status', 'not available'))}")
    y = report["young"]
    if y.get("status") == "ok":
        every = (f"; this run checkpoints every {_dur(y['interval_s'])} ({y['interval_from'].split(':')[0]}), "
                 f"overhead {y['overhead_at_interval']:.1%}" if y.get("interval_s") else "")
        console.print(f"Young's checkpoint interval sqrt(2 x C {y['checkpoint_cost_s']:.3f} s x MTBF "
                      f"{_dur(y['mtbf_s'])}) = {_dur(y['optimal_interval_s'])} (overhead "
                      f"{y['overhead_at_optimum']:.1%}){every}; C: the measured save stall per checkpoint, MTBF: "
                      f"{escape(y['mtbf_from'])}" + (f"; a save took {_dur(y['save_latency_s'])} to commit"
                                                      if y.get("save_latency_s") is not None else ""))
    else:
        console.print(f"Young's checkpoint interval: {escape(y.get('status', 'not available'))}")
    from replay.screen.goodput import headline

    headline = f"[bold]{escape(headline(report))}[/]"
    console.print(Panel(headline, title="goodput"), soft_wrap=False)


def _render_input_wait(inp: Mapping[str, Any], console: Console) -> None:
    """The input wait line of ``replay goodput``: the loader_wait part split by where it went."""
    from replay.screen.goodput import INPUT_TEXT

    if not inp or not inp.get("charged_us"):
        return
    total = inp["charged_us"]
    parts = sorted(((v, k) for k, v in inp["us"].items() if v > 0), reverse=True)
    split = "; ".join(f"{escape(INPUT_TEXT[k])} {_dur(v / 1e6)} ({v / total:.0%})" for v, k in parts)
    occ = (f"; the buffer was empty at {inp['drained_steps']} of {inp['steps_with_occupancy']} asks"
           if inp.get("steps_with_occupancy") else "")
    console.print(f"input wait {_dur(total / 1e6)}: {split}{occ}")
    if inp.get("worst") and inp["worst"][0][1] > 0:
        console.print("  longest: " + ", ".join(f"step {s} {_dur(w)} ({escape(INPUT_TEXT.get(k, k))})"
                                                for s, w, k in inp["worst"][:3]))


def plot_goodput(rep: Any, path: str) -> None:
    """Writes a ``replay.screen.goodput.GoodputReport``'s picture: the waterfall (100% of the wall time,
    each part that is not productive taken off in turn, to the net goodput) and goodput over time
    (productive time so far over elapsed time) with restores and rewinds as vertical lines."""
    plt = figures.pyplot()
    import numpy as np

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
        # no steps ran in a gap far longer than a step (between attempts): drawn apart, not as data
        dt = np.diff(np.asarray(t, float))
        gap = dt > max(5.0 * float(np.median(dt)), 1e-9) if dt.size else np.zeros(0, bool)
        start, labelled = 0, False
        for i in list(np.nonzero(gap)[0]) + [len(t) - 1]:
            ax2.plot(t[start:i + 1], g[start:i + 1], color="#55a868", linewidth=1.5,
                     label=None if start else "goodput so far (productive / elapsed)")
            if i + 1 < len(t):
                ax2.plot(t[i:i + 2], g[i:i + 2], color="grey", linestyle=":", linewidth=1,
                         label=None if labelled else "no step ran (between attempts)")
                labelled = True
            start = i + 1
        ax2.legend(fontsize=8, loc="lower right")
    else:
        ax2.text(0.5, 0.5, "no per-step timestamps logged", ha="center", transform=ax2.transAxes)
    ax2.set_ylim(0, 100)
    span = max([x for x, _, _ in rep.events] + [x for x, _ in rep.timeline] + [1e-9])
    placed: list[tuple[float, float]] = []  # (x, y) of the labels so far: close ones are stacked downwards
    for x, kind, step in rep.events:
        color = {"start": "tab:green", "restore": "tab:orange", "rewind": "tab:red", "skip_window": "tab:purple"}.get(
            kind, "tab:gray")
        ax2.axvline(x, color=color, linestyle="--", linewidth=1)
        y = 98.0
        while any(abs(x - px) < 0.02 * span and abs(y - py) < 1 for px, py in placed):
            y -= 27.0
        placed.append((x, y))
        ax2.text(x, y, f"{kind.replace('_', ' ')} {step}", rotation=90, va="top", ha="right", fontsize=7,
                 color=color)
    ax2.set_xlabel("seconds since the first launch")
    ax2.set_ylabel("goodput so far (%)")
    ax2.set_title("goodput over time; starts, restores, rewinds and skip windows as dashed lines", fontsize=10)
    fig.suptitle(f"replay goodput of {rep.run_dir}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    figures.save(fig, path, dpi=90)


_CERTIFY_STYLE = {"trusted": "blue", "certified": "green", "poisoned": "red", "damaged": "yellow",
                  "not_certifiable": "magenta", "not_checked": "dim"}


def render_certify(report: Mapping[str, Any], console: Optional[Console] = None) -> None:
    """Prints a certify report: one row per checkpoint of the chain (verdict and reason), then the
    rewind target and the first failure."""
    console = console or make_console()
    table = Table(title=f"checkpoint chain of {report['run_dir']} ({report['steps_replayed']} steps replayed on "
                        f"{len(report['placements'])} placement(s))")
    table.add_column("checkpoint", justify="right")
    table.add_column("verdict")
    table.add_column("segment")
    table.add_column("reason")
    for v in report["chain"]:
        seg = f"{v['segment'][0]}:{v['segment'][1]}" if v.get("segment") else ""
        table.add_row(str(v["checkpoint"]), f"[{_CERTIFY_STYLE[v['verdict']]}]{v['verdict']}[/]", seg,
                      escape(v["reason"]))
    console.print(table)
    first = report.get("first_failure")
    head = f"certified: checkpoint {report['certified']} (the newest clean checkpoint: the rewind target)"
    if first:
        head += f"\nfirst not certified: checkpoint {first['checkpoint']}, {first['verdict']}: {escape(first['reason'])}"
    console.print(Panel(f"{head}\n(exit code {report['exit_code']})", title="certify"), soft_wrap=False)
