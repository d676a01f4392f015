"""Synthetic packed datasets: real ArrayRecord shards, real codec, real manifest, every row's origin known.

A dataset to try the loader, the trainer and ``replay`` on without a corpus or a tokenizer, and
the one that ``replay drill --triage`` (``replay.triage_drill``), the benchmarks and the tests
build. Its layout is the one of the dataset contract (``contract.manifest``)::

    <path>/<source>/data-SSSSS-of-NNNNN.array_record   # group_size:1, one encode_row record a row
    <path>/manifest.json                               # ledgers reconcile, sha256 per shard

Every row's tokens are a deterministic function of ``(seed, source, record)``, and the
first three tokens of its first segment say where it came from::

    token:  [1 + source_index, 1 + record // (V - 1), 1 + record % (V - 1), noise ...]

with ``V = vocab_size`` and ``source_index`` the position of the source in
``sorted(sources)``; :func:`row_origin` reads them back, :func:`synthetic_row` regenerates a
row exactly. ``record`` is the source-global record index (shard 0 first). All tokens are
in ``[1, V)``, so token 0 only ever appears as padding.

Use::

    from loader import synthetic
    mix = synthetic.synthetic_mixture({"a": 0.7, "b": 0.3}, seq_len=32)
    synthetic.write_synthetic_dataset("build/synthetic", {"a": 200, "b": 100}, seq_len=32,
                                      vocab_size=128, mixture=mix)

May import: ``contract`` (no loader module: the loader reads it as it reads any dataset).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Mapping, Sequence

import numpy as np

from contract import codec
from contract.config import MixtureConfig, mixture_from_dict
from contract.hashing import derive_seed, document_key
from contract.manifest import MANIFEST_NAME, Ledger, Manifest, ShardInfo, SourceEntry, shard_name

SYNTHETIC_RELPATH = "synthetic.jsonl"


def synthetic_tokenizer_sha256(vocab_size: int) -> str:
    """The tokenizer sha256 recorded in synthetic manifests (no real model file exists)."""
    return hashlib.sha256(f"synthetic-tokenizer:{vocab_size}".encode()).hexdigest()


def synthetic_mixture(
    weights: Mapping[str, float],
    *,
    seq_len: int = 16,
    seed: int = 0,
    phases: Sequence[tuple[int, Mapping[str, float]]] = (),
    shards_per_source: int = 1,
    name: str = "synthetic",
    version: int = 1,
    tokenizer_sha256: str | None = None,
    root: str = "/nonexistent/synthetic-inputs",
) -> MixtureConfig:
    """Returns a validated :class:`MixtureConfig` naming ``weights``' sources.

    Args:
      weights: source name -> weight of the first phase (step 0), each >= 0.
      seq_len: slots per row; must match the dataset's.
      seed: the mixture seed (the loader's shuffle seed comes from ``loader.build(seed=)``).
      phases: ``(from_step, weights)`` pairs of later phases, increasing ``from_step``.
      tokenizer_sha256: pinned tokenizer sha256 (``None``: not pinned).
      root: a fake input folder; never read (the dataset is already packed).

    Raises:
      contract.config.ConfigError: an invalid weight, phase or name.
    """
    tokenizer = {"path": os.path.join(root, "tokenizer.model")}
    if tokenizer_sha256 is not None:
        tokenizer["sha256"] = tokenizer_sha256
    raw = {
        "name": name,
        "version": version,
        "seq_len": seq_len,
        "seed": seed,
        "shards_per_source": shards_per_source,
        "tokenizer": tokenizer,
        "sources": [
            {"name": n, "paths": [f"{root}/{n}/*.jsonl"], "format": "jsonl", "weight": w}
            for n, w in weights.items()
        ],
        "phases": [{"from_step": s, "weights": dict(w)} for s, w in phases],
    }
    return mixture_from_dict(raw)


def _segment_plan(rng: np.random.Generator, seq_len: int) -> list[int]:
    """Segment lengths of one row: 1 to 3 segments, some padding, the first >= 3 tokens."""
    pad = int(rng.integers(0, max(1, seq_len // 4) + 1)) if seq_len > 4 else 0
    total = seq_len - pad
    n_seg = int(rng.integers(1, 4))
    n_seg = max(1, min(n_seg, total // 3))
    if n_seg == 1:
        return [total]
    cuts = np.sort(rng.choice(np.arange(3, total), size=n_seg - 1, replace=False))
    bounds = [0, *cuts.tolist(), total]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    return lengths


def synthetic_row(
    source: str, source_index: int, record: int, *, seq_len: int, vocab_size: int, seed: int
) -> tuple[list[np.ndarray], list[str], list[int]]:
    """Regenerates row ``record`` of ``source``: ``(tokens per segment, doc keys, chunk indices)``.

    Raises:
      ValueError: ``seq_len < 3``, or ``vocab_size`` too small to tag the row
        (needs ``vocab_size - 1 > source_index`` and ``(vocab_size - 1)**2 > record``).
    """
    base = vocab_size - 1
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 for synthetic rows, got {seq_len}")
    if base <= source_index or base * base <= record:
        raise ValueError(
            f"vocab_size {vocab_size} too small to tag source {source_index} record {record}"
        )
    rng = np.random.default_rng(derive_seed(seed, "synthetic", source, record))
    lengths = _segment_plan(rng, seq_len)
    flat = rng.integers(1, vocab_size, size=sum(lengths), dtype=np.int64)
    flat[:3] = [1 + source_index, 1 + record // base, 1 + record % base]
    bounds = np.cumsum(lengths)[:-1]
    segments = np.split(flat, bounds)
    keys = [document_key(source, SYNTHETIC_RELPATH, 1 + 4 * record + k) for k in range(len(lengths))]
    return segments, keys, [0] * len(lengths)


def row_origin(tokens: np.ndarray, source_names: Sequence[str], vocab_size: int) -> tuple[str, int]:
    """Returns ``(source, record)`` of a synthetic row from its first three tokens.

    Args:
      tokens: the row's tokens (stored or dense ``inputs``), at least 3.
      source_names: the dataset's sources (any order; sorted here).
      vocab_size: as given to :func:`write_synthetic_dataset`.
    """
    t = np.asarray(tokens[:3], dtype=np.int64)
    base = vocab_size - 1
    return sorted(source_names)[int(t[0]) - 1], int(t[1] - 1) * base + int(t[2] - 1)


def write_synthetic_dataset(
    path: str,
    sources: Mapping[str, int],
    seq_len: int = 16,
    *,
    shards_per_source: int = 1,
    vocab_size: int = 1000,
    seed: int = 0,
    mixture: MixtureConfig | None = None,
    name: str = "synthetic",
) -> Manifest:
    """Writes a real packed dataset and returns its :class:`Manifest`.

    Args:
      path: dataset folder (created; must not hold a manifest already).
      sources: source name -> rows (records) of that source, each >= 1.
      seq_len: slots per row, >= 3.
      shards_per_source: shards per source, >= 1; a source with fewer rows than shards
        gets empty shards at the end (rows are split as evenly as possible, earlier
        shards one larger).
      vocab_size: token ids are in ``[1, vocab_size)``; uint16 storage when it fits.
      seed: seeds the token content (not the loader's shuffle).
      mixture: the mixture config recorded in the manifest (default: equal weights via
        :func:`synthetic_mixture`).

    Returns:
      The manifest, also written to ``<path>/manifest.json`` (last, as the commit marker).

    Raises:
      ValueError: bad counts, a mixture whose seq_len differs, or ``manifest.json``
        already exists at ``path``.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    if not sources:
        raise ValueError("sources must name at least one source")
    if shards_per_source < 1:
        raise ValueError(f"shards_per_source must be >= 1, got {shards_per_source}")
    for n, rows in sources.items():
        if rows < 1:
            raise ValueError(f"source {n!r}: rows must be >= 1, got {rows}")
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        raise ValueError(f"{path} already holds a {MANIFEST_NAME}")
    if mixture is not None and mixture.seq_len != seq_len:
        raise ValueError(f"mixture seq_len {mixture.seq_len} != dataset seq_len {seq_len}")
    if mixture is None:
        mixture = synthetic_mixture({n: 1.0 for n in sources}, seq_len=seq_len, shards_per_source=shards_per_source)
    dtype = codec.token_dtype_for_vocab(vocab_size)
    names = sorted(sources)
    entries = {}
    for si, src in enumerate(names):
        rows = sources[src]
        os.makedirs(os.path.join(path, src), exist_ok=True)
        per, extra = divmod(rows, shards_per_source)
        record = 0
        shards = []
        for k in range(shards_per_source):
            n_rows = per + (1 if k < extra else 0)
            rel = f"{src}/{shard_name(k, shards_per_source)}"
            full = os.path.join(path, rel)
            writer = ArrayRecordWriter(full, "group_size:1")
            tokens = docs = segs = 0
            for _ in range(n_rows):
                segments, keys, chunks = synthetic_row(
                    src, si, record, seq_len=seq_len, vocab_size=vocab_size, seed=seed
                )
                writer.write(codec.encode_row(segments, keys, chunks, seq_len, dtype))
                t = sum(len(s) for s in segments)
                tokens += t
                docs += len(keys)
                segs += len(keys)
                record += 1
            writer.close()
            with open(full, "rb") as f:
                data = f.read()
            shards.append(
                ShardInfo(
                    path=rel, records=n_rows, tokens=tokens, padding=n_rows * seq_len - tokens,
                    documents=docs, segments=segs, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
                )
            )
        docs = sum(s.documents for s in shards)
        toks = sum(s.tokens for s in shards)
        ledger = Ledger(read=docs, packed=docs, rejected={}, tokens_in=toks, tokens_packed=toks, docs_split=0)
        entries[src] = SourceEntry(tuple(shards), ledger)
    manifest = Manifest(
        name=name,
        version=mixture.version,
        record_format_version=codec.FORMAT_VERSION,
        config=mixture.to_dict(),
        config_sha256=mixture.sha256(),
        tokenizer={
            "sha256": mixture.tokenizer.sha256 or synthetic_tokenizer_sha256(vocab_size),
            "vocab_size": vocab_size, "bos_id": -1, "eos_id": 1, "pad_id": 0, "unk_id": 0,
            "add_bos": False, "add_eos": True,
        },
        seq_len=seq_len,
        token_dtype=dtype.name,
        sources=entries,
        tools={"generator": "loader.synthetic"},
    )
    problems = manifest.problems()
    if problems:  # our own bug, not the caller's input
        raise RuntimeError(f"synthetic manifest does not reconcile: {problems}")
    with open(os.path.join(path, MANIFEST_NAME), "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
    return manifest
