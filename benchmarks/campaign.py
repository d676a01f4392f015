"""An honest fault campaign: verdicts measured on faults the checker does not look at (issue 27).

    python benchmarks/campaign.py                 # >= 1000 drills over the grid, 200 clean replays, drift drills
    python benchmarks/campaign.py --quick         # one drill per (site, magnitude) on the first layout, a few
                                                  # on the second, 20 clean replays, 10 drift drills
    python benchmarks/campaign.py --png FILE      # the matrix as a labeled PNG (default campaign.png)
    python benchmarks/campaign.py --rows R.jsonl  # every drill's row as it runs; --from-rows R.jsonl: summarize
                                                  # the rows of an interrupted run (exactly what ran)

Two real training runs of the reference trainer with expert parallelism (``model.dispatch:
all_to_all``, the tiny model with 4 experts, top-2, capacity factor 2, checkpoints every 4 steps), one on
``{data: 2, expert: 4}`` and one on ``{data: 4, expert: 2}`` of 8 CPU devices. On each, drills from
``replay.verify.faults``: every site of ``CAMPAIGN_SITES`` (inside the FFN matmuls forward and backward,
inside attention, the router logits, the received buffer of each all-to-all forward and backward, the host
batch; none of them a buffer the checker fingerprints next) x every magnitude class (bit classes low /
mid / high mantissa 0-7 / 8-15 / 16-22, exponent 23-30, sign 31; scales x(1+1e-6), x(1+1e-3), x(1+1e-1),
x2) x persistence (once, or every step of a 3-step segment), the device, layer, element and bit drawn from
``--seed`` (seeds no test uses: the tests use 0-99). Each drill trains its segment from a checkpoint with
the fault on the run's mesh (one compiled step, reused by every drill), and:

* masked: no fingerprint of any device changed AND the state after the segment is compared with the
  clean run's, every element bit for bit (``masked_shown_identical``: true when every masked drill was);
* otherwise a range replay of the fault's first step on two independent placements judges it: right
  device (or link, or data for the host batch) alone / right plus others / wrong / missed;
* detected by screening (``replay scan`` of the drilled logs), by the canary (persistent faults in a
  chip's arithmetic, which fire in the canary program too) and by range replay, each counted apart.

Then clean replays (``--clean``) of random steps of both runs against their own logs (every conviction a
false one), and drift drills (``--drift``) for the expert-device screening signal (issue 27 item 4): one
expert device's experts' output x(1 + delta) at every step from a random step on, delta from the fixed
grid ``DRIFT_GRID``; ``replay scan`` must name that device within 20 steps of the start: alone, or, on two
data replicas, as the pair of twins that hold the same experts (which the signal cannot tell apart:
``scan_expert_drift_named_alone_fraction`` counts the drills named alone).

Prints ONE JSON object with ``unmasked_right_alone_fraction``, ``false_convictions``,
``masked_shown_identical``, ``transit_link_named_fraction``, ``scan_expert_drift_named_fraction`` (over
drifts at or above ``floor``), ``floor``, the matrix and the failures; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

EP_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 8, "n_experts": 4, "top_k": 2, "d_ff": 32,
            "capacity_factor": 2.0, "aux_loss_weight": 0.1, "router_bias_rate": 0.02, "dispatch": "all_to_all"}
LAYOUTS = ({"data": 2, "expert": 4}, {"data": 4, "expert": 2})
DRIFT_GRID = (0.01, 0.02, 0.05, 0.1, 0.2)
FLOOR = 0.05  # the stated floor of the expert-device drift signal (replay.screen.scan, expert_drift)
SEED = 1027  # no test uses it
SEGMENT = 3  # steps of a persistent drill's segment


def train_run(root: str, mesh: dict, steps: int, name: str):
    """One EP training run (module docstring): its ``replay.verify.engine.Session``."""
    import dataclasses

    from replay.reference import run as runm
    from replay.reference import loop
    from replay.reference.testing import write_tiny_run
    from replay.run.runlog import load_run
    from replay.verify import engine

    path = write_tiny_run(os.path.join(root, f"data-{name}"), seq_len=32, global_batch=16,
                          rows={"a": 400, "b": 200}, checkpoint_every=4, phases=(), mesh=mesh, model=EP_MODEL,
                          extra={"canary_every": 4, "router_health": {"window_steps": 10}})
    cfg = runm.load_run_config(path)
    trainer, m, _ = runm.make_trainer(cfg)
    run_dir = os.path.join(root, f"run-{name}")
    loop.train(run_dir, cfg, steps, trainer=trainer, mesh=m, output=loop.Output(log=lambda s: None, plot=False))
    run = load_run(run_dir)
    return engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=trainer))


def grid(rng: random.Random, per_cell: int, persistences) -> list[tuple[str, str, str]]:
    """``(site, magnitude, persistence)`` cells, each ``per_cell`` times (host batch: bit classes only),
    in a seeded order."""
    from replay.verify.faults import BIT_CLASSES, CAMPAIGN_SITES, MAGNITUDES

    out = []
    for site in CAMPAIGN_SITES:
        for mag in MAGNITUDES:
            if site == "host_batch" and mag not in BIT_CLASSES:
                continue
            for p in persistences:
                out += [(site, mag, p)] * per_cell
    rng.shuffle(out)
    return out


def _segment(session, step: int) -> int:
    """The checkpoint segment (its checkpoint) that holds ``step``."""
    return max(c for c in session.run.checkpoints if c <= step)


def drift_drills(sessions, rng, count: int, steps: int, root: str) -> list[dict]:
    """Expert-device drift drills (module docstring), ``delta`` cycling through ``DRIFT_GRID``, the layouts
    alternating; each drifts for the last 20 steps of its run, so a drill the scan names is named within 20
    steps of the drift's start."""
    from replay import drill

    out = []
    for i in range(count):
        session = sessions[(i // len(DRIFT_GRID)) % len(sessions)]
        delta = DRIFT_GRID[i % len(DRIFT_GRID)]
        dev = rng.choice(list(session.setup.run_device_ids))
        start = steps - 20
        folder = os.path.join(root, f"drift-{i}")
        res = drill.run_scenario(session, "expert_drift", folder, rng=random.Random(SEED + i), device=dev,
                                 start=start, magnitude=delta)
        onset = res.scan.get("onset")
        out.append({"layout": dict(zip(session.setup.axis_names, session.setup.shape)), "delta": delta,
                    # targeted replay starts at the onset's checkpoint segment: the right one holds the start
                    "onset_segment_right": bool(onset) and _segment(session, int(onset["step"])) == _segment(session, start),
                    "device": dev, "start": start, "steps_after_start": steps - start, "caught": res.caught,
                    # on two data replicas the check names the pair of twins (replay.screen.scan._expert_drift)
                    "named_alone": res.caught and res.scan.get("suspect_devices") == [dev],
                    "named": res.named, "suspect_devices": res.scan.get("suspect_devices"),
                    "onset": res.scan.get("onset")})
        shutil.rmtree(folder, ignore_errors=True)
    return out


def matrix_png(matrix: dict, path: str, title: str) -> str:
    """The site x magnitude matrix as a heat map: colour the fraction of unmasked drills convicted right
    alone; each cell says ``right/unmasked`` and ``m`` the masked count (grey: every drill masked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from replay.verify.faults import CAMPAIGN_SITES, MAGNITUDES

    sites = [s for s in CAMPAIGN_SITES if s in matrix]
    frac = np.full((len(sites), len(MAGNITUDES)), np.nan)
    fig, ax = plt.subplots(figsize=(13, 0.45 * len(sites) + 2.2))
    for i, s in enumerate(sites):
        for j, m in enumerate(MAGNITUDES):
            c = matrix[s].get(m)
            if not c:
                continue
            un = c["drills"] - c["masked"]
            if un:
                frac[i, j] = c["right_alone"] / un
            ax.text(j, i, f"{c['right_alone']}/{un}\nm{c['masked']}", ha="center", va="center", fontsize=7,
                    color="black")
    cmap = matplotlib.colormaps["RdYlGn"].copy()
    cmap.set_bad("lightgrey")
    im = ax.imshow(frac, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(MAGNITUDES)), MAGNITUDES, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(sites)), sites, fontsize=8)
    ax.set_xlabel("bit class (flip of one bit in the range) or scale (element x factor)")
    ax.set_ylabel("fault site (inside the computation, in transit, on the host)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="unmasked drills convicted right alone (grey: every drill masked, or none: no text)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize_rows(path: str, png: str) -> dict:
    """The figures of the drill rows in ``path`` (``--rows``), per layout and persistence, and the PNG."""
    from replay.verify import faults as fm

    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    summary = fm.summarize(rows)
    part = {}
    for key, pick in (("layout", lambda r: json.dumps(r["layout"])), ("persistence", lambda r: r["fault"]["persistence"])):
        for v in sorted({pick(r) for r in rows}):
            got = fm.summarize([r for r in rows if pick(r) == v])
            part.setdefault(key, {})[v] = {k: got[k] for k in ("drills", "masked", "outcomes",
                                                               "unmasked_right_alone_fraction",
                                                               "transit_link_named_fraction")}
    detection = {k: sum(bool((r.get("detected") or {}).get(k)) for r in rows if r["outcome"] != "masked")
                 for k in ("screening", "canary", "range")}
    detection["canary_tried"] = sum((r.get("detected") or {}).get("canary") is not None for r in rows)
    title = (f"fault campaign (rows of {os.path.basename(path)}): {summary['drills']} drills ({summary['masked']} "
             f"masked, shown bit-identical: {summary['masked_shown_identical']})")
    result = {"benchmark": "campaign", "from_rows": path,
              **{k: summary[k] for k in ("drills", "masked", "unmasked", "outcomes", "unmasked_right_alone_fraction",
                                         "masked_shown_identical", "transit_link_named_fraction")},
              "detected_unmasked": detection, "by": part,
              "failures": [r for r in rows if r["outcome"] in ("wrong", "missed", "right_plus_others")][:40],
              "matrix": summary["matrix"], "png": matrix_png(summary["matrix"], png, title) if rows else None}
    print(json.dumps(result, default=str))
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the short campaign (module docstring)")
    ap.add_argument("--per-cell", type=int, default=3, help="drills per (site, magnitude, persistence) on the "
                    "first layout (default 3; the second layout gets one)")
    ap.add_argument("--clean", type=int, default=200, help="clean replays (default 200)")
    ap.add_argument("--drift", type=int, default=20, help="expert-device drift drills (default 20; --quick: 10)")
    ap.add_argument("--steps", type=int, default=40, help="training steps of each run (default 40)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many fault drills (a partial run)")
    ap.add_argument("--png", default="campaign.png", help="where to write the matrix (default campaign.png)")
    ap.add_argument("--rows", default=None, help="also write every drill's row as JSON lines here")
    ap.add_argument("--from-rows", default=None, metavar="FILE",
                    help="no drills: summarize the rows an earlier (possibly interrupted) run wrote with --rows, "
                         "and draw its matrix; prints what those rows hold, nothing else")
    args = ap.parse_args(argv)
    if args.from_rows:
        return summarize_rows(args.from_rows, args.png)
    import jax

    from replay.run.codes import Verdict
    from replay.runtime.progress import step_progress
    from replay.screen.scan import scan_run
    from replay.verify import engine
    from replay.verify import faults as fm

    t_start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="campaign-bench-")
    rng = random.Random(args.seed)
    plan = []  # (layout index, site, magnitude, persistence)
    if args.quick:
        first = grid(rng, 1, ("once",))
        for n, cell in enumerate(first):  # every cell once, half of them persistent
            plan.append((0, cell[0], cell[1], "every" if n % 2 else "once"))
        plan += [(1, *c) for c in grid(rng, 1, ("once",))[:24]]
        args.clean, args.drift = min(args.clean, 20), min(args.drift, 10)
    else:
        plan += [(0, *c) for c in grid(rng, args.per_cell, ("once", "every"))]
        plan += [(1, *c) for c in grid(rng, 1, ("once", "every"))]
    if args.limit is not None:
        plan = plan[:args.limit]
    rows, sessions, train_s = [], [], []
    out_rows = open(args.rows, "w", encoding="utf-8") if args.rows else None
    try:
        for i, mesh in enumerate(LAYOUTS):
            t0 = time.perf_counter()
            sessions.append(train_run(root, mesh, args.steps, f"L{i}"))
            train_s.append(round(time.perf_counter() - t0, 1))
        contexts = [fm.DrillContext(s, scan=scan_run) for s in sessions]
        t_drills = time.perf_counter()
        with step_progress("fault drills", 0, len(plan), unit="drill", counted=True) as shown:
            for n, (li, site, mag, pers) in enumerate(plan):
                fault = fm.draw_fault(sessions[li], rng, site, mag, pers)
                row = fm.run_fault_drill(contexts[li], fault, segment=1 if pers == "once" else SEGMENT)
                row["layout"] = LAYOUTS[li]
                rows.append(row)
                if out_rows:
                    out_rows.write(json.dumps(row, default=str) + "\n")
                    out_rows.flush()
                shown.update(n + 1)
        drills_s = time.perf_counter() - t_drills
        t0 = time.perf_counter()
        clean = []
        with step_progress("clean replays", 0, args.clean, unit="replay", counted=True) as shown:
            for n in range(args.clean):
                session = sessions[n % len(sessions)]
                first_step, stop = session.run.logged_steps
                s = rng.randrange(first_step, stop)
                rep = engine.replay_range(session, s, s + 1, device_spec="all", full_comparison=False, onset=None)
                clean.append({"layout": LAYOUTS[n % len(sessions)], "step": s, "verdict": rep.verdict.value,
                              "devices": list(rep.decision.devices), "links": [list(x) for x in rep.decision.links]})
                shown.update(n + 1)
        clean_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        drifts = drift_drills(sessions, rng, args.drift, args.steps, root) if args.drift else []
        drift_s = time.perf_counter() - t0
        from replay.screen.scan import scan_run

        clean_scans = {json.dumps(LAYOUTS[i]): {k: scan_run(s.run).checks[k] for k in ("expert_drift", "norm_drift")}
                       for i, s in enumerate(sessions)}
    finally:
        if out_rows:
            out_rows.close()
        shutil.rmtree(root, ignore_errors=True)
    summary = fm.summarize(rows)
    at_floor = [d for d in drifts if d["delta"] >= FLOOR]
    per_delta = {str(x): {"drills": sum(d["delta"] == x for d in drifts),
                          "named": sum(d["caught"] for d in drifts if d["delta"] == x)} for x in DRIFT_GRID}
    by_layout = {}
    for mesh in LAYOUTS:
        part = fm.summarize([r for r in rows if r["layout"] == mesh])
        by_layout[json.dumps(mesh)] = {k: part[k] for k in ("drills", "masked", "unmasked", "outcomes",
                                                           "unmasked_right_alone_fraction",
                                                           "transit_link_named_fraction")}
    by_persistence = {}
    for p in ("once", "every"):
        part = fm.summarize([r for r in rows if r["fault"]["persistence"] == p])
        by_persistence[p] = {k: part[k] for k in ("drills", "masked", "outcomes", "unmasked_right_alone_fraction")}
    detection = {k: sum(bool((r.get("detected") or {}).get(k)) for r in rows if r["outcome"] != "masked")
                 for k in ("screening", "canary", "range")}
    detection["canary_tried"] = sum((r.get("detected") or {}).get("canary") is not None for r in rows)
    title = (f"fault campaign: {summary['drills']} drills ({summary['masked']} masked, shown bit-identical: "
             f"{summary['masked_shown_identical']}), layouts data2xexpert4 + data4xexpert2, seed {args.seed}")
    png = matrix_png(summary["matrix"], args.png, title) if rows else None
    result = {
        "benchmark": "campaign",
        "quick": bool(args.quick),
        "unmasked_right_alone_fraction": summary["unmasked_right_alone_fraction"],
        "false_convictions": sum(c["verdict"] == Verdict.CONVICTED.value for c in clean),
        "clean_replays": len(clean),
        "masked_shown_identical": summary["masked_shown_identical"],
        "transit_link_named_fraction": summary["transit_link_named_fraction"],
        "scan_expert_drift_named_fraction": (sum(d["caught"] for d in at_floor) / len(at_floor)) if at_floor else None,
        "scan_expert_drift_named_alone_fraction": (sum(d["named_alone"] for d in at_floor) / len(at_floor))
        if at_floor else None,
        "floor": FLOOR,
        "drift_grid": list(DRIFT_GRID),
        "drift_per_delta": per_delta,
        "scan_onset_right_segment_fraction": (sum(d["onset_segment_right"] for d in drifts if d["caught"])
                                              / max(1, sum(d["caught"] for d in drifts))) if drifts else None,
        "drills": summary["drills"], "masked": summary["masked"], "unmasked": summary["unmasked"],
        "outcomes": summary["outcomes"],
        "detected_unmasked": detection,
        "by_layout": by_layout, "by_persistence": by_persistence,
        "failures": [r for r in rows if r["outcome"] in ("wrong", "missed", "right_plus_others")][:40],
        "clean_not_acquitted": [c for c in clean if c["verdict"] != Verdict.ACQUITTED.value],
        "drift_missed": [d for d in drifts if not d["caught"]],
        "drift_drills": drifts,
        "clean_runs_scan": clean_scans,
        "matrix": summary["matrix"],
        "png": png,
        "layouts": list(LAYOUTS), "model": EP_MODEL, "steps": args.steps, "segment": SEGMENT, "seed": args.seed,
        "devices": jax.device_count(), "platform": jax.devices()[0].platform,
        "train_s": train_s, "drills_s": round(drills_s, 1), "clean_s": round(clean_s, 1),
        "drift_s": round(drift_s, 1), "wall_s": round(time.perf_counter() - t_start, 1),
        "load_avg": os.getloadavg()[0],
    }
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
