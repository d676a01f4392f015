"""Quiet failures of Orbax restores: one clear error instead of a traceback per aborted read.

When an Orbax restore fails (a damaged checkpoint), TensorStore's still-running reads of the other
arrays call back into Orbax's closed event loop, and each prints a ``RuntimeError: Event loop is
closed`` traceback from its thread and at interpreter exit. Every command that restores checkpoints
(training, every ``replay`` command) reports the failure once, in its own words; these helpers drop
exactly those tracebacks. In the runtime room: a trainer's restore and replay's both need them.
"""

from __future__ import annotations

import os

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
