"""Checkpoints you can trust: what the state fingerprint costs at a save, what single-byte bit rot does,
and what certifying a chain of checkpoints costs.

    python benchmarks/checkpoint.py              # the demo's model and mesh at seq_len 1024, 200 flips
    python benchmarks/checkpoint.py --quick      # seq_len 256, 40 flips (a smoke run, not a figure)
    python benchmarks/checkpoint.py --parts save # only the save ratio (rerun it a few times under load)

Prints ONE JSON object:

* ``save_with_fingerprint_ratio``: checkpoint save time with the state fingerprint over the save without
  it, the demo's model (configs/runs/demo.yaml: d_model 128, 2 layers, 8 experts, expert parallelism
  on a {data 2, expert 2} mesh; AdamW state) after one step. One save = the Orbax save call and the
  wait for its commit (``wait_until_finished``); with the fingerprint, also
  ``replay.run.statefp.record_state`` on the devices (every leaf, shard and replica, with NaN/Inf
  counts) and the record written beside the checkpoint, before the save (as the trainer does:
  ``non_finite: stop`` must refuse a non-finite state before Orbax can commit it). Interleaved,
  ``--saves`` triples (with, without, control; the order rotated), median of the per-triple ratios
  (goal <= 1.05). Also ``blocked_ratio``: the part the training loop waits for (the save call, which
  returns before the commit, plus the fingerprint) with over without; ``record_s``: the record's parts
  (``program``: the fingerprint program over every leaf and copy, dispatch to result on the host;
  ``host``: the record built from it; ``write``: the JSON file), medians, and ``record_over_save``,
  their sum over the save without (the ratio's expected excess, steadier than the ratio under load);
  ``save_after_record_ratio``: the save alone (the record's time taken out) after a record over the
  save without one (1 when the record does not slow the save itself; its spread shows the noise);
  ``control_ratio``: a third arm, interleaved with the two, that sleeps as long as the record took in
  warm-up (``control_pause_s``) instead of computing it: what the ratio would be if the record cost
  exactly its own time, in the same run's noise; ``fingerprint_s`` / ``step_s``: the whole record
  against one train step of the same state, and ``per_step_if_every_36``: that amortized over a
  checkpoint every 36 steps (the seed's interval), against the seed's detection budget of 0.1% of step
  time.
* ``bitrot_drills``: ``--flips`` single-byte flips (seeded: ``--seed``; mask 1<<b or 0xFF) over every file
  of checkpoint 4 of a short run of a small model (the test suite's: d_model 16; a run of its own),
  each on a fresh copy, counted as ``raised`` (Orbax or TensorStore refused the files), ``caught`` (it
  restored, and the state record named the damaged leaf and shard), ``no_effect`` (it restored, and the
  restored state is *shown* bit-identical to the intact checkpoint's, every leaf and the loader state),
  ``missed`` (it restored with other values and nothing said so; goal 0); and ``device_convicted``: a
  range replay of steps 4..5 on every damaged copy (two placements) convicting a device (goal 0).
* ``certify``: ``replay certify`` on the same small run's chain of 4 checkpoints after the first
  (0, 2, 4, 6, 8): ``certify_steps_replayed``, ``certify_wall_s`` with its placements at the same time and
  ``certify_wall_s_sequential`` one after the other.

Runs on 8 host CPU devices unless XLA_FLAGS already says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SMALL_MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "head_dim": 8, "n_experts": 2, "top_k": 1, "d_ff": 16}


def _inputs(root: str, seq_len: int, vocab: int, rows: int) -> tuple[str, str]:
    import yaml

    from contract.config import load_mixture
    from loader.synthetic import synthetic_mixture, write_synthetic_dataset

    os.makedirs(root, exist_ok=True)
    mix_path = os.path.join(root, "mixture.yaml")
    with open(mix_path, "w") as f:
        yaml.safe_dump(synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=seq_len).to_dict(), f)
    write_synthetic_dataset(os.path.join(root, "dataset"), {"a": rows, "b": rows}, seq_len=seq_len, vocab_size=vocab,
                            mixture=load_mixture(mix_path))
    return mix_path, os.path.join(root, "dataset")


def save_ratio(root: str, seq_len: int, saves: int) -> dict:
    """``save_with_fingerprint_ratio`` and its parts on the demo's model (module docstring)."""
    import jax
    import yaml

    from replay.reference import checkpoint as ckpt
    from replay.reference import run as ref_run
    from replay.run import statefp

    demo = yaml.safe_load(open(os.path.join(os.path.dirname(_HERE), "configs", "runs", "demo.yaml")))
    mix, data = _inputs(root, seq_len, 8000, 64)
    cfg = ref_run.run_config_from_dict({"name": "bench", "mixture": mix, "dataset": data, "global_batch": 8,
                                        "mesh": demo["mesh"], "model": demo["model"], "optimizer": demo["optimizer"]},
                                       root)
    trainer, mesh, _ = ref_run.make_trainer(cfg)
    state = trainer.init_state(mesh, 0)
    loader = ref_run.build_loader(cfg, mesh)
    batch = loader.batch_at(0)
    state, _ = trainer.train_step(state, batch, 0)
    jax.block_until_ready(state)
    step_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        out, _ = trainer.train_step(state, batch, 1)
        jax.block_until_ready(out)
        step_s.append(time.perf_counter() - t0)
    loader_state = loader.state().to_dict()
    mngr = ckpt.manager(os.path.join(root, "ckpt"))
    statefp.record_state(state, loader_state, 0)  # compiled once, outside the timing
    with_t, without_t, with_b, without_b, fp_t = [], [], [], [], []
    parts: dict[str, list[float]] = {"program": [], "host": [], "write": []}

    pause = [0.0]  # the control arm's stand-in for the record: a sleep of the record's warm-up time

    def one(step: int, fingerprint) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        fp_s = 0.0
        if fingerprint == "control":
            time.sleep(pause[0])
            fp_s = time.perf_counter() - t0
        elif fingerprint:
            pending = statefp.start_record(state)
            jax.block_until_ready(pending._out)
            t1 = time.perf_counter()
            rec = pending.result(loader_state, step)
            t2 = time.perf_counter()
            statefp.write_record(root, rec)
            fp_s = time.perf_counter() - t0
            for k, v in zip(parts, (t1 - t0, t2 - t1, fp_s - (t2 - t0))):
                parts[k].append(v)
        ckpt.save(mngr, step, state, loader_state)
        blocked = time.perf_counter() - t0
        mngr.wait_until_finished()
        return time.perf_counter() - t0, blocked, fp_s

    pause[0] = statistics.median(one(10_000 + k, True)[2] for k in range(3))
    one(10_003, False)  # warm both paths
    for k in parts:
        parts[k].clear()
    control_t = []
    arms = (True, False, "control")
    for i in range(saves):
        order = arms[i % 3:] + arms[:i % 3]
        order = order if i % 2 == 0 else order[::-1]
        got = {}
        for k, fingerprint in enumerate(order):
            got[fingerprint] = one(3 * i + k + 1, fingerprint)
        with_t.append(got[True][0])
        without_t.append(got[False][0])
        control_t.append(got["control"][0])
        with_b.append(got[True][1])
        without_b.append(got[False][1])
        fp_t.append(got[True][2])
    mngr.close()
    n_elems = sum(int(x.size) for x in jax.tree_util.tree_leaves(state))
    copies = sum(int(sh.data.size) for x in jax.tree_util.tree_leaves(state) for sh in x.addressable_shards)
    fp_med, step_med = statistics.median(fp_t), statistics.median(step_s)
    return {
        "save_with_fingerprint_ratio": round(statistics.median(a / b for a, b in zip(with_t, without_t)), 4),
        "blocked_ratio": round(statistics.median(a / b for a, b in zip(with_b, without_b)), 4),
        "save_s": {"with": round(statistics.median(with_t), 6), "without": round(statistics.median(without_t), 6)},
        "blocked_s": {"with": round(statistics.median(with_b), 6), "without": round(statistics.median(without_b), 6)},
        "record_s": {k: round(statistics.median(v), 6) for k, v in parts.items()},
        "record_over_save": round(fp_med / statistics.median(without_t), 4),
        "save_after_record_ratio": round(statistics.median((a - f) / b for a, f, b in zip(with_t, fp_t, without_t)), 4),
        "control_ratio": round(statistics.median(a / b for a, b in zip(control_t, without_t)), 4),
        "control_pause_s": round(pause[0], 6),
        "fingerprint_s": round(fp_med, 6), "step_s": round(step_med, 6),
        "fingerprint_over_step": round(fp_med / step_med, 5),
        "per_step_if_every_36": round(fp_med / (36 * step_med), 6),
        "state_elements": n_elems, "elements_fingerprinted": copies,  # every copy: each device reads its own
        "state_leaves": len(jax.tree_util.tree_leaves(state)), "saves": saves,
        "model": demo["model"], "mesh": demo["mesh"], "seq_len": seq_len,
        "reference": "the same Orbax save and commit, without record_state/write_record, interleaved",
    }


