"""Small helpers over Beam's ``FileSystems`` so that every path may be local or ``gs://``."""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

from apache_beam.io.filesystem import BeamIOError, CompressionTypes
from apache_beam.io.filesystems import FileSystems

_CHUNK = 1 << 20


def is_local(path: str) -> bool:
    """True when Beam's local file system serves ``path`` (False for ``gs://`` and unknown schemes)."""
    from apache_beam.io.localfilesystem import LocalFileSystem

    try:
        return isinstance(FileSystems.get_filesystem(path), LocalFileSystem)
    except ValueError:
        return False


def open_raw(path: str) -> BinaryIO:
    """Opens ``path`` for reading bytes as stored (no decompression by extension)."""
    return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def read_bytes(path: str) -> bytes:
    """Returns the bytes of ``path`` (raises ``IOError``/``BeamIOError`` when missing)."""
    with open_raw(path) as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` (replacing it), creating parent folders where needed."""
    parent, _ = FileSystems.split(path)
    if parent and not FileSystems.exists(parent):
        try:
            FileSystems.mkdirs(parent)
        except IOError:
            pass  # created concurrently, or the file system has no folders
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """:func:`write_bytes`, but a reader never sees a partial file at ``path``.

    Local files are written to a temporary name beside ``path``, flushed to disk
    (``fsync``) and renamed over it; object stores (``gs://``) make an upload visible only
    once it is complete, so there it is :func:`write_bytes`. For commit markers such as
    ``manifest.json``: a run killed while writing one must not leave a truncated one.
    """
    if not is_local(path):
        write_bytes(path, data)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def copy_local_to(local_path: str, dest: str) -> tuple[str, int]:
    """Copies a local file to ``dest`` through FileSystems; returns (sha256 hex, bytes)."""
    parent, _ = FileSystems.split(dest)
    if parent and not FileSystems.exists(parent):
        try:
            FileSystems.mkdirs(parent)
        except IOError:
            pass
    h = hashlib.sha256()
    size = 0
    with (
        open(local_path, "rb") as src,
        FileSystems.create(dest, compression_type=CompressionTypes.UNCOMPRESSED) as out,
    ):
        while True:
            block = src.read(_CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
            out.write(block)
    return h.hexdigest(), size


def sha256_of(path: str) -> str:
    """Returns the hex sha256 of the file at ``path``, streamed."""
    h = hashlib.sha256()
    with open_raw(path) as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def exists(path: str) -> bool:
    return FileSystems.exists(path)


def size(path: str) -> int:
    """Returns the size in bytes of the file at ``path`` (its listing, the file is not opened)."""
    return int(FileSystems.get_filesystem(path).size(path))


def join(base: str, *parts: str) -> str:
    return FileSystems.join(base, *parts)


def is_not_a_file(path: str) -> bool:
    """True for what a glob may match but is no input file: a local folder, FIFO, socket or
    device (reading a FIFO would block for ever), or an object-store "folder" placeholder
    (a name ending in ``/``)."""
    if path.endswith("/"):
        return True
    return is_local(path) and os.path.exists(path) and not os.path.isfile(path)


def real_path(path: str) -> str:
    """The canonical name of a local file (symbolic links resolved); other paths unchanged."""
    return os.path.realpath(path) if is_local(path) else path


def has_glob(pattern: str) -> bool:
    """True when ``pattern`` holds a glob character (``*``, ``?`` or ``[``)."""
    return any(ch in pattern for ch in "*?[")


def delete(path: str) -> None:
    if FileSystems.exists(path):
        FileSystems.delete([path])


def match(pattern: str) -> list[str]:
    """Returns the sorted paths matching ``pattern`` (empty when none)."""
    return [path for path, _ in match_sizes(pattern)]


def match_sizes(pattern: str) -> list[tuple[str, int]]:
    """Returns the sorted ``(path, size in bytes)`` of the files matching ``pattern``.

    Sizes are the file system's listing (``FileSystems.match`` metadata): no file is opened.
    """
    try:
        results = FileSystems.match([pattern])
    except BeamIOError as e:  # some file systems raise for "no match" instead of returning none
        if "No files found" in str(e) or "not found" in str(e).lower():
            return []
        raise
    return sorted({(m.path, int(m.size_in_bytes)) for r in results for m in r.metadata_list})


class ListingError(ValueError):
    """Listing a local input pattern would leave files out silently; the message names the path."""


def list_inputs(pattern: str) -> list[tuple[str, int]]:
    """Returns the sorted ``(path, size in bytes)`` of the input files ``pattern`` matches.

    Patterns mean what they mean to Beam's ``FileSystems.match`` (``*`` stays within a
    folder, ``**`` crosses folders). On object stores this is ``FileSystems.match``. On the
    local file system Beam's listing silently leaves out three kinds of files, each of which
    would be a silent loss of input; here, instead:

    * files under a symbolic link to a folder are listed (Beam's ``os.walk`` does not follow
      links; a link back to a folder it is inside is not followed again);
    * a matched symbolic link whose target does not exist raises :class:`ListingError`;
    * a folder that cannot be listed (permission denied) raises :class:`ListingError`, and
      so does a matched file that cannot be read.

    Raises:
      ListingError: as above.
      ValueError: no installed Beam file system serves the pattern's scheme.
    """
    if not is_local(pattern):
        return match_sizes(pattern)
    import re

    from apache_beam.io.filesystem import FileMetadata

    prefix = re.match(r"^[^[*?]*", pattern).group(0)
    if prefix == pattern:  # a literal path, no glob
        if os.path.islink(pattern) and not os.path.exists(pattern):
            raise ListingError(f"{pattern} is a symbolic link to {os.readlink(pattern)!r}, which does not exist")
        found = match_sizes(pattern)
    else:
        top = os.path.dirname(prefix)
        if not os.path.isdir(top):
            return []

        def cannot_list(e: OSError) -> None:
            raise ListingError(
                f"cannot list folder {e.filename} ({e.strerror}): the files in it would be left out; "
                "make it readable or narrow the pattern"
            )

        metas, dangling = [], set()
        reals: dict[str, str] = {}
        # Without "**" a match lies exactly this many folders below ``top``: go no deeper.
        depth = None if "**" in pattern else pattern[len(top):].strip(os.sep).count(os.sep)
        for folder, subfolders, names in os.walk(top, onerror=cannot_list, followlinks=True):
            if depth is not None and folder[len(top):].count(os.sep) >= depth:
                subfolders[:] = []
            real = os.path.realpath(folder)
            above, parent = set(), os.path.dirname(folder)
            while parent in reals:  # the folders this one is inside (walked before it)
                above.add(reals[parent])
                parent, up = os.path.dirname(parent), parent
                if parent == up:
                    break
            reals[folder] = real
            if real in above:  # a link back up the tree: following it again would never end
                subfolders[:] = []
                continue
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    dangling.add(path)
                    metas.append(FileMetadata(path, 0, 0.0))
                    continue
                except OSError as e:
                    raise ListingError(f"cannot read the size of {path} ({e.strerror})") from None
                metas.append(FileMetadata(path, st.st_size, st.st_mtime))
        matched = list(FileSystems.get_filesystem(pattern).match_files(metas, pattern))
        for m in sorted(matched, key=lambda m: m.path):
            if m.path in dangling:
                raise ListingError(
                    f"{m.path} is a symbolic link to {os.readlink(m.path)!r}, which does not exist; "
                    "restore the target or remove the link"
                )
        found = sorted({(m.path, int(m.size_in_bytes)) for m in matched})
    for path, _ in found:
        if os.path.isfile(path) and not os.access(path, os.R_OK):
            raise ListingError(f"{path} is not readable (permission denied)")
    return found
