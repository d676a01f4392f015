"""Replay speed: replaying k steps against training the same k steps, in the same run and process.

Prints ONE JSON object:

  replay_train_ratio  seconds to replay the same k steps on the two independent placements a verdict needs
                      (at the same time, as range replay runs them) / train seconds (goal < 1.2);
                      replay_one_placement_train_ratio: one placement's, the figure before issue 27.
                      train: ``replay.reference.run.train`` resuming the run at checkpoint c and
                      training steps c..c+k; timed from the ``on_step`` call of step c to that
                      of step c+k (per-step timestamps: k steps), so process start, restore,
                      the first step and the final checkpoint save are excluded; the loop's own
                      loader prefetch, fingerprint logging and any checkpoint inside the window
                      are included.
                      replay: ``replay.verify.engine.Session.run_steps`` over the same k steps c+1..c+k
                      from the state after step c on the run's own mesh: batches rebuilt with ``batch_at``, train
                      step, and the comparison with the logged fingerprints of every step.
                      Both sides use one trainer whose step is already compiled, so compile time
                      is reported apart (``replay_compile_s``), as is the checkpoint restore
                      (``restore_s``). Best of ``--rounds`` alternating rounds per side.
  late_early_ratio    mean seconds of ``batch_at(step)`` for late steps (10**7 ..) / for early
                      steps (1 ..): a batch is a pure function of the step, so the goal is ~1.
  train_s, replay_s, restore_s, replay_compile_s, batch_early_ms, batch_late_ms, k, mesh, ...

Targeted and concurrent replay (issue 19; ``--part targeted`` / ``--part concurrent`` alone):

  targeted            a run with checkpoints every K steps (``checkpoint_every``), 4 segments, mesh
                      {data: 2, expert: 2} on devices 0-3 (the demo's), replayed on 0-3 and 4-7:
    flip.steps_replayed_to_verdict   steps each placement replayed of the whole range [0, end) before the
                      conviction of one bit-30 flip in device 2's local gradient (``replay drill --scenario
                      flip --flips 1 --bit 30``, written as a run), targeted at the onset ``replay scan``
                      found in that run (suspects.json; never the planted step), against
                      ``exhaustive_steps`` (every segment); goal <= K + 1 per placement.
    drift.steps_replayed_to_verdict  the same for a drift drill (device 1's local gradient x2 from its
                      step on, ``--scenario drift --magnitude 1``), with the planted and the found onset.
  concurrent_wall_ratio  wall seconds of a 4-segment range replayed on 2 placements concurrently
                      (threads over disjoint devices) over the same replay run sequentially, on
                      1-device meshes (goal <= 0.65 on 2 cores); ``concurrent_wall_ratio_demo_mesh``: the
                      same on the demo's 4-device mesh. Compiled and restored once before timing; best
                      of ``--rounds`` alternating rounds.

Usage:  python benchmarks/replay.py [--quick] [--part all|ratio|targeted|concurrent] [--steps K]
        [--rounds R] [--seq-len L]
The dataset is synthetic (``loader.synthetic``); the model is the reference MoE, small; the mesh
is {data: 4, expert: 2} over the 8 (CPU) devices (the ratio), as said above otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# This file is named like the package it measures: keep its folder off the import path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]

import jax
import yaml

from contract.config import load_mixture
from loader import synthetic as lt
from replay.verify import engine
from replay.run import runlog
from replay.reference import loop
from replay.reference import run as ref_run
from replay.reference.trainer import ReferenceTrainer, make_mesh


def make_run(tmp: str, *, seq_len: int, model: dict, global_batch: int, rows: int):
    os.makedirs(tmp, exist_ok=True)
    mix = lt.synthetic_mixture({"web": 0.7, "code": 0.3}, seq_len=seq_len)
    mix_path = os.path.join(tmp, "mixture.yaml")
    with open(mix_path, "w") as f:
        yaml.safe_dump(mix.to_dict(), f)
    ds = os.path.join(tmp, "dataset")
    lt.write_synthetic_dataset(ds, {"web": rows, "code": rows // 2}, seq_len, shards_per_source=2, vocab_size=512,
                               mixture=load_mixture(mix_path))
    return ref_run.run_config_from_dict(
        {"name": "bench", "mixture": mix_path, "dataset": ds, "global_batch": global_batch, "seed": 0,
         "mesh": {"data": 4, "expert": 2}, "model": model, "checkpoint_every": 10_000}, tmp)


def timed_train(run_dir, cfg, stop, trainer, mesh) -> dict[int, float]:
    stamps: dict[int, float] = {}

    def on_step(step: int, loss: float) -> None:
        stamps[step] = time.perf_counter()

    loop.train(run_dir, cfg, stop, trainer=trainer, mesh=mesh, output=loop.Output(on_step=on_step, plot=False))
    return stamps


def targeted(tmp: str, quick: bool) -> dict:
    """Steps replayed to a verdict targeted at the onset ``replay scan`` found: a flip drill and a drift drill,
    each written as a run, on a run of 4+ checkpoint segments (module docstring)."""
    import random

    from replay import drill
    from replay.screen import scan

    every, seq_len = 8, (32 if quick else 64)
    model = {"d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16, "n_experts": 4, "top_k": 2, "d_ff": 64,
             "capacity_factor": 2.0}
    cfg = make_run(os.path.join(tmp, "t"), seq_len=seq_len, model=model, global_batch=8, rows=600)
    cfg = dataclasses.replace(cfg, mesh=(("data", 2), ("expert", 2)), checkpoint_every=every)
    run_dir = os.path.join(tmp, "t", "run")
    loop.train(run_dir, cfg, 6 * every,
               output=loop.Output(log=lambda s: None, plot=False, progress=open(os.devnull, "w")))
    session = engine.Session(runlog.load_run(run_dir))
    out = {"checkpoint_every": every, "segments": 6, "placements": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    def scanned(scenario: str, planted: int, **kw):
        """A screening drill written as a run, every checkpoint of the run before the fault copied in (the
        states are the same), ``replay scan`` of it (its onset in suspects.json), and the range replay of
        the whole ``[0, end)`` that targets the scan's onset (issue 27: the onset is what scan reports,
        never the planted step)."""
        scen = drill.run_scenario(session, scenario, os.path.join(tmp, "t", scenario), rng=random.Random(1),
                                  device=kw.pop("device"), start=planted, **kw)
        for c in session.run.checkpoints:
            dst = os.path.join(scen.run_dir, "checkpoints", str(c))
            if c < planted and not os.path.exists(dst):
                shutil.copytree(os.path.join(session.run.run_dir, "checkpoints", str(c)), dst)
        found = scan.scan_run(runlog.load_run(scen.run_dir))
        scan.write_suspects(found)
        target = engine.Session(runlog.load_run(scen.run_dir), session.setup)
        end = target.run.logged_steps[1]
        rep = engine.replay_range(target, 0, end, device_spec="all", allow_env_drift=True)  # onset: suspects.json
        full = engine.replay_range(target, 0, end, device_spec="all", allow_env_drift=True, onset=None,
                                   exhaustive=True)
        return {"planted_onset": planted, "scan_onset": found.onset, "verdict": rep.verdict.value,
                "convicted": list(rep.decision.devices), "first_divergent_step": rep.decision.step,
                "replayed_range": [0, end], "steps_replayed_to_verdict": rep.steps_per_placement(),
                "unreplayed_segments": rep.to_dict()["unreplayed_segments"],
                "exhaustive_steps": full.steps_per_placement(), "exhaustive_verdict": full.verdict.value}

    # flip: one flip of bit 30 (the exponent's top bit: what norm screening can see) in one element of device
    # 2's local gradient; drift: device 1's local gradient x2 from its step on
    out["flip"] = scanned("flip", 2 * every + 3, device=2, flips=1, bit=30)
    out["drift"] = scanned("drift", 2 * every + 2, device=1, magnitude=1.0)
    worst = max(max(out["flip"]["steps_replayed_to_verdict"].values()),
                max(out["drift"]["steps_replayed_to_verdict"].values()))
    out["goal"] = f"steps_replayed_to_verdict <= checkpoint_every + 1 = {every + 1} per placement: " \
                  f"{'met' if worst <= every + 1 else 'NOT met'} (worst {worst})"
    return out


def concurrent(tmp: str, quick: bool, rounds: int) -> dict:
    """Wall time of a 4-segment range on 2 placements, concurrent over sequential (module docstring)."""
    every = 2 if quick else 4
    model = ({"d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16, "n_experts": 4, "top_k": 2, "d_ff": 64}
             if quick else
             {"d_model": 64, "n_layers": 2, "n_heads": 4, "head_dim": 16, "n_experts": 4, "top_k": 2, "d_ff": 128})
    seq_len = 64 if quick else 256
    out = {"segments": 4, "checkpoint_every": every, "model": model, "seq_len": seq_len}
    for name, mesh, spec in (("one_device_mesh", (("data", 1), ("expert", 1)), "0-1"),
                             ("demo_mesh", (("data", 2), ("expert", 2)), "all")):
        cfg = make_run(os.path.join(tmp, name), seq_len=seq_len, model=model, global_batch=8, rows=600)
        cfg = dataclasses.replace(cfg, mesh=mesh, checkpoint_every=every)
        run_dir = os.path.join(tmp, name, "run")
        loop.train(run_dir, cfg, 4 * every,
                   output=loop.Output(log=lambda s: None, plot=False, progress=open(os.devnull, "w")))
        session = engine.Session(runlog.load_run(run_dir))
        for flag in (True, False):  # compile and restore once per placement
            engine.replay_range(session, 0, 4 * every, device_spec=spec, onset=None, concurrent=flag)
        walls, cores = {True: [], False: []}, {True: [], False: []}
        for _ in range(rounds):
            for flag in (True, False):
                c0, t0 = os.times(), time.perf_counter()
                rep = engine.replay_range(session, 0, 4 * every, device_spec=spec, onset=None, concurrent=flag)
                walls[flag].append(time.perf_counter() - t0)
                c1 = os.times()
                cores[flag].append((c1.user - c0.user + c1.system - c0.system) / walls[flag][-1])
                assert rep.verdict.value == "acquitted", rep.decision.explanation
        out[name] = {"placements": [p["devices"] for p in rep.placements], "concurrent_s": round(min(walls[True]), 4),
                     "sequential_s": round(min(walls[False]), 4),
                     "ratio": round(min(walls[True]) / min(walls[False]), 4),
                     # cores busy (process CPU seconds / wall seconds): one placement alone already keeps
                     # more than one core busy when XLA:CPU's intra-op threads run its ops
                     "cores_busy": {"concurrent": round(statistics.median(cores[True]), 2),
                                    "sequential": round(statistics.median(cores[False]), 2)},
                     "rounds_s": {"concurrent": [round(x, 4) for x in walls[True]],
                                  "sequential": [round(x, 4) for x in walls[False]]}}
    out["concurrent_wall_ratio"] = out["one_device_mesh"]["ratio"]
    out["concurrent_wall_ratio_demo_mesh"] = out["demo_mesh"]["ratio"]
    out["goal"] = "concurrent_wall_ratio <= 0.65 on 2 cores (1-device meshes)"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    p.add_argument("--part", choices=("all", "ratio", "targeted", "concurrent"), default="all",
                   help="which measurements (default all)")
    p.add_argument("--steps", type=int, default=None, help="k, steps replayed and trained")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds; each side's best is kept")
    p.add_argument("--seq-len", type=int, default=None)
    args = p.parse_args(argv)
    if args.part != "ratio":
        with tempfile.TemporaryDirectory() as tmp:
            extra = {}
            if args.part in ("all", "targeted"):
                extra["targeted"] = targeted(tmp, args.quick)
            if args.part in ("all", "concurrent"):
                c = concurrent(tmp, args.quick, args.rounds or (2 if args.quick else 3))
                extra.update(concurrent_wall_ratio=c.pop("concurrent_wall_ratio"),
                             concurrent_wall_ratio_demo_mesh=c.pop("concurrent_wall_ratio_demo_mesh"), concurrent=c)
        if args.part != "all":
            print(json.dumps({"benchmark": "replay", "quick": bool(args.quick), "part": args.part, **extra}))
            return 0
    else:
        extra = {}
    k = args.steps or (8 if args.quick else 30)
    rounds = args.rounds or (2 if args.quick else 3)
    seq_len = args.seq_len or (64 if args.quick else 256)
    model = ({"d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16, "n_experts": 4, "top_k": 2, "d_ff": 64}
             if args.quick else
             {"d_model": 64, "n_layers": 2, "n_heads": 4, "head_dim": 16, "n_experts": 4, "top_k": 2, "d_ff": 128})
    B = 16
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_run(tmp, seq_len=seq_len, model=model, global_batch=B, rows=2000)
        from loader.dataset import read_manifest

        vocab = int(read_manifest(cfg.dataset)[0].tokenizer["vocab_size"])
        trainer = ReferenceTrainer(cfg.model_config(vocab), cfg.optimizer)
        mesh = make_mesh(dict(cfg.mesh))
        base = os.path.join(tmp, "base")
        # The run: steps 0..k (checkpoints at 0 and k+1); compiles the step once.
        timed_train(base, cfg, k + 1, trainer, mesh)
        run = runlog.load_run(base)
        session = engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=trainer))
        home = session.home_assignment()
        t0 = time.perf_counter()
        session.restore(0, home)
        restore_s = time.perf_counter() - t0
        # Replay compile on a fresh trainer (what a replay process pays once), reported apart.
        fresh = ReferenceTrainer(cfg.model_config(vocab), cfg.optimizer)
        t0 = time.perf_counter()
        fresh.train_step(session.restore(0, home), session.batch(0, home), 0)
        compile_s = time.perf_counter() - t0
        # The second placement a verdict needs (replay.runtime.devices.independent_assignments), compiled once.
        from concurrent.futures import ThreadPoolExecutor

        from replay.runtime import devices as dv

        places = [tuple(a) for a in dv.independent_assignments(sorted(session.jax_devices), session.setup.mesh_size, 2)]
        for pl in places:
            session.run_steps(pl, 0, 2, log=run.fingerprints)
        train_times, replay_times, two_times = [], [], []
        for r in range(rounds):
            # train: a copy of the run cut back to checkpoint 0, resumed for steps 0..k (k+1 step lines);
            # the window is from step 0's line to step k's line: steps 1..k, k steps.
            rd = os.path.join(tmp, f"train{r}")
            os.makedirs(os.path.join(rd, "checkpoints"))
            for name in ("run_config.yaml", "env.json"):
                shutil.copy(os.path.join(base, name), rd)
            shutil.copytree(os.path.join(base, "checkpoints", "0"), os.path.join(rd, "checkpoints", "0"))
            stamps = timed_train(rd, cfg, k + 1, trainer, mesh)
            train_times.append(stamps[k] - stamps[0])
            # replay: the same steps 1..k from the state after step 0, compared with the log.
            _, _, kept = session.run_steps(home, 0, 1, log=run.fingerprints, keep_state_at=0)
            state1 = kept[0]
            session._states[(1, tuple(home))] = state1  # replay from "checkpoint" 1: the state after step 0
            session._batches.clear()
            t0 = time.perf_counter()
            _, diffs, _ = session.run_steps(home, 1, k + 1, log=run.fingerprints)
            replay_times.append(time.perf_counter() - t0)
            if not all(d.ok for d in diffs) or len(diffs) != k:
                print(f"replay did not reproduce the run: {[d.to_dict() for d in diffs if not d.ok][:1]}",
                      file=sys.stderr)
                return 1
            # the two placements a verdict needs, at the same time (as replay_range runs them)
            for pl in places:
                session._states[(1, pl)] = session.run_steps(pl, 0, 1, keep_state_at=0)[2][0]
            session._batches.clear()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=2) as pool:
                done = [f.result() for f in [pool.submit(session.run_steps, pl, 1, k + 1, log=run.fingerprints)
                                             for pl in places]]
            two_times.append(time.perf_counter() - t0)
            if not all(d.ok for _, diffs2, _ in done for d in diffs2):
                print("a placement did not reproduce the run", file=sys.stderr)
                return 1
        # batch rebuild: early vs late steps, fresh loader, alternating, best of rounds
        data = session.setup.make_loader(mesh)
        data.batch_at(0)
        early_steps = list(range(1, 11))
        late_steps = [10**7 + s for s in range(10)]
        early, late = [], []
        for _ in range(max(3, rounds)):
            for steps, acc in ((early_steps, early), (late_steps, late)):
                t0 = time.perf_counter()
                for s in steps:
                    jax.block_until_ready(data.batch_at(s))
                acc.append((time.perf_counter() - t0) / len(steps))
        train_s, replay_s, two_s = min(train_times), min(replay_times), min(two_times)
        out = {
            "benchmark": "replay",
            "quick": bool(args.quick),
            "k": k,
            "devices": jax.device_count(),
            "mesh": {"data": 4, "expert": 2},
            "global_batch": B,
            "seq_len": seq_len,
            "model": model,
            "train_s": round(train_s, 4),
            "replay_s": round(replay_s, 4),
            "replay_train_ratio": round(two_s / train_s, 4),
            "replay_s_two_placements": round(two_s, 4),
            "placements": [list(pl) for pl in places],
            "replay_one_placement_train_ratio": round(replay_s / train_s, 4),
            "restore_s": round(restore_s, 4),
            "replay_compile_s": round(compile_s, 3),
            "batch_early_ms": round(1e3 * min(early), 3),
            "batch_late_ms": round(1e3 * min(late), 3),
            "late_early_ratio": round(min(late) / min(early), 4),
            "late_step": late_steps[0],
            "rounds": rounds,
            "train_rounds_s": [round(t, 4) for t in train_times],
            "replay_rounds_s": [round(t, 4) for t in replay_times],
            "median_ratio": round(statistics.median(replay_times) / statistics.median(train_times), 4),
            "goal": "replay_train_ratio < 1.2; late_early_ratio ~ 1",
            **extra,
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
