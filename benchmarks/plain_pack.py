"""The plain reference for benchmarks/pack.py: tokenize and cut into rows with no Beam.

    python benchmarks/plain_pack.py --inputs 'corpus/*.jsonl' --model tok.model --out plain/ --processes 2

A ``multiprocessing.Pool`` takes one input file a task. Each task reads the JSONL lines,
encodes their ``text`` with SentencePiece in batches of about 1 MB (ids as NumPy arrays,
one EOS appended), concatenates the tokens and cuts them into ``seq_len`` rows, and writes
the rows (raw uint16 bytes) to one ArrayRecord file per input with the pipeline's options
(``group_size:1,zstd:3``). No document boundaries, keys, packing, ledger or manifest: the
least work that turns the same text into rows. Prints one JSON object: tokens, rows, wall
and CPU seconds (this process and its workers), peak RSS of the largest process.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import time
from multiprocessing import Pool

import numpy as np
import sentencepiece as spm
from array_record.python.array_record_module import ArrayRecordWriter

_SP = None


def _init(model: str) -> None:
    global _SP
    _SP = spm.SentencePieceProcessor(model_file=model)


def pack_file(task: tuple[str, str, int]) -> tuple[int, int]:
    """Encodes, concatenates and cuts one JSONL file; returns (tokens, rows)."""
    path, out, seq_len = task
    eos, parts, batch, chars = _SP.eos_id(), [], [], 0

    def flush():
        for ids in _SP.encode(batch, num_threads=1, return_type="numpy"):
            parts.append(ids.astype(np.uint16))
            parts.append(np.array([eos], np.uint16))

    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                batch.append(json.loads(line)["text"])
                chars += len(batch[-1])
                if chars >= 1 << 20:
                    flush()
                    batch, chars = [], 0
    if batch:
        flush()
    tokens = np.concatenate(parts)
    writer = ArrayRecordWriter(out, "group_size:1,zstd:3")
    rows = 0
    for start in range(0, len(tokens), seq_len):
        writer.write(tokens[start : start + seq_len].tobytes())
        rows += 1
    writer.close()
    return len(tokens), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", required=True, help="glob of JSONL files with a 'text' field")
    parser.add_argument("--model", required=True, help="SentencePiece model")
    parser.add_argument("--out", required=True, help="folder for the ArrayRecord files")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    files = sorted(glob.glob(args.inputs))
    os.makedirs(args.out, exist_ok=True)
    tasks = [(f, os.path.join(args.out, os.path.basename(f) + ".array_record"), args.seq_len) for f in files]
    start, cpu = time.perf_counter(), time.process_time()
    with Pool(args.processes, initializer=_init, initargs=(args.model,)) as pool:
        results = pool.map(pack_file, tasks, chunksize=1)
        pool.close()
        pool.join()
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({
        "files": len(files),
        "processes": args.processes,
        "tokens": sum(t for t, _ in results),
        "rows": sum(r for _, r in results),
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(time.process_time() - cpu + children.ru_utime + children.ru_stime, 3),
        "peak_rss_mb_largest_process": round(children.ru_maxrss / 1024, 1),
    }, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
