"""Localization under expert parallelism in bulk: drills of every kind, clean replays, drift drills.

    python benchmarks/localization.py              # 100 drills per kind, 100 clean replays, 10 drift drills
    python benchmarks/localization.py --count 10   # 10 of each (a few minutes idle)
    python benchmarks/localization.py --quick      # 3 of each, 2 drift drills

One real training run of the reference trainer (``replay.reference.run.train``) with expert
parallelism: ``model.dispatch: all_to_all`` on a ``{data: 2, expert: 4}`` mesh of 8 CPU devices, the
tiny model with 4 experts (one per device of an expert group), top-2, capacity factor 2 (no token
dropped), checkpoints every 4 steps. Then, on that run (``replay.drill``):

* per kind (``--where``: ``expert_forward``, ``expert_backward``, ``attention``, ``local_gradient``),
  ``--count`` drills, every field drawn from a seeded RNG: a step, a device, the layer or leaf, an
  element, and a bit from the whole dtype (bit 0, the lowest mantissa bit, included). The run's log
  is recomputed with the fault on the run's mesh, and a range replay of the step on two independent
  placements judges it (``replay.drill.run_drill``). Counted: ``convicted_alone`` (the faulty device
  and only it, at the fault's step), ``site_as_planted`` (the first divergent buffer is where the
  fault was planted: ``replay.drill.expected_site``), ``spread`` (drills whose error reached other
  devices within the step: where "the device whose gradient differs" would have named several),
  ``masked`` (the flipped bit changed nothing the step computed, e.g. rounded away in a residual
  add: the drilled log equals the clean one, the replay acquits, and there is nothing to name),
  ``missed`` (anything else: a wrong, extra or no device);
* ``--clean`` replays of random steps against the run's own log: every conviction is a false one;
* ``--drift`` screening drills (``replay drill --scenario drift``) on random expert devices:
  ``replay scan`` of the drilled run must name that device alone (replica-norm screening under
  expert parallelism).

Prints ONE JSON object with those counts, the failures' details, and the wall time; progress (a line
every few seconds, a Rich bar on a terminal) goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
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
MESH = {"data": 2, "expert": 4}
KINDS = ("expert_forward", "expert_backward", "attention", "local_gradient")


def train_run(root: str, steps: int):
    """The benchmark's run (module docstring): ``(session, cfg)``."""
    import dataclasses

    from replay.reference import run as runm
    from replay.reference import loop
    from replay.reference.testing import write_tiny_run
    from replay.run.runlog import load_run
    from replay.verify import engine

    path = write_tiny_run(os.path.join(root, "data"), seq_len=64, global_batch=16, rows={"a": 400, "b": 200},
                          checkpoint_every=4, phases=(), mesh=MESH, model=EP_MODEL,
                          extra={"router_health": {"window_steps": 10}})
    cfg = runm.load_run_config(path)
    trainer, mesh, _ = runm.make_trainer(cfg)
    run_dir = os.path.join(root, "run")
    loop.train(run_dir, cfg, steps, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None, plot=False))
    run = load_run(run_dir)
    return engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=trainer)), cfg


