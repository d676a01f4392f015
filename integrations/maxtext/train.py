"""Train a MaxText model on a dataset this toolkit packed, into a run directory ``replay`` reads.

    python -m integrations.maxtext.train BASE_YML key=value ... --dataset DIR --mixture YAML [--seed N]
        [--stop-after STEP]

``BASE_YML`` and the ``key=value`` overrides are MaxText's own (``<site-packages>/maxtext/configs/base.yml``,
``steps=8 decoder_block=mixtral ...``). The run directory is MaxText's output folder,
``<base_output_directory>/<run_name>``: MaxText's checkpoints go to its ``checkpoints/<step>/`` (``items``:
the train state; ``iter``: the loader state), and the launcher adds what replay reads, through the
public writer (``replay.run.writer.RunWriter``): ``run_config.yaml`` (the MaxText config as given, the
dataset, mixture and seed, ``trainer: integrations.maxtext.trainer:make_setup``), ``env.json`` (JAX and
every version, the mesh), ``fingerprints.jsonl`` and ``signals.jsonl`` (each step), ``events.jsonl``
(start, restore, checkpoints, end) and the inputs record (``inputs.json``, ``mixture.yaml``).

What it does with MaxText: builds MaxText's config (``pyconfig``), installs the loader as MaxText's data
iterator (``integrations.maxtext.iterator``; ``create_data_iterator`` set before ``setup_train_loop``),
lets MaxText build its mesh, model, optimizer and checkpoint manager and restore the run's latest
checkpoint (state and loader state), then runs the steps with the replayable step
(``integrations.maxtext.trainer``) and saves with MaxText's ``save_checkpoint`` every
``checkpoint_period`` steps and at the end. Checkpoint ``c`` holds the state *before* step ``c`` (the
toolkit's convention: replay restores ``c`` to rerun steps ``c..``); MaxText's schedule length is
``learning_rate_schedule_steps`` (set it: otherwise it follows ``steps``, and a resumed run with other
``steps`` would learn at other rates).

Several processes: the same command in each, with JAX's settings (``--coordinator-address HOST:PORT
--num-processes N --process-id I``, or a cluster's environment: ``replay.run.distributed``); the launcher
starts ``jax.distributed`` (gloo collectives on CPU) before MaxText, whose mesh then spans every
process's devices; each process reads its own rows, MaxText saves each process's loader state
(``iter/process_<i>-of-<n>.json``) and the run directory is one for all (``RunWriter``'s per-process
files).

``--stop-after STEP`` ends after training step ``STEP - 1`` (a planned stop, as a kill after that
checkpoint would leave the run; rerun without it to resume).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

from integrations.maxtext import internals
from replay.run import distributed

RECORDED_EXCLUDED = ("steps=",)  # how far to train is not part of the run's identity


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m integrations.maxtext.train", description=__doc__.split("\n\n")[0])
    p.add_argument("base_yml", help="MaxText's base config YAML (e.g. <site-packages>/maxtext/configs/base.yml)")
    p.add_argument("overrides", nargs="*", help="MaxText key=value overrides (run_name and base_output_directory "
                                                "name the run directory)")
    p.add_argument("--dataset", required=True, help="the packed dataset folder (manifest.json)")
    p.add_argument("--mixture", required=True, help="the mixture config YAML")
    p.add_argument("--seed", type=int, default=0, help="the loader's shuffle seed (default 0)")
    p.add_argument("--stop-after", type=int, default=None, help="stop before this step (a planned interruption)")
    distributed.add_arguments(p)
    args = p.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"MaxText overrides are key=value; got {bad}")
    return args


def train(base_yml: str, overrides: Sequence[str], *, dataset: str, mixture: str, seed: int = 0,
          stop_after: Optional[int] = None) -> dict[int, float]:
    """Trains (or resumes) the MaxText run; returns ``{step: loss}`` of the steps trained now.

    Raises:
      integrations.maxtext.trainer.MaxTextConfigError: an option the replayable step does not support.
      Everything ``loader.build`` raises for the dataset and mixture.
    """
    import jax

    from integrations.maxtext import trainer as mtt
    from integrations.maxtext.iterator import LoaderIterator, build_loader
    from replay.run import inputs as run_inputs
    from replay.run import writer

    mixture, dataset = os.path.abspath(mixture), os.path.abspath(dataset)
    config = mtt.maxtext_config(base_yml, overrides)
    run_dir = os.path.join(config.base_output_directory, config.run_name)
    steps = int(config.steps)
    made: list = []

    def make_iterator(cfg, mesh):
        made.append(LoaderIterator(build_loader(cfg, mesh, mixture=mixture, dataset=dataset, seed=seed,
                                                planned_steps=steps)))
        return made[-1]

    ctx = mtt.setup(config, make_iterator)
    data_iter = ctx.iterator if isinstance(ctx.iterator, LoaderIterator) else made[0]
    ckm = ctx.checkpoint_manager
    if ckm is None:
        raise mtt.MaxTextConfigError("enable_checkpointing=false: the run directory needs MaxText's checkpoints "
                                     "(replay restores them); leave enable_checkpointing on")
    latest = internals.get("maxtext.common.checkpointing", "latest_step")(ckm)
    record = {"name": config.run_name, "mixture": mixture, "dataset": dataset, "seed": seed,
              "global_batch": int(config.global_batch_size_to_train_on),
              "maxtext": {"base_yml": os.path.abspath(base_yml),
                          "overrides": [o for o in overrides if not o.startswith(RECORDED_EXCLUDED)],
                          "version": internals.MAXTEXT_VERSION}}
    log = writer.RunWriter(run_dir, config=record, trainer=mtt.FACTORY, mesh=ctx.mesh)
    start = log.start(latest)
    if jax.process_index() == 0:
        d = data_iter.data
        run_inputs.record_inputs(run_dir, d.mixture, mixture, dataset, d.manifest_sha256, d.schedule.to_dict())
    save = internals.get("maxtext.common.checkpointing", "save_checkpoint")
    wait = internals.get("maxtext.common.checkpointing", "wait_until_finished")

    def checkpoint(step: int, state) -> None:
        save(ckm, step, state, config, data_iter, force=True)
        wait(ckm)
        log.event("checkpoint", step)

    t = mtt.MaxTextTrainer(base_yml, overrides, ctx.config.checkpoint_dir, None)
    t._contexts[tuple(int(dv.id) for dv in ctx.mesh.devices.reshape(-1))] = ctx
    t._table = mtt.leaf_table(ctx.graphdef, ctx.state)
    state = ctx.state
    if latest is None:
        checkpoint(0, state)
    elif data_iter.data.state().next_step != start:
        raise RuntimeError(f"checkpoint {latest} restored the loader at step {data_iter.data.state().next_step}, "
                           f"not {start}: its iter/ state does not belong to it")
    stop = steps if stop_after is None else min(steps, int(stop_after))
    period = max(1, int(config.checkpoint_period))
    losses = {}
    for step in range(start, stop):
        batch = next(data_iter)
        if data_iter.step != step:
            raise RuntimeError(f"the loader served step {data_iter.step} for training step {step}")
        t0 = time.perf_counter()
        state, fp = t.train_step(state, batch, step)
        log.log_step(fp, step_time_s=time.perf_counter() - t0,
                     loader_wait_s=data_iter.data.metrics()["wait_s_last_step"])
        losses[step] = fp.signals.loss
        print(f"step {step}: loss {fp.signals.loss:.6f} grad_norm {fp.signals.grad_norm:.6f}", flush=True)
        if (step + 1) % period == 0 or step + 1 == stop:
            checkpoint(step + 1, state)
    log.end(max(start, stop))
    data_iter.close()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        dargs = distributed.from_args(args)
        if dargs is not None:  # several processes: jax.distributed (gloo on CPU) before MaxText touches JAX
            distributed.initialize(dargs)
    except distributed.DistributedConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    internals.require()
    train(args.base_yml, args.overrides, dataset=args.dataset, mixture=args.mixture, seed=args.seed,
          stop_after=args.stop_after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
