"""Benchmark: fill of the packing (dataprep.packing.pack_rows) against best fit decreasing, same run.

    python benchmarks/packing.py            # about a minute on 2 cores
    python benchmarks/packing.py --quick    # a smoke test, not a figure (20,000 synthetic documents)
    python benchmarks/packing.py --memory   # also the bytes a document of the packing and dedup steps

Pure packing, no Beam pipeline: each corpus's documents are tokenized (EOS added, as the
demo and shared configs do), cut into ``seq_len`` chunks (only documents longer than
``seq_len`` are split), sorted in packing order and packed as one bucket, at ``--seq-len``
8192 and ``--max-segments`` 256 (the config defaults), by both:

* ``old``: ``packing.best_fit_decreasing``, what the pipeline did before (the reference);
* ``new``: ``packing.pack_rows``, what it does now (best fit decreasing, plus the packings
  that spread small items when the cap bound; the fewest rows win).

Corpora:

* ``synthetic``: ``--docs`` documents (420,000, the size of the paragraph corpus of
  issue 22) with log-normal token counts, median 30, sigma 1.6 (mean about 110):
  ``dataprep.testing.heavy_tailed_token_counts``, the same on every machine.
* ``shared_lines``: real short documents, every non-blank line of ``../shared/corpora``
  (the web pages' lines and the novel's, whose lines are its paragraphs), tokenized with
  ``../shared/tokenizers/en_unigram_1000.model``; left out, with the reason, where
  ``../shared`` is absent.
* ``stdlib_paragraphs``: real short documents every machine has, the blank-line separated
  paragraphs of the standard library's modules and pydoc topics (the corpus of
  ``benchmarks/pack.py --paragraphs``), tokenized with the 1,000-piece unigram model that
  ``benchmarks/pack.py`` trains (``dataprep.testing.train_small_tokenizer``).
* ``benchmark_corpus``: the same modules and topics whole, one document each (the corpus of
  ``benchmarks/pack.py``, one copy): its fill must not drop.

Figures, per corpus (one JSON object on stdout): ``documents``, ``chunks``, ``tokens``,
``median_tokens``, ``mean_tokens``; ``lower_bound_rows`` = ceil(tokens / seq_len) and
``lower_bound_rows_with_cap`` = max(that, ceil(chunks / max_segments)); ``rows_old``,
``rows_new``, ``fill_old``, ``fill_new`` (tokens / (rows x seq_len)), ``fill_at_lower_bound``;
``cap_bound_rows_old`` (rows of best fit decreasing that stopped at the cap with room left);
``seconds_old``, ``seconds_new`` (best of ``--repeats``, CPU seconds of the packing alone)
and ``time_ratio`` = new / old; ``same_rows`` (pack_rows returned best fit's rows). Plus
``load_average`` (1-minute, before and after).

With ``--memory`` (this part imports the pipeline's DoFns, so Beam): what grows with the
number of documents, the ``tracemalloc`` peak per document of one bucket of the synthetic
documents (``--memory-docs``, 200,000; keys like ``web/part-00012.jsonl:123456``) in

* ``pack_step_bytes_per_document``: ``PackAndWriteShard`` packing and writing the bucket
  (keys, lengths, the chunk columns, the packings, a window of rows), beside the bucket's
  staged segments (``segment_bytes_per_document``: the tokens, 2 bytes each, and the
  record headers); ``..._with_ids``: the same with a 45-character id a document;
* ``dedup_step_bytes_per_document``: ``FindDuplicates`` on the same documents' hashes (16 bytes each, text
  hashes here: the step holds the same bytes for token hashes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import sentencepiece as spm

from dataprep import demo, packing, testing

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def token_counts(model: str, texts: list[str]) -> list[int]:
    """Tokens of each text with one EOS appended (``add_eos: true``, ``add_bos: false``)."""
    sp = spm.SentencePieceProcessor(model_file=model)
    return [len(ids) + 1 for ids in sp.encode(texts, num_threads=1)]


def shared_lines() -> list[str]:
    """Every non-blank line of the shared web pages and the shared novel."""
    lines = []
    for path in sorted((SHARED / "corpora" / "web").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                lines += [ln for ln in json.loads(line)["text"].splitlines() if ln.strip()]
    for path in sorted((SHARED / "corpora" / "books").glob("*.txt")):
        lines += [ln for ln in re.split(r"\r?\n", path.read_text(encoding="utf-8")) if ln.strip()]
    return lines


def measure(name: str, counts: list[int], seq_len: int, max_segments: int, repeats: int) -> dict:
    lengths = packing.chunk_lengths(counts, seq_len)
    tokens = sum(lengths)
    timings: dict[str, float] = {}
    rows: dict[str, list] = {}
    for _ in range(repeats):  # interleaved: the machine may be shared
        for label, fn in (("old", packing.best_fit_decreasing), ("new", packing.pack_rows)):
            t0 = time.process_time()
            rows[label] = fn(lengths, seq_len, max_segments)
            dt = time.process_time() - t0
            timings[label] = min(timings.get(label, dt), dt)
    lb = -(-tokens // seq_len)
    lb_cap = packing.lower_bound(tokens, len(lengths), seq_len, max_segments)
    old, new = len(rows["old"]), len(rows["new"])
    capped = sum(1 for r in rows["old"] if len(r) == max_segments and sum(lengths[i] for i in r) < seq_len)
    return {
        "corpus": name,
        "documents": len(counts),
        "chunks": len(lengths),
        "tokens": tokens,
        "median_tokens": statistics.median(counts),
        "mean_tokens": round(tokens / len(counts), 1),
        "lower_bound_rows": lb,
        "lower_bound_rows_with_cap": lb_cap,
        "rows_old": old,
        "rows_new": new,
        "fill_old": round(packing.fill(tokens, old, seq_len), 5),
        "fill_new": round(packing.fill(tokens, new, seq_len), 5),
        "fill_at_lower_bound": round(packing.fill(tokens, lb_cap, seq_len), 5),
        "cap_bound_rows_old": capped,
        "same_rows": rows["old"] == rows["new"],
        "seconds_old": round(timings["old"], 3),
        "seconds_new": round(timings["new"], 3),
        "time_ratio": round(timings["new"] / timings["old"], 2) if timings["old"] else None,
    }


def _traced_peak(fn) -> int:
    """Peak bytes ``tracemalloc`` saw while ``fn()`` ran, above what was allocated before."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak - base


