"""The end-to-end demo's stages, run as the commands a user types, timed, with a closing table.

    bash scripts/demo.sh              # set-up, then this script (what the README's first command runs)
    .venv/bin/python scripts/demo.py  # the stages alone, once .venv exists

Each stage is one command, printed before it runs; its own output (progress, tables) streams
through. A stage that fails stops the demo with that stage's exit code and the command to
rerun it by hand. At the end: the stages with their wall time, and the files the demo wrote
with what each holds. Environment: ``DEMO_OUT`` (default ``build/demo``; the run config
``configs/runs/demo.yaml`` reads the dataset from ``build/demo``), ``DEMO_SETUP_S`` (seconds the
set-up took, shown in the table when given).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.progress import duration  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Stage:
    """One demo stage: a name, what it does, and the command (argv) that does it."""

    name: str
    what: str
    argv: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Output:
    """A file or folder the demo writes, relative to the demo folder, and what it holds."""

    path: str
    holds: str


def stages(out: str, python: str, replay: str, steps: int, replay_steps: int) -> list[Stage]:
    """The demo's stages, in order (``python`` and ``replay``: the venv's executables)."""
    run = f"{out}/run"
    return [
        Stage("dataprep", "export inputs, train the tokenizer, pack with Beam",
              (python, "-m", "dataprep.demo", "--out", out)),
        Stage("train", f"train the reference MoE model for {steps} steps on 4 of 8 CPU devices",
              (python, "-m", "replay.reference.train", "--run", run, "--config", "configs/runs/demo.yaml",
               "--steps", str(steps))),
        Stage("replay", f"rerun steps {steps - replay_steps}:{steps} on good devices, diff fingerprints",
              (replay, "--run", run, "--steps", f"{steps - replay_steps}:{steps}", "--devices", "good",
               "--json", f"{out}/replay.json", "--plot", f"{out}/replay.png")),
        Stage("canary", "the fixed canary batch on every device",
              (replay, "canary", "--run", run, "--devices", "all")),
        Stage("scan", "screen the run log: replica norms, canaries, router health (must be clean)",
              (replay, "scan", "--run", run, "--json", f"{out}/scan.json", "--plot", f"{out}/scan.png")),
        Stage("goodput", "where the run's wall time and tokens went",
              (replay, "goodput", "--run", run, "--json", f"{out}/goodput.json", "--plot", f"{out}/goodput.png")),
    ]


OUTPUTS = [
    Output("inputs/", "the exported documents: docs/topics.jsonl (pydoc topics), code/ (stdlib .py files)"),
    Output("tokenizer.model", "the SentencePiece model trained on the inputs (+ .sha256)"),
    Output("demo.pinned.yaml", "configs/mixtures/demo.yaml with the tokenizer's sha256 pinned"),
    Output("dataset/manifest.json", "the dataset's manifest: shards, ledger, config, tokenizer"),
    Output("dataset/report.png", "what the pack did: segment lengths, fill, tokens vs weights, splits, rejections"),
    Output("dataset/errors/", "dead letters: every rejected document with its reason"),
    Output("run/", "the training run: run_config.yaml, env.json, checkpoints/, fingerprints.jsonl, "
                   "signals.jsonl, canary.jsonl, events.jsonl"),
    Output("run/train.png", "loss, gradient norm and router dropped fraction per step"),
    Output("replay.json", "the range replay's full report and verdict"),
    Output("replay.png", "the range replay: steps x devices, match or differ"),
    Output("scan.json", "the screening board: replica norm ratios, canary timeline, router health, suspects"),
    Output("scan.png", "the screening board as a picture"),
    Output("goodput.json", "the run's wall time and tokens, every part accounted; MFU"),
    Output("goodput.png", "the goodput waterfall and goodput over time"),
]


def _size(path: pathlib.Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"  # unreachable


def closing_tables(out: pathlib.Path, timings: Sequence[tuple[str, str, float]], outputs: Sequence[Output],
                   width: Optional[int] = None) -> str:
    """The demo's closing tables as text: stages with wall time and total, then the outputs.

    Args:
      out: the demo folder.
      timings: (stage name, what it did, seconds) in order.
      outputs: the files to list; those missing are left out.
      width: the console width (default: the terminal's, 160 when not a terminal).
    """
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=width or (None if sys.stdout.isatty() else 160), file=open(os.devnull, "w"))
    t = Table(title="demo: stages")
    t.add_column("stage")
    t.add_column("what it did")
    t.add_column("wall time", justify="right")
    for name, what, secs in timings:
        t.add_row(name, what, duration(secs))
    t.add_section()
    t.add_row("total", "", duration(sum(s for _, _, s in timings)))
    console.print(t)
    o = Table(title=f"demo: outputs in {out}")
    o.add_column("path", no_wrap=True)
    o.add_column("size", justify="right")
    o.add_column("what it holds")
    for item in outputs:
        p = out / item.path
        if p.exists():
            o.add_row(item.path, _human(_size(p)), item.holds)
    console.print(o)
    return console.export_text()


def stage_summary(stage: Stage, out: pathlib.Path) -> str:
    """What a stage did, for the closing table: the goodput stage adds its headline figure (from
    ``goodput.json``: ``replay.screen.goodput.headline``)."""
    if stage.name != "goodput" or not (out / "goodput.json").is_file():
        return stage.what
    import json

    from replay.screen.goodput import headline

    return f"{stage.what}: {headline(json.loads((out / 'goodput.json').read_text()))}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    out = os.environ.get("DEMO_OUT", "build/demo")
    replay_steps = 10
    try:
        steps = int(os.environ.get("DEMO_STEPS", "30"))
    except ValueError:
        steps = 0
    if steps <= replay_steps:
        print(f"demo: DEMO_STEPS must be an integer above {replay_steps} (the demo replays the last "
              f"{replay_steps} steps), got {os.environ.get('DEMO_STEPS')!r}; unset it for the default 30",
              file=sys.stderr)
        return 2
    python = str(REPO / ".venv" / "bin" / "python")
    replay = str(REPO / ".venv" / "bin" / "replay")
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    # JAX's persistent compilation cache: a command run again (replay, canary, drill) loads the
    # programs it compiled before instead of compiling them again (docs/replay.md)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / "build" / "jax-cache"))
    timings: list[tuple[str, str, float]] = []
    if os.environ.get("DEMO_SETUP_S"):
        timings.append(("set-up", "make .venv, install the project (scripts/setup.sh)", float(os.environ["DEMO_SETUP_S"])))
    todo = stages(out, python, replay, steps, replay_steps)
    for k, stage in enumerate(todo, start=1):
        shown = " ".join(shlex.quote(os.path.relpath(a, REPO) if a.startswith(str(REPO)) else a) for a in stage.argv)
        print(f"\n=== demo stage {k}/{len(todo)}: {stage.name}: {stage.what}\n$ {shown}", flush=True)
        if stage.name == "train" and (REPO / out / "run").exists():
            print(f"(removing the previous demo run {out}/run: the demo trains a fresh run)", flush=True)
            shutil.rmtree(REPO / out / "run")
        t0 = time.monotonic()
        code = subprocess.call(list(stage.argv), cwd=REPO, env=env)
        secs = time.monotonic() - t0
        if code != 0:
            print(f"demo: stage {stage.name!r} failed with exit code {code} after {duration(secs)}; "
                  f"rerun it by hand from {REPO}: {shown}", file=sys.stderr, flush=True)
            return code
        print(f"=== demo stage {stage.name} done in {duration(secs)}", flush=True)
        timings.append((stage.name, stage_summary(stage, REPO / out), secs))
    print()
    print(closing_tables(REPO / out, timings, OUTPUTS), end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
