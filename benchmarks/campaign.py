"""An honest fault campaign: verdicts measured on faults the checker does not look at (issue 27).

    python benchmarks/campaign.py                 # >= 1000 drills over the grid, 200 clean replays here and 60
                                                  # in other processes, 20 drift drills
    python benchmarks/campaign.py --quick         # the quick grid (quick_grid; the JSON's "grid" says what it
                                                  # covers), 20 clean replays here, 3 in another process, 10 drift
    python benchmarks/campaign.py --png FILE      # the matrix as a labeled PNG (default campaign.png)
    python benchmarks/campaign.py --rows R.jsonl  # every drill's row as it runs; --from-rows R.jsonl: summarize
                                                  # the rows of an interrupted run (exactly what ran)

Two real training runs of the reference trainer with expert parallelism (``model.dispatch:
all_to_all``, the tiny model with 4 experts, top-2, capacity factor 2, checkpoints every 4 steps, a periodic
canary every 4), one on ``{data: 2, expert: 4}`` and one on ``{data: 4, expert: 2}`` of 8 CPU devices. On
each, drills from ``replay.verify.faults``: every site of ``CAMPAIGN_SITES`` (inside the FFN matmuls forward
and backward, inside attention, the router logits, the received buffer of each all-to-all forward and
backward, the host batch, one device's copy of a leaf of the updated state; none of them a buffer the checker
fingerprints next) x every magnitude class (bit classes low / mid / high mantissa 0-7 / 8-15 / 16-22,
exponent 23-30, sign 31; scales x(1+1e-6), x(1+1e-3), x(1+1e-1), x2) x persistence (once, or every step of a
3-step segment), the device, layer, element and bit drawn from ``--seed`` (seeds no test uses: the tests use
0-99 and 27xx). Each drill trains its segment from a checkpoint with the fault on the run's mesh (one compiled
step, reused by every drill), and:

* masked: no fingerprint of any device changed AND the state after the segment is compared with the
  clean run's, every element of every device's copy bit for bit (``masked_shown_identical``);
* otherwise its judge: a range replay of the fault's first step on two independent placements (right
  device, or link, or data for the host batch, alone / right plus others / wrong / missed); for
  ``optimizer_update``, whose step's gradients are right, ``replay certify``'s verdict on the next
  checkpoint save from the state record of the state being saved (``faults.run_state_drill``);
* detected by screening (``replay scan`` of the drilled logs), by the canary (persistent faults in a
  chip's arithmetic, which fire in the canary program too) and by range replay, each counted apart.

Clean replays, every conviction a false one, each kind counted apart (``clean``): random steps of both runs
in this process (``same_shape``: two placements each, the run's device order and a rotation); each run
replayed with a set-up of the other run's mesh shape (``cross_shape``: refused before any work, see
``replay.verify.engine.check_mesh_shape``); and in other processes whose threads differ
(``threads``, :data:`THREAD_VARIANTS`: 1 CPU, 16 devices and threads, Eigen single-threaded).

Drift drills (``--drift``) for the expert-device screening (issue 27 item 4): one expert device's experts'
output x(1 + delta) at every step from a random step on, delta from the fixed grid ``DRIFT_GRID``; judged by
``replay scan`` (named within 20 steps by ``expert_drift``, alone or, on two data replicas, as the pair of
twins, with no suspect of healthy devices only), by its output-per-token statistic alone (the probes removed:
``scan_expert_drift_statistic_named_fraction``, the floor ``floor`` is that statistic's), by the next periodic
canary (``canary_expert_drift_named_fraction``) and by a range replay targeted at the scan's onset
(``targeted_replay_right_fraction``: the device alone at the drift's first step).

Prints ONE JSON object with ``unmasked_right_alone_fraction``, ``false_convictions``,
``masked_shown_identical``, ``transit_link_named_fraction``, ``scan_expert_drift_named_fraction`` (over
drifts at or above ``floor``), ``floor``, the matrix, the failures, and each phase's wall and CPU seconds
with the load average; progress goes to stderr.
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


def _layout(session) -> dict:
    return dict(zip(session.setup.axis_names, (int(n) for n in session.setup.shape)))


def _without_probes(signals: dict) -> dict:
    """``signals`` with every ``ExpertLoad.probe`` removed: what ``expert_drift``'s statistic alone sees."""
    import dataclasses

    return {s: dataclasses.replace(v, expert_load=tuple(dataclasses.replace(L, probe={}) for L in v.expert_load))
            for s, v in signals.items()}


