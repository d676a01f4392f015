"""Tokenize and pack a mixture's sources into ArrayRecord shards with a manifest.

Locally (the DirectRunner's batch engine, FnApiRunner, is the default)::

    python -m dataprep.pack --config configs/mixtures/demo.yaml --output build/demo/dataset
    python -m dataprep.pack --config ... --output ... \
        --direct_num_workers=2 --direct_running_mode=multi_processing

On Dataflow, unchanged (Beam builds an sdist of this project from ``pyproject.toml`` with
``python -m build`` and installs it on the workers; ``pip install -e ".[dataflow]"``)::

    python -m dataprep.pack --config configs/mixtures/web.yaml --output gs://BUCKET/datasets/web-v1 \
        --runner DataflowRunner --project PROJECT --region us-central1 \
        --temp_location gs://BUCKET/tmp --setup_file ./pyproject.toml

``python dataprep/pack.py ...`` works the same. Exit status: 0 done, 1 the pipeline failed
(a worker error, a full disk, an input that changed during the run: no manifest written), 2
bad config, arguments or output folder, or another run is writing to the same output
(nothing was started), 3 the ledger does not reconcile (no manifest written), 4 a source lost
too much: a source with weight > 0 packed no row, or rejected more than
``max_rejected_fraction`` of its documents (no manifest written), 130 interrupted (Ctrl-C,
SIGTERM).

Order of work: the config is validated and every file check is made (globs, tokenizer
sha256, the shard plan against the bucket budget) before the pipeline is built; the
pipeline writes shards, dead letters and a ``_stats.json``; then this driver reconciles the
ledger, checks for silent loss, writes ``manifest.json`` last (the commit marker), removes
``_stats.json`` and the spill files, and draws ``report.png``.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # the command: Beam's imports make objects that live for the whole run;
    gc.disable()  # collecting while importing them is wasted work (re-enabled, frozen, below)

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid
from typing import Mapping, Optional, Sequence

if not __package__:  # run as a script: the repository root replaces dataprep/ on sys.path
    import os as _os

    sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

import apache_beam as beam  # noqa: E402
from apache_beam.io.filesystems import FileSystems  # noqa: E402
from apache_beam.metrics.metric import MetricsFilter  # noqa: E402
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions  # noqa: E402

from common import locks  # noqa: E402
from contract import duplicates as dup  # noqa: E402
from contract.codec import FORMAT_VERSION, token_dtype_for_vocab  # noqa: E402
from contract.config import ConfigError, MixtureConfig, load_mixture  # noqa: E402
from contract.plan import (  # noqa: E402
    DEFAULT_MAX_EPOCHS,
    PlanError,
    SourceEpochs,
    describe,
    epoch_lengths,
    source_epochs,
    steps_for_tokens,
)
from contract.manifest import (  # noqa: E402
    ERRORS_DIR,
    MANIFEST_NAME,
    Ledger,
    Manifest,
    ShardInfo,
    SourceEntry,
    shard_name,
)
from dataprep import dryrun, faults, fsutil, pipeline, preflight, progress, sizing, staging  # noqa: E402

DEFAULT_RUNNER = "FnApiRunner"
EXIT_PIPELINE = 1
EXIT_CONFIG = 2
EXIT_LEDGER = 3
EXIT_LOSS = 4
REPORT_NAME = "report.png"
TMP_DIR = "_tmp"  # spill files of a local run, under --output unless --temp_location is set
# Beam's local runners: their workers share this machine's file system, and their
# GroupByKey holds every element in memory, so token payloads are spilled to files.
LOCAL_RUNNERS = {"FnApiRunner", "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner", "PrismRunner"}


class LedgerError(RuntimeError):
    """The run's counts do not reconcile; the manifest was not written."""


class DataLossError(RuntimeError):
    """A source lost too much (nothing packed, or too many rejections); the manifest was not written."""


class PipelineError(RuntimeError):
    """The Beam pipeline failed (its cause is chained); the manifest was not written."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the run; ``committed`` says whether manifest.json was written."""

    def __init__(self, output: str, committed: bool):
        super().__init__(output, committed)
        self.output, self.committed = output, committed

    def __str__(self) -> str:
        if self.committed:
            return (f"interrupted after manifest.json was written: the dataset {self.output} is complete "
                    "(report.png may be missing)")
        return f"interrupted; nothing was committed (no manifest.json in {self.output}); rerun to pack"


class OutputExistsError(ValueError):
    """The output folder already holds a committed dataset (manifest.json)."""


class OutputNotAFolderError(OutputExistsError):
    """``--output`` (or a folder above it) is an existing file, so no dataset can be written there."""


class OutputBusyError(OutputExistsError):
    """Another ``dataprep.pack`` run holds the lock of the same local ``--output``."""


def check_output_location(output: str) -> None:
    """Raises :class:`OutputNotAFolderError` where a local ``--output`` cannot be a folder.

    Raises :class:`ConfigError` when no installed Beam file system serves its scheme.

    Checked before any work, so that a typo does not surface as a crash of the pipeline's
    last step. Object stores (``gs://``) have no folders and need no check.
    """
    import os

    from apache_beam.io.localfilesystem import LocalFileSystem

    try:
        if not isinstance(FileSystems.get_filesystem(output), LocalFileSystem):
            return
    except ValueError as e:  # a scheme no installed Beam file system serves
        raise ConfigError(f"--output {output}: {e}") from None
    path = os.path.abspath(output)
    while True:
        if os.path.lexists(path):
            if not os.path.isdir(path):
                inside = f"is inside {path}, which is a file"
                what = "is a file" if path == os.path.abspath(output) else inside
                raise OutputNotAFolderError(f"--output {output} {what}, not a folder")
            return
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def check_writable_folder(folder: str, what: str) -> None:
    """Creates the local ``folder`` if needed and checks that a file can be written in it.

    ``what`` names the option in the message (``--output``, ``--temp_location``). Object
    stores (``gs://``) are not checked: they have no folders, and a write would cost a request.

    Raises:
      ConfigError: the folder (or one above it) is a file, or the file system refuses to
        create it or write in it (read-only, permission denied, no space left).
    """
    if not fsutil.is_local(folder):
        return
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dataprep-probe-"):
            pass
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{what} {folder}: is a file, or inside one; it must be a folder") from None
    except OSError as e:
        raise ConfigError(
            f"{what} {folder}: cannot write there ({e.strerror}); choose a folder this user can write to"
        ) from None