def small_run(root: str) -> tuple[str, object]:
    """A short run of the small model: 8 steps, checkpoints 0, 2, 4, 6, 8 (the chain to certify)."""
    import jax

    from replay.reference import run as ref_run
    from replay.reference import loop
    from replay.reference.trainer import make_mesh

    mix, data = _inputs(root, 16, 64, 40)
    cfg = ref_run.run_config_from_dict({"name": "small", "mixture": mix, "dataset": data, "global_batch": 8,
                                        "seed": 3, "mesh": {"data": 2, "expert": 2}, "model": SMALL_MODEL,
                                        "checkpoint_every": 2, "optimizer": {"warmup_steps": 2}}, root)
    trainer, _, _ = ref_run.make_trainer(cfg)
    mesh = make_mesh({"data": 2, "expert": 2}, jax.devices()[:4])
    run_dir = os.path.join(root, "run")
    import io

    loop.train(run_dir, cfg, 8, trainer=trainer, mesh=mesh,
               output=loop.Output(log=lambda s: None, plot=False, progress=io.StringIO()))
    return run_dir, trainer


def bitrot(run_dir: str, trainer, flips: int, seed: int, scratch: str) -> dict:
    import dataclasses

    from replay.run import statefp
    from replay.run.runlog import load_run
    from replay.runtime.quiet import quiet_aborted_reads
    from replay.verify import bitrot as br
    from replay.verify import engine

    quiet_aborted_reads()
    mesh = None

    def setup_for(d):
        run = load_run(d)
        return run, dataclasses.replace(engine.default_setup(run), trainer=trainer)

    run0, setup0 = setup_for(run_dir)
    mesh = engine.Session(run0, setup0).mesh((0, 1, 2, 3))

    def restore(d, step):
        return trainer.restore(d, step, mesh)

    def judge(d):
        run, setup = setup_for(d)
        try:
            rep = engine.replay_range(engine.Session(run, setup), 4, 5, allow_env_drift=True, full_comparison=False)
        except statefp.DamagedCheckpointError:
            return "damaged_checkpoint"
        except engine.CheckpointCorruptError:
            return "restore_failed"
        return rep.decision.verdict.value

    plan = br.plan_flips(os.path.join(run_dir, "checkpoints", "4"), flips, seed)
    t0 = time.perf_counter()
    res = br.run_drills(run_dir, 4, plan, restore, scratch, judge=judge)
    verdicts: dict[str, int] = {}
    for r in res["drills"]:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    return {"flips": flips, "seed": seed, **res["counts"], "device_convicted": res["device_convicted"],
            "replay_verdicts": verdicts, "files": len(br.checkpoint_files(os.path.join(run_dir, "checkpoints", "4"))),
            "wall_s": round(time.perf_counter() - t0, 2),
            "caught_examples": [r for r in res["drills"] if r["outcome"] == "caught"][:3]}


