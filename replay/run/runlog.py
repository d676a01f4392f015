"""Reading a run directory (layout in ``replay.run.protocol``). I/O only: no JAX, no decisions.

:func:`load_run` reads everything replay needs, once, and checks it, so that a broken run
directory is reported before any device work starts::

    run_config.yaml      -> RunLog.config  (dict; as in force: the mixture is the run's own copy
                            when it kept one, and skip windows requested by `replay skip` are added;
                            RunLog.config_file is the file as written)
    env.json             -> RunLog.env     (dict)
    events.jsonl         -> RunLog.lineage (replay.run.lineage: attempts, lineage, superseded steps);
                            RunLog.events  (the lineage's events, in order: superseded ones left out);
                            RunLog.all_events (every event)
    fingerprints.jsonl   -> RunLog.fingerprints  {step: StepFingerprints}; a step logged twice
                            (a run killed and resumed) keeps its last line; lines that disagree
                            are listed in RunLog.relogged_conflicts
    checkpoints/<step>/  -> RunLog.checkpoints (sorted steps; Orbax temporaries ignored)
    quarantine.txt       -> RunLog.quarantine (device ids)
    suspects.json        -> RunLog.suspects (device ids named by `replay scan`)

The screening logs (signals.jsonl, canary.jsonl) are read by ``replay.screen.scan`` only.

Step ranges are half-open, ``A:B`` meaning steps ``A, A+1, ..., B-1`` (like Python slices);
``A`` alone is the one step ``A``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Mapping, Optional

import yaml

from replay.run import inputs as run_inputs
from replay.runtime.devices import QUARANTINE_NAME, DeviceSpecError, read_quarantine
from replay.run.lineage import Lineage, lineage_of_run
from replay.run.protocol import (EVENT_HELP, SealCheck, StepFingerprints, event_problem, log_files, merge_step_parts,
                                 seals_every_line, shard_name, step_of)

RUN_CONFIG = "run_config.yaml"
ENV_JSON = "env.json"
EVENTS = "events.jsonl"
FINGERPRINTS = "fingerprints.jsonl"
CHECKPOINTS = "checkpoints"
SUSPECTS = "suspects.json"
RUN_DIR_FILES = (RUN_CONFIG, ENV_JSON, FINGERPRINTS)  # what makes a folder a run directory
RUN_ENV_VAR = "REPLAY_RUN"  # the run directory when --run is not given


class RunDirError(ValueError):
    """The run directory is missing, incomplete or unreadable; the message names the file.

    Attributes:
      nearest: for a run directory that is not there, or a folder that is not one, the nearest
        existing run directory (:func:`nearest_run_dir`), also named in the message; else None.
    """

    def __init__(self, message: str, *, nearest: Optional[str] = None):
        super().__init__(message)
        self.nearest = nearest


class MissingCheckpointError(RunDirError):
    """No checkpoint at or before the step a replay must start from."""


class StepRangeError(RunDirError):
    """The step range asks for steps the run did not log.

    Attributes:
      start, stop: the half-open range asked for.
      logged: ``(first, stop)``, the half-open span of logged steps (None when not the issue).
      suggestion: ``(start, stop)`` of the nearest logged range to try instead (the logged part of
        a range partly outside, or a range of the same length at the near end of the log), or None.
    """

    def __init__(self, message: str, *, start: Optional[int] = None, stop: Optional[int] = None,
                 logged: Optional[tuple[int, int]] = None, suggestion: Optional[tuple[int, int]] = None):
        super().__init__(message)
        self.start, self.stop, self.logged, self.suggestion = start, stop, logged, suggestion

    @classmethod
    def outside(cls, start: int, stop: int, first: int, end: int, run_dir: str) -> "StepRangeError":
        """The error for ``[start, stop)`` not inside the logged span ``[first, end)`` of ``run_dir``.

        A range partly outside names the part that is (``steps 20:25 were not logged``) and
        suggests the logged part; a range entirely outside suggests the range of the same length
        at the near end of the log (the whole log when that is shorter).
        """
        span = f"the logged steps {first}:{end} of {run_dir}"
        if start >= end or stop <= first:
            length = stop - start
            if length <= end - first:
                near = (end - length, end) if start >= end else (first, first + length)
                hint = f"the nearest logged range of the same length is {near[0]}:{near[1]}"
            else:
                near = (first, end)
                hint = f"all {end - first} logged steps are {first}:{end} (fewer than the {length} asked for)"
            return cls(f"steps {start}:{stop} are outside {span}; {hint}", start=start, stop=stop,
                       logged=(first, end), suggestion=near)
        parts = ([f"{start}:{first}"] if start < first else []) + ([f"{end}:{stop}"] if stop > end else [])
        near = (max(start, first), min(stop, end))
        return cls(f"steps {start}:{stop} are partly outside {span}: steps {' and '.join(parts)} were not "
                   f"logged; the logged part is {near[0]}:{near[1]}", start=start, stop=stop,
                   logged=(first, end), suggestion=near)


class StepsSpecError(ValueError):
    """A ``--steps`` value is malformed (a usage error)."""


def parse_steps(spec: str) -> tuple[int, int]:
    """Parses ``"A:B"`` (half-open) or ``"A"`` into ``(start, stop)``.

    Raises:
      StepsSpecError: not of that form, negative, or ``stop <= start``.
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", spec or "")
    if not m and re.fullmatch(r"\s*-?\d+\s*(?::\s*-?\d+\s*)?", spec or ""):
        raise StepsSpecError(f"--steps: steps count from 0, got {spec!r}; give A:B with 0 <= A < B "
                             f"(half-open, steps A..B-1) or one step A >= 0")
    if not m:
        raise StepsSpecError(f"--steps: expected A:B (half-open, steps A..B-1) or A, got {spec!r}")
    start = int(m.group(1))
    stop = int(m.group(2)) if m.group(2) is not None else start + 1
    if stop <= start:
        raise StepsSpecError(f"--steps: empty range {spec!r}: stop {stop} must be > start {start}")
    return start, stop


