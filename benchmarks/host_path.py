"""The loader's host-side costs, piece by piece (the figures behind docs/loader.md's notes).

Prints ONE JSON object:

  read_cpu_us_per_record   {"batched", "records"}: CPU microseconds (process time, all
                           threads) per record, reading ``--per-call`` random records of one
                           shard per call: ``ArrayRecordReader.read(indices)`` through
                           ArrayRecord's pool (``read_mode="batched"``) against ``seek`` +
                           ``read`` in the calling thread (``"records"``). ``records_cpu_ratio``
                           is records / batched.
  pack_ms_per_step         ``loader.arrays.pack_records(six=True)`` for ``--batch`` rows of
                           ``--seq-len`` tokens (records already read), best of 5.
  transfer_ms_per_step     ``jax.device_put`` of the six int32 arrays onto a 1-D mesh of all
                           devices, from a 64-byte-aligned pool block (what the loader does on
                           CPU devices: aliased, not copied) and from a plain ``np.empty``
                           block (16-byte aligned: copied when unaligned), median of 50.
  prefetch_us_per_item     {form: {"no_work", "work_<W>us"}: {"wall", "cpu"}}: microseconds per
                           item to hand ``--prefetch-items`` results of a function from a
                           background thread to the consumer, 2 ahead, best of 5 rounds
                           (forms alternating): ``futures`` (``loader.prefetch.Prefetch``, what
                           the loader runs) and ``grain_thread_prefetch`` (Grain's
                           ``ThreadPrefetchIterDataset`` over a ``MapDataset``), with a function
                           that returns at once and with one that holds the GIL for
                           ``--prefetch-work-us`` (as record reads do). With ``--old-tree
                           PATH`` (a checkout of an older commit, e.g. ``git worktree add
                           /tmp/old 2385607``) also ``thread_stage``: that commit's
                           ``loader.core._Stage``, measured in a child process.
                           ``prefetch_wall_ratio_vs_grain``: each form's wall time / Grain's.

Usage:  python benchmarks/host_path.py [--seq-len L] [--batch B] [--per-call K]
                                       [--prefetch-items N] [--prefetch-work-us W] [--old-tree PATH]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# HOST_PATH_TREE: the checkout whose loader a child process times (--old-tree)
sys.path.insert(0, os.environ.get("HOST_PATH_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from loader import synthetic as lt


def read_cpu(path: str, mode: str, calls: list[list[int]]) -> float:
    from loader import shards as sh

    r = sh._open_reader(path, mode)  # noqa: SLF001 - the loader's own reader options
    c0 = time.process_time()
    n = 0
    for idx in calls:
        if mode == "records":
            for i in idx:
                r.seek(i)
                r.read()
        else:
            r.read(idx)
        n += len(idx)
    return (time.process_time() - c0) / n * 1e6


def _busy(us: float) -> None:
    """Holds the GIL for ``us`` microseconds (a pure-Python wait, as a record read holds it)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def prefetch_forms(names) -> dict:
    """``name -> make(fn, n, depth)``: an iterator of ``fn(i)`` for ``i < n``, computed on a thread."""
    forms = {}
    for name in names:
        if name == "futures":
            from loader.prefetch import Prefetch

            forms[name] = lambda fn, n, depth: Prefetch(fn, range(n), depth, name="loader-bench")
        elif name == "grain_thread_prefetch":
            import grain
            from grain.experimental import ThreadPrefetchIterDataset

            opts = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # the one thread is the prefetch's
            forms[name] = lambda fn, n, depth, _opts=opts: iter(ThreadPrefetchIterDataset(
                grain.MapDataset.range(n).map(fn).to_iter_dataset(_opts), prefetch_buffer_size=depth))
        elif name == "thread_stage":  # the home-made stage of commits up to 2385607
            from loader.core import _Stage

            forms[name] = lambda fn, n, depth: iter(_Stage(lambda: map(fn, range(n)), depth, "loader-bench"))
        else:
            raise ValueError(f"unknown prefetch form {name!r}")
    return forms


