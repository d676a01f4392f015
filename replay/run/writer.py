"""Writing a run directory (the layout of :mod:`replay.run.protocol`): appends flushed line by line,
whole files through a temporary name.

Attempts (``replay.run.lineage``): the training loop sets :attr:`RunDir.attempt` when it starts or
restores, and every event it writes then carries ``attempt``. Every event carries ``t``, the wall
clock in Unix seconds (microseconds), besides the readable ``time``: ``replay goodput`` accounts
for the run's time from these. On a restore, :meth:`RunDir.supersede` moves the step-log lines of
the steps the restore abandons into ``superseded/`` (each tagged with the attempt that wrote it and
the one that superseded it) and :meth:`RunDir.supersede_checkpoints` moves abandoned checkpoints to
``superseded/attempt-<b>/checkpoints/``: history is kept, never deleted, and the step logs hold the
lineage alone.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from typing import Any, Callable, Mapping, Optional

from replay.run import protocol as proto
from replay.run.protocol import SUPERSEDED_DIR


class RunDir:
    """The files of one run directory (``replay.run.protocol`` layout); appends are flushed per line.

    Attributes:
      path: the run directory (absolute).
      attempt: the attempt the writer belongs to (written into every event), or None.
    """

    def __init__(self, path: str, attempt: Optional[int] = None):
        self.path = os.path.abspath(path)
        self.attempt = attempt
        os.makedirs(self.path, exist_ok=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        return self.file(proto.CHECKPOINTS_DIR)

    def event(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Appends one event: ``{"event", "step", **fields, "attempt" (when set), "t" (Unix s), "time"}``."""
        now = time.time()
        rec = {"event": event, "step": int(step), **fields, "t": round(now, 6),
               "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds")}
        if self.attempt is not None and "attempt" not in fields:
            rec["attempt"] = int(self.attempt)
        with open(self.file(proto.EVENTS_NAME), "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
        return rec

    def drop_torn_event(self) -> bool:
        """Drops a torn last line of events.jsonl (a kill mid-write), so that the next event starts
        on a line of its own; returns whether one was dropped."""
        path = self.file(proto.EVENTS_NAME)
        if not os.path.exists(path):
            return False
        with open(path, "rb+") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return False
            f.truncate(data.rfind(b"\n") + 1)
        return True

    def truncate_fingerprints(self, before_step: int) -> int:
        """Keeps only lines of fingerprints.jsonl with ``step < before_step``; returns lines dropped."""
        return self.truncate_log(proto.FINGERPRINTS_NAME, before_step)

    def truncate_log(self, name: str, before_step: int) -> int:
        """Keeps only lines of the step log ``name`` with ``step < before_step`` (atomic rewrite; a
        torn line is dropped); returns lines dropped."""
        path = self.file(name)
        if not os.path.exists(path):
            return 0
        keep, dropped = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError):  # a line torn by a kill
                    dropped += 1
                    continue
                if step < before_step:
                    keep.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, path)
        return dropped

    def supersede(self, from_step: int, writer_of: Callable[[int], Optional[int]], by_attempt: int,
                  names: tuple[str, ...] = (proto.FINGERPRINTS_NAME, proto.SIGNALS_NAME, proto.CANARY_NAME)
                  ) -> dict[str, int]:
        """Moves the lines of steps ``>= from_step`` of each step log into ``superseded/<name>``, each
        with ``attempt`` (``writer_of(step)``: the attempt that wrote it) and ``superseded_by``
        (``by_attempt``), then keeps only the earlier lines in the step log (atomic rewrite; a torn
        line is dropped).

        Crash-safe: the lines are appended to the superseded file before the step log is rewritten;
        a kill in between moves them again on the next restore, and readers count a line once
        (``replay.run.lineage.read_superseded``).

        Returns:
          per step log, the lines moved.
        """
        moved: dict[str, int] = {}
        for name in names:
            path = self.file(name)
            if not os.path.exists(path):
                continue
            keep, out = [], []
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        step = int(rec["step"])
                    except (ValueError, KeyError, TypeError):  # a line torn by a kill
                        continue
                    if step < from_step:
                        keep.append(line if line.endswith("\n") else line + "\n")
                    else:
                        rec["attempt"], rec["superseded_by"] = writer_of(step), int(by_attempt)
                        out.append(json.dumps(rec, sort_keys=True) + "\n")
            if out:
                os.makedirs(self.file(SUPERSEDED_DIR), exist_ok=True)
                with open(os.path.join(self.file(SUPERSEDED_DIR), name), "a", encoding="utf-8") as f:
                    f.writelines(out)
                    f.flush()
                    os.fsync(f.fileno())
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(keep)
            os.replace(tmp, path)
            moved[name] = len(out)
        return moved

    def supersede_checkpoints(self, after_step: int, by_attempt: int) -> list[int]:
        """Moves the checkpoints of steps ``> after_step`` to ``superseded/attempt-<by_attempt>/checkpoints/``
        (a rename each: nothing is deleted, and the restored lineage can save those steps again);
        returns their steps."""
        moved = []
        if not os.path.isdir(self.checkpoints):
            return moved
        dest = os.path.join(self.file(SUPERSEDED_DIR), f"attempt-{int(by_attempt)}", proto.CHECKPOINTS_DIR)
        for name in sorted((n for n in os.listdir(self.checkpoints) if n.isdigit()), key=int):
            if int(name) > after_step:
                os.makedirs(dest, exist_ok=True)
                target = os.path.join(dest, name)
                if os.path.exists(target):  # a second rewind over the same step by the same attempt
                    target = f"{target}.{len(os.listdir(dest))}"
                shutil.move(os.path.join(self.checkpoints, name), target)
                moved.append(int(name))
        return moved

    def append_fingerprints(self, fp: proto.StepFingerprints) -> None:
        proto.append_line(self.file(proto.FINGERPRINTS_NAME), fp.to_json())

    def append_signals(self, signals: proto.StepSignals) -> None:
        proto.append_line(self.file(proto.SIGNALS_NAME), signals.to_json())

    def append_canary(self, record: proto.CanaryRecord) -> None:
        proto.append_line(self.file(proto.CANARY_NAME), record.to_json())


def write_json(report: Mapping[str, Any], path: str) -> None:
    """Writes ``report`` as indented, key-sorted JSON (through a temporary name, then renamed)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
