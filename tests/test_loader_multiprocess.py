"""A real two-process run: jax.distributed on localhost, 2 processes x 4 CPU devices, data x context mesh."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import loader
from loader import testing as lt

SEQ = 16
B = 8
STEPS = (0, 1, 5)

WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax
    port, pid, dataset, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jax.sharding import Mesh
    import loader
    from loader import testing as lt
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "context"))
    mixture = lt.synthetic_mixture({"a": 0.4, "b": 0.6}, seq_len=%(seq)d)
    data = loader.build(mixture, dataset, global_batch=%(b)d, mesh=mesh, context_axis="context")
    result = {"local_rows": data.local_rows.tolist(), "shards": []}
    for step in %(steps)r:
        batch = data.batch_at(step)
        for key, arr in batch.items():
            assert arr.shape == (%(b)d, %(seq)d)
            for shard in arr.addressable_shards:
                idx = [[s.start or 0, s.stop] for s in shard.index]
                result["shards"].append([step, key, shard.device.id, idx, np.asarray(shard.data).tolist()])
    json.dump(result, open(out, "w"))
    jax.distributed.shutdown()
    """
) % {"seq": SEQ, "b": B, "steps": STEPS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_build_the_single_process_batch(tmp_path):
    dataset = str(tmp_path / "ds")
    lt.write_synthetic_dataset(dataset, {"a": 7, "b": 13}, SEQ, shards_per_source=2)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(script), str(port), str(i), dataset, str(tmp_path / f"out{i}.json")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-process run timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "context"))
    mixture = lt.synthetic_mixture({"a": 0.4, "b": 0.6}, seq_len=SEQ)
    single = loader.build(mixture, dataset, global_batch=B, mesh=mesh, context_axis="context")
    want = {s: {k: np.asarray(v) for k, v in single.batch_at(s).items()} for s in STEPS}
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    # each process read only its own rows: half the batch each, disjoint
    assert results[0]["local_rows"] == list(range(B // 2))
    assert results[1]["local_rows"] == list(range(B // 2, B))
    covered = {(s, k): np.zeros((B, SEQ), int) for s in STEPS for k in loader.BATCH_KEYS}
    for res in results:
        for step, key, _dev, ((r0, r1), (c0, c1)), data in res["shards"]:
            np.testing.assert_array_equal(np.asarray(data), want[step][key][r0:r1, c0:c1])
            covered[(step, key)][r0:r1, c0:c1] += 1
    assert all(np.all(c == 1) for c in covered.values())  # 8 devices tile the batch exactly once