def one_drill(session, rng, where: str) -> dict:
    from replay import drill
    from replay.run.codes import Verdict
    from replay.verify.verdict import Cause

    fault = drill.random_fault(session, rng, where=where)
    res = drill.run_drill(session, fault, canary=False)
    d = res.range_report.decision
    masked = d.verdict is Verdict.ACQUITTED and d.cause is Cause.REPRODUCED
    outcome = "convicted_alone" if res.convicted_ok else "masked" if masked else "missed"
    return {"fault": {k: v for k, v in vars(fault).items()}, "outcome": outcome, "site": d.site,
            "site_as_planted": bool(res.site_ok), "reached": list(d.reached), "verdict": d.verdict.value,
            "devices": list(d.devices), "step": d.step}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100, help="drills per kind (default 100)")
    ap.add_argument("--clean", type=int, default=None, help="clean replays (default: --count)")
    ap.add_argument("--drift", type=int, default=10, help="drift drills on expert devices (default 10)")
    ap.add_argument("--quick", action="store_true", help="3 drills per kind, 3 clean replays, 2 drift drills")
    ap.add_argument("--steps", type=int, default=48, help="training steps of the run (default 48)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.count, args.clean, args.drift = 3, 3, 2
    n_clean = args.count if args.clean is None else args.clean
    import jax

    from replay import drill
    from replay.run.codes import Verdict
    from replay.runtime.progress import step_progress
    from replay.verify import engine

    t_start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="localization-bench-")
    try:
        session, cfg = train_run(root, args.steps)
        t_trained = time.perf_counter()
        rng = random.Random(args.seed)
        kinds = {}
        for where in KINDS:
            t0 = time.perf_counter()
            rows = []
            with step_progress(f"drills {where}", 0, args.count, unit="drill", counted=True) as shown:
                for n in range(args.count):
                    rows.append(one_drill(session, rng, where))
                    shown.update(n + 1)
            count = collections.Counter(r["outcome"] for r in rows)
            kinds[where] = {
                "drills": len(rows), "convicted_alone": count["convicted_alone"], "masked": count["masked"],
                "missed": count["missed"],
                "site_as_planted": sum(r["site_as_planted"] for r in rows if r["outcome"] == "convicted_alone"),
                "spread": sum(len(r["reached"]) > 1 for r in rows if r["outcome"] == "convicted_alone"),
                "sites": dict(collections.Counter(r["site"] for r in rows if r["site"])),
                "failures": [r for r in rows if r["outcome"] == "missed" or
                             (r["outcome"] == "convicted_alone" and not r["site_as_planted"])][:10],
                "masked_examples": [r["fault"] for r in rows if r["outcome"] == "masked"][:5],
                "seconds": round(time.perf_counter() - t0, 1),
            }
        t0 = time.perf_counter()
        first, stop = session.run.logged_steps
        clean_rows = []
        with step_progress("clean replays", 0, n_clean, unit="replay", counted=True) as shown:
            for n in range(n_clean):
                s = rng.randrange(first, stop)
                rep = engine.replay_range(session, s, s + 1, device_spec="all", full_comparison=False)
                clean_rows.append({"step": s, "verdict": rep.verdict.value, "devices": list(rep.decision.devices)})
                shown.update(n + 1)
        clean = {"replays": n_clean, "convicted": sum(r["verdict"] == Verdict.CONVICTED.value for r in clean_rows),
                 "acquitted": sum(r["verdict"] == Verdict.ACQUITTED.value for r in clean_rows),
                 "other": [r for r in clean_rows if r["verdict"] != Verdict.ACQUITTED.value],
                 "seconds": round(time.perf_counter() - t0, 1)}
        t0 = time.perf_counter()
        drifts = []
        ids = list(session.setup.run_device_ids)
        for i in range(args.drift):
            dev = rng.choice(ids)
            start = rng.randrange(args.steps // 2, args.steps - 10)
            res = drill.run_scenario(session, "drift", os.path.join(root, f"drift-{i}"), rng=random.Random(i),
                                     device=dev, start=start, magnitude=1.0)
            drifts.append({"device": dev, "start": start, "caught": res.caught, "named": res.named,
                           "suspect_devices": res.scan.get("suspect_devices")})
            shutil.rmtree(os.path.join(root, f"drift-{i}"), ignore_errors=True)
        result = {
            "benchmark": "localization",
            "kinds": kinds,
            "clean": clean,
            "drift_on_expert_devices": {"drills": len(drifts), "caught": sum(d["caught"] for d in drifts),
                                        "magnitude": 1.0, "missed": [d for d in drifts if not d["caught"]],
                                        "seconds": round(time.perf_counter() - t0, 1)},
            "mesh": MESH, "model": EP_MODEL, "steps": args.steps, "checkpoint_every": 4, "global_batch": 16,
            "seq_len": 64, "seed": args.seed, "devices": jax.device_count(), "platform": jax.devices()[0].platform,
            "train_s": round(t_trained - t_start, 1), "wall_s": round(time.perf_counter() - t_start, 1),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