def _read_jsonl(path: str, strict: bool = True,
                check: Optional[Callable[[Any], Optional[str]]] = None, what: str = "") -> list[dict[str, Any]]:
    """One dict per non-empty line. A run killed mid-write may leave a torn last line: it is
    skipped; a bad line anywhere else is an error (``strict``) or skipped (events, which are
    informational: a torn line that a resumed run appended to). ``check``: each parsed line's problem
    or None (``protocol.event_problem``); a problem is a :class:`RunDirError` naming the file, the line,
    the key path and ``what`` to do."""
    text = _read_text(path)
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    out = []
    for i, (n, line) in enumerate(lines):
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            if not strict:
                continue
            raise RunDirError(f"{path}:{n}: not JSON ({e.msg})") from None
        why = check(d) if check is not None else None
        if why is not None:
            raise RunDirError(f"{path}:{n}: {why}; {what}")
        out.append(d)
    return out


def _check_event(d: Any) -> Optional[str]:
    """A line of events.jsonl checked on read (``protocol.event_problem``, worded for the run log);
    ``benchmarks/runlog.py`` times load_run with and without it."""
    why = event_problem(d)
    return None if why is None else f"not an event: {why}"


def _read_text(path: str) -> str:
    """A file's UTF-8 text; an unreadable or non-UTF-8 file is a :class:`RunDirError` naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise RunDirError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): corrupted?") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read ({e.strerror or e})") from None


def missing_steps(logged: Mapping[int, Any], start: int, stop: int, limit: int = 10) -> list[int]:
    """The first ``limit`` steps of ``[start, stop)`` not in ``logged``, in O(len(logged) + limit)
    whatever the span (a sparse or damaged log must not make replay walk 10**9 steps)."""
    inside = sum(1 for s in logged if start <= s < stop)
    if inside >= stop - start:
        return []
    out = []
    step = start
    while len(out) < limit and step < stop:
        if step not in logged:
            out.append(step)
        step += 1
    return out


@dataclasses.dataclass
class RunLog:
    """What a training run left for triage (see the module docstring)."""

    run_dir: str
    config: dict[str, Any]
    env: dict[str, Any]
    events: list[dict[str, Any]]
    fingerprints: dict[int, StepFingerprints]
    relogged_conflicts: list[int]
    checkpoints: list[int]
    quarantine: frozenset[int]
    malformed: dict[int, str] = dataclasses.field(default_factory=dict)  # step -> why its line is unusable
    suspects: frozenset[int] = frozenset()  # devices named by the last `replay scan` (suspects.json)
    lineage: Optional[Lineage] = None  # attempts and lineage (replay.run.lineage); None: not computed
    all_events: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # events of every attempt
    config_file: dict[str, Any] = dataclasses.field(default_factory=dict)  # run_config.yaml as written
    notes: list[str] = dataclasses.field(default_factory=list)  # what a command should tell (inputs used)
    pending_superseded: list[int] = dataclasses.field(default_factory=list)  # logged steps past a pending rewind

    @property
    def held_suspect(self) -> frozenset[int]:
        """Devices held suspect: quarantined (quarantine.txt) or named by ``replay scan`` (suspects.json).
        ``--devices good`` leaves them out, ``--devices suspect`` picks them."""
        return self.quarantine | self.suspects

    @property
    def logged_steps(self) -> tuple[int, int]:
        """``(first, stop)``: the half-open span of logged steps."""
        steps = sorted(self.fingerprints)
        return steps[0], steps[-1] + 1

    def check_range(self, start: int, stop: int, allow_malformed: bool = False) -> None:
        """Raises :class:`StepRangeError` unless every step of ``[start, stop)`` was logged (and, unless
        ``allow_malformed``, with well-formed fingerprints: ``inspect`` needs only the steps). A range
        partly or entirely outside the logged span carries the nearest logged range to try
        (:meth:`StepRangeError.outside`)."""
        bad = sorted(s for s in self.malformed if start <= s < stop)
        if bad and not allow_malformed:
            raise StepRangeError(
                f"step {bad[0]}: its logged fingerprints are malformed ({self.malformed[bad[0]]}); replay "
                f"cannot judge steps {bad[:10]} of {start}:{stop} (a damaged log, not a device fault)")
        logged = {**self.malformed, **self.fingerprints} if allow_malformed else self.fingerprints
        first, end = min(logged), max(logged) + 1
        if start < first or stop > end:
            raise StepRangeError.outside(start, stop, first, end, self.run_dir)
        missing = missing_steps(logged, start, stop)
        if missing:
            raise StepRangeError(f"steps {missing} of {start}:{stop} have no logged fingerprints")

    def checkpoint_for(self, step: int) -> int:
        """The newest checkpoint step ``<= step``.

        Raises:
          MissingCheckpointError: none (the message lists the checkpoints there are).
        """
        usable = [c for c in self.checkpoints if c <= step]
        if not usable:
            raise MissingCheckpointError(
                f"no checkpoint at or before step {step} in {os.path.join(self.run_dir, CHECKPOINTS)} "
                f"(checkpoints: {self.checkpoints or 'none'}); a replay restores one"
            )
        return usable[-1]

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        """The events whose ``event`` field is one of ``kinds``, in log order."""
        return [e for e in self.events if e.get("event") in kinds]

    def replay_checkpoint(self, start: int, stop: int, log: Mapping[int, Any]) -> int:
        """The checkpoint a replay of ``[start, stop)`` against ``log`` (``{step: StepFingerprints}``) starts
        from, once the log is known to be one replay can judge: fingerprints of this code's formula, every
        step of the range logged, and every step from the checkpoint to ``start`` (replayed and checked
        too) logged and well formed.

        Raises:
          RunDirError: another fingerprint formula; a malformed or missing step before ``start``.
          StepRangeError, MissingCheckpointError: as :meth:`check_range`, :meth:`checkpoint_for`.
        """
        from replay.run.fingerprint import version_mismatch

        problem = version_mismatch(self.env)  # other formula: every leaf would differ, a false conviction
        if problem:
            raise RunDirError(f"{os.path.join(self.run_dir, ENV_JSON)}: {problem}")
        self.check_range(start, stop)
        ckpt = self.checkpoint_for(start)
        bad = sorted(s for s in self.malformed if ckpt <= s < start and s not in log)
        if bad:
            raise RunDirError(f"step {bad[0]} (between checkpoint {ckpt} and {start}, replayed and checked too): "
                              f"its logged fingerprints are malformed ({self.malformed[bad[0]]})")
        missing = missing_steps(log, ckpt, start)
        if missing:
            raise RunDirError(f"steps {missing[:10]} between checkpoint {ckpt} and {start} have no logged fingerprints")
        return ckpt

    def skip_windows(self) -> list[tuple[int, int]]:
        """Inclusive training-step windows whose data the run skipped, from the run config and events.jsonl.

        The run config's ``skip_windows: [[A, B], ...]`` (what the loader is built with) plus events of
        kind ``skipped_window`` with ``start`` and ``end`` fields (for the report).
        """
        out = []
        for w in self.config.get("skip_windows", []) or []:
            out.append((int(w[0]), int(w[1])))
        for e in self.events_of("skipped_window"):
            lo, hi = e.get("start"), e.get("end")
            if lo is not None and hi is not None and (int(lo), int(hi)) not in out:
                out.append((int(lo), int(hi)))
        return sorted(out)

    def dropped_updates(self) -> frozenset[int]:
        """Steps of the lineage whose update the run dropped (``non_finite`` events with ``action:
        skip_step``): the next step started from the state before them."""
        return frozenset(int(e["step"]) for e in self.events
                         if e.get("event") == "non_finite" and e.get("action") == "skip_step")

    def phase_changes(self) -> list[dict[str, Any]]:
        """The run's logged mixture phase changes (events of kind ``phase``/``phase_change``)."""
        return self.events_of("phase", "phase_change", "mixture_phase")

    @property
    def mesh(self) -> Mapping[str, Any]:
        """The run's mesh record from env.json (``axis_names``, ``shape``, ``device_ids``, ``device_coords``)."""
        return self.env.get("mesh", {})

    @property
    def mesh_size(self) -> int:
        n = 1
        for s in self.mesh.get("shape", []):
            n *= int(s)
        return n


