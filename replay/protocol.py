"""The trainer protocol: what replay needs from a trainer, and the run directory it reads.

A user's own trainer plugs into replay by implementing :class:`Trainer`; the reference MoE
trainer in ``replay.reference`` is one implementation. Replay never imports a trainer's
internals: it builds one from the run config, restores a checkpoint read-only, and calls
:meth:`Trainer.train_step` on batches rebuilt by the loader.

The run directory a training run leaves (DESIGN.md, "The run directory")::

    <run>/
      run_config.yaml       # the run config as used (model, mixture, dataset, global batch, seed, mesh, ...)
      env.json              # environment record (see replay.reference / env module)
      events.jsonl          # one JSON object a line: {"event": ..., "step": ..., ...}
      fingerprints.jsonl    # one StepFingerprints.to_json() a line, appended every step
      checkpoints/<step>/   # Orbax checkpoints: params, optimizer state, loader state
      quarantine.txt        # optional: device ids (one a line, '#' comments) held suspect

Glossary: *step* is the global training step (the batch of step ``s`` holds global rows
``[s*B, (s+1)*B)``); *device id* is ``jax.Device.id``; *leaf path* is
``jax.tree_util.keystr`` of a parameter leaf; a *fingerprint* is the order-independent
integer fingerprint of DESIGN.md ("Gradient fingerprints").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A simulated silent data corruption: flip one bit of one device's local gradient.

    Attributes:
      step: the global step at which the fault fires.
      device_id: ``jax.Device.id`` of the device whose local gradient contribution (before
        the data-parallel reduction) is corrupted.
      leaf: leaf path (``jax.tree_util.keystr``) of the parameter whose gradient is hit.
      element: flat index into that device's local shard of the gradient leaf.
      bit: bit position in the element's bit pattern (0 = lowest mantissa bit).
    """

    step: int
    device_id: int
    leaf: str
    element: int
    bit: int


@dataclasses.dataclass(frozen=True)
class StepFingerprints:
    """What one train step computed, in integers that compare bit for bit.

    Attributes:
      step: global step.
      loss_bits: float32 bit pattern of the loss, as an unsigned int.
      grad_norm_bits: float32 bit pattern of the global gradient norm.
      batch_hash: fingerprint of the batch's ``inputs`` tokens (hex string).
      leaves: per leaf path, ``{"fp": int, "nan": int, "inf": int}`` of the reduced gradient.
      devices: per device id, per leaf path, the fingerprint (int) of that device's local
        gradient contribution before the data-parallel reduction.
      router: router health figures (per-expert token share, dropped fraction, entropy,
        z-loss), floats, for humans; never compared bit for bit.
      device_coords: per device id, its mesh coordinates ``{axis name: index}``, so that a
        replay on another device set can match shards by position (added; default empty).
    """

    step: int
    loss_bits: int
    grad_norm_bits: int
    batch_hash: str
    leaves: Mapping[str, Mapping[str, int]]
    devices: Mapping[int, Mapping[str, int]]
    router: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    device_coords: Mapping[int, Mapping[str, int]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; device ids become string keys (JSON objects key by str)."""
        return {
            "step": int(self.step),
            "loss_bits": int(self.loss_bits),
            "grad_norm_bits": int(self.grad_norm_bits),
            "batch_hash": self.batch_hash,
            "leaves": {k: {f: int(v) for f, v in d.items()} for k, d in self.leaves.items()},
            "devices": {str(dev): {k: int(v) for k, v in d.items()} for dev, d in self.devices.items()},
            "router": dict(self.router),
            "device_coords": {str(dev): {a: int(i) for a, i in c.items()} for dev, c in self.device_coords.items()},
        }

    def to_json(self) -> str:
        """One line of ``fingerprints.jsonl`` (keys sorted, no newline)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StepFingerprints":
        """Inverse of :meth:`to_dict` (device ids back to int). Unknown keys are ignored.

        Raises:
          KeyError: a required field is missing.
        """
        return cls(
            step=int(d["step"]),
            loss_bits=int(d["loss_bits"]),
            grad_norm_bits=int(d["grad_norm_bits"]),
            batch_hash=str(d["batch_hash"]),
            leaves={k: {f: int(v) for f, v in x.items()} for k, x in d["leaves"].items()},
            devices={int(dev): {k: int(v) for k, v in x.items()} for dev, x in d["devices"].items()},
            router=dict(d.get("router", {})),
            device_coords={int(dev): dict(c) for dev, c in d.get("device_coords", {}).items()},
        )

    @classmethod
    def from_json(cls, line: str) -> "StepFingerprints":
        """Parses one line of ``fingerprints.jsonl``."""
        return cls.from_dict(json.loads(line))

    def bits_equal(self, other: "StepFingerprints") -> bool:
        """True when every bit-compared field (all but ``router``) is equal."""
        a, b = self.to_dict(), other.to_dict()
        a.pop("router"), b.pop("router")
        return a == b


@runtime_checkable
class Trainer(Protocol):
    """A trainer that replay can drive.

    Implementations must be deterministic: the same state and batch on the same mesh give
    bit-identical fingerprints.
    """

    def init_state(self, mesh: Any, seed: int) -> Any:
        """Returns a fresh train state (parameters and optimizer state) placed on ``mesh``."""

    def restore(self, run_dir: str, step: int, mesh: Any) -> tuple[Any, Mapping[str, Any]]:
        """Restores, read-only, the checkpoint saved at ``step`` onto ``mesh``.

        Returns ``(train_state, loader_state_dict)``.

        Raises:
          FileNotFoundError: there is no checkpoint at ``step``.
        """

    def train_step(
        self, state: Any, batch: Mapping[str, Any], step: int, fault: Optional[FaultSpec] = None
    ) -> tuple[Any, StepFingerprints]:
        """Runs one optimizer step on ``batch`` (the loader's global arrays).

        ``fault``, when given and ``fault.step == step``, flips the bit it names before the
        data-parallel reduction (a drill). Returns the new state and the step's fingerprints.
        """


# --- Run directory names and readers (added with the reference trainer) ------------------

RUN_CONFIG_NAME = "run_config.yaml"
ENV_NAME = "env.json"
EVENTS_NAME = "events.jsonl"
FINGERPRINTS_NAME = "fingerprints.jsonl"
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_NAME = "quarantine.txt"


def read_fingerprints(run_dir: str) -> dict[int, StepFingerprints]:
    """Reads ``<run_dir>/fingerprints.jsonl`` into ``{step: StepFingerprints}``.

    A later line for the same step replaces an earlier one (the trainer truncates on
    restart, so this only matters for files written by other tools). A torn last line (a
    process killed mid-write) is skipped.

    Raises:
      FileNotFoundError: the file does not exist.
    """
    import os

    out: dict[int, StepFingerprints] = {}
    with open(os.path.join(run_dir, FINGERPRINTS_NAME), encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            fp = StepFingerprints.from_json(line)
        except (ValueError, KeyError):
            if i >= len(lines) - 2:  # torn final line
                continue
            raise
        out[fp.step] = fp
    return out


def read_events(run_dir: str) -> list[dict[str, Any]]:
    """Reads ``<run_dir>/events.jsonl`` (one dict per event, in order; a torn last line is skipped)."""
    import os

    path = os.path.join(run_dir, EVENTS_NAME)
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out
