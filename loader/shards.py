"""The shard set: read the records of a dataset's shards, one way or the other (no JAX).

(source, record of the source) -> (shard, record in shard) -> the record's bytes. The
caller computes every record of a step first (``loader.index``); :meth:`ShardSet.read_located`
then reads them in either read mode:

- ``"records"``: ``seek`` + ``read`` per record in the calling thread, in batch order
  (least CPU on a local disk or the page cache);
- ``"batched"``: one ``ArrayRecordReader.read(indices)`` per shard and step, in
  ArrayRecord's C++ thread pool with the GIL released (for network and FUSE file systems,
  where reads wait; ``"auto"`` tells them apart from ``/proc/self/mounts``,
  :func:`resolve_read_mode`).

A failed read is explained record by record (:meth:`ShardSet._read_fault`): the message
names the shard, the record in it and the source record.

May import: numpy and array_record; no loader module.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence

import numpy as np

# Random access: no read-ahead (what Grain's ArrayRecordDataSource uses). "batched" reads
# go through ArrayRecord's thread pool (ParallelReadRecordsWithIndices, the GIL released);
# "records" reads (seek + read, one record at a time, in the calling thread) need no pool.
READER_OPTIONS = "readahead_buffer_size:0"
READER_OPTIONS_BY_MODE = {"batched": READER_OPTIONS, "records": "readahead_buffer_size:0,max_parallelism:0"}
READ_MODES = ("auto", "records", "batched")
# File systems whose reads wait on a network: "auto" reads them batched, so the waits
# overlap in ArrayRecord's pool and do not hold the GIL.
NETWORK_FSTYPES = ("fuse", "nfs", "nfs4", "cifs", "smb3", "9p", "lustre", "gpfs", "ceph", "glusterfs", "beegfs")


class DatasetError(ValueError):
    """The packed dataset is missing, malformed, altered or disagrees with the mixture config.

    Its message ends with a ``next:`` line saying what to do (:func:`repair_step` and the like).
    """


NEXT = "\nnext: "  # the line of a message that says what to do


def pack_command(config: str, output: str, overwrite: bool = True) -> str:
    """The ``dataprep.pack`` command line that (re)builds a dataset."""
    return f"python -m dataprep.pack --config {config} --output {output}" + (" --overwrite" if overwrite else "")


def repair_step(what: str, dataset: str, config: str) -> str:
    """The ``next:`` line for a damaged or missing file of a committed dataset."""
    return (f"{NEXT}restore {what} from the copy the dataset was written to, or rebuild the dataset: "
            f"{pack_command(config, dataset)}")


def with_next(e: DatasetError, step: str) -> DatasetError:
    """``e`` with ``step`` (a ``next:`` line) added, unless it says what to do already."""
    return e if NEXT in str(e) or not step else DatasetError(f"{e}{step}")


def _open_reader(path: str, mode: str = "batched"):
    from array_record.python.array_record_module import ArrayRecordReader

    if mode == "records":  # a seek + read a record: ArrayRecord's default buffer (benchmarks/load.py)
        return ArrayRecordReader(path, READER_OPTIONS_BY_MODE[mode])
    return ArrayRecordReader(path, READER_OPTIONS_BY_MODE[mode], file_reader_buffer_size=32768)


_UNESCAPE_MOUNT = re.compile(r"\\([0-7]{3})")  # the kernel's octal escapes in /proc/self/mounts


def filesystem_type(path: str) -> str | None:
    """The type (``/proc/self/mounts``'s third field, e.g. ``ext4``, ``fuse.gcsfuse``,
    ``nfs4``) of the file system holding ``path``, or ``None`` where it cannot be told."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = -1, None
    for fields in mounts:  # in mount order: of mounts on one point, the last is the one seen
        if len(fields) < 3:
            continue
        point = _UNESCAPE_MOUNT.sub(lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 space, \134 backslash...
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, fstype = len(point), fields[2]
    return fstype


def resolve_read_mode(mode: str, dataset: str) -> str:
    """``"records"`` or ``"batched"`` for ``mode`` (one of :data:`READ_MODES`).

    ``"auto"``: ``"batched"`` when ``dataset`` lies on a network or FUSE file system
    (:data:`NETWORK_FSTYPES`, e.g. a gcsfuse mount), where each read waits on the network
    and a batch of them should wait together, outside the GIL; ``"records"`` otherwise
    (local disk or page cache: a seek and read per record in the calling thread costs a
    third of the CPU of a pooled batched read of a few records, measured in
    ``benchmarks/load.py``).

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in READ_MODES:
        raise ValueError(f"read_mode must be one of {READ_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    fstype = filesystem_type(dataset) or ""
    network = fstype.split(".")[0] in NETWORK_FSTYPES or fstype.startswith("fuse")
    return "batched" if network else "records"



class ShardSet:
    """The shards of the sources a schedule reads, opened lazily per thread.

    Picklable (holds paths and counts only), so Grain worker processes can carry it.

    Args:
      dataset: the dataset folder (local, or a mount such as gcsfuse).
      shards: per source (in schedule order), the shard paths relative to ``dataset``.
      offsets: per source, cumulative records ``[0, r_0, r_0 + r_1, ...]`` (int64).
      read_mode: ``"records"`` (seek and read each record in the calling thread) or
        ``"batched"`` (one ``ArrayRecordReader.read(indices)`` per shard per step, in
        ArrayRecord's thread pool with the GIL released); see :func:`resolve_read_mode`.
        Both return the same bytes.
      repair: the ``next:`` line added to a read or decode error (:func:`repair_step`), or "".
    """

    def __init__(self, dataset: str, shards: Sequence[Sequence[str]], offsets: Sequence[np.ndarray],
                 read_mode: str = "records", repair: str = ""):
        if read_mode not in READER_OPTIONS_BY_MODE:
            raise ValueError(f"read_mode must be 'records' or 'batched', got {read_mode!r}")
        self.dataset = dataset
        self.shards = [list(s) for s in shards]
        self.offsets = [np.asarray(o, np.int64) for o in offsets]
        self.read_mode = read_mode
        self.repair = repair
        self._local = threading.local()

    def __getstate__(self):  # no readers, no caches
        return {"dataset": self.dataset, "shards": self.shards, "offsets": self.offsets, "read_mode": self.read_mode,
                "repair": self.repair}

    def __setstate__(self, state):
        self.__dict__.update({"repair": ""} | state)
        self._local = threading.local()

    def path(self, source: int, shard: int) -> str:
        """The file of shard ``shard`` of schedule source ``source``."""
        return os.path.join(self.dataset, self.shards[source][shard])

    def _reader(self, source: int, shard: int):
        cache = getattr(self._local, "readers", None)
        if cache is None:
            cache = self._local.readers = {}
        key = (source, shard)
        if key not in cache:
            cache[key] = _open_reader(self.path(source, shard), self.read_mode)
        return cache[key]

    def locate(self, source: np.ndarray, record: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Maps (source, source-level record) to (shard, record in shard), int64 arrays."""
        source = np.asarray(source, np.int64)
        record = np.asarray(record, np.int64)
        shard = np.empty_like(record)
        for k in np.unique(source).tolist():
            sel = source == k
            shard[sel] = np.searchsorted(self.offsets[k], record[sel], side="right") - 1
        flat, base = self._flat_offsets()
        return shard, record - flat[base[source] + shard]

    def _flat_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """All sources' offsets back to back, and where each source's start: one gather per step."""
        hit = getattr(self, "_flat", None)
        if hit is None:
            sizes = [len(o) for o in self.offsets]
            hit = self._flat = (np.concatenate(self.offsets) if self.offsets else np.zeros(0, np.int64),
                                np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
        return hit

    def read(self, source: np.ndarray, record: np.ndarray) -> list[bytes]:
        """Returns the record bytes of each (source, record), in order; one read per shard.

        Raises:
          DatasetError: a shard cannot be read (named).
        """
        return self.locate_and_read(source, record)[2]

    def locate_and_read(self, source: np.ndarray, record: np.ndarray,
                        stamps: list[float] | None = None) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """:meth:`locate`, then :meth:`read_located`: ``(shard, in_shard, records)``.

        Args:
          source, record: int ``[n]``, schedule source index and record of that source.
          stamps: when given, ``time.perf_counter()`` is appended after :meth:`locate` and
            again after the reads (the loader's stage clock, ``loader.source.STAGE_BOUNDS``).

        Returns:
          ``shard`` and ``in_shard``, int64 ``[n]``, and the ``n`` record bytes, in order.

        Raises:
          DatasetError: a record cannot be read (see :meth:`read_located`).
        """
        shard, in_shard = self.locate(source, record)
        if stamps is None:
            return shard, in_shard, self.read_located(source, record, shard, in_shard)
        stamps.append(time.perf_counter())
        data = self.read_located(source, record, shard, in_shard)
        stamps.append(time.perf_counter())
        return shard, in_shard, data

    def read_located(self, source: np.ndarray, record: np.ndarray, shard: np.ndarray,
                     in_shard: np.ndarray) -> list[bytes]:
        """:meth:`read` with ``(shard, in_shard)`` already computed by :meth:`locate`.

        Raises:
          DatasetError: a record cannot be read; names the shard, the record in it and the
            source record.
        """
        source = np.asarray(source, np.int64)
        n = len(shard)
        if n == 0:
            return []
        if self.read_mode == "records":  # in batch order: a seek and a read a record, nothing to group
            return self._read_records(source.tolist(), shard.tolist(), in_shard.tolist())
        # one group per (source, shard), in (source, shard) order: a stable sort of one key
        key = source * (1 << 32) + shard
        order = np.argsort(key, kind="stable")
        cuts = (np.flatnonzero(np.diff(key[order])) + 1).tolist()
        out: list[bytes | None] = [None] * n
        for a, b in zip([0, *cuts], [*cuts, n]):
            grp = order[a:b]
            k, s = int(source[grp[0]]), int(shard[grp[0]])
            idx = in_shard[grp].tolist()
            try:
                data = self._reader(k, s).read(idx)
            except Exception as e:  # array_record raises RuntimeError/OSError/IndexError variants
                self._local.readers.pop((k, s), None)  # a failed reader may be left mid-record
                raise DatasetError(self._read_fault(k, s, idx, e) + self.repair) from e
            for j, d in zip(grp.tolist(), data):
                out[j] = d
        return out  # type: ignore[return-value]

    def _read_records(self, source: list[int], shard: list[int], in_shard: list[int]) -> list[bytes]:
        """Records mode: ``seek`` + ``read`` of each record in the given order, readers kept per
        (source, shard) in this thread."""
        readers = getattr(self._local, "readers", None)
        if readers is None:
            readers = self._local.readers = {}
        out = []
        k = s = None
        try:
            for k, s, i in zip(source, shard, in_shard):
                reader = readers.get((k, s))
                if reader is None:
                    reader = self._reader(k, s)
                reader.seek(i)
                out.append(reader.read())
        except Exception as e:  # array_record raises RuntimeError/OSError/IndexError variants
            readers.pop((k, s), None)  # a failed reader may be left mid-record
            idx = [i for kk, ss, i in zip(source, shard, in_shard) if (kk, ss) == (k, s)]
            raise DatasetError(self._read_fault(k, s, idx, e) + self.repair) from e
        return out

    def _read_fault(self, source: int, shard: int, idx: list[int], err: Exception) -> str:
        """The message for a failed batched read: finds the records that fail one by one."""
        bad = []
        for i in sorted(set(idx)):
            try:
                reader = self._reader(source, shard)
                reader.seek(i)
                reader.read()
            except Exception:  # noqa: BLE001 - probing which record fails
                bad.append(i)
                self._local.readers.pop((source, shard), None)
        where = self.path(source, shard)
        if bad:
            first = int(self.offsets[source][shard])
            recs = ", ".join(f"{i} (source record {first + i})" for i in bad[:8])
            return f"reading {where}: record(s) in shard {recs} unreadable: {err}"
        return f"reading {where}: {err}"