class RunNotGivenError(ValueError):
    """No run directory was named: no ``--run``, no ``REPLAY_RUN``, and the current folder is not one
    (a usage error)."""


def is_run_dir(path: str) -> bool:
    """True when ``path`` holds the files every run directory has (``RUN_DIR_FILES``: run_config.yaml,
    env.json, fingerprints.jsonl; the reference trainer writes them at its first step)."""
    return all(os.path.isfile(os.path.join(path, name)) for name in RUN_DIR_FILES)


_NOT_SEARCHED = frozenset({CHECKPOINTS, "node_modules", "__pycache__", "site-packages", "proc", "sys", "dev"})


def nearest_run_dir(path: str, *, depth: int = 3, max_folders: int = 2000,
                    siblings: bool = True) -> Optional[str]:
    """The existing run directory (:func:`is_run_dir`) nearest to ``path``, a run directory that is
    not there or a folder that is not one; None when there is none near.

    Where it looks: from the nearest existing folder at or above ``path``, that folder and its two
    parents when they are run directories, and the folders up to ``depth`` levels below it; when
    none is there and ``path`` is itself a folder (e.g. a dataset beside the run), the same below
    its parent (with ``siblings``). Never below the file system's root; at most ``max_folders``
    folders in all, breadth first; hidden folders, ``checkpoints`` and run directories' insides
    are not entered. Of the run directories found, the one whose path is most like ``path``
    (``difflib`` ratio; then the shallower), spelled as ``path`` is: relative when it is relative.
    Never ``path`` itself.

    Args:
      path: the run directory asked for.
      depth, max_folders: the search's bounds (a typo next to a large tree costs at most this).
      siblings: also look below an existing ``path``'s parent.

    Returns:
      the run directory's path, or None.
    """
    import difflib

    given = os.path.normpath(path or ".")
    base = given
    while base and not os.path.isdir(base):
        parent = os.path.dirname(base)
        base = parent if parent != base else ""
    base = base or ("/" if os.path.isabs(given) else ".")
    found: list[str] = []
    up = base
    for _ in range(3):
        if os.path.normpath(up) != given and is_run_dir(up):
            found.append(os.path.normpath(up))
        up = os.path.join(up, os.pardir)
    budget = [max_folders]
    top = base
    for _ in range(2 if siblings and base == given else 1):
        if found:
            break
        if os.path.dirname(os.path.abspath(top)) == os.path.abspath(top):  # the root: too far to guess
            return None
        found = [c for c in _run_dirs_below(top, depth, budget) if c != given]
        top = os.path.normpath(os.path.join(top, os.pardir))
    if not found:
        return None
    return max(found, key=lambda c: (difflib.SequenceMatcher(None, given, c).ratio(), -c.count(os.sep)))


