"""Benchmark: the duplicate report's document hash (of the token ids) against hashing the normalized text, same run.

    python benchmarks/dedup_hash.py            # about 15 s on 2 cores
    python benchmarks/dedup_hash.py --quick    # a smoke test, not a figure

What ``dedup: report`` (the config default) adds to packing is, per document, its document
hash (``dataprep.dedup``): xxh3_128 of the token ids the pipeline already holds (where the ids
hold the unknown id, of the ids and the normalized text together; this benchmark's tokenizer has
byte fallback, so none do here). Every form runs over the same documents,
interleaved, best of ``--repeats``, CPU seconds (the encoding itself is not timed: the
pipeline encodes every document with the report on or off):

* ``document``: ``dataprep.dedup.document_hashes`` over the pipeline's encode batches
  (``ReadAndTokenize``: about 1 MB of text), what the pipeline does now;
* ``text_batch``: ``dataprep.dedup.text_hashes`` over the same batches: NFC, whitespace runs
  as one space, stripped, with NumPy on the joined bytes; what it did on 2026-12-07;
* ``text_reference``: ``dataprep.dedup.text_hash`` one document at a time (``" ".join(text.split())``:
  a Python object a word), what it did before;
* ``hash_only``: xxh3_128 of the already normalized texts: the part of the text forms no
  normalization can save; ``hash_only_blake2b``: the same with the hash the report used
  before 2026-12-07 (blake2b, 16 bytes, person ``moe-dedup-v1``), for the difference.

Tokenizer: unigram, 1,000 pieces, trained on pydoc text with byte fallback (``pack.py``'s).
Corpora: ``documents``, the corpus of ``benchmarks/pack.py`` (the standard library's modules
and pydoc topics, one document each, 16 KB on average, repeated to ``--mb``) and
``paragraphs`` (its blank-line separated paragraphs, 280 characters on average, the corpus of
``pack.py --paragraphs``).

Figures (one JSON object on stdout), per corpus: ``mb``, ``documents``, ``ns_per_byte`` of each
form (per byte of text), ``cpu_seconds_per_200_mb`` of each (what ``pack.py``'s 200 MB run
pays), ``speedup_vs_text_batch`` = text_batch / document, ``same_text_digests`` (the batch
text form gives the reference's bytes) and ``same_groups`` (the groups of the document
hashes are the groups of the text hashes: the report's findings on this corpus are
unchanged). Plus ``load_average`` (1-minute, before and after).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import sentencepiece as spm

from dataprep import dedup, demo, testing, tokenizer


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


def measure(texts: list[str], sp: spm.SentencePieceProcessor, repeats: int) -> dict:
    nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    batches = _batches(texts)
    dtype = np.uint16 if sp.get_piece_size() <= 1 << 16 else np.uint32
    ids = [tokenizer.encode_batch(sp, b, False, True, dtype) for b in batches]  # as the pipeline stages them
    unk = sp.unk_id()
    normalized = [dedup.normalize(t).encode("utf-8", "surrogatepass") for t in texts]
    ref = [dedup.text_hash(t) for t in texts]
    same = [h for b in batches for h in dedup.text_hashes(b)] == ref
    docs = [h for b, i in zip(batches, ids) for h in dedup.document_hashes(b, i, unk)]
    keys = [f"s/f.jsonl:{n}" for n in range(len(texts))]
    same_groups = sorted(dedup.groups(keys, docs, [0] * len(texts))) == sorted(dedup.groups(keys, ref, [0] * len(texts)))
    forms = {
        "document": lambda: [dedup.document_hashes(b, i, unk) for b, i in zip(batches, ids)],
        "text_batch": lambda: [dedup.text_hashes(b) for b in batches],
        "text_reference": lambda: [dedup.text_hash(t) for t in texts],
        "hash_only": lambda: [dedup.text_hash_of_normalized(d) for d in normalized],
        "hash_only_blake2b": lambda: [hashlib.blake2b(d, digest_size=16, person=b"moe-dedup-v1").digest()
                                      for d in normalized],
    }
    best = {k: float("inf") for k in forms}
    for _ in range(repeats):  # interleaved: the machine may be shared
        for k, fn in forms.items():
            best[k] = min(best[k], _cpu(fn))
    return {
        "mb": round(nbytes / 1e6, 2),
        "documents": len(texts),
        "ns_per_byte": {k: round(v / nbytes * 1e9, 3) for k, v in best.items()},
        "cpu_seconds_per_200_mb": {k: round(v / nbytes * 200e6, 3) for k, v in best.items()},
        "speedup_vs_text_batch": round(best["text_batch"] / best["document"], 2),
        "same_text_digests": same,
        "same_groups": same_groups,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one copy of the corpus, one repeat")
    p.add_argument("--mb", type=float, default=40.0, help="MB of text per corpus (default 40)")
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3, quick 1)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        testing.train_small_tokenizer(f"{tmp}/tok.model", vocab_size=1000)
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/tok.model")
    docs = [t for _, t in demo.stdlib_documents() if t.strip()]
    paragraphs = [p for t in docs for p in t.split("\n\n") if p.strip()]
    out = {}
    for name, texts in (("documents", docs), ("paragraphs", paragraphs)):
        one = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        copies = 1 if args.quick else max(1, round(args.mb * 1e6 / one))
        out[name] = measure(texts * copies, sp, repeats)
    out["repeats"] = repeats
    out["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
