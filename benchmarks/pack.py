"""Benchmark: the packing pipeline against plain SentencePiece encoding and a plain script, same run.

    python benchmarks/pack.py                    # 200 MB of text (about 4 minutes on 2 cores)
    python benchmarks/pack.py --size-mb 1000     # 1 GB
    python benchmarks/pack.py --quick            # 20 MB, under a minute (a smoke test, not a figure)
    python benchmarks/pack.py --tokenizer build/demo/tokenizer.model   # the demo's 8,000 pieces
    python benchmarks/pack.py --paragraphs       # short documents (280 characters on average)
    python benchmarks/pack.py --dedup off        # without the duplicate report (what the pipeline did before it)

Corpus: real text every machine has, the Python standard library's modules (code) and
``pydoc_data.topics`` (prose), written as JSONL documents and repeated until the size is
reached; each repetition is a different deterministic order of the documents (by
``stable_hash64(repetition, name)``), so buckets and rows differ between copies. A second
corpus of a quarter of the size is built the same way, for the memory slope.

Every pipeline run is ``python -m dataprep.pack --no-report`` in a fresh process
(FnApiRunner; seq_len 8192, ``--shards`` shards a source, tokenizer: unigram, 1,000 pieces,
trained on pydoc text); ``report_cpu_seconds`` is what drawing ``report.png`` adds. Its CPU seconds and peak RSS come from ``wait4`` (its own and its waited-for
workers'); the RSS of a process tree is also sampled every 0.1 s. Figures (one JSON object
on stdout):

* ``pipeline_tokens_per_s_per_core``: tokens packed / CPU seconds of the whole 1-worker run
  (start-up, read, tokenize, pack, write, manifest).
* ``encode_tokens_per_s_per_core``: tokens / CPU seconds of plain SentencePiece batch
  encoding of the same documents in memory, ``sp.encode(batch, num_threads=1)`` (its
  default output, Python lists of ids), in batches of about 1 MB of text;
  ``encode_numpy_tokens_per_s_per_core``: the same with ``return_type="numpy"``, the call
  the pipeline makes (no list of ints is built: about 1.45x faster).
* ``speed_ratio``: pipeline / encode, per CPU second (the definition of the issue that set
  the 0.8 goal); ``speed_ratio_vs_numpy_encode``: against the numpy output, a reference
  that does nothing but encode (no reading, JSON, compression or writing).
* ``plain_script_tokens_per_s_per_core``: tokens / CPU seconds of ``benchmarks/plain_pack.py``
  (multiprocessing, encode, concatenate and split, ArrayRecord write; 1 process), and
  ``speed_ratio_vs_plain_script``: pipeline / plain script, per CPU second.
* ``runner_cpu_seconds_2_workers`` / ``worker_cpu_seconds_2_workers``: CPU seconds of the
  runner process and of each worker process of the 2-worker run (``/proc`` sampled).
* ``worker_speedup``: wall seconds of 1 worker (in-process) / 2 workers
  (``--direct_running_mode=multi_processing``), same input; ``worker_speedup_vs_1_process``
  against 1 worker in multi_processing mode too (both then start worker processes);
  ``worker_speedup_2_threads``: 2 workers in ``multi_threading`` mode (one process;
  SentencePiece releases the GIL while it encodes);
  ``worker_speedup_after_startup``: the same with each run's fixed cost taken off (the wall
  seconds of the same command on a 20 KB input: ``startup_wall_seconds`` for 1 worker,
  ``startup_wall_seconds_2_workers`` for 2, which also start the worker processes): the
  speed-up of the part of the run that grows with the input;
  ``byte_identical_1_vs_2_workers``: every shard, dead-letter file and the manifest of the
  1-worker, 2-process and 2-thread runs equal.
* ``peak_rss_mb``: peak RSS of the 1-worker run; ``ram_bytes_per_token``: (peak RSS at the
  full size - at a quarter of it) / (tokens packed at the full size - at a quarter of it).
* ``shuffle_bucket_bytes_per_token``: what the packing step holds for one bucket on the
  shuffle path (``--spill off``, distributed runners), per token: the delivered segments
  plus the step's peak ``tracemalloc`` memory, for the quarter-size corpus as one bucket.
* ``startup_cpu_seconds`` / ``startup_wall_seconds``: the same command on a 20 KB input:
  the fixed cost (imports, building and translating the pipeline, starting the runner).
* ``fill``, ``bytes_per_token_ratio`` (shard bytes on disk / (tokens x token width)),
  ``docs_split``, ``load_average`` (1-minute, before and after).

Timings are best of ``--repeats`` (3; interleaved: the machine may be shared); the ratios of each
repeat on its own are printed too (``worker_speedup_each_repeat``,
``speed_ratio_vs_plain_script_each_repeat``): their spread is the benchmark's noise. Take a lock
around it on a shared machine: ``flock /tmp/bench.lock python benchmarks/pack.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import sentencepiece as spm
import yaml

from contract.hashing import stable_hash64
from contract.manifest import Manifest
from dataprep import demo, testing

REPO = pathlib.Path(__file__).resolve().parents[1]


def build_corpus(
    folder: pathlib.Path, target_bytes: int, files: int = 8, keep_texts: int = 0, paragraphs: bool = False
) -> tuple[list[str], int]:
    """Writes ``files`` JSONL files of at least ``target_bytes`` of text.

    With ``paragraphs``, a document is one blank-line separated paragraph (280 characters
    on average) instead of a whole module or topic (16 KB).

    Returns:
      (the texts of the first ``keep_texts`` bytes or so, total bytes of text written).
    """
    docs = [(n, t) for n, t in demo.stdlib_documents() if t.strip()]
    if paragraphs:
        docs = [(f"{n}#{i}", p) for n, t in docs for i, p in enumerate(t.split("\n\n")) if p.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    outs = [open(folder / f"part-{i:02d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    texts, total, rep, i = [], 0, 0, 0
    while total < target_bytes:
        for name, text in sorted(docs, key=lambda d: stable_hash64(rep, d[0])):
            outs[i % files].write(json.dumps({"id": f"{rep}/{name}", "text": text}) + "\n")
            n = len(text.encode("utf-8"))
            if total < keep_texts:
                texts.append(text)
            total += n
            i += 1
            if total >= target_bytes:
                break
        rep += 1
    for f in outs:
        f.close()
    return texts, total


def plain_encode(model: str, texts: list[str], numpy: bool, batch_chars: int = 1 << 20) -> tuple[int, float]:
    """Returns (tokens incl. one EOS per document, CPU s) of batch encoding on one thread."""
    sp = spm.SentencePieceProcessor(model_file=model)
    kwargs = {"return_type": "numpy"} if numpy else {}
    tokens = 0
    cpu = time.process_time()
    batch, chars = [], 0
    for t in texts + [None]:
        if t is not None:
            batch.append(t)
            chars += len(t)
        if batch and (t is None or chars >= batch_chars):
            tokens += sum(len(ids) + 1 for ids in sp.encode(batch, num_threads=1, **kwargs))
            batch, chars = [], 0
    return tokens, time.process_time() - cpu


def shuffle_bucket_bytes_per_token(model: str, corpus: pathlib.Path, seq_len: int) -> tuple[float, int]:
    """Peak memory of the packing step for one bucket on the shuffle path, per token.

    Stages every document of ``corpus`` inline (``--spill off``, what a distributed runner's
    GroupByKey delivers) into one bucket, then runs ``PackAndWriteShard`` on it under
    ``tracemalloc``. Returns ((delivered segment bytes + peak traced bytes of the step) /
    tokens, tokens): what a worker holds for a bucket, per token.
    """
    import tracemalloc

    from dataprep import pipeline, staging, tokenizer

    sp, _ = tokenizer.load(model)
    stager, values, tokens, batch = staging.Stager(None), [], 0, []
    files = sorted(corpus.glob("*.jsonl"))

    def encode():
        nonlocal tokens
        for key, ids in zip([k for k, _ in batch], tokenizer.encode_batch(sp, [t for _, t in batch], False, True,
                                                                           "uint16")):
            stager.add(("s", 0), key, ids)
            tokens += ids.size

    for f in files:
        for i, line in enumerate(open(f, encoding="utf-8")):
            batch.append((f"s/{f.name}:{i + 1}", json.loads(line)["text"]))
            if len(batch) == 256:
                encode()
                batch = []
                if stager.full():
                    values += [v for _, v in stager.flush()]
    encode()
    values += [v for _, v in stager.flush()]
    delivered = sum(len(v) for v in values)
    with tempfile.TemporaryDirectory() as out:
        dofn = pipeline.PackAndWriteShard(out, seq_len, 256, {"s": 1}, "uint16")
        dofn.setup()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        list(dofn.process((("s", 0), iter(values))))
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    return (delivered + peak) / tokens, tokens


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [p for c in f.read().split() for p in _tree(int(c))]
        except OSError:
            pass
    return out


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (``/proc/<pid>/stat``), 0 when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def measure(cmd: list[str]) -> dict:
    """Runs ``cmd``; returns wall s, CPU s (with its waited-for children), peak RSS (own, and of
    the tree), and the CPU seconds of the process itself and of each child last seen."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_tree = [0.0]
    cpu_by_pid: dict[int, float] = {}
    done = threading.Event()

    def sample():
        while not done.wait(0.1):
            pids = _tree(proc.pid)
            peak_tree[0] = max(peak_tree[0], sum(_rss_mb(p) for p in pids))
            for p in pids:
                cpu_by_pid[p] = max(cpu_by_pid.get(p, 0.0), _cpu_s(p))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "peak_tree_rss_mb": max(peak_tree[0], usage.ru_maxrss / 1024),
        "self_cpu_seconds": cpu_by_pid.get(proc.pid, 0.0),
        "children_cpu_seconds": sorted((v for p, v in cpu_by_pid.items() if p != proc.pid), reverse=True),
        "stdout": out.decode(),
    }


