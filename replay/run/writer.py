"""Writing a run directory (the layout of :mod:`replay.run.protocol`), from one process or many.

Two layers:

* :class:`RunWriter`, the public writer any trainer adds to its loop (about ten lines: docs/trainer.md,
  "Your own trainer"): the run config with its ``trainer:`` factory, the environment record, each
  step's fingerprints and screening signals, and the events.
* :class:`RunDir`, the files underneath (the reference trainer's loop uses it directly).

Many processes, one directory (DESIGN.md, "The run directory"). Who writes what::

    run_config.yaml, env.json, events.jsonl       process 0 (the primary) only: events are written once
    fingerprints.jsonl, signals.jsonl             process 0: each step's global record (loss, gradient
                                                  norm, batch hash, reduced leaves, every device's mesh
                                                  coordinates, router figures, timings) and its own
                                                  devices' per-device entries
    fingerprints.p00001.jsonl, signals.p00001...  process p >= 1: its own devices' per-device entries
    canary.jsonl, canary.p00001.jsonl, ...        each process its own devices' canary records
    checkpoints/<step>/                           Orbax: every process its shards, process 0 the
                                                  metadata, the commit (a rename) last

Every file has one writer, so no two processes ever append to the same file. A torn write is
avoided by construction: the ``*.jsonl`` files are append-only, a line is written whole and flushed
(a process killed mid-write leaves at most a torn *last* line, which every reader skips), and the
whole files (run_config.yaml, env.json, a truncated log) are written to a temporary name and renamed
over the old one (``os.replace``, atomic on POSIX). A step is logged once every process's line for it
is there: the readers merge the files by step (``replay.run.protocol.read_fingerprints``,
``replay.run.runlog.load_run``), and a step a process did not log is set aside as malformed, naming
that process's file, never compared. A single-process run writes the same files as before, without
``.pNNNNN`` shards.

Attempts (``replay.run.lineage``): the training loop sets :attr:`RunDir.attempt` when it starts or
restores, and every event it writes then carries ``attempt``. Every event carries ``t``, the wall
clock in Unix seconds (microseconds), besides the readable ``time``: ``replay goodput`` accounts
for the run's time from these. On a restore, :meth:`RunDir.supersede` moves the step-log lines of
the steps the restore abandons into ``superseded/`` (each tagged with the attempt that wrote it and
the one that superseded it; each process its own files' lines) and :meth:`RunDir.supersede_checkpoints`
moves abandoned checkpoints to ``superseded/attempt-<b>/checkpoints/`` (process 0): history is kept,
never deleted, and the step logs hold the lineage alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import math
import os
import re
import shutil
import time
from typing import Any, Callable, Iterable, Mapping, Optional

from replay.run import protocol as proto
from replay.run.protocol import SUPERSEDED_DIR


def input_signals(metrics: Optional[Mapping[str, Any]], wait_s: Optional[float] = None,
                  occupancy: Optional[int] = None) -> dict[str, Any]:
    """The ``StepSignals`` input fields of a step from the loader's ``metrics()`` (read after its batch
    was taken): ``loader_wait_s``, ``loader_occupancy`` (at the ask), ``loader_occupancy_min``,
    ``loader_wait_stages`` (seconds, rounded to the microsecond); ``wait_s`` and ``occupancy`` win
    where given. Without ``metrics`` only those two."""
    m = metrics or {}
    wait = wait_s if wait_s is not None else m.get("wait_s_last_step")
    occ = occupancy if occupancy is not None else m.get("occupancy_at_ask", m.get("prefetch_occupancy"))
    stages = m.get("wait_stages_s")
    return {"loader_wait_s": None if wait is None else round(float(wait), 6),
            "loader_occupancy": None if occ is None else int(occ),
            "loader_occupancy_min": None if m.get("occupancy_min") is None else int(m["occupancy_min"]),
            "loader_wait_stages": None if stages is None else {k: round(float(v), 6) for k, v in stages.items()}}


class RunDir:
    """The files of one run directory (``replay.run.protocol`` layout), as one process of the run writes them.

    Args:
      path: the run directory (created).
      attempt: the attempt the writer belongs to (written into every event), or None.
      process_index, process_count: this process and the run's processes (``jax.process_index()``,
        ``jax.process_count()``); defaults: one process.
      local_devices: global ids of this process's devices in the mesh; their per-device entries go to
        this process's files (the primary's to the main files). None: every device's entries go to
        this process's files (one process, or a trainer whose records hold only its own devices).
    """

    def __init__(self, path: str, attempt: Optional[int] = None, *, process_index: int = 0, process_count: int = 1,
                 local_devices: Optional[Iterable[int]] = None):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} must be in [0, process_count={process_count})")
        self.path = os.path.abspath(path)
        self.attempt = attempt
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.local_devices = None if local_devices is None else frozenset(int(d) for d in local_devices)
        os.makedirs(self.path, exist_ok=True)

    @classmethod
    def for_mesh(cls, path: str, mesh: Any) -> "RunDir":
        """The run directory as this process of a run on ``mesh`` writes it: process 0 the run's single
        files, each process its own devices' step-log entries (one process: every entry)."""
        import jax

        me = jax.process_index()
        local = [int(d.id) for d in mesh.devices.reshape(-1) if d.process_index == me]
        count = jax.process_count()
        return cls(path, process_index=me, process_count=count, local_devices=local if count > 1 else None)

    @property
    def primary(self) -> bool:
        """Whether this process writes the run's single files (config, env record, events, global records)."""
        return self.process_index == 0

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def own_file(self, name: str) -> str:
        """This process's file of the step log ``name``: the main file for the primary, ``<stem>.pNNNNN.jsonl``
        for process N >= 1 (``replay.run.protocol.shard_name``)."""
        return self.file(name if self.primary else proto.shard_name(name, self.process_index))

    @property
    def checkpoints(self) -> str:
        return self.file(proto.CHECKPOINTS_DIR)

    def event(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """Appends one event ``{"event", "step", **fields, "attempt" (when set), "t" (Unix s), "time"}`` to
        events.jsonl (process 0 only: events are written once) and returns it."""
        now = time.time()
        rec = {"event": event, "step": int(step), **fields, "t": round(now, 6),
               "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds")}
        if self.attempt is not None and "attempt" not in fields:
            rec["attempt"] = int(self.attempt)
        if self.primary:
            proto.append_line(self.file(proto.EVENTS_NAME), json.dumps(rec, sort_keys=True))
        return rec

    def drop_torn_event(self) -> bool:
        """Drops a torn last line of events.jsonl (a kill mid-write), so that the next event starts
        on a line of its own; returns whether one was dropped (process 0 only)."""
        path = self.file(proto.EVENTS_NAME)
        if not self.primary or not os.path.exists(path):
            return False
        with open(path, "rb+") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return False
            f.truncate(data.rfind(b"\n") + 1)
        return True

    def logged_steps(self) -> list[int]:
        """The steps of the run's ``fingerprints.jsonl`` (process 0's file), in file order; a line without a
        readable step (one torn by a kill) is skipped."""
        path = self.file(proto.FINGERPRINTS_NAME)
        out = []
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        out.append(int(json.loads(line)["step"]))
                    except (ValueError, KeyError, TypeError):
                        continue
        return out

    def truncate_log(self, name: str, before_step: int) -> int:
        """Keeps only lines of this process's file of the step log ``name`` with ``step < before_step``
        (atomic rewrite; a torn line is dropped); returns lines dropped."""
        path = self.own_file(name)
        if not os.path.exists(path):
            return 0
        keep, dropped = [], 0
        for line in io.StringIO(_read_step_log(path)):
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # a line torn by a kill
                dropped += 1
                continue
            if step < before_step:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
        _atomic_write(path, "".join(keep))
        return dropped

    def supersede(self, from_step: int, writer_of: Callable[[int], Optional[int]], by_attempt: int,
                  names: tuple[str, ...] = (proto.FINGERPRINTS_NAME, proto.SIGNALS_NAME, proto.CANARY_NAME)
                  ) -> dict[str, int]:
        """Moves the lines of steps ``>= from_step`` of each of this process's step logs into
        ``superseded/<its file name>``, each with ``attempt`` (``writer_of(step)``: the attempt that wrote
        it) and ``superseded_by`` (``by_attempt``), then keeps only the earlier lines in the step log
        (atomic rewrite; a torn line is dropped).

        Crash-safe: the lines are appended to the superseded file before the step log is rewritten;
        a kill in between moves them again on the next restore, and readers count a line once
        (``replay.run.lineage.read_superseded``).

        Returns:
          per step log, the lines moved.
        """
        moved: dict[str, int] = {}
        # Every step log is read before any is changed: a damaged one stops the move with nothing moved
        # (was: the logs before it moved, then a bare UnicodeDecodeError naming no file).
        texts = {name: _read_step_log(path) for name in names if os.path.exists(path := self.own_file(name))}
        for name, text in texts.items():
            path = self.own_file(name)
            keep, out = [], []
            for line in io.StringIO(text):
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
                    intact = proto.line_damage(rec) is None
                    rec["attempt"], rec["superseded_by"] = writer_of(step), int(by_attempt)
                    if intact and proto.LINE_CHECK in rec:  # sealed again with its tags; a damaged line stays so
                        rec = proto.seal(rec)
                    out.append(json.dumps(rec, sort_keys=True) + "\n")
            if out:
                os.makedirs(self.file(SUPERSEDED_DIR), exist_ok=True)
                with open(os.path.join(self.file(SUPERSEDED_DIR), os.path.basename(path)), "a",
                          encoding="utf-8") as f:
                    f.writelines(out)
                    f.flush()
                    os.fsync(f.fileno())
            _atomic_write(path, "".join(keep))
            moved[name] = len(out)
        return moved

    def supersede_checkpoints(self, after_step: int, by_attempt: int) -> list[int]:
        """Moves the checkpoints of steps ``> after_step`` to ``superseded/attempt-<by_attempt>/checkpoints/``
        (a rename each: nothing is deleted, and the restored lineage can save those steps again);
        returns their steps. Process 0's task: the other processes move nothing."""
        moved = []
        if not self.primary or not os.path.isdir(self.checkpoints):
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

    def _own(self, devices: Iterable[int]) -> list[int]:
        return [int(d) for d in devices if self.local_devices is None or int(d) in self.local_devices]

    def append_fingerprints(self, fp: proto.StepFingerprints) -> None:
        """Appends the step's fingerprints: the primary the global record with its own devices' entries,
        another process its own devices' entries (:meth:`RunDir` docstring)."""
        own = self._own(fp.devices)
        sends = getattr(fp, "sends", None) or {}
        if self.primary:
            rec = fp if self.local_devices is None else dataclasses.replace(
                fp, devices={d: fp.devices[d] for d in own}, **({"sends": {d: sends[d] for d in own if d in sends}}
                                                                 if sends else {}))
            proto.append_line(self.file(proto.FINGERPRINTS_NAME), rec.to_json())
        else:
            line = {"step": int(fp.step), "process": self.process_index,
                    "devices": {str(d): {k: int(v) for k, v in fp.devices[d].items()} for d in own}}
            if sends:  # the all-to-all send fingerprints of its devices (replay.verify.localize)
                line["sends"] = {str(d): [int(v) for v in sends[d]] for d in own if d in sends}
            proto.append_line(self.own_file(proto.FINGERPRINTS_NAME), json.dumps(proto.seal(line), sort_keys=True))

    def append_signals(self, signals: proto.StepSignals) -> None:
        """Appends the step's screening signals, split like the fingerprints (a replica goes with its first device)."""
        own = set(self._own(signals.devices))
        replicas = tuple(r for r in signals.replicas if self.local_devices is None or r.devices[0] in self.local_devices)
        if self.primary:
            rec = signals if self.local_devices is None else dataclasses.replace(
                signals, devices={d: v for d, v in signals.devices.items() if d in own}, replicas=replicas)
            proto.append_line(self.file(proto.SIGNALS_NAME), rec.to_json())
        else:
            full = dataclasses.replace(signals, devices={d: v for d, v in signals.devices.items() if d in own},
                                       replicas=replicas).to_dict()
            line = {"step": full["step"], "process": self.process_index, "devices": full["devices"],
                    "replicas": full["replicas"]}
            if getattr(signals, "tokens", None) is not None:  # its own reads: the readers add them up
                line["tokens"] = int(signals.tokens)
            proto.append_line(self.own_file(proto.SIGNALS_NAME), json.dumps(proto.seal(line), sort_keys=True))

    def append_canary(self, record: proto.CanaryRecord) -> None:
        """Appends one device's canary record, when the device is this process's."""
        if self._own([record.device]):
            proto.append_line(self.own_file(proto.CANARY_NAME), record.to_json())

    def write_whole(self, name: str, text: str) -> None:
        """Writes the run file ``name`` whole, through a temporary name (process 0 only)."""
        if self.primary:
            _atomic_write(self.file(name), text)

    def write_env(self, env: Mapping[str, Any]) -> None:
        """Writes ``env.json`` at the run's fresh start: ``env`` (``replay.run.env.record_environment``)
        and ``step_log_check: "crc32"`` (``protocol.RUN_LINE_CHECK``): this writer seals every line of the
        run's step logs, so a reader takes a line without its checksum for damage wherever it is."""
        self.write_whole(proto.ENV_NAME, json.dumps({**env, proto.RUN_LINE_CHECK: proto.LINE_CHECK},
                                                    indent=1, sort_keys=True))


