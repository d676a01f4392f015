"""Triage drills over each cause's fixed grid of magnitudes, and the cost of triage and goodput,
against replay scan in the same run.

    python benchmarks/triage.py            # every triage drill at every magnitude of its grid x 3 seeds
    python benchmarks/triage.py --quick    # 1 seed each

Every drill is a short training run of the reference trainer with one planted cause
(``replay.triage_drill``: sdc, restart, data, duplicate, router, router_scale, nonfinite, clean) at
a magnitude of its grid (``triage_drill.GRIDS``, down to the check's stated floor), and ``replay
triage`` must name it: the duplicated shard is 1 to 3 copies of one shard with a consistent
manifest, the router fault (``router_scale``) the router weights scaled once, triaged 4 steps after
its onset.
The reference each cost is measured against, side by side in the same process and on the same
run directories, is ``replay scan`` (``replay.screen.scan.scan_run``): the cheapest screen of a run,
which triage runs inside it.

Prints ONE JSON object:
  drills: per scenario correct of total, and the whole set's correct and total;
  detections: per scenario, per magnitude of its grid, "correct/total" (a detection is the right
    cause with the right subject: device, restore and shift, shards, layer; for clean, no suspect);
  grids: the magnitudes;
  drill_s: the whole set's wall seconds (compilation of the drills' three trainers included) and
    drill_s_median: a drill's median seconds after the first (training 40 tiny steps and triage);
  scan_s, triage_s, goodput_s: the median seconds of scan_run, triage_run (no range replay; it
    rebuilds the rows of the data check) and goodput.account over the drill runs at each grid's
    largest magnitude, best of 3 each;
  triage_scan_ratio, goodput_scan_ratio: their ratios to scan_run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _best(fn, repeats: int = 3) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def plot_detections(detections, grids, path: str) -> None:
    """Writes ``path``: per cause, the share of drills correct at each magnitude of its grid (largest
    first), the counts written on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(detections)
    fig, axes = plt.subplots(1, len(names), figsize=(2.2 * len(names), 3.2), sharey=True)
    for ax, name in zip(axes, names):
        mags = [m for m in grids[name] if m in detections[name]]
        counts = [tuple(int(x) for x in detections[name][m].split("/")) for m in mags]
        shares = [c / t if t else 0 for c, t in counts]
        ax.bar(range(len(mags)), shares, color=["tab:green" if x == 1 else "tab:orange" if x else "tab:red"
                                                for x in shares])
        for i, (c, t) in enumerate(counts):
            ax.text(i, 0.02, f"{c}/{t}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(mags)), mags, fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("magnitude (largest first)", fontsize=7)
    axes[0].set_ylabel("drills named correctly")
    axes[0].set_ylim(0, 1.05)
    fig.suptitle("replay triage drills: detection per magnitude of each cause's grid", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed per scenario")
    parser.add_argument("--plot", metavar="OUT.png", help="write the detections per magnitude as a bar chart")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per scenario and magnitude (default 3)")
    args = parser.parse_args(argv)
    from replay import triage_drill
    from replay.run.runlog import load_run
    from replay.screen import goodput, scan, triage

    seeds = list(range(100, 100 + (1 if args.quick else args.seeds)))  # seeds no test uses
    root = tempfile.mkdtemp(prefix="bench-triage-")
    t0 = time.perf_counter()
    per: list[float] = []
    res = triage_drill.run_drills(triage_drill.SCENARIOS, seeds, root, grid=True,
                                  on_result=lambda r, n: (per.append(r.seconds), print(
                                      f"drill {n}: {r.scenario} at {r.planted['magnitude']} seed {r.seed}: "
                                      f"{'correct' if r.correct else 'WRONG'} ({r.seconds:.1f} s)",
                                      file=sys.stderr, flush=True)))
    drill_s = time.perf_counter() - t0
    largest = {name: str(g[0]) for name, g in triage_drill.GRIDS.items()}
    runs = [r["run_dir"] for name, sc in res["scenarios"].items() for r in sc["runs"]
            if str(r["planted"]["magnitude"]) == largest[name]]  # the costs: on the drills at their defaults
    scan_s, triage_s, goodput_s = [], [], []
    for d in runs:
        run = load_run(d)
        last = run.logged_steps[1] - 1
        scan_s.append(_best(lambda run=run: scan.scan_run(run)))
        triage_s.append(_best(lambda run=run, last=last: triage.triage_run(run, last)))
        goodput_s.append(_best(lambda run=run: goodput.account(run)))
    med = {k: statistics.median(v) for k, v in (("scan", scan_s), ("triage", triage_s), ("goodput", goodput_s))}
    detections = {name: {m: f"{e['correct']}/{e['total']}" for m, e in sc["by_magnitude"].items()}
                  for name, sc in res["scenarios"].items()}
    grids = {name: [str(m) for m in g] for name, g in triage_drill.GRIDS.items()}
    if args.plot:
        plot_detections(detections, grids, args.plot)
    print(json.dumps({
        "drills": {name: f"{sc['correct']}/{sc['total']}" for name, sc in res["scenarios"].items()},
        "detections": detections, "grids": grids,
        "correct": res["correct"], "total": res["total"], "seeds": len(seeds),
        "drill_s": round(drill_s, 1), "drill_s_median": round(statistics.median(per[1:] or per), 2),
        "scan_s": round(med["scan"], 4), "triage_s": round(med["triage"], 4), "goodput_s": round(med["goodput"], 4),
        "triage_scan_ratio": round(med["triage"] / med["scan"], 2),
        "goodput_scan_ratio": round(med["goodput"] / med["scan"], 2),
    }, sort_keys=True))
    at_default = all(sc["by_magnitude"][largest[name]]["correct"] == sc["by_magnitude"][largest[name]]["total"]
                     for name, sc in res["scenarios"].items())
    return 0 if at_default else 1  # the smaller magnitudes measure the floor: a miss there is a figure


if __name__ == "__main__":
    sys.exit(main())
