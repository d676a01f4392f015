"""The I/O edge of the loader: open and check a packed dataset, read rows, build dense arrays.

No JAX here (worker processes import it). Reads are batched: the caller computes every
record of a step first (``loader.index``), then :meth:`ShardSet.read` issues one
``ArrayRecordReader.read(indices)`` per shard touched.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from contract import codec
from contract.config import MixtureConfig
from contract.manifest import MANIFEST_NAME, Manifest, ManifestError

# Random access: no read-ahead (what Grain's ArrayRecordDataSource uses).
READER_OPTIONS = "readahead_buffer_size:0"
BATCH_KEYS = (
    "inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position",
)


class DatasetError(ValueError):
    """The packed dataset is missing, malformed, altered or disagrees with the mixture config."""


def _open_reader(path: str):
    from array_record.python.array_record_module import ArrayRecordReader

    return ArrayRecordReader(path, READER_OPTIONS, file_reader_buffer_size=32768)


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(dataset: str) -> tuple[Manifest, str]:
    """Returns the dataset's manifest and the sha256 of its ``manifest.json`` bytes.

    Raises:
      DatasetError: no manifest (the dataset was never committed), or a malformed one.
    """
    path = os.path.join(dataset, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no manifest; the dataset is missing or was not committed") from None
    try:
        manifest = Manifest.from_json(data.decode("utf-8"))
    except (ManifestError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: {e}") from None
    problems = manifest.problems()
    if problems:
        raise DatasetError(f"{path}: does not reconcile: " + "; ".join(problems))
    return manifest, hashlib.sha256(data).hexdigest()


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
      dataset: the dataset folder.
      shards: per source (in schedule order), the shard paths relative to ``dataset``.
      offsets: per source, cumulative records ``[0, r_0, r_0 + r_1, ...]`` (int64).
    """

    def __init__(self, dataset: str, shards: Sequence[Sequence[str]], offsets: Sequence[np.ndarray]):
        self.dataset = dataset
        self.shards = [list(s) for s in shards]
        self.offsets = [np.asarray(o, np.int64) for o in offsets]
        self._local = threading.local()

    def __getstate__(self):
        return {"dataset": self.dataset, "shards": self.shards, "offsets": self.offsets}

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
            cache[key] = _open_reader(self.path(source, shard))
        return cache[key]

    def locate(self, source: np.ndarray, record: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Maps (source, source-level record) to (shard, record in shard), int64 arrays."""
        source = np.asarray(source, np.int64)
        record = np.asarray(record, np.int64)
        shard = np.empty_like(record)
        for k in np.unique(source):
            sel = source == k
            off = self.offsets[k]
            shard[sel] = np.searchsorted(off, record[sel], side="right") - 1
        in_shard = record - np.asarray([self.offsets[k][s] for k, s in zip(source, shard)], np.int64)
        return shard, in_shard

    def read(self, source: np.ndarray, record: np.ndarray) -> list[bytes]:
        """Returns the record bytes of each (source, record), in order; one read per shard.

        Raises:
          DatasetError: a shard cannot be read (named).
        """
        shard, in_shard = self.locate(source, record)
        out: list[bytes | None] = [None] * len(shard)
        keys = np.stack([np.asarray(source, np.int64), shard], axis=1) if len(shard) else np.zeros((0, 2), np.int64)
        for k, s in sorted({(int(a), int(b)) for a, b in keys}):
            sel = np.nonzero((keys[:, 0] == k) & (keys[:, 1] == s))[0]
            try:
                data = self._reader(k, s).read([int(i) for i in in_shard[sel]])
            except Exception as e:  # array_record raises RuntimeError/OSError variants
                raise DatasetError(f"reading {self.path(k, s)}: {e}") from e
            for j, d in zip(sel.tolist(), data):
                out[j] = d
        return out  # type: ignore[return-value]


def open_dataset(
    dataset: str, mixture: MixtureConfig, verify_sha256: bool = False
) -> tuple[Manifest, str, ShardSet]:
    """Opens and checks a packed dataset before the first step.

    Checks: manifest present, well-formed and reconciling; format version, seq_len,
    tokenizer sha256 (when the mixture pins it) and sources agree with ``mixture``; every
    shard of every mixture source exists, has the manifest's byte size, opens, is ``ok()``
    and holds the manifest's record count; with ``verify_sha256``, its sha256 matches.

    Returns:
      ``(manifest, manifest_sha256, shards)`` with ``shards`` in mixture source order.

    Raises:
      DatasetError: the first fault found, naming the shard and the fault.
    """
    manifest, manifest_sha = read_manifest(dataset)
    where = os.path.join(dataset, MANIFEST_NAME)
    check_against_mixture(manifest, mixture, where)
    shard_paths, offsets = [], []
    for name in mixture.source_names:
        entry = manifest.sources[name]
        paths = []
        for info in entry.shards:
            full = os.path.join(dataset, info.path)
            if not os.path.isfile(full):
                raise DatasetError(f"shard {full}: missing (manifest lists {info.records} records)")
            size = os.path.getsize(full)
            if size != info.bytes:
                raise DatasetError(f"shard {full}: {size} bytes, manifest says {info.bytes} (truncated or altered)")
            try:
                reader = _open_reader(full)
            except Exception as e:
                raise DatasetError(f"shard {full}: does not open as ArrayRecord: {e}") from e
            try:
                if not reader.ok():
                    raise DatasetError(f"shard {full}: reader is not ok()")
                n = reader.num_records()
                if n != info.records:
                    raise DatasetError(f"shard {full}: {n} records, manifest says {info.records}")
            finally:
                reader.close()
            if verify_sha256:
                digest = file_sha256(full)
                if digest != info.sha256:
                    raise DatasetError(f"shard {full}: sha256 {digest} != manifest {info.sha256} (altered)")
            paths.append(info.path)
        shard_paths.append(paths)
        offsets.append(np.concatenate([[0], np.cumsum([s.records for s in entry.shards])]).astype(np.int64))
    return manifest, manifest_sha, ShardSet(dataset, shard_paths, offsets)


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