def _config(path: pathlib.Path, corpus: pathlib.Path, model: pathlib.Path, sha: str, seq_len: int, shards: int,
            dedup: str = "report"):
    path.write_text(yaml.safe_dump({
        "name": "bench",
        "version": 1,
        "seq_len": seq_len,
        "shards_per_source": shards,
        "dedup": dedup,
        "tokenizer": {"path": str(model), "sha256": sha},
        "sources": [{"name": "stdlib", "paths": [str(corpus / "*.jsonl")], "format": "jsonl"}],
    }))
    return path


def _pack(config: pathlib.Path, out: pathlib.Path, workers: int = 1, mode: str = "in_memory",
          report: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "dataprep.pack", "--config", str(config), "--output", str(out), "--overwrite",
           "--quiet", f"--direct_num_workers={workers}"] + ([] if report else ["--no-report"])
    return cmd + ([f"--direct_running_mode={mode}"] if mode != "in_memory" else [])


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", "--mb", dest="size_mb", type=float, default=None,
                        help="corpus size in MB of text (default 200; --quick 20)")
    parser.add_argument("--quick", action="store_true", help="20 MB, one repeat: a smoke test, not a figure")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--shards", type=int, default=4, help="shards_per_source of the benchmark config")
    parser.add_argument("--repeats", type=int, default=None, help="best of N timings (default 3, quick 1)")
    parser.add_argument("--keep", default=None, help="keep the corpora and datasets in this folder")
    parser.add_argument("--dedup", choices=("off", "report", "exact"), default="report",
                        help="the benchmark config's dedup (default report, the config default: every document's "
                             "ids hashed and grouped; off: what the pipeline did before duplicates were found)")
    parser.add_argument("--paragraphs", action="store_true",
                        help="short documents: one paragraph each (280 characters on average)")
    parser.add_argument("--tokenizer", default=None,
                        help="a SentencePiece model to use instead of training the 1,000-piece one, e.g. "
                             "build/demo/tokenizer.model (8,000 pieces, after python -m dataprep.demo)")
    args = parser.parse_args(argv)
    mb = args.size_mb or (20.0 if args.quick else 200.0)
    repeats = args.repeats or (1 if args.quick else 3)
    load_before = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory(prefix="pack-bench-")
    work = pathlib.Path(args.keep or tmp.name)
    encode_bytes = int(min(mb, 200) * 1e6)  # the encode references' rate does not depend on size
    texts, nbytes = build_corpus(work / "corpus", int(mb * 1e6), keep_texts=encode_bytes, paragraphs=args.paragraphs)
    _, small_bytes = build_corpus(work / "corpus-small", int(mb * 1e6 / 4), paragraphs=args.paragraphs)
    build_corpus(work / "corpus-tiny", 20_000, files=1)
    if args.tokenizer:
        import hashlib

        model = pathlib.Path(args.tokenizer).resolve()
        sha = hashlib.sha256(model.read_bytes()).hexdigest()
    else:
        model = work / "tok.model"
        sha = testing.train_small_tokenizer(str(model), vocab_size=1000)
    big = _config(work / "mix.yaml", work / "corpus", model, sha, args.seq_len, args.shards, args.dedup)
    small = _config(work / "mix-small.yaml", work / "corpus-small", model, sha, args.seq_len, args.shards, args.dedup)
    tiny = _config(work / "mix-tiny.yaml", work / "corpus-tiny", model, sha, args.seq_len, 1, args.dedup)

    startup = min((measure(_pack(tiny, work / "ds-tiny")) for _ in range(repeats)), key=lambda r: r["cpu"])
    startup2 = min((measure(_pack(tiny, work / "ds-tiny2", 2, "multi_processing")) for _ in range(repeats)),
                   key=lambda r: r["wall"])
    with_report = min((measure(_pack(tiny, work / "ds-tiny", report=True)) for _ in range(repeats)),
                      key=lambda r: r["cpu"])
    small_run = measure(_pack(small, work / "ds-small"))
    one = two = plain = None
    enc_cpu = list_cpu = float("inf")
    each = []  # per interleaved repeat: (1-worker wall, 1-worker CPU, 2-worker wall, plain CPU, plain tokens)
    for _ in range(repeats):  # interleaved, best of N: the machine may be shared
        r1 = measure(_pack(big, work / "ds-1"))
        one = r1 if one is None or r1["wall"] < one["wall"] else one
        one["cpu"] = min(one["cpu"], r1["cpu"])
        r2 = measure(_pack(big, work / "ds-2", 2, "multi_processing"))
        two = r2 if two is None or r2["wall"] < two["wall"] else two
        r3 = measure([sys.executable, "benchmarks/plain_pack.py", "--inputs", str(work / "corpus/*.jsonl"),
                      "--model", str(model), "--out", str(work / "plain"), "--seq-len", str(args.seq_len),
                      "--processes", "1"])
        plain = r3 if plain is None or r3["cpu"] < plain["cpu"] else plain
        each.append((r1["wall"], r1["cpu"], r2["wall"], r3["cpu"], json.loads(r3["stdout"])["tokens"]))
        enc_tokens, c = plain_encode(str(model), texts, numpy=True)
        enc_cpu = min(enc_cpu, c)
    list_tokens, list_cpu = plain_encode(str(model), texts, numpy=False)
    bucket_bpt, bucket_tokens = shuffle_bucket_bytes_per_token(str(model), work / "corpus-small", args.seq_len)
    one_proc = measure(_pack(big, work / "ds-1p", 1, "multi_processing"))
    threads = measure(_pack(big, work / "ds-2t", 2, "multi_threading"))
    plain2 = measure([sys.executable, "benchmarks/plain_pack.py", "--inputs", str(work / "corpus/*.jsonl"),
                      "--model", str(model), "--out", str(work / "plain2"), "--seq-len", str(args.seq_len),
                      "--processes", "2"])

    m = Manifest.from_json((work / "ds-1/manifest.json").read_text())
    m_small = Manifest.from_json((work / "ds-small/manifest.json").read_text())
    entry = m.sources["stdlib"]
    t = entry.totals()
    tokens, small_tokens = t["tokens"], m_small.sources["stdlib"].totals()["tokens"]
    plain_stats = json.loads(plain["stdout"])
    if plain_stats["tokens"] != tokens:
        print(f"warning: pipeline packed {tokens} tokens, the plain script {plain_stats['tokens']}", file=sys.stderr)
    width = 2 if m.token_dtype == "uint16" else 4
    pipe_rate = tokens / one["cpu"]
    numpy_rate, list_rate = enc_tokens / enc_cpu, list_tokens / list_cpu
    plain_rate = plain_stats["tokens"] / plain["cpu"]
    identical = _files(work / "ds-1") == _files(work / "ds-2") == _files(work / "ds-2t")
    report = {
        "corpus_bytes": nbytes,
        "corpus_bytes_small": small_bytes,
        "documents": entry.ledger.read,
        "tokens": tokens,
        "tokens_small": small_tokens,
        "seq_len": args.seq_len,
        "shards": len(entry.shards),
        "rows": t["records"],
        "fill": round(tokens / (t["records"] * m.seq_len), 6),
        "docs_split": entry.ledger.docs_split,
        "bytes_per_token_ratio": round(t["bytes"] / (tokens * width), 4),
        "token_dtype": m.token_dtype,
        "vocab_size": m.tokenizer["vocab_size"],
        "text_bytes_per_token": round(nbytes / tokens, 3),
        "disk_bytes_per_token": round(t["bytes"] / tokens, 4),
        "repeats": repeats,
        "paragraphs": args.paragraphs,
        "dedup": args.dedup,
        "cpu_count": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "pipeline_seconds": round(one["wall"], 2),
        "pipeline_cpu_seconds": round(one["cpu"], 2),
        "pipeline_seconds_2_workers": round(two["wall"], 2),
        "pipeline_cpu_seconds_2_workers": round(two["cpu"], 2),
        "pipeline_seconds_1_worker_process": round(one_proc["wall"], 2),
        "runner_cpu_seconds_2_workers": round(two["self_cpu_seconds"], 2),
        "worker_cpu_seconds_2_workers": [round(c, 2) for c in two["children_cpu_seconds"]],
        "startup_cpu_seconds": round(startup["cpu"], 2),
        "startup_wall_seconds": round(startup["wall"], 2),
        "startup_wall_seconds_2_workers": round(startup2["wall"], 2),
        "worker_speedup_after_startup": round((one["wall"] - startup["wall"]) / (two["wall"] - startup2["wall"]), 3),
        "report_cpu_seconds": round(with_report["cpu"] - startup["cpu"], 2),
        "pipeline_tokens_per_s_per_core": round(pipe_rate),
        "pipeline_tokens_per_s_per_core_after_startup": round(tokens / (one["cpu"] - startup["cpu"])),
        "pipeline_tokens_per_s_wall": round(tokens / one["wall"]),
        "encode_cpu_seconds": round(list_cpu * tokens / list_tokens, 2),
        "encode_tokens_per_s_per_core": round(list_rate),
        "encode_numpy_tokens_per_s_per_core": round(numpy_rate),
        "encode_bytes": encode_bytes if encode_bytes < nbytes else nbytes,
        "speed_ratio": round(pipe_rate / list_rate, 4),
        "speed_ratio_vs_numpy_encode": round(pipe_rate / numpy_rate, 4),
        "plain_script_cpu_seconds": round(plain["cpu"], 2),
        "plain_script_tokens_per_s_per_core": round(plain_rate),
        "plain_script_seconds": round(plain["wall"], 2),
        "plain_script_seconds_2_processes": round(plain2["wall"], 2),
        "plain_script_peak_rss_mb": round(plain["peak_rss_mb"], 1),
        "speed_ratio_vs_plain_script": round(pipe_rate / plain_rate, 4),
        "worker_speedup": round(one["wall"] / two["wall"], 3),
        "worker_speedup_each_repeat": [round(w1 / w2, 3) for w1, _, w2, _, _ in each],
        "speed_ratio_vs_plain_script_each_repeat": [round((tokens / c1) / (pt / cp), 4) for _, c1, _, cp, pt in each],
        "worker_speedup_vs_1_process": round(one_proc["wall"] / two["wall"], 3),
        "worker_speedup_2_threads": round(one["wall"] / threads["wall"], 3),
        "pipeline_seconds_2_threads": round(threads["wall"], 2),
        "plain_script_speedup_2_processes": round(plain["wall"] / plain2["wall"], 3),
        "byte_identical_1_vs_2_workers": identical,
        "peak_rss_mb": round(one["peak_rss_mb"], 1),
        "peak_rss_mb_small": round(small_run["peak_rss_mb"], 1),
        "peak_rss_mb_startup": round(startup["peak_rss_mb"], 1),
        "peak_rss_mb_2_workers_tree": round(two["peak_tree_rss_mb"], 1),
        "shuffle_bucket_bytes_per_token": round(bucket_bpt, 3),
        "shuffle_bucket_tokens": bucket_tokens,
        "ram_bytes_per_token": round((one["peak_rss_mb"] - small_run["peak_rss_mb"]) * 2**20 / (tokens - small_tokens), 4),
    }
    print(json.dumps(report, sort_keys=True))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