def step_memory(docs: int, seq_len: int, cap: int) -> dict:
    """Bytes a document of the packing and dedup steps on one bucket (module docstring)."""
    import numpy as np

    from dataprep import dedup, pipeline, staging

    counts = testing.heavy_tailed_token_counts(docs, 30, 1.6, seed=0)
    keys = [f"web/part-{i % 64:05d}.jsonl:{i + 1}" for i in range(docs)]
    rng = np.random.default_rng(0)
    out = {"documents": docs}
    with tempfile.TemporaryDirectory(prefix="packing-memory-") as tmp:
        for suffix, with_ids in (("", False), ("_with_ids", True)):
            stager = staging.Stager(None, flush_bytes=1 << 62)
            for i, n in enumerate(counts):
                stager.add(("web", 0), keys[i], rng.integers(0, 30000, n).astype(np.uint16),
                           f"https://example.org/articles/{i:08d}/index.html" if with_ids else "")
            values = [v for _, v in stager.flush()]
            step = pipeline.PackAndWriteShard(tmp, seq_len, cap, {"web": 1}, "uint16")
            step.setup()
            peak = _traced_peak(lambda step=step, values=values: step._pack("web", 0, staging.StagedGroup(values), set()))
            out[f"pack_step_bytes_per_document{suffix}"] = round(peak / docs)
            out[f"segment_bytes_per_document{suffix}"] = round(sum(len(v) for v in values) / docs)
        stager = staging.Stager(None, flush_bytes=1 << 62)
        for i, n in enumerate(counts):  # half the documents duplicate another
            stager.add(0, keys[i], dedup.RECORD.pack(dedup.text_hash(str(i % (docs // 2))), 0, n))
        values = [v for _, v in stager.flush()]
        find = pipeline.FindDuplicates(["web"], 0, {"web": 1}, drop=False)
        find.setup()
        out["dedup_step_bytes_per_document"] = round(_traced_peak(lambda: list(find.process((0, values)))) / docs)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 synthetic documents, one repeat")
    parser.add_argument("--docs", type=int, default=None, help="synthetic documents (default 420,000)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--max-segments", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=None, help="best of N timings (default 3, quick 1)")
    parser.add_argument("--memory", action="store_true", help="also measure the bytes a document of the steps")
    parser.add_argument("--memory-docs", type=int, default=200_000)
    args = parser.parse_args(argv)
    docs = args.docs or (20_000 if args.quick else 420_000)
    repeats = args.repeats or (1 if args.quick else 3)
    seq_len, cap = args.seq_len, args.max_segments
    load_before = os.getloadavg()[0]
    out: dict = {"seq_len": seq_len, "max_segments": cap, "corpora": []}

    synthetic = testing.heavy_tailed_token_counts(docs, 30, 1.6, seed=0)
    out["corpora"].append(measure("synthetic", synthetic, seq_len, cap, repeats))

    model = SHARED / "tokenizers" / "en_unigram_1000.model"
    if model.exists() and (SHARED / "corpora").is_dir():
        out["corpora"].append(measure("shared_lines", token_counts(str(model), shared_lines()), seq_len, cap, repeats))
    else:
        out["skipped"] = {"shared_lines": f"{SHARED} not found (the shared corpora and tokenizer)"}

    with tempfile.TemporaryDirectory(prefix="packing-bench-") as tmp:
        small = os.path.join(tmp, "tok.model")
        testing.train_small_tokenizer(small, vocab_size=1000)
        texts = [t for _, t in demo.stdlib_documents() if t.strip()]
        paragraphs = [p for t in texts for p in t.split("\n\n") if p.strip()]
        out["corpora"].append(measure("stdlib_paragraphs", token_counts(small, paragraphs), seq_len, cap, repeats))
        out["corpora"].append(measure("benchmark_corpus", token_counts(small, texts), seq_len, cap, repeats))
    if args.memory:
        out["memory"] = step_memory(args.memory_docs, seq_len, cap)
    out["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
