"""Step -> host-local numpy batch: the picklable, JAX-free unit that threads and Grain workers run.

One call reads the rows of one step that this process's devices hold, one layer at a time,
each entered once:

    StepSource.six(step), StepSource(step)
      loader.index    Schedule.step_locations  step -> global rows -> (source, epoch, record)
      loader.shards   ShardSet.locate_and_read -> (shard, record in shard) -> record bytes
      loader.arrays   pack_records             record bytes -> host arrays

It is a pure function of the step, so the output is the same whatever the number of
workers or hosts. :meth:`StepSource.refs` and :meth:`StepSource.read_rows` answer "where
does each row of step N come from" and "which documents are in it" the same way.

May import: ``loader.index``, ``loader.shards``, ``loader.arrays`` (and ``contract``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from contract import codec
from loader import index as ix
from loader.arrays import decode_all, pack_records
from loader.shards import DatasetError, ShardSet, with_next


STAGE_BOUNDS = ("start", "index", "read", "decode", "rows")
"""What each of a host batch's ``stamps`` marks: the start of the step, then the end of its
index arithmetic (``loader.index`` and ``ShardSet.locate``), of its storage reads
(``ShardSet.read_located``), of decoding and checking the records and of building the rows'
arrays (``loader.arrays.pack_records``)."""


@dataclasses.dataclass(frozen=True)
class RowRef:
    """Where one row of a step comes from (replay's ``inspect`` prints these).

    Attributes:
      global_row: row of the unskipped run (``data_step * B + position``).
      phase: index of the mixture phase.
      source: source name.
      epoch: pass over the source (0-based).
      index_in_epoch: position in the epoch's shuffled order.
      record: record of the source (across its shards, manifest order).
      shard: shard path relative to the dataset folder.
      record_in_shard: record index inside that shard.
    """

    global_row: int
    phase: int
    source: str
    epoch: int
    index_in_epoch: int
    record: int
    shard: str
    record_in_shard: int

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (JSON values)."""
        return dataclasses.asdict(self)


def unpack(host: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(inputs, inputs_segmentation, inputs_position)``, int32 ``[n, L]``, of a host batch."""
    packed = host["packed"].astype(np.int32)
    return packed[:, 0], packed[:, 1], packed[:, 2]


class _Names:
    """``names[i]``: "<source> record <r> (<shard> record <j>)" of the i-th row, built only
    when an error needs it."""

    def __init__(self, sources, loc: ix.RowLocations, shards: ShardSet, shard: np.ndarray, in_shard: np.ndarray):
        self.sources, self.loc, self.shards = sources, loc, shards
        self.shard, self.in_shard = shard, in_shard

    def get(self, i, default=None):
        k, r = int(self.loc.source[i]), int(self.loc.record[i])
        s, j = int(self.shard[i]), int(self.in_shard[i])
        return f"{self.sources[k]} record {r} (shard {self.shards.path(k, s)} record {j})"


class StepSource:
    """Reads the host-local rows of a step.

    Args:
      schedule: the :class:`loader.index.Schedule`.
      shards: the opened :class:`ShardSet` (same source order as the schedule).
      local_rows: int64 ``[n]``, sorted positions in ``[0, B)`` of the rows this process
        holds (``B`` = global batch).
      seq_len: slots per row.
      pad_id: token id written on padding.
      token_dtype: the dataset's token dtype (uint16 allows the narrow host array).
      token_width: bytes per stored token (2 or 4) that every record must have; ``None``:
        either, as long as the host array holds it.
      vocab_size: when given, every token must be below it (else ``DatasetError``).
    """

    def __init__(self, schedule: ix.Schedule, shards: ShardSet, local_rows: np.ndarray, seq_len: int,
                 pad_id: int = 0, token_dtype: np.dtype | str = np.int32, token_width: int | None = None,
                 vocab_size: int | None = None):
        self.schedule = schedule
        self.shards = shards
        self.local_rows = np.asarray(local_rows, np.int64)
        self.seq_len = seq_len
        self.pad_id = pad_id
        # One host array [n, 3, L] of tokens, segment ids and positions: uint16 when the tokens
        # are uint16 and ids and positions (<= seq_len) fit, else int32; the devices widen it.
        narrow = np.dtype(token_dtype) == np.uint16 and seq_len < 2**15
        self.packed_dtype = np.dtype(np.uint16 if narrow else np.int32)
        self.token_width = token_width
        self.vocab_size = vocab_size

    def refs(self, step: int, positions: np.ndarray | None = None) -> list[RowRef]:
        """:class:`RowRef` of each row of ``step`` (all ``B`` rows, or those at ``positions``); no I/O.

        Raises:
          loader.index.ScheduleError: a bad step.
        """
        loc = self.schedule.step_locations(step, positions)
        shard, in_shard = self.shards.locate(loc.source, loc.record)
        return [
            RowRef(int(g), int(p), self.schedule.sources[int(k)], int(e), int(i), int(r),
                   self.shards.shards[int(k)][int(s)], int(j))
            for g, p, k, e, i, r, s, j in zip(loc.global_row, loc.phase, loc.source, loc.epoch,
                                              loc.index_in_epoch, loc.record, shard, in_shard)
        ]

    def read_rows(self, step: int, positions: np.ndarray | None = None) -> list[codec.PackedRow]:
        """The stored rows of ``step`` (all, or those at ``positions``), in batch order.

        Raises:
          loader.index.ScheduleError: a bad step.
          loader.shards.DatasetError: a record cannot be read or does not decode (named).
        """
        loc = self.schedule.step_locations(step, positions)
        shard, in_shard, data = self.shards.locate_and_read(loc.source, loc.record)
        try:
            return decode_all(data, _Names(self.schedule.sources, loc, self.shards, shard, in_shard))
        except DatasetError as e:  # a damaged record: what to do next, as for one that cannot be read
            raise with_next(e, getattr(self.shards, "repair", "")) from None

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        """Host-local arrays of ``step``.

        Returns:
          ``packed``: ``[n, 3, seq_len]`` in :attr:`packed_dtype`, tokens, segment ids and
          positions of the host's rows (:func:`unpack`; the targets keys derive from them,
          ``loader.device.derive``); ``step`` (int64 scalar); ``tokens`` (int64
          scalar, non-padding tokens); ``source`` (int32 ``[n]``, schedule source index);
          ``stamps`` (float64 ``[5]``, ``time.perf_counter()`` seconds: the step's start and
          the end of each of its stages, :data:`STAGE_BOUNDS`; ``perf_counter`` is the
          system-wide monotonic clock on Linux, so a Grain worker's stamps compare with the
          trainer's).

        Raises:
          loader.index.ScheduleError: a bad step.
          loader.shards.DatasetError: a record cannot be read, does not decode or disagrees
            with the manifest (named: source record, shard, record in shard).
        """
        return self._read(step, six=False)

    def unstamped(self, step: int) -> dict[str, np.ndarray]:
        """Calling the source without ``stamps``: the host arrays alone, a pure function of
        the step (what ``DataLoader.grain_dataset`` gives, so that Grain's checkpoint
        round trip compares equal elements)."""
        host = self._read(step, six=False)
        del host["stamps"]
        return host

    def six(self, step: int, out: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Like calling the source, but the host arrays are the six trainer keys (int32
        ``[n, L]``, ``loader.arrays.BATCH_KEYS``) built in one pass, instead of ``packed``:
        for a loader that derives the targets on the host anyway. They are views of ``out``
        (int32 ``[6, n, L]``, see ``loader.arrays.pack_records``) when given.

        Raises:
          as calling the source.
        """
        return self._read(step, six=True, out=out)

    def _read(self, step: int, six: bool, out: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The path of a step, each layer entered once: rows (``loader.index``), their record
        bytes (``loader.shards``), host arrays (``loader.arrays``)."""
        t0 = time.perf_counter()
        loc = self.schedule.step_locations(step, self.local_rows)
        stamps = [t0]  # ShardSet.locate_and_read adds the end of locate, then of the reads
        shard, in_shard, records = self.shards.locate_and_read(loc.source, loc.record, stamps)
        try:
            arrays, tokens = pack_records(records, self.seq_len, self.token_width, self.pad_id, self.packed_dtype,
                                          self.vocab_size,
                                          _Names(self.schedule.sources, loc, self.shards, shard, in_shard),
                                          six=six, out=out, stamps=stamps)
        except DatasetError as e:  # a damaged record: what to do next, as for one that cannot be read
            raise with_next(e, getattr(self.shards, "repair", "")) from None
        if len(stamps) == 3:  # no rows: nothing was decoded
            stamps.append(stamps[-1])
        stamps.append(time.perf_counter())
        host = dict(arrays) if six else {"packed": arrays}
        # int(step): an integer, as step_locations checked
        host.update(step=np.int64(int(step)), tokens=np.int64(tokens), source=loc.source.astype(np.int32),
                    stamps=np.array(stamps, np.float64))
        return host