def _run_dirs_below(folder: str, depth: int, budget: list[int]) -> list[str]:
    """The run directories up to ``depth`` levels below ``folder``, breadth first, entering at most
    ``budget[0]`` folders (decremented)."""
    found, level = [], [folder]
    for _ in range(depth):
        below = []
        for here in level:
            try:
                with os.scandir(here) as entries:
                    names = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
            except OSError:
                continue
            for name in names:
                if name in _NOT_SEARCHED or budget[0] <= 0:
                    continue
                budget[0] -= 1
                child = os.path.normpath(os.path.join(here, name))
                (found if is_run_dir(child) else below).append(child)
        level = below
    return found


def resolve_run_dir(given: Optional[str], environ: Optional[Mapping[str, str]] = None,
                    cwd: Optional[str] = None) -> tuple[str, str]:
    """The run directory a command works on, and where it came from.

    In this order: ``given`` (``--run``); else the environment variable ``REPLAY_RUN`` when set and
    not empty (taken as is: :func:`load_run` reports a wrong one); else the current folder when it
    is a run directory (:func:`is_run_dir`).

    Args:
      given: the ``--run`` value, or None.
      environ: the environment (default ``os.environ``).
      cwd: the current folder (default ``os.getcwd()``).

    Returns:
      ``(run_dir, source)``, ``source`` one of ``"--run"``, ``"REPLAY_RUN"``, ``"the current folder"``.

    Raises:
      RunNotGivenError: none of the three; the message names all three ways.
    """
    if given:
        return given, "--run"
    env = (os.environ if environ is None else environ).get(RUN_ENV_VAR, "")
    if env:
        return env, RUN_ENV_VAR
    here = os.getcwd() if cwd is None else cwd
    if is_run_dir(here):
        return here, "the current folder"
    lacking = ", ".join(n for n in RUN_DIR_FILES if not os.path.isfile(os.path.join(here, n)))
    near = nearest_run_dir(here if cwd is not None else ".", siblings=False)  # relative to where the user is
    raise RunNotGivenError(
        f"no run directory: pass --run DIR, set {RUN_ENV_VAR}=DIR, or run replay from inside a run "
        f"directory (the current folder {here} is not one: it lacks {lacking})"
        + (f"; the nearest run directory is {near}" if near else ""))


