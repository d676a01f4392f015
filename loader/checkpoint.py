"""Orbax integration: the loader state saved beside the model in one ``CheckpointManager`` step.

Modelled on Grain's ``grain.checkpoint.CheckpointHandler``: a handler with ``save`` and
``restore`` plus ``ocp.args`` classes registered for it, so::

    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                            loader=loader.LoaderSave(data.state())))
    restored = mngr.restore(step, args=ocp.args.Composite(state=..., loader=loader.LoaderRestore()))
    data = loader.build(..., state=restored.loader)

The state is global (the same on every process), so process 0 writes ``loader_state.json``
and every process reads it back: a resume under a different number of hosts works.

May import: ``loader.state`` (and Orbax, JAX); ``loader/__init__`` imports it on first use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from loader.state import LoaderState

STATE_FILE = "loader_state.json"


class LoaderCheckpointHandler(ocp.CheckpointHandler):
    """Saves and restores a :class:`LoaderState` (or a ``DataLoader``'s state) as JSON."""

    def save(self, directory: epath.Path, *args, **kwargs):
        a = kwargs.get("args") or (args[0] if args else None)
        item = a.item if a is not None else kwargs.get("item")
        state = item.state() if hasattr(item, "state") and callable(item.state) else item
        if not isinstance(state, LoaderState):
            raise TypeError(f"LoaderSave needs a LoaderState or a DataLoader, got {type(item).__name__}")
        import jax

        if jax.process_index() == 0:
            (epath.Path(directory) / STATE_FILE).write_text(state.to_json())

    def restore(self, directory: epath.Path, *args, **kwargs) -> LoaderState:
        a = kwargs.get("args") or (args[0] if args else None)
        path = epath.Path(directory) / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(f"no loader state at {path}")
        state = LoaderState.from_json(path.read_text())
        target = getattr(a, "item", None)
        if target is not None and hasattr(target, "restore"):
            target.restore(state)
        return state

    def metadata(self, directory: epath.Path) -> Any | None:
        return None

    def finalize(self, directory: epath.Path):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_save=True)
@dataclasses.dataclass
class LoaderSave(ocp.args.CheckpointArgs):
    """Save args: ``item`` is a :class:`LoaderState` or a ``DataLoader``."""

    item: Any


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class LoaderRestore(ocp.args.CheckpointArgs):
    """Restore args: ``item`` optionally a ``DataLoader`` to restore into; returns the state."""

    item: Any = None