def lock_output(output: str) -> Optional[int]:
    """Takes an exclusive lock on the local ``output`` folder for the whole run; returns its fd.

    Two runs writing one dataset would delete each other's spill and half-written files and
    could commit a manifest over the other's shards. The lock is ``flock`` on the folder
    itself (``common.locks``: no lock file in the dataset); the kernel releases it when the process ends, also
    when it is killed. Returns None for object stores (no lock: one run at a time is then up
    to the user) and where the file system has no ``flock`` (some network file systems).

    Raises:
      OutputBusyError: another process holds the lock.
    """
    if not fsutil.is_local(output):
        return None
    try:
        return locks.acquire(output, wait=False)
    except BlockingIOError:
        raise OutputBusyError(
            f"--output {output}: another dataprep.pack run is writing there (it holds the folder's lock); "
            "wait for it to end, or choose another --output"
        ) from None
    except OSError:
        return None  # no flock here: run unlocked


def _output_key(output: str) -> str:
    """12 hex digits naming ``output``'s spill folders, so that a rerun finds a killed run's."""
    import hashlib

    return hashlib.sha256(fsutil.real_path(output).encode("utf-8", "surrogatepass")).hexdigest()[:12]


SPILL_PREFIX = "dataprep-spill-"


@dataclasses.dataclass(frozen=True)
class PackResult:
    """What a run produced.

    Attributes:
      output: the dataset folder.
      manifest: the manifest written to ``<output>/manifest.json``.
      metrics: Beam counters (``"<source>.<what>" -> value``), committed where the runner
        supports it, else attempted; empty where the runner reports none.
      timings: wall seconds of each step (``checks``, ``read and tokenize``, ``pack and
        write`` where the runner lets them be told apart, else ``pipeline``; ``manifest``,
        ``report``, ``total``).
      report: where ``report.png`` was written, or None (``--no-report``).
      epochs: per source, the epochs of the planned run (``--train-steps`` or
        ``--train-tokens`` with ``--global-batch``), ``contract.plan.SourceEpochs``; empty
        without a plan.
    """

    output: str
    manifest: Manifest
    metrics: Mapping[str, int]
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    report: Optional[str] = None
    epochs: tuple[SourceEpochs, ...] = ()


def tool_versions() -> dict[str, str]:
    """Versions of the tools that shape the bytes of the output (no timestamps)."""
    import array_record  # noqa: F401
    import numpy
    import pyarrow
    import sentencepiece
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        "apache_beam": beam.__version__,
        "sentencepiece": sentencepiece.__version__,
        "array_record": version("array-record"),
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
        "record_format_version": str(FORMAT_VERSION),
    }


_EPILOG = """\
Every other option is a Beam pipeline option, passed on to Beam (an option that neither
this command nor Beam knows is an error). The runner defaults to FnApiRunner, the
DirectRunner's local batch engine.

examples:
  python -m dataprep.pack --config configs/mixtures/demo.yaml --output build/demo/dataset
  python -m dataprep.pack --config ... --output ... \\
      --direct_num_workers=2 --direct_running_mode=multi_processing
  python -m dataprep.pack --config ... --output gs://BUCKET/datasets/NAME-vN \\
      --runner DataflowRunner --project PROJECT --region REGION \\
      --temp_location gs://BUCKET/tmp --setup_file ./pyproject.toml

Progress goes to stderr: a bar on a terminal, else a line every --progress-every seconds
(documents, tokens, tokens/s, ETA), and each step's duration as it ends.

Memory: on local runners token arrays are spilled to files under --temp_location (or
<output>/_tmp) and only references cross Beam's in-memory GroupByKey (--spill auto);
the spill needs free disk of about 2 bytes a token (4 above 65,536 pieces) and is
removed at the end (what a killed run left is removed by the next run into the same
--output). On distributed runners they go through the shuffle.

A local --output is locked for the run: a second pack into it exits 2 at once. On object
stores (gs://) there is no lock: run one pack per output at a time. Inputs must not change
while a pack runs (a file whose size differs from its listing fails the run).

Dataflow dry run (--dry-run): the job is built with Beam's DataflowRunner and checked without a
cloud: options, translation, every DoFn unpickled again, key coders, the --setup_file sdist,
paths the workers cannot reach; prints what would be staged and how many workers the sizing
suggests; exit 0 when every check passed, else 2.

exit status: 0 done; 1 the pipeline failed (no manifest.json written; the last line says
what to do); 2 bad config, arguments, output or --temp_location folder, or another pack is
writing to --output (checked before any work); 3 the ledger does not reconcile (no
manifest.json written); 4 a source with weight > 0 in some phase packed no row, or
rejected more than max_rejected_fraction of its documents, or duplicated data with --duplicates
refuse (no manifest.json written; see
errors/ and report.png; a source at weight 0 only gets a warning); 130 interrupted (Ctrl-C or
SIGTERM: the workers are stopped and the spill files removed; local worker processes also
exit on their own when the driver is killed).
"""


def check_inputs_outside_output(files: Mapping[str, Sequence[str]], output: str, what: str = "--output") -> None:
    """Raises :class:`ConfigError` when an input file lies inside ``--output`` (or the spill folder).

    A glob such as ``corpus/**/*.jsonl`` with ``--output corpus/ds`` would otherwise read the
    previous run's dead letters (``errors/*.jsonl``) or shards back in as documents; with
    ``--temp_location corpus/tmp``, a killed run's spill files.
    """
    out = fsutil.real_path(output).rstrip("/") + "/"
    for source in sorted(files):
        for f in files[source]:
            if fsutil.real_path(f).startswith(out):
                raise ConfigError(
                    f"sources: {f} (source {source!r}) lies inside {what} {output}; "
                    f"the run's own files would be read back as inputs: narrow the glob or move {what}"
                )


