"""Step time of MaxText with the replay fingerprints, against without, on the tiny MoE on 4 CPU devices.

    .venv-maxtext/bin/python benchmarks/maxtext_step.py [--steps 20] [--block 5]

Needs MaxText (``bash scripts/setup_maxtext.sh``). The model of ``tests/test_maxtext_integration.py``
(``decoder_block=mixtral``, 4 experts, top-2, 2 layers, width 64, 128 tokens a row, data 2 x expert 2),
fed by the loader on a packed dataset written to a temporary folder. Three steps compiled in one process
and interleaved round by round, a block of ``--block`` steps of each a round, the order alternating (so
machine load affects them alike), each on its own copy of the state:

* ``maxtext``: MaxText's own ``train_step``, jitted by MaxText (``train_utils.jit_train_and_eval_step``):
  GSPMD over the global batch, expert weights split over ``expert``;
* ``plain``: the integration's step without the probe (``make_step(..., fingerprints=False)``): the
  per-device ``shard_map`` (experts gathered), the psum, MaxText's clipping and optimizer;
* ``fingerprints``: the step the launcher trains with (``make_step``): ``plain`` plus the per-device and
  reduced fingerprints, the screening signals and the drill inputs.

Two clocks per step: the wall time, and the process's CPU time (user + system, every thread: the
work the 4 emulated devices did, which the machine's load does not inflate). Prints ONE JSON object:
medians (over the rounds, of the mean step time of a block) per variant of both, ``fingerprints_over_maxtext``, ``fingerprints_over_plain`` and
``plain_over_maxtext`` (medians of the per-round ratios of wall times) and the same ratios of CPU
times (``cpu_*``), and ``uptime``.

Why two clocks: with 4 emulated devices on a 2-core machine shared with other jobs, the wall time of
the per-device ``shard_map`` step (each device runs its whole forward and backward pass alone, then
one reduction) depends on how the operating system interleaves XLA:CPU's threads far more than
MaxText's GSPMD step (collectives in every layer keep the devices in step) does, although both do the
same work: measured on 2026-12-06 at load averages 12 to 20, ``cpu_plain_over_maxtext`` 0.94 to 1.0
while ``plain_over_maxtext`` was 1.15 to 2.6 from one run to the next. The CPU-time ratios measure
what the fingerprints cost; the wall-time ratios what this machine made of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (a block of steps of each variant a round)")
    ap.add_argument("--block", type=int, default=5, help="steps of one variant timed together (default 5): one "
                                                         "step's time on a shared machine is too noisy to compare")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax.core.spmd import logical_axis_rules

    from integrations.maxtext import internals
    from integrations.maxtext import trainer as mtt
    from integrations.maxtext.iterator import LoaderIterator, build_loader
    from integrations.maxtext.testing import TINY, base_yml, write_dataset

    root = tempfile.mkdtemp(prefix="maxtext-bench-")
    mixture, dataset = write_dataset(root, rows=(400, 300))
    config = mtt.maxtext_config(base_yml(), [*TINY, "steps=1000", "learning_rate_schedule_steps=1000"],
                                base_output_directory=root, run_name="bench", enable_checkpointing="false")

    def make_iterator(cfg, mesh):
        return LoaderIterator(build_loader(cfg, mesh, mixture=mixture, dataset=dataset, seed=0))

    ctx = mtt.setup(config, make_iterator)
    data = ctx.iterator
    table = mtt.leaf_table(ctx.graphdef, ctx.state)
    ours = mtt.make_step(ctx, table[0])
    plain = mtt.make_step(ctx, table[0], fingerprints=False)
    own, _ = internals.get("maxtext.utils.train_utils", "jit_train_and_eval_step")(
        config, ctx.graphdef, ctx.mesh, ctx.state, ctx.state_shardings,
        internals.get("maxtext.trainers.pre_train.train", "train_step"))
    zeros5, zeros4 = np.zeros(5, np.int32), np.zeros(4, np.float32)

    def copy(tree):
        return jax.tree_util.tree_map(lambda x: x.copy() if hasattr(x, "copy") else x, tree)

    states = {"maxtext": copy(ctx.state), "plain": copy(ctx.state), "fingerprints": copy(ctx.state)}

    def run(name, batches):
        """Seconds of wall and CPU time a step, over the steps of ``batches`` (one after the other)."""
        c0, t0 = time.process_time(), time.perf_counter()
        with jax.set_mesh(ctx.mesh):
            for batch in batches:
                if name == "maxtext":
                    with logical_axis_rules(config.logical_axis_rules):
                        states[name], out = own(states[name], batch)
                else:
                    states[name], out = (ours if name == "fingerprints" else plain)(states[name], batch, zeros5,
                                                                                     zeros4)
                jax.block_until_ready((states[name], out))
        return (time.perf_counter() - t0) / len(batches), (time.process_time() - c0) / len(batches)

    warm = [next(data) for _ in range(2)]
    for name in states:  # compile and warm
        run(name, warm)
    times = {n: [] for n in states}
    cpu = {n: [] for n in states}
    for i in range(args.steps):
        batches = [next(data) for _ in range(max(1, args.block))]
        order = list(states) if i % 2 == 0 else list(reversed(states))
        for name in order:
            wall, used = run(name, batches)
            times[name].append(wall)
            cpu[name].append(used)

    def ratio(clock, a, b):
        return round(statistics.median(x / y for x, y in zip(clock[a], clock[b])), 4)

    result = {"benchmark": "maxtext_step", "rounds": args.steps, "block": args.block, "devices": 4,
              "median_s": {n: round(statistics.median(v), 6) for n, v in times.items()},
              "median_cpu_s": {n: round(statistics.median(v), 6) for n, v in cpu.items()},
              "fingerprints_over_maxtext": ratio(times, "fingerprints", "maxtext"),
              "fingerprints_over_plain": ratio(times, "fingerprints", "plain"),
              "plain_over_maxtext": ratio(times, "plain", "maxtext"),
              "cpu_fingerprints_over_maxtext": ratio(cpu, "fingerprints", "maxtext"),
              "cpu_fingerprints_over_plain": ratio(cpu, "fingerprints", "plain"),
              "cpu_plain_over_maxtext": ratio(cpu, "plain", "maxtext"),
              "jax": jax.__version__,
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    data.close()
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):  # MaxText's modules print notices on stdout: JSON alone there
        res = main()
    print(json.dumps(res))
