"""Cost of gradient fingerprints: the train step with and without them, and the fingerprint
against a sum of squares over the same gradients, same run.

    python benchmarks/fingerprint.py                # demo-size model, seq_len 1024 (a few minutes on CPU)
    python benchmarks/fingerprint.py --quick        # seq_len 256 (under a minute)
    python benchmarks/fingerprint.py --ratio-only   # only the fingerprint/reduction ratios (under a minute)
    python benchmarks/fingerprint.py --ep           # expert parallelism: dispatch all_to_all, mesh data 2 x expert 4
    python benchmarks/fingerprint.py --ep --quick   # the same at seq_len 256

Prints ONE JSON object:

* ``overhead`` = median over back-to-back pairs of (step time with fingerprints / step time
  without) - 1. The reference is the identical step compiled without fingerprinting, in the
  same process, the two interleaved so machine load affects both alike. Also the median and
  minimum step times of each, and the model and batch sizes. ``overhead_serial_bound``: the
  step's fingerprints timed apart (each device's whole local gradient without counts, plus
  the reduced gradient with them: the isolated ``step_gradients`` times below), as if run one
  after another on one core, over the fastest step without fingerprints; steadier than
  ``overhead`` on a loaded machine (it leaves out the fault injector's one-element in-place
  update and the uint32 ``psum``).
* ``fingerprint_vs_reduction_ratio``: the time to fingerprint a step's gradients (every
  leaf of one device's real local gradient, ``replay.run.fingerprint.fingerprint`` with its
  NaN/Inf counts, one jit program) divided by the time of one fused reduction over the same
  gradients (``sum(jnp.sum(jnp.square(g)))`` over the leaves, one jit program: the floor for
  a pass that must read every element), on one device, the two interleaved, median of the
  per-pair ratios. A figure that travels across hardware: on an accelerator both are bound
  by memory bandwidth and the ratio approaches 1; on a CPU the integer mixing costs compute.
  ``..._no_counts`` is the same without the NaN/Inf counts (the per-device fingerprints the
  trainer takes of local gradients); ``standalone_4m_float32`` the same two ratios on one
  array of 4M normal float32 elements.

With ``--ep`` the model's experts are on their own devices (``model.dispatch: all_to_all``, 8 experts
on a ``{data: D/4, expert: 4}`` mesh: 2 a device) and three steps are timed side by side,
interleaved: the plain step (no fingerprints, no signals), the step with the logging of a gather
run (gradient fingerprints and screening signals) but no send fingerprints, and the full step
(also each device's fingerprint of what it sends at each all-to-all, forward and backward, and
the tokens each expert device received). ``ep.added_overhead`` = median over rounds of (full /
without sends) - 1: what expert parallelism's logging adds; ``ep.overhead`` = full / plain - 1:
all of the logging. ``ep.added_overhead_serial_bound``: one device's send fingerprints of a step timed
apart (``sends_fingerprint_s_per_device``) times the devices, over the fastest step without them
(as ``overhead_serial_bound`` above; steadier on a loaded machine). ``ep.log_bytes_per_step_per_device``: how much the run log grows per step and
device, measured on the step's own JSON lines (``fingerprints.jsonl``: the send fingerprints;
``signals.jsonl``: the expert load), and the whole lines' size for scale.

Runs on 8 host CPU devices unless XLA_FLAGS already says otherwise (on GPU/TPU it uses the
accelerators that are there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# This folder holds other benchmark scripts (e.g. replay.py) that would shadow the packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def paired_ratio(f, g, arg, reps: int = 60) -> dict:
    """Times ``f(arg)`` and ``g(arg)`` (jitted) back to back ``reps`` times: the median of the
    per-pair ratios f/g, and each one's median time in seconds."""
    import jax

    for fn in (f, g):
        jax.block_until_ready(fn(arg))
    tf, tg = [], []
    for i in range(reps):
        for fn, acc in ((f, tf), (g, tg)) if i % 2 == 0 else ((g, tg), (f, tf)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            acc.append(time.perf_counter() - t0)
    return {"ratio": round(statistics.median(a / b for a, b in zip(tf, tg)), 3),
            "fingerprint_s": round(statistics.median(tf), 6), "sum_of_squares_s": round(statistics.median(tg), 6)}


def reduction_ratios(trainer, state, batch, device) -> dict:
    """``fingerprint_vs_reduction_ratio`` (and its variants) on one device: the real local
    gradient of ``batch`` there, and one array of 4M normal float32 elements."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from replay.run import fingerprint as fpm

    grads, _, _ = trainer.local_gradients(state, batch, device)
    leaves = jax.tree_util.tree_leaves(grads)

    def fingerprints(counts):
        return jax.jit(lambda t: jnp.stack([fpm.fingerprint(g, counts=counts) for g in t]))

    sum_of_squares = jax.jit(lambda t: sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in t))
    step = {c: paired_ratio(fingerprints(c), sum_of_squares, leaves) for c in (True, False)}
    x = [jax.device_put(np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32), device)]
    alone = {c: paired_ratio(fingerprints(c), sum_of_squares, x) for c in (True, False)}
    return {
        "fingerprint_vs_reduction_ratio": step[True]["ratio"],
        "fingerprint_vs_reduction_ratio_no_counts": step[False]["ratio"],
        "step_gradients": {"elements": int(sum(g.size for g in leaves)), "leaves": len(leaves),
                           "with_counts": step[True], "no_counts": step[False]},
        "standalone_4m_float32": {"elements": 1 << 22, "ratio": alone[True]["ratio"],
                                  "ratio_no_counts": alone[False]["ratio"],
                                  "with_counts": alone[True], "no_counts": alone[False]},
        "reduction_reference": "sum over leaves of jnp.sum(jnp.square(g)), one jit program, same device, "
                               "interleaved; fingerprint_version " + str(fpm.FINGERPRINT_VERSION),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sequence and few steps (< 1 minute)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--ratio-only", action="store_true", help="only the fingerprint / reduction ratios")
    ap.add_argument("--ep", action="store_true", help="expert parallelism: dispatch all_to_all on data x expert 4")
    args = ap.parse_args(argv)
    if args.ep:
        return expert_parallel(args)

    import jax

    from replay.reference.model import ModelConfig
    from replay.reference.testing import random_batch
    from replay.reference.trainer import OptimizerConfig, ReferenceTrainer, make_mesh

    seq_len = args.seq_len or (256 if args.quick else 1024)
    steps = args.steps or (16 if args.quick else 20)
    # The demo model (configs/runs/demo.yaml) with the demo tokenizer's vocabulary.
    model = ModelConfig(vocab_size=8000, d_model=128, n_layers=2, n_heads=4, head_dim=32, n_experts=8, top_k=2,
                        d_ff=256, capacity_factor=1.25)
    n_dev = jax.device_count()
    mesh = make_mesh({"data": -1, "expert": 2 if n_dev % 2 == 0 else 1})
    with_fp = ReferenceTrainer(model, OptimizerConfig())
    without = ReferenceTrainer(model, OptimizerConfig(), fingerprints=False)
    state = with_fp.init_state(mesh, seed=0)
    batches = [random_batch(i, args.global_batch, seq_len, model.vocab_size) for i in range(4)]
    ratios = reduction_ratios(with_fp, state, batches[0], jax.devices()[0])
    if args.ratio_only:
        result = {"benchmark": "fingerprint", **ratios, "params": sum(with_fp.leaf_sizes),
                  "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind}
        print(json.dumps(result))
        return result
    batches = [{k: jax.device_put(v, with_fp.batch_sharding(mesh)) for k, v in b.items()} for b in batches]

    def timed(trainer, step):
        t0 = time.perf_counter()
        new_state, fp = trainer.train_step(state, batches[step % len(batches)], step)
        jax.block_until_ready(new_state)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    for tr in (with_fp, without):  # compile and warm up
        timed(tr, 0)
        timed(tr, 1)
    compile_s = time.perf_counter() - t0
    t_with, t_without = [], []
    for i in range(steps):
        order = (with_fp, without) if i % 2 == 0 else (without, with_fp)
        for tr in order:
            (t_with if tr is with_fp else t_without).append(timed(tr, i))
    med_with, med_without = statistics.median(t_with), statistics.median(t_without)
    # Each pair ran back to back under the same machine load: the median of the per-pair
    # ratios is steadier than the ratio of medians on a shared machine.
    pair_ratio = statistics.median(a / b for a, b in zip(t_with, t_without))
    n_params = sum(with_fp.leaf_sizes)
    grad_fp = ratios["step_gradients"]
    serial_fp_s = mesh.size * grad_fp["no_counts"]["fingerprint_s"] + grad_fp["with_counts"]["fingerprint_s"]
    result = {
        "benchmark": "fingerprint",
        "overhead": round(pair_ratio - 1.0, 4),
        "overhead_serial_bound": round(serial_fp_s / min(t_without), 5),
        "ratio_with_over_without": round(pair_ratio, 4),
        "ratio_of_median_steps": round(med_with / med_without, 4),
        "step_s_with_fingerprints": round(med_with, 5),
        "step_s_without_fingerprints": round(med_without, 5),
        "min_step_s_with": round(min(t_with), 5),
        "min_step_s_without": round(min(t_without), 5),
        "reference": "the same train step compiled without fingerprints, same process, interleaved",
        **ratios,
        "timed_steps_each": steps,
        "params": n_params,
        "fingerprinted_elements_per_step": n_params * (mesh.size + 1),
        "global_batch": args.global_batch,
        "seq_len": seq_len,
        "devices": mesh.size,
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))),
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "compile_and_warmup_s": round(compile_s, 2),
        "quick": bool(args.quick),
    }
    print(json.dumps(result))
    return result


def interleaved(steps: int, variants: dict, state, batches) -> dict:
    """Each variant's train step timed ``steps`` times, round robin with the order rotated every
    round (so machine load affects all alike); returns ``{name: [seconds]}`` after two warm-ups each."""
    import jax

    def timed(trainer, step):
        t0 = time.perf_counter()
        new_state, _ = trainer.train_step(state, batches[step % len(batches)], step)
        jax.block_until_ready(new_state)
        return time.perf_counter() - t0

    names = list(variants)
    for name in names:
        timed(variants[name], 0)
        timed(variants[name], 1)
    out = {name: [] for name in names}
    for i in range(steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            out[name].append(timed(variants[name], i))
    return out


def expert_parallel(args) -> dict:
    """The ``--ep`` configuration (module docstring)."""
    import dataclasses

    import jax

    from replay.reference.testing import benchmark_model_config, random_batch
    from replay.reference.trainer import OptimizerConfig, ReferenceTrainer, make_mesh

    seq_len = args.seq_len or (256 if args.quick else 1024)
    steps = args.steps or (12 if args.quick else 20)
    model = benchmark_model_config(dispatch="all_to_all")
    n_dev = jax.device_count()
    if n_dev % 4:
        raise SystemExit(f"--ep needs a multiple of 4 devices (expert axis 4), got {n_dev}")
    mesh = make_mesh({"data": n_dev // 4, "expert": 4})
    opt = OptimizerConfig()
    variants = {"full": ReferenceTrainer(model, opt), "no_sends": ReferenceTrainer(model, opt, sends=False),
                "plain": ReferenceTrainer(model, opt, fingerprints=False)}
    state = variants["full"].init_state(mesh, seed=0)
    sh = variants["full"].batch_sharding(mesh)
    batches = [{k: jax.device_put(v, sh) for k, v in random_batch(i, args.global_batch, seq_len, model.vocab_size).items()}
               for i in range(4)]
    t0 = time.perf_counter()
    times = interleaved(steps, variants, state, batches)
    loop_s = time.perf_counter() - t0

    def ratio(a, b):
        return round(statistics.median(x / y for x, y in zip(times[a], times[b])) - 1.0, 4)

    per_site = _send_elements(model, mesh, args.global_batch, seq_len) // (4 * model.n_layers)
    sends_alone = _sends_alone_s(per_site, 4 * model.n_layers, jax.devices()[0])
    _, fp = variants["full"].train_step(state, batches[0], 0)
    lean = dataclasses.replace(fp, send_sites=(), sends={})
    sig = fp.signals
    fp_bytes, lean_bytes = len(fp.to_json()) + 1, len(lean.to_json()) + 1
    sig_bytes, sig_lean = len(sig.to_json()) + 1, len(dataclasses.replace(sig, expert_load=()).to_json()) + 1
    result = {
        "benchmark": "fingerprint", "configuration": "expert_parallel",
        "ep": {
            "added_overhead": ratio("full", "no_sends"),
            "overhead": ratio("full", "plain"),
            "overhead_without_sends": ratio("no_sends", "plain"),
            # the send fingerprints of a step timed apart, as if the devices ran them one after another
            # on one core, over the fastest step without them: steadier than added_overhead under load
            "added_overhead_serial_bound": round(mesh.size * sends_alone / min(times["no_sends"]), 5),
            "sends_fingerprint_s_per_device": round(sends_alone, 6),
            "step_s": {k: round(statistics.median(v), 5) for k, v in times.items()},
            "min_step_s": {k: round(min(v), 5) for k, v in times.items()},
            "log_bytes_per_step_per_device": {
                "sends": round((fp_bytes - lean_bytes) / mesh.size, 1),
                "expert_load": round((sig_bytes - sig_lean) / mesh.size, 1),
                "fingerprints_line": round(fp_bytes / mesh.size, 1), "signals_line": round(sig_bytes / mesh.size, 1),
            },
            "send_sites": len(fp.send_sites),
            "send_elements_per_device_per_step": _send_elements(model, mesh, args.global_batch, seq_len),
            "reference": "the same step compiled without the send fingerprints (and without any logging), same "
                         "process, interleaved round robin",
        },
        "timed_steps_each": steps, "params": sum(variants["full"].leaf_sizes), "global_batch": args.global_batch,
        "seq_len": seq_len, "devices": mesh.size,
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))),
        "model": {"n_experts": model.n_experts, "top_k": model.top_k, "capacity_factor": model.capacity_factor,
                  "dispatch": model.dispatch},
        "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
        "loop_s": round(loop_s, 1), "quick": bool(args.quick),
    }
    print(json.dumps(result))
    return result


def _sends_alone_s(elements: int, sites: int, device, reps: int = 20) -> float:
    """Median seconds of one device's send fingerprints of a step (``sites`` buffers of ``elements``
    normal float32 values, one jit program, as the step computes them: lanes only, no counts)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from replay.run import fingerprint as fpm

    rng = np.random.default_rng(0)
    bufs = [jax.device_put(rng.standard_normal(elements).astype(np.float32), device) for _ in range(sites)]
    fn = jax.jit(lambda bs: jnp.stack([fpm.fingerprint(b, counts=False)[:2] for b in bs]))
    jax.block_until_ready(fn(bufs))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(bufs))
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _send_elements(model, mesh, global_batch: int, seq_len: int) -> int:
    """Elements each device fingerprints per step at its sends: 4 buffers per layer of ``[E, B, C, D]``."""
    rows = global_batch // mesh.size
    return 4 * model.n_layers * model.n_experts * rows * model.capacity(seq_len) * model.d_model


if __name__ == "__main__":
    main(sys.argv[1:])
