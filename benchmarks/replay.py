"""Replay speed: replaying k steps against training the same k steps, in the same run and process.

Prints ONE JSON object:

  replay_train_ratio  replay seconds / train seconds for the same k steps (goal < 1.2).
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

Usage:  python benchmarks/replay.py [--quick] [--steps K] [--rounds R] [--seq-len L]
The dataset is synthetic (``loader.testing``); the model is the reference MoE, small; the mesh
is {data: 4, expert: 2} over the 8 (CPU) devices.
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
from loader import testing as lt
from replay.verify import engine
from replay.run import runlog
from replay.reference import run as ref_run
from replay.reference.trainer import ReferenceTrainer, make_mesh


def make_run(tmp: str, *, seq_len: int, model: dict, global_batch: int, rows: int):
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

    ref_run.train(run_dir, cfg, stop, trainer=trainer, mesh=mesh, on_step=on_step, plot=False)
    return stamps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    p.add_argument("--steps", type=int, default=None, help="k, steps replayed and trained")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds; each side's best is kept")
    p.add_argument("--seq-len", type=int, default=None)
    args = p.parse_args(argv)
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
        train_times, replay_times = [], []
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
        train_s, replay_s = min(train_times), min(replay_times)
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
            "replay_train_ratio": round(replay_s / train_s, 4),
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
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
