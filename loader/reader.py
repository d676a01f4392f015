"""The I/O edge of the loader: open and check a packed dataset, read rows, build dense arrays.

No JAX here (worker processes import it). Reads are batched: the caller computes every
record of a step first (``loader.index``), then :meth:`ShardSet.read` issues one
``ArrayRecordReader.read(indices)`` per shard touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from contract import codec
from contract.config import MixtureConfig
from contract.manifest import MANIFEST_NAME, Manifest, ManifestError
from loader import storage

# Random access: no read-ahead (what Grain's ArrayRecordDataSource uses). "batched" reads
# go through ArrayRecord's thread pool (ParallelReadRecordsWithIndices, the GIL released);
# "records" reads (seek + read, one record at a time, in the calling thread) need no pool.
READER_OPTIONS = "readahead_buffer_size:0"
READER_OPTIONS_BY_MODE = {"batched": READER_OPTIONS, "records": "readahead_buffer_size:0,max_parallelism:0"}
READ_MODES = ("auto", "records", "batched")
# File systems whose reads wait on a network: "auto" reads them batched, so the waits
# overlap in ArrayRecord's pool and do not hold the GIL.
NETWORK_FSTYPES = ("fuse", "nfs", "nfs4", "cifs", "smb3", "9p", "lustre", "gpfs", "ceph", "glusterfs", "beegfs")
# token_dtype of the manifest -> token width in bytes of every record (contract.codec)
TOKEN_WIDTHS = {"uint16": 2, "uint32": 4}
BATCH_KEYS = (
    "inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position",
)


class DatasetError(ValueError):
    """The packed dataset is missing, malformed, altered or disagrees with the mixture config."""


def _open_reader(path: str, mode: str = "batched"):
    from array_record.python.array_record_module import ArrayRecordReader

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


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(dataset: str) -> tuple[Manifest, str]:
    """Returns the dataset's manifest and the sha256 of its ``manifest.json`` bytes.

    ``dataset`` is a folder or a URL (``gs://...``, read through Beam's ``FileSystems``,
    ``loader.storage``).

    Raises:
      DatasetError: no manifest (the dataset was never committed), or a malformed one.
    """
    manifest, sha, _ = _load_manifest(storage.local_path(dataset))
    return manifest, sha


def _manifest_path(dataset: str) -> str:
    """Where ``dataset``'s manifest is: a URL for a URL dataset, else a local path."""
    return storage.join(dataset, MANIFEST_NAME) if storage.is_url(dataset) else os.path.join(dataset, MANIFEST_NAME)


