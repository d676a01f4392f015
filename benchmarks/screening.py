"""Screening drills in bulk: false alarms on clean runs, the drift detection floor, drift/flip/canary drills.

    python benchmarks/screening.py            # 20 clean runs, a magnitude sweep, 20 drift drills,
                                              # 5 flip and 5 canary drills (~70 short runs; minutes)
    python benchmarks/screening.py --quick    # 4 clean, a 3-point sweep, 4 drift drills, 2 flip, 2 canary

Every run is a real short training run of the reference trainer (``replay.reference.run.train``)
on a synthetic packed dataset, 8 CPU devices (mesh data 4 x expert 2: 8 replicas), the tiny model
of ``replay.reference.testing`` made drop-free (capacity factor = E/R) and balanced (aux loss,
loss-free bias); a fault is injected through the trainer's traced fault inputs
(``replay.run.protocol.DriftSpec`` / ``FaultSpec``), and ``replay scan`` (``replay.screen.scan.scan_run``)
judges the run directory from its logs alone (``replay.drill.judge_scan``: exactly the faulty
device named, with evidence of the scenario's kind, from the right first step; a drift's onset
within ``replay.drill.DRIFT_TOLERANCE`` steps).

Prints ONE JSON object:
  clean: runs, runs with any suspect, runs with a device suspect, replica-steps scored, the false-alarm
    rate per run and per replica-step (upper 95% bound when none), max_abs_z: the largest robust
    score of any clean replica-step (the tail the spike threshold ``spike_z`` must clear);
  sweep: per (kind, magnitude) the drills caught; floor: the smallest relative error (scale
    drifts) caught in every drill of the sweep at it and at every larger magnitude;
  drift: 20 drills with random device and start step, magnitudes cycling through the fixed grid
    DRIFT_GRID (not drawn from this run's own floor), how many named the right device per magnitude
    (and onset errors; other_replicas_max_abs_z: the largest score of the replicas without the fault);
  flip, canary: drills caught;
  the noise: the median robust sigma of the replicas' log-ratios (the floor scales with it:
    roughly with one over the square root of the tokens a replica sees per step);
  step and canary seconds of the tiny model (the demo model's cost is benchmarks/signals.py's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

DRILL_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 8, "n_experts": 4, "top_k": 2, "d_ff": 32,
               "capacity_factor": 2.0, "aux_loss_weight": 0.1, "router_bias_rate": 0.02}
STEPS = 120
DRIFT_GRID = (0.02, 0.05, 0.1, 0.2, 0.5)  # the drift drills' magnitudes: a fixed grid, not the run's own floor


def make_config(folder: str, canary_every: int = 10):
    """The drills' run config: tiny model, 8 replicas, 2 rows of 64 tokens per replica, no phases."""
    import yaml

    from replay.reference import run as runm
    from replay.reference.testing import write_tiny_run

    path = write_tiny_run(folder, seq_len=64, global_batch=16, rows={"a": 400, "b": 200}, checkpoint_every=10_000,
                          phases=(), model=DRILL_MODEL)
    raw = yaml.safe_load(open(path))
    raw["canary_every"] = canary_every
    raw["router_health"] = {"window_steps": 10}  # as the demo: expert shares over 10-step windows
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return runm.load_run_config(path)


