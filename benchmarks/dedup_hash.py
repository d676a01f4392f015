"""Benchmark: the duplicate report's text hashing, batch form against the per-document reference, same run.

    python benchmarks/dedup_hash.py            # about 15 s on 2 cores
    python benchmarks/dedup_hash.py --quick    # a smoke test, not a figure

What ``dedup: report`` (the config default) adds to packing is, per document, the hash of its
normalized text (``dataprep.dedup``: NFC, whitespace runs as one space, stripped; xxh3_128).
Both forms run over the same documents, interleaved, best of ``--repeats``, CPU seconds:

* ``reference``: ``dataprep.dedup.text_hash`` one document at a time (``" ".join(text.split())``:
  a Python object a word), what the pipeline did before;
* ``batch``: ``dataprep.dedup.text_hashes`` over batches of about 1 MB of text, the batches
  the pipeline tokenizes (``ReadAndTokenize``), what it does now;
* ``hash_only``: xxh3_128 of the already normalized texts: the part no normalization can save;
  ``hash_only_blake2b``: the same with the hash the report used before 2026-12-07 (blake2b,
  16 bytes, person ``moe-dedup-v1``), for the difference.

Corpora: ``documents``, the corpus of ``benchmarks/pack.py`` (the standard library's modules
and pydoc topics, one document each, 16 KB on average, repeated to ``--mb``) and
``paragraphs`` (its blank-line separated paragraphs, 280 characters on average, the corpus of
``pack.py --paragraphs``).

Figures (one JSON object on stdout), per corpus: ``mb``, ``documents``, ``ns_per_byte`` of each
form, ``cpu_seconds_per_200_mb`` of each (what ``pack.py``'s 200 MB run pays),
``speedup`` = reference / batch, and ``same_digests`` (every digest of the batch form equals
the reference's: the report's findings cannot change). Plus ``load_average`` (1-minute,
before and after).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from dataprep import dedup, demo


def _batches(texts: list[str], batch_chars: int = 1 << 20, batch_docs: int = 1024) -> list[list[str]]:
    """The texts in the pipeline's encode batches (``ReadAndTokenize``'s defaults)."""
    out, cur, n = [], [], 0
    for t in texts:
        cur.append(t)
        n += len(t)
        if n >= batch_chars or len(cur) >= batch_docs:
            out.append(cur)
            cur, n = [], 0
    return out + ([cur] if cur else [])


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(texts: list[str], repeats: int) -> dict:
    nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    batches = _batches(texts)
    normalized = [dedup.normalize(t).encode("utf-8", "surrogatepass") for t in texts]
    ref = [dedup.text_hash(t) for t in texts]
    same = [h for b in batches for h in dedup.text_hashes(b)] == ref
    best = {"reference": float("inf"), "batch": float("inf"), "hash_only": float("inf"),
            "hash_only_blake2b": float("inf")}
    for _ in range(repeats):  # interleaved: the machine may be shared
        best["reference"] = min(best["reference"], _cpu(lambda: [dedup.text_hash(t) for t in texts]))
        best["batch"] = min(best["batch"], _cpu(lambda: [dedup.text_hashes(b) for b in batches]))
        best["hash_only"] = min(best["hash_only"], _cpu(lambda: [dedup.text_hash_of_normalized(d) for d in normalized]))
        best["hash_only_blake2b"] = min(best["hash_only_blake2b"], _cpu(
            lambda: [hashlib.blake2b(d, digest_size=16, person=b"moe-dedup-v1").digest() for d in normalized]))
    return {
        "mb": round(nbytes / 1e6, 2),
        "documents": len(texts),
        "ns_per_byte": {k: round(v / nbytes * 1e9, 3) for k, v in best.items()},
        "cpu_seconds_per_200_mb": {k: round(v / nbytes * 200e6, 3) for k, v in best.items()},
        "speedup": round(best["reference"] / best["batch"], 3),
        "same_digests": same,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one copy of the corpus, one repeat")
    p.add_argument("--mb", type=float, default=40.0, help="MB of text per corpus (default 40)")
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3, quick 1)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    load_before = os.getloadavg()[0]
    docs = [t for _, t in demo.stdlib_documents() if t.strip()]
    paragraphs = [p for t in docs for p in t.split("\n\n") if p.strip()]
    out = {}
    for name, texts in (("documents", docs), ("paragraphs", paragraphs)):
        one = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        copies = 1 if args.quick else max(1, round(args.mb * 1e6 / one))
        out[name] = measure(texts * copies, repeats)
    out["repeats"] = repeats
    out["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
