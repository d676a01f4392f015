"""Cost of the screening signals and of the periodic canary, against the plain train step, same run.

    python benchmarks/signals.py            # demo-size model, seq_len 1024 (a few minutes on CPU)
    python benchmarks/signals.py --quick    # seq_len 256

Three variants of the reference train step, compiled in one process and interleaved step by step
(so machine load affects them alike): ``plain`` (``fingerprints=False``: no fingerprints, no
signals), ``fingerprints`` (``signals=False``) and ``all`` (the default trainer: fingerprints and
the screening signals: per-device norms before the reduction, their dots with the reduced gradient,
non-finite counts, per-layer router figures). Then the periodic canary
(``ReferenceTrainer.canary_fingerprints``: forward and backward of ``--canary-rows`` rows of
``--canary-seq-len`` slots on every device at once, as the demo's config), timed the same way.

Prints ONE JSON object: ``overhead_signals`` = median over back-to-back pairs of
(all / fingerprints) - 1; ``overhead_total`` = median of (all / plain) - 1 (the goal of issue 10:
under 0.02, what ``benchmarks/fingerprint.py``'s ``overhead`` measures too, since its trainer is
the default one); ``canary_over_step`` = median canary time / median plain step time, and
``canary_amortized`` = that over ``--canary-every`` (the demo's period): the canary's share of
training time. Wall-clock and process-CPU medians are both printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seq_len 256, fewer steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--canary-rows", type=int, default=1)
    ap.add_argument("--canary-seq-len", type=int, default=256, help="slots of each canary row (the demo's canary.seq_len)")
    ap.add_argument("--canary-every", type=int, default=10, help="the demo's canary period (configs/runs/demo.yaml)")
    args = ap.parse_args(argv)

    import jax

    from replay.reference.testing import benchmark_model_config, random_batch
    from replay.reference.trainer import OptimizerConfig, ReferenceTrainer, make_mesh

    seq_len = args.seq_len or (256 if args.quick else 1024)
    steps = args.steps or (12 if args.quick else 20)
    model = benchmark_model_config()  # the fingerprint benchmark's model
    mesh = make_mesh({"data": -1, "expert": 2 if jax.device_count() % 2 == 0 else 1})
    variants = {
        "all": ReferenceTrainer(model, OptimizerConfig()),
        "fingerprints": ReferenceTrainer(model, OptimizerConfig(), signals=False),
        "plain": ReferenceTrainer(model, OptimizerConfig(), fingerprints=False),
    }
    trainer = variants["all"]
    state = trainer.init_state(mesh, seed=0)
    batches = [random_batch(i, args.global_batch, seq_len, model.vocab_size) for i in range(4)]
    batches = [{k: jax.device_put(v, trainer.batch_sharding(mesh)) for k, v in b.items()} for b in batches]
    canary_params = trainer.init_params(mesh, 1234)
    canary_batch = {k: v[: args.canary_rows, : args.canary_seq_len]
                    for k, v in random_batch(99, args.global_batch, seq_len, model.vocab_size).items()}

    def timed(name, step):
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "canary":
            trainer.canary_fingerprints(canary_params, canary_batch)
        else:
            new_state, _ = variants[name].train_step(state, batches[step % len(batches)], step)
            jax.block_until_ready(new_state)
        return time.perf_counter() - t0, time.process_time() - c0

    t0 = time.perf_counter()
    names = ["all", "fingerprints", "plain", "canary"]
    for name in names:  # compile and warm up
        timed(name, 0)
        timed(name, 1)
    compile_s = time.perf_counter() - t0
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for i in range(steps):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
        for name in order:
            w, c = timed(name, i)
            wall[name].append(w)
            cpu[name].append(c)

    def pair(a, b, d=wall):
        return statistics.median(x / y for x, y in zip(d[a], d[b]))

    med = {n: statistics.median(wall[n]) for n in names}
    med_cpu = {n: statistics.median(cpu[n]) for n in names}
    result = {
        "benchmark": "signals",
        "overhead_signals": round(pair("all", "fingerprints") - 1, 4),
        "overhead_fingerprints": round(pair("fingerprints", "plain") - 1, 4),
        "overhead_total": round(pair("all", "plain") - 1, 4),
        "overhead_total_cpu": round(pair("all", "plain", cpu) - 1, 4),
        "canary_over_step": round(med["canary"] / med["plain"], 4),
        "canary_amortized": round(med["canary"] / (args.canary_every * med["plain"]), 4),
        "canary_amortized_cpu": round(med_cpu["canary"] / (args.canary_every * med_cpu["plain"]), 4),
        "step_s": {n: round(med[n], 5) for n in names[:3]},
        "step_cpu_s": {n: round(med_cpu[n], 5) for n in names[:3]},
        "canary_s": round(med["canary"], 5),
        "canary_cpu_s": round(med_cpu["canary"], 5),
        "canary_rows": args.canary_rows,
        "canary_seq_len": min(args.canary_seq_len, seq_len),
        "canary_every": args.canary_every,
        "reference": "the same train step compiled without fingerprints or signals, same process, interleaved",
        "timed_steps_each": steps,
        "params": sum(trainer.leaf_sizes),
        "global_batch": args.global_batch,
        "seq_len": seq_len,
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "compile_and_warmup_s": round(compile_s, 2),
        "quick": bool(args.quick),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
