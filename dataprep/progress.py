"""Progress of a packing run: heartbeats from the workers, a monitor in the driver.

Beam's local runner (FnApiRunner) runs the whole pipeline inside ``Pipeline.run()`` and
reports counters only when it has finished, and its ``multi_processing`` workers are other
processes. So on local runners each DoFn instance writes a small *heartbeat* file (its
cumulative counts as JSON, replaced atomically at most every ``HEARTBEAT_S`` seconds and at
the end of each bundle) into a folder on the driver's machine, and the driver's
:class:`Monitor` sums them. On a distributed runner the pipeline runs asynchronously and
the monitor polls the Beam counters instead (:meth:`Monitor.poll_metrics`).

What is shown: on a terminal, a Rich progress bar per step (bytes read of the listed input
bytes, then shards written); otherwise one plain line every ``interval`` seconds, e.g.::

    pack: read 52.1 MB of 100.0 MB (52%), 3,214 documents, 23.9 M tokens, 5.6 M tokens/s, ETA 9 s
    pack: wrote 2 of 4 shards, 2,810 rows, 23.0 M tokens, ETA 2 s

and, as each step ends, its duration::

    pack: read and tokenize done in 10.4 s (45.9 M tokens, 4.4 M tokens/s)

Counts from a bundle that failed and was retried are counted twice here (never in the
manifest): the monitor is a view, the ledger is the record.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import threading
import time
import uuid
from typing import Callable, Iterator, Mapping, Optional, TextIO

from common.progress import duration, print_line, rich_bar, stop_bar

HEARTBEAT_S = 0.5
READ, TOKENIZE, PACK = "read", "tokenize", "pack"


class Heartbeat:
    """Cumulative counts of one DoFn instance, written to ``<folder>/<stage>-<id>.json``.

    ``folder`` is ``None`` on distributed runners: then every method does nothing.
    """

    def __init__(self, folder: Optional[str], stage: str):
        self._path = None if folder is None else os.path.join(folder, f"{stage}-{os.getpid()}-{uuid.uuid4().hex}.json")
        self._stage = stage
        self._counts: dict[str, int] = {}
        self._first: Optional[float] = None
        self._last_write = 0.0

    def add(self, **counts: int) -> None:
        if self._path is None:
            return
        if self._first is None:
            self._first = time.time()
        for k, v in counts.items():
            self._counts[k] = self._counts.get(k, 0) + int(v)
        if time.monotonic() - self._last_write >= HEARTBEAT_S:
            self.write()

    def write(self) -> None:
        """Writes the counts now (atomically: a temporary name, then ``os.replace``)."""
        if self._path is None or self._first is None:
            return
        data = {"stage": self._stage, "first": self._first, "last": time.time(), **self._counts}
        tmp = self._path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self._path)
        except OSError:  # the driver removed the folder (run over): progress is best effort
            return
        self._last_write = time.monotonic()


HEARTBEAT_PREFIX = "dataprep-progress-"


def heartbeat_folder() -> str:
    """Creates this run's heartbeat folder, ``<tmp>/dataprep-progress-<pid>-<random>``.

    First removes the folders of runs whose process is gone (killed: they could not remove
    their own); the pid in the name tells them apart from those of runs still going.
    """
    import shutil
    import tempfile

    for path in glob.glob(os.path.join(tempfile.gettempdir(), HEARTBEAT_PREFIX + "*-*")):
        pid = os.path.basename(path)[len(HEARTBEAT_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (PermissionError, OverflowError):  # another user's live process, or not a pid
            pass
    return tempfile.mkdtemp(prefix=f"{HEARTBEAT_PREFIX}{os.getpid()}-")


def read_heartbeats(folder: str) -> dict[str, dict[str, float]]:
    """Sums the heartbeat files of ``folder`` by stage; also gives each stage's first and last time."""
    out: dict[str, dict[str, float]] = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):  # replaced or removed while reading
            continue
        stage = data.pop("stage")
        first, last = data.pop("first"), data.pop("last")
        agg = out.setdefault(stage, {"first": first, "last": last})
        agg["first"], agg["last"] = min(agg["first"], first), max(agg["last"], last)
        for k, v in data.items():
            agg[k] = agg.get(k, 0) + v
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _tokens(n: float) -> str:
    return f"{n / 1e6:,.1f} M tokens" if n >= 1e5 else f"{int(n):,} tokens"