def load_run(run_dir: str, quarantine_file: Optional[str] = None) -> RunLog:
    """Reads and checks a run directory.

    Args:
      run_dir: the run directory.
      quarantine_file: read device quarantine from here instead of ``<run_dir>/quarantine.txt``.

    Raises:
      RunDirError: the directory or one of run_config.yaml, env.json, fingerprints.jsonl is
        missing or unreadable, or no step was logged; a quarantine file is malformed; a line of
        events.jsonl is JSON but not an event (``protocol.Event``: file, line, key path).
    """
    if not os.path.isdir(run_dir):
        near = nearest_run_dir(run_dir)
        raise RunDirError(f"run directory not found: {run_dir}"
                          + (f"; the nearest run directory is {near}" if near else ""), nearest=near)
    paths = {name: os.path.join(run_dir, name) for name in (RUN_CONFIG, ENV_JSON, EVENTS, FINGERPRINTS)}
    for name in RUN_DIR_FILES:
        if not os.path.isfile(paths[name]):
            near = nearest_run_dir(run_dir)
            raise RunDirError(f"{run_dir} is not a run directory: {name} is missing"
                              + (f"; the nearest run directory is {near}" if near else ""), nearest=near)
    try:
        config = yaml.safe_load(_read_text(paths[RUN_CONFIG]))
    except yaml.YAMLError as e:
        raise RunDirError(f"{paths[RUN_CONFIG]}: not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{paths[RUN_CONFIG]}: expected a mapping")
    try:
        env = json.loads(_read_text(paths[ENV_JSON]))
    except json.JSONDecodeError as e:
        raise RunDirError(f"{paths[ENV_JSON]}: not JSON ({e.msg})") from None
    if not isinstance(env, dict):
        raise RunDirError(f"{paths[ENV_JSON]}: expected a JSON object, got {type(env).__name__}")
    if not isinstance(env.get("mesh", {}), dict):
        raise RunDirError(f"{paths[ENV_JSON]}: 'mesh' must be an object, got {type(env['mesh']).__name__}")
    events = _read_jsonl(paths[EVENTS], strict=False, check=_check_event, what=EVENT_HELP) \
        if os.path.isfile(paths[EVENTS]) else []
    fingerprints: dict[int, StepFingerprints] = {}
    malformed: dict[int, str] = {}
    conflicts = set()
    shards, expected, damaged = _fingerprint_shards(run_dir, env)
    seals = SealCheck(seals_every_line(env))
    for n, raw in enumerate(_read_jsonl(paths[FINGERPRINTS]), 1):
        step = raw.get("step") if isinstance(raw, dict) else None
        own = seals.check(raw) if isinstance(raw, dict) else None
        if own is not None:  # changed after it was written: not judged, whatever its step field holds now
            key = _damaged_step(paths[FINGERPRINTS], n, raw, own)
            malformed[key] = f"{paths[FINGERPRINTS]} entry {n}: {own}"
            fingerprints.pop(key, None)
            continue
        if isinstance(step, int) and step in damaged:  # another process's line of this step is damaged
            malformed[step] = damaged[step]
            fingerprints.pop(step, None)
            continue
        lacking = [p for p in expected if step not in shards.get(p, {})]
        try:
            raw = merge_step_parts(raw, [sh[step] for sh in shards.values() if step in sh])
            fp = StepFingerprints.from_dict(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunDirError(f"{paths[FINGERPRINTS]}: entry {n} is not a StepFingerprints ({e!r})") from None
        problem = _inconsistency(fp)
        if problem is not None and lacking:  # a process stopped before it logged this step
            problem = (f"process {lacking[0]}'s {shard_name(FINGERPRINTS, lacking[0])} has no line for step "
                       f"{fp.step} (that process stopped before logging it?): {problem}")
        if problem is not None:  # a structurally damaged line would read as a device fault: set aside
            malformed[fp.step] = f"{paths[FINGERPRINTS]} entry {n}: {problem}"
            fingerprints.pop(fp.step, None)
            continue
        malformed.pop(fp.step, None)
        old = fingerprints.get(fp.step)
        if old is not None and not old.bits_equal(fp):
            conflicts.add(fp.step)
        fingerprints[fp.step] = fp
    if not fingerprints:
        raise RunDirError(f"{paths[FINGERPRINTS]}: no step was logged"
                          + (f" ({len(malformed)} malformed entries, e.g. {next(iter(malformed.values()))})"
                             if malformed else ""))
    lineage = lineage_of_run(run_dir, events, set(fingerprints) | set(malformed))
    pending = sorted(s for s in fingerprints if s >= lineage.end)  # past a pending rewind: superseded
    for s in pending:
        fingerprints.pop(s)
    for s in [s for s in malformed if s >= lineage.end]:
        malformed.pop(s)
    conflicts = {s for s in conflicts if s < lineage.end}
    if not fingerprints:
        raise RunDirError(f"{run_dir}: every logged step is past the rewind to checkpoint "
                          f"{(lineage.pending_rewind or {}).get('checkpoint')} that 'replay skip' recorded: "
                          "nothing is left to read until training resumes (python -m replay.reference.train --run "
                          f"{run_dir})")
    notes: list[str] = []
    in_force = dict(config)
    try:
        resolved = run_inputs.resolve(run_dir, config)
    except run_inputs.InputsChangedError as e:
        raise RunDirError(str(e)) from None
    if config.get("mixture") is not None:
        in_force["mixture"] = resolved.mixture
    notes += resolved.notes
    if lineage.skip_windows:
        windows = [tuple(w) for w in config.get("skip_windows") or []]
        extra = [list(w) for w in lineage.skip_windows if tuple(w) not in windows]
        if extra:
            in_force["skip_windows"] = sorted([list(w) for w in windows] + extra)
    ckpt_dir = os.path.join(run_dir, CHECKPOINTS)
    checkpoints = sorted(
        int(name) for name in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else [])
        if name.isdigit() and os.path.isdir(os.path.join(ckpt_dir, name))
    )
    return RunLog(
        run_dir=run_dir, config=in_force, env=env, events=list(lineage.events), fingerprints=fingerprints,
        relogged_conflicts=sorted(conflicts), checkpoints=[c for c in checkpoints if c <= lineage.end],
        quarantine=_quarantine(run_dir, quarantine_file), malformed=malformed, suspects=read_suspects(run_dir),
        lineage=lineage, all_events=events, config_file=config, notes=notes, pending_superseded=pending,
    )


