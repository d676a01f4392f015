"""The Beam pipeline: read -> tokenize and stage -> (find duplicates) -> pack and write shards.

Shape (per source; all sources share the transforms, keyed by source name)::

    Create[(source, file, listed size)]  (Create reshuffles the files over workers)
      -> ParDo(ReadAndTokenize)    main: ((source, bucket), staged tokens and ids)
                                   rejected: unreadable inputs and empty documents
                                   dedup: (dedup bucket, staged doc hashes)    [dedup on]
      -> Flatten with one empty marker per (source, bucket)
                 (and the drop lists of FindDuplicates, dedup: exact) -> GroupByKey
      -> ParDo(PackAndWriteShard)  one shard per bucket: <out>/<source>/data-SSSSS-of-NNNNN.array_record
    dedup -> GroupByKey -> ParDo(FindDuplicates)   counts and examples; with dedup: exact,
                                                   ((source, bucket), (DROP, staged keys))
    rejected -> ParDo(StageRejected) ((source, bucket), staged dead letters)
      -> GroupByKey -> ParDo(WriteDeadLetters)
    every step's counts -> ToList -> write <out>/_stats.json (read by the driver, which
    reconciles the ledger and writes manifest.json last).

Duplicates at scale: a document's hash (of its token ids: ``dataprep.dedup``) goes to the dedup
bucket its hash picks, so every copy of a document meets in one bucket and FindDuplicates holds
one bucket of (hash, source, tokens, key) records at a time, about 100 bytes a document,
never a set of every hash of the corpus; the drop lists travel to the packing buckets of
the dropped documents through the same staging as the tokens.

Staging (``dataprep.staging``): a document's tokens cross the GroupByKey as part of a compact
segment (uint16/uint32 bytes, never Python objects), either inline (the shuffle of a
distributed runner) or spilled to a file with only a small reference crossing (local
runners, whose GroupByKey holds every element in the runner process). Text is not kept
after it is tokenized. The packing step holds one bucket's keys and lengths; with spill
files it reads each chunk's tokens from its file as it writes the row.

Determinism: buckets come from a stable hash of (seed, source, key); within a bucket the
chunks are sorted by (length desc, key, chunk) before packing and each shard is written to
one fixed name from a local temporary file, so reruns, worker counts, retried bundles and
the staging transport give identical bytes. Nothing depends on the order in which elements
arrive.
"""

from __future__ import annotations

import base64
import collections
import heapq
import itertools
import json
import os
import tempfile
import threading
from typing import Any, Iterable, Mapping, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindows

from contract.codec import encode_row
from contract.config import DedupMode, MixtureConfig, SourceConfig
from contract.manifest import ERRORS_DIR, shard_name
from contract.hashing import key_position
from dataprep import dedup, fsutil, packing, progress, readers, staging, tokenizer

NAMESPACE = "dataprep"
STATS_NAME = "_stats.json"
REJECTED = "rejected"
STATS = "stats"
DEDUP = "dedup"
DROP = "drop"  # tags a drop list among the values of a packing bucket
# Duplicate groups each dedup bucket reports as examples (the manifest keeps the 5 of the
# smallest hashes over all buckets), and keys shown per group.
DUPLICATE_EXAMPLES = 5
# group_size:1: every record is one read. zstd:3 is ArrayRecord's default compression,
# spelled out so that the shard bytes do not change if the library's default does.
ARRAY_RECORD_OPTIONS = "group_size:1,zstd:3"
# Bins of the segment length histogram in the stats (and report.png): HIST_BINS equal bins
# over [1, seq_len].
HIST_BINS = 32


class ShardVerifyError(IOError):
    """A freshly written shard does not reopen cleanly or has the wrong record count."""


class InputChangedError(IOError):
    """An input file is gone, or its size differs from the listing the run was planned on.

    The shard counts and the listed sizes were fixed before any work, so a file that
    changes during the run would give a dataset that no run on the files as they are now
    reproduces. The bundle fails; its retries fail the same way, and so does the run.
    """


def check_input_unchanged(path: str, listed: int, when: str) -> None:
    """Raises :class:`InputChangedError` unless ``path`` still has its ``listed`` size (< 0: unknown)."""
    if listed < 0:
        return
    try:
        now = fsutil.size(path)
    except (OSError, ValueError) as e:  # BeamIOError is an IOError
        raise InputChangedError(
            f"input {path} was listed with {listed:,} bytes before the run but cannot be found {when} ({e}); "
            "inputs must not change while pack runs"
        ) from None
    if now != listed:
        raise InputChangedError(
            f"input {path} was listed with {listed:,} bytes before the run but has {now:,} bytes {when}; "
            "inputs must not change while pack runs"
        )


