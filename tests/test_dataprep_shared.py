"""Real corpora from ../shared (skipped where absent): web JSONL.gz and a book, seq_len 8192."""

import json
import pathlib

import numpy as np
import pytest
import sentencepiece as spm
from array_record.python.array_record_module import ArrayRecordReader

from contract.codec import decode_row
from contract.config import load_mixture
from contract.manifest import Manifest
from dataprep import pack

REPO = pathlib.Path(__file__).resolve().parents[1]
SEQ_LEN = 8192


@pytest.fixture(scope="module")
def packed(shared_dir, tmp_path_factory):
    """Packs the committed configs/mixtures/shared.yaml (its paths point at ../shared)."""
    config = REPO / "configs/mixtures/shared.yaml"
    assert load_mixture(str(config)).tokenizer.path == str(shared_dir / "tokenizers/en_unigram_1000.model")
    out = tmp_path_factory.mktemp("shared") / "ds"
    result = pack.run(["--config", str(config), "--output", str(out)], print_summary=False)
    sp = spm.SentencePieceProcessor(model_file=str(shared_dir / "tokenizers/en_unigram_1000.model"))
    return out, result.manifest, sp


def _documents(out, manifest):
    """key -> list of (chunk index, tokens) read back from every shard."""
    docs = {}
    for entry in manifest.sources.values():
        for shard in entry.shards:
            reader = ArrayRecordReader(str(out / shard.path))
            assert reader.ok() and reader.num_records() == shard.records
            for rec in reader.read_all():
                row = decode_row(rec)
                assert row.seq_len == SEQ_LEN and row.num_tokens <= SEQ_LEN
                for key, c, seg in zip(row.doc_keys, row.chunk_indices, row.segments()):
                    docs.setdefault(key, []).append((int(c), seg))
            reader.close()
    return docs


def test_ledger_reconciles_and_nothing_is_lost(packed, shared_dir):
    out, m, _ = packed
    assert Manifest.from_json((out / "manifest.json").read_text()).problems() == []
    web, books = m.sources["web"].ledger, m.sources["books"].ledger
    import gzip

    lines = sum(
        1
        for p in sorted((shared_dir / "corpora/web").glob("*.jsonl.gz"))
        for line in gzip.open(p)
        if line.strip()
    )
    assert web.read == lines == web.packed and web.rejected == {}
    assert books.read == books.packed == 1 and books.docs_split == 1
    assert web.tokens_in == web.tokens_packed and books.tokens_in == books.tokens_packed
    assert m.token_dtype == "uint16" and m.tokenizer["vocab_size"] == 1000


def test_long_web_document_is_split_and_every_segment_decodes(packed, shared_dir):
    out, m, sp = packed
    docs = _documents(out, m)
    texts = {}
    import gzip

    for p in sorted((shared_dir / "corpora/web").glob("*.jsonl.gz")):
        for lineno, line in enumerate(gzip.open(p), start=1):
            texts[f"web/{p.name}:{lineno}"] = json.loads(line)["text"]
    # "utf-8-sig": the file starts with a byte order mark, which is not text (readers drop it)
    texts["books/botchan.txt:0"] = (shared_dir / "corpora/books/botchan.txt").read_bytes().decode("utf-8-sig")
    assert set(docs) == set(texts)
    longest = max(texts, key=lambda k: len(texts[k]) if k.startswith("web/") else 0)
    assert len(texts[longest]) > 60_000 and len(docs[longest]) > 1  # the 65 KB document is split
    split = 0
    for key, parts in docs.items():
        parts.sort()
        assert [c for c, _ in parts] == list(range(len(parts)))
        assert all(len(seg) == SEQ_LEN for _, seg in parts[:-1])
        tokens = np.concatenate([seg for _, seg in parts]).tolist()
        assert tokens[-1] == sp.eos_id() and sp.eos_id() not in tokens[:-1]
        assert sp.decode(tokens[:-1]) == sp.decode(sp.encode(texts[key]))
        split += len(parts) > 1
    assert split == sum(e.ledger.docs_split for e in m.sources.values())


def test_each_segment_decodes_on_its_own(packed):
    """decode(tokens of one segment) is a piece of the document's normalized text."""
    out, m, sp = packed
    docs = _documents(out, m)
    for parts in docs.values():
        parts.sort()
        if len(parts) == 1:
            continue
        whole = sp.decode(np.concatenate([seg for _, seg in parts]).tolist()[:-1])
        for _, seg in parts:
            piece = sp.decode([t for t in seg.tolist() if t != sp.eos_id()]).strip()
            assert piece[:50] in whole
