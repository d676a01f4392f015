"""Helpers for tests and drills: the tiny model, synthetic batches, a tiny run on synthetic data.

Used by this repository's tests and by ``replay``'s (issue 5): a run config and dataset
that train in seconds on 8 CPU devices.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import yaml

from replay.reference.model import ModelConfig

TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 8, "n_experts": 4, "top_k": 2, "d_ff": 32}


def benchmark_model_config(**overrides: Any) -> ModelConfig:
    """The demo-size model of the cost benchmarks (``benchmarks/fingerprint.py``'s sizes: 3.2 M
    parameters, vocabulary 8000, d_model 128, 2 layers, 8 experts top-2, capacity factor 1.25)."""
    sizes = dict(vocab_size=8000, d_model=128, n_layers=2, n_heads=4, head_dim=32, n_experts=8, top_k=2, d_ff=256,
                 capacity_factor=1.25)
    return ModelConfig(**{**sizes, **overrides})


def tiny_model_config(vocab_size: int = 128, **overrides: Any) -> ModelConfig:
    """The test-size model (about 30k parameters)."""
    return ModelConfig(vocab_size=vocab_size, **{**TINY_MODEL, **overrides})


def packed_batch(
    segments_per_row: Sequence[Sequence[Sequence[int]]], seq_len: int
) -> dict[str, np.ndarray]:
    """A MaxText-keyed batch from explicit documents: row r holds ``segments_per_row[r]``.

    Each document ``d`` (a token list, length >= 2) fills consecutive slots; inputs are
    ``d[:-1]`` and targets ``d[1:]`` (so no target crosses a document), segment ids count
    from 1, positions restart at 0, padding is 0.

    Returns:
      six int32 ``[rows, seq_len]`` arrays.

    Raises:
      ValueError: a row's documents need more than ``seq_len`` slots, or a document is
        shorter than 2 tokens.
    """
    rows = len(segments_per_row)
    out = {k: np.zeros((rows, seq_len), np.int32) for k in (
        "inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")}
    for r, docs in enumerate(segments_per_row):
        at = 0
        for s, doc in enumerate(docs, start=1):
            if len(doc) < 2:
                raise ValueError(f"row {r} document {s}: needs >= 2 tokens, got {len(doc)}")
            n = len(doc) - 1
            if at + n > seq_len:
                raise ValueError(f"row {r}: documents need more than seq_len={seq_len} slots")
            out["inputs"][r, at:at + n] = doc[:-1]
            out["targets"][r, at:at + n] = doc[1:]
            for k in ("inputs_segmentation", "targets_segmentation"):
                out[k][r, at:at + n] = s
            for k in ("inputs_position", "targets_position"):
                out[k][r, at:at + n] = np.arange(n)
            at += n
    return out


def random_batch(seed: int, rows: int, seq_len: int, vocab_size: int, docs_per_row: int = 2) -> dict[str, np.ndarray]:
    """A random packed batch: ``docs_per_row`` documents per row and some padding."""
    rng = np.random.default_rng(seed)
    rows_docs = []
    for _ in range(rows):
        room = seq_len - int(rng.integers(0, seq_len // 4 + 1))
        cuts = sorted(rng.choice(np.arange(3, room - 2), size=docs_per_row - 1, replace=False).tolist())
        bounds = [0, *cuts, room]
        rows_docs.append([rng.integers(1, vocab_size, size=b - a + 1).tolist() for a, b in zip(bounds, bounds[1:])])
    return packed_batch(rows_docs, seq_len)


def write_tiny_run(
    folder: str,
    *,
    seq_len: int = 32,
    global_batch: int = 8,
    vocab_size: int = 128,
    rows: Optional[Mapping[str, int]] = None,
    checkpoint_every: int = 5,
    workers: int = 0,
    skip_windows: Sequence[Sequence[int]] = (),
    phases: Sequence[tuple[int, Mapping[str, float]]] = ((10, {"a": 0.2, "b": 0.8}),),
    mesh: Optional[Mapping[str, int]] = None,
    model: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> str:
    """Writes a synthetic packed dataset (``loader.synthetic``), its mixture YAML and a run config.

    ``extra``: further run config fields (e.g. ``{"canary_every": 5}``), written as given.

    Returns:
      the run config path ``<folder>/run.yaml`` (dataset in ``<folder>/dataset``).
    """
    from loader.synthetic import synthetic_mixture, write_synthetic_dataset

    os.makedirs(folder, exist_ok=True)
    rows = dict(rows or {"a": 200, "b": 100})
    mix = synthetic_mixture({"a": 0.7, "b": 0.3}, seq_len=seq_len, phases=list(phases))
    write_synthetic_dataset(os.path.join(folder, "dataset"), rows, seq_len=seq_len, vocab_size=vocab_size, mixture=mix)
    with open(os.path.join(folder, "mixture.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(mix.to_dict(), f, sort_keys=False)
    cfg = {
        "name": "tiny",
        "mixture": "mixture.yaml",
        "dataset": "dataset",
        "global_batch": global_batch,
        "seed": 0,
        "mesh": dict(mesh or {"data": 4, "expert": 2}),
        "model": dict(model or TINY_MODEL),
        "optimizer": {"learning_rate": 3e-3, "warmup_steps": 5},
        "checkpoint_every": checkpoint_every,
        "skip_windows": [list(w) for w in skip_windows],
        "loader": {"workers": workers, "prefetch": 2},
        "canary": {"step": 0, "seed": 1234},
        **dict(extra or {}),
    }
    path = os.path.join(folder, "run.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path
