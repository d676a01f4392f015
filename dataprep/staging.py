"""Staging records between pipeline steps: through the shuffle, or spilled to files.

The tokenize step hands each document's tokens to the packing step of its bucket, and the
read step hands each rejected input to the dead-letter writer of its bucket. Both go
through a GroupByKey keyed by ``(source, bucket)``. What crosses it is one of:

* **shuffle** (distributed runners, e.g. Dataflow): the *segment* itself, one compact
  ``bytes`` value per (bundle flush, group) holding many records. The runner's shuffle
  service sorts and stores it.
* **spill** (local runners): the segments of one flush are written to one spill file under
  a temporary folder (through ``FileSystems``), and only a reference ``(path, offset,
  header bytes, payload bytes)`` crosses the GroupByKey. Beam's local runner
  (FnApiRunner, ``fn_api_runner/execution.py: GroupingBuffer``) keeps every element of a
  GroupByKey decoded in the runner process until the next stage, then encodes it all once
  more to hand it on, and in ``multi_processing`` mode every element crosses gRPC twice;
  with references only, the runner holds a few hundred bytes per flush and group.

Both transports give the reader the same records, so the packed bytes are the same; the
reader sorts records itself, so neither arrival order nor the transport matters.

Segment layout (integers little-endian)::

    offset              size            field
    0                   4               n, the number of records (u32)
    4                   4 n             byte length of each record's key (u32)
    4 + 4 n             4 n             byte length of each record's id (u32; 0: none)
    4 + 8 n             8 n             byte length of each record's payload (u64)
    4 + 16 n            sum(key bytes)  keys, UTF-8, concatenated
    ...                 sum(id bytes)   ids, UTF-8, concatenated       <- end of the header
    header              sum(payloads)   payloads, concatenated

A record's id is the document's own id (``id_field``), carried to the packed row's
provenance; the segments of one run are written and read by the same code, so the layout
is not part of the dataset contract.

A spill file is segments back to back; its name is random (``uuid4``) so that a retried
bundle never overwrites a file whose references an earlier attempt already emitted. Names
never reach the output. The folder is removed when the run ends (``dataprep.pack``).
"""

from __future__ import annotations

import collections
import uuid
from typing import Hashable, Iterable, Optional, Sequence, Union

import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from dataprep import fsutil

# A flush when a bundle has staged this many payload bytes: bounds the step's memory.
DEFAULT_FLUSH_BYTES = 16 << 20
SPILL_SUFFIX = ".seg"

Payload = Union[bytes, np.ndarray]
SpillRef = tuple  # (path, offset, header bytes, payload bytes)
Value = Union[bytes, SpillRef]


def encode_header(keys: Sequence[str], payload_lengths: Sequence[int], ids: Optional[Sequence[str]] = None) -> bytes:
    """Returns the header of a segment of ``len(keys)`` records (layout in the module docstring).

    ``ids``: each record's id (``""``: none), or None for no ids at all.
    """
    raw_keys = [k.encode("utf-8", "surrogatepass") for k in keys]
    raw_ids = [i.encode("utf-8", "surrogatepass") for i in ids] if ids is not None else []
    n = len(raw_keys)
    return b"".join(
        [
            np.uint32(n).astype("<u4").tobytes(),
            np.fromiter((len(k) for k in raw_keys), "<u4", n).tobytes(),
            np.fromiter((len(i) for i in raw_ids), "<u4", n).tobytes() if ids is not None else bytes(4 * n),
            np.asarray(payload_lengths, "<u8").tobytes(),
            b"".join(raw_keys),
            b"".join(raw_ids),
        ]
    )


