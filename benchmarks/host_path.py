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

Usage:  python benchmarks/host_path.py [--seq-len L] [--batch B] [--per-call K]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from loader import arrays as ar
from loader import shards as sh
from loader import testing as lt


def read_cpu(path: str, mode: str, calls: list[list[int]]) -> float:
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--per-call", type=int, default=8, help="records per batched read call")
    args = p.parse_args(argv)
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
    print(json.dumps({
        "read_cpu_us_per_record": {k: round(v, 2) for k, v in cpu.items()},
        "records_cpu_ratio": round(cpu["records"] / cpu["batched"], 3),
        "pack_ms_per_step": round(min(pack), 3),
        "transfer_ms_per_step": transfer,
        "config": {"seq_len": L, "batch": B, "per_call": args.per_call, "devices": jax.device_count()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
