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

Verdicts (``replay.run.codes.Verdict``): ACQUITTED when every device matches; CONVICTED naming the
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

from replay.run.codes import Verdict

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
      replay.run.runlog.RunDirError: the file is unreadable, not JSON, or not such a table (a
        corrupt golden value must never be taken for a verdict).
    """
    from replay.run.runlog import RunDirError

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
    corrupt table is replaced only when ``reset``; the lock: ``common.locks``, on ``.<name>.lock``
    beside the table)."""
    from common import locks

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with locks.held(os.path.join(folder, "." + os.path.basename(path) + ".lock")):
        try:
            table = read_golden(path)
        except ValueError:
            if not reset:
                raise
            table = {}
        table[key] = dict(entry)
        write_golden(path, table)