def _counter(source: str, what: str):
    return Metrics.counter(NAMESPACE, f"{source}.{what}")


class _Counters(dict):
    """Beam counters by (source, what), created once per DoFn instance."""

    def __missing__(self, key):
        self[key] = c = _counter(*key)
        return c


def dead_letter(source: str, key: str, reason: str, raw: bytes | str, detail: str) -> dict[str, Any]:
    """Returns the JSON object of one dead letter (raw input as text, or base64 when not UTF-8)."""
    out: dict[str, Any] = {"source": source, "key": key, "reason": reason, "detail": detail}
    if isinstance(raw, bytes):
        try:
            out["raw"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            out["raw_base64"] = base64.b64encode(raw).decode("ascii")
    else:
        try:
            raw.encode("utf-8")
            out["raw"] = raw
        except UnicodeEncodeError:
            out["raw_base64"] = base64.b64encode(raw.encode("utf-8", "surrogatepass")).decode("ascii")
    return out


_DRIVER_WATCH = threading.Lock()
_driver_watched: Optional[int] = None


def exit_with_driver(driver_pid: Optional[int], poll_s: float = 2.0) -> None:
    """In a local worker process, exits it soon after the driver (``driver_pid``) is gone.

    Beam's ``multi_processing`` workers are separate processes that outlive a driver killed
    by SIGKILL (or by SIGTERM while they work): each stayed, idle at about 150 MB, for ever.
    A daemon thread, started once per process, checks every ``poll_s`` seconds that the
    driver still exists (and, on Linux, is the same process: its start time) and ends the
    worker with ``os._exit(1)`` when it is not. Nothing happens in the driver's own process
    or when ``driver_pid`` is None (distributed runners).
    """
    global _driver_watched
    if driver_pid is None or driver_pid == os.getpid():
        return
    with _DRIVER_WATCH:
        if _driver_watched == driver_pid:
            return
        _driver_watched = driver_pid

    def start_time() -> Optional[str]:
        try:
            with open(f"/proc/{driver_pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[19].decode()  # field 22, after "pid (comm)"
        except (OSError, IndexError):
            return None

    born = start_time()

    def watch() -> None:
        import time

        while True:
            time.sleep(poll_s)
            try:
                os.kill(driver_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # exists, owned by someone else: the pid was reused
                os._exit(1)
            if born is not None and start_time() != born:
                os._exit(1)

    threading.Thread(target=watch, name="dataprep-driver-watch", daemon=True).start()


def _windowed(outputs: Iterable[Any]) -> Iterable[Any]:
    """Outputs of ``finish_bundle`` must carry their window: the global one here."""
    for out in outputs:
        if isinstance(out, pvalue.TaggedOutput):
            yield pvalue.TaggedOutput(out.tag, GlobalWindows.windowed_value(out.value))
        else:
            yield GlobalWindows.windowed_value(out)


class ReadAndTokenize(beam.DoFn):
    """(source, path, listed size) -> ((source, bucket), staged tokens) for the file's documents.

    The file must still have its listed size (a negative size: unknown, not checked) when
    its reading starts and ends, else :class:`InputChangedError` fails the bundle.

    One element is one input file: its documents never become Beam elements (per-element
    overhead would cost more than tokenizing a short web document), only its rejected
    inputs do. Reads the file (``dataprep.readers``), buffers documents and encodes them in
    batches of about ``batch_chars`` characters with one SentencePiece ``encode(list)``
    call (a document over ``tokenizer.LONG_TEXT_CHARS`` in pieces, same ids) into NumPy arrays (``token_dtype``: uint16 when the vocabulary fits, else
    uint32; BOS/EOS added by id); each document's tokens are staged for the bucket
    ``packing.bucket_of(seed, source, key, num_shards[source])`` and its text dropped. The
    stager (``dataprep.staging``: inline segments, or spill files under ``spill_dir``) is
    flushed when it holds ``flush_bytes`` and at the end of the bundle; the text buffer is
    carried across files of a bundle, so small files still make full batches.

    The SentencePiece model is loaded once per worker in ``setup()`` (through FileSystems,
    checked against its sha256). Outputs: main ``((source, bucket), value)`` (each record:
    the document's key, its own id from ``id_field`` and its tokens); ``rejected``
    ``(source, key, reason, raw, detail)`` (unreadable input, and documents with no token);
    ``stats`` ``("read", source, n)`` per file and ``("tokens_in", source, n)`` per bundle;
    with ``dedup_buckets`` > 0, ``dedup`` ``(dedup bucket, value)``: each document's text
    hash, source index and token count (``dataprep.dedup.RECORD``), staged like the tokens.
    """

    def __init__(
        self,
        sources: Mapping[str, SourceConfig],
        tokenizer_path: str,
        tokenizer_sha256: str,
        add_bos: bool,
        add_eos: bool,
        token_dtype: str,
        seed: int,
        num_shards: Mapping[str, int],
        spill_dir: Optional[str] = None,
        heartbeat_dir: Optional[str] = None,
        batch_chars: int = 1 << 20,
        batch_docs: int = 1024,
        flush_bytes: int = staging.DEFAULT_FLUSH_BYTES,
        driver_pid: Optional[int] = None,
        dedup_buckets: int = 0,
    ):
        self._driver_pid = driver_pid
        self._dedup_buckets = dedup_buckets
        self._source_index = {name: i for i, name in enumerate(sources)}
        self._sources = dict(sources)
        self._path = tokenizer_path
        self._sha = tokenizer_sha256
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._dtype = token_dtype
        self._seed = seed
        self._num_shards = dict(num_shards)
        self._spill_dir = spill_dir
        self._heartbeat_dir = heartbeat_dir
        self._batch_chars = batch_chars
        self._batch_docs = batch_docs
        self._flush_bytes = flush_bytes

    def setup(self):
        exit_with_driver(self._driver_pid)
        self._sp, _ = tokenizer.load(self._path, self._sha)
        self._cuts = tokenizer.safe_cuts(self._sp)  # long documents encoded in pieces, same ids
        self._counters = _Counters()
        self._bucket = {s: packing.BucketOf(self._seed, s, self._num_shards[s]) for s in self._sources}
        self._read_beat = progress.Heartbeat(self._heartbeat_dir, progress.READ)
        self._token_beat = progress.Heartbeat(self._heartbeat_dir, progress.TOKENIZE)

    def start_bundle(self):
        self._buffer: list[readers.Document] = []
        self._buffer_sources: list[str] = []
        self._chars = 0
        self._tokens_in: dict[str, int] = collections.defaultdict(int)
        self._stager = staging.Stager(self._spill_dir, self._flush_bytes)
        self._hashes = staging.Stager(self._spill_dir, self._flush_bytes)  # dedup records

    def _flush(self, force: bool = False) -> list:
        """The staged tokens (main output) and document hashes (``dedup``) when full, or ``force``."""
        out = self._stager.flush() if force or self._stager.full() else []
        if force or self._hashes.full():
            out += [pvalue.TaggedOutput(DEDUP, v) for v in self._hashes.flush()]
        return out

    def process(self, element: tuple[str, str, int]):
        source_name, path, size = element
        source = self._sources[source_name]
        check_input_unchanged(path, size, "when its reading started")
        raw: list[Any] = []
        n = done = 0
        for item in readers.read_file(source, path, on_open=raw.append):
            n += 1
            if type(item) is readers.Document:
                self._buffer.append(item)
                self._buffer_sources.append(source_name)
                self._chars += len(item.text)
                if self._chars >= self._batch_chars or len(self._buffer) >= self._batch_docs:
                    yield from self._encode()
                    yield from self._flush()
            else:
                self._counters[source_name, f"rejected.{item.reason.value}"].inc()
                yield pvalue.TaggedOutput(
                    REJECTED, (source_name, item.key, item.reason.value, item.raw, item.detail)
                )
            if n % 32 == 0 and raw and self._heartbeat_dir:
                try:
                    at = raw[0].tell()
                except (OSError, ValueError):  # closed or not seekable: count the file at its end
                    at = done
                self._read_beat.add(documents=32, bytes=max(0, at - done))
                done = max(done, at)
        check_input_unchanged(path, size, "once it was read")
        self._counters[source_name, "read"].inc(n)
        self._counters[source_name, "bytes_read"].inc(max(0, size))
        self._read_beat.add(documents=n % 32, bytes=max(0, size - done))
        yield pvalue.TaggedOutput(STATS, ("read", source_name, n))

    def _encode(self) -> Iterable[Any]:
        """Encodes the buffered documents; stages their tokens; yields the empty ones as rejected."""
        batch, sources = self._buffer, self._buffer_sources
        self._buffer, self._buffer_sources, self._chars = [], [], 0
        if not batch:
            return
        encoded = tokenizer.encode_batch(
            self._sp, [doc.text for doc in batch], self._add_bos, self._add_eos, self._dtype, self._cuts
        )
        n = 0
        stage = self._stager.add
        hashes = self._hashes.add if self._dedup_buckets else None
        # the batch's document hashes: of the ids in hand (the text's only where they hold the unknown id)
        digests = (dedup.document_hashes([doc.text for doc in batch], encoded, self._sp.unk_id())
                   if hashes is not None else itertools.repeat(None))
        for source, (key, text, doc_id), tokens, digest in zip(sources, batch, encoded, digests):
            size = tokens.size
            if not size or text.isspace():  # whitespace alone is no document, whatever the tokenizer keeps of it
                self._counters[source, f"rejected.{readers.Reason.EMPTY.value}"].inc()
                yield pvalue.TaggedOutput(REJECTED, (source, key, readers.Reason.EMPTY.value, text, empty_detail(text)))
                continue
            n += size
            self._tokens_in[source] += size
            stage((source, self._bucket[source](key)), key, tokens, doc_id)
            if hashes is not None:
                hashes(dedup.dedup_bucket(digest, self._dedup_buckets), key,
                       dedup.RECORD.pack(digest, self._source_index[source], size))
        self._token_beat.add(tokens=n)

    def finish_bundle(self):
        yield from self._emit(list(self._encode()) + self._flush(force=True))
        for source in sorted(self._tokens_in):
            self._counters[source, "tokens_in"].inc(self._tokens_in[source])
            yield from _windowed([pvalue.TaggedOutput(STATS, ("tokens_in", source, self._tokens_in[source]))])
        self._read_beat.write()
        self._token_beat.write()

    def _emit(self, outputs: list) -> Iterable[Any]:
        """The bundle's buffered outputs (staged tokens, rejected and dedup records), each in its window."""
        yield from _windowed(outputs)


def empty_detail(text: str) -> str:
    """The dead letter's detail for a document with no token besides BOS/EOS, or only whitespace."""
    if not text:
        return "no token: the text is empty"
    shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
    if text.isspace():
        return f"the text is only whitespace ({len(text):,} characters: {shown})"
    return f"no token from {len(text):,} characters ({shown}): characters the tokenizer's normalization removes"


class StageRejected(beam.DoFn):
    """(source, key, reason, raw, detail) -> ((source, bucket), staged dead-letter lines).

    Each rejected input becomes its dead letter's JSON line (``dead_letter``) at once, so the
    raw input crosses the GroupByKey as part of a compact segment (or a spill file), in the
    bucket ``packing.bucket_of(seed, source, key, num_shards[source])``.
    """

    def __init__(self, seed: int, num_shards: Mapping[str, int], spill_dir: Optional[str] = None,
                 flush_bytes: int = staging.DEFAULT_FLUSH_BYTES):
        self._seed = seed
        self._num_shards = dict(num_shards)
        self._spill_dir = spill_dir
        self._flush_bytes = flush_bytes

    def start_bundle(self):
        self._stager = staging.Stager(self._spill_dir, self._flush_bytes)

    def process(self, element):
        source, key = element[0], element[1]
        line = json.dumps(dead_letter(*element), sort_keys=True, ensure_ascii=True) + "\n"
        bucket = packing.bucket_of(self._seed, source, key, self._num_shards[source])
        self._stager.add((source, bucket), key, line.encode("ascii"))
        if self._stager.full():
            yield from self._stager.flush()

    def finish_bundle(self):
        yield from _windowed(self._stager.flush())


def write_shard(records: Iterable[bytes], num_records: int, dest: str) -> tuple[str, int]:
    """Writes encoded rows as one ArrayRecord shard at ``dest`` (any FileSystems path).

    The shard is written with options ``group_size:1`` to a temporary name (beside ``dest``
    when ``dest`` is local, else in a local temporary folder), reopened and checked
    (``ok()`` and record count), then renamed to ``dest`` (local) or copied there.

    Returns:
      (sha256 hex, size in bytes) of the shard.

    Raises:
      ShardVerifyError: the written file does not verify, or the copy has a different size.
    """
    from apache_beam.io.localfilesystem import LocalFileSystem
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    def write_and_verify(path: str) -> None:
        writer = ArrayRecordWriter(path, ARRAY_RECORD_OPTIONS)
        for record in records:
            writer.write(record)
        if not writer.ok():
            raise ShardVerifyError(f"ArrayRecord writer for {dest} is not ok")
        writer.close()
        reader = ArrayRecordReader(path)
        try:
            if not reader.ok() or reader.num_records() != num_records:
                raise ShardVerifyError(
                    f"{dest}: reopened shard has ok()={reader.ok()} and {reader.num_records()} records, "
                    f"expected {num_records}"
                )
        finally:
            reader.close()

    if isinstance(FileSystems.get_filesystem(dest), LocalFileSystem):
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        tmp = f"{dest}.tmp-{os.getpid()}-{threading.get_ident()}"  # one writer per name at a time
        try:
            write_and_verify(tmp)
            sha, size = fsutil.sha256_of(tmp), os.path.getsize(tmp)
            os.replace(tmp, dest)  # atomic: a reader never sees half a shard
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return sha, size
    with tempfile.TemporaryDirectory(prefix="dataprep-shard-") as tmpdir:
        local = os.path.join(tmpdir, "shard.array_record")
        write_and_verify(local)
        sha, size = fsutil.copy_local_to(local, dest)
    on_disk = FileSystems.match([dest])[0].metadata_list[0].size_in_bytes
    if on_disk != size:
        raise ShardVerifyError(f"{dest}: copied {size} bytes but the file system reports {on_disk}")
    return sha, size


def segment_length_histogram(lengths: np.ndarray, seq_len: int, bins: int = HIST_BINS) -> list[int]:
    """Counts of segment lengths in ``bins`` equal bins over ``[1, seq_len]`` (the last bin holds seq_len)."""
    width = -(-seq_len // bins)
    idx = np.minimum((np.asarray(lengths, np.int64) - 1) // width, bins - 1)
    return np.bincount(idx, minlength=bins).astype(int).tolist()


class FindDuplicates(beam.DoFn):
    """(dedup bucket, staged document hashes) -> duplicate counts and examples; drop lists (``exact``).

    Reads the bucket's records (key, and ``dataprep.dedup.RECORD``: document hash, source index,
    tokens), groups them by hash (``dataprep.dedup.groups``: keep order is source order in
    the config, then file and line) and emits, per pair (source of a duplicate, source of
    its kept copy), ``("duplicates", source, kept_source, documents, tokens)`` (tagged
    ``stats``), and for its :data:`DUPLICATE_EXAMPLES` groups of the smallest
    ``dataprep.dedup.example_rank`` (most copies first) ``("duplicate_example", hash hex,
    copies, first keys)``. With ``drop`` (``dedup:
    exact``), every document but the kept copy is staged, key only, for its packing bucket:
    main output ``((source, bucket), (DROP, value))``.
    """

    def __init__(self, source_names: Sequence[str], seed: int, num_shards: Mapping[str, int], drop: bool,
                 spill_dir: Optional[str] = None, driver_pid: Optional[int] = None):
        self._names = list(source_names)
        self._seed = seed
        self._num_shards = dict(num_shards)
        self._drop = drop
        self._spill_dir = spill_dir
        self._driver_pid = driver_pid

    def setup(self):
        exit_with_driver(self._driver_pid)
        self._bucket = {s: packing.BucketOf(self._seed, s, self._num_shards[s]) for s in self._names}

    def process(self, element):
        _, values = element
        group = staging.StagedGroup(values)
        keys = group.keys
        records = np.frombuffer(group.payloads(), dedup.RECORD_DTYPE)  # no Python object a record
        found = dedup.groups(keys, records["hash"], records["source"])
        pairs: dict[tuple[int, int], list[int]] = {}
        stager = staging.Stager(self._spill_dir) if self._drop else None
        for members in found:
            kept = int(records["source"][members[0]])
            for m in members[1:]:
                src, tokens = int(records["source"][m]), int(records["tokens"][m])
                count = pairs.setdefault((src, kept), [0, 0])
                count[0] += 1
                count[1] += tokens
                if stager is not None:
                    name = self._names[src]
                    stager.add((name, self._bucket[name](keys[m])), keys[m], b"")
        for (src, kept), (docs, tokens) in sorted(pairs.items()):
            yield pvalue.TaggedOutput(STATS, ("duplicates", self._names[src], self._names[kept], docs, tokens))
        source_of = records["source"]
        shown = heapq.nsmallest(DUPLICATE_EXAMPLES, found, key=lambda members: dedup.example_rank(
            len(members), int(source_of[members[0]]), keys[members[0]]))
        for members in shown:
            yield pvalue.TaggedOutput(STATS, ("duplicate_example", records["hash"][members[0]].tobytes().hex(), len(members),
                                              [keys[m] for m in members[:DUPLICATE_EXAMPLES]]))
        if stager is not None:
            for bucket, value in stager.flush():
                yield bucket, (DROP, value)


class PackAndWriteShard(beam.DoFn):
    """((source, bucket), staged values) -> the shard's entry for the manifest, after writing it.

    Reads the bucket's records (``dataprep.staging.StagedGroup``: keys, ids and lengths;
    tokens stay in their segments or spill files), leaves out the documents of the drop
    lists among the values (``(DROP, value)``, from :class:`FindDuplicates` with ``dedup:
    exact``), cuts each document into ``seq_len`` chunks, packs them within both limits
    (``dataprep.packing.pack_rows``) and writes
    ``<output>/<source>/data-SSSSS-of-NNNNN.array_record``; each row carries its documents'
    keys, chunk indices and own ids (``contract.codec``). Rows are encoded in windows of
    about ``window_tokens`` tokens, the window's chunks gathered in one pass over the spill
    files (sorted by file and offset), so the step holds the bucket's metadata (keys, ids,
    lengths, the sort and the packing: a few hundred bytes a document, docs/dataprep.md
    "Memory") and one window, whatever the size of the bucket's tokens. Emits one
    ``("shard", source, bucket, info)`` where ``info`` has the ``ShardInfo`` fields plus
    ``docs_split``, ``duplicates_dropped``, ``tokens_dropped`` and ``segment_lengths`` (a
    histogram, :func:`segment_length_histogram`).

    Raises:
      ValueError: a drop list names a document that is not in the bucket (a routing bug).
    """

    def __init__(
        self,
        output: str,
        seq_len: int,
        max_segments: int,
        num_shards: Mapping[str, int],
        token_dtype: str,
        heartbeat_dir: Optional[str] = None,
        window_tokens: int = 1 << 22,
        driver_pid: Optional[int] = None,
    ):
        self._driver_pid = driver_pid
        self._output = output
        self._seq_len = seq_len
        self._max_segments = max_segments
        self._num_shards = dict(num_shards)
        self._dtype = token_dtype
        self._heartbeat_dir = heartbeat_dir
        self._window_tokens = window_tokens

    def setup(self):
        exit_with_driver(self._driver_pid)
        self._beat = progress.Heartbeat(self._heartbeat_dir, progress.PACK)

    def process(self, element):
        (source, bucket), values = element
        staged, drops = [], []
        for v in values:  # None: the bucket's marker
            if v is None:
                continue
            if type(v) is tuple and len(v) == 2 and v[0] == DROP:
                drops.append(v[1])
            else:
                staged.append(v)
        group = staging.StagedGroup(staged)
        info = self._pack(source, bucket, group, set(staging.StagedGroup(drops).keys) if drops else set())
        _counter(source, "packed").inc(info["documents"])
        _counter(source, "tokens_packed").inc(info["tokens"])
        _counter(source, "rows").inc(info["records"])
        _counter(source, "shards").inc()
        if info["duplicates_dropped"]:
            _counter(source, "duplicates_dropped").inc(info["duplicates_dropped"])
        self._beat.add(shards=1, rows=info["records"], tokens=info["tokens"])
        self._beat.write()
        yield "shard", source, bucket, info

    def _pack(self, source: str, bucket: int, group: staging.StagedGroup, dropped: set[str]) -> dict[str, Any]:
        seq_len, dtype = self._seq_len, np.dtype(self._dtype)
        width = dtype.itemsize
        keys, ids = group.keys, group.ids
        ntok = group.nbytes // width
        kept = np.arange(len(keys))
        tokens_dropped = 0
        if dropped:
            mask = np.fromiter((k not in dropped for k in keys), bool, len(keys))
            if len(keys) - int(mask.sum()) != len(dropped):
                missing = sorted(dropped - set(keys))[:3]
                raise ValueError(f"{source} bucket {bucket}: drop list names documents not in the bucket: {missing}")
            kept = np.flatnonzero(mask)
            tokens_dropped = int(ntok[~mask].sum())
        record, chunk, start, length = packing.chunk_columns(
            [keys[i] for i in kept.tolist()] if dropped else keys, ntok[kept], seq_len)
        record = kept[record]  # back to the group's record indices
        rows = packing.pack_rows(length.tolist(), seq_len, self._max_segments)

        def records():
            """Encoded rows, their tokens gathered ``window_tokens`` at a time (bounded memory)."""
            frombuffer = np.frombuffer
            per_window = max(1, self._window_tokens // seq_len)  # a row holds at most seq_len tokens
            for w in range(0, len(rows), per_window):
                window = rows[w : w + per_window]
                idx = np.fromiter((i for row in window for i in row), np.int64)
                data = group.gather(record[idx], start[idx] * width, length[idx] * width)
                docs = record[idx].tolist()
                row_keys = [keys[r] for r in docs]
                row_ids = [ids[r] for r in docs] if ids is not None else None
                row_chunks = chunk[idx].tolist()
                k = 0
                for row in window:
                    n = len(row)
                    segs = [frombuffer(d, dtype) for d in data[k : k + n]]
                    yield encode_row(segs, row_keys[k : k + n], row_chunks[k : k + n], seq_len, dtype,
                                     row_ids[k : k + n] if row_ids is not None else None)
                    k += n

        num_shards = self._num_shards[source]
        rel = f"{source}/{shard_name(bucket, num_shards)}"
        sha, size = write_shard(records(), len(rows), fsutil.join(self._output, source, shard_name(bucket, num_shards)))
        total = int(length.sum())
        return {
            "path": rel,
            "records": len(rows),
            "tokens": total,
            "padding": len(rows) * seq_len - total,
            "documents": len(kept),
            "segments": len(length),
            "sha256": sha,
            "bytes": size,
            "docs_split": int((ntok[kept] > seq_len).sum()),
            "duplicates_dropped": len(keys) - len(kept),
            "tokens_dropped": tokens_dropped,
            "segment_lengths": segment_length_histogram(length, seq_len),
        }


class WriteDeadLetters(beam.DoFn):
    """((source, bucket), staged dead letters) -> ``<output>/errors/<source>-SSSSS-of-NNNNN.jsonl``.

    One JSON object a line, in input order (file, then line or row:
    ``contract.hashing.key_position``): ``source``, ``key``, ``reason``, ``detail`` and the
    input as ``raw`` (text) or ``raw_base64``. Emits ``("rejected", source, reason, n)``, for
    each reason the first dead letter by input position, its key and detail
    ``("rejected_example", source, reason, key, detail)``, and ``("errors_file", source,
    path, n)``.
    """

    def __init__(self, output: str, num_shards: Mapping[str, int]):
        self._output = output
        self._num_shards = dict(num_shards)

    def process(self, element):
        (source, bucket), values = element
        group = staging.StagedGroup(values)
        lines = sorted(zip(group.keys, map(bytes, group.gather_all())), key=lambda kl: key_position(kl[0]))
        num_shards = self._num_shards[source]
        name = f"{source}-{bucket:05d}-of-{num_shards:05d}.jsonl"
        fsutil.write_bytes(fsutil.join(self._output, ERRORS_DIR, name), b"".join(line for _, line in lines))
        counts: dict[str, int] = collections.Counter()
        examples: dict[str, tuple[str, str]] = {}
        for key, line in lines:
            letter = json.loads(line)
            counts[letter["reason"]] += 1
            examples.setdefault(letter["reason"], (key, letter["detail"]))
        for reason in sorted(counts):
            yield "rejected", source, reason, counts[reason]
            yield ("rejected_example", source, reason, *examples[reason])
        yield "errors_file", source, f"{ERRORS_DIR}/{name}", len(lines)


def _write_stats(stats: list[tuple], path: str) -> None:
    rows = sorted((json.dumps(list(s), sort_keys=True) for s in stats))
    fsutil.write_bytes(path, ("[\n" + ",\n".join(rows) + "\n]\n").encode("utf-8"))


def dedup_buckets(config: MixtureConfig, num_shards: Mapping[str, int]) -> int:
    """Dedup buckets of a run: one per output shard (the sum over sources), 0 with ``dedup: off``.

    A dedup bucket then holds about as many documents as a shard: bounded by the shard plan,
    not by the corpus (DESIGN.md, "Scale of dataprep").
    """
    if config.dedup is DedupMode.OFF:
        return 0
    return max(1, sum(num_shards[name] for name in config.source_names))


class PackSources(beam.PTransform):
    """The whole packing for a mixture: (source, file) pairs in, shards and stats written.

    Args:
      config: the validated mixture config.
      files: per source, its input files (from ``dataprep.preflight``).
      tokenizer_sha256: the checked sha256 of the tokenizer model.
      token_dtype: ``"uint16"`` or ``"uint32"``.
      output: dataset folder (local or FileSystems URL).
      num_shards: per source, its shard count (``dataprep.sizing.plan_shards``); default:
        ``config.shards_per_source`` (or 1) for every source.
      sizes: per source, the listed byte size of each file (for progress, and checked
        against the file as it is read: :class:`InputChangedError`); default: unknown.
      spill_dir: folder for spill files (``dataprep.staging``); ``None``: tokens go through
        the shuffle inline.
      heartbeat_dir: local folder for progress heartbeats (``dataprep.progress``), or None.
      driver_pid: on local runners, the driver's process id: worker processes exit when it
        is gone (:func:`exit_with_driver`); None on distributed runners.

    Duplicates (``config.dedup``): ``off`` adds nothing; ``report`` and ``exact`` add the text
    hashes, their GroupByKey over :func:`dedup_buckets` buckets and :class:`FindDuplicates`;
    ``exact`` feeds its drop lists into the packing buckets.

    The DoFns of the reading and packing steps are the class attributes ``read_and_tokenize`` and
    ``pack_and_write`` (a test-only subclass, ``dataprep.faults``, replaces them).
    """

    read_and_tokenize = ReadAndTokenize
    pack_and_write = PackAndWriteShard

    def __init__(
        self,
        config: MixtureConfig,
        files: Mapping[str, Sequence[str]],
        tokenizer_sha256: str,
        token_dtype: str,
        output: str,
        num_shards: Optional[Mapping[str, int]] = None,
        sizes: Optional[Mapping[str, Sequence[int]]] = None,
        spill_dir: Optional[str] = None,
        heartbeat_dir: Optional[str] = None,
        driver_pid: Optional[int] = None,
    ):
        super().__init__()
        self._driver_pid = driver_pid
        self._config = config
        self._files = files
        self._sha = tokenizer_sha256
        self._dtype = token_dtype
        self._output = output
        default = config.shards_per_source or 1
        self._num_shards = dict(num_shards) if num_shards is not None else {n: default for n in config.source_names}
        self._sizes = sizes or {n: [-1] * len(files[n]) for n in config.source_names}
        self._spill = spill_dir
        self._beats = heartbeat_dir

    def expand(self, pbegin):
        cfg = self._config
        n = self._num_shards
        # Largest files first: a local runner deals them to its workers in this order, so the
        # big ones start early and spread (the output does not depend on the order).
        files = sorted(
            ((s.name, f, int(b)) for s in cfg.sources for f, b in zip(self._files[s.name], self._sizes[s.name])),
            key=lambda e: (-e[2], e[0], e[1]),
        )
        tok = cfg.tokenizer
        read = (
            pbegin
            | "ListFiles" >> beam.Create(files)  # Create reshuffles (spreads files over workers)
            | "ReadAndTokenize"
            >> beam.ParDo(
                self.read_and_tokenize(
                    {s.name: s for s in cfg.sources}, tok.path, self._sha, tok.add_bos, tok.add_eos,
                    self._dtype, cfg.seed, n, self._spill, self._beats, driver_pid=self._driver_pid,
                    dedup_buckets=dedup_buckets(cfg, n),
                )
            ).with_outputs(REJECTED, STATS, DEDUP, main="staged")
        )
        markers = pbegin | "BucketMarkers" >> beam.Create(
            [((s.name, b), None) for s in cfg.sources for b in range(n[s.name])], reshuffle=False
        )
        to_pack, stats = [read.staged, markers], [read[STATS]]
        if cfg.dedup is not DedupMode.OFF:
            found = (
                read[DEDUP]
                | "GroupByTextHash" >> beam.GroupByKey()
                | "FindDuplicates" >> beam.ParDo(
                    FindDuplicates(cfg.source_names, cfg.seed, n, cfg.dedup is DedupMode.EXACT, self._spill,
                                   driver_pid=self._driver_pid)
                ).with_outputs(STATS, main="drops")
            )
            stats.append(found[STATS])
            if cfg.dedup is DedupMode.EXACT:
                to_pack.append(found.drops)
        shards = (
            to_pack
            | "WithMarkers" >> beam.Flatten()
            | "GroupByBucket" >> beam.GroupByKey()
            | "PackAndWrite"
            >> beam.ParDo(
                self.pack_and_write(self._output, cfg.seq_len, cfg.max_segments_per_row, n, self._dtype, self._beats,
                                  driver_pid=self._driver_pid)
            )
        )
        errors = (
            read[REJECTED]
            | "StageRejected" >> beam.ParDo(StageRejected(cfg.seed, n, self._spill))
            | "GroupRejected" >> beam.GroupByKey()
            | "WriteDeadLetters" >> beam.ParDo(WriteDeadLetters(self._output, n))
        )
        stats_path = fsutil.join(self._output, STATS_NAME)
        return (
            (*stats, shards, errors)
            | "AllStats" >> beam.Flatten()
            # One key and a GroupByKey, not ToList: CombineGlobally's default-value side
            # input adds stages, each a round trip on the local runner. There is always at
            # least one stat (every source has a file, and every bucket a shard).
            | "KeyStats" >> beam.Map(lambda stat: (0, stat))
            | "CollectStats" >> beam.GroupByKey()
            | "WriteStats" >> beam.MapTuple(lambda _, stats: _write_stats(list(stats), stats_path))
        )
