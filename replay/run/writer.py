"""Writing a run directory (the layout of :mod:`replay.run.protocol`): appends flushed line by line,
whole files through a temporary name.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping

from replay.run import protocol as proto


class RunDir:
    """The files of one run directory (``replay.run.protocol`` layout); appends are flushed per line."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        return self.file(proto.CHECKPOINTS_DIR)

    def event(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        rec = {"event": event, "step": int(step), **fields,
               "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        with open(self.file(proto.EVENTS_NAME), "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
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