def _next_canary_names(folder: str, start: int, device: int) -> tuple:
    """``(step, named alone)``: the first periodic canary at or after ``start`` in the drilled run, and whether
    it named ``device`` and only it."""
    from replay.run.protocol import read_canary

    recs = [c for c in read_canary(folder) if c.step >= start]
    if not recs:
        return None, False
    first = min(c.step for c in recs)
    odd = sorted(c.device for c in recs if c.step == first and c.status != "ok")
    return first, odd == [device]


def _targeted_replay(session, folder: str, scan: dict, start: int, device: int) -> dict:
    """Range replay of the drilled run from the onset ``replay scan`` reported (its range first, the rest after
    unless the first round convicts), on two placements: right when it convicts ``device`` alone at the drift's
    first step ``start``."""
    import dataclasses

    from replay.run.runlog import load_run
    from replay.verify import engine, plan

    onset = scan.get("onset")
    if not onset:
        return {"right": False, "why": "no onset"}
    run = load_run(folder)
    lo, hi = (int(x) for x in onset["range"])
    o = plan.Onset(int(onset["step"]), lo, hi, f"scan: {onset.get('check')}")
    first = max([c for c in run.checkpoints if c <= lo] or [min(run.checkpoints)])
    sess = engine.Session(run, dataclasses.replace(session.setup))
    rep = engine.replay_range(sess, first, run.logged_steps[1], device_spec="all", allow_env_drift=True,
                              full_comparison=False, onset=o)
    d = rep.decision
    return {"right": d.verdict.value == "convicted" and list(d.devices) == [device] and d.step == start,
            "verdict": d.verdict.value, "devices": list(d.devices), "step": d.step,
            "steps_replayed": sum(len(r.fingerprints) for r in rep.replays)}