def _quarantine(run_dir: str, quarantine_file: Optional[str]) -> frozenset[int]:
    """The devices held suspect: ``quarantine_file``'s, else ``<run_dir>/quarantine.txt``'s, else none.

    Raises:
      RunDirError: the file is missing (given), unreadable or not a list of device ids.
    """
    try:
        if quarantine_file is not None:
            return read_quarantine(quarantine_file)
        if os.path.exists(os.path.join(run_dir, QUARANTINE_NAME)):
            return read_quarantine(os.path.join(run_dir, QUARANTINE_NAME))
        return frozenset()
    except FileNotFoundError:
        raise RunDirError(f"quarantine file not found: {quarantine_file}") from None
    except DeviceSpecError as e:
        raise RunDirError(str(e)) from None
    except UnicodeDecodeError as e:
        where = quarantine_file or os.path.join(run_dir, QUARANTINE_NAME)
        raise RunDirError(f"{where}: not a text file of device ids ({e.reason} at byte {e.start})") from None
    except OSError as e:
        where = quarantine_file or os.path.join(run_dir, QUARANTINE_NAME)
        raise RunDirError(f"quarantine file {where}: cannot read ({e.strerror or e})") from None


def _fingerprint_shards(run_dir: str, env: Mapping[str, Any]
                        ) -> tuple[dict[int, dict[int, dict]], list[int], dict[int, str]]:
    """The other processes' fingerprint lines ``{process: {step: line}}`` (``replay.run.writer``: process
    p >= 1 writes its devices' entries to ``fingerprints.pNNNNN.jsonl``), the processes >= 1 that
    env.json says the run had (each must have logged every step), and ``{step: why}`` for the steps
    whose line in one of those files fails its checksum (``protocol.line_damage``: not judged).

    Raises:
      RunDirError: a shard file is unreadable or has a malformed line (not its last).
    """
    out: dict[int, dict[int, dict]] = {}
    damaged: dict[int, str] = {}
    for p, path in log_files(run_dir, FINGERPRINTS)[1:]:
        out[p] = {}
        seals = SealCheck(seals_every_line(env))
        for n, raw in enumerate(_read_jsonl(path), 1):
            if not isinstance(raw, dict):
                continue
            damage = seals.check(raw)
            if damage is not None:  # whatever its step field holds now
                damaged.setdefault(_damaged_step(path, n, raw, damage), f"{path} entry {n}: {damage}")
                continue
            if isinstance(raw.get("step"), int):
                out[p][raw["step"]] = raw
    backend = env.get("backend") if isinstance(env.get("backend"), dict) else {}
    try:
        count = int(backend.get("process_count", 1) or 1)
    except (TypeError, ValueError):
        count = 1
    return out, list(range(1, count)), damaged


