"""Step time of MaxText with the replay fingerprints, against without, on the tiny MoE on 4 CPU devices.

    .venv-maxtext/bin/python benchmarks/maxtext_step.py [--steps 20]

Needs MaxText (``bash scripts/setup_maxtext.sh``). The model of ``tests/test_maxtext_integration.py``
(``decoder_block=mixtral``, 4 experts, top-2, 2 layers, width 64, 128 tokens a row, data 2 x expert 2),
fed by the loader on a packed dataset written to a temporary folder. Three steps compiled in one process
and interleaved step by step (so machine load affects them alike), each on its own copy of the state:

* ``maxtext``: MaxText's own ``train_step``, jitted by MaxText (``train_utils.jit_train_and_eval_step``):
  GSPMD over the global batch, expert weights split over ``expert``;
* ``plain``: the integration's step without the probe (``make_step(..., fingerprints=False)``): the
  per-device ``shard_map`` (experts gathered), the psum, MaxText's clipping and optimizer;
* ``fingerprints``: the step the launcher trains with (``make_step``): ``plain`` plus the per-device and
  reduced fingerprints, the screening signals and the drill inputs.

Prints ONE JSON object: medians of the wall time per variant, ``fingerprints_over_maxtext`` and
``fingerprints_over_plain`` (medians of the per-round ratios), and ``uptime``.
"""

from __future__ import annotations

import argparse
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
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each variant a round)")
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

    def run(name, batch):
        t0 = time.perf_counter()
        with jax.set_mesh(ctx.mesh):
            if name == "maxtext":
                with logical_axis_rules(config.logical_axis_rules):
                    states[name], out = own(states[name], batch)
            else:
                states[name], out = (ours if name == "fingerprints" else plain)(states[name], batch, zeros5, zeros4)
        jax.block_until_ready((states[name], out))
        return time.perf_counter() - t0

    for _ in range(2):  # compile and warm
        batch = next(data)
        for name in states:
            run(name, batch)
    times = {n: [] for n in states}
    for i in range(args.steps):
        batch = next(data)
        order = list(states) if i % 2 == 0 else list(reversed(states))
        for name in order:
            times[name].append(run(name, batch))
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    result = {"benchmark": "maxtext_step", "rounds": args.steps, "devices": 4,
              "median_s": {n: round(statistics.median(v), 6) for n, v in times.items()},
              "fingerprints_over_maxtext": round(ratio("fingerprints", "maxtext"), 4),
              "fingerprints_over_plain": round(ratio("fingerprints", "plain"), 4),
              "plain_over_maxtext": round(ratio("plain", "maxtext"), 4),
              "jax": jax.__version__, "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    data.close()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
