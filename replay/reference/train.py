"""Command line: train the reference MoE model and leave a run directory for replay.

    python -m replay.reference.train --run build/demo/run --config configs/runs/demo.yaml --steps 30

``--steps`` is the step to stop at (total): after a kill, the same command resumes from
the last complete checkpoint and finishes the same run. Thin over
:func:`replay.reference.run.train`. Exit codes: 0 done, 2 a config, data or file error, 3 stopped
by a canary mismatch (``canary_action: stop``).

Progress goes to stderr (a Rich bar on a terminal; a line every ``$REPLAY_PROGRESS_EVERY`` seconds,
default 10, otherwise); the summary and the path of ``<run>/train.png`` go to stdout.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from replay.run.env import pin_determinism_flags
from replay.run.progress import loss_text
from replay.reference.run import RunConfigError, load_run_config, train


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replay.reference.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run directory (created; resumed when it holds checkpoints)")
    parser.add_argument("--config", required=True, help="run config YAML (configs/runs/<name>.yaml)")
    parser.add_argument("--steps", required=True, type=int, help="train until this global step (exclusive)")
    args = parser.parse_args(argv)
    pin_determinism_flags()  # before JAX starts its backend; recorded in env.json
    try:
        cfg = load_run_config(args.config)
        summary = train(args.run, cfg, args.steps)
    except (RunConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}{_dataset_hint(e, args.config)}", file=sys.stderr)
        if argv is None:  # the command: a process of its own
            from replay.reference import checkpoint

            checkpoint.exit_quietly_after_failed_restore(2)
        return 2
    except OSError as e:  # e.g. --config is a folder, --run is a file, permission denied, disk full
        print(f"error: {os_error_message(e, args.run, args.config, args.steps)}", file=sys.stderr)
        return 2
    losses = summary["losses"]
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


def _dataset_hint(e: Exception, config: str) -> str:
    """For a missing dataset: where the path came from (``dataset:`` of the run config, resolved
    against the config file's folder, so a copied config points elsewhere)."""
    from loader.dataset import DatasetError

    if not isinstance(e, DatasetError):
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
