"""Open and check a packed dataset before step 0: the manifest, the mixture, every shard.

``open_dataset`` reads ``manifest.json`` (from a folder, or a URL through
``loader.storage``, which stages the shards locally first), checks it against the mixture
config and checks every shard (present, size, opens, record count, optionally sha256),
and returns the :class:`loader.shards.ShardSet` the loader reads from. Every fault is a
``DatasetError`` naming the file and the fault, raised at ``loader.build``, never mid-run.

May import: ``loader.index``, ``loader.storage``, ``loader.shards`` (and ``contract``).
"""

from __future__ import annotations

import hashlib
import os
import shlex


from contract import codec
from contract.config import MixtureConfig
from contract.manifest import MANIFEST_NAME, MANIFEST_VERSION, Manifest, ManifestError, NewerManifestError
from loader import index as ix
from loader import storage
from loader.shards import (NEXT, READ_MODES, DatasetError, ShardSet, _open_reader, pack_command, repair_step,
                           resolve_read_mode, with_next)

# token_dtype of the manifest -> token width in bytes of every record (contract.codec)
TOKEN_WIDTHS = {"uint16": 2, "uint32": 4}

def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    """sha256 hex of the file at ``path``, read ``chunk`` bytes at a time (OSError as ``open``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(dataset: str, mixture: MixtureConfig | str | None = None) -> tuple[Manifest, str]:
    """Returns the dataset's manifest and the sha256 of its ``manifest.json`` bytes.

    ``dataset`` is a folder or a URL (``gs://...``, read through Beam's ``FileSystems``,
    ``loader.storage``). ``mixture`` (a config or its file), when given, is named in the
    ``next:`` line of an error (the config to rebuild the dataset with).

    Raises:
      DatasetError: no manifest (the dataset was never committed), or a malformed one.
    """
    manifest, sha, _ = _load_manifest(storage.local_path(dataset), mixture)
    return manifest, sha


TOOLKIT = "moe-data-toolkit"


def config_for(manifest: Manifest | None, mixture: MixtureConfig | str | None) -> str:
    """The mixture config to rebuild the dataset with, for a ``next:`` line: the mixture's file when
    the manifest records that config (or cannot tell), else a placeholder naming the dataset."""
    path = mixture if isinstance(mixture, str) else getattr(mixture, "path", None)
    same = (manifest is None or not isinstance(mixture, MixtureConfig)
            or mixture.sha256() == manifest.config_sha256)
    if path and same:
        return shlex.quote(path)
    if manifest is not None:
        return f"<the mixture config of {manifest.name!r} version {manifest.version}>"
    return "<the mixture config it was packed from>"


def _manifest_path(dataset: str) -> str:
    """Where ``dataset``'s manifest is: a URL for a URL dataset, else a local path."""
    return storage.join(dataset, MANIFEST_NAME) if storage.is_url(dataset) else os.path.join(dataset, MANIFEST_NAME)