def _load_manifest(dataset: str) -> tuple[Manifest, str, bytes]:
    """:func:`read_manifest` plus the raw bytes."""
    path = _manifest_path(dataset)
    try:
        if storage.is_url(dataset):
            data = storage.read_bytes(path)
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no manifest; the dataset is missing or was not committed") from None
    except storage.StagingError as e:
        raise DatasetError(str(e)) from None
    except OSError as e:  # a file where the folder should be, permissions, I/O errors
        raise DatasetError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
    try:
        manifest = Manifest.from_json(data.decode("utf-8"))
        problems = manifest.problems()
    except (ManifestError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type deeper down
        raise DatasetError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
    if problems:
        raise DatasetError(f"{path}: does not reconcile: " + "; ".join(problems))
    seen: dict[str, str] = {}
    for name, entry in sorted(manifest.sources.items()):
        for info in entry.shards:
            problem = storage.shard_path_problem(info.path)
            if problem is None and info.path in seen:
                problem = f"is listed twice (sources {seen[info.path]!r} and {name!r})"
            if problem:
                raise DatasetError(f"{path}: shard path {info.path!r} {problem}")
            seen[info.path] = name
    return manifest, hashlib.sha256(data).hexdigest(), data


def check_against_mixture(manifest: Manifest, mixture: MixtureConfig, where: str) -> None:
    """Checks format version, seq_len, tokenizer and sources of ``manifest`` against ``mixture``.

    The tokenizer check uses the mixture's pinned sha256, or, when it pins none and its
    tokenizer file exists, that file's sha256.

    Raises:
      DatasetError: naming the field, the dataset's value and the config's.
    """
    if manifest.record_format_version != codec.FORMAT_VERSION:
        raise DatasetError(
            f"{where}: record format version {manifest.record_format_version}, "
            f"this loader reads {codec.FORMAT_VERSION}"
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
    if manifest.seq_len != mixture.seq_len:
        raise DatasetError(f"{where}: seq_len {manifest.seq_len} != mixture seq_len {mixture.seq_len}")
    want = mixture.tokenizer.sha256
    got = manifest.tokenizer.get("sha256")
    if want is not None and got != want:
        raise DatasetError(f"{where}: tokenizer sha256 {got} != the mixture's pinned {want}")
    if want is None and os.path.isfile(mixture.tokenizer.path):
        # Not pinned, but the model the config names is here: it must be the one packed with.
        have = file_sha256(mixture.tokenizer.path)
        if have != got:
            raise DatasetError(
                f"{where}: dataset packed with tokenizer sha256 {got}, but the mixture's tokenizer "
                f"{mixture.tokenizer.path} has sha256 {have}"
            )
    missing = [n for n in mixture.source_names if n not in manifest.sources]
    if missing:
        raise DatasetError(f"{where}: mixture sources {missing} are not in the dataset (has {sorted(manifest.sources)})")


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
    """

    def __init__(self, dataset: str, shards: Sequence[Sequence[str]], offsets: Sequence[np.ndarray],
                 read_mode: str = "records"):
        if read_mode not in READER_OPTIONS_BY_MODE:
            raise ValueError(f"read_mode must be 'records' or 'batched', got {read_mode!r}")
        self.dataset = dataset
        self.shards = [list(s) for s in shards]
        self.offsets = [np.asarray(o, np.int64) for o in offsets]
        self.read_mode = read_mode
        self._local = threading.local()

    def __getstate__(self):  # no readers, no caches
        return {"dataset": self.dataset, "shards": self.shards, "offsets": self.offsets, "read_mode": self.read_mode}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def path(self, source: int, shard: int) -> str:
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
        return self.read_located(source, record, *self.locate(source, record))

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
        # one group per (source, shard), in (source, shard) order: a stable sort of one key
        key = source * (1 << 32) + shard
        order = np.argsort(key, kind="stable")
        skey = key[order]
        bounds = np.flatnonzero(np.diff(skey)) + 1
        out: list[bytes | None] = [None] * n
        for grp in np.split(order, bounds):
            k, s = int(source[grp[0]]), int(shard[grp[0]])
            idx = in_shard[grp].tolist()
            try:
                reader = self._reader(k, s)
                if self.read_mode == "records":
                    data = []
                    for i in idx:
                        reader.seek(i)
                        data.append(reader.read())
                else:
                    data = reader.read(idx)
            except Exception as e:  # array_record raises RuntimeError/OSError/IndexError variants
                self._local.readers.pop((k, s), None)  # a failed reader may be left mid-record
                raise DatasetError(self._read_fault(k, s, idx, e)) from e
            for j, d in zip(grp.tolist(), data):
                out[j] = d
        return out  # type: ignore[return-value]

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
    manifest, manifest_sha, raw = _load_manifest(dataset)
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
    shard_paths, offsets = [], []
    for name in mixture.source_names:
        entry = manifest.sources[name]
        paths = []
        for info in entry.shards:
            full = os.path.join(folder, info.path)
            shown = f"{storage.join(dataset, info.path)} (staged as {full})" if remote else full
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
            paths.append(info.path)
        shard_paths.append(paths)
        offsets.append(np.concatenate([[0], np.cumsum([s.records for s in entry.shards])]).astype(np.int64))
    return manifest, manifest_sha, ShardSet(folder, shard_paths, offsets, resolve_read_mode(read_mode, folder))


def pack_inputs(
    rows: Sequence[codec.PackedRow], seq_len: int, pad_id: int = 0,
    token_dtype: np.dtype | str = np.int32, index_dtype: np.dtype | str = np.int32,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, segment ids and positions of packed rows; the other keys derive from them.

    Legend: ``n`` rows, ``L = seq_len``.

    Returns:
      ``(inputs, inputs_segmentation, inputs_position)``, ``[n, L]``: tokens
      (``pad_id`` on padding), 1-based segment ids and positions restarting at 0 in each
      segment (both 0 on padding). Ids and positions are running sums of marks: +1 at each
      segment start and ``-S`` after the last token for ids; +1 per token, minus the
      previous segment's length at each start and minus the last position after the last
      token for positions.
      ``token_dtype`` and ``index_dtype`` (int32 by default) may be narrower when the values
      fit (uint16 tokens; int16 ids and positions for ``seq_len <= 2**15``): fewer bytes to
      move to the devices.

    Raises:
      ValueError: a row's seq_len differs from ``seq_len``.
    """
    n = len(rows)
    for i, row in enumerate(rows):
        if row.seq_len != seq_len:
            raise ValueError(f"row {i} has seq_len {row.seq_len}, expected {seq_len}")
    inputs = np.full((n, seq_len), pad_id, token_dtype)
    for i, row in enumerate(rows):
        inputs[i, : row.num_tokens] = row.tokens
    seg_marks = np.zeros((n, seq_len), np.int32)
    if n == 0:
        return inputs, seg_marks.astype(index_dtype), seg_marks.astype(index_dtype)
    # Marks for every row at once: T tokens and S segments per row.
    T = np.fromiter((r.num_tokens for r in rows), np.int64, n)
    S = np.fromiter((r.num_segments for r in rows), np.int64, n)
    pos_marks = (np.arange(seq_len)[None, :] < T[:, None]).astype(np.int32)
    pos_marks[:, 0] = 0
    if S.sum() == 0:
        return inputs, seg_marks.astype(index_dtype), seg_marks.astype(index_dtype)
    lengths = np.concatenate([r.segment_lengths for r in rows]).astype(np.int64)
    seg_row = np.repeat(np.arange(n), S)
    starts = np.cumsum(lengths) - lengths - np.repeat(np.cumsum(T) - T, S)  # start slot in its row
    first = np.zeros(lengths.size, bool)
    first[(np.cumsum(S) - S)[S > 0]] = True
    seg_marks[seg_row, starts] = 1
    later = np.nonzero(~first)[0]
    pos_marks[seg_row[later], starts[later]] = 1 - lengths[later - 1]
    tail = np.nonzero((S > 0) & (T < seq_len))[0]  # rows with padding after their last segment
    seg_marks[tail, T[tail]] = -S[tail]
    pos_marks[tail, T[tail]] = -(lengths[np.cumsum(S)[tail] - 1] - 1)
    # Running sums in int32 (numpy's int16 cumsum is several times slower), then narrowed.
    seg = np.cumsum(seg_marks, axis=1, dtype=np.int32)
    pos = np.cumsum(pos_marks, axis=1, dtype=np.int32)
    return inputs, seg.astype(index_dtype, copy=False), pos.astype(index_dtype, copy=False)


def derive_batch(inputs: np.ndarray, inputs_segmentation: np.ndarray,
                 inputs_position: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The six trainer arrays from tokens and segment ids (numpy; ``loader.device`` has the
    jitted twin the loader runs on the mesh, and tests check they agree).

    Args:
      inputs: int32 ``[n, L]`` tokens.
      inputs_segmentation: int32 ``[n, L]`` 1-based segment ids, 0 on padding.
      inputs_position: int32 ``[n, L]`` positions, or ``None`` to derive them from the ids.

    Returns:
      dict of int32 ``[n, L]`` arrays (MaxText names): ``inputs``, ``inputs_segmentation``,
      ``inputs_position`` (restarting at 0 per segment, 0 on padding), ``targets`` (the next
      token when it is in the same segment, else 0), ``targets_segmentation`` (the segment
      id where the target is valid; 0 at each segment's last token and on padding),
      ``targets_position`` (``inputs_position`` where the target is valid, else 0). So no
      (input, target) pair crosses a document boundary.
    """
    seg = inputs_segmentation
    n, L = seg.shape
    if inputs_position is None:
        idx = np.arange(L, dtype=np.int32)
        start = np.ones((n, L), bool)
        start[:, 1:] = seg[:, 1:] != seg[:, :-1]
        first = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
        pos = np.where(seg != 0, idx - first, 0).astype(np.int32)
    else:
        pos = inputs_position
    valid = np.zeros((n, L), bool)
    valid[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
    targets = np.zeros((n, L), np.int32)
    targets[:, :-1] = inputs[:, 1:]
    return {
        "inputs": inputs,
        "targets": np.where(valid, targets, 0).astype(np.int32),
        "inputs_segmentation": seg,
        "targets_segmentation": np.where(valid, seg, 0).astype(np.int32),
        "inputs_position": pos,
        "targets_position": np.where(valid, pos, 0).astype(np.int32),
    }


def derive_packed(packed: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`derive_batch` of a host array ``[n, 3, L]`` (tokens, segment ids, positions; uint16
    or int32, as ``loader.source.StepSource`` makes it), in fewer passes: the same six int32
    ``[n, L]`` arrays, bit for bit."""
    inputs = packed[:, 0].astype(np.int32)
    seg = packed[:, 1].astype(np.int32)
    pos = packed[:, 2].astype(np.int32)
    n, L = seg.shape
    valid = np.zeros((n, L), bool)
    np.equal(seg[:, 1:], seg[:, :-1], out=valid[:, :-1])
    valid[:, :-1] &= seg[:, :-1] != 0
    targets = np.zeros((n, L), np.int32)
    np.multiply(inputs[:, 1:], valid[:, :-1], out=targets[:, :-1])
    return {
        "inputs": inputs,
        "targets": targets,
        "inputs_segmentation": seg,
        "targets_segmentation": seg * valid,
        "inputs_position": pos,
        "targets_position": pos * valid,
    }


def dense_batch(rows: Sequence[codec.PackedRow], seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The six int32 ``[n, seq_len]`` trainer arrays of packed rows (see :func:`derive_batch`).

    Raises:
      ValueError: a row's seq_len differs from ``seq_len``.
    """
    return derive_batch(*pack_inputs(rows, seq_len, pad_id))


def decode_all(records: Sequence[bytes], where: Mapping[int, str] | None = None) -> list[codec.PackedRow]:
    """Decodes records with ``contract.codec.decode_row``.

    Raises:
      DatasetError: a record does not decode (``where[i]`` names it when given).
    """
    out = []
    for i, data in enumerate(records):
        try:
            out.append(codec.decode_row(data))
        except codec.RecordError as e:
            name = where.get(i, f"record {i}") if where else f"record {i}"
            raise DatasetError(f"{name}: {e}") from None
    return out


# The record header of contract.codec (format version 1), parsed here without building
# PackedRow objects: the loader's hot path only needs tokens and segment lengths.
_HEADER = struct.Struct("<4sBBHIII")
assert _HEADER.size == codec._HEADER.size  # noqa: SLF001 - same layout as the codec


_HEADER_DTYPE = np.dtype([("magic", "S4"), ("version", "u1"), ("width", "u1"), ("reserved", "<u2"),
                          ("seq_len", "<u4"), ("tokens", "<u4"), ("segments", "<u4")])
assert _HEADER_DTYPE.itemsize == _HEADER.size


def pack_records(
    records: Sequence[bytes], seq_len: int, token_width: int, pad_id: int = 0,
    out_dtype: np.dtype | str = np.int32, vocab_size: int | None = None,
    where: Mapping[int, str] | None = None, six: bool = False, out: np.ndarray | None = None,
) -> tuple[np.ndarray | dict[str, np.ndarray], int]:
    """Tokens, segment ids and positions of encoded rows, straight from the record bytes.

    The loader's per-step path: the same values as ``pack_inputs(decode_all(records), ...)``
    without building :class:`contract.codec.PackedRow` objects (one header unpack and two
    ``np.frombuffer`` per row; everything else over the whole step at once).

    Checks every record as ``contract.codec.decode_row`` does (magic, version, width,
    ``T <= seq_len``, lengths partition the tokens, no truncation or trailing bytes; the
    document keys' bytes are counted, not decoded), and also that its seq_len is
    ``seq_len``, its token width is ``token_width`` (``None``: 2 or 4 bytes, but not
    wider than ``out_dtype``: a wider token would be silently narrowed) and, when ``vocab_size`` is given, that every token is below it.

    Legend: ``n`` records, ``L = seq_len``.

    Returns:
      ``(packed, tokens)``: ``packed`` ``[n, 3, L]`` of ``out_dtype``: tokens (``pad_id`` on
      padding), 1-based segment ids, positions restarting at 0 per segment (both 0 on
      padding); ``tokens`` the number of non-padding tokens. With ``six=True``, ``packed``
      is instead the dict of the six int32 ``[n, L]`` trainer arrays (what
      :func:`derive_batch` gives, built in the same pass; ``out_dtype`` is ignored), views
      of ``out`` (int32 ``[6, n, L]``, overwritten; allocated when ``None``) in
      ``BATCH_KEYS`` order (when ``None``, a 64-byte-aligned block that nothing else
      uses, from :class:`AlignedPool`). Reusing ``out`` spares the fresh pages (page faults) of
      megabytes of new arrays every step.

    Raises:
      DatasetError: a record fails a check; ``where[i]`` (or "record i") names it.
    """
    n, L = len(records), int(seq_len)
    out_dtype = np.dtype(np.int32 if six else out_dtype)
    if six:
        if out is None:  # aligned: XLA's CPU devices then alias it instead of copying
            out = _POOL.take((6, n, L), np.int32)
        elif out.shape != (6, n, L) or out.dtype != np.int32:
            raise ValueError(f"out must be int32 [6, {n}, {L}], got {out.dtype} {list(out.shape)}")
        if n == 0:
            return dict(zip(BATCH_KEYS, out)), 0
        tok = out[0]
    else:
        packed = np.zeros((n, 3, L), out_dtype)
        tok = packed[:, 0]
        if n == 0:
            return packed, 0
    # token_width None: each record's own width (2 or 4), as long as out_dtype holds it
    widths = (token_width,) if token_width else tuple(w for w in (2, 4) if w <= max(out_dtype.itemsize, 2))
    hsize = _HEADER.size
    # All headers at once (a record shorter than a header makes the joined size wrong).
    heads = b"".join([rec[:hsize] for rec in records])
    if len(heads) != hsize * n:
        _explain(records, next(i for i, r in enumerate(records) if len(r) < hsize), L, widths, where)
    hdr = np.frombuffer(heads, _HEADER_DTYPE)
    T = hdr["tokens"].astype(np.int64)
    S = hdr["segments"].astype(np.int64)
    W = hdr["width"].astype(np.int64)
    size = np.fromiter(map(len, records), np.int64, n)
    meta_at = hsize + T * W
    bad = ((hdr["magic"] != codec.MAGIC) | (hdr["version"] != codec.FORMAT_VERSION) | (hdr["seq_len"] != L)
           | (W != widths[0]) & (W != widths[-1]) | (T > L) | (size < meta_at + 12 * S))
    if bad.any():
        _explain(records, int(np.argmax(bad)), L, widths, where)
    _copy_tokens(records, tok, T, W, hsize, pad_id, pad_rows=six or bool(pad_id))
    # lengths, chunk indices and key lengths (3 x S u32) of every row, back to back
    meta = [rec[a: a + 12 * sg] for rec, a, sg in zip(records, meta_at.tolist(), S.tolist())]
    # Segment lengths and key lengths of every segment of the step, row after row.
    allmeta = np.frombuffer(b"".join(meta), "<u4").astype(np.int64)
    n_seg = int(S.sum())
    seg_first = np.cumsum(S) - S  # first segment of each row
    row = np.repeat(np.arange(n), S)
    rank = np.arange(n_seg) - seg_first[row]  # segment index within its row
    base = 3 * seg_first[row] + rank
    lengths = allmeta[base]
    keylens = allmeta[base + 2 * S[row]]
    bad = (np.bincount(row, lengths, minlength=n) != T) | (
        meta_at + 12 * S + np.bincount(row, keylens, minlength=n) != size)
    if n_seg and lengths.min() == 0:
        bad[row[lengths == 0]] = True
    if bad.any():
        _explain(records, int(np.argmax(bad)), L, widths, where)
    # compared unsigned: a 4-byte token >= 2**31 is negative in int32 and would slip below vocab_size
    utok = tok.view(np.uint32) if tok.dtype == np.int32 else tok
    if vocab_size is not None and int(utok.max()) >= vocab_size:
        over = (utok >= vocab_size) & (np.arange(L) < T[:, None])
        if over.any():
            i = int(np.argmax(over.any(axis=1)))
            raise DatasetError(f"{_name(where, i)}: token {int(utok[i][over[i]].max())} >= vocab_size {vocab_size}")
    # Segment ids and positions: one running sum of marks per row (int32, then narrowed).
    starts = np.cumsum(lengths) - lengths - np.repeat(np.cumsum(T) - T, S)  # start slot in its row
    seg = out[2] if six else np.empty((n, L), np.int32)
    pos = out[4] if six else np.empty((n, L), np.int32)
    marks = _scratch(n, L)  # reused per thread: no fresh pages every step
    later = np.flatnonzero(rank > 0)
    # ids: +1 at each segment start, -S at the first padding slot (column L when full)
    marks.fill(0)
    marks[row, starts] = 1
    marks[np.arange(n), T] -= S.astype(np.int32)
    np.cumsum(marks[:, :L], axis=1, dtype=np.int32, out=seg)
    # positions: +1 per token after the first, 1 - previous length at a later start; in
    # rows with padding, minus the last position at the first padding slot and 0 after it
    marks.fill(1)
    marks[:, 0] = 0
    short = np.flatnonzero(T < L)
    if short.size:
        for i, t in zip(short.tolist(), T[short].tolist()):  # a slice a row: 4-5x a mask's speed
            marks[i, t + 1:] = 0
        has = short[S[short] > 0]
        marks[has, T[has]] = 1 - lengths[np.cumsum(S)[has] - 1]
    marks[row[later], starts[later]] = 1 - lengths[later - 1]
    np.cumsum(marks[:, :L], axis=1, dtype=np.int32, out=pos)
    if not six:
        packed[:, 1] = seg
        packed[:, 2] = pos
        return packed, int(T.sum())
    # The targets keys (derive_batch): slot j has a target when slot j + 1 holds a token of
    # the same segment, i.e. unless j is the last slot of a segment or padding. Ids and
    # positions are already 0 on padding; so are the shifted tokens when pad_id is 0.
    ends_row, ends = row, starts + lengths - 1  # last slot of every segment
    targets = out[1]
    targets[:, :-1] = tok[:, 1:]
    targets[:, -1] = 0
    if pad_id:
        targets[np.arange(L) >= T[:, None]] = 0
    targets[ends_row, ends] = 0
    out[3] = seg
    out[3][ends_row, ends] = 0
    out[5] = pos
    out[5][ends_row, ends] = 0
    return dict(zip(BATCH_KEYS, out)), int(T.sum())


def aligned_empty(shape: Sequence[int], dtype: np.dtype | str = np.int32, align: int = 64) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an ``align``-byte boundary.

    XLA's CPU client aliases (does not copy) a host buffer handed to ``device_put`` when
    it is aligned to 64 bytes; numpy only guarantees 16. So on CPU devices, a batch built
    in such a block reaches the devices without a copy (measured in
    ``benchmarks/load.py``). Device slices of whole rows stay aligned when a row's bytes
    are a multiple of ``align``.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return _aligned_view(np.empty(nbytes + align, np.uint8), shape, dtype, align)


def _aligned_view(raw: np.ndarray, shape, dtype: np.dtype, align: int = 64) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    start = (-raw.ctypes.data) % align
    return raw[start: start + nbytes].view(dtype).reshape(tuple(shape))


class AlignedPool:
    """Aligned blocks (:func:`aligned_empty`) handed out again once nothing uses them.

    A batch built in a fresh block every step costs its pages anew (page faults and the
    kernel's zeroing of megabytes a step), and a block may not simply be
    overwritten, because the CPU devices alias it while any array of that batch lives. A
    block is reused only when the pool holds the sole reference to it: every numpy view of
    it (and so every device buffer aliasing it, which keeps its view alive) is gone.
    Thread-safe; at most ``keep`` idle blocks are kept.
    """

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: np.dtype | str = np.int32, align: int = 64) -> np.ndarray:
        """An uninitialized aligned array of ``shape``/``dtype`` (contents undefined)."""
        import sys

        dtype = np.dtype(dtype)
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + align
        with self._lock:
            blocks, chosen = self._blocks, None
            # idle: only the pool's list and getrefcount's argument refer to the block
            idle = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) <= 2]
            for i in idle:
                if blocks[i].nbytes == need:
                    chosen = blocks[i]
                    break
            spare = [i for i in idle if blocks[i] is not chosen]
            for i in reversed(spare[: max(0, len(spare) - self.keep + (chosen is None))]):
                del blocks[i]  # the oldest idle blocks beyond keep
            if chosen is None:
                chosen = np.empty(need, np.uint8)
                blocks.append(chosen)
            return _aligned_view(chosen, shape, dtype, align)


_POOL = AlignedPool()


_SCRATCH = threading.local()


def _scratch(n: int, L: int) -> np.ndarray:
    """Per-thread work array of :func:`pack_records`: int32 ``[n, L + 1]`` marks (contents undefined)."""
    have = getattr(_SCRATCH, "marks", None)
    if have is None or have.shape != (n, L + 1):
        have = _SCRATCH.marks = np.empty((n, L + 1), np.int32)
    return have


_PAD_BYTES: dict = {}


def _copy_tokens(records, tok: np.ndarray, T: np.ndarray, W: np.ndarray, hsize: int, pad_id: int,
                 pad_rows: bool) -> None:
    """Writes each record's tokens into its row of ``tok`` ``[n, L]`` (and ``pad_id`` after
    them when ``pad_rows``; else the padding slots are left as they are).

    When every record has the same token width and ``pad_id`` fits it, the rows' token
    bytes and padding are joined into one buffer and converted in a single copy; otherwise
    row by row.
    """
    n, L = tok.shape
    Tl = T.tolist()
    w = int(W[0]) if n else 2
    if n and (W == w).all() and 0 <= pad_id < 1 << (8 * w):  # (writing the padding is harmless)
        pad = _PAD_BYTES.get((pad_id, w, L))
        if pad is None:
            pad = _PAD_BYTES[(pad_id, w, L)] = memoryview(pad_id.to_bytes(w, "little") * L)
        parts = []
        for rec, t in zip(records, Tl):
            parts.append(memoryview(rec)[hsize: hsize + w * t])
            parts.append(pad[: w * (L - t)])
        np.copyto(tok, np.frombuffer(b"".join(parts), {2: "<u2", 4: "<u4"}[w]).reshape(n, L), casting="unsafe")
        return
    tdt = {2: "<u2", 4: "<u4"}
    for i, (rec, t, wi) in enumerate(zip(records, Tl, W.tolist())):
        tok[i, :t] = np.frombuffer(rec, tdt[wi], t, hsize)
        if pad_rows and t < L:
            tok[i, t:] = pad_id


def _name(where, i: int) -> str:
    return where.get(i, f"record {i}") if where else f"record {i}"


def _explain(records, i: int, seq_len: int, widths: tuple[int, ...], where) -> None:
    """Raises the DatasetError for record ``i``, which a fast check of :func:`pack_records` failed."""
    name = _name(where, i)
    try:
        row = codec.decode_row(records[i])
    except codec.RecordError as e:
        raise DatasetError(f"{name}: {e}") from None
    if row.seq_len != seq_len:
        raise DatasetError(f"{name}: record has seq_len {row.seq_len}, the dataset's is {seq_len}")
    width = row.tokens.dtype.itemsize
    if width not in widths:
        raise DatasetError(f"{name}: record has {width}-byte tokens, expected {' or '.join(map(str, widths))} "
                           "(the dataset's token_dtype)")
    raise DatasetError(f"{name}: record does not decode")  # pragma: no cover - the checks above agree
