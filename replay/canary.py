"""Canary: a fixed, versioned batch and fixed weights through forward and backward on each device.

A canary is a cheap health check of every device, independent of any training step::

    batch   = the global batch of the run config's ``canary.step`` (rebuilt by the loader;
              ``--rows`` keeps its first rows)
    weights = a named checkpoint (``--checkpoint N``) or the trainer's initialization from the
              run config's ``canary.seed``
    for each chosen device d, for each repeat:
        fps_d = trainer.single_device_fingerprints(weights, batch, d)   # {leaf: 64-bit fingerprint}

Every device and every repeat must give the same fingerprints, equal to the *golden* value stored
for this environment (a key over the canary's identity and the environment record: library
versions, XLA flags, JAX config, platform and device kind), in ``<run>/canary/golden.json`` or
``--golden FILE``. When no golden value exists yet it is created from the majority of the
devices (more than half must agree) and the odd devices out are named.

Verdicts (``replay.verdict.Verdict``): ACQUITTED when every device matches; CONVICTED naming the
devices that differ from the golden value or disagree with their own repeats (while others
match); AMBIGUOUS when no majority exists or every device differs from the golden value (an
environment or software change, not a device: re-create it with ``--reset-golden``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from replay import devices as dv
from replay.protocol import FaultSpec
from replay.verdict import Verdict

CANARY_VERSION = 1
GOLDEN_DEFAULT = os.path.join("canary", "golden.json")


@dataclasses.dataclass(frozen=True)
class CanarySpec:
    """The canary's identity: which batch and which weights (versioned)."""

    step: int
    rows: int
    weights: str  # "checkpoint:N" or "init:SEED"
    batch_sha256: str
    version: int = CANARY_VERSION
    program: Optional[str] = None  # None: the one-device program (replay canary); "mesh:..." the periodic one
    seq_len: Optional[int] = None  # None: whole rows; else the first seq_len slots of each row

    @property
    def name(self) -> str:
        base = f"step{self.step}-rows{self.rows}-{self.weights.replace(':', '')}"
        if self.seq_len is not None:
            base += f"-seq{self.seq_len}"
        return base if self.program is None else f"{base}-{self.program.replace(':', '')}"

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "version": self.version, "step": self.step, "rows": self.rows,
             "weights": self.weights, "batch_sha256": self.batch_sha256}
        if self.program is not None:  # absent for the one-device canary: its golden keys are unchanged
            d["program"] = self.program
        if self.seq_len is not None:
            d["seq_len"] = self.seq_len
        return d


def batch_sha256(batch: Mapping[str, np.ndarray]) -> str:
    """sha256 over the batch's arrays (key order sorted; int32 little-endian bytes)."""
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(np.ascontiguousarray(np.asarray(batch[k], "<i4")).tobytes())
    return h.hexdigest()


def fingerprints_signature(fps: Mapping[str, int]) -> str:
    """sha256 of ``{leaf: fingerprint}`` (canonical JSON)."""
    return hashlib.sha256(json.dumps({k: int(v) for k, v in sorted(fps.items())}).encode()).hexdigest()


def environment_key(spec: CanarySpec, env: Mapping[str, Any]) -> str:
    """The golden value's key: sha256 over the canary identity and what decides bits in ``env``."""
    backend = env.get("backend", {})
    backend = backend if isinstance(backend, Mapping) else {}
    keyed = {
        "canary": spec.to_dict(),
        "versions": env.get("versions", {}),
        "env": env.get("env", {}),
        "jax_config": env.get("jax_config", {}),
        "platform": backend.get("platform"),
        "device_kind": backend.get("device_kind"),
    }
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class DeviceResult:
    id: int
    signatures: tuple[str, ...]
    fingerprints: Mapping[str, int]

    @property
    def repeats_agree(self) -> bool:
        return len(set(self.signatures)) == 1


@dataclasses.dataclass(frozen=True)
class CanaryDecision:
    verdict: Verdict
    odd_devices: tuple[int, ...]
    reference: Optional[str]
    golden_status: str  # "matched", "created", "created-not-saved", "absent-no-majority", "mismatch-all"
    statuses: Mapping[int, str]
    explanation: str


