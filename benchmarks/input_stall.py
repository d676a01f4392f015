"""Input stalls on a slow store: the buffer drains, the wait is attributed to storage reads, goodput
charges it, and the prefetch depth and read threads from docs/loader.md's arithmetic hide it.

A loader reads a synthetic dataset through ``loader.slow_store.SlowShardSet`` (20 ms a shard
read request, one request per shard a step touches; a 500 ms burst at one read) while a trainer
loop takes ``--step-ms`` per step (a sleep: the device's step, during which an accelerator
host's CPU idles) and logs each step's input figures through the public path
(``replay.run.writer.input_signals(data.metrics())``) into a run directory; ``replay goodput``
then accounts for it. Five runs, same steps, side by side:

  baseline        no injected latency (prefetch 2, 1 read thread)
  steady_shallow  20 ms a read, prefetch 2, 1 read thread: the reads of a step take longer than
                  the step, so every step waits
  steady_hidden   20 ms a read, read threads and prefetch from the arithmetic:
                  threads >= ceil((latency x reads a step + CPU a step) / step time), depth threads + 1
  burst           steady_hidden's settings and a 500 ms burst: the buffer drains once
  burst_hidden    prefetch from the arithmetic with the burst:
                  depth >= ceil((burst + latency x reads a step + CPU a step) / step time) + 1

The first step also compiles (a sleep, logged as ``compile_s``) for as long as the deepest buffer
takes to fill, and the burst hits a read issued after that, so it meets a full buffer.

The truth is what the trainer waited (timed by its own loop around ``next()``) while the store was
sleeping (the store's own record of what it injected): the injected wait the trainer met. Prints
ONE JSON object:

  stall_attributed_fraction  over the runs that stall (steady_shallow, burst): goodput's input wait
                             charged to storage reads / the injected wait the trainer met; 1 is
                             exact (goal: near 1; above 1 by the reads' own time)
  goodput_input_error        max over those runs of |goodput's input wait - the injected wait the
                             trainer met| / the injected wait (goal <= 0.1; the loader's own CPU a
                             step is in the first and not the second)
  hidden_wait_s              what steady_hidden and burst_hidden waited after their first step
                             (which waits for the first batch: a start fills the buffer), trainer's
                             clock (goal: about 0: the arithmetic hides the latency)
  stalled_wait_s             the same for steady_shallow and burst
  recommended                the arithmetic's inputs and its threads and depth
  runs                       per run: settings, wall_s, input wait (s, by stage), drained steps,
                             exposed_s (the truth above), trainer_wait_s (all it waited, its clock)

Usage:  python benchmarks/input_stall.py [--quick] [--steps S] [--step-ms T] [--latency-ms L] [--burst-ms X]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/replay.py would shadow the replay package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import numpy as np  # noqa: E402

import loader  # noqa: E402
from loader import synthetic as lt  # noqa: E402
from loader.slow_store import SlowShardSet, overlap  # noqa: E402
from replay.run import protocol as proto  # noqa: E402
from replay.run.runlog import load_run  # noqa: E402
from replay.run.writer import RunDir, input_signals  # noqa: E402
from replay.screen import goodput as gp  # noqa: E402


def reads_per_step(data, steps) -> float:
    """Mean shard read requests a step issues: distinct (source, shard) pairs of its rows."""
    n = []
    for s in steps:
        loc = data.schedule.step_locations(s, data.local_rows)
        shard, _ = data.source.shards.locate(loc.source, loc.record)
        n.append(len(set(zip(loc.source.tolist(), shard.tolist()))))
    return float(np.mean(n))


def cpu_per_step(data, steps) -> float:
    """Median seconds of the loader's own work for a step (batch_at, no injected latency)."""
    times = []
    for s in steps:
        t0 = time.perf_counter()
        data.batch_at(s)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def train(run_dir, data, steps, step_s, warmup_s) -> float:
    """The trainer loop: ``steps`` steps of ``step_s`` each (the first also ``warmup_s``: its compilation,
    logged as ``compile_s``, while the buffer fills), logged into ``run_dir``; returns the wall s and,
    per step, the ``(t_ask, t_got)`` of the trainer's own ``next()`` on the loader (perf_counter s)."""
    rd = RunDir(run_dir, attempt=1)
    with open(rd.file(proto.RUN_CONFIG_NAME), "w") as f:
        f.write("name: input-stall\n")
    rd.write_whole(proto.ENV_NAME, json.dumps({"mesh": {"axis_names": ["data"], "shape": [1], "device_ids": [0]}}))
    launched = time.time()
    rd.event("start", 0, launched_at=round(launched, 6), tokens_per_step=data.global_batch * data.seq_len)
    t0 = time.perf_counter()
    it, asks = data.iterate(0), []
    for _ in range(steps):
        a = time.perf_counter()
        step, batch = next(it)
        asks.append((a, time.perf_counter()))  # the trainer's own clock of its wait
        c0 = time.perf_counter()
        time.sleep(step_s + (warmup_s if step == 0 else 0.0))  # the device's step (the first compiles)
        dt = time.perf_counter() - c0
        m = data.metrics()
        rd.append_fingerprints(proto.StepFingerprints(  # no model: a placeholder leaf, so the run reads
            step=step, loss_bits=0, grad_norm_bits=0, batch_hash="00", leaves={"['w']": {"fp": 0, "nan": 0, "inf": 0}},
            devices={0: {"['w']": 0}}, device_coords={0: {"data": 0}}))
        rd.append_signals(proto.StepSignals(step=step, loss=0.0, grad_norm=0.0, step_time_s=round(dt, 6),
                                            t=round(time.time(), 6), compile_s=warmup_s if step == 0 else 0.0,
                                            canary_s=0.0, checkpoint_s=0.0,
                                            tokens=data.global_batch * data.seq_len, **input_signals(m)))
        del batch
    wall = time.perf_counter() - t0
    it.close()
    rd.event("end", steps)
    return wall, asks