def _read_step_log(path: str) -> str:
    """The UTF-8 text of a step log; one that is not UTF-8 is a ``ValueError`` naming it and what to do."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): corrupted?; nothing was moved or rewritten: "
            "restore the file from a copy, or delete its damaged line (that step's record is lost), and rerun"
        ) from None


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(report: Mapping[str, Any], path: str) -> None:
    """Writes ``report`` as indented, key-sorted JSON (through a temporary name, then renamed)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the public writer


class RunConfigMismatchError(ValueError):
    """The run directory was started with another config; the message names the differing keys."""


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RunWriter:
    """The run directory of any trainer, written from its training loop (every process calls every
    method, in the same order; process 0 writes the run's single files).

    Usage (docs/trainer.md, "Your own trainer")::

        log = RunWriter(run_dir, config=cfg, trainer="mypackage.replay_setup:make_setup", mesh=mesh)
        start = log.start(checkpoint)          # None: a fresh run (step 0); else resumed from that checkpoint
        for step in range(start, steps):
            state, fp = train_step(state, batch, step)   # fp: replay.run.protocol.StepFingerprints
            log.log_step(fp, step_time_s=..., loader_wait_s=...)
            if saved: log.checkpoint(step + 1, save_start_t=t_save, commit_t=t_commit)  # once it has committed
        log.end(steps)

    Args:
      run_dir: the run directory (created).
      config: the run config (a JSON/YAML-able mapping); written to ``run_config.yaml`` with
        ``trainer:`` set, or, when the directory holds one already (a resume), checked against it.
      trainer: the factory replay rebuilds the run with, ``"package.module:function"``
        (``replay.run.setup``).
      mesh: the run's ``jax.sharding.Mesh`` (recorded in env.json: axes, shape, device order, every
        device's process, local index and host).

    Raises:
      ValueError: ``trainer`` is not a factory name, or ``config`` sets another ``trainer``.
      RunConfigMismatchError: the directory was started with another config.
    """

    def __init__(self, run_dir: str, *, config: Mapping[str, Any], trainer: str, mesh: Any):
        import jax
        import yaml

        from replay.run.env import record_environment

        if not isinstance(trainer, str) or not _FACTORY.match(trainer):
            raise ValueError(f"trainer: expected 'package.module:function', got {trainer!r}")
        if config.get("trainer", trainer) != trainer:
            raise ValueError(f"config sets trainer {config['trainer']!r}, the writer was given {trainer!r}")
        self.config = {**dict(config), "trainer": trainer}
        me = jax.process_index()
        local = [int(d.id) for d in mesh.devices.reshape(-1) if d.process_index == me]
        self.dir = RunDir(run_dir, process_index=me, process_count=jax.process_count(), local_devices=local)
        self.env = record_environment(mesh)  # a collective the first time (host names): every process calls it
        path = self.dir.file(proto.RUN_CONFIG_NAME)
        text = yaml.safe_dump(self.config, sort_keys=True)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = yaml.safe_load(f) or {}
            new = yaml.safe_load(text)
            diffs = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if diffs:
                raise RunConfigMismatchError(
                    f"run directory {self.dir.path} was started with another config (differs in {diffs}); use a "
                    f"new run directory")
        else:
            self.dir.write_whole(proto.RUN_CONFIG_NAME, text)

    def start(self, checkpoint: Optional[int]) -> int:
        """Begins (``checkpoint`` None: step 0, a fresh env.json and a ``start`` event) or resumes from
        ``checkpoint`` (moves this process's step-log lines of steps ``>= checkpoint`` into ``superseded/``,
        a ``restore`` event listing what differs from the recorded environment); either begins an
        attempt (``replay.run.lineage``), which every later event carries. Returns the first step to train."""
        from replay.run import lineage as lin
        from replay.run.env import compare_environment

        self.dir.drop_torn_event()
        logs = (proto.FINGERPRINTS_NAME, proto.SIGNALS_NAME, proto.CANARY_NAME)
        events = proto.read_events(self.dir.path) if os.path.exists(self.dir.file(proto.EVENTS_NAME)) else []
        steps = [int(d["step"]) for d in proto.read_raw_lines(self.dir.file(proto.FINGERPRINTS_NAME))] \
            if os.path.exists(self.dir.file(proto.FINGERPRINTS_NAME)) else []
        lineage = lin.lineage_of_run(self.dir.path, events, steps)
        self.dir.attempt = lineage.next_attempt()  # each start or restore begins an attempt (replay.run.lineage)
        if checkpoint is None:
            for name in logs:
                self.dir.truncate_log(name, 0)
            self.dir.write_env(self.env)
            self.dir.event("start", 0, processes=self.dir.process_count)
            return 0
        recorded = {}
        if os.path.exists(self.dir.file(proto.ENV_NAME)):
            with open(self.dir.file(proto.ENV_NAME), encoding="utf-8") as f:
                recorded = json.load(f)
        last = lineage.attempts[-1].id if lineage.attempts else None  # a loop that only resumes: the last wrote them
        moved = self.dir.supersede(checkpoint, lambda _step: last, self.dir.attempt, logs)
        self.dir.event("restore", checkpoint, checkpoint=checkpoint, superseded={"lines": moved},
                       dropped_fingerprint_lines=moved.get(proto.FINGERPRINTS_NAME, 0),
                       env_differences=compare_environment(recorded, self.env))
        return int(checkpoint)

    def log_step(self, fp: proto.StepFingerprints, *, step_time_s: Optional[float] = None,
                 loader_wait_s: Optional[float] = None, loader_occupancy: Optional[int] = None,
                 loader: Optional[Mapping[str, Any]] = None) -> None:
        """Appends the step's fingerprints and, when ``fp.signals`` holds them, its screening signals with
        the loop's timings (seconds; the loader's buffer occupancy).

        ``loader``: the loader's ``metrics()`` read after the step's batch was taken (``loader.DataLoader``);
        its input figures fill the signals' ``loader_wait_s``, ``loader_occupancy`` (the level at the ask),
        ``loader_occupancy_min`` and ``loader_wait_stages`` (``replay.run.protocol.StepSignals``), unless
        ``loader_wait_s`` or ``loader_occupancy`` are given, which win."""
        self.dir.append_fingerprints(fp)
        if fp.signals is not None:
            self.dir.append_signals(dataclasses.replace(
                fp.signals, step_time_s=step_time_s, **input_signals(loader, loader_wait_s, loader_occupancy)))

    def event(self, name: str, step: int, **fields: Any) -> dict[str, Any]:
        """Appends an event (``checkpoint`` once a checkpoint has committed, ``phase_change``,
        ``skipped_window``, ...); written once, by process 0. A ``checkpoint`` event carries the state
        record :meth:`record_checkpoint` took of that step, and writes it beside the checkpoints."""
        if name == "checkpoint":
            fields = {**self._record_fields(step), **fields}
        return self.dir.event(name, step, **fields)

    def checkpoint(self, step: int, *, save_start_t: Optional[float] = None,
                   commit_t: Optional[float] = None) -> dict[str, Any]:
        """The ``checkpoint`` event, once checkpoint ``step`` has committed: ``save_start_t``, the Unix
        seconds (``time.time()``, the clock of every event's ``t``) when its save began, and
        ``commit_t``, when it committed (``replay goodput`` measures the checkpoint interval and the
        save's latency from them; either may be left out where not known).

        Raises:
          ValueError: a time that is not a finite number, or ``commit_t`` before ``save_start_t``.
        """
        times = {k: v for k, v in (("save_start_t", save_start_t), ("commit_t", commit_t)) if v is not None}
        for k, v in times.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"checkpoint {step}: {k} must be Unix seconds (a finite number), got {v!r}")
        if len(times) == 2 and commit_t < save_start_t:
            raise ValueError(f"checkpoint {step}: commit_t {commit_t} is before save_start_t {save_start_t}")
        return self.dir.event("checkpoint", step, **self._record_fields(step),
                              **{k: round(float(v), 6) for k, v in times.items()})

    def end(self, step: int) -> None:
        """The ``end`` event: training stopped at ``step``."""
        self.dir.event("end", step)

    def record_inputs(self, data: Any) -> bool:
        """Keeps what the run trains with, from its loader ``data`` (``loader.build(...)``): ``mixture.yaml``
        (a copy of the mixture config, paths absolute) and ``inputs.json`` (the mixture's sha256 and path,
        the dataset manifest's sha256, the loader's schedule), once, at the run's first start
        (``replay.run.inputs.record_inputs``; process 0 writes them). Replay then rebuilds batches with the
        copy even when the mixture file is edited later, and refuses a dataset that is not the one trained
        on. Returns whether it wrote them (False: already there, or not process 0)."""
        from replay.run.inputs import record_inputs

        if not self.dir.primary:
            return False
        return record_inputs(self.dir.path, data.mixture, str(self.config.get("mixture", "")), data.dataset,
                             data.manifest_sha256, data.schedule.to_dict())
    # --- checkpoint state records (replay.run.statefp; docs/trainer.md, "Checkpoints you can trust")

    def record_checkpoint(self, step: int, state: Any, loader_state: Optional[Mapping[str, Any]] = None) -> Any:
        """Fingerprints ``state`` (global ``jax.Array`` leaves with ``NamedSharding``: every leaf, shard and
        replica, on the devices) and ``loader_state`` as checkpoint ``step``'s state record, at the save,
        from the state being saved: call it with the arrays you hand your checkpointer. Replicas that
        disagree are a ``state_replicas_disagree`` event (the devices, leaves and shards named). Every
        process calls it; process 0 writes the record beside the checkpoints at once (so a kill between your
        checkpointer's commit and the ``checkpoint`` event leaves it). Returns the
        ``replay.run.statefp.StateRecord``; the ``checkpoint`` event carries it."""
        from replay.run import statefp

        rec = statefp.record_state(state, loader_state, step)
        path = statefp.write_record(self.dir.path, rec) if self.dir.primary else None  # beside, before the save
        if not rec.replicas_agree:
            self.dir.event("state_replicas_disagree", step, **statefp.disagree_event(rec))
        self._records = {**getattr(self, "_records", {}), int(step): (rec, path)}
        return rec

    def _record_fields(self, step: int) -> dict[str, Any]:
        """The ``checkpoint`` event's ``state`` from :meth:`record_checkpoint`'s record of ``step`` (already
        written beside the checkpoints, ``checkpoint_records/<step>.json``, by process 0); none without a
        record (replay then says the checkpoint cannot be verified)."""
        from replay.run import statefp

        saved = getattr(self, "_records", {}).pop(int(step), None)
        return {} if saved is None else statefp.event_fields(*saved)

    def verify_restore(self, step: int, state: Any, loader_state: Optional[Mapping[str, Any]] = None) -> Any:
        """Checks a restored checkpoint against its state record before the loop uses it
        (``replay.run.statefp.verify_restored``; every process calls it).

        Returns:
          the ``Verification`` (``unverified``, with its note, for a checkpoint saved without a record).

        Raises:
          replay.run.statefp.DamagedCheckpointError: the restored state differs from the record (step, leaf
            and shard named: restore the previous checkpoint, or ``replay certify``).
          replay.run.statefp.PoisonedCheckpointError: the record says its replicas disagreed at the save.
        """
        from replay.run import statefp

        return statefp.verify_restored(self.dir.path, step, state, loader_state)
