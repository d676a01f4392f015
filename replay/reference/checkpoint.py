"""Orbax checkpoints of a run: train state (parameters, AdamW state) and loader state.

Layout: ``<run>/checkpoints/<step>/{state,loader}``; the checkpoint labelled ``step`` holds
the state *before* step ``step`` runs (after steps ``0 .. step-1``), so restoring it resumes
at ``step``. Orbax writes each checkpoint under a temporary name and renames it when
complete, so a process killed mid-save leaves no checkpoint that :func:`latest_step` or
:func:`restore` would pick (the temporary folder is removed by the next writer).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import orbax.checkpoint as ocp

ITEMS = ("state", "loader")


def manager(directory: str, *, read_only: bool = False, max_to_keep: Optional[int] = None) -> ocp.CheckpointManager:
    """An Orbax ``CheckpointManager`` for ``directory`` (created unless ``read_only``).

    Saves are asynchronous (``enable_async_checkpointing``); call ``wait_until_finished()``
    before exit. ``read_only`` managers never write, delete or clean up (replay uses them).
    """
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=not read_only,
    )
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=ITEMS)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, loader_state: Mapping[str, Any]) -> bool:
    """Starts saving ``state`` and ``loader_state`` (JSON) as checkpoint ``step``; returns whether it saved."""
    return mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(dict(loader_state))),
        force=True,
    )


def latest_step(directory: str) -> Optional[int]:
    """The latest complete checkpoint's step under ``directory``, or ``None``."""
    if not os.path.isdir(directory):
        return None
    m = manager(directory, read_only=True)
    try:
        return m.latest_step()
    finally:
        m.close()


def all_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints under ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    m = manager(directory, read_only=True)
    try:
        return sorted(m.all_steps())
    finally:
        m.close()


def restore(directory: str, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Reads checkpoint ``step`` onto the shardings of ``abstract_state`` (read-only).

    Args:
      directory: ``<run>/checkpoints``.
      step: a complete checkpoint's step.
      abstract_state: ``jax.ShapeDtypeStruct`` tree with shardings
        (``ReferenceTrainer.abstract_state(mesh)``); a different mesh than the one saved is
        fine (Orbax reshards).

    Returns:
      ``(state, loader_state_dict)``.

    Raises:
      FileNotFoundError: no complete checkpoint at ``step`` (the message lists those present).
    """
    steps = all_steps(directory)
    if step not in steps:
        raise FileNotFoundError(f"no complete checkpoint at step {step} under {directory}; present: {steps}")
    m = manager(directory, read_only=True)
    try:
        out = m.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), loader=ocp.args.JsonRestore()),
        )
    finally:
        m.close()
    return out["state"], dict(out["loader"] or {})