def _load_manifest(dataset: str, mixture: MixtureConfig | str | None = None) -> tuple[Manifest, str, bytes]:
    """:func:`read_manifest` plus the raw bytes."""
    path = _manifest_path(dataset)
    try:
        if storage.is_url(dataset):
            data = storage.read_bytes(path)
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no manifest; the dataset is missing or was not committed{NEXT}check the "
                           f"path (a committed dataset folder holds {MANIFEST_NAME}), or build the dataset: "
                           f"{pack_command(config_for(None, mixture), dataset, overwrite=False)}") from None
    except storage.StagingError as e:
        raise DatasetError(str(e)) from None
    except OSError as e:  # a file where the folder should be, permissions, I/O errors
        raise DatasetError(f"{path}: cannot read the manifest ({e.strerror or e}){NEXT}check that {path} is a "
                           f"readable file inside the dataset folder (the path, permissions, the mount)") from None
    damaged = repair_step(MANIFEST_NAME, dataset, config_for(None, mixture))
    try:
        manifest = Manifest.from_json(data.decode("utf-8"))
        problems = manifest.problems()
    except NewerManifestError as e:
        raise DatasetError(f"{path}: {e}{NEXT}a newer toolkit wrote this dataset: upgrade this one "
                           f"({TOOLKIT}, which reads manifest_version {MANIFEST_VERSION}) to read it") from None
    except (ManifestError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: {e}{damaged}") from None
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type deeper down
        raise DatasetError(f"{path}: malformed manifest ({type(e).__name__}: {e}){damaged}") from None
    damaged = repair_step(MANIFEST_NAME, dataset, config_for(manifest, mixture))
    if problems:
        raise DatasetError(f"{path}: does not reconcile: " + "; ".join(problems) + damaged)
    seen: dict[str, str] = {}
    for name, entry in sorted(manifest.sources.items()):
        for info in entry.shards:
            problem = storage.shard_path_problem(info.path)
            if problem is None and info.path in seen:
                problem = f"is listed twice (sources {seen[info.path]!r} and {name!r})"
            if problem:
                raise DatasetError(f"{path}: shard path {info.path!r} {problem}{damaged}")
            seen[info.path] = name
    return manifest, hashlib.sha256(data).hexdigest(), data


def check_against_mixture(manifest: Manifest, mixture: MixtureConfig, where: str) -> None:
    """Checks format version, seq_len, tokenizer and sources of ``manifest`` against ``mixture``.

    The tokenizer check uses the mixture's pinned sha256, or, when it pins none and its
    tokenizer file exists, that file's sha256.

    Raises:
      DatasetError: naming the field, the dataset's value and the config's.
    """
    if manifest.record_format_version not in codec.READABLE_VERSIONS:
        newer = manifest.record_format_version > max(codec.READABLE_VERSIONS)
        raise DatasetError(
            f"{where}: record format version {manifest.record_format_version}, "
            f"this loader reads {' and '.join(map(str, codec.READABLE_VERSIONS))}"
            + (f"{NEXT}a newer toolkit wrote this dataset: upgrade this one ({TOOLKIT}) to read it" if newer else
               repair_step(MANIFEST_NAME, os.path.dirname(where), config_for(manifest, mixture)))
        )
    if manifest.token_dtype not in TOKEN_WIDTHS:
        raise DatasetError(f"{where}: token_dtype {manifest.token_dtype!r}, expected one of {sorted(TOKEN_WIDTHS)}")
    for key in ("pad_id", "vocab_size"):
        v = manifest.tokenizer.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise DatasetError(f"{where}: tokenizer.{key} must be an integer, got {v!r}")
    pad = manifest.tokenizer.get("pad_id")
    if pad is not None and pad >= 2 ** (8 * TOKEN_WIDTHS[manifest.token_dtype]):
        raise DatasetError(f"{where}: tokenizer.pad_id {pad} does not fit token_dtype {manifest.token_dtype}")
    if manifest.seq_len < 1:
        raise DatasetError(f"{where}: seq_len must be >= 1, got {manifest.seq_len}")
    mine = shlex.quote(mixture.path) if mixture.path else "<this mixture config>"
    other = (f"{NEXT}give the dataset packed from this mixture config, or pack one: "
             f"{pack_command(mine, '<new dataset folder>', overwrite=False)}")
    if manifest.seq_len != mixture.seq_len:
        raise DatasetError(f"{where}: seq_len {manifest.seq_len} != mixture seq_len {mixture.seq_len}{other}")
    want = mixture.tokenizer.sha256
    got = manifest.tokenizer.get("sha256")
    if want is not None and got != want:
        raise DatasetError(f"{where}: tokenizer sha256 {got} != the mixture's pinned {want}{other}")
    if want is None and os.path.isfile(mixture.tokenizer.path):
        # Not pinned, but the model the config names is here: it must be the one packed with.
        have = file_sha256(mixture.tokenizer.path)
        if have != got:
            raise DatasetError(
                f"{where}: dataset packed with tokenizer sha256 {got}, but the mixture's tokenizer "
                f"{mixture.tokenizer.path} has sha256 {have}{NEXT}point the mixture's tokenizer.path at the model "
                f"the dataset was packed with (and pin tokenizer.sha256: {got}), or pack the dataset again with "
                f"this tokenizer: {pack_command(mine, '<new dataset folder>', overwrite=False)}"
            )
    missing = [n for n in mixture.source_names if n not in manifest.sources]
    if missing:
        raise DatasetError(f"{where}: mixture sources {missing} are not in the dataset (has {sorted(manifest.sources)})"
                           + other)



def _check_shard(full: str, shown: str, info, verify_sha256: bool) -> None:
    """Checks one shard file against its manifest entry: present, size, sha256 (optional), opens, record count.

    Raises:
      DatasetError: the fault, naming the shard (``shown``).
    """
    if not os.path.isfile(full):
        raise DatasetError(f"shard {shown}: missing (manifest lists {info.records} records)")
    size = os.path.getsize(full)
    if size != info.bytes:
        raise DatasetError(f"shard {shown}: {size} bytes, manifest says {info.bytes} (truncated or altered)")
    if verify_sha256:  # first: an altered shard is named as such, whatever else it breaks
        digest = file_sha256(full)
        if digest != info.sha256:
            raise DatasetError(f"shard {shown}: sha256 {digest} != manifest {info.sha256} (altered)")
    try:
        reader = _open_reader(full)
    except Exception as e:
        raise DatasetError(f"shard {shown}: does not open as ArrayRecord: {e}") from e
    fault, n = None, None
    try:
        if reader.ok():
            n = reader.num_records()
        else:
            fault = "reader is not ok()"
    except Exception as e:  # noqa: BLE001 - array_record raises RuntimeError on a corrupted index
        fault = f"corrupted ArrayRecord file: {e}"
    try:
        reader.close()  # a reader that is not ok() raises its status here
    except Exception as e:  # noqa: BLE001
        fault = f"{fault or 'closing failed'}: {e}"
    if fault is not None:
        raise DatasetError(f"shard {shown}: {fault}")
    if n != info.records:
        raise DatasetError(f"shard {shown}: {n} records, manifest says {info.records}")


def open_dataset(
    dataset: str, mixture: MixtureConfig, verify_sha256: bool = False, read_mode: str = "auto",
    cache_dir: str | None = None,
) -> tuple[Manifest, str, ShardSet]:
    """Opens and checks a packed dataset before the first step.

    Checks: manifest present, well-formed and reconciling; format version, seq_len,
    tokenizer sha256 (when the mixture pins it) and sources agree with ``mixture``; every
    shard of every mixture source exists, has the manifest's byte size, opens, is ``ok()``
    and holds the manifest's record count; with ``verify_sha256``, its sha256 matches.

    A ``dataset`` given as a URL (``gs://...``) is checked remotely and its shards copied
    to ``cache_dir`` first (``loader.storage.stage``: sizes checked before any copy, every
    copy hashed against the manifest); messages then name the URL and the staged copy.

    Args:
      read_mode: ``"auto"``, ``"records"`` or ``"batched"`` (:func:`resolve_read_mode`).
      cache_dir: where URL datasets are staged (default ``loader.storage.default_cache_dir``).

    Returns:
      ``(manifest, manifest_sha256, shards)`` with ``shards`` in mixture source order.

    Raises:
      DatasetError: the first fault found, naming the shard and the fault.
      ValueError: an unknown ``read_mode``.
    """
    if read_mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    dataset = storage.local_path(dataset)
    manifest, manifest_sha, raw = _load_manifest(dataset, mixture)
    remote = storage.is_url(dataset)
    check_against_mixture(manifest, mixture, _manifest_path(dataset))
    folder = dataset
    if remote:
        try:
            folder = storage.stage(dataset, manifest, raw, manifest_sha, mixture.source_names, cache_dir,
                                   verify_sha256)
        except storage.StagingError as e:
            raise DatasetError(str(e)) from None
        verify_sha256 = False  # every staged shard was hashed (copied or, with the flag, re-hashed)
    config = config_for(manifest, mixture)
    shard_paths, offsets = [], []
    for name in mixture.source_names:
        entry = manifest.sources[name]
        paths = []
        for info in entry.shards:
            full = os.path.join(folder, info.path)
            shown = f"{storage.join(dataset, info.path)} (staged as {full})" if remote else full
            try:
                _check_shard(full, shown, info, verify_sha256)
            except DatasetError as e:
                raise with_next(e, repair_step(f"the shard {info.path}", dataset, config)) from e.__cause__
            paths.append(info.path)
        shard_paths.append(paths)
        offsets.append(ix.shard_offsets([s.records for s in entry.shards]))
    return manifest, manifest_sha, ShardSet(folder, shard_paths, offsets, resolve_read_mode(read_mode, folder),
                                            repair=repair_step("the shard", dataset, config))

