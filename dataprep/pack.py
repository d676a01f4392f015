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

``python dataprep/pack.py ...`` works the same. Exit status: 0 done, 2 bad config,
arguments or output folder (nothing was started), 3 the ledger does not reconcile (no
manifest written).

Order of work: the config is validated and every file check is made (globs, tokenizer
sha256) before the pipeline is built; the pipeline writes shards, dead letters and a
``_stats.json``; then this driver reconciles the ledger, writes ``manifest.json`` last
(the commit marker) and removes ``_stats.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from typing import Mapping, Optional, Sequence

if not __package__:  # run as a script: the repository root replaces dataprep/ on sys.path
    import os as _os

    sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

import apache_beam as beam  # noqa: E402
from apache_beam.io.filesystems import FileSystems  # noqa: E402
from apache_beam.metrics.metric import MetricsFilter  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions  # noqa: E402

from contract.codec import FORMAT_VERSION, token_dtype_for_vocab  # noqa: E402
from contract.config import ConfigError, MixtureConfig, load_mixture  # noqa: E402
from contract.manifest import (  # noqa: E402
    ERRORS_DIR,
    MANIFEST_NAME,
    Ledger,
    Manifest,
    ShardInfo,
    SourceEntry,
    shard_name,
)
from dataprep import fsutil, pipeline, preflight  # noqa: E402

DEFAULT_RUNNER = "FnApiRunner"
EXIT_CONFIG = 2
EXIT_LEDGER = 3


class LedgerError(RuntimeError):
    """The run's counts do not reconcile; the manifest was not written."""


class OutputExistsError(ValueError):
    """The output folder already holds a committed dataset (manifest.json)."""


class OutputNotAFolderError(OutputExistsError):
    """``--output`` (or a folder above it) is an existing file, so no dataset can be written there."""


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


@dataclasses.dataclass(frozen=True)
class PackResult:
    """What a run produced.

    Attributes:
      output: the dataset folder.
      manifest: the manifest written to ``<output>/manifest.json``.
      metrics: Beam counters (``"<source>.<what>" -> value``), committed where the runner
        supports it, else attempted; empty where the runner reports none.
    """

    output: str
    manifest: Manifest
    metrics: Mapping[str, int]


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

exit status: 0 done; 2 bad config, arguments or output folder (checked before any work);
3 the ledger does not reconcile (no manifest.json written).
"""


def check_inputs_outside_output(files: Mapping[str, Sequence[str]], output: str) -> None:
    """Raises :class:`ConfigError` when an input file lies inside ``--output``.

    A glob such as ``corpus/**/*.jsonl`` with ``--output corpus/ds`` would otherwise read the
    previous run's dead letters (``errors/*.jsonl``) or shards back in as documents.
    """
    out = fsutil.real_path(output).rstrip("/") + "/"
    for source in sorted(files):
        for f in files[source]:
            if fsutil.real_path(f).startswith(out):
                raise ConfigError(
                    f"sources: {f} (source {source!r}) lies inside --output {output}; "
                    "the dataset's own files would be read back as inputs: narrow the glob or move --output"
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
    parser.add_argument("--quiet", action="store_true", help="do not print the summary table")
    return parser.parse_known_args(list(argv) if argv is not None else None)


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
            f"unknown argument(s) {unknown}: neither this command's "
            "(--config, --output, --overwrite, --quiet) nor a Beam pipeline option"
        )
    std = options.view_as(StandardOptions)
    if not std.runner:
        std.runner = DEFAULT_RUNNER
    return options


def build_manifest(config: MixtureConfig, pre: preflight.Preflight, stats: list[list]) -> Manifest:
    """Assembles the manifest from the pipeline's stats (see ``dataprep.pipeline``)."""
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
        if [d["bucket"] for d in infos] != list(range(config.shards_per_source)):
            raise LedgerError(
                f"source {n!r}: shards written {[d['bucket'] for d in infos]}, "
                f"expected 0..{config.shards_per_source - 1} once each"
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
    )


