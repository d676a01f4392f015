"""Checks that touch files, run before any pipeline is built (config mistakes first).

``contract.config.load_mixture`` validates the schema; this module adds what needs a file
system, through Beam's ``FileSystems`` so that ``gs://`` works: every path or glob must
match at least one file, the tokenizer must exist and match its pinned sha256, the first
Parquet file of a source must have its text column, and each source's shard count (from
the listed file sizes, ``dataprep.sizing``) must keep a bucket within the budget.

Every :class:`ConfigError` raised here names the config file first (``configs/x.yaml:
sources[0].paths[0]: 'in/*.jsonl' matches no file``), so that a user with many configs
knows which one to fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Iterator, Mapping

from contract.config import ConfigError, MixtureConfig, SourceFormat
from dataprep import fsutil, sizing, tokenizer


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What the checks found.

    Attributes:
      files: per source name, the sorted, de-duplicated input files.
      tokenizer_sha256: sha256 of the tokenizer model file.
      tokenizer_info: the manifest's ``tokenizer`` entry (path, sha256, vocab size, ids, flags).
      sizes: per source name, the listed byte size of each file of ``files`` (same order).
      shards: per source name, its :class:`dataprep.sizing.ShardPlan`.
    """

    files: Mapping[str, tuple[str, ...]]
    tokenizer_sha256: str
    tokenizer_info: Mapping[str, object]
    sizes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    shards: Mapping[str, sizing.ShardPlan] = dataclasses.field(default_factory=dict)

    @property
    def input_bytes(self) -> int:
        """Listed bytes of all input files."""
        return sum(sum(v) for v in self.sizes.values())


@contextlib.contextmanager
def in_config(config: MixtureConfig) -> Iterator[None]:
    """Re-raises a :class:`ConfigError` with the config file's path in front (when it has one;
    not for a message about a command-line option, ``--...``)."""
    try:
        yield
    except ConfigError as e:
        if config.path and not str(e).startswith((f"{config.path}: ", "--")):
            raise ConfigError(f"{config.path}: {e}") from None
        raise


def match_inputs(config: MixtureConfig) -> dict[str, tuple[str, ...]]:
    """Returns, per source, the input files its paths match (see :func:`match_inputs_with_sizes`).

    Raises:
      ConfigError: as :func:`match_inputs_with_sizes`, naming the config file.
    """
    with in_config(config):
        listed = match_inputs_with_sizes(config)
    return {name: tuple(p for p, _ in found) for name, found in listed.items()}


def _no_match_next(pattern: str, config_path: str | None) -> str:
    """What to do about a path or glob that matches no file: where relative paths start, and what the
    deepest existing folder of the pattern holds (local paths; the first 10 names)."""
    base = (f"relative paths are read from the config file's folder {os.path.dirname(os.path.abspath(config_path))}"
            if config_path else "relative paths are read from the config file's folder")
    if "://" in pattern:
        return f"check the path ({base}) and list what is there"
    wanted = re.split(r"[*?\[]", pattern, maxsplit=1)[0] if fsutil.has_glob(pattern) else pattern
    folder = wanted if wanted.endswith(os.sep) else os.path.dirname(wanted)
    folder = folder.rstrip(os.sep) or os.sep
    missing = None
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        missing, folder = folder, os.path.dirname(folder)
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        held = f"{folder} cannot be listed ({e.strerror or e})"
    else:
        shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")
        held = f"{folder} holds: {shown}" if names else f"{folder} is empty"
    gone = f"{missing} does not exist; " if missing else ""
    return f"check the path ({base}): {gone}{held}"