class Drills:
    """Trains and scans drill runs with one compiled trainer."""

    def __init__(self, root: str, steps: int = STEPS):
        from replay.reference import run as runm

        self.root, self.steps = root, steps
        self.cfg = make_config(os.path.join(root, "data"))
        self.trainer, self.mesh, _ = runm.make_trainer(self.cfg)
        self.ids = [int(d.id) for d in self.mesh.devices.reshape(-1)]
        self.n = 0

    def run(self, seed: int, scenario=None, **fault) -> dict:
        """One run (clean when ``scenario`` is None); returns its scan report (dict) and timings."""
        from replay import drill
        from replay.reference import loop
        from replay.reference.drills import DrillHooks
        from replay.run.runlog import load_run
        from replay.screen.scan import scan_run

        self.n += 1
        out = os.path.join(self.root, f"run{self.n}")
        faults = canary_fault = None
        first = None
        if scenario is not None:
            faults, canary_fault, first = drill.scenario_faults(
                scenario, stop=self.steps, leaf_paths=self.trainer.leaf_paths, leaf_sizes=self.trainer.leaf_sizes,
                rng=random.Random(seed), **fault)
            if scenario == "canary":
                every = self.cfg.canary_every
                first = -(-first // every) * every
        cfg = dataclasses.replace(self.cfg, seed=seed)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # canary mismatch warnings are the canary drill's point
            summary = loop.train(out, cfg, self.steps, trainer=self.trainer, mesh=self.mesh,
                                 output=loop.Output(log=lambda s: None),
                                 drill=DrillHooks(faults=faults, canary_fault=canary_fault))
        rep = scan_run(load_run(out))
        d = rep.to_dict()
        ser = rep.series.get("replicas") or {}
        z = np.abs(np.asarray(ser.get("z", np.zeros((0, 0))), float))
        faulty = [i for i, devs in enumerate(ser.get("devices", [])) if scenario is not None and fault["device"] in devs]
        z_clean = np.delete(z, faulty, axis=1) if z.size else z
        res = {"scan": d, "first": first, "canary_s": summary["canary_seconds"][1:],
               "max_abs_z_clean": float(np.nanmax(z_clean)) if np.isfinite(z_clean).any() else None,
               "sigma": float(statistics.median([s for s in ser["sigma"] if math.isfinite(s)])) if ser else None,
               "judged": _judged(d), "step_s": d["figures"].get("median_step_s")}
        if scenario is not None:
            tol = drill.DRIFT_TOLERANCE if scenario == "drift" else 0
            res["caught"] = drill.judge_scan(d, scenario, fault["device"], first, tol)
            res["named"] = drill.top_device_suspect(d)
        shutil.rmtree(out, ignore_errors=True)
        return res


def _judged(scan: dict) -> int:
    detail = scan["checks"]["norm_drift"].get("detail", "")
    return int(detail.split(" ")[0]) if detail[:1].isdigit() else 0


def _onset_error(res: dict) -> int | None:
    for s in res["scan"]["suspects"]:
        for e in s["evidence"]:
            if e["check"] == "norm_drift" and res["named"] and s["devices"] == res["named"]["devices"]:
                return e["first_step"] - res["first"]
    return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few drills of each kind (about a minute idle)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    quick = args.quick
    from replay.screen.screening import ScreeningConfig

    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="screening-bench-")
    t_start = time.perf_counter()
    try:
        dr = Drills(root)
        n_clean = 4 if quick else 20
        clean = [dr.run(1000 + i) for i in range(n_clean)]
        any_suspect = sum(bool(r["scan"]["suspects"]) for r in clean)
        dev_suspect = sum(bool(r["scan"]["suspect_devices"]) for r in clean)
        judged = sum(r["judged"] for r in clean)
        alarms = sum(sum(1 for s in r["scan"]["suspects"] if s["kind"] in ("device", "replica")) for r in clean)
        # one-sided 95% upper bound on a rate with zero events: 3 / n ("rule of three")
        clean_out = {"runs": n_clean, "runs_with_any_suspect": any_suspect, "runs_with_device_suspect": dev_suspect,
                     "false_alarm_rate_per_run": dev_suspect / n_clean,
                     "false_alarm_rate_per_run_upper95": (3 / n_clean) if dev_suspect == 0 else None,
                     "replica_steps_scored": judged, "device_alarms": alarms,
                     "false_alarm_rate_per_replica_step_upper95": (3 / judged) if alarms == 0 and judged else
                     alarms / max(judged, 1),
                     "max_abs_z": max((r["max_abs_z_clean"] for r in clean if r["max_abs_z_clean"] is not None),
                                      default=None),
                     "suspects_seen": sorted({s["subject"] + ":" + s["evidence"][0]["check"]
                                              for r in clean for s in r["scan"]["suspects"]})}

        def drift(seed, magnitude, kind="scale"):
            device = rng.choice(dr.ids)
            start = rng.randrange(30, 71)
            return dict(dr.run(seed, "drift", device=device, start=start, magnitude=magnitude, kind=kind),
                        device=device)

        mags = [0.1, 0.2, 0.3] if quick else [0.05, 0.1, 0.15, 0.2, 0.3]
        per = 2 if quick else 4
        sweep = {}
        for m in mags:
            sweep[m] = [drift(2000 + int(m * 1000) + i, m) for i in range(per)]
        caught = {m: sum(r["caught"] for r in rs) for m, rs in sweep.items()}
        floor = None
        for m in sorted(mags, reverse=True):
            if caught[m] == per:
                floor = m
            else:
                break
        bias = {}
        if not quick:
            for m in (0.3, 0.6, 1.0):
                bias[m] = [drift(3000 + int(m * 100) + i, m, "bias") for i in range(3)]
        n_drift = 4 if quick else 20
        drills = []
        for i in range(n_drift):  # magnitudes from the fixed grid, not from this run's own floor (issue 27)
            m = DRIFT_GRID[i % len(DRIFT_GRID)]
            r = drift(4000 + i, m)
            drills.append({"magnitude": m, "device": r["device"], "caught": r["caught"], "named": r["named"],
                           "max_abs_z_other_replicas": r["max_abs_z_clean"],
                           "first": r["first"], "onset_error": _onset_error(r)})
        flips = [dr.run(5000 + i, "flip", device=rng.choice(dr.ids), start=rng.randrange(20, 100))
                 for i in range(2 if quick else 5)]
        canaries = [dr.run(6000 + i, "canary", device=rng.choice(dr.ids), start=rng.randrange(20, 100))
                    for i in range(2 if quick else 5)]
        sigmas = [r["sigma"] for r in clean if r["sigma"] is not None]
        canary_s = [x for r in clean for x in r["canary_s"]]
        step_s = [r["step_s"] for r in clean if r["step_s"]]
        onset = [d["onset_error"] for d in drills if d["onset_error"] is not None]
        result = {
            "benchmark": "screening",
            "clean": clean_out,
            "sweep_scale": {str(m): {"caught": caught[m], "of": per} for m in mags},
            "floor_relative_error_scale": floor,
            "sweep_bias": {str(m): {"caught": sum(r["caught"] for r in rs), "of": len(rs)} for m, rs in bias.items()},
            "drift_drills": {"count": n_drift, "caught": sum(d["caught"] for d in drills),
                             "magnitude_grid": list(DRIFT_GRID),
                             "caught_per_magnitude": {str(m): [sum(d["caught"] for d in drills if d["magnitude"] == m),
                                                               sum(d["magnitude"] == m for d in drills)]
                                                      for m in DRIFT_GRID},
                             "onset_error_steps": onset,
                             "onset_error_max_abs": max((abs(x) for x in onset), default=None),
                             "other_replicas_max_abs_z": max((d["max_abs_z_other_replicas"] for d in drills
                                                              if d["max_abs_z_other_replicas"] is not None), default=None),
                             "missed": [d for d in drills if not d["caught"]]},
            "spike_z": ScreeningConfig().spike_z,
            "flip_drills": {"count": len(flips), "caught": sum(r["caught"] for r in flips),
                            "bits": "each flip's bit drawn from 0-31 (replay.drill.scenario_faults), not bit 30",
                            "missed": [{"first": r["first"], "named": r["named"]} for r in flips if not r["caught"]]},
            "canary_drills": {"count": len(canaries), "caught": sum(r["caught"] for r in canaries),
                              "missed": [{"first": r["first"], "named": r["named"]} for r in canaries
                                         if not r["caught"]]},
            "noise_sigma_log_ratio_median": round(statistics.median(sigmas), 4) if sigmas else None,
            "tiny_median_step_s": round(statistics.median(step_s), 5) if step_s else None,
            "tiny_median_canary_s": round(statistics.median(canary_s), 5) if canary_s else None,
            "model": DRILL_MODEL, "steps_per_run": STEPS, "replicas": len(dr.ids),
            "tokens_per_replica_step": 2 * 64, "runs": dr.n, "wall_s": round(time.perf_counter() - t_start, 1),
            "quick": quick,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