def certify_cost(run_dir: str, trainer) -> dict:
    import dataclasses

    from replay.run.runlog import load_run
    from replay.verify import certify, engine

    out = {}
    for concurrent in (True, False):
        run = load_run(run_dir)
        sess = engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=trainer))
        t0 = time.perf_counter()
        rep = certify.certify(sess, concurrent=concurrent, allow_env_drift=True)
        wall = time.perf_counter() - t0
        key = "certify_wall_s" if concurrent else "certify_wall_s_sequential"
        out[key] = round(wall, 3)
        out["certify_steps_replayed"] = rep.steps_replayed
        out["chain"] = [(v.checkpoint, v.verdict) for v in rep.chain]
        out["placements"] = rep.placements
    out["note"] = "the placements' steps are compiled by the first call (concurrent), which includes compilation"
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--flips", type=int, default=None)
    ap.add_argument("--saves", type=int, default=None)
    ap.add_argument("--seed", type=int, default=20261204)
    ap.add_argument("--parts", default="save,certify,bitrot",
                    help="comma-separated parts to run: save (the ratio), certify, bitrot (default: all three)")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"save", "certify", "bitrot"}:
        ap.error(f"--parts: a comma-separated subset of save,certify,bitrot, got {args.parts!r}")
    seq_len = 256 if args.quick else 1024
    flips = args.flips or (40 if args.quick else 200)
    saves = args.saves or (4 if args.quick else 20)
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        out = {"benchmark": "checkpoint", "uptime_load": os.getloadavg()[0]}
        if "save" in parts:
            out.update(save_ratio(os.path.join(tmp, "save"), seq_len, saves))
        if parts & {"certify", "bitrot"}:
            run_dir, trainer = small_run(os.path.join(tmp, "small"))
            if "certify" in parts:
                out["certify"] = certify_cost(run_dir, trainer)
            if "bitrot" in parts:
                out["bitrot_drills"] = bitrot(run_dir, trainer, flips, args.seed, os.path.join(tmp, "bitrot"))
        out["uptime_load_end"] = os.getloadavg()[0]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
