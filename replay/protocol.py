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
    """

    step: int
    loss_bits: int
    grad_norm_bits: int
    batch_hash: str
    leaves: Mapping[str, Mapping[str, int]]
    devices: Mapping[int, Mapping[str, int]]
    router: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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
