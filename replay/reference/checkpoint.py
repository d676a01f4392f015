"""Orbax checkpoints of a run: train state (parameters, AdamW state) and loader state.

Layout: ``<run>/checkpoints/<step>/{state,loader}``; the checkpoint labelled ``step`` holds
the state *before* step ``step`` runs (after steps ``0 .. step-1``), so restoring it resumes
at ``step``. Orbax writes each checkpoint under a temporary name and renames it when
complete, so a process killed mid-save leaves no checkpoint that :func:`all_steps` or
:func:`restore` would pick (the temporary folder is removed by the next writer).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Iterator, Mapping, Optional

import orbax.checkpoint as ocp

from replay.runtime import quiet
from replay.runtime.quiet import quiet_aborted_reads

ITEMS = ("state", "loader")


def manager(directory: str, *, read_only: bool = False, max_to_keep: Optional[int] = None,
            processes: Optional[Iterable[int]] = None) -> ocp.CheckpointManager:
    """An Orbax ``CheckpointManager`` for ``directory`` (created unless ``read_only``).

    Saves are asynchronous (``enable_async_checkpointing``); call ``wait_until_finished()``
    before exit. ``read_only`` managers never write, delete or clean up (replay uses them).
    ``processes``: for a read-only manager in a multi-process job, the processes that restore
    together (those of the target mesh); Orbax's barriers then wait for them only, so that
    placements on other processes restore on their own (``MultiprocessingOptions.active_processes``).
    Default: every process.
    """
    with (quiet_orbax_notes() if read_only else contextlib.nullcontext()):
        return _manager(directory, read_only, max_to_keep, processes)


@contextlib.contextmanager
def quiet_orbax_notes() -> Iterator[None]:
    """Raises the ``absl`` logger (Orbax logs through it) to ERROR while the block runs, then puts
    its level back: a read-only manager logs two WARNING notes on every creation
    (``read_only=True, setting save_interval_steps=0``, ``Given directory is read only``), which are
    what was asked for, not news. Errors still show."""
    logger = logging.getLogger("absl")
    level = logger.level
    if logger.getEffectiveLevel() < logging.ERROR:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_RESTORES: dict[tuple[int, ...], int] = {}  # restores per set of processes: unique, agreed barrier names


def _manager(directory: str, read_only: bool, max_to_keep: Optional[int],
             processes: Optional[Iterable[int]] = None) -> ocp.CheckpointManager:
    import jax

    extra = {}
    if read_only and processes is not None and jax.process_count() > 1:
        active = tuple(sorted(set(int(p) for p in processes)))
        _RESTORES[active] = _RESTORES.get(active, 0) + 1  # the same count on each of them: they restore in step
        extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
            primary_host=active[0], active_processes=set(active),
            barrier_sync_key_prefix=f"restore-{'-'.join(map(str, active))}-{_RESTORES[active]}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=not read_only,
        **extra,
    )
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=ITEMS)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, loader_state: Mapping[str, Any]) -> bool:
    """Starts saving ``state`` and ``loader_state`` (JSON) as checkpoint ``step``; returns whether it saved."""
    return mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), loader=ocp.args.JsonSave(dict(loader_state))),
        force=True,
    )


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
    quiet_aborted_reads()  # a damaged checkpoint must give one clear error, not a traceback per array
    import jax

    shardings = [x.sharding for x in jax.tree_util.tree_leaves(abstract_state) if getattr(x, "sharding", None)]
    processes = {d.process_index for sh in shardings[:1] for d in sh.device_set}
    m = manager(directory, read_only=True, processes=processes or None)
    try:
        out = m.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), loader=ocp.args.JsonRestore()),
        )
    except BaseException:
        quiet.restore_failed = True
        raise
    finally:
        m.close()
    return out["state"], dict(out["loader"] or {})


def is_committed(directory: str, step: int) -> bool:
    """Whether checkpoint ``step`` under ``directory`` has committed (Orbax's own test,
    ``orbax.checkpoint.path.step.is_path_finalized``: on a local file system the temporary
    ``<step>.orbax-checkpoint-tmp-*`` folder has been renamed to ``<step>``; on object stores
    ``<step>/commit_success.txt`` exists). A save still in flight, or one killed or failed
    before its commit, is not committed."""
    path = os.path.join(directory, str(step))
    if not os.path.isdir(path):
        return False
    return bool(ocp.path.step.is_path_finalized(path))


def commit_time(mngr: ocp.CheckpointManager, step: int) -> Optional[float]:
    """Unix seconds at which checkpoint ``step`` committed: Orbax's own record
    (``StepMetadata.commit_timestamp_nsecs`` in ``<step>/_CHECKPOINT_METADATA``, written at the commit), or
    None where it recorded none."""
    try:
        ns = mngr.metadata(step).commit_timestamp_nsecs
    except (FileNotFoundError, ValueError, KeyError, AttributeError, OSError):
        return None
    return None if ns is None else ns / 1e9
