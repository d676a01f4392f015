"""Orbax checkpoints of a run: train state (parameters, AdamW state) and loader state.

Layout: ``<run>/checkpoints/<step>/{state,loader}``; the checkpoint labelled ``step`` holds
the state *before* step ``step`` runs (after steps ``0 .. step-1``), so restoring it resumes
at ``step``. Orbax writes each checkpoint under a temporary name and renames it when
complete, so a process killed mid-save leaves no checkpoint that :func:`latest_step` or
:func:`restore` would pick (the temporary folder is removed by the next writer).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Mapping, Optional

import orbax.checkpoint as ocp

ITEMS = ("state", "loader")


def manager(directory: str, *, read_only: bool = False, max_to_keep: Optional[int] = None) -> ocp.CheckpointManager:
    """An Orbax ``CheckpointManager`` for ``directory`` (created unless ``read_only``).

    Saves are asynchronous (``enable_async_checkpointing``); call ``wait_until_finished()``
    before exit. ``read_only`` managers never write, delete or clean up (replay uses them).
    """
    with (quiet_orbax_notes() if read_only else contextlib.nullcontext()):
        return _manager(directory, read_only, max_to_keep)


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


def _manager(directory: str, read_only: bool, max_to_keep: Optional[int]) -> ocp.CheckpointManager:
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
    global restore_failed
    quiet_aborted_reads()  # a damaged checkpoint must give one clear error, not a traceback per array
    m = manager(directory, read_only=True)
    try:
        out = m.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), loader=ocp.args.JsonRestore()),
        )
    except BaseException:
        restore_failed = True
        raise
    finally:
        m.close()
    return out["state"], dict(out["loader"] or {})


restore_failed = False  # set when a restore failed: aborted reads may still call back at exit


def exit_quietly_after_failed_restore(code: int) -> None:
    """For a command's ``main``: after a failed restore, TensorStore's aborted reads print a
    traceback each while the interpreter shuts down (past any hook); the error has been reported,
    so flush and leave without that teardown. Does nothing when no restore failed."""
    if restore_failed:
        import sys

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


class _QuietStderr:
    """``sys.stderr`` for a process whose restore may fail: output of the main thread passes through
    untouched; another thread's output is collected per traceback and dropped when it is exactly the
    ``RuntimeError: Event loop is closed`` of an aborted TensorStore read (printed directly, past
    ``sys.excepthook``), else passed on."""

    _DROP = "RuntimeError: Event loop is closed"

    def __init__(self, stream):
        import threading

        self._stream = stream
        self._pending: dict[int, str] = {}
        self._main = threading.main_thread()

    def write(self, text):
        import threading

        me = threading.current_thread()
        if me is self._main:
            return self._stream.write(text)
        buf = self._pending.get(me.ident, "") + text
        out = []
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            block = self._pending.pop(("block", me.ident), None)
            if block is None and not line.startswith("Traceback (most recent call last):"):
                out.append(line + "\n")
                continue
            block = (block or "") + line + "\n"
            if line.startswith((" ", "\t", "Traceback (most recent call last):")):
                self._pending[("block", me.ident)] = block
            elif line.strip() != self._DROP:  # the exception line ends the traceback
                out.append(block)
        self._pending[me.ident] = buf
        if out:
            self._stream.write("".join(out))
        return len(text)

    def flush(self):
        import threading

        partial = self._pending.pop(threading.current_thread().ident, "")
        if partial and ("block", threading.current_thread().ident) not in self._pending:
            self._stream.write(partial)
        return self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def quiet_aborted_reads() -> None:
    """When a restore fails, TensorStore's still-running reads of the other arrays call back into
    Orbax's closed event loop and each prints a ``RuntimeError: Event loop is closed`` traceback
    (from their threads, and through ``sys.excepthook`` at exit). The failure is reported as one
    clear error: drop exactly those tracebacks, pass everything else on."""
    import sys

    if not isinstance(sys.stderr, _QuietStderr):
        sys.stderr = _QuietStderr(sys.stderr)
    previous = sys.excepthook
    if getattr(previous, "_quiet_aborted_reads", False):
        return

    def hook(kind, value, tb):
        if kind is RuntimeError and str(value) == "Event loop is closed":
            return
        previous(kind, value, tb)

    hook._quiet_aborted_reads = True
    sys.excepthook = hook



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
