"""The demo on an input every machine has: the local Python installation.

    python -m dataprep.demo --out build/demo

1. Prepares the inputs under ``<out>/inputs``: ``docs/topics.jsonl`` with one JSON line
   per documentation topic of ``pydoc_data.topics`` (real English prose), and
   ``code/<relpath>.py``, a copy of each standard-library module (real code), leaving out
   site-packages, the test suites (``test``, ``tests``, ``idle_test``), ``turtledemo`` and
   ``__pycache__``.
2. Trains a SentencePiece tokenizer on them (``<out>/tokenizer.model``, vocab 8000, byte
   fallback) with ``configs/mixtures/demo.yaml``.
3. Writes ``<out>/demo.pinned.yaml``: the committed demo config with absolute paths (moved
   under ``<out>``) and the trained tokenizer's sha256 pinned. The committed config cannot pin it, since each
   machine trains its own tokenizer from its own Python; packing with the pinned copy runs
   the same sha256 check a production config gets.
4. Packs into ``<out>/dataset`` and prints where it is and what it holds.

Nothing is sampled: the whole standard library (about 12 MB of ``.py`` on CPython 3.11)
is packed. Pass ``--max-code-mb`` to keep a deterministic subset (by key hash) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import sysconfig
from typing import Optional, Sequence

if not __package__:  # run as a script: the repository root replaces dataprep/ on sys.path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402

from contract.config import ConfigError, load_mixture  # noqa: E402
from contract.hashing import stable_hash64  # noqa: E402
from dataprep import pack, train_tokenizer  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "configs" / "mixtures" / "demo.yaml"
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "turtledemo", "__pycache__"}
VOCAB_SIZE = 8000


def export_topics(dest: pathlib.Path) -> int:
    """Writes ``pydoc_data.topics`` as JSONL (``{"id": topic, "text": ...}``, sorted); returns the count."""
    from pydoc_data.topics import topics

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8", newline="\n") as f:
        for name in sorted(topics):
            f.write(json.dumps({"id": name, "text": topics[name]}, ensure_ascii=False) + "\n")
    return len(topics)


def stdlib_files(stdlib: Optional[str] = None) -> list[pathlib.Path]:
    """Returns the standard library's ``.py`` files, sorted, without tests and site-packages."""
    root = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append(path)
    return sorted(out)


def stdlib_documents() -> list[tuple[str, str]]:
    """``(name, text)`` of every standard-library module of :func:`stdlib_files` (``code/<relpath>``)
    and every ``pydoc_data.topics`` topic (``topic/<name>``), sorted by name: the benchmark
    corpus of ``benchmarks/pack.py`` and ``benchmarks/packing.py``. Modules that are not UTF-8
    are left out."""
    from pydoc_data.topics import topics

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in stdlib_files(str(root)):
        try:
            docs.append((f"code/{p.relative_to(root)}", p.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    docs += [(f"topic/{k}", topics[k]) for k in sorted(topics)]
    return docs


def copy_code(dest: pathlib.Path, max_bytes: Optional[int] = None) -> tuple[int, int, bool]:
    """Copies the stdlib modules under ``dest``; returns (files, bytes, sampled).

    With ``max_bytes``, files are taken in order of ``stable_hash64("demo", relpath)`` until
    the budget is reached: a deterministic subset.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(str(root))
    sampled = False
    if max_bytes is not None:
        ranked = sorted(files, key=lambda p: stable_hash64("demo", str(p.relative_to(root))))
        keep, total = [], 0
        for p in ranked:
            size = p.stat().st_size
            if total + size > max_bytes:
                sampled = True
                continue
            keep.append(p)
            total += size
        files = sorted(keep)
    if dest.exists():
        shutil.rmtree(dest)
    total = 0
    for p in files:
        target = dest / p.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
        total += p.stat().st_size
    return len(files), total, sampled


def pinned_config(out: pathlib.Path, sha256: Optional[str]) -> pathlib.Path:
    """Writes ``<out>/demo.pinned.yaml``: the demo config with absolute paths and sha256 pinned.

    The committed config's paths point into ``build/demo`` of the repository; they are moved
    under ``out``, so the demo can run in any folder.
    """
    config = load_mixture(str(DEMO_CONFIG))
    default = str(REPO_ROOT / "build" / "demo")

    def move(path: str) -> str:
        return str(out) + path[len(default) :] if path.startswith(default) else path

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["tokenizer"]["path"] = move(config.tokenizer.path)
    if sha256 is not None:
        raw["tokenizer"]["sha256"] = sha256
    for src_raw, src in zip(raw["sources"], config.sources):
        src_raw["paths"] = [move(p) for p in src.paths]
        src_raw["root"] = move(src.root)
    path = out / "demo.pinned.yaml"
    path.write_text(
        "# Written by python -m dataprep.demo from configs/mixtures/demo.yaml; tokenizer pinned.\n"
        + yaml.safe_dump(raw, sort_keys=False)
    )
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dataprep.demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out",
        default="build/demo",
        help="demo folder (configs/mixtures/demo.yaml itself points at build/demo of the repository)",
    )
    parser.add_argument(
        "--max-code-mb", type=float, default=None, help="pack a deterministic subset of the stdlib"
    )
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args, beam_args = parser.parse_known_args(argv)
    out = pathlib.Path(args.out).resolve()
    from rich.console import Console

    console = Console(soft_wrap=True)  # paths and commands are never broken across lines
    console.rule("1. inputs from the local Python installation")
    n_topics = export_topics(out / "inputs" / "docs" / "topics.jsonl")
    max_bytes = int(args.max_code_mb * 1e6) if args.max_code_mb else None
    n_files, n_bytes, sampled = copy_code(out / "inputs" / "code", max_bytes)
    console.print(f"docs: {n_topics} pydoc topics -> {out / 'inputs/docs/topics.jsonl'}")
    console.print(
        f"code: {n_files} stdlib modules, {n_bytes / 1e6:.1f} MB -> {out / 'inputs/code'}"
        + (" (deterministic subset, --max-code-mb)" if sampled else " (all of them, no sampling)")
    )
    console.rule("2. tokenizer")
    tok = out / "tokenizer.model"
    unpinned = load_mixture(str(pinned_config(out, None)))
    try:
        sha = train_tokenizer.train(
            unpinned, args.vocab_size, str(tok), sample_fraction=1.0, seed=0, max_sentences=300_000
        )
    except (ConfigError, train_tokenizer.TrainError) as e:  # e.g. --vocab-size too small
        print(f"error: {e}", file=sys.stderr)
        return 2
    console.print(f"{tok} (vocab {args.vocab_size}, byte fallback, normalization nmt_nfkc: decoded text is NFKC-normalized, sha256 {sha})")
    console.rule("3. pack")
    cfg = pinned_config(out, sha)
    dataset = out / "dataset"
    if dataset.exists():
        shutil.rmtree(dataset)
    try:
        pack.run(["--config", str(cfg), "--output", str(dataset), *beam_args])
    except (ConfigError, pack.OutputExistsError, pack.LedgerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return pack.EXIT_LEDGER if isinstance(e, pack.LedgerError) else pack.EXIT_CONFIG
    console.print(f"config: {DEMO_CONFIG} (pinned copy {cfg})")
    console.print(f"read it with: Manifest.from_json(open('{dataset / 'manifest.json'}').read())")
    return 0


if __name__ == "__main__":
    sys.exit(main())
