"""Triage drills and the cost of triage and goodput, against replay scan in the same run.

    python benchmarks/triage.py            # the five triage drills x 5 seeds (replay drill --scenario all)
    python benchmarks/triage.py --quick    # 1 seed each

Every drill is a short training run of the reference trainer with one planted cause
(``replay.triage_drill``: sdc, restart, data, router, clean) and ``replay triage`` must name it.
The reference each cost is measured against, side by side in the same process and on the same
run directories, is ``replay scan`` (``replay.screen.scan.scan_run``): the cheapest screen of a run,
which triage runs inside it.

Prints ONE JSON object:
  drills: per scenario correct of total, and the whole set's correct and total;
  drill_s: the whole set's wall seconds (compilation of the drills' three trainers included) and
    drill_s_median: a drill's median seconds after the first (training 40 tiny steps and triage);
  scan_s, triage_s, goodput_s: the median seconds of scan_run, triage_run (no range replay; it
    rebuilds the rows of the data check) and goodput.account over the drill runs, best of 3 each;
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed per scenario")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per scenario (default 5)")
    args = parser.parse_args(argv)
    from replay import triage_drill
    from replay.run.runlog import load_run
    from replay.screen import goodput, scan, triage

    seeds = list(range(1 if args.quick else args.seeds))
    root = tempfile.mkdtemp(prefix="bench-triage-")
    t0 = time.perf_counter()
    per: list[float] = []
    res = triage_drill.run_drills(triage_drill.SCENARIOS, seeds, root,
                                  on_result=lambda r, n: per.append(r.seconds))
    drill_s = time.perf_counter() - t0
    runs = [r["run_dir"] for sc in res["scenarios"].values() for r in sc["runs"]]
    scan_s, triage_s, goodput_s = [], [], []
    for d in runs:
        run = load_run(d)
        last = run.logged_steps[1] - 1
        scan_s.append(_best(lambda run=run: scan.scan_run(run)))
        triage_s.append(_best(lambda run=run, last=last: triage.triage_run(run, last)))
        goodput_s.append(_best(lambda run=run: goodput.account(run)))
    med = {k: statistics.median(v) for k, v in (("scan", scan_s), ("triage", triage_s), ("goodput", goodput_s))}
    print(json.dumps({
        "drills": {name: f"{sc['correct']}/{sc['total']}" for name, sc in res["scenarios"].items()},
        "correct": res["correct"], "total": res["total"], "seeds": len(seeds),
        "drill_s": round(drill_s, 1), "drill_s_median": round(statistics.median(per[1:] or per), 2),
        "scan_s": round(med["scan"], 4), "triage_s": round(med["triage"], 4), "goodput_s": round(med["goodput"], 4),
        "triage_scan_ratio": round(med["triage"] / med["scan"], 2),
        "goodput_scan_ratio": round(med["goodput"] / med["scan"], 2),
    }, sort_keys=True))
    return 0 if res["correct"] == res["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