def decide_canary(results: Sequence[DeviceResult], golden: Optional[str]) -> CanaryDecision:
    """Judges per-device canary results against ``golden`` (or the majority when None). Pure.

    Raises:
      ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError("decide_canary needs at least one device result")
    consistent = [r for r in results if r.repeats_agree]
    status = "matched"
    reference = golden
    if golden is None:
        counts = collections.Counter(r.signatures[0] for r in consistent)
        top = counts.most_common(2)
        if top and top[0][1] * 2 > len(results) and (len(top) == 1 or top[1][1] < top[0][1]):
            reference, status = top[0][0], "created"
        else:
            statuses = {r.id: ("repeats_disagree" if not r.repeats_agree else "no_majority") for r in results}
            return CanaryDecision(Verdict.AMBIGUOUS, (), None, "absent-no-majority", statuses,
                                  "no golden value and no majority among the devices: run the canary on more "
                                  "devices or with a golden value from a trusted machine")
    statuses = {}
    for r in results:
        if not r.repeats_agree:
            statuses[r.id] = "repeats_disagree"
        elif r.signatures[0] != reference:
            statuses[r.id] = "differs_from_golden" if status == "matched" else "differs_from_majority"
        else:
            statuses[r.id] = "ok"
    odd = tuple(sorted(i for i, s in statuses.items() if s != "ok"))
    if not odd:
        return CanaryDecision(Verdict.ACQUITTED, (), reference, status, statuses,
                              f"all {len(results)} device(s) agree, across repeats, with the "
                              f"{'golden' if status == 'matched' else 'majority'} value")
    if len(odd) == len(results) and all(s == "differs_from_golden" for s in statuses.values()) \
            and len({r.signatures[0] for r in results}) == 1:
        return CanaryDecision(Verdict.AMBIGUOUS, (), reference, "mismatch-all", statuses,
                              "every device agrees with the others but not with the golden value: the "
                              "environment or software changed, not a device; re-create it with --reset-golden")
    return CanaryDecision(Verdict.CONVICTED, odd, reference, status, statuses,
                          f"device(s) {list(odd)} compute different bits from the "
                          f"{'golden' if status == 'matched' else 'majority'} value (or from their own repeats)")


def read_golden(path: Optional[str]) -> dict[str, Any]:
    """The golden table ``{environment key: {"signature": ..., ...}}`` of ``path`` ({} when absent).

    Raises:
      replay.runlog.RunDirError: the file is unreadable, not JSON, or not such a table (a
        corrupt golden value must never be taken for a verdict).
    """
    from replay.runlog import RunDirError

    if path is None or not os.path.exists(path):
        return {}
    hint = "repair or remove it, or pass --reset-golden to start a new table there"
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RunDirError(f"canary golden file {path} is corrupt or unreadable ({e}); {hint}") from None
    bad = [k for k, v in table.items() if not (isinstance(v, dict) and isinstance(v.get("signature"), str))] \
        if isinstance(table, dict) else None
    if bad is None or bad:
        raise RunDirError(f"canary golden file {path} is not a table of golden values "
                          f"({'entries ' + str(bad[:3]) if bad else type(table).__name__}); {hint}")
    return table


def write_golden(path: str, table: Mapping[str, Any]) -> None:
    """Writes the golden table atomically (a temporary file unique to this process, then renamed)."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=2, sort_keys=True)
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def update_golden(path: str, key: str, entry: Mapping[str, Any], reset: bool = False) -> None:
    """Adds ``entry`` under ``key`` to the table at ``path``, under an exclusive lock, re-reading the
    table first so that concurrent canaries on one run do not drop each other's entries (a
    corrupt table is replaced only when ``reset``)."""
    import fcntl

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "." + os.path.basename(path) + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                table = read_golden(path)
            except ValueError:
                if not reset:
                    raise
                table = {}
            table[key] = dict(entry)
            write_golden(path, table)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclasses.dataclass
class CanaryReport:
    spec: CanarySpec
    env_key: str
    devices: list[DeviceResult]
    decision: CanaryDecision
    golden_path: Optional[str]
    repeats: int

    @property
    def exit_code(self) -> int:
        return int(self.decision.verdict.exit_code)

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "kind": "canary",
            "canary": self.spec.to_dict(),
            "environment_key": self.env_key,
            "golden": {"status": d.golden_status, "path": self.golden_path, "signature": d.reference},
            "repeats": self.repeats,
            "devices": [
                {"id": r.id, "signature": r.signatures[0], "signatures": list(r.signatures),
                 "repeats_agree": r.repeats_agree, "status": d.statuses[r.id]}
                for r in self.devices
            ],
            "verdict": d.verdict.value,
            "exit_code": self.exit_code,
            "odd_devices": list(d.odd_devices),
            "explanation": d.explanation,
        }


