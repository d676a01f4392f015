"""Command line: train the reference MoE model and leave a run directory for replay.

    python -m replay.reference.train --run build/demo/run --config configs/runs/demo.yaml --steps 30
    python -m replay.reference.train --run build/demo/run                  # resume: the run's own config
    python -m replay.reference.train --run build/demo/run --from-checkpoint 10   # roll back to checkpoint 10

``--steps`` is the step to stop at (total): after a kill, the same command resumes from
the last complete checkpoint and finishes the same run. On an existing run directory ``--config``
and ``--steps`` may be left out: the run's own ``run_config.yaml`` (with its copy of the mixture,
``mixture.yaml``) and the last target it was given. A rewind recorded by ``replay skip`` is
followed: training resumes from its checkpoint with its data window skipped. ``--from-checkpoint``
rolls back to an older checkpoint of the run; the steps after it are kept as a superseded attempt
(``replay.run.lineage``). Thin over :func:`replay.reference.loop.train`. Exit codes: 0 done, 2 a
config, data or file error, 3 stopped by a canary mismatch (``canary_action: stop``), 4 another
process of the run died (this one stopped too: restart them all with the same commands; they resume
from the last checkpoint), 20 the checkpoint to resume from is damaged (it does not match its state
record, ``replay.run.statefp``), 21 it is poisoned (its replicas disagreed at the save), 22 stopped on
a non-finite loss, gradient or state (``non_finite: stop``) before a checkpoint held it.

Several processes (``jax.distributed``; on CPU with gloo collectives), one run directory: every
process runs the same command with JAX's process settings (``replay.runtime.distributed``)::

    python -m replay.reference.train --run RUN --config run.yaml --steps 30 \
        --coordinator-address 127.0.0.1:1234 --num-processes 2 --process-id 0 &
    python -m replay.reference.train --run RUN --config run.yaml --steps 30 \
        --coordinator-address 127.0.0.1:1234 --num-processes 2 --process-id 1

or none of them inside a cluster JAX detects (Slurm, Open MPI, multi-host Cloud TPU, Kubernetes,
``JAX_COORDINATOR_ADDRESS``). With several processes each one runs its training in a worker child
and watches it: when another process dies, JAX's coordination service stops the worker (after the
``--heartbeat-timeout``, default 10 s, or at once when process 0 died) and the command ends with one
clear error and exit code 4.

Progress goes to stderr (a Rich bar on a terminal; a line every ``$REPLAY_PROGRESS_EVERY`` seconds,
default 10, otherwise); the summary and the path of ``<run>/train.png`` go to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

LAUNCHED_AT = time.time()  # the command's start: the start of its attempt's start-up (replay goodput)

from replay.runtime import distributed  # noqa: E402  (after LAUNCHED_AT: imports are start-up)
from replay.run.env import pin_determinism_flags  # noqa: E402
from replay.runtime.progress import loss_text  # noqa: E402
from replay.run import statefp  # noqa: E402
from replay.run.codes import ExitCode  # noqa: E402
from replay.reference.loop import Launch, train  # noqa: E402
from replay.reference.run import RunConfigError, load_run_config  # noqa: E402


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay.reference.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run directory (created; resumed when it holds checkpoints)")
    parser.add_argument("--config", help="run config YAML (configs/runs/<name>.yaml); default on an existing run: "
                                         "its own run_config.yaml and mixture copy")
    parser.add_argument("--steps", type=int, help="train until this global step (exclusive); default on an existing "
                                                  "run: the last --steps it was given")
    parser.add_argument("--from-checkpoint", type=int, metavar="C",
                        help="roll back: resume from checkpoint C of the run instead of the newest (the steps after "
                             "it are kept as a superseded attempt)")
    parser.add_argument("--reason", help="with --from-checkpoint: why (recorded in the rewind event)")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    pin_determinism_flags()  # before JAX starts its backend; recorded in env.json
    start = LAUNCHED_AT if argv is None else time.time()
    try:
        dargs = distributed.from_args(args)
    except distributed.DistributedConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dargs is not None and dargs.num_processes != 1 and argv is None and not distributed.supervised():
        # One of several processes: run as a watched worker, so that the death of another process ends
        # this one with a clear error (replay.runtime.distributed.supervise).
        return distributed.supervise([sys.executable, "-m", "replay.reference.train", *sys.argv[1:]],
                                     what_next=lambda: _restart_hint(args, dargs),
                                     heartbeat_timeout_s=dargs.heartbeat_timeout_s)
    try:
        if dargs is not None:
            distributed.initialize(dargs)
        cfg, steps = _config_and_steps(args)
        args.config, args.steps = args.config or "(the run's own)", steps
        summary = train(args.run, cfg, steps,
                        launch=Launch(rewind_to=args.from_checkpoint, rewind_reason=args.reason, launched_at=start))
    except (statefp.DamagedCheckpointError, statefp.PoisonedCheckpointError) as e:
        damaged = isinstance(e, statefp.DamagedCheckpointError)
        print(f"error: {'damaged' if damaged else 'poisoned'} checkpoint: {e}", file=sys.stderr)
        return int(ExitCode.DAMAGED_CHECKPOINT if damaged else ExitCode.POISONED_CHECKPOINT)
    except (RunConfigError, FileNotFoundError, ValueError, distributed.DistributedConfigError) as e:
        print(f"error: {e}{_dataset_hint(e, args.config)}", file=sys.stderr)
        if argv is None:  # the command: a process of its own
            from replay.runtime.quiet import exit_quietly_after_failed_restore

            exit_quietly_after_failed_restore(2)
        return 2
    except OSError as e:  # e.g. --config is a folder, --run is a file, permission denied, disk full
        print(f"error: {os_error_message(e, args.run, args.config, args.steps)}", file=sys.stderr)
        return 2
    losses = summary["losses"]
    if (summary.get("stopped") or {}).get("kind") == "non_finite":
        stop = summary["stopped"]
        print(f"stopped: {stop['reason']}; the checkpoints before it are finite: find the cause with 'replay triage "
              f"--run {args.run} --step {stop['first_step']}', or set non_finite: skip_step (drop such updates) or "
              "warn in the run config", file=sys.stderr)
        return int(ExitCode.NON_FINITE)
    if summary.get("stopped"):
        stop = summary["stopped"]
        print(f"stopped before step {stop['step']} (canary_action: stop): {stop['reason']}; a checkpoint was "
              f"saved at step {stop['step']}: run 'replay scan --run {args.run}' and quarantine the device",
              file=sys.stderr)
        return 3
    if losses:
        first, last = min(losses), max(losses)
        print(f"trained steps {summary['start']}..{summary['end'] - 1}: loss {loss_text(losses[first])} -> "
              f"{loss_text(losses[last])}")
    else:
        print(f"nothing to do: run already at step {summary['start']} (--steps is the step to stop at: "
              f"--steps {summary['start'] + 10} trains 10 more)")
    if summary.get("plot"):
        print(f"loss, gradient norm and router drops per step: {summary['plot']}")
    return 0


def _restart_hint(args, dargs) -> str:
    """What to do after a process of the run died: restart them all; from which checkpoint."""
    import os

    folder = os.path.join(args.run, "checkpoints")
    done = sorted(int(n) for n in (os.listdir(folder) if os.path.isdir(folder) else []) if n.isdigit())
    where = f"checkpoint {done[-1]}, the last committed one in {folder}" if done else "step 0 (no checkpoint yet)"
    n = dargs.num_processes or "all"
    return (f"Restart all {n} processes of the run with the same commands (this one: python -m "
            f"replay.reference.train {' '.join(sys.argv[1:]) if sys.argv[1:] else '...'}): they resume from {where}.")


def _config_and_steps(args):
    """The run config and target step: ``--config``/``--steps``, else the run directory's own
    ``run_config.yaml`` (mixture: the run's copy when it kept one) and the last target of its events.

    Raises:
      RunConfigError: neither is given for a new run directory, or the run's own config is unreadable.
    """
    import os

    from replay.reference.run import RunConfigError, run_config_from_dict
    from replay.run import protocol as proto

    cfg = load_run_config(args.config) if args.config else None
    steps = args.steps
    own = os.path.join(args.run, proto.RUN_CONFIG_NAME)
    if cfg is None or steps is None:
        if not os.path.isfile(own):
            missing = " and ".join(f for f, v in (("--config", args.config), ("--steps", args.steps)) if v is None)
            raise RunConfigError(f"{args.run} is not a run directory yet: give {missing} to start one")
    if cfg is None:
        import yaml

        from replay.run import inputs as run_inputs

        with open(own, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
        if not isinstance(raw, dict):
            raise RunConfigError(f"{own}: not a mapping")
        resolved = run_inputs.resolve(args.run, raw)
        raw = {**raw, "mixture": resolved.mixture}
        for note in resolved.notes:
            print(f"note: {note}", file=sys.stderr)
        cfg = run_config_from_dict(raw, args.run)
    if steps is None:
        targets = [e.get("steps") for e in proto.read_events(args.run) if e.get("event") in ("start", "restore")
                   and isinstance(e.get("steps"), int)] if os.path.exists(os.path.join(args.run, proto.EVENTS_NAME)) \
            else []
        if not targets:
            raise RunConfigError(f"{args.run}: no earlier --steps is recorded; give --steps")
        steps = targets[-1]
    return cfg, steps


def _dataset_hint(e: Exception, config: str) -> str:
    """For a missing dataset: where the path came from (``dataset:`` of the run config, resolved
    against the config file's folder, so a copied config points elsewhere)."""
    from loader.dataset import DatasetError

    if not isinstance(e, DatasetError) or ": no manifest; " not in str(e):
        return ""
    return (f" (the run config {config}'s 'dataset:' is resolved against that file's folder: in a copied "
            f"config, make it absolute or relative to the copy; pack the dataset first if it was never built)")


def os_error_message(e: OSError, run: str, config: str, steps: int) -> str:
    """The message of a file error of training: the file (when the error names one), what failed,
    and for a full disk what to do next (the run resumes from its last complete checkpoint)."""
    import errno

    what = e.strerror or str(e) or type(e).__name__
    head = f"{e.filename}: {what}" if e.filename else what
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{head} (writing the run directory {run}). Free space there, or point --run at a folder on "
                f"another disk (copy the run there first to keep its steps), then run the same command again: "
                f"python -m replay.reference.train --run {run} --config {config} --steps {steps} resumes from "
                f"the last complete checkpoint")
    return head


if __name__ == "__main__":
    sys.exit(main())