def time_prefetch(names, items: int, work_us: float, rounds: int = 5) -> dict:
    """Best-of-``rounds`` wall and CPU microseconds per item of each form, the forms alternating."""
    forms = prefetch_forms(names)
    out = {}
    for label, us in (("no_work", 0.0), (f"work_{work_us:g}us", work_us)):
        fn = (lambda i, _us=us: (_busy(_us), i)[1]) if us else (lambda i: i)
        n = items if not us else max(1, items // 3)
        best = {name: [float("inf"), float("inf")] for name in forms}
        for _ in range(rounds + 1):  # the first round warms up
            for name, make in forms.items():
                t0, c0 = time.perf_counter(), time.process_time()
                it = make(fn, n, 2)
                total = sum(it)
                getattr(it, "close", lambda: None)()
                wall, cpu = (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6
                assert total == n * (n - 1) // 2, name
                best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
        for name, (wall, cpu) in best.items():
            out.setdefault(name, {})[label] = {"wall": round(wall, 2), "cpu": round(cpu, 2)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--per-call", type=int, default=8, help="records per batched read call")
    p.add_argument("--prefetch-items", type=int, default=3000, help="items per round (a third with work)")
    p.add_argument("--prefetch-work-us", type=float, default=500.0, help="GIL-holding work per item")
    p.add_argument("--old-tree", default=None, help="also time this checkout's loader.core._Stage (child process)")
    p.add_argument("--prefetch-only", default=None, help=argparse.SUPPRESS)  # the child: comma-separated forms
    args = p.parse_args(argv)
    if args.prefetch_only:
        print(json.dumps(time_prefetch(args.prefetch_only.split(","), args.prefetch_items, args.prefetch_work_us)))
        return 0
    from loader import arrays as ar
    from loader import shards as sh

    L, B = args.seq_len, args.batch
    with tempfile.TemporaryDirectory() as tmp:
        rows = max(4 * B, 4000)
        lt.write_synthetic_dataset(tmp + "/ds", {"web": rows}, L, shards_per_source=1, vocab_size=32000)
        (path,) = glob.glob(tmp + "/ds/**/*.array_record", recursive=True)
        rng = np.random.default_rng(0)
        calls = [rng.integers(0, rows, args.per_call).tolist() for _ in range(3000)]
        read_cpu(path, "batched", calls[:100])  # warm the page cache
        cpu = {m: min(read_cpu(path, m, calls) for _ in range(3)) for m in ("batched", "records")}
        reader = sh._open_reader(path, "records")  # noqa: SLF001
        steps = []
        for s in range(20):
            recs = []
            for i in range(s * B, (s + 1) * B):
                reader.seek(i % rows)
                recs.append(reader.read())
            steps.append(recs)
        pack = []
        for _ in range(5):
            t0 = time.perf_counter()
            for recs in steps:
                ar.pack_records(recs, L, 2, 0, vocab_size=32000, six=True)
            pack.append((time.perf_counter() - t0) / len(steps) * 1e3)
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        sharding = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec("data", None))
        pool = ar.AlignedPool()
        transfer = {}
        for name, make in (("aligned_pool", lambda: pool.take((6, B, L), np.int32)),
                           ("plain_numpy", lambda: np.empty((6, B, L), np.int32))):
            times = []
            for _ in range(50):
                block = make()
                block.fill(1)
                t0 = time.perf_counter()
                arrays = jax.device_put(list(block), sharding)
                jax.block_until_ready(arrays)
                times.append((time.perf_counter() - t0) * 1e3)
                del arrays, block
            transfer[name] = round(statistics.median(times), 3)
    prefetch = time_prefetch(["futures", "grain_thread_prefetch"], args.prefetch_items, args.prefetch_work_us)
    if args.old_tree:
        child = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--prefetch-only", "thread_stage",
             "--prefetch-items", str(args.prefetch_items), "--prefetch-work-us", str(args.prefetch_work_us)],
            env={**os.environ, "HOST_PATH_TREE": os.path.abspath(args.old_tree)}, capture_output=True, text=True,
            check=True)
        prefetch.update(json.loads(child.stdout.strip().splitlines()[-1]))
    grain_wall = prefetch["grain_thread_prefetch"]
    ratio = {name: {k: round(v["wall"] / grain_wall[k]["wall"], 3) for k, v in per.items()}
             for name, per in prefetch.items()}
    print(json.dumps({
        "read_cpu_us_per_record": {k: round(v, 2) for k, v in cpu.items()},
        "records_cpu_ratio": round(cpu["records"] / cpu["batched"], 3),
        "pack_ms_per_step": round(min(pack), 3),
        "transfer_ms_per_step": transfer,
        "prefetch_us_per_item": prefetch,
        "prefetch_wall_ratio_vs_grain": ratio,
        "config": {"seq_len": L, "batch": B, "per_call": args.per_call, "devices": jax.device_count(),
                   "prefetch_items": args.prefetch_items, "prefetch_work_us": args.prefetch_work_us,
                   "old_tree": args.old_tree},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