def match_inputs_with_sizes(config: MixtureConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Returns, per source, the ``(file, listed size in bytes)`` its paths match, sorted.

    Folders (and FIFOs, devices) that a glob matches (``in/*`` over a tree) are not inputs and
    are left out. Local globs follow symbolic links to folders (``dataprep.fsutil.list_inputs``).

    Raises:
      ConfigError: a path or glob matches no file (naming ``sources[i].paths[j]``), a path
        names a folder, a matched file's name is not UTF-8, two sources (or two paths of one
        source) read the same file, or the local listing would leave files out silently
        (``dataprep.fsutil.list_inputs``: a dangling link, a folder that cannot be listed).
    """
    files: dict[str, tuple[tuple[str, int], ...]] = {}
    owner: dict[str, tuple[str, str]] = {}  # real path -> (source, path as listed)
    for i, source in enumerate(config.sources):
        found: dict[str, int] = {}
        for j, pattern in enumerate(source.paths):
            try:
                listed = dict(fsutil.list_inputs(pattern))
            except ValueError as e:  # a scheme no file system serves; a dangling link, an unreadable folder
                raise ConfigError(f"sources[{i}].paths[{j}]: {e}") from None
            if not listed and fsutil.has_glob(pattern) and fsutil.exists(pattern):
                listed = {pattern: fsutil.size(pattern)}  # a file whose name holds glob characters, "a[1].jsonl"
            matched = sorted(listed)
            files_only = [m for m in matched if not fsutil.is_not_a_file(m)]
            if not files_only:
                if matched and not fsutil.has_glob(pattern):
                    raise ConfigError(
                        f"sources[{i}].paths[{j}]: {pattern!r} is a folder or other non-regular file, "
                        f"not an input file; name the files, e.g. {fsutil.join(pattern, '*')!r}"
                    )
                raise ConfigError(f"sources[{i}].paths[{j}]: {pattern!r} matches no file; "
                                  f"{_no_match_next(pattern, config.path)}")
            for m in files_only:
                try:
                    m.encode("utf-8")
                except UnicodeEncodeError:
                    shown = m.encode("utf-8", "surrogateescape")
                    raise ConfigError(
                        f"sources[{i}].paths[{j}]: {pattern!r} matches the file {shown!r}, whose name is "
                        "not valid UTF-8 (document keys are UTF-8); rename it or narrow the pattern"
                    ) from None
            found.update((m, listed[m]) for m in files_only)
        for f in sorted(found):
            same = fsutil.real_path(f)  # one file through two links, or two spellings
            if same in owner:
                other, first = owner[same]
                if other == source.name:
                    raise ConfigError(
                        f"sources[{i}].paths: {first} and {f} are the same file ({same}, through a symbolic "
                        "link): its documents would be read twice; narrow the paths or globs to one of them"
                    )
                raise ConfigError(
                    f"sources[{i}].paths: {f} is also an input of source {other!r}"
                    + (f" (as {first})" if first != f else "")
                    + "; a file may belong to one source only"
                )
            owner[same] = (source.name, f)
        files[source.name] = tuple(sorted(found.items()))
    return files


def check_parquet_columns(config: MixtureConfig, files: Mapping[str, tuple[str, ...]]) -> None:
    """Raises :class:`ConfigError` when the first file of a Parquet source lacks its text column.

    Only the footer of one file per source is read (the schema), so a wrong ``text_field``
    is a config mistake reported before any work, with the columns the file has. Files
    after the first are checked as they are read (their rows become ``missing_text``
    dead letters naming the columns).
    """
    import pyarrow
    import pyarrow.parquet as pq

    for i, source in enumerate(config.sources):
        if source.format is not SourceFormat.PARQUET or not files[source.name]:
            continue
        first = files[source.name][0]
        try:
            with fsutil.open_raw(first) as f:
                names = pq.ParquetFile(f).schema_arrow.names
        except (pyarrow.ArrowException, OSError):  # a damaged file: the reader's dead letter, not a config error
            continue
        if source.text_field not in names:
            raise ConfigError(
                f"sources[{i}].text_field: {first} has no column {source.text_field!r}; its columns are "
                f"{sorted(names)}; set text_field to the column that holds the text"
            )


def check_tokenizer(config: MixtureConfig) -> tuple[str, dict[str, object]]:
    """Loads the tokenizer once to check it; returns (sha256, manifest tokenizer entry).

    Raises:
      ConfigError: the model is missing or unreadable, its sha256 differs from
        ``tokenizer.sha256``, or ``add_bos``/``add_eos`` ask for an id the model lacks.
    """
    path = config.tokenizer.path
    try:
        found = fsutil.exists(path)
    except ValueError as e:  # a scheme no installed Beam file system serves
        raise ConfigError(f"tokenizer.path: {e}") from None
    if not found:
        raise ConfigError(f"tokenizer.path: {path} does not exist")
    if fsutil.is_not_a_file(path):  # a folder, or a device such as /dev/zero that never ends
        raise ConfigError(f"tokenizer.path: {path} is a folder or other non-regular file, not a model file")
    try:
        sp, sha = tokenizer.load(path)
    except (IOError, RuntimeError) as e:
        raise ConfigError(f"tokenizer.path: {path} is not a readable SentencePiece model: {e}") from None
    expected = config.tokenizer.sha256
    if expected is not None and sha != expected:
        raise ConfigError(f"tokenizer.sha256: the config pins {expected}, but {path} has sha256 {sha}; point "
                          f"tokenizer.path at the model the pin is for, or, if {path} is the right model, pin it: set "
                          f"tokenizer.sha256: {sha} (python -m dataprep.train_tokenizer ... --pin writes it when it "
                          f"trains a model)")
    if config.tokenizer.add_bos and sp.bos_id() < 0:
        raise ConfigError(f"tokenizer.add_bos: {path} has no BOS id")
    if config.tokenizer.add_eos and sp.eos_id() < 0:
        raise ConfigError(f"tokenizer.add_eos: {path} has no EOS id")
    info = tokenizer.describe(sp, path, sha, config.tokenizer.add_bos, config.tokenizer.add_eos)
    return sha, info


def preflight(config: MixtureConfig, max_shard_tokens: int = sizing.DEFAULT_MAX_SHARD_TOKENS) -> Preflight:
    """Runs every file check and plans the shards; raises :class:`ConfigError` on the first problem,
    naming the config file and the field."""
    with in_config(config):
        sha, info = check_tokenizer(config)
        listed = match_inputs_with_sizes(config)
        files = {n: tuple(p for p, _ in v) for n, v in listed.items()}
        sizes = {n: tuple(s for _, s in v) for n, v in listed.items()}
        check_parquet_columns(config, files)
        shards = sizing.plan_shards(config, sizes, max_shard_tokens)
    return Preflight(files=files, tokenizer_sha256=sha, tokenizer_info=info, sizes=sizes, shards=shards)


def num_shards(config: MixtureConfig, pre: Preflight, source: str) -> int:
    """The shard count of ``source``: its plan's, else ``shards_per_source`` (or 1)."""
    plan = pre.shards.get(source)
    return plan.num_shards if plan is not None else (config.shards_per_source or 1)