def decode_header(data: bytes) -> tuple[list[str], Optional[list[str]], np.ndarray, int]:
    """Parses a segment header at the start of ``data``.

    Returns:
      ``(keys, ids (None when no record has one), payload byte lengths (int64 [n]), header
      size in bytes)``.

    Raises:
      ValueError: ``data`` is shorter than the header it announces.
    """
    if len(data) < 4:
        raise ValueError(f"segment header truncated: {len(data)} bytes")
    n = int(np.frombuffer(data, "<u4", 1, 0)[0])
    fixed = 4 + 16 * n
    if len(data) < fixed:
        raise ValueError(f"segment header truncated: {len(data)} bytes, {n} records need {fixed}")
    key_lengths = np.frombuffer(data, "<u4", n, 4).astype(np.int64)
    id_lengths = np.frombuffer(data, "<u4", n, 4 + 4 * n).astype(np.int64)
    payload_lengths = np.frombuffer(data, "<u8", n, 4 + 8 * n).astype(np.int64)
    end = fixed + int(key_lengths.sum()) + int(id_lengths.sum())
    if len(data) < end:
        raise ValueError(f"segment header truncated: {len(data)} bytes, keys and ids end at {end}")
    off = fixed

    def strings(lengths: np.ndarray) -> list[str]:
        nonlocal off
        out = []
        for k in lengths.tolist():
            out.append(bytes(data[off : off + k]).decode("utf-8", "surrogatepass"))
            off += k
        return out

    keys = strings(key_lengths)
    ids = strings(id_lengths) if id_lengths.any() else None
    return keys, ids, payload_lengths, end


class Stager:
    """Collects records by group within a bundle; :meth:`flush` hands them on as values.

    Args:
      spill_dir: folder (any FileSystems path) for spill files; ``None``: shuffle transport,
        values are the segment bytes themselves.
      flush_bytes: :meth:`full` is true once this many payload bytes are staged.

    Records keep the order they were added within a group. Values are ``bytes`` (a
    segment) or a spill reference tuple ``(path, offset, header bytes, payload bytes)``.
    Payloads are ``bytes`` or C-contiguous NumPy arrays (their raw bytes are staged); a
    record may carry an id (``doc_id``, ``""``: none).
    """

    def __init__(self, spill_dir: Optional[str], flush_bytes: int = DEFAULT_FLUSH_BYTES):
        self._dir = spill_dir
        self._flush_bytes = flush_bytes
        # group -> (keys, payloads, payload lengths, ids)
        self._groups: dict[Hashable, tuple[list[str], list[Payload], list[int], list[str]]] = {}
        self._bytes = 0

    def add(self, group: Hashable, key: str, payload: Payload, doc_id: str = "") -> None:
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = ([], [], [], [])
        n = payload.nbytes if isinstance(payload, np.ndarray) else len(payload)
        entry[0].append(key)
        entry[1].append(payload)
        entry[2].append(n)
        entry[3].append(doc_id)
        self._bytes += n + len(doc_id)

    def full(self) -> bool:
        return self._bytes >= self._flush_bytes

    def flush(self) -> list[tuple[Hashable, Value]]:
        """Returns ``(group, value)`` for every group with records, and empties the stager."""
        groups, self._groups, self._bytes = self._groups, {}, 0
        if not groups:
            return []
        order = sorted(groups, key=repr)  # any fixed order; readers sort records themselves
        if self._dir is None:
            out = []
            for g in order:
                keys, payloads, lengths, ids = groups[g]
                out.append((g, b"".join([encode_header(keys, lengths, ids if any(ids) else None), *payloads])))
            return out
        path = fsutil.join(self._dir, uuid.uuid4().hex + SPILL_SUFFIX)
        out, offset = [], 0
        with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            for g in order:
                keys, payloads, lengths, ids = groups[g]
                header = encode_header(keys, lengths, ids if any(ids) else None)
                body = b"".join(payloads)
                f.write(header)
                f.write(body)
                out.append((g, (path, offset, len(header), len(body))))
                offset += len(header) + len(body)
        return out


