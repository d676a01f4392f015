"""The Beam pipeline: read -> tokenize -> chunk and bucket -> pack and write shards.

Shape (per source; all sources share the transforms, keyed by source name)::

    Create[(source, file)]  (Create reshuffles the files over workers)
      -> ParDo(ReadFiles)        main: (source, key, text)        rejected: dead letters
      -> ParDo(Tokenize)         main: (source, key, tokens)      rejected: empty docs
      -> FlatMap(chunk_and_bucket)  ((source, bucket), (key, chunk, tokens))
      -> Flatten with one empty marker per (source, bucket) -> GroupByKey
      -> ParDo(PackAndWriteShard)   one shard per bucket: <out>/<source>/data-SSSSS-of-NNNNN.array_record
    rejected -> key by (source, bucket) -> GroupByKey -> ParDo(WriteDeadLetters)
    every step's counts -> ToList -> write <out>/_stats.json (read by the driver, which
    reconciles the ledger and writes manifest.json last).

Determinism: buckets come from a stable hash of (seed, source, key); within a bucket the
chunks are sorted by (length desc, key, chunk) before packing and each shard is written to
one fixed name from a local temporary file, so reruns, worker counts and retried bundles
give identical bytes. Nothing depends on the order in which elements arrive.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import tempfile
from typing import Any, Iterable, Mapping, Sequence

import apache_beam as beam
import numpy as np
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindows

from contract.codec import encode_row
from contract.config import MixtureConfig, SourceConfig
from contract.manifest import ERRORS_DIR, shard_name
from dataprep import faults, fsutil, packing, readers, tokenizer

NAMESPACE = "dataprep"
STATS_NAME = "_stats.json"
REJECTED = "rejected"
STATS = "stats"
# group_size:1: every record is one read. zstd:3 is ArrayRecord's default compression,
# spelled out so that the shard bytes do not change if the library's default does.
ARRAY_RECORD_OPTIONS = "group_size:1,zstd:3"


class ShardVerifyError(IOError):
    """A freshly written shard does not reopen cleanly or has the wrong record count."""


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


class ReadFiles(beam.DoFn):
    """(source, path) -> documents (source, key, text); rejected inputs on ``rejected``.

    Also emits ``("read", source, n)`` on ``stats``: the documents read from the file.
    """

    def __init__(self, sources: Mapping[str, SourceConfig]):
        self._sources = dict(sources)

    def process(self, element: tuple[str, str]):
        source_name, path = element
        source = self._sources[source_name]
        n = 0
        for item in readers.read_file(source, path):
            n += 1
            if isinstance(item, readers.Document):
                yield source_name, item.key, item.text
            else:
                _counter(source_name, f"rejected.{item.reason.value}").inc()
                yield pvalue.TaggedOutput(
                    REJECTED, (source_name, item.key, item.reason.value, item.raw, item.detail)
                )
        _counter(source_name, "read").inc(n)
        yield pvalue.TaggedOutput(STATS, ("read", source_name, n))


class Tokenize(beam.DoFn):
    """(source, key, text) -> (source, key, tokens); documents with no token rejected.

    Tokens are ``token_dtype`` arrays (uint16 when the vocabulary fits, else uint32).

    The SentencePiece model is loaded once per worker in ``setup()`` (through FileSystems,
    checked against its sha256). Documents are buffered and encoded in batches of about
    ``batch_chars`` characters with one ``encode(list)`` call; the rest of a bundle is
    encoded in ``finish_bundle``. Emits ``("tokens_in", source, n)`` per bundle on ``stats``.
    """

    def __init__(
        self,
        tokenizer_path: str,
        tokenizer_sha256: str,
        add_bos: bool,
        add_eos: bool,
        token_dtype: str = "uint32",
        batch_chars: int = 1 << 20,
        batch_docs: int = 1024,
    ):
        self._path = tokenizer_path
        self._sha = tokenizer_sha256
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._dtype = token_dtype
        self._batch_chars = batch_chars
        self._batch_docs = batch_docs

    def setup(self):
        self._sp, _ = tokenizer.load(self._path, self._sha)
        self._fault = faults.current_spec()
        self._counters = _Counters()

    def start_bundle(self):
        self._buffer: list[tuple[str, str, str]] = []
        self._chars = 0
        self._tokens_in: dict[str, int] = collections.defaultdict(int)

    def process(self, element: tuple[str, str, str]):
        self._buffer.append(element)
        self._chars += len(element[2])
        if self._chars >= self._batch_chars or len(self._buffer) >= self._batch_docs:
            yield from self._flush()

    def _flush(self) -> Iterable[Any]:
        batch, self._buffer, self._chars = self._buffer, [], 0
        if not batch:
            return
        encoded = tokenizer.encode_batch(
            self._sp, [t for _, _, t in batch], self._add_bos, self._add_eos, self._dtype
        )
        for (source, key, text), tokens in zip(batch, encoded):
            if tokens.size == 0:
                self._counters[source, f"rejected.{readers.Reason.EMPTY.value}"].inc()
                yield pvalue.TaggedOutput(REJECTED, (source, key, readers.Reason.EMPTY.value, text, ""))
            else:
                self._tokens_in[source] += int(tokens.size)
                self._counters[source, "tokens_in"].inc(int(tokens.size))
                yield source, key, tokens

    def finish_bundle(self):
        outputs = list(self._flush())
        for i, out in enumerate(outputs):
            if self._fault and i == len(outputs) // 2:
                faults.maybe_fail(
                    "tokenize.finish_bundle", f"after {i} of {len(outputs)} outputs", self._fault
                )
            if isinstance(out, pvalue.TaggedOutput):
                yield pvalue.TaggedOutput(out.tag, GlobalWindows.windowed_value(out.value))
            else:
                yield GlobalWindows.windowed_value(out)
        for source in sorted(self._tokens_in):
            yield pvalue.TaggedOutput(
                STATS, GlobalWindows.windowed_value(("tokens_in", source, self._tokens_in[source]))
            )


def chunk_and_bucket(element: tuple[str, str, np.ndarray], seed: int, seq_len: int, num_shards: int):
    """(source, key, tokens) -> ((source, bucket), (key, chunk index, chunk tokens)) per chunk."""
    source, key, tokens = element
    bucket = packing.bucket_of(seed, source, key, num_shards)
    for chunk in packing.split_into_chunks(key, tokens, seq_len):
        yield (source, bucket), (chunk.key, chunk.index, chunk.tokens)


def write_shard(
    rows: Sequence[Sequence[packing.Chunk]], seq_len: int, token_dtype: str, dest: str
) -> tuple[str, int]:
    """Writes packed rows as one ArrayRecord shard at ``dest`` (any FileSystems path).

    The shard is written to a local temporary file with options ``group_size:1``, reopened
    and checked (``ok()`` and record count), then copied to ``dest``.

    Returns:
      (sha256 hex, size in bytes) of the shard.

    Raises:
      ShardVerifyError: the local file does not verify, or the copy has a different size.
    """
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    with tempfile.TemporaryDirectory(prefix="dataprep-shard-") as tmp:
        local = os.path.join(tmp, "shard.array_record")
        writer = ArrayRecordWriter(local, ARRAY_RECORD_OPTIONS)
        for row in rows:
            writer.write(
                encode_row(
                    [c.tokens for c in row],
                    [c.key for c in row],
                    [c.index for c in row],
                    seq_len,
                    token_dtype,
                )
            )
        if not writer.ok():
            raise ShardVerifyError(f"ArrayRecord writer for {dest} is not ok")
        writer.close()
        reader = ArrayRecordReader(local)
        try:
            if not reader.ok() or reader.num_records() != len(rows):
                raise ShardVerifyError(
                    f"{dest}: reopened shard has ok()={reader.ok()} and {reader.num_records()} records, "
                    f"expected {len(rows)}"
                )
        finally:
            reader.close()
        sha, size = fsutil.copy_local_to(local, dest)
    on_disk = FileSystems.match([dest])[0].metadata_list[0].size_in_bytes
    if on_disk != size:
        raise ShardVerifyError(f"{dest}: copied {size} bytes but the file system reports {on_disk}")
    return sha, size


class PackAndWriteShard(beam.DoFn):
    """((source, bucket), chunks) -> the shard's entry for the manifest, after writing it.

    Packs with best-fit-decreasing (``dataprep.packing``) and writes
    ``<output>/<source>/data-SSSSS-of-NNNNN.array_record``. Emits one
    ``("shard", source, bucket, info)`` where ``info`` has the ``ShardInfo`` fields plus
    ``docs_split``.
    """

    def __init__(self, output: str, seq_len: int, max_segments: int, num_shards: int, token_dtype: str):
        self._output = output
        self._seq_len = seq_len
        self._max_segments = max_segments
        self._num_shards = num_shards
        self._dtype = token_dtype

    def process(self, element):
        (source, bucket), values = element
        chunks = [packing.Chunk(*v) for v in values if v is not None]  # None: the bucket's marker
        rows = packing.pack_chunks(chunks, self._seq_len, self._max_segments)
        rel = f"{source}/{shard_name(bucket, self._num_shards)}"
        sha, size = write_shard(
            rows,
            self._seq_len,
            self._dtype,
            fsutil.join(self._output, source, shard_name(bucket, self._num_shards)),
        )
        faults.maybe_fail("pack", rel)
        tokens = sum(len(c) for c in chunks)
        info = {
            "path": rel,
            "records": len(rows),
            "tokens": tokens,
            "padding": len(rows) * self._seq_len - tokens,
            "documents": sum(1 for c in chunks if c.index == 0),
            "segments": len(chunks),
            "sha256": sha,
            "bytes": size,
            "docs_split": sum(1 for c in chunks if c.index == 1),
        }
        _counter(source, "packed").inc(info["documents"])
        _counter(source, "tokens_packed").inc(tokens)
        _counter(source, "rows").inc(len(rows))
        yield "shard", source, bucket, info


class WriteDeadLetters(beam.DoFn):
    """((source, bucket), rejected inputs) -> ``<output>/errors/<source>-SSSSS-of-NNNNN.jsonl``.

    One JSON object a line, sorted by key: ``source``, ``key``, ``reason``, ``detail`` and the
    input as ``raw`` (text) or ``raw_base64``. Emits ``("rejected", source, reason, n)``.
    """

    def __init__(self, output: str, num_shards: int):
        self._output = output
        self._num_shards = num_shards

    def process(self, element):
        (source, bucket), values = element
        letters = sorted((dead_letter(*v) for v in values), key=lambda d: (d["key"], d["reason"]))
        name = f"{source}-{bucket:05d}-of-{self._num_shards:05d}.jsonl"
        data = "".join(json.dumps(d, sort_keys=True, ensure_ascii=True) + "\n" for d in letters)
        fsutil.write_bytes(fsutil.join(self._output, ERRORS_DIR, name), data.encode("ascii"))
        counts = collections.Counter(d["reason"] for d in letters)
        for reason in sorted(counts):
            yield "rejected", source, reason, counts[reason]
        yield "errors_file", source, f"{ERRORS_DIR}/{name}", len(letters)


def _write_stats(stats: list[tuple], path: str) -> None:
    rows = sorted((json.dumps(list(s), sort_keys=True) for s in stats))
    fsutil.write_bytes(path, ("[\n" + ",\n".join(rows) + "\n]\n").encode("utf-8"))


class PackSources(beam.PTransform):
    """The whole packing for a mixture: (source, file) pairs in, shards and stats written.

    Args:
      config: the validated mixture config.
      files: per source, its input files (from ``dataprep.preflight``).
      tokenizer_sha256: the checked sha256 of the tokenizer model.
      token_dtype: ``"uint16"`` or ``"uint32"``.
      output: dataset folder (local or FileSystems URL).
    """

    def __init__(
        self,
        config: MixtureConfig,
        files: Mapping[str, Sequence[str]],
        tokenizer_sha256: str,
        token_dtype: str,
        output: str,
    ):
        super().__init__()
        self._config = config
        self._files = files
        self._sha = tokenizer_sha256
        self._dtype = token_dtype
        self._output = output

    def expand(self, pbegin):
        cfg = self._config
        n = cfg.shards_per_source
        pairs = [(s.name, f) for s in cfg.sources for f in self._files[s.name]]
        read = (
            pbegin
            | "ListFiles" >> beam.Create(pairs)  # Create reshuffles (spreads files over workers)
            | "ReadFiles"
            >> beam.ParDo(ReadFiles({s.name: s for s in cfg.sources})).with_outputs(
                REJECTED, STATS, main="documents"
            )
        )
        tok = cfg.tokenizer
        tokenized = read.documents | "Tokenize" >> beam.ParDo(
            Tokenize(tok.path, self._sha, tok.add_bos, tok.add_eos, self._dtype)
        ).with_outputs(REJECTED, STATS, main="tokens")
        chunks = tokenized.tokens | "ChunkAndBucket" >> beam.FlatMap(
            chunk_and_bucket, seed=cfg.seed, seq_len=cfg.seq_len, num_shards=n
        )
        markers = pbegin | "BucketMarkers" >> beam.Create(
            [((s.name, b), None) for s in cfg.sources for b in range(n)], reshuffle=False
        )
        shards = (
            (chunks, markers)
            | "WithMarkers" >> beam.Flatten()
            | "GroupByBucket" >> beam.GroupByKey()
            | "PackAndWrite"
            >> beam.ParDo(
                PackAndWriteShard(self._output, cfg.seq_len, cfg.max_segments_per_row, n, self._dtype)
            )
        )
        seed = cfg.seed
        errors = (
            (read[REJECTED], tokenized[REJECTED])
            | "AllRejected" >> beam.Flatten()
            | "BucketRejected" >> beam.Map(lambda r: ((r[0], packing.bucket_of(seed, r[0], r[1], n)), r))
            | "GroupRejected" >> beam.GroupByKey()
            | "WriteDeadLetters" >> beam.ParDo(WriteDeadLetters(self._output, n))
        )
        stats_path = fsutil.join(self._output, STATS_NAME)
        return (
            (read[STATS], tokenized[STATS], shards, errors)
            | "AllStats" >> beam.Flatten()
            | "CollectStats" >> beam.combiners.ToList()
            | "WriteStats" >> beam.Map(_write_stats, stats_path)
        )