class Monitor:
    """Shows a run's progress from heartbeats (local runners) or counters (distributed ones).

    Args:
      total_bytes: listed bytes of all inputs (the read step's 100%).
      total_shards: shards the run writes (the packing step's 100%).
      stream: where lines go (stderr by default).
      interval: seconds between plain lines when ``stream`` is not a terminal.
      terminal: force the Rich bar on (True) or off (False); default: ``stream.isatty()``.
      clock: ``time.time``, replaceable in tests.
    """

    def __init__(
        self,
        total_bytes: int,
        total_shards: int,
        stream: Optional[TextIO] = None,
        interval: float = 10.0,
        terminal: Optional[bool] = None,
        clock: Callable[[], float] = time.time,
    ):
        self._stream = stream or sys.stderr
        self._total_bytes = max(1, total_bytes)
        self._total_shards = max(1, total_shards)
        self._interval = interval
        self._terminal = self._stream.isatty() if terminal is None else terminal
        self._clock = clock
        self._start = clock()
        self._last_line = self._start
        self._done_read: Optional[float] = None
        self.durations: dict[str, float] = {}
        self._bar = None
        self._tasks: dict[str, int] = {}
        self._broken = False

    # -- rendering -------------------------------------------------------------------------

    def _print(self, line: str) -> None:
        """Shows ``line``; once the stream fails (a pipe whose reader is gone) the monitor goes
        quiet instead of failing the run: progress is a view, the manifest is the record."""
        if not self._broken and not print_line(line, self._stream, self._bar):
            self._broken = True

    def _start_bar(self) -> None:
        self._bar = rich_bar(self._stream, transient=False, eta=True)
        self._tasks[READ] = self._bar.add_task("read and tokenize", total=self._total_bytes, detail="")
        self._tasks[PACK] = self._bar.add_task("pack and write", total=self._total_shards, detail="", visible=False)

    def update(self, stages: Mapping[str, Mapping[str, float]], final: bool = False) -> None:
        """Shows ``stages`` (as :func:`read_heartbeats` returns them)."""
        now = self._clock()
        read, tok, pack = stages.get(READ, {}), stages.get(TOKENIZE, {}), stages.get(PACK, {})
        if (pack or final) and self._done_read is None and (read or tok):
            end = max(read.get("last", now), tok.get("last", now))
            self._done_read = end
            self.durations["read and tokenize"] = end - self._start
            tokens = tok.get("tokens", 0)
            rate = tokens / max(end - self._start, 1e-9)
            self._print(
                f"pack: read and tokenize done in {duration(end - self._start)} "
                f"({_tokens(tokens)}, {rate / 1e6:,.1f} M tokens/s)"
            )
        if final and pack and "pack and write" not in self.durations:
            self.durations["pack and write"] = pack["last"] - min(pack["first"], self._done_read or pack["first"])
            self._print(
                f"pack: pack and write done in {duration(self.durations['pack and write'])} "
                f"({int(pack.get('shards', 0)):,} shards, {int(pack.get('rows', 0)):,} rows)"
            )
        if self._terminal and not self._broken:
            try:
                self._update_bar(read, tok, pack)
            except (OSError, ValueError):
                self._broken = True
        elif not final and now - self._last_line >= self._interval:
            self._last_line = now
            self._print(self.line(read, tok, pack, now))

    def line(self, read, tok, pack, now: float) -> str:
        """The plain progress line for the current counts."""
        elapsed = max(now - self._start, 1e-9)
        if pack:
            shards = int(pack.get("shards", 0))
            spent = now - (self._done_read or pack["first"])
            eta = spent / shards * (self._total_shards - shards) if shards else None
            return (
                f"pack: wrote {shards:,} of {self._total_shards:,} shards, {int(pack.get('rows', 0)):,} rows, "
                f"{_tokens(pack.get('tokens', 0))}" + (f", ETA {duration(eta)}" if eta is not None else "")
            )
        if not read and not tok:
            return f"pack: started {duration(elapsed)} ago, no document read yet (workers starting)"
        done = min(read.get("bytes", 0), self._total_bytes)
        tokens = tok.get("tokens", 0)
        eta = elapsed / done * (self._total_bytes - done) if done else None
        return (
            f"pack: read {_mb(done)} of {_mb(self._total_bytes)} ({done / self._total_bytes:.0%}), "
            f"{int(read.get('documents', 0)):,} documents, {_tokens(tokens)}, "
            f"{tokens / elapsed / 1e6:,.1f} M tokens/s" + (f", ETA {duration(eta)}" if eta is not None else "")
        )

    def _update_bar(self, read, tok, pack) -> None:
        if self._bar is None:
            self._start_bar()
        tokens = tok.get("tokens", 0)
        self._bar.update(
            self._tasks[READ],
            completed=min(read.get("bytes", 0), self._total_bytes),
            detail=f"{int(read.get('documents', 0)):,} docs, {_tokens(tokens)}",
        )
        if pack:
            self._bar.update(
                self._tasks[PACK],
                visible=True,
                completed=int(pack.get("shards", 0)),
                detail=f"{int(pack.get('rows', 0)):,} rows",
            )
            self._bar.update(self._tasks[READ], completed=self._total_bytes)

    def close(self) -> None:
        if self._bar is not None:
            if not stop_bar(self._bar):
                self._broken = True
            self._bar = None

    # -- sources ---------------------------------------------------------------------------

    def watch(self, folder: str, tick: Optional[float] = None) -> "_Watcher":
        """Starts a thread that reads ``folder``'s heartbeats every ``tick`` s (default: the line
        interval, at most 0.25 s); stop it with ``.stop()``."""
        return _Watcher(self, folder, min(0.25, self._interval) if tick is None else tick)