def empty_source_warnings(config: MixtureConfig, manifest: Manifest) -> list[str]:
    """Warnings for sources that packed no row but have weight > 0 in some phase.

    The dataset is committed all the same (the ledger reconciles), but a loader cannot draw
    rows from such a source, so the mixture as configured cannot be trained on.
    """
    out = []
    for name in config.source_names:
        entry = manifest.sources[name]
        steps = [p.from_step for p in config.phases if p.weights.get(name, 0.0) > 0]
        if entry.records == 0 and steps:
            rejected = ", ".join(f"{k}: {v}" for k, v in sorted(entry.ledger.rejected.items())) or "none"
            out.append(
                f"warning: source {name!r} packed no rows (documents read {entry.ledger.read}, "
                f"rejected {rejected}) but has weight > 0 from step {steps[0]}; "
                f"a loader cannot draw from it (see {ERRORS_DIR}/)"
            )
    return out


def _clear_dead_letters(output: str, config: MixtureConfig) -> None:
    """Removes dead-letter files and stale shards of an earlier, uncommitted or overwritten run.

    Shards have fixed names and are rewritten; dead-letter files exist only for buckets with
    rejections, and shards named for another shard count are not rewritten, so a stale one
    could otherwise survive a rerun beside the new dataset.
    """
    for source in config.source_names:
        for path in fsutil.match(fsutil.join(output, ERRORS_DIR, f"{source}-?????-of-?????.jsonl")):
            fsutil.delete(path)
        # Shards of an earlier run with another shards_per_source are not rewritten either.
        current = {shard_name(i, config.shards_per_source) for i in range(config.shards_per_source)}
        for path in fsutil.match(fsutil.join(output, source, "data-?????-of-?????.array_record")):
            if FileSystems.split(path)[1] not in current:
                fsutil.delete(path)


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


def run(argv: Optional[Sequence[str]] = None, print_summary: bool = True) -> PackResult:
    """Runs the whole packing: checks, pipeline, ledger, manifest.

    Args:
      argv: ``--config``, ``--output`` and any Beam pipeline options.
      print_summary: print the Rich summary table to stdout (``--quiet`` turns it off).

    Returns:
      The :class:`PackResult`.

    Raises:
      ConfigError: the config, a file check or a Beam option failed (before any work started).
      OutputExistsError: ``--output`` holds a committed dataset and ``--overwrite`` is off.
      LedgerError: the counts do not reconcile (``manifest.json`` is not written).
    """
    args, beam_args = parse_args(argv)
    config = load_mixture(args.config)
    pre = preflight.preflight(config)
    if not args.output.strip():
        raise ConfigError("--output: must name a folder, got an empty string")  # "" would be "/"
    output = args.output.rstrip("/") or "/"
    if fsutil.has_glob(output):  # Beam's FileSystems.match, used on the output, cannot quote them
        raise ConfigError(f"--output {output}: must not contain the glob characters *, ? or [")
    check_output_location(output)
    check_inputs_outside_output(pre.files, output)
    options = pipeline_options(beam_args)
    try:
        p = beam.Pipeline(options=options)  # checks the runner, before the output is touched
    except ValueError as e:
        raise ConfigError(f"Beam options: {e}") from None
    manifest_path = fsutil.join(output, MANIFEST_NAME)
    if fsutil.exists(manifest_path):
        if not args.overwrite:
            raise OutputExistsError(
                f"--output {output} already holds a dataset ({MANIFEST_NAME}); pass --overwrite to replace it"
            )
        fsutil.delete(manifest_path)
    _clear_dead_letters(output, config)
    vocab = int(pre.tokenizer_info["vocab_size"])
    _ = p | "Pack" >> pipeline.PackSources(
        config, pre.files, pre.tokenizer_sha256, token_dtype_for_vocab(vocab).name, output
    )
    result = p.run()
    result.wait_until_finish()
    stats_path = fsutil.join(output, pipeline.STATS_NAME)
    stats = json.loads(fsutil.read_bytes(stats_path))
    manifest = build_manifest(config, pre, stats)
    metrics = _metrics(result)
    problems = manifest.problems()
    if problems:
        raise LedgerError(
            "the ledger does not reconcile, manifest.json not written:\n  " + "\n  ".join(problems)
        )
    fsutil.write_bytes(manifest_path, manifest.to_json().encode("ascii"))
    fsutil.delete(stats_path)
    for line in empty_source_warnings(config, manifest):
        print(line, file=sys.stderr)
    out = PackResult(output=output, manifest=manifest, metrics=metrics)
    if print_summary and not args.quiet:
        from dataprep import summary

        summary.print_summary(out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    try:
        run(argv)
    except (ConfigError, OutputExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_LEDGER
    return 0


if __name__ == "__main__":
    sys.exit(main())