def drift_drills(sessions, rng, count: int, steps: int, root: str) -> list[dict]:
    """Expert-device drift drills (module docstring), ``delta`` cycling through ``DRIFT_GRID``, the layouts
    alternating; each drifts from a step drawn in ``[steps - 23, steps - 20]`` (its checkpoint segment's first
    step or later) to the end, so a drill the scan names is named within 20 steps of the drift's start.
    Judged four ways: ``replay scan`` (every check; ``caught`` by ``expert_drift`` with no suspect of healthy
    devices only, ``replay.drill.judge_scan``), its statistic alone (the probes removed), the next periodic
    canary, and a range replay targeted at the scan's onset."""
    from replay import drill
    from replay.run.protocol import read_signals
    from replay.run.runlog import load_run
    from replay.screen.scan import expert_drift_scope, scan_run

    out = []
    for i in range(count):
        session = sessions[(i // len(DRIFT_GRID)) % len(sessions)]
        delta = DRIFT_GRID[i % len(DRIFT_GRID)]
        dev = rng.choice(list(session.setup.run_device_ids))
        start = steps - 20 - rng.randrange(4)
        folder = os.path.join(root, f"drift-{i}")
        res = drill.run_scenario(session, "expert_drift", folder, rng=random.Random(SEED + i), device=dev,
                                 start=start, magnitude=delta)
        run = load_run(folder)
        stop = start + 20  # the scan sees the 20 steps from the drift's start, no more
        scan = scan_run(run, stop=stop).to_dict()
        sig = {k: v for k, v in _without_probes(read_signals(folder)).items() if k < stop}
        stat = scan_run(run, stop=stop, screening_logs=(sig, None)).to_dict()
        canary_step, canary_named = _next_canary_names(folder, start, dev)
        suspects = [x for x in scan.get("suspects", []) if x["kind"] in ("device", "replica")]
        judge = lambda sc, wider=(), dev=dev, start=start, res=res: drill.judge_scan(sc, "expert_drift", dev, start,  # noqa: E731
                                                      drill.DRIFT_TOLERANCE, resolution=res.resolution + wider)
        coords = {int(d): dict(c) for d, c in (session.run.mesh.get("device_coords") or {}).items()}
        scope = tuple(sorted(expert_drift_scope(sorted(coords), coords, dev)))
        out.append({"layout": _layout(session), "delta": delta, "device": dev, "start": start,
                    "steps_scanned_after_start": stop - start,
                    "caught": judge(scan), "named_alone": drill.named_alone(scan, dev, ("expert_drift",)),
                    # the statistic alone names the scope a finding can point at (scan.expert_drift_scope)
                    "statistic_caught": judge(stat, (scope,)),
                    "canary_step": canary_step, "canary_named_alone": canary_named,
                    "healthy_only_suspects": [x["devices"] for x in suspects if dev not in x["devices"]],
                    "targeted_replay": _targeted_replay(session, folder, scan, start, dev),
                    "suspects": [(x["devices"], [e["check"] for e in x["evidence"]]) for x in suspects],
                    "onset": scan.get("onset")})
        shutil.rmtree(folder, ignore_errors=True)
    return out


THREAD_VARIANTS = {
    "cpu1": {"xla": "--xla_force_host_platform_device_count=8", "taskset": "0", "allow_env_drift": False,
             "what": "the replay process pinned to 1 CPU (taskset -c 0; the run had 2): XLA:CPU's intra-op pool is "
                     "the larger of CPUs and local devices, 8 as in the run"},
    "devices16": {"xla": "--xla_force_host_platform_device_count=16", "taskset": None, "allow_env_drift": False,
                  "what": "16 host devices: a pool of 16 intra-op threads (the run: 8), and the second placement "
                          "on devices 8-15, disjoint from the run's"},
    "eigen1": {"xla": "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false", "taskset": None,
               "allow_env_drift": True,
               "what": "Eigen's matrix products single-threaded (--xla_cpu_multi_thread_eigen=false): another XLA "
                       "flag, refused as environment drift unless --allow-env-drift, here given"},
}
"""Clean replays in another process whose threads differ from the training run's (``--thread-variants``)."""


def clean_worker(run_dir: str, steps: list[int], allow_env_drift: bool) -> dict:
    """Clean replays of ``steps`` of ``run_dir`` in this process (its XLA flags and CPUs): one record per step,
    the product's own set-up (the run's trainer factory) on every device; printed as JSON by ``--clean-worker``.
    With ``allow_env_drift`` the first step is also tried without it (``refused_without``: the differences)."""
    from replay.run.runlog import load_run
    from replay.verify import engine

    session = engine.Session(load_run(run_dir))
    out, refused = [], None
    if allow_env_drift and steps:
        try:
            engine.replay_range(session, steps[0], steps[0] + 1, device_spec="all", full_comparison=False, onset=None)
        except engine.EnvDriftError as e:
            refused = e.differences
    for s in steps:
        try:
            rep = engine.replay_range(session, s, s + 1, device_spec="all", full_comparison=False, onset=None,
                                      allow_env_drift=allow_env_drift)
        except engine.EnvDriftError as e:
            out.append({"step": s, "verdict": "refused", "why": e.differences})
            continue
        d = rep.decision
        out.append({"step": s, "verdict": d.verdict.value, "cause": d.cause.value, "devices": list(d.devices),
                    "links": [list(x) for x in d.links], "evidence": d.evidence.value,
                    "placements": [list(r.assignment) for r in rep.replays]})
    from replay.run import env as envmod
    import jax

    return {"replays": out, "refused_without": refused, "cpu_threads": envmod.cpu_threads(jax.local_device_count()),
            "devices": jax.device_count()}


def thread_replays(sessions, rng, variants: list[str], per_run: int) -> dict:
    """Clean replays of random steps of each run in a subprocess per (variant, run) (:data:`THREAD_VARIANTS`)."""
    import subprocess

    out = {}
    for name in variants:
        v = THREAD_VARIANTS[name]
        if v["taskset"] is not None and shutil.which("taskset") is None:
            out[name] = {"what": v["what"], "skipped": "no taskset command on this machine"}
            continue
        rows, meta = [], []
        for session in sessions:
            first, stop = session.run.logged_steps
            steps = sorted(rng.sample(range(first, stop), min(per_run, stop - first)))
            cmd = [sys.executable, os.path.abspath(__file__), "--clean-worker", session.run.run_dir,
                   "--worker-steps", ",".join(map(str, steps))] + (["--allow-env-drift"] if v["allow_env_drift"] else [])
            if v["taskset"] is not None:
                cmd = ["taskset", "-c", v["taskset"]] + cmd
            env = dict(os.environ, XLA_FLAGS=v["xla"])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"clean worker {name} failed ({done.returncode}): {done.stderr[-2000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            rows += [dict(r, layout=_layout(session)) for r in got["replays"]]
            meta.append({"layout": _layout(session), "cpu_threads": got["cpu_threads"], "devices": got["devices"],
                         "refused_without_allow_env_drift": got["refused_without"]})
        out[name] = {"what": v["what"], "xla_flags": v["xla"], "taskset": v["taskset"],
                     "allow_env_drift": v["allow_env_drift"], "processes": meta, **_clean_counts(rows),
                     "replays": rows}
    return out


def _clean_counts(rows: list[dict]) -> dict:
    from collections import Counter

    return {"count": len(rows), "verdicts": dict(Counter(r["verdict"] for r in rows)),
            "false_convictions": sum(r["verdict"] == "convicted" for r in rows),
            "devices_named": sorted({d for r in rows for d in r.get("devices", [])})}


def cross_shape(sessions) -> list[dict]:
    """Each run replayed with a set-up of the other run's mesh shape: what the product does (it refuses before
    any work, ``replay.verify.engine.check_mesh_shape``; a verdict would be a false one)."""
    import dataclasses

    from replay.verify import compare, engine

    out = []
    for i, session in enumerate(sessions):
        other = sessions[(i + 1) % len(sessions)]
        if other.setup.shape == session.setup.shape:
            continue
        setup = dataclasses.replace(session.setup, shape=other.setup.shape, axis_names=other.setup.axis_names)
        s = session.run.logged_steps[0]
        try:
            rep = engine.replay_range(engine.Session(session.run, setup), s, s + 1, device_spec="all",
                                      allow_env_drift=True, full_comparison=False, onset=None)
            out.append({"run": _layout(session), "replayed_as": _layout(other), "verdict": rep.decision.verdict.value,
                        "devices": list(rep.decision.devices)})
        except compare.PairingError as e:
            out.append({"run": _layout(session), "replayed_as": _layout(other), "verdict": "refused", "why": str(e)})
    return out


def matrix_png(matrix: dict, path: str, title: str) -> str:
    """The site x magnitude matrix as a heat map: colour the fraction of unmasked drills convicted right
    alone; each cell says ``right/unmasked`` and ``m`` the masked count (grey: every drill masked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from replay.verify.faults import CAMPAIGN_SITES, JUDGE, MAGNITUDES

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
    ax.set_yticks(range(len(sites)), [f"{x} (judge: {JUDGE[x]})" if x in JUDGE else x for x in sites], fontsize=8)
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
                 for k in ("screening", "canary", "range", "state_record", "certify")}
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


class _Clock:
    """Wall and CPU seconds of each phase (CPU: this process's threads and its finished children's)."""

    def __init__(self):
        self.phases: dict[str, dict[str, float]] = {}

    @staticmethod
    def _cpu() -> float:
        import resource

        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + ch.ru_utime + ch.ru_stime

    def start(self):
        return time.perf_counter(), self._cpu()

    def stop(self, name: str, t) -> None:
        got = self.phases.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0})
        got["wall_s"] = round(got["wall_s"] + time.perf_counter() - t[0], 1)
        got["cpu_s"] = round(got["cpu_s"] + self._cpu() - t[1], 1)


def quick_grid(rng: random.Random) -> list[tuple]:
    """The quick campaign's drills (``--quick``): on the first layout every (site, magnitude class) cell once,
    persistence alternating once / every in the seeded order; on the second, 24 cells of the grid drawn."""
    plan = []
    for n, cell in enumerate(grid(rng, 1, ("once",))):
        plan.append((0, cell[0], cell[1], "every" if n % 2 else "once"))
    plan += [(1, *c) for c in grid(rng, 1, ("once",))[:24]]
    return plan


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the short campaign (module docstring)")
    ap.add_argument("--per-cell", type=int, default=3, help="drills per (site, magnitude, persistence) on the "
                    "first layout (default 3; the second layout gets one)")
    ap.add_argument("--clean", type=int, default=200, help="clean replays in this process (default 200; --quick: 20)")
    ap.add_argument("--thread-variants", default=None,
                    help=f"comma-separated clean-replay variants in other processes, of {', '.join(THREAD_VARIANTS)} "
                         "(default: all; --quick: eigen1 on the first layout); 'none' for none")
    ap.add_argument("--thread-steps", type=int, default=10,
                    help="clean replays per (variant, run) in those processes (default 10; --quick: 3)")
    ap.add_argument("--drift", type=int, default=20, help="expert-device drift drills (default 20; --quick: 10)")
    ap.add_argument("--steps", type=int, default=40, help="training steps of each run (default 40)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many fault drills (a partial run)")
    ap.add_argument("--png", default="campaign.png", help="where to write the matrix (default campaign.png)")
    ap.add_argument("--rows", default=None, help="also write every drill's row as JSON lines here")
    ap.add_argument("--from-rows", default=None, metavar="FILE",
                    help="no drills: summarize the rows an earlier (possibly interrupted) run wrote with --rows, "
                         "and draw its matrix; prints what those rows hold, nothing else")
    ap.add_argument("--clean-worker", default=None, metavar="RUN_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--worker-steps", default="", help=argparse.SUPPRESS)
    ap.add_argument("--allow-env-drift", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.clean_worker:
        got = clean_worker(args.clean_worker, [int(x) for x in args.worker_steps.split(",") if x], args.allow_env_drift)
        print(json.dumps(got, default=str))
        return got
    if args.from_rows:
        return summarize_rows(args.from_rows, args.png)
    import jax

    from replay.run.codes import Verdict
    from replay.runtime.progress import step_progress
    from replay.screen.scan import EXPERT_DRIFT_FLOOR, scan_run
    from replay.verify import engine
    from replay.verify import faults as fm

    assert FLOOR == EXPERT_DRIFT_FLOOR, "the campaign judges the floor replay scan states"
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    clock = _Clock()
    root = tempfile.mkdtemp(prefix="campaign-bench-")
    rng = random.Random(args.seed)
    if args.quick:
        plan = quick_grid(rng)
        args.clean, args.drift = min(args.clean, 20), min(args.drift, 10)
        variants = args.thread_variants or "eigen1"
        args.thread_steps = min(args.thread_steps, 3)
        coverage = ("layout 0: every site x every magnitude class once (one element, device, layer and bit each, "
                    "persistence alternating once / every); layout 1: 24 cells drawn; clean: 20 in-process replays, "
                    "the cross-shape attempts, and eigen1 in another process on layout 0; 10 drift drills (each "
                    "delta of the grid on each layout)")
    else:
        plan = [(0, *c) for c in grid(rng, args.per_cell, ("once", "every"))]
        plan += [(1, *c) for c in grid(rng, 1, ("once", "every"))]
        variants = args.thread_variants or ",".join(THREAD_VARIANTS)
        coverage = (f"layout 0: every site x magnitude class x persistence {args.per_cell} times; layout 1: each "
                    f"once; clean: {args.clean} in-process replays, the cross-shape attempts, "
                    f"{args.thread_steps} per run in each thread variant; {args.drift} drift drills")
    variants = [] if variants == "none" else [v for v in variants.split(",") if v]
    bad = [v for v in variants if v not in THREAD_VARIANTS]
    if bad:
        ap.error(f"--thread-variants: unknown {bad}; choose from {', '.join(THREAD_VARIANTS)}")
    if args.limit is not None:
        plan = plan[:args.limit]
    rows, sessions = [], []
    out_rows = open(args.rows, "w", encoding="utf-8") if args.rows else None
    try:
        for i, mesh in enumerate(LAYOUTS):
            t = clock.start()
            sessions.append(train_run(root, mesh, args.steps, f"L{i}"))
            clock.stop(f"train_L{i}", t)
        contexts = [fm.DrillContext(s, scan=scan_run) for s in sessions]
        t = clock.start()
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
        clock.stop("drills", t)
        t = clock.start()
        same = []
        with step_progress("clean replays", 0, args.clean, unit="replay", counted=True) as shown:
            for n in range(args.clean):
                session = sessions[n % len(sessions)]
                first_step, stop = session.run.logged_steps
                s = rng.randrange(first_step, stop)
                rep = engine.replay_range(session, s, s + 1, device_spec="all", full_comparison=False, onset=None)
                same.append({"layout": LAYOUTS[n % len(sessions)], "step": s, "verdict": rep.verdict.value,
                             "devices": list(rep.decision.devices), "links": [list(x) for x in rep.decision.links],
                             "placements": [list(r.assignment) for r in rep.replays]})
                shown.update(n + 1)
        crossed = cross_shape(sessions)
        clock.stop("clean_same_shape", t)
        t = clock.start()
        threads = thread_replays(sessions[:1] if args.quick else sessions, rng, variants, args.thread_steps)
        clock.stop("clean_threads", t)
        t = clock.start()
        drifts = drift_drills(sessions, rng, args.drift, args.steps, root) if args.drift else []
        clock.stop("drift", t)
        clean_scans = {json.dumps(LAYOUTS[i]): {k: scan_run(s.run).checks[k] for k in ("expert_drift", "norm_drift")}
                       for i, s in enumerate(sessions)}
    finally:
        if out_rows:
            out_rows.close()
        shutil.rmtree(root, ignore_errors=True)
    summary = fm.summarize(rows)
    at_floor = [d for d in drifts if d["delta"] >= FLOOR]
    frac = lambda xs, key: (sum(bool(key(d)) for d in xs) / len(xs)) if xs else None  # noqa: E731
    per_delta = {str(x): {"drills": sum(d["delta"] == x for d in drifts),
                          "scan_named": sum(d["caught"] for d in drifts if d["delta"] == x),
                          "statistic_named": sum(d["statistic_caught"] for d in drifts if d["delta"] == x),
                          "canary_named": sum(d["canary_named_alone"] for d in drifts if d["delta"] == x),
                          "targeted_replay_right": sum(d["targeted_replay"]["right"] for d in drifts
                                                       if d["delta"] == x)} for x in DRIFT_GRID}
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
                 for k in ("screening", "canary", "range", "state_record", "certify")}
    detection["canary_tried"] = sum((r.get("detected") or {}).get("canary") is not None for r in rows)
    state_rows = [r for r in rows if r.get("judge") == "certify"]
    clean = {"same_shape": {"what": "in this process, the run's XLA flags and threads; each replay on two placements "
                                    "(the run's device order and a rotation: every device at another position)",
                            **_clean_counts(same)},
             "cross_shape": {"what": "each run replayed with a set-up of the other run's mesh shape",
                             "attempts": crossed, "refused": sum(c["verdict"] == "refused" for c in crossed),
                             "false_convictions": sum(c["verdict"] == "convicted" for c in crossed)},
             "threads": threads}
    false_convictions = (clean["same_shape"]["false_convictions"] + clean["cross_shape"]["false_convictions"]
                         + sum(v.get("false_convictions", 0) for v in threads.values()))
    title = (f"fault campaign: {summary['drills']} drills ({summary['masked']} masked, shown bit-identical: "
             f"{summary['masked_shown_identical']}), layouts data2xexpert4 + data4xexpert2, seed {args.seed}")
    png = matrix_png(summary["matrix"], args.png, title) if rows else None
    result = {
        "benchmark": "campaign",
        "quick": bool(args.quick),
        "grid": coverage,
        "unmasked_right_alone_fraction": summary["unmasked_right_alone_fraction"],
        "false_convictions": false_convictions,
        "clean_replays": len(same) + sum(v.get("count", 0) for v in threads.values()),
        "masked_shown_identical": summary["masked_shown_identical"],
        "transit_link_named_fraction": summary["transit_link_named_fraction"],
        "scan_expert_drift_named_fraction": frac(at_floor, lambda d: d["caught"]),
        "scan_expert_drift_named_alone_fraction": frac(at_floor, lambda d: d["named_alone"]),
        "scan_expert_drift_statistic_named_fraction": frac(at_floor, lambda d: d["statistic_caught"]),
        "scan_suspects_of_healthy_devices_only": sum(bool(d["healthy_only_suspects"]) for d in drifts),
        "canary_expert_drift_named_fraction": frac(drifts, lambda d: d["canary_named_alone"]),
        "targeted_replay_right_fraction": frac([d for d in drifts if d["caught"]],
                                               lambda d: d["targeted_replay"]["right"]),
        "floor": FLOOR,
        "floor_probe": "one bit of an expert device's output for the probe token (compared with its twins')",
        "drift_grid": list(DRIFT_GRID),
        "drift_per_delta": per_delta,
        "optimizer_update": {"judge": "replay certify's verdict on the next checkpoint save (state record: every "
                                      "replica of every leaf)",
                             "drills": len(state_rows),
                             "outcomes": {o: sum(r["outcome"] == o for r in state_rows) for o in fm.OUTCOMES},
                             "leaf_named": sum(bool(r.get("leaf_named")) for r in state_rows
                                               if r["outcome"] != "masked")},
        "drills": summary["drills"], "masked": summary["masked"], "unmasked": summary["unmasked"],
        "outcomes": summary["outcomes"],
        "detected_unmasked": detection,
        "by_layout": by_layout, "by_persistence": by_persistence,
        "failures": [r for r in rows if r["outcome"] in ("wrong", "missed", "right_plus_others")][:40],
        "clean": clean,
        "clean_not_acquitted": [c for c in same if c["verdict"] != Verdict.ACQUITTED.value],
        "drift_missed": [d for d in drifts if not d["caught"]],
        "drift_drills": drifts,
        "clean_runs_scan": clean_scans,
        "matrix": summary["matrix"],
        "png": png,
        "layouts": list(LAYOUTS), "model": EP_MODEL, "steps": args.steps, "segment": SEGMENT, "seed": args.seed,
        "devices": jax.device_count(), "platform": jax.devices()[0].platform,
        "phases": clock.phases, "wall_s": round(time.perf_counter() - t_start, 1),
        "cpu_s": round(sum(p["cpu_s"] for p in clock.phases.values()), 1),
        "load_avg_start": [round(x, 1) for x in load_start], "load_avg_end": [round(x, 1) for x in os.getloadavg()],
    }
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
