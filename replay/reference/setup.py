"""The reference trainer's factory: what ``replay`` rebuilds a reference-trainer run from.

Named by the run config's ``trainer:`` key (``replay.reference.setup:make_setup``, the default for a
run config without the key: ``replay.run.setup.REFERENCE_FACTORY``). ``replay`` imports it by name,
so that the rooms that read runs never import the trainer.
"""

from __future__ import annotations

import os

from replay.run.runlog import RunDirError, RunLog
from replay.run.setup import RunSetup, mesh_record


def make_setup(run: RunLog) -> RunSetup:
    """The :class:`RunSetup` of a reference-trainer run, from its run config and env.json.

    The trainer, model sizes (vocab size from the dataset's manifest), optimizer, loader
    arguments and skip windows are those ``replay.reference.run`` trains with; the mesh shape,
    axis names and device order are the run's record in env.json.

    Raises:
      RunDirError: the run config is invalid, names a dataset that is missing, or no mesh was recorded.
    """
    from loader.dataset import read_manifest
    from replay.reference import run as ref_run
    from replay.reference.drills import retrainer
    from replay.reference.trainer import ReferenceTrainer

    where = os.path.join(run.run_dir, "run_config.yaml")
    try:
        cfg = ref_run.run_config_from_dict(run.config, run.run_dir)
        manifest, _ = read_manifest(cfg.dataset, cfg.mixture)
        model = cfg.model_config(int(manifest.tokenizer["vocab_size"]))
    except ValueError as e:  # RunConfigError, DatasetError, ModelConfigError
        raise RunDirError(f"{where}: cannot rebuild the run: {e}") from None
    axis_names, shape, run_ids = mesh_record(run)
    trainer = ReferenceTrainer(model, cfg.optimizer)

    def make_loader(mesh):  # checked against the inputs the run recorded (replay.run.inputs)
        from replay.run.setup import checked_loader

        return checked_loader(run, ref_run.build_loader(cfg, mesh))

    return RunSetup(trainer=trainer, axis_names=axis_names, shape=shape, run_device_ids=run_ids,
                    make_loader=make_loader, seed=cfg.seed, global_batch=cfg.global_batch, mixture=cfg.mixture,
                    dataset=cfg.dataset, canary_step=cfg.canary.step, canary_seed=cfg.canary.seed,
                    canary_rows=cfg.canary.rows, canary_seq_len=cfg.canary.seq_len, canary_every=cfg.canary_every,
                    retrain=retrainer(cfg))