class StagedGroup:
    """The records of one group, read back from the values its GroupByKey delivered.

    Payloads of inline segments stay where they are (views, no copy); payloads of spilled
    segments stay in their files until :meth:`gather` reads the pieces asked for, so a
    reader holds keys and lengths only.

    Attributes:
      keys: the records' keys, in delivery order.
      ids: the records' ids (``""``: none) in the same order, or None when no record has one.
      nbytes: int64 ``[n]``, each record's payload size in bytes.
      segment: int64 ``[n]``, the segment each record is in.
      offset: int64 ``[n]``, where each payload starts: in the segment's bytes (inline) or
        in its spill file (spilled).
    """

    def __init__(self, values: Iterable[Value]):
        self._inline: dict[int, memoryview] = {}
        self._paths: dict[int, str] = {}
        self._bodies: list[tuple[int, int]] = []  # per segment: (where its payloads start, their bytes)
        keys: list[str] = []
        ids: Optional[list[str]] = None
        nbytes, segment, offset = [], [], []
        for s, value in enumerate(values):
            if isinstance(value, (bytes, bytearray, memoryview)):
                view = memoryview(value).cast("B")
                k, i, lengths, header = decode_header(view)
                self._inline[s] = view
                base = header
            else:
                path, seg_offset, header_size, _ = value
                with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
                    f.seek(seg_offset)
                    k, i, lengths, header = decode_header(f.read(header_size))
                if header != header_size:
                    raise ValueError(f"spill file {path}: header at {seg_offset} is {header}, expected {header_size}")
                self._paths[s] = path
                base = seg_offset + header
            self._bodies.append((base, int(lengths.sum())))
            if i is not None and ids is None:
                ids = [""] * len(keys)
            if ids is not None:
                ids.extend(i if i is not None else [""] * len(k))
            keys.extend(k)
            starts = np.cumsum(lengths) - lengths + base
            nbytes.append(lengths)
            segment.append(np.full(len(k), s, np.int64))
            offset.append(starts.astype(np.int64))
        self.keys = keys
        self.ids = ids
        self.nbytes = np.concatenate(nbytes) if nbytes else np.zeros(0, np.int64)
        self.segment = np.concatenate(segment) if segment else np.zeros(0, np.int64)
        self.offset = np.concatenate(offset) if offset else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.keys)

    def gather(self, records: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> list:
        """Returns the bytes of each piece ``(records[i], starts[i], sizes[i])``.

        A piece is ``sizes[i]`` bytes at byte ``starts[i]`` of record ``records[i]``'s
        payload (arrays or lists of ints, one entry a piece). Inline pieces are views.
        Spilled pieces are read file by file, each file opened once and read in offset
        order (so a gather of many pieces is sequential I/O), and returned in the order asked.
        """
        records = np.asarray(records, np.int64)
        segment = self.segment[records].tolist()  # Python ints: per-piece NumPy indexing is slow
        at_list = (self.offset[records] + np.asarray(starts, np.int64)).tolist()
        size_list = np.asarray(sizes, np.int64).tolist()
        out: list = [None] * len(segment)
        by_path: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
        inline, paths = self._inline, self._paths
        for i, (s, at, n) in enumerate(zip(segment, at_list, size_list)):
            view = inline.get(s)
            if view is not None:
                out[i] = view[at : at + n]
            else:
                by_path[paths[s]].append((at, n, i))
        for path in sorted(by_path):
            with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
                for at, n, i in sorted(by_path[path]):
                    f.seek(at)
                    data = f.read(n)
                    if len(data) != n:
                        raise IOError(f"spill file {path}: read {len(data)} bytes at {at}, expected {n}")
                    out[i] = data
        return out

    def payloads(self) -> bytes:
        """Every record's payload, concatenated in delivery order (one bytes object: no object a record).

        A segment's payloads lie back to back, so this is each segment's body in turn.
        """
        parts = []
        for s, (base, size) in enumerate(self._bodies):
            view = self._inline.get(s)
            if view is not None:
                parts.append(view[base : base + size])
                continue
            with FileSystems.open(self._paths[s], compression_type=CompressionTypes.UNCOMPRESSED) as f:
                f.seek(base)
                data = f.read(size)
            if len(data) != size:
                raise IOError(f"spill file {self._paths[s]}: read {len(data)} bytes at {base}, expected {size}")
            parts.append(data)
        return b"".join(parts)

    def gather_all(self) -> list:
        """The whole payload of every record, in delivery order."""
        n = len(self.keys)
        return self.gather(np.arange(n), np.zeros(n, np.int64), self.nbytes)


def remove_spill(spill_dir: str) -> None:
    """Deletes the spill folder and everything in it (any FileSystems path; missing is fine)."""
    for path in fsutil.match(fsutil.join(spill_dir, "*" + SPILL_SUFFIX)):
        fsutil.delete(path)
    fsutil.delete(spill_dir)
