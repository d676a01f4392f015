"""Datasets behind a URL (``gs://``, ``s3://``, ``hdfs://``, ...): check, then stage locally.

``ArrayRecordReader`` reads local files only (riegeli's ``FdReader``), so a dataset given
as a URL is read through Apache Beam's ``FileSystems`` (the layer the packing pipeline
wrote it with; ``gs://`` needs ``apache-beam[gcp]``, the ``gcs`` extra) and copied into a
local cache before the first step:

1. the manifest is read from the URL and checked against the mixture;
2. every shard of the mixture's sources is looked up (``FileSystems.match``): a missing
   shard or one whose size is not the manifest's is named, before anything is copied;
3. the bytes still to copy are compared with the cache's free space (refused up front,
   naming both, when they do not fit);
4. each missing shard is streamed to ``<cache_dir>/<manifest sha256[:16]>/<shard path>``
   through a temporary name, its sha256 computed on the way and compared with the
   manifest's, then renamed into place (atomic: processes of one host staging the same
   dataset at once never see half a file); a copy already there with the manifest's size
   is reused (and re-hashed with ``verify_sha256``; a mismatching one is copied again).

The cache folder is then a complete dataset folder (``manifest.json`` included) that the
loader opens like any local one. Staging suits datasets that fit the host's disk; for larger
ones, mount the bucket (e.g. gcsfuse) and pass the mount's path: the loader then reads the
shards in place, batched (``loader.shards.resolve_read_mode``).

May import: ``contract`` and Apache Beam (imported on first use); no other loader module.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Sequence

from contract.manifest import MANIFEST_NAME, Manifest

log = logging.getLogger("loader")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
DEFAULT_CACHE_ENV = "LOADER_CACHE_DIR"
COPY_CHUNK = 8 << 20  # bytes per read while streaming a shard
# A ``.part-`` file not written to for this long is the remains of a killed copy (a live copy
# writes every COPY_CHUNK): staging removes it instead of leaving it to fill the cache.
STALE_PART_S = 3600.0
ACCESS_HINT = ("check the URL, the network and the credentials (gs:// needs the gcs extra, "
               "pip install -e '.[gcs]', and Google credentials, e.g. gcloud auth application-default login; "
               "other schemes need Beam's own extra and options), or mount the bucket (e.g. gcsfuse) and pass "
               "the mount's path")


class StagingError(ValueError):
    """A remote dataset cannot be checked or staged (base of ``loader.shards.DatasetError``'s
    messages; raised as ``DatasetError`` by ``loader.dataset.open_dataset``)."""


def is_url(dataset: str) -> bool:
    """True when ``dataset`` names a file system by scheme (``gs://...``), except ``file://``."""
    return bool(_URL.match(dataset)) and not dataset.startswith("file://")


def local_path(dataset: str) -> str:
    """``dataset`` without a ``file://`` prefix (``file:///data/ds`` -> ``/data/ds``)."""
    return dataset[len("file://"):] if dataset.startswith("file://") else dataset


def shard_path_problem(path: str) -> str | None:
    """Why the manifest's shard ``path`` cannot name a file inside the dataset folder, or ``None``.

    A shard path is relative and ``/``-separated, without empty, ``.`` or ``..`` parts (so
    neither the loader nor staging ever reads or writes outside the dataset's folder).
    """
    if "\x00" in path:
        return "contains a NUL byte"
    if path.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "is not a plain relative path (empty, '.' or '..' part)"
    return None


def default_cache_dir() -> str:
    """``$LOADER_CACHE_DIR``, else ``$XDG_CACHE_HOME/moe-data-toolkit/datasets``, else
    ``~/.cache/moe-data-toolkit/datasets``."""
    if os.environ.get(DEFAULT_CACHE_ENV):
        return os.environ[DEFAULT_CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moe-data-toolkit", "datasets")


def _filesystems():
    try:
        from apache_beam.io.filesystems import FileSystems
    except ImportError as e:  # pragma: no cover - Beam is a dependency of the project
        raise StagingError(f"reading a dataset by URL needs apache-beam ({e})") from None
    return FileSystems


def join(dataset: str, *parts: str) -> str:
    """``dataset`` joined with relative ``parts`` (``/``-separated, as the manifest writes them)."""
    return "/".join([dataset.rstrip("/"), *(p.strip("/") for p in parts)])


def read_bytes(url: str) -> bytes:
    """All bytes of the file at ``url``.

    Raises:
      FileNotFoundError: no file there.
      StagingError: the scheme has no file system installed, or the read failed.
    """
    from apache_beam.io.filesystem import CompressionTypes

    fs = _filesystems()
    try:
        if not fs.exists(url):
            raise FileNotFoundError(url)
        with fs.open(url, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            return f.read()
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - Beam: ValueError (no file system), BeamIOError, OSError
        raise StagingError(f"{url}: cannot read ({type(e).__name__}: {e}); {ACCESS_HINT}") from None


def remote_sizes(dataset: str) -> dict[str, int]:
    """Size in bytes of every file under the URL ``dataset``, by URL: one listing
    (``FileSystems.match`` of ``<dataset>/**``), not a request per shard. Where the URL has
    a glob character (``[``, ``*``, ``?``), files of look-alike folders may be listed too.

    Raises:
      StagingError: the file system cannot be listed.
    """
    from apache_beam.io.filesystem import BeamIOError

    # Beam's patterns are fnmatch's: a glob character of the URL itself ("run[1]") becomes
    # "?" (any one character); the listing may then hold more files, looked up exactly below.
    pattern = re.sub(r"[\[*?]", "?", dataset)
    try:
        (result,) = _filesystems().match([join(pattern, "**")])
    except (BeamIOError, ValueError) as e:
        raise StagingError(f"{dataset}: cannot list the dataset ({e}); {ACCESS_HINT}") from None
    return {m.path: m.size_in_bytes for m in result.metadata_list}


def _copy(url: str, dest: str, expect_bytes: int, expect_sha256: str) -> float:
    """Streams ``url`` to ``dest`` through a temporary name; checks size and sha256 first.

    Returns seconds taken. Raises StagingError naming the shard on a mismatch or a failed
    read or write (nothing is left at ``dest``); a source longer than ``expect_bytes`` is
    refused as soon as the excess is read, not copied to the end.
    """
    from apache_beam.io.filesystem import CompressionTypes

    tmp = f"{dest}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    h, n, t0 = hashlib.sha256(), 0, time.perf_counter()
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with _filesystems().open(url, compression_type=CompressionTypes.UNCOMPRESSED) as src, open(tmp, "wb") as dst:
            while n <= expect_bytes and (block := src.read(COPY_CHUNK)):
                h.update(block)
                dst.write(block)
                n += len(block)
        if n != expect_bytes:
            raise StagingError(f"shard {url}: copied {n} bytes, manifest says {expect_bytes} (changed while copying?)")
        if h.hexdigest() != expect_sha256:
            raise StagingError(f"shard {url}: sha256 {h.hexdigest()} != manifest {expect_sha256} (altered)")
        os.replace(tmp, dest)
    except StagingError:
        raise
    except Exception as e:  # noqa: BLE001 - any read or write failure, named
        raise StagingError(f"shard {url}: copy to {dest} failed: {type(e).__name__}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return time.perf_counter() - t0


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(COPY_CHUNK):
            h.update(block)
    return h.hexdigest()


def _remove_stale_parts(dest: str, now: float) -> None:
    """Removes ``<dest>.part-*`` files not written to for :data:`STALE_PART_S` (killed copies)."""
    folder, name = os.path.split(dest)
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        if entry.startswith(name + ".part-"):
            path = os.path.join(folder, entry)
            try:
                if now - os.path.getmtime(path) > STALE_PART_S:
                    os.remove(path)
                    log.info("removed %s, left by an interrupted copy", path)
            except OSError:  # gone meanwhile (another stager), or not ours to remove
                pass


def stage(dataset: str, manifest: Manifest, manifest_bytes: bytes, manifest_sha256: str,
          source_names: Sequence[str], cache_dir: str | None = None, verify_sha256: bool = False,
          threads: int = 8) -> str:
    """Copies the shards of ``source_names`` of the dataset at URL ``dataset`` into the cache.

    Args:
      dataset: the dataset's URL (its folder).
      manifest: its parsed manifest; ``manifest_bytes``/``manifest_sha256``: the raw
        ``manifest.json`` and its sha256 (the cache folder's name is its first 16 hex digits).
      source_names: the sources to stage (the mixture's).
      cache_dir: local folder for staged datasets (default :func:`default_cache_dir`).
      verify_sha256: also re-hash shards already in the cache (fresh copies are always
        hashed while they stream).
      threads: shards copied at once.

    Returns:
      The local dataset folder, ready for ``loader.dataset.open_dataset``.

    Raises:
      StagingError: a shard path that would leave the cache folder (absolute, ``..``), a
        shard missing or of the wrong size at the URL (before anything is copied), the
        cache's free space smaller than the bytes to copy, a copy that does not match the
        manifest, a cache folder that cannot be written, or the file system fails; each
        names the shard or the folder.
    """
    cache_dir = cache_dir or default_cache_dir()
    local = os.path.join(cache_dir, manifest_sha256[:16])
    infos = [info for name in source_names for info in manifest.sources[name].shards]
    for info in infos:
        problem = shard_path_problem(info.path)
        if problem:
            raise StagingError(f"{join(dataset, MANIFEST_NAME)}: shard path {info.path!r} {problem}")
    urls = [join(dataset, info.path) for info in infos]
    sizes = remote_sizes(dataset)
    for info, url in zip(infos, urls):  # every remote shard first: fail before copying anything
        if url not in sizes:
            raise StagingError(f"shard {url}: missing (manifest lists {info.records} records)")
        if sizes[url] != info.bytes:
            raise StagingError(f"shard {url}: {sizes[url]} bytes, manifest says {info.bytes} (truncated or altered)")
    todo = []
    for info, url in zip(infos, urls):
        dest = os.path.join(local, *info.path.split("/"))
        if os.path.isfile(dest) and os.path.getsize(dest) == info.bytes:
            if not verify_sha256 or _sha256(dest) == info.sha256:
                continue
            log.warning("cached shard %s does not match the manifest's sha256: copying it again", dest)
        todo.append((info, url, dest))
    need = sum(info.bytes for info, _, _ in todo)
    if todo:
        try:
            os.makedirs(local, exist_ok=True)
            now = time.time()
            for _, _, dest in todo:  # first: their room counts as free
                _remove_stale_parts(dest, now)
            free = shutil.disk_usage(local).free
        except OSError as e:  # a file where the folder should be, permissions
            raise StagingError(f"staging {dataset}: cannot use the cache folder {local}: {e.strerror or e}") from None
        if need > free:
            raise StagingError(
                f"staging {dataset}: {len(todo)} shard(s), {need / 2**30:.2f} GiB to copy, but {local} has "
                f"{free / 2**30:.2f} GiB free; pass a larger cache_dir, or mount the bucket (e.g. gcsfuse) "
                "and pass the mount's path to read the shards in place")
        log.info("staging %s: %d shard(s), %.1f MiB to %s", dataset, len(todo), need / 2**20, local)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="loader-stage") as pool:
            futures = [pool.submit(_copy, url, dest, info.bytes, info.sha256) for info, url, dest in todo]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        dt = time.perf_counter() - t0
        log.info("staged %.1f MiB in %.1f s (%.1f MiB/s)", need / 2**20, dt, need / 2**20 / max(dt, 1e-9))
    target = os.path.join(local, MANIFEST_NAME)
    if not (os.path.isfile(target) and _sha256(target) == manifest_sha256):  # manifest last: the folder is complete
        tmp = f"{target}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(local, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(manifest_bytes)
            os.replace(tmp, target)
        except OSError as e:
            raise StagingError(f"staging {dataset}: cannot write {target}: {e.strerror or e}") from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return local