class _Watcher:
    def __init__(self, monitor: Monitor, folder: str, tick: float):
        self._monitor, self._folder, self._tick = monitor, folder, tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dataprep-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._monitor.update(read_heartbeats(self._folder))

    def stop(self) -> dict[str, dict[str, float]]:
        """Stops the thread and shows the final counts; returns them."""
        self._stop.set()
        self._thread.join()
        stages = read_heartbeats(self._folder)
        self._monitor.update(stages, final=True)
        self._monitor.close()
        return stages


def counters_as_stages(counters: Mapping[str, int], start: float, now: float) -> dict[str, dict[str, float]]:
    """Beam counters (``"<source>.<what>"``) as the stage sums :meth:`Monitor.update` takes.

    For distributed runners, whose counters can be queried while the job runs.
    """
    def total(what: str) -> int:
        return sum(v for k, v in counters.items() if k.split(".", 1)[-1] == what)

    out: dict[str, dict[str, float]] = {
        READ: {"first": start, "last": now, "documents": total("read"), "bytes": total("bytes_read")},
        TOKENIZE: {"first": start, "last": now, "tokens": total("tokens_in")},
    }
    if total("rows"):
        out[PACK] = {"first": start, "last": now, "shards": total("shards"), "rows": total("rows"),
                     "tokens": total("tokens_packed")}
    return out


def is_worker_noise(line: str) -> bool:
    """Beam SDK worker start-up and shutdown chatter (``INFO:`` lines, the semi-persistent
    directory warning, the GCP extras' import warning): what a ``multi_processing`` run's
    workers print on every start."""
    return line.startswith(("INFO:", "DEBUG:")) or any(
        s in line for s in ("No semi_persistent_directory found", "apitools not found")
    )


@contextlib.contextmanager
def filtered_stderr(active: bool) -> Iterator[TextIO]:
    """Filters :func:`is_worker_noise` lines out of file descriptor 2 while the block runs.

    Beam's ``multi_processing`` workers are subprocesses that inherit the driver's stderr
    and log at INFO before they read any option. Here fd 2 is a pipe for the duration; a
    thread forwards every other line (errors, tracebacks, warnings) to the real stderr.

    Yields:
      A text stream on the real stderr (a terminal stays a terminal), for progress output.
    """
    if not active:
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    out = os.dup(saved)  # the pump's own: closing ``saved`` never leaves it writing to a reused fd

    def pump() -> None:
        try:
            with os.fdopen(read_end, "rb") as pipe:
                for line in pipe:  # drained to the end even when the real stderr fails
                    if not is_worker_noise(line.decode("utf-8", "replace")):
                        try:
                            os.write(out, line)
                        except OSError:
                            pass  # the real stderr is closed; writers must not block on a full pipe
        finally:
            os.close(out)

    thread = threading.Thread(target=pump, name="dataprep-stderr", daemon=True)
    thread.start()
    stream = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield stream
    finally:
        for f in (stream, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):  # a closed real stderr must not keep fd 2 on the pipe
                pass
        os.dup2(saved, 2)  # the pipe ends when the workers (which hold it too) have exited
        thread.join(timeout=10)
        try:
            stream.close()
        except OSError:
            pass
        os.close(saved)