def run_one(name, tmp, mix, ds, B, steps, step_s, warmup_s, *, latency_s=0.0, burst=None, prefetch=2,
            read_threads=1):
    data = loader.build(mix, ds, global_batch=B, prefetch=prefetch, read_threads=read_threads, read_mode="records")
    data.batch_at(0)  # readers, caches and the transfer set up, as in a trainer's warm-up
    data.source.shards = SlowShardSet.wrap(data.source.shards, latency_s=latency_s, bursts=burst or {})
    run_dir = os.path.join(tmp, name)
    wall, asks = train(run_dir, data, steps, step_s, warmup_s)
    rep = gp.account(load_run(run_dir))
    inp = rep.input
    store = data.source.shards
    injected = sum(b - a for _, a, b in store.injected)
    # the truth: the trainer's wait (its own clock) while the store was sleeping
    exposed = sum(overlap(a, b, store.injected) for a, b in asks)
    return {"name": name, "latency_ms": latency_s * 1e3, "bursts": {str(k): v for k, v in (burst or {}).items()},
            "prefetch": prefetch, "read_threads": read_threads, "wall_s": round(wall, 4),
            "goodput_wall_s": round(rep.wall_us / 1e6, 4),
            "input_wait_s": round(rep.time_us["loader_wait"] / 1e6, 4),
            "input_wait_by_stage_s": {k: round(v / 1e6, 4) for k, v in inp["us"].items() if v},
            "drained_steps": inp["drained_steps"], "input_adds_up": inp["adds_up"],
            "store_injected_s": round(injected, 4), "exposed_s": round(exposed, 4),
            "trainer_wait_s": round(sum(b - a for a, b in asks), 4),
            "trainer_wait_after_first_step_s": round(sum(b - a for a, b in asks[1:]), 4)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--step-ms", type=float, default=50.0, help="the trainer's step time")
    p.add_argument("--latency-ms", type=float, default=20.0, help="injected seconds per shard read request")
    p.add_argument("--burst-ms", type=float, default=500.0, help="one burst at a read in the middle")
    args = p.parse_args(argv)
    steps = args.steps or (24 if args.quick else 40)  # at least the deep buffer + 16
    step_s, lat, burst_s = args.step_ms / 1e3, args.latency_ms / 1e3, args.burst_ms / 1e3
    seq_len, B = 1024, 32
    with tempfile.TemporaryDirectory() as tmp:
        ds = os.path.join(tmp, "ds")
        lt.write_synthetic_dataset(ds, {"web": 4000, "code": 2000}, seq_len, shards_per_source=4, vocab_size=32000)
        mix = lt.synthetic_mixture({"web": 0.7, "code": 0.3}, seq_len=seq_len)
        probe = loader.build(mix, ds, global_batch=B, read_mode="records")
        reads = reads_per_step(probe, range(steps))
        cpu = cpu_per_step(probe, range(steps, steps + 10))
        per_step = lat * reads + cpu  # one thread's time for a step's reads and work
        threads = max(1, math.ceil(per_step / step_s))
        depth_steady = threads + 1  # a step in flight on each thread, and one ready
        depth_burst = max(depth_steady, math.ceil((burst_s + per_step) / step_s) + 1)  # + 1: jitter
        warmup_s = (depth_burst / threads + 1) * per_step  # the first step compiles while the buffer fills
        burst = {depth_burst + 4: burst_s}  # a read issued once the buffer is full
        steps = max(steps, depth_burst + 16)
        common = (tmp, mix, ds, B, steps, step_s, warmup_s)
        runs = [
            run_one("baseline", *common),
            run_one("steady_shallow", *common, latency_s=lat),
            run_one("steady_hidden", *common, latency_s=lat, prefetch=depth_steady, read_threads=threads),
            run_one("burst", *common, latency_s=lat, burst=burst, prefetch=depth_steady, read_threads=threads),
            run_one("burst_hidden", *common, latency_s=lat, burst=burst, prefetch=depth_burst, read_threads=threads),
        ]
    by = {r["name"]: r for r in runs}
    errors = []
    for name in ("steady_shallow", "burst"):  # the runs that stall
        r = by[name]
        r["charged_error"] = round(abs(r["input_wait_s"] - r["exposed_s"]) / r["exposed_s"], 4)
        errors.append(r["charged_error"])
    stalled = [by[n] for n in ("steady_shallow", "burst")]
    out = {
        "stall_attributed_fraction": round(sum(r["input_wait_by_stage_s"].get("read", 0.0) for r in stalled)
                                           / sum(r["exposed_s"] for r in stalled), 4),
        "goodput_input_error": round(max(errors), 4),
        "hidden_wait_s": {n: by[n]["trainer_wait_after_first_step_s"] for n in ("steady_hidden", "burst_hidden")},
        "stalled_wait_s": {n: by[n]["trainer_wait_after_first_step_s"] for n in ("steady_shallow", "burst")},
        "recommended": {"latency_s": lat, "reads_per_step": round(reads, 3), "cpu_per_step_s": round(cpu, 5),
                        "step_s": step_s, "burst_s": burst_s, "read_threads": threads,
                        "prefetch_steady": depth_steady, "prefetch_burst": depth_burst, "warmup_s": round(warmup_s, 3),
                        "formula": "threads >= ceil((latency x reads + cpu) / step); depth >= threads + 1 "
                                   "(steady), ceil((burst + latency x reads + cpu) / step) + 1 (a burst)"},
        "runs": runs,
        "config": {"steps": steps, "global_batch": B, "seq_len": seq_len, "sources": {"web": 4000, "code": 2000},
                   "shards_per_source": 4, "read_mode": "records", "quick": args.quick},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