def run_canary(
    session: Any,
    *,
    device_spec: str = "all",
    repeats: int = 2,
    checkpoint: Optional[int] = None,
    step: Optional[int] = None,
    rows: Optional[int] = None,
    seq_len: Optional[int] = None,
    golden_path: Optional[str] = "default",
    reset_golden: bool = False,
    fault: Optional[FaultSpec] = None,
    advance=lambda n=1: None,
    progress=None,
) -> CanaryReport:
    """Runs the canary on each chosen device ``repeats`` times and judges it (module docstring).

    Args:
      session: a ``replay.engine.Session``.
      device_spec: see ``replay.devices`` (any number of devices >= 1).
      repeats: runs per device, >= 1.
      checkpoint: weights from this checkpoint step; None: the trainer's init from the run
        config's ``canary.seed``.
      step, rows, seq_len: the canary batch: the first ``rows`` rows of the global batch of
        ``step``, each cut to its first ``seq_len`` slots (a valid packed prefix: segment ids and
        positions are cut with the tokens). Defaults: the run config's ``canary.step``,
        ``canary.rows`` and ``canary.seq_len`` (``Setup.canary_*``; the whole global batch and
        whole rows where the setup gives none). ``seq_len`` >= 2, at most the row length.
      golden_path: golden table file; "default": ``<run>/canary/golden.json``; None: in memory only.
      reset_golden: ignore and overwrite this environment's golden value.
      fault: a drill: flips a bit in ``fault.device_id``'s gradient.
      advance: called with 1 after each canary run (one device, one repeat).
      progress: a ``total -> advance`` factory (``replay.progress.StepProgress.advance``), called
        once with the number of runs (devices x repeats) when they are known; replaces ``advance``.

    Raises:
      replay.devices.DeviceSpecError; replay.runlog.RunDirError (no such checkpoint); ValueError.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    run, setup = session.run, session.setup
    step = setup.canary_step if step is None else step
    if rows is None:
        rows = min(setup.canary_rows or setup.global_batch, setup.global_batch)
    if not 1 <= rows <= setup.global_batch:
        raise ValueError(f"canary rows must be in [1, {setup.global_batch}], got {rows}")
    seq_len = setup.canary_seq_len if seq_len is None else seq_len
    if step < 0:
        raise ValueError(f"canary step must be >= 0, got {step}")
    chosen = dv.select_devices(device_spec, session.device_infos(), run.held_suspect, minimum=1)
    path = os.path.join(run.run_dir, GOLDEN_DEFAULT) if golden_path == "default" else golden_path
    if not reset_golden:
        read_golden(path)  # a corrupt golden file is reported before any device work
    home = session.home_assignment()
    host = session.numpy_batch(step, home)
    row_len = int(next(iter(host.values())).shape[1])
    if seq_len is not None and not 2 <= seq_len <= row_len:
        raise ValueError(f"canary seq_len must be in [2, {row_len}] (the row length), got {seq_len}")
    if seq_len == row_len:
        seq_len = None  # whole rows: the same canary as without a cut
    batch = {k: v[:rows, :seq_len] for k, v in host.items()}
    if checkpoint is not None:
        if checkpoint not in run.checkpoints:
            from replay.runlog import MissingCheckpointError

            raise MissingCheckpointError(f"no checkpoint {checkpoint}; checkpoints: {run.checkpoints or 'none'}")
        state = session.restore(checkpoint, home)
        weights = f"checkpoint:{checkpoint}"
    else:
        state = session.init_state(home, setup.canary_seed)
        weights = f"init:{setup.canary_seed}"
    spec = CanarySpec(step=step, rows=rows, weights=weights, batch_sha256=batch_sha256(batch), seq_len=seq_len)
    env_key = environment_key(spec, run.env)
    if progress is not None:
        advance = progress(len(chosen) * repeats)
    results = []
    for d in chosen:
        dev = session.jax_devices[d.id]
        sigs, fps = [], {}
        for _ in range(repeats):
            fps = setup.trainer.single_device_fingerprints(state, batch, dev, fault)
            sigs.append(fingerprints_signature(fps))
            advance(1)
        results.append(DeviceResult(d.id, tuple(sigs), dict(fps)))
    if reset_golden:
        golden = None
    else:
        golden = (read_golden(path).get(env_key) or {}).get("signature")
    decision = decide_canary(results, golden)
    if path is not None and decision.golden_status == "created" and fault is None:
        try:
            update_golden(path, env_key, {"signature": decision.reference, "canary": spec.to_dict(),
                                           "created_from": f"majority of {len(results)} device(s)"}, reset_golden)
        except OSError as e:  # e.g. a read-only run directory: the verdict stands, the golden value is not kept
            decision = dataclasses.replace(
                decision, golden_status="created-not-saved",
                explanation=f"{decision.explanation} (the golden value could not be saved to {path}: "
                            f"{e.strerror or e}; pass --golden FILE)")
    return CanaryReport(spec, env_key, results, decision, path, repeats)
