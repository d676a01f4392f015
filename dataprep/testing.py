"""Test helpers: an in-memory Beam file system (``memfs://``) and a small tokenizer.

``MemFileSystem`` is a real ``apache_beam.io.filesystem.FileSystem`` subclass: defining it
registers the ``memfs`` scheme with ``FileSystems`` (Beam looks file systems up among the
subclasses of ``FileSystem`` by ``scheme()``), so a pipeline run in this process reads and
writes ``memfs://...`` paths exactly as it would ``gs://...``, with no directories, as on
object stores. Its files live in a class-level dict, so only in-process runners
(``--direct_num_workers=1``) see them.
"""

from __future__ import annotations

import io
import threading
from typing import BinaryIO

from apache_beam.io.filesystem import BeamIOError, CompressedFile, CompressionTypes, FileMetadata, FileSystem

MEMFS_FILES: dict[str, bytes] = {}
_LOCK = threading.Lock()


class _MemWriter(io.BytesIO):
    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def close(self) -> None:
        if not self.closed:
            with _LOCK:
                MEMFS_FILES[self._path] = self.getvalue()
        super().close()


class MemFileSystem(FileSystem):
    """A dict-backed file system for the ``memfs://`` scheme (no directories, like GCS)."""

    @classmethod
    def scheme(cls) -> str:
        return "memfs"

    def join(self, basepath: str, *paths: str) -> str:
        out = basepath.rstrip("/")
        for p in paths:
            out += "/" + p.strip("/")
        return out

    def split(self, path: str) -> tuple[str, str]:
        head, _, tail = path.rstrip("/").rpartition("/")
        return head, tail

    def has_dirs(self) -> bool:
        return False

    def mkdirs(self, path: str) -> None:
        pass

    def _list(self, dir_or_prefix: str):
        with _LOCK:
            items = sorted(MEMFS_FILES.items())
        for path, data in items:
            if path.startswith(dir_or_prefix):
                yield FileMetadata(path, len(data), 0.0)

    def create(
        self,
        path: str,
        mime_type: str = "application/octet-stream",
        compression_type: str = CompressionTypes.AUTO,
    ) -> BinaryIO:
        writer = _MemWriter(path)
        if compression_type == CompressionTypes.AUTO:
            compression_type = CompressionTypes.detect_compression_type(path)
        if compression_type != CompressionTypes.UNCOMPRESSED:
            return CompressedFile(writer, compression_type)
        return writer

    def open(
        self,
        path: str,
        mime_type: str = "application/octet-stream",
        compression_type: str = CompressionTypes.AUTO,
    ) -> BinaryIO:
        with _LOCK:
            if path not in MEMFS_FILES:
                raise BeamIOError(f"memfs: {path} not found", {path: FileNotFoundError(path)})
            data = MEMFS_FILES[path]
        if compression_type == CompressionTypes.AUTO:
            compression_type = CompressionTypes.detect_compression_type(path)
        if compression_type != CompressionTypes.UNCOMPRESSED:
            return CompressedFile(io.BytesIO(data), compression_type)
        return io.BytesIO(data)

    def copy(self, source_file_names, destination_file_names) -> None:
        with _LOCK:
            for s, d in zip(source_file_names, destination_file_names):
                MEMFS_FILES[d] = MEMFS_FILES[s]

    def rename(self, source_file_names, destination_file_names) -> None:
        with _LOCK:
            for s, d in zip(source_file_names, destination_file_names):
                MEMFS_FILES[d] = MEMFS_FILES.pop(s)

    def exists(self, path: str) -> bool:
        with _LOCK:
            return path in MEMFS_FILES

    def size(self, path: str) -> int:
        with _LOCK:
            return len(MEMFS_FILES[path])

    def last_updated(self, path: str) -> float:
        return 0.0

    def checksum(self, path: str) -> str:
        import hashlib

        with _LOCK:
            return hashlib.sha256(MEMFS_FILES[path]).hexdigest()

    def metadata(self, path: str) -> FileMetadata:
        with _LOCK:
            if path not in MEMFS_FILES:
                raise BeamIOError(f"memfs: {path} not found", {path: FileNotFoundError(path)})
            return FileMetadata(path, len(MEMFS_FILES[path]), 0.0)

    def delete(self, paths) -> None:
        with _LOCK:
            for p in paths:
                MEMFS_FILES.pop(p, None)


def pydoc_text(limit_chars: int = 400_000) -> list[str]:
    """Returns real English prose from every Python: ``pydoc_data.topics``, sorted by topic."""
    from pydoc_data.topics import topics

    out, total = [], 0
    for name in sorted(topics):
        out.append(topics[name])
        total += len(topics[name])
        if total >= limit_chars:
            break
    return out


def write_pydoc_jsonl(folder, files: int, limit_chars: int, stem: str = "p") -> list:
    """Writes ``pydoc_text(limit_chars)`` round-robin into ``<folder>/<stem>{i}.jsonl``, one
    ``{"text": ...}`` a line; returns the paths (``pathlib.Path``), in order."""
    import json
    import pathlib

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    texts = pydoc_text(limit_chars)
    paths = [folder / f"{stem}{i}.jsonl" for i in range(files)]
    for i, path in enumerate(paths):
        with open(path, "w", encoding="utf-8") as f:
            for t in texts[i::files]:
                f.write(json.dumps({"text": t}) + "\n")
    return paths


def train_small_tokenizer(path: str, vocab_size: int = 400) -> str:
    """Trains a small unigram SentencePiece model on pydoc prose; returns its sha256.

    Special ids: unk 0, bos 1, eos 2, pad 3; byte fallback on.
    """
    import hashlib

    import sentencepiece as spm

    lines = [ln.strip() for t in pydoc_text(200_000) for ln in t.splitlines() if ln.strip()]
    spm.set_random_generator_seed(0)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    data = model.getvalue()
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def heavy_tailed_token_counts(n: int, median: float, sigma: float, seed: int) -> list[int]:
    """Token counts of ``n`` synthetic documents, log-normal, in document order.

    Document ``i`` has ``max(1, ceil(exp(ln(median) + sigma * z_i)))`` tokens, ``z_i`` the
    standard normal quantile of ``u_i = (stable_hash64(seed, "length", i) + 0.5) / 2**64``
    (no NumPy random stream: the same values on every machine and version). ``sigma`` 1.6
    with median 30 gives a mean of about 110 tokens: the shape of a corpus of paragraphs
    (median 34, mean 122 in the one issue 22 describes). ``dataprep.packing.chunk_lengths``
    cuts them into chunks.
    """
    import math
    import statistics

    from contract.hashing import stable_hash64

    normal = statistics.NormalDist()
    mu = math.log(median)
    return [max(1, math.ceil(math.exp(mu + sigma * normal.inv_cdf((stable_hash64(seed, "length", i) + 0.5) / 2**64))))
            for i in range(n)]
