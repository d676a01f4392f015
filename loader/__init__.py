"""Deterministic, checkpointable loader: packed ArrayRecord shards -> global jax.Array batches.

Public API::

    data = loader.build(mixture=..., dataset=..., global_batch=B, mesh=mesh, seed=0)
    batch = data.batch_at(step); for step, batch in data.iterate(start): ...
    state = data.state(); loader.build(..., state=state) / data.restore(state)
    data.rows_at(step), data.read_rows(step), data.metrics()
    loader.LoaderCheckpointHandler, loader.LoaderSave, loader.LoaderRestore  (Orbax)

The modules form a one-way chain, listed here from the bottom up: each imports only
modules listed before it, never one above it (``tests/test_loader_imports.py`` checks it;
``python tests/test_loader_imports.py`` prints the chain and the path of a step)::

    index        step -> global rows -> (phase, source, epoch, record): pure, no JAX, no I/O
    storage      datasets behind a URL: checked, then staged locally (Beam FileSystems)
    shards       ShardSet: (source, record) -> (shard, record in shard) -> bytes; read modes
    dataset      open and check a dataset: manifest, mixture, every shard -> ShardSet
    arrays       record bytes -> host arrays (pack_records: the one implementation), PackedRows
    source       StepSource: step -> this process's host arrays (index -> shards -> arrays)
    device       Placement: host arrays -> global jax.Arrays on the mesh; the jitted derive
    prefetch     computing steps ahead on background threads (concurrent.futures)
    state        LoaderState: next step + fingerprint; what-changed comparison
    data_loader  build, DataLoader: batch_at, iterate, state, restore, metrics
    checkpoint   the Orbax handler (imported on first use)
    synthetic    synthetic datasets whose every row's origin is known (drills, benchmarks, tests)
    testing      the slower reference forms tests compare against (no command imports it)
"""

from loader.arrays import BATCH_KEYS
from loader.data_loader import DataLoader, LoaderConfigError, build
from loader.index import Schedule, ScheduleError, SkipWindow
from loader.shards import DatasetError
from loader.source import RowRef
from loader.state import LoaderState, ResumeError


def __getattr__(name):  # Orbax imported only when the checkpoint API is used
    if name in ("LoaderCheckpointHandler", "LoaderSave", "LoaderRestore"):
        from loader import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")


__all__ = [
    "BATCH_KEYS",
    "DataLoader",
    "DatasetError",
    "LoaderCheckpointHandler",
    "LoaderConfigError",
    "LoaderRestore",
    "LoaderSave",
    "LoaderState",
    "ResumeError",
    "RowRef",
    "Schedule",
    "ScheduleError",
    "SkipWindow",
    "build",
]