def _damaged_step(path: str, n: int, raw: Mapping[str, Any], damage: str) -> int:
    """The step a damaged line of ``path`` (entry ``n``) is the damage of (``protocol.step_of``: 5, 5.0 or
    "5" alike).

    Raises:
      RunDirError: the line names no step at all (then no step can be set aside for it).
    """
    key = step_of(raw)
    if key is None:
        raise RunDirError(f"{path}: entry {n}: {damage} (its step {raw.get('step')!r} names no step)")
    return key


def read_suspects(run_dir: str) -> frozenset[int]:
    """The devices ``<run_dir>/suspects.json`` (written by ``replay scan``) names; empty when absent.

    Raises:
      RunDirError: the file is not a scan report.
    """
    path = os.path.join(run_dir, SUSPECTS)
    if not os.path.exists(path):
        return frozenset()
    try:
        data = json.loads(_read_text(path))
        return frozenset(int(d) for d in data["suspect_devices"])
    except (ValueError, KeyError, TypeError) as e:
        raise RunDirError(f"{path}: not a replay scan report ({e!r}); rerun 'replay scan' or remove it") from None


def _inconsistency(fp: StepFingerprints) -> Optional[str]:
    """Why a logged step cannot be judged, or None: every device must fingerprint every leaf of the
    reduced gradient, and the devices must be those of ``device_coords`` (when recorded). A missing
    entry is damage to the log, and compared with a replay it would look like a faulty device."""
    leaves = set(fp.leaves)
    if not leaves or not fp.devices:
        return "no leaves or no devices"
    if fp.device_coords and set(fp.device_coords) != set(fp.devices):
        return (f"devices {sorted(fp.devices)} do not match the mesh coordinates' devices "
                f"{sorted(fp.device_coords)}")
    for dev, fps in fp.devices.items():
        if set(fps) != leaves:
            lacking = sorted(leaves - set(fps)) or sorted(set(fps) - leaves)
            return f"device {dev}'s leaves differ from the step's leaves ({lacking[:3]})"
    return None
