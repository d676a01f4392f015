"""Deterministic, checkpointable loader: packed ArrayRecord shards -> global jax.Array batches.

Public API::

    data = loader.build(mixture=..., dataset=..., global_batch=B, mesh=mesh, seed=0)
    batch = data.batch_at(step); for step, batch in data.iterate(start): ...
    state = data.state(); loader.build(..., state=state) / data.restore(state)
    data.rows_at(step), data.read_rows(step), data.metrics()
    loader.LoaderCheckpointHandler, loader.LoaderSave, loader.LoaderRestore  (Orbax)

Index arithmetic lives in :mod:`loader.index` (no JAX, no I/O).
"""

from loader.core import DataLoader, LoaderConfigError, build
from loader.index import Schedule, ScheduleError, SkipWindow
from loader.reader import BATCH_KEYS, DatasetError, dense_batch, derive_batch
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
    "dense_batch",
    "derive_batch",
]
