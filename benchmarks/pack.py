"""Benchmark: the packing pipeline against plain SentencePiece batch encoding, same run.

    python benchmarks/pack.py            # 52 MB corpus (about a minute on 2 cores)
    python benchmarks/pack.py --mb 100   # a larger corpus
    python benchmarks/pack.py --quick    # ~3 MB, under a minute

Corpus: real text every machine has, the Python standard library's modules (code) and
``pydoc_data.topics`` (prose), written as JSONL documents and repeated until the size is
reached; each repetition is a different deterministic order of the documents (by
``stable_hash64(repetition, name)``), so buckets and rows differ between copies.

Figures (one JSON object on stdout):

* ``encode_tokens_per_s_per_core``: tokens / CPU seconds of ``sp.encode(batch,
  num_threads=1)`` over the same documents in batches of about 1 MB of text (text in memory).
* ``pipeline_tokens_per_s_per_core``: tokens packed / CPU seconds of the process running
  ``dataprep.pack.run`` end to end on the local runner, one in-process worker (read,
  tokenize, pack, write, manifest; all its threads count). CPU seconds, not wall seconds, so
  that other jobs on a shared machine do not move the figure; with ``--workers N > 1`` the
  worker processes' CPU time is not visible here and wall seconds x N are used instead.
  ``speed_ratio_wall`` gives the same ratio from wall seconds.
* Both are timed ``--repeats`` times, interleaved, and the best of each is kept (the
  machine may be shared).
* ``speed_ratio``: pipeline / encode, per core (goal >= 0.5).
* ``fill``: tokens / (rows x seq_len) over all shards (goal >= 0.995 at seq_len 8192).
* ``bytes_per_token_ratio``: shard bytes on disk / (tokens x token width in bytes).
* ``docs_split``: documents longer than seq_len, split into chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import sentencepiece as spm  # noqa: E402
import yaml  # noqa: E402

from contract.hashing import stable_hash64  # noqa: E402
from dataprep import demo, pack, testing  # noqa: E402


def real_documents() -> list[tuple[str, str]]:
    """(name, text) of every stdlib module (no tests) and pydoc topic, sorted by name."""
    import sysconfig

    from pydoc_data.topics import topics

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in demo.stdlib_files(str(root)):
        try:
            docs.append((f"code/{p.relative_to(root)}", p.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    docs += [(f"topic/{k}", topics[k]) for k in sorted(topics)]
    return docs


def build_corpus(folder: pathlib.Path, target_bytes: int, files: int = 8) -> tuple[list[str], int]:
    """Writes ``files`` JSONL files of at least ``target_bytes`` of text; returns (texts, bytes)."""
    docs = [(n, t) for n, t in real_documents() if t.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    outs = [open(folder / f"part-{i:02d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    texts, total, rep, i = [], 0, 0, 0
    while total < target_bytes:
        for name, text in sorted(docs, key=lambda d: stable_hash64(rep, d[0])):
            outs[i % files].write(json.dumps({"id": f"{rep}/{name}", "text": text}) + "\n")
            texts.append(text)
            total += len(text.encode("utf-8"))
            i += 1
            if total >= target_bytes:
                break
        rep += 1
    for f in outs:
        f.close()
    return texts, total


def plain_encode(model: str, texts: list[str], batch_chars: int = 1 << 20) -> tuple[int, float, float]:
    """Returns (tokens incl. one EOS per document, wall s, CPU s) of batch encoding on one thread."""
    sp = spm.SentencePieceProcessor(model_file=model)
    tokens = 0
    start, cpu = time.perf_counter(), time.process_time()
    batch, chars = [], 0
    for t in texts + [None]:
        if t is not None:
            batch.append(t)
            chars += len(t)
        if batch and (t is None or chars >= batch_chars):
            tokens += sum(len(ids) + 1 for ids in sp.encode(batch, num_threads=1))
            batch, chars = [], 0
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~3 MB corpus, under a minute")
    parser.add_argument("--mb", type=float, default=None, help="corpus size in MB (default 52, quick 3)")
    parser.add_argument("--workers", type=int, default=1, help="--direct_num_workers for the pipeline")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=None, help="best of N timings (default 3, quick 1)")
    parser.add_argument("--keep", default=None, help="keep the corpus and dataset in this folder")
    args = parser.parse_args(argv)
    mb = args.mb or (3.0 if args.quick else 52.0)
    tmp = tempfile.TemporaryDirectory(prefix="pack-bench-")
    work = pathlib.Path(args.keep or tmp.name)
    texts, nbytes = build_corpus(work / "corpus", int(mb * 1e6))
    model = work / "tok.model"
    sha = testing.train_small_tokenizer(str(model), vocab_size=1000)
    (work / "mix.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "bench",
                "version": 1,
                "seq_len": args.seq_len,
                "shards_per_source": args.shards,
                "tokenizer": {"path": str(model), "sha256": sha},
                "sources": [{"name": "stdlib", "paths": [str(work / "corpus/*.jsonl")], "format": "jsonl"}],
            }
        )
    )
    repeats = args.repeats or (1 if args.quick else 3)
    out = work / "dataset"
    beam_args = [f"--direct_num_workers={args.workers}"]
    if args.workers > 1:
        beam_args.append("--direct_running_mode=multi_processing")
    enc_s = pipe_s = enc_cpu = pipe_cpu = float("inf")
    for _ in range(repeats):  # interleaved, best of N: the machine is shared
        enc_tokens, s, c = plain_encode(str(model), texts)
        enc_s, enc_cpu = min(enc_s, s), min(enc_cpu, c)
        start, cpu = time.perf_counter(), time.process_time()
        result = pack.run(
            ["--config", str(work / "mix.yaml"), "--output", str(out), "--overwrite", *beam_args],
            print_summary=False,
        )
        pipe_s = min(pipe_s, time.perf_counter() - start)
        pipe_cpu = min(pipe_cpu, time.process_time() - cpu)
    m = result.manifest
    entry = m.sources["stdlib"]
    t = entry.totals()
    width = 2 if m.token_dtype == "uint16" else 4
    if t["tokens"] != enc_tokens:
        print(
            f"warning: pipeline packed {t['tokens']} tokens, plain encoding gave {enc_tokens}",
            file=sys.stderr,
        )
    if args.workers == 1:  # one process: its CPU time is all the pipeline used, whatever the load
        pipe_rate, enc_rate = t["tokens"] / pipe_cpu, enc_tokens / enc_cpu
    else:  # worker processes: their CPU time is not ours to read; count wall x workers
        pipe_rate, enc_rate = t["tokens"] / (pipe_s * args.workers), enc_tokens / enc_s
    report = {
        "corpus_bytes": nbytes,
        "documents": entry.ledger.read,
        "tokens": t["tokens"],
        "seq_len": args.seq_len,
        "rows": t["records"],
        "fill": round(t["tokens"] / (t["records"] * m.seq_len), 6),
        "docs_split": entry.ledger.docs_split,
        "bytes_per_token_ratio": round(t["bytes"] / (t["tokens"] * width), 4),
        "token_dtype": m.token_dtype,
        "workers": args.workers,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "pipeline_seconds": round(pipe_s, 2),
        "encode_seconds": round(enc_s, 2),
        "pipeline_cpu_seconds": round(pipe_cpu, 2),
        "encode_cpu_seconds": round(enc_cpu, 2),
        "speed_ratio_wall": round((t["tokens"] / (pipe_s * args.workers)) / (enc_tokens / enc_s), 4),
        "per_core_basis": "cpu_seconds" if args.workers == 1 else "wall_seconds_x_workers",
        "pipeline_tokens_per_s_per_core": round(pipe_rate),
        "encode_tokens_per_s_per_core": round(enc_rate),
        "speed_ratio": round(pipe_rate / enc_rate, 4),
    }
    print(json.dumps(report, sort_keys=True))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