def check_spill_outside_inputs(config: MixtureConfig, base: str) -> None:
    """Raises :class:`ConfigError` when a source's paths would match a spill file under ``base``.

    With ``--temp_location corpus/tmp`` and ``paths: [corpus/**]``, the spill files of a run
    killed before its cleanup (``<base>/dataprep-spill-*/*.seg``) would be read as documents
    by the next run. Checked on a spill file's name, before any exists.
    """
    import re

    probe = fsutil.join(base, f"{SPILL_PREFIX}000000000000-000000000000", "0" * 32 + staging.SPILL_SUFFIX)
    for i, source in enumerate(config.sources):
        for j, pattern in enumerate(source.paths):
            try:
                fs = FileSystems.get_filesystem(pattern)
            except ValueError:
                continue
            if re.match(fs.translate_pattern(pattern), probe) or pattern == probe:
                raise ConfigError(
                    f"sources[{i}].paths[{j}]: {pattern!r} would match the spill files under --temp_location "
                    f"{base} (e.g. {probe}); those of a killed run would be read back as inputs: narrow the "
                    "glob or move --temp_location"
                )


def parse_args(argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m dataprep.pack",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("--config", required=True, help="mixture config YAML (configs/mixtures/*.yaml)")
    parser.add_argument("--output", required=True, help="dataset folder, local or gs://...")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset already committed (manifest.json present) at --output",
    )
    parser.add_argument("--quiet", action="store_true", help="print no summary table and no progress")
    parser.add_argument(
        "--spill",
        choices=["auto", "on", "off"],
        default="auto",
        help="spill token arrays to files so that only references cross the GroupByKey: auto (default) "
        "does it on Beam's local runners, whose GroupByKey is in memory, not on distributed ones",
    )
    parser.add_argument(
        "--max-shard-tokens",
        type=int,
        default=sizing.DEFAULT_MAX_SHARD_TOKENS,
        help="bucket budget: the most estimated tokens one shard may get; a config over it is refused "
        f"before any work (default 2**30 = {sizing.DEFAULT_MAX_SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between progress lines when stderr is not a terminal (default 10)",
    )
    parser.add_argument("--no-report", action="store_true", help=f"do not draw <output>/{REPORT_NAME}")
    parser.add_argument("--duplicates", choices=dup.MODES, default="warn",
                        help="duplicated data (shards with one sha256, a source whose rows repeat beyond "
                             "--max-repeated-fraction): warn (default), refuse (exit 4, no manifest.json) or off")
    parser.add_argument("--max-repeated-fraction", type=float, default=dup.DEFAULT_MAX_FRACTION, metavar="F",
                        help="a source whose rows repeat beyond this share is duplicated data "
                             f"(default {dup.DEFAULT_MAX_FRACTION:g}; rows of shard copies plus the duplicate "
                             "report's documents)")
    plan = parser.add_argument_group(
        "the planned run", "how many epochs of each source a run sees, printed after packing; a source over "
        "--max-epochs gets a warning")
    plan.add_argument("--train-steps", type=int, default=None, metavar="STEPS", help="planned training steps")
    plan.add_argument("--train-tokens", type=int, default=None, metavar="TOKENS",
                      help="planned training tokens (instead of --train-steps)")
    plan.add_argument("--global-batch", type=int, default=None, metavar="ROWS", help="rows per step")
    plan.add_argument("--max-epochs", type=float, default=DEFAULT_MAX_EPOCHS, metavar="EPOCHS",
                      help=f"warn above this many epochs of a source (default {DEFAULT_MAX_EPOCHS:g})")
    dry = parser.add_argument_group(
        "Dataflow dry run", "build the Dataflow job (--runner DataflowRunner and its options) and check it "
        "without submitting anything or reaching a cloud (dataprep/dryrun.py); needs apache-beam[gcp]")
    dry.add_argument("--dry-run", action="store_true", help="build and check the job; write nothing to --output")
    dry.add_argument("--dry-run-venv", action="store_true",
                     help="--dry-run, and install the staged sdist into a fresh venv, as a worker would (minutes)")
    dry.add_argument("--dry-run-dir", default=dryrun.DEFAULT_FOLDER, metavar="FOLDER",
                     help=f"where the staged files and dataflow_job.json go (default {dryrun.DEFAULT_FOLDER})")
    return parser.parse_known_args(list(argv) if argv is not None else None)


def planned_steps(args: argparse.Namespace, config: MixtureConfig) -> Optional[int]:
    """The planned run's steps from ``--train-steps`` or ``--train-tokens``, or None without a plan.

    Raises:
      ConfigError: a plan without ``--global-batch`` (or a batch without a plan), both steps
        and tokens, or a value below 1 (checked before any work).
    """
    given = [name for name, v in (("--train-steps", args.train_steps), ("--train-tokens", args.train_tokens))
             if v is not None]
    if len(given) == 2:
        raise ConfigError("--train-steps and --train-tokens: give one of them, not both")
    if not given and args.global_batch is None:
        if not args.max_epochs > 0:
            raise ConfigError(f"--max-epochs: must be > 0, got {args.max_epochs}")
        return None
    if not given or args.global_batch is None:
        raise ConfigError("--global-batch goes with --train-steps or --train-tokens: give both, to see how many "
                          "epochs of each source the planned run sees")
    if not args.max_epochs > 0:
        raise ConfigError(f"--max-epochs: must be > 0, got {args.max_epochs}")
    try:
        if args.train_tokens is not None:
            return steps_for_tokens(args.train_tokens, args.global_batch, config.seq_len)
        for name, value in (("--train-steps", args.train_steps), ("--global-batch", args.global_batch)):
            if value < 1:
                raise PlanError(f"{name}: must be an integer >= 1, got {value}")
    except PlanError as e:
        raise ConfigError(str(e)) from None
    return args.train_steps


def epochs_of_run(config: MixtureConfig, manifest: Manifest, steps: Optional[int], global_batch: Optional[int],
                  max_epochs: float) -> tuple[list[SourceEpochs], list[str], list[str]]:
    """``(epochs, lines, warnings)`` of the planned run over the packed rows (``contract.plan``);
    without a plan, no epochs and the lines say how long an epoch of each source lasts."""
    phases = [(p.from_step, p.weights) for p in config.phases]
    records = {n: manifest.sources[n].records for n in config.source_names}
    if steps is None:
        return [], epoch_lengths(phases, records), []
    items = source_epochs(phases, records, steps, global_batch)
    lines, warnings = describe(items, steps, global_batch, max_epochs)
    return items, lines, warnings


def pipeline_options(beam_args: Sequence[str]) -> PipelineOptions:
    """Beam options from the remaining arguments; the runner defaults to FnApiRunner.

    Raises:
      ConfigError: an argument is not a Beam option (Beam itself would drop it silently).

    The DirectRunner of Beam 2.77 first tries the Prism runner (a downloaded Go binary
    that ignores ``--direct_num_workers``); FnApiRunner is the DirectRunner's own batch
    engine and honours ``--direct_num_workers`` and ``--direct_running_mode``.
    """
    options = PipelineOptions(list(beam_args))
    parsers = []  # Beam's own parser of every registered option, to find what it would drop
    options.get_all_options(add_extra_args_fn=parsers.append)
    _, unknown = parsers[0].parse_known_args(list(beam_args))
    if unknown:
        raise ConfigError(
            f"unknown argument(s) {unknown}: neither this command's (--config, --output, --overwrite, "
            "--quiet, --spill, --max-shard-tokens, --progress-every, --no-report, --train-steps, --train-tokens, "
            "--global-batch, --max-epochs, --dry-run) nor a Beam pipeline option; see --help"
        )
    std = options.view_as(StandardOptions)
    if not std.runner:
        std.runner = DEFAULT_RUNNER
    return options


def build_manifest(config: MixtureConfig, pre: preflight.Preflight, stats: list[list]) -> Manifest:
    """Assembles the manifest from the pipeline's stats (see ``dataprep.pipeline``).

    Raises:
      LedgerError: a shard is missing or written twice.
    """
    names = config.source_names
    read = {n: 0 for n in names}
    tokens_in = {n: 0 for n in names}
    rejected: dict[str, dict[str, int]] = {n: {} for n in names}
    shards: dict[str, list[dict]] = {n: [] for n in names}
    for s in stats:
        kind, source = s[0], s[1]
        if kind == "read":
            read[source] += s[2]
        elif kind == "tokens_in":
            tokens_in[source] += s[2]
        elif kind == "rejected":
            rejected[source][s[2]] = rejected[source].get(s[2], 0) + s[3]
        elif kind == "shard":
            shards[source].append(dict(s[3], bucket=s[2]))
    sources = {}
    for n in names:
        infos = sorted(shards[n], key=lambda d: d["bucket"])
        expected = preflight.num_shards(config, pre, n)
        if [d["bucket"] for d in infos] != list(range(expected)):
            raise LedgerError(
                f"source {n!r}: shards written {[d['bucket'] for d in infos]}, expected 0..{expected - 1} once each"
            )
        fields = [f.name for f in dataclasses.fields(ShardInfo)]
        entries = tuple(ShardInfo(**{k: d[k] for k in fields}) for d in infos)
        ledger = Ledger(
            read=read[n],
            packed=sum(d["documents"] for d in infos),
            rejected={k: rejected[n][k] for k in sorted(rejected[n])},
            tokens_in=tokens_in[n],
            tokens_packed=sum(d["tokens"] for d in infos),
            docs_split=sum(d["docs_split"] for d in infos),
            duplicates_dropped=sum(d.get("duplicates_dropped", 0) for d in infos),
            tokens_dropped=sum(d.get("tokens_dropped", 0) for d in infos),
        )
        sources[n] = SourceEntry(entries, ledger)
    vocab = int(pre.tokenizer_info["vocab_size"])
    return Manifest(
        name=config.name,
        version=config.version,
        record_format_version=FORMAT_VERSION,
        config=config.to_dict(),
        config_sha256=config.sha256(),
        tokenizer=dict(pre.tokenizer_info),
        seq_len=config.seq_len,
        token_dtype=token_dtype_for_vocab(vocab).name,
        sources=sources,
        tools=tool_versions(),
        duplicates=duplicates_report(config, stats),
    )


def duplicates_report(config: MixtureConfig, stats: list[list]) -> Optional[dict]:
    """The manifest's ``duplicates`` entry from the stats of ``FindDuplicates`` (None with ``dedup: off``).

    ``by_source[s]``: documents of ``s`` whose normalized text an earlier document has (the
    first by source order in the config, then file and line), their tokens, and ``of``: how
    many of them have that earlier copy in each source (``s`` itself: within the source).
    ``examples``: the :data:`pipeline.DUPLICATE_EXAMPLES` groups of the smallest
    ``dedup.example_rank``: the most copies, then the kept copy's keep order (never the hash).
    """
    from contract.config import DedupMode
    from dataprep import dedup

    if config.dedup is DedupMode.OFF:
        return None
    by_source = {n: {"documents": 0, "tokens": 0, "of": {}} for n in config.source_names}
    examples = []
    for s in stats:
        if s[0] == "duplicates":
            _, source, kept, docs, tokens = s
            entry = by_source[source]
            entry["documents"] += docs
            entry["tokens"] += tokens
            entry["of"][kept] = entry["of"].get(kept, 0) + docs
        elif s[0] == "duplicate_example":
            examples.append({"hash": s[1], "copies": s[2], "keys": list(s[3])})
    for entry in by_source.values():
        entry["of"] = dict(sorted(entry["of"].items()))
    return {
        "mode": config.dedup.value,
        "normalization": dedup.NORMALIZATION,
        "hash": dedup.HASH_NAME,
        "documents": sum(e["documents"] for e in by_source.values()),
        "tokens": sum(e["tokens"] for e in by_source.values()),
        "by_source": by_source,
        "examples": sorted(examples, key=lambda e: dedup.example_rank(
            e["copies"], config.source_names.index(e["keys"][0].partition("/")[0]), e["keys"][0]),
        )[: pipeline.DUPLICATE_EXAMPLES],
    }


def rejected_examples(stats: list[list]) -> dict[tuple[str, str], tuple[str, str]]:
    """``(source, reason) -> (key, detail)`` of the first dead letter of each reason, by its
    position in the input (file, then line or row: ``contract.hashing.key_position``), not by
    the string order of keys (which puts line 10 before line 2)."""
    from contract.hashing import key_position

    out: dict[tuple[str, str], tuple[str, str]] = {}
    for s in stats:
        if s[0] == "rejected_example":
            _, source, reason, key, detail = s
            if (source, reason) not in out or key_position(key) < key_position(out[source, reason][0]):
                out[source, reason] = (key, detail)
    return out


def _weighted_steps(config: MixtureConfig, name: str) -> list[tuple[int, float]]:
    """``(from_step, weight)`` of every phase that gives source ``name`` a weight > 0."""
    return [(p.from_step, p.weights.get(name, 0.0)) for p in config.phases if p.weights.get(name, 0.0) > 0]


def _loss_reasons(name: str, led: Ledger, examples: Mapping[tuple[str, str], tuple[str, str]], output: str) -> str:
    """``: read N, packed N, rejected N: <top three reasons with the first dead letter>; dead letters in ...``."""
    rejected = sum(led.rejected.values())
    top = sorted(led.rejected.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    reasons = "; ".join(
        f"{reason} {count:,}" + (f" (first: {examples[name, reason][0]}: {examples[name, reason][1]})"
                                 if (name, reason) in examples and examples[name, reason][1] else "")
        for reason, count in top
    )
    dropped = led.duplicates_dropped
    return (
        f": read {led.read:,}, packed {led.packed:,}, rejected {rejected:,}"
        + (f", dropped as duplicates of earlier documents {dropped:,} (dedup: exact)" if dropped else "")
        + (f": {reasons}" if reasons else "" if dropped else " (the files hold no documents)")
        + (f"; dead letters in {fsutil.join(output, ERRORS_DIR, name + '-*.jsonl')}" if rejected else "")
    )


def losses(
    config: MixtureConfig,
    manifest: Manifest,
    examples: Mapping[tuple[str, str], tuple[str, str]],
    output: str,
) -> tuple[list[str], list[str]]:
    """Silent loss, source by source: ``(problems that fail the run, warnings)``.

    A source with weight > 0 in some phase (one this mixture trains on) is a problem when

    * it packed no row (a loader could not draw from it), or
    * it rejected more than ``config.max_rejected_fraction`` of the documents it read.

    A source at weight 0 in every phase never fails the run (this mixture never draws from
    it); over the rejection limit it is a warning, since a mixture that gives it weight later
    would train on what was packed. Each line names the top three reasons with their counts
    and the first dead letter's key and detail, and where the dead letters are.
    """
    problems, warnings = [], []
    limit = config.max_rejected_fraction
    for name in config.source_names:
        led = manifest.sources[name].ledger
        rejected = sum(led.rejected.values())
        steps = _weighted_steps(config, name)
        over = bool(led.read) and rejected / led.read > limit
        share = f"rejected {rejected / led.read:.0%} of its documents, over max_rejected_fraction {limit:g}" if over else ""
        if not steps:
            if over:
                warnings.append(f"source {name!r} (weight 0 in every phase) {share}"
                                + _loss_reasons(name, led, examples, output)
                                + "; fix its input before a mixture gives it weight")
            continue
        why = []
        if manifest.sources[name].records == 0:
            why.append(f"packed no rows but has weight {steps[0][1]:g} from step {steps[0][0]}")
        if over:
            why.append(share)
        if why:
            problems.append(f"source {name!r} " + " and ".join(why) + _loss_reasons(name, led, examples, output))
    return problems, warnings


def _loss_message(problems: list[str], limit: float, all_duplicates: Sequence[str] = ()) -> str:
    """The message of a run that lost too much; ``all_duplicates``: sources that packed nothing
    because every document they read duplicates an earlier one (``dedup: exact``)."""
    accept = (f"; to accept the loss, raise max_rejected_fraction in the config (now {limit:g})" if limit < 1
              else " (max_rejected_fraction is already 1: a source that packs no row cannot be accepted, since "
                   "a loader could not draw from it)")
    head = "a source lost too much, manifest.json not written:\n  " + "\n  ".join(problems)
    if all_duplicates and len(all_duplicates) == len(problems):
        return (head + f"\nnext: every document of {', '.join(map(repr, all_duplicates))} duplicates one of a source "
                "listed before it (dedup: exact keeps the first copy): remove the source from the mixture or set its "
                "weight to 0 in every phase, or set dedup: report to pack the copies")
    dups = (f"\n(every document of {', '.join(map(repr, all_duplicates))} duplicates one of a source listed before "
            "it: dedup: exact keeps the first copy)") if all_duplicates else ""
    return (head + dups + "\nnext: fix the input or the source's format/text_field and rerun; to train without the "
            "source, set its weight to 0 in every phase" + accept)


def remove_stale_spills(output: str, base: Optional[str]) -> None:
    """Removes the spill folders that killed runs into ``output`` left behind.

    Under ``<output>/_tmp`` every ``dataprep-spill-*`` folder goes (only runs into this
    output write there, and the output is locked), then ``_tmp`` itself when empty. Under
    another ``base`` (``--temp_location``, shared by many runs) only the folders named for
    this output (``dataprep-spill-<output key>-*``). A run that ends, well or not, removes
    its own folder; one that is killed cannot, and its files would stay for ever.
    """
    tmp = fsutil.join(output, TMP_DIR)
    targets = [(tmp, SPILL_PREFIX)]
    if base is not None and base != tmp:
        targets.append((base, f"{SPILL_PREFIX}{_output_key(output)}-"))
    for folder, prefix in targets:
        if fsutil.is_local(folder):
            import glob

            for path in sorted(glob.glob(os.path.join(glob.escape(folder), glob.escape(prefix) + "*"))):
                shutil.rmtree(path, ignore_errors=True)
        else:  # object stores have no folders: the files are the folder
            for path in fsutil.match(fsutil.join(folder, prefix + "*", "*" + staging.SPILL_SUFFIX)):
                fsutil.delete(path)
    if fsutil.is_local(tmp):
        try:
            os.rmdir(tmp)  # the folder may hold other files: then it stays
        except OSError:
            pass


def is_local_runner(options: PipelineOptions) -> bool:
    """True for Beam's local runners (FnApiRunner, DirectRunner, BundleBasedDirectRunner, ...)."""
    runner = options.view_as(StandardOptions).runner
    name = runner if isinstance(runner, str) else type(runner).__name__
    return name.rsplit(".", 1)[-1] in LOCAL_RUNNERS


def spill_base(mode: str, options: PipelineOptions, output: str) -> Optional[str]:
    """The folder under which this run's spill folder goes, or None when tokens go through the shuffle.

    ``mode``: ``auto`` spills on local runners only; ``on`` always; ``off`` never. The base
    is ``--temp_location`` when set, else ``<output>/_tmp`` when the output is local, else
    the local temporary folder.

    Raises:
      ConfigError: ``--spill on`` with a distributed runner and a local base (its workers
        could not read each other's spill files).
    """
    local = is_local_runner(options)
    if mode == "off" or (mode == "auto" and not local):
        return None
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    base = options.view_as(GoogleCloudOptions).temp_location
    if not base:
        base = fsutil.join(output, TMP_DIR) if fsutil.is_local(output) else tempfile.gettempdir()
    if not local and fsutil.is_local(base):
        raise ConfigError(
            f"--spill on: the spill folder {base} is on this machine's disk, which the workers of a "
            "distributed runner do not share; set --temp_location to storage they all read (gs://...), "
            "or use --spill auto (tokens go through the shuffle)"
        )
    return base


def spill_folder(base: Optional[str], output: str) -> Optional[str]:
    """This run's spill folder, ``<base>/dataprep-spill-<output key>-<random>``, or None without a base.

    The output key (a hash of the output path, :func:`spill_base` gives the base) lets a
    rerun remove what a killed run into the same output left under a shared
    ``--temp_location`` (:func:`remove_stale_spills`).
    """
    if base is None:
        return None
    return fsutil.join(base, f"{SPILL_PREFIX}{_output_key(output)}-{uuid.uuid4().hex[:12]}")


def _clear_dead_letters(output: str, config: MixtureConfig, pre: preflight.Preflight) -> None:
    """Removes dead-letter files and stale shards of an earlier, uncommitted or overwritten run.

    Shards have fixed names and are rewritten; dead-letter files exist only for buckets with
    rejections, and shards named for another shard count are not rewritten, so a stale one
    could otherwise survive a rerun beside the new dataset.
    """
    for source in config.source_names:
        for path in fsutil.match(fsutil.join(output, ERRORS_DIR, f"{source}-?????-of-?????.jsonl")):
            fsutil.delete(path)
        # Shards of an earlier run with another shard count are not rewritten either.
        n = preflight.num_shards(config, pre, source)
        current = {shard_name(i, n) for i in range(n)}
        for path in fsutil.match(fsutil.join(output, source, "data-?????-of-?????.array_record")):
            if FileSystems.split(path)[1] not in current:
                fsutil.delete(path)
        for path in fsutil.match(fsutil.join(output, source, "data-?????-of-?????.array_record.tmp-*")):
            fsutil.delete(path)  # a shard being written when a run was killed


def _metrics(result) -> dict[str, int]:
    try:
        counters = result.metrics().query(MetricsFilter().with_namespace(pipeline.NAMESPACE))["counters"]
    except (NotImplementedError, KeyError, AttributeError):
        return {}
    out = {}
    for c in counters:
        value = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(value or 0)
    return dict(sorted(out.items()))


def _say(quiet: bool, line: str) -> None:
    """Prints ``line`` to stderr unless ``quiet``; a closed stderr (a pipe whose reader is gone)
    does not fail the run: the lines are a view, the manifest is the record."""
    if not quiet:
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass


def run(argv: Optional[Sequence[str]] = None, print_summary: bool = True) -> PackResult:
    """Runs the whole packing: checks, pipeline, ledger, loss checks, manifest, report.

    Args:
      argv: ``--config``, ``--output``, this command's options and any Beam pipeline options.
      print_summary: print the Rich summary table to stdout (``--quiet`` turns it off, and
        the progress lines on stderr too).

    Returns:
      The :class:`PackResult`.

    Raises:
      ConfigError: the config, a file check, the shard plan, a Beam option, or the output or
        spill folder (not a folder, not writable) failed (before any work started).
      OutputExistsError: ``--output`` holds a committed dataset and ``--overwrite`` is off;
        :class:`OutputBusyError` when another run is writing to the same local output.
      PipelineError: the pipeline failed (``manifest.json`` is not written).
      LedgerError: the counts do not reconcile (``manifest.json`` is not written).
      DataLossError: a source lost too much (``manifest.json`` is not written).
      Interrupted: Ctrl-C or SIGTERM (a ``KeyboardInterrupt`` saying whether it came after the commit).
    """
    t0 = time.time()
    args, config, steps, pre, output, options, p = _prepare(argv)
    if args.dry_run or args.dry_run_venv:
        raise ConfigError("--dry-run: call dataprep.pack.dry_run (the command does), which builds no dataset")
    base = spill_base(args.spill, options, output)
    if base is not None and base != fsutil.join(output, TMP_DIR):
        check_spill_outside_inputs(config, base)
        check_writable_folder(base, "--temp_location")
    check_writable_folder(output, "--output")  # creates it: the lock is taken on the folder
    lock = lock_output(output)
    state: dict[str, bool] = {}
    try:
        return _run_locked(args, config, pre, output, options, p, base, t0, print_summary, state, steps)
    except KeyboardInterrupt:
        raise Interrupted(output, state.get("committed", False)) from None
    finally:
        if lock is not None:
            locks.release(lock)


def _prepare(argv: Optional[Sequence[str]]):
    """The checks every run makes before it touches anything: arguments, config, the file
    checks of preflight, the output's form and Beam's options (Beam validates them when the
    pipeline object is made). Returns ``(args, config, steps, pre, output, options, p)``.

    Raises:
      ConfigError: the first mistake.
    """
    args, beam_args = parse_args(argv)
    if args.dry_run or args.dry_run_venv:
        dryrun.require_gcp()  # before a gs:// path or Beam's own message about a runner it cannot load
    if not args.progress_every > 0:
        raise ConfigError(f"--progress-every: must be > 0 seconds, got {args.progress_every}")
    if not 0 <= args.max_repeated_fraction <= 1:
        raise ConfigError(f"--max-repeated-fraction: must be in [0, 1], got {args.max_repeated_fraction}")
    config = load_mixture(args.config)
    steps = planned_steps(args, config)
    pre = preflight.preflight(config, args.max_shard_tokens)
    if not args.output.strip():
        raise ConfigError("--output: must name a folder, got an empty string")  # "" would be "/"
    output = args.output.rstrip("/") or "/"
    if fsutil.has_glob(output):  # Beam's FileSystems.match, used on the output, cannot quote them
        raise ConfigError(f"--output {output}: must not contain the glob characters *, ? or [")
    check_output_location(output)
    check_inputs_outside_output(pre.files, output)
    options = pipeline_options(beam_args)
    if args.dry_run or args.dry_run_venv:
        if is_local_runner(options):
            raise ConfigError("--dry-run builds a Dataflow job: pass --runner DataflowRunner and its options "
                              "(--project, --region, --temp_location gs://..., --setup_file ./pyproject.toml)")
        dryrun.prepare_options(options)  # no cloud call from Beam's own option checks
    try:
        p = beam.Pipeline(options=options)  # checks the runner, before the output is touched
    except ValueError as e:
        raise ConfigError(f"Beam options: {e}") from None
    return args, config, steps, pre, output, options, p


def dry_run(argv: Optional[Sequence[str]] = None) -> dryrun.DryRunReport:
    """``--dry-run``: every check of :func:`run`, then the Dataflow job built and checked
    (``dataprep.dryrun.run_dry``); nothing is written to ``--output`` and nothing is submitted.

    Raises:
      ConfigError: as :func:`run`'s checks; apache-beam[gcp] missing; a runner other than
        Dataflow.
    """
    args, config, _, pre, output, options, _ = _prepare(argv)
    return dryrun.run_dry(config, pre, output, options, args.dry_run_dir, args.dry_run_venv)


def _run_locked(args, config, pre, output, options, p, base, t0, print_summary, state, steps) -> PackResult:
    """:func:`run` once every check has passed and the output is locked; ``state["committed"]``
    is set once manifest.json is written."""
    quiet = args.quiet
    manifest_path = fsutil.join(output, MANIFEST_NAME)
    if fsutil.exists(manifest_path):
        if not args.overwrite:
            raise OutputExistsError(
                f"--output {output} already holds a dataset ({MANIFEST_NAME}); pass --overwrite to replace it"
            )
        fsutil.delete(manifest_path)
    _clear_dead_letters(output, config, pre)
    fsutil.delete(fsutil.join(output, REPORT_NAME))
    remove_stale_spills(output, base)
    vocab = int(pre.tokenizer_info["vocab_size"])
    for warning in disk_space_warnings(pre, output, base, token_dtype_for_vocab(vocab).itemsize):
        _say(False, "warning: " + warning)
    timings = {"checks": time.time() - t0}
    shards = {n: preflight.num_shards(config, pre, n) for n in config.source_names}
    _say(
        quiet,
        f"pack: checks done in {progress.duration(timings['checks'])} ({sum(map(len, pre.files.values())):,} files, "
        f"{pre.input_bytes / 1e6:,.1f} MB; shards: " + ", ".join(f"{n} {k}" for n, k in shards.items()) + ")",
    )
    local = is_local_runner(options)
    spill = spill_folder(base, output)
    beats = progress.heartbeat_folder() if local and not quiet else None
    _ = p | "Pack" >> faults.pack_sources()(
        config, pre.files, pre.tokenizer_sha256, token_dtype_for_vocab(vocab).name, output,
        num_shards=shards, sizes=pre.sizes, spill_dir=spill, heartbeat_dir=beats,
        driver_pid=os.getpid() if local else None,
    )
    t1 = time.time()
    # Everything so far (Beam, the config) lives for the whole run: keep the cyclic garbage
    # collector from walking it again at every collection while the pipeline runs.
    gc.freeze()
    workers = options.view_as(DirectOptions).direct_running_mode == "multi_processing"
    try:
        with progress.filtered_stderr(local and workers) as err:
            monitor = progress.Monitor(pre.input_bytes, sum(shards.values()), err, args.progress_every)
            watcher = monitor.watch(beats) if beats else None
            try:
                result = p.run()
                if local or quiet:
                    result.wait_until_finish()
                else:
                    _wait_with_progress(result, monitor, args.progress_every)
            finally:
                if watcher is not None:
                    watcher.stop()
    except Exception as e:  # a worker's error, re-raised by the runner: name it, say what to do
        raise PipelineError(_pipeline_failure(e, output, spill)) from e
    finally:
        gc.unfreeze()
        if beats:
            shutil.rmtree(beats, ignore_errors=True)
        if spill:
            staging.remove_spill(spill)
            remove_stale_spills(output, None)  # <output>/_tmp itself, when empty
    timings.update(monitor.durations if len(monitor.durations) == 2 else {"pipeline": time.time() - t1})
    t2 = time.time()
    stats_path = fsutil.join(output, pipeline.STATS_NAME)
    stats = json.loads(fsutil.read_bytes(stats_path))
    manifest = build_manifest(config, pre, stats)
    metrics = _metrics(result)
    problems = manifest.problems()
    if problems:
        raise LedgerError(
            "the ledger does not reconcile, manifest.json not written:\n  " + "\n  ".join(problems)
        )
    report_path = None
    examples = rejected_examples(stats)
    lost, warnings = losses(config, manifest, examples, output)
    if lost:
        copies = [n for n in config.source_names if manifest.sources[n].records == 0
                  and manifest.sources[n].ledger.duplicates_dropped and not manifest.sources[n].ledger.packed]
        message = _loss_message(lost, config.max_rejected_fraction, copies)
        if not args.no_report:
            report_path = _write_report(manifest, config, stats, output, quiet, failure=message)
        fsutil.delete(stats_path)
        raise DataLossError(message + (f"\nreport: {report_path}" if report_path else ""))
    if args.duplicates != "off":
        found = dup.find(manifest, args.max_repeated_fraction)
        if found and args.duplicates == "refuse":
            fsutil.delete(stats_path)
            raise DataLossError("duplicated data (--duplicates refuse), manifest.json not written:\n  "
                                + "\n  ".join(f.message for f in found))
        warnings = [*warnings, *(f"duplicated data: {f.message}" for f in found)]
    fsutil.write_bytes_atomic(manifest_path, manifest.to_json().encode("ascii"))  # the commit
    state["committed"] = True
    fsutil.delete(stats_path)
    timings["manifest"] = time.time() - t2
    _say(quiet, f"pack: manifest written in {progress.duration(timings['manifest'])}: {manifest_path}")
    for warning in warnings:
        _say(False, "warning: " + warning)
    epochs, lines, epoch_warnings = epochs_of_run(config, manifest, steps, args.global_batch, args.max_epochs)
    head = (f"pack: epochs of each source in the planned run ({steps:,} steps of {args.global_batch:,} rows):"
            if steps is not None else
            "pack: epochs (pass --train-steps or --train-tokens with --global-batch for those of a planned run):")
    _say(quiet, "\n  ".join([head, *lines]))
    for warning in epoch_warnings:
        _say(False, "warning: " + warning)
    if not args.no_report:
        t3 = time.time()
        report_path = _write_report(manifest, config, stats, output, quiet)
        timings["report"] = time.time() - t3
        if report_path:
            _say(quiet, f"pack: report drawn in {progress.duration(timings['report'])}: {report_path}")
    timings["total"] = time.time() - t0
    _say(quiet, "pack: done in " + progress.duration(timings["total"]) + " (" + ", ".join(
        f"{k} {progress.duration(v)}" for k, v in timings.items() if k != "total") + ")")
    out = PackResult(output=output, manifest=manifest, metrics=metrics, timings=timings, report=report_path,
                     epochs=tuple(epochs))
    if print_summary and not quiet:
        from dataprep import summary

        summary.print_summary(out)
    return out


# Shard bytes on disk per token, high: 0.31 of the uint16 width measured (docs/dataprep.md).
SHARD_BYTES_PER_TOKEN = 1.0


def disk_space_warnings(pre: preflight.Preflight, output: str, base: Optional[str], itemsize: int) -> list[str]:
    """Warnings for local folders with less free space than the run may need there.

    Needs, from the estimated tokens (high on purpose, ``dataprep.sizing``): the spill
    files, ``itemsize`` bytes a token (removed at the end), and the shards,
    :data:`SHARD_BYTES_PER_TOKEN`. Folders on one file system add up. Only a warning: the
    estimate can be twice the real count; a disk that fills fails the run (exit 1).
    """
    tokens = sum(plan.estimated_tokens for plan in pre.shards.values())
    needs: dict[int, list] = {}
    for folder, need in ((output, tokens * SHARD_BYTES_PER_TOKEN), (base, tokens * itemsize if base else 0)):
        if not folder or not need or not fsutil.is_local(folder):
            continue
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:  # <output>/_tmp: not made yet
            folder = os.path.dirname(folder)
        dev = os.stat(folder).st_dev
        entry = needs.setdefault(dev, [folder, 0.0, shutil.disk_usage(folder).free])
        entry[1] += need
    def size(n: float) -> str:
        return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"

    return [
        f"{folder} has {size(free)} free; this run may need up to {size(need)} there (spill "
        f"files {itemsize} bytes a token and shards, from the estimated tokens, which are high on purpose); "
        "if the disk fills, the run fails with exit status 1"
        for folder, need, free in needs.values() if free < need
    ]


def _pipeline_failure(e: BaseException, output: str, spill: Optional[str]) -> str:
    """The one-paragraph message of a failed pipeline: what failed, what was kept, what to do."""
    text = f"{type(e).__name__}: {e}"
    # A multi-process runner's error holds the worker's whole traceback: its last line that is
    # not a frame ("SomeError: what [while running 'Pack/...']") says what failed.
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln[0].isspace()
             and not ln.startswith(("Traceback (most recent call last)", "During handling", "The above exception"))]
    first = lines[-1] if lines else type(e).__name__
    if len(first) > 600:
        first = first[:600] + " ..."
    hint = "fix the cause (the worker traceback above names the step) and rerun; the rerun replaces what this run left"
    if "[Errno 28]" in text or "No space left" in text:
        base = FileSystems.split(spill)[0] if spill else None
        where = output + (f" and {base} (spill files)" if base and base != fsutil.join(output, TMP_DIR) else "")
        hint = (f"the disk is full: free space under {where}, or point --temp_location at a larger disk (spill "
                "files need about 2 bytes a token, 4 above 65,536 pieces, and are removed at the end); then rerun")
    elif pipeline.InputChangedError.__name__ in text:
        hint = "an input changed while the pack ran: rerun once the inputs are stable (their listing is taken at the start)"
    return (f"the pipeline failed, manifest.json not written: {first}\nnext: {hint}")


def _write_report(manifest: Manifest, config: MixtureConfig, stats: list[list], output: str, quiet: bool,
                  failure: Optional[str] = None):
    """Draws ``<output>/report.png``; returns its path, or None (with a warning) when it fails.

    The picture is a view of a dataset already committed (or of a failed run, whose
    ``failure`` message it shows): failing to draw it must not fail the pack.
    """
    from dataprep import report

    path = fsutil.join(output, REPORT_NAME)
    try:
        fsutil.write_bytes(path, report.render(manifest, config, report.segment_histograms(stats), failure=failure))
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        _say(quiet, f"warning: {REPORT_NAME} not drawn ({type(e).__name__}: {e}); the dataset is not affected; "
                    "rerun with --overwrite to try again, or pass --no-report")
        return None
    return path


def _wait_with_progress(result, monitor: progress.Monitor, every: float) -> None:
    """Waits for a distributed runner's job, showing its counters every ``every`` seconds."""
    from apache_beam.runners.runner import PipelineState

    start = time.time()
    while True:
        state = result.wait_until_finish(duration=int(every * 1000))
        if state is not None and PipelineState.is_terminal(state):
            return
        monitor.update(progress.counters_as_stages(_metrics(result), start, time.time()))


def _terminate(signum, frame) -> None:
    """SIGTERM (a scheduler's or ``timeout``'s stop) ends the run like Ctrl-C: Beam stops its
    workers and the run removes its spill files (by default Python would die on the spot)."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (130 when interrupted or terminated)."""
    import signal

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return _main(argv)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Optional[Sequence[str]]) -> int:
    args = list(argv) if argv is not None else sys.argv[1:]
    if "--dry-run" in args or "--dry-run-venv" in args:
        try:
            report = dry_run(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        print(dryrun.main_lines(report), end="")
        return EXIT_CONFIG if report.problems else 0
    try:
        run(argv)
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the output was touched
        print("error: interrupted before any work; nothing was written", file=sys.stderr)
        return 130
    except (ConfigError, OutputExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_LEDGER
    except DataLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_LOSS
    except PipelineError as e:
        import traceback

        traceback.print_exception(e.__cause__, file=sys.stderr)  # the driver's view of the worker's error
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PIPELINE
    return 0


if __name__ == "__main__":
    gc.freeze()
    gc.enable()
    sys.exit(main())
