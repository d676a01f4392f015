"""The reference MoE trainer: a small JAX MoE decoder, a sharded train step with per-device
gradient fingerprints, Orbax checkpoints and a run directory for replay.

Public API::

    from replay.reference import ReferenceTrainer, ModelConfig, OptimizerConfig, make_mesh
    trainer = ReferenceTrainer(ModelConfig(vocab_size=...), OptimizerConfig())
    mesh = make_mesh({"data": -1, "expert": 2})
    state = trainer.init_state(mesh, seed=0)
    state, fingerprints = trainer.train_step(state, batch, step, fault=None)
    state, loader_state = trainer.restore(run_dir, step, mesh)
    trainer.single_device_fingerprints(state, batch, device)      # canaries
    trainer.device_contributions(state, batch, step)              # per-device gradients

    from replay.reference.run import load_run_config, make_trainer, build_loader, canary_batch
    from replay.reference.loop import train, Launch, Output    # the training loop (attempt, hooks)
    from replay.reference.drills import DrillHooks              # drills only: faults into the loop

Command line: ``python -m replay.reference.train --run <dir> --config <run.yaml> --steps N``.
"""

from replay.reference.model import ModelConfig, ModelConfigError
from replay.reference.trainer import (
    FaultSpecError,
    OptimizerConfig,
    ReferenceTrainer,
    TrainerConfigError,
    device_coords,
    device_rows,
    make_mesh,
)

__all__ = [
    "ModelConfig", "ModelConfigError", "OptimizerConfig", "ReferenceTrainer", "TrainerConfigError",
    "FaultSpecError", "make_mesh", "device_coords", "device_rows",
]
