"""What a user's own corpus needs (issue 22): exact duplicates (dataprep.dedup, FindDuplicates,
dedup: report | exact), document ids carried from the input to the packed rows and the loader,
and the epochs of each source in a planned run, at pack time and from the loader."""

import json
import pathlib

import apache_beam as beam
import numpy as np
import pytest
import sentencepiece as spm
import yaml
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to
from array_record.python.array_record_module import ArrayRecordReader
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.codec import decode_row
from contract.hashing import key_position
from contract.manifest import Manifest
from dataprep import dedup, pack, pipeline, staging, summary, testing

RUNNER = ["--runner=FnApiRunner"]


def test_normalized_text_and_its_hash_are_pinned():
    assert dedup.normalize("  Call me\tIshmael.\r\n\n") == "Call me Ishmael."
    assert dedup.normalize("Cafe\u0301") == "Caf\u00e9"  # NFC
    assert dedup.text_hash("Call me Ishmael.") == dedup.text_hash(" Call  me\nIshmael. ")
    assert dedup.text_hash("Call me Ishmael.") != dedup.text_hash("call me Ishmael.")  # case is kept
    # pinned: a change to the normalization or the hash changes every duplicate report
    # (xxh3_128 of b"Call me Ishmael.", canonical big-endian; it was blake2b "4f26d467...", bucket 1, before
    # 2026-12-07: the groups are the same, the hex and buckets are not)
    assert dedup.text_hash("Call me Ishmael.").hex() == "fb94ff7358ed06d2674ca85d64e9c2e9"
    assert dedup.dedup_bucket(dedup.text_hash("Call me Ishmael."), 7) == 4


def test_token_hash_is_pinned_and_independent_of_byte_order_and_strides():
    ids = np.array([1, 500, 2], np.uint16)
    # pinned: xxh3_128 of the little-endian bytes 01 00 f4 01 02 00, seed TOKEN_HASH_SEED
    assert dedup.token_hash(ids).hex() == "0d174558f5939121694377dde972bd42"
    assert dedup.token_hash(ids.astype(">u2")) == dedup.token_hash(ids)
    assert dedup.token_hash(np.array([1, 9, 500, 9, 2], np.uint16)[::2]) == dedup.token_hash(ids)
    # the seed keeps ids apart from a text of the same bytes; the width is part of the ids
    assert dedup.token_hash(ids) != dedup.text_hash_of_normalized(ids.tobytes())
    assert dedup.token_hash(ids.astype(np.uint32)) != dedup.token_hash(ids)


_IDS = st.lists(st.integers(0, 6), max_size=6).map(lambda v: np.array(v, np.uint16))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "a ", "b", "\u2603", "\u2602"]), _IDS), max_size=8),
       st.sampled_from([-1, 0, 3]))
def test_document_hashes_take_the_ids_unless_they_hold_the_unknown_id(docs, unk):
    texts, ids = [t for t, _ in docs], [i for _, i in docs]
    want = [dedup.unknown_hash(t, a) if unk >= 0 and unk in a.tolist() else dedup.token_hash(a) for t, a in docs]
    assert dedup.document_hashes(texts, ids, unk) == want
    with pytest.raises(ValueError, match="2 texts but 1 id arrays"):
        dedup.document_hashes(["a", "b"], [np.zeros(1, np.uint16)], 0)


def test_documents_the_tokenizer_reads_alike_are_duplicates_and_unknown_characters_are_not(tmp_path):
    """With the default normalization (nmt_nfkc) whitespace and NFKC variants encode to the same
    ids: duplicates (the docstring's worked example). Without byte fallback two different
    characters the model does not know both read as the unknown id: the ids alone would make
    the two documents duplicates (and dedup: exact would drop one); their texts tell them apart."""
    import io

    lines = [ln.strip() for t in testing.pydoc_text(100_000) for ln in t.splitlines() if ln.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=300,
                                   model_type="unigram", byte_fallback=False, character_coverage=1.0,
                                   num_threads=1, hard_vocab_limit=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())

    def hashes(texts):
        return dedup.document_hashes(texts, [np.array(sp.encode(t) + [sp.eos_id()], np.uint16) for t in texts],
                                     sp.unk_id())

    keys = ["web/a.jsonl:10", "web/a.jsonl:2", "books/m.txt:0", "web/a.jsonl:3", "web/a.jsonl:4"]
    texts = ["Call me Ishmael.", "Call me  Ishmael.\n", "Call me Ishmael.", "Something else.", "Call me \uff29shmael."]
    assert dedup.groups(keys, hashes(texts), [0, 0, 1, 0, 0]) == [[1, 4, 0, 2]]  # U+FF29: fullwidth I, NFKC I
    snow, umbrella = "Snow: \u2603.", "Snow: \u2602."
    assert sp.encode(snow) == sp.encode(umbrella) and sp.unk_id() in sp.encode(snow)
    h = hashes([snow, umbrella, snow + " ", "Snow: \u2603.\n"])
    assert h[0] != h[1] and h[0] == h[2] == h[3]
    # found by a hostile test: the text alone (its normalization) merged texts the model reads apart. With an
    # unknown piece the ids must match too: nmt_nfkc drops a vertical tab (a.b) where the text hash saw a space
    tab, space = "Price list.\x0bTea costs 5\u20ac.", "Price list. Tea costs 5\u20ac."
    assert dedup.text_hash(tab) == dedup.text_hash(space) and sp.encode(tab) != sp.encode(space)
    assert sp.unk_id() in sp.encode(tab)
    h = hashes([tab, space, "Caf\u00e9 \u2603", "Cafe\u0301 \u2603"])
    assert h[0] != h[1] and h[2] == h[3]  # NFC and NFKC agree on the accent: the same ids and text


# Whitespace of every kind str.split() knows, characters that share their UTF-8 lead bytes
# (0xC2, 0xE1-0xE3) without being whitespace, a combining accent (NFC), a lone surrogate,
# control characters that are no whitespace (bytes 0-8, 14-27: the joins that hold one take
# the exact byte ranges instead of max(byte, 32)).
_ALPHABET = (list(dedup.WHITESPACE) + ["\x00", "\x01", "\x08", "\x0e", "\x1b", "\x7f"]
             + list("aZ.0") + ["\u00e0", "\u00c2", "\u20ac", "\u2030", "\u200b", "\u3001", "\u1681", "\u0301",
                                "e\u0301", "\ud800", "\U0001f600", "\u65e5"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_ALPHABET), max_size=12).map("".join), max_size=8))
def test_text_hashes_equal_text_hash_one_by_one(texts):
    """The batch form (normalization on the joined bytes with NumPy) gives the reference's bytes."""
    assert dedup.text_hashes(texts) == [dedup.text_hash(t) for t in texts]


def test_whitespace_is_what_str_split_splits_on():
    assert dedup.WHITESPACE == "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
    assert {c for lo, hi in dedup._ASCII_RANGES for c in range(lo, hi + 1)} == {
        ord(w) for w in dedup.WHITESPACE if ord(w) < 0x80}


def test_text_hashes_exact_cases():
    texts = ["  Call me\tIshmael.\r\n\n", "", " \u3000\n", "Call me Ishmael.", "Caf\u00e9", "Cafe\u0301",
             "a\u00a0\u2028b", "a b", "\u00e0\u20ac", "x"]
    got = dedup.text_hashes(texts)
    assert got == [dedup.text_hash(t) for t in texts]
    # a control character that is no whitespace anywhere in a join: the same digests (exact byte ranges)
    assert dedup.text_hashes(texts + ["\x00 a\x1b"]) == [dedup.text_hash(t) for t in texts + ["\x00 a\x1b"]]
    assert got[0] == got[3] and got[0].hex() == "fb94ff7358ed06d2674ca85d64e9c2e9"
    assert got[1] == got[2] and got[4] == got[5] and got[6] == got[7] and len(set(got)) == 6
    assert dedup.text_hashes([]) == []


def test_text_hashes_across_joins(monkeypatch):
    """Texts are joined a few hundred thousand characters at a time; with joins of 3 characters,
    every text boundary is also a join boundary, and the digests are the same."""
    texts = ["  Call me\tIshmael.\r\n\n", "", " \u3000\n", "ab", "Cafe\u0301 x", "a\u00a0\u2028b"]
    want = [dedup.text_hash(t) for t in texts]
    monkeypatch.setattr(dedup, "JOIN_CHARS", 3)
    assert dedup.text_hashes(texts) == want


def test_key_position_is_file_order():
    keys = ["s/a.jsonl:10", "s/a.jsonl:2", "s/b.jsonl:1", "s/a.jsonl:file", "s/a.jsonl:9"]
    assert sorted(keys) == ["s/a.jsonl:10", "s/a.jsonl:2", "s/a.jsonl:9", "s/a.jsonl:file", "s/b.jsonl:1"]
    assert sorted(keys, key=key_position) == ["s/a.jsonl:2", "s/a.jsonl:9", "s/a.jsonl:10", "s/a.jsonl:file",
                                              "s/b.jsonl:1"]
    assert key_position("web/dir/x:y.jsonl:3") == ("dir/x:y.jsonl", 0, 3)


def test_normalized_texts_group_in_keep_order():
    keys = ["web/a.jsonl:10", "web/a.jsonl:2", "books/m.txt:0", "web/a.jsonl:3"]
    texts = ["Call me Ishmael.", "Call me  Ishmael.\n", "Call me Ishmael.", "Something else."]
    assert dedup.groups(keys, [dedup.text_hash(t) for t in texts], [0, 0, 1, 0]) == [[1, 0, 2]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.sampled_from(["a", "b", "a ", "\tb", "c"])),
                max_size=40, unique_by=lambda d: (d[0], d[1])))
def test_groups_equal_a_plain_reference(docs):
    keys = [f"s{src}/f.jsonl:{line}" for src, line, _ in docs]
    sources = [src for src, _, _ in docs]
    digests = [dedup.text_hash(t) for _, _, t in docs]
    by_hash = {}
    for i, d in enumerate(digests):
        by_hash.setdefault(d, []).append(i)
    expected = [sorted(m, key=lambda i: (sources[i], docs[i][1])) for _, m in sorted(by_hash.items()) if len(m) > 1]
    assert dedup.groups(keys, digests, sources) == expected


def test_find_duplicates_alone():
    """The DoFn on two staged values of one dedup bucket: counts by (source, kept source), the
    examples, and with drop the drop lists routed to each dropped document's packing bucket."""
    docs = [("web/a.jsonl:2", "x", 0, 5), ("web/a.jsonl:10", "x", 0, 5), ("books/b.txt:0", "x", 1, 7),
            ("books/b.txt:1", "y", 1, 3), ("web/a.jsonl:4", "y", 0, 3), ("web/a.jsonl:5", "z", 0, 1)]
    values = []
    for part in (docs[:3], docs[3:]):
        stager = staging.Stager(None)
        for key, text, src, tokens in part:
            stager.add(0, key, dedup.RECORD.pack(dedup.text_hash(text), src, tokens))
        values += [v for _, v in stager.flush()]
    x, y = dedup.text_hash("x").hex(), dedup.text_hash("y").hex()
    shards = {"web": 3, "books": 2}
    with BeamTestPipeline(argv=RUNNER) as p:
        out = (p | beam.Create([(0, values)])
               | beam.ParDo(pipeline.FindDuplicates(["web", "books"], 0, shards, drop=True)).with_outputs(
                   pipeline.STATS, main="drops"))
        assert_that(out[pipeline.STATS], equal_to([
            ("duplicates", "web", "web", 1, 5), ("duplicates", "books", "web", 2, 10),
            ("duplicate_example", x, 3, ["web/a.jsonl:2", "web/a.jsonl:10", "books/b.txt:0"]),
            ("duplicate_example", y, 2, ["web/a.jsonl:4", "books/b.txt:1"]),
        ]), "stats")
        bucket = {k: pipeline.packing.bucket_of(0, k.split("/")[0], k, shards[k.split("/")[0]])
                  for k in ("web/a.jsonl:10", "books/b.txt:0", "books/b.txt:1")}
        assert_that(out.drops | beam.Map(lambda kv: (kv[0], kv[1][0], sorted(staging.StagedGroup([kv[1][1]]).keys))),
                    equal_to(_expected_drops(bucket)), "drops")


def test_the_examples_are_the_most_copied_groups_whatever_their_hashes():
    """duplicates_report keeps the 5 groups of the smallest example_rank over every bucket's
    examples: most copies, then the kept copy's source (config order) and place in its file."""
    from types import SimpleNamespace

    from contract.config import DedupMode

    config = SimpleNamespace(dedup=DedupMode.REPORT, source_names=["web", "books"])
    found = [  # (hash hex, copies, keys): the hashes in the reverse order of the ranks
        ("f" * 32, 9, ["books/b.txt:0", "books/b.txt:3"]),
        ("e" * 32, 3, ["web/a.jsonl:10", "books/b.txt:1"]),
        ("d" * 32, 3, ["web/a.jsonl:2", "web/a.jsonl:9"]),
        ("c" * 32, 3, ["books/a.txt:1", "books/b.txt:2"]),
        ("b" * 32, 2, ["web/a.jsonl:1", "web/a.jsonl:3"]),
        ("a" * 32, 2, ["web/b.jsonl:1", "web/b.jsonl:2"]),
        ("0" * 32, 2, ["books/a.txt:0", "books/a.txt:5"]),
    ]
    stats = [["duplicate_example", h, c, k] for h, c, k in reversed(found)]
    report = pack.duplicates_report(config, stats)
    assert [e["hash"] for e in report["examples"]] == ["f" * 32, "d" * 32, "e" * 32, "c" * 32, "b" * 32]


def _expected_drops(bucket):
    by = {}
    for key, b in bucket.items():
        by.setdefault((key.split("/")[0], b), []).append(key)
    return [(g, pipeline.DROP, sorted(keys)) for g, keys in by.items()]


# --------------------------------------------------------------------------- end to end

SHARED = [f"Paragraph {i} of the shared text: the same words in both sources, byte for byte." for i in range(10)]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Two sources holding the same 10 documents (the issue's case), one duplicate within "web"
    that differs only in whitespace, and ids (URLs) on "web" only."""
    d = tmp_path_factory.mktemp("twins")
    tok = d / "tok.model"
    sha = testing.train_small_tokenizer(str(tok))
    own = [f"Only on the web, number {i}, with words of its own." for i in range(20)]
    web = own[:5] + SHARED + own[5:] + ["  Only on the web, number 3,\nwith words of its own.  "]
    (d / "web").mkdir()
    with open(d / "web/w.jsonl", "w") as f:
        for i, t in enumerate(web):
            f.write(json.dumps({"url": f"https://example.org/{i}", "text": t}) + "\n")
    (d / "mirror").mkdir()
    with open(d / "mirror/m.jsonl", "w") as f:
        for t in ["A document only the mirror has."] + SHARED:
            f.write(json.dumps({"text": t}) + "\n")
    config = {"name": "twins", "version": 1, "seq_len": 64, "seed": 1, "shards_per_source": 2,
              "tokenizer": {"path": "tok.model", "sha256": sha},
              "sources": [{"name": "web", "paths": ["web/*.jsonl"], "format": "jsonl", "id_field": "url",
                           "weight": 0.5},
                          {"name": "mirror", "paths": ["mirror/*.jsonl"], "format": "jsonl", "weight": 0.5}]}
    for mode in ("report", "exact"):
        (d / f"{mode}.yaml").write_text(yaml.safe_dump({**config, "dedup": mode}))
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    return d, web, lambda text: len(sp.encode(text)) + 1  # tokens with EOS


def _rows(out):
    m = Manifest.from_json((out / "manifest.json").read_text())
    rows = []
    for entry in m.sources.values():
        for shard in entry.shards:
            reader = ArrayRecordReader(str(out / shard.path))
            rows += [decode_row(r) for r in reader.read_all()]
            reader.close()
    return m, rows


def test_duplicates_are_reported_and_all_packed(twins, tmp_path):
    d, web, tokens = twins
    out = tmp_path / "ds"
    result = pack.run(["--config", str(d / "report.yaml"), "--output", str(out)], print_summary=False)
    m, rows = _rows(out)
    shared_tokens = sum(tokens(t) for t in SHARED)
    assert m.duplicates == {
        "mode": "report",
        "normalization": dedup.NORMALIZATION,
        "hash": "xxh3_128-token-ids",
        "documents": 11,
        "tokens": shared_tokens + tokens(web[-1]),
        "by_source": {"web": {"documents": 1, "tokens": tokens(web[-1]), "of": {"web": 1}},
                      "mirror": {"documents": 10, "tokens": shared_tokens, "of": {"web": 10}}},
        "examples": m.duplicates["examples"],
    }
    examples = m.duplicates["examples"]
    # every group has 2 copies: the kept copies' keep order, whatever the hashes (web/w.jsonl:4 is
    # the within-web group, its copy at line 31; lines 6 to 15 the shared text's first copies)
    assert [e["keys"][0] for e in examples] == [f"web/w.jsonl:{n}" for n in (4, 6, 7, 8, 9)]
    # the hash of each kept copy's ids as packed (uint16, EOS added): its token hash
    sp = spm.SentencePieceProcessor(model_file=str(d / "tok.model"))
    assert [e["hash"] for e in examples] == [
        dedup.token_hash(np.array(sp.encode(web[n - 1]) + [sp.eos_id()], np.uint16)).hex() for n in (4, 6, 7, 8, 9)]
    for e in examples:
        assert e["copies"] == 2 and e["keys"][0].startswith("web/") and len(e["keys"]) == 2
    assert {n: (e.ledger.read, e.ledger.packed, e.ledger.duplicates_dropped) for n, e in m.sources.items()} == {
        "web": (31, 31, 0), "mirror": (11, 11, 0)}
    # the closing table says so
    table = summary.summary_table(result.manifest)
    assert [c.header for c in table.columns][4] == "duplicates"
    assert list(table.columns[4].cells) == ["10 (of web)", "1", "11"]  # sources sorted: mirror, web
    # ids: the web's URLs in the rows' provenance, none for the mirror
    ids = {k: i for r in rows for k, i in zip(r.doc_keys, r.doc_ids)}
    assert {k: v for k, v in ids.items() if k.startswith("web/")} == {
        f"web/w.jsonl:{i + 1}": f"https://example.org/{i}" for i in range(31)}
    assert {v for k, v in ids.items() if k.startswith("mirror/")} == {""}


def test_dedup_exact_drops_every_copy_but_the_first(twins, tmp_path):
    import io

    from rich.console import Console

    d, web, tokens = twins
    out = tmp_path / "ds"
    result = pack.run(["--config", str(d / "exact.yaml"), "--output", str(out)], print_summary=False)
    text = io.StringIO()
    summary.print_summary(result, Console(file=text, width=200))
    assert "ledger: documents read = packed + rejected + duplicates dropped, tokens in = tokens packed + tokens " \
           "dropped: reconciled" in text.getvalue()
    assert list(summary.summary_table(result.manifest).columns[4].cells) == ["10 dropped (of web)", "1 dropped",
                                                                              "11 dropped"]
    m, rows = _rows(out)
    assert m.problems() == []
    keys = {k for r in rows for k in r.doc_keys}
    # web line 31 (line 4 again, but for whitespace) and the mirror's 10 copies of web lines 6-15 are left out
    assert keys == {f"web/w.jsonl:{i}" for i in range(1, 31)} | {"mirror/m.jsonl:1"}
    led = {n: e.ledger for n, e in m.sources.items()}
    assert (led["web"].read, led["web"].packed, led["web"].duplicates_dropped, led["web"].tokens_dropped) == (
        31, 30, 1, tokens(web[-1]))
    assert (led["mirror"].read, led["mirror"].packed, led["mirror"].duplicates_dropped) == (11, 1, 10)
    assert led["mirror"].tokens_dropped == sum(tokens(t) for t in SHARED)
    assert led["mirror"].tokens_in == led["mirror"].tokens_packed + led["mirror"].tokens_dropped
    assert m.duplicates["mode"] == "exact" and m.duplicates["documents"] == 11
    # what was dropped repeats nothing in the rows: no "duplicated data" finding (the mirror's 10 dropped
    # copies against its 1 packed document read as a 100% repeated share before 2026-12-07)
    from contract import duplicates as duplicated_data
    assert duplicated_data.find(m) == []
    report_manifest = Manifest.from_dict({**m.to_dict(), "duplicates": {**m.duplicates, "mode": "report"}})
    assert [f.sources for f in duplicated_data.find(report_manifest)] == [("mirror",)]
    # the same bytes from two worker processes
    out2 = tmp_path / "ds2"
    pack.run(["--config", str(d / "exact.yaml"), "--output", str(out2), "--direct_num_workers=2",
              "--direct_running_mode=multi_processing", "--no-report"], print_summary=False)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file() and p.name != "report.png")
    assert files == sorted(p.relative_to(out2) for p in out2.rglob("*") if p.is_file())
    assert all((out / f).read_bytes() == (out2 / f).read_bytes() for f in files)


def test_dedup_off_hashes_nothing(twins, tmp_path):
    d, _, _ = twins
    raw = yaml.safe_load((d / "report.yaml").read_text())
    (d / "off.yaml").write_text(yaml.safe_dump({**raw, "dedup": "off"}))
    out = tmp_path / "ds"
    result = pack.run(["--config", str(d / "off.yaml"), "--output", str(out), "--no-report"], print_summary=False)
    assert result.manifest.duplicates is None and "duplicates" not in json.loads((out / "manifest.json").read_text())
    ref = tmp_path / "ref"
    pack.run(["--config", str(d / "report.yaml"), "--output", str(ref), "--no-report"], print_summary=False)
    shards = sorted(pathlib.Path(p).relative_to(out) for p in out.rglob("*.array_record"))
    assert all((out / s).read_bytes() == (ref / s).read_bytes() for s in shards)  # report drops nothing


def test_the_loader_answers_with_the_users_ids(twins, tmp_path):
    """"Which documents were in step N": the rows the loader reads carry the input's ids."""
    import loader

    d, _, _ = twins
    out = tmp_path / "ds"
    pack.run(["--config", str(d / "report.yaml"), "--output", str(out), "--no-report"], print_summary=False)
    data = loader.build(str(d / "report.yaml"), str(out), global_batch=8)
    seen = {}
    for step in range(4):
        for ref, row in zip(data.rows_at(step), data.read_rows(step)):
            for key, doc_id in zip(row.doc_keys, row.doc_ids):
                seen[key] = doc_id
                if ref.source == "web":
                    assert doc_id == f"https://example.org/{int(key.rsplit(':', 1)[1]) - 1}"
                else:
                    assert doc_id == ""
    assert any(k.startswith("web/") for k in seen)
    # replay inspect answers with them too: in its report, and as a column of its table
    import io

    from rich.console import Console

    from replay import report
    from replay.screen.forensics import inspect_steps

    rep = inspect_steps(data, 0, 4).to_dict()
    docs = [doc for r in rep["rows"] for doc in r["documents"]]
    assert {doc["key"]: doc.get("id", "") for doc in docs} == seen
    assert all(("id" in doc) == doc["key"].startswith("web/") for doc in docs)
    out_text = io.StringIO()
    report.render_inspect(rep, Console(file=out_text, width=200))
    table = out_text.getvalue()
    assert "document id" in table
    assert all(doc["id"] in table for doc in docs if "id" in doc)


def test_pack_prints_the_epochs_of_a_planned_run_and_warns(twins, tmp_path, capsys):
    d, _, _ = twins
    out = tmp_path / "ds"
    result = pack.run(["--config", str(d / "report.yaml"), "--output", str(out), "--no-report",
                       "--train-steps", "100", "--global-batch", "8"], print_summary=False)
    records = {n: e.records for n, e in result.manifest.sources.items()}
    err = capsys.readouterr().err
    # 100 steps x 8 rows x weight 0.5 = 400 rows of each source; an epoch every records / 4 steps
    lines = [f"{n}: {records[n]:,} rows, {400 / records[n]:,.2f} epochs in 100 steps of 8 rows (an epoch every "
             f"{records[n] / 4:,.1f} steps at its highest weight)" for n in ("web", "mirror")]
    assert "pack: epochs of each source in the planned run (100 steps of 8 rows):\n  " + "\n  ".join(lines) in err
    assert [e.epochs for e in result.epochs] == [400 / records["web"], 400 / records["mirror"]]
    # the mirror's duplicated rows have their own warning (test_pack_refuses_duplicated_data_...)
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: ") and not ln.startswith("warning: duplicated")]
    assert warnings == [
        f"warning: source {n!r} repeats {400 / records[n]:,.1f} times in the planned 100 steps (an epoch every "
        f"{records[n] / 4:,.1f} steps), over 4 epochs, beyond which repeated data helps less and less "
        "(Muennighoff et al. 2023); lower its weight, add documents to it, or plan fewer steps"
        for n in ("web", "mirror") if 400 / records[n] > 4]
    assert warnings  # the mirror's few rows repeat


@pytest.mark.parametrize("args, message", [
    (["--global-batch", "8"], "error: --global-batch goes with --train-steps or --train-tokens: give both, to see "
                              "how many epochs of each source the planned run sees\n"),
    (["--train-steps", "5", "--train-tokens", "9", "--global-batch", "8"],
     "error: --train-steps and --train-tokens: give one of them, not both\n"),
    (["--train-tokens", "0", "--global-batch", "8"], "error: --train-tokens: must be an integer >= 1, got 0\n"),
    (["--train-steps", "10", "--global-batch", "8", "--max-epochs", "0"], "error: --max-epochs: must be > 0, got 0.0\n"),
])
def test_a_bad_plan_exits_2_before_any_work(twins, tmp_path, capsys, args, message):
    d, _, _ = twins
    assert pack.main(["--config", str(d / "report.yaml"), "--output", str(tmp_path / "ds"), *args]) == 2
    assert capsys.readouterr().err == message
    assert not (tmp_path / "ds").exists()


def test_pack_refuses_duplicated_data_when_told_and_warns_otherwise(twins, tmp_path, capsys):
    """The mirror repeats 10 of its 11 documents from the web (the duplicate report): over the stated
    fraction. --duplicates refuse: exit 4 and no manifest; the default warns after committing."""
    d, _, _ = twins
    out = tmp_path / "ds"
    assert pack.main(["--config", str(d / "report.yaml"), "--output", str(out), "--no-report", "--quiet",
                      "--duplicates", "refuse"]) == pack.EXIT_LOSS == 4
    err = capsys.readouterr().err
    assert "duplicated data (--duplicates refuse), manifest.json not written" in err and "source 'mirror'" in err
    assert not (out / "manifest.json").exists()
    assert pack.main(["--config", str(d / "report.yaml"), "--output", str(out), "--no-report", "--quiet",
                      "--max-repeated-fraction", "2"]) == 2
    assert pack.main(["--config", str(d / "report.yaml"), "--output", str(out), "--no-report", "--quiet"]) == 0
    assert (out / "manifest.json").exists() and "warning: duplicated data: source 'mirror'" in capsys.readouterr().err


def test_the_loader_counts_the_epochs_exactly_and_warns(twins, tmp_path, caplog):
    import logging

    import loader

    d, _, _ = twins
    out = tmp_path / "ds"
    m = pack.run(["--config", str(d / "report.yaml"), "--output", str(out), "--no-report"],
                 print_summary=False).manifest
    records = {n: e.records for n, e in m.sources.items()}
    with caplog.at_level(logging.INFO, logger="loader"):
        data = loader.build(str(d / "report.yaml"), str(out), global_batch=8, planned_steps=100)
    got = {e.source: e for e in data.epochs(100)}
    # weights 1/2 and 1/2: the interleave alternates, so exactly 400 rows each
    assert {n: e.rows for n, e in got.items()} == {"web": 400.0, "mirror": 400.0}
    assert {n: e.epochs for n, e in got.items()} == {n: 400 / records[n] for n in records}
    # the same as rows_at over the steps, source by source
    drawn = {"web": 0, "mirror": 0}
    for step in range(100):
        for ref in data.rows_at(step):
            drawn[ref.source] += 1
    assert drawn == {"web": 400, "mirror": 400}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # the mirror's documents are copies of the web's (the pack's duplicate report): duplicated data
    assert [w for w in warned if w.startswith("duplicated data")] == [
        f"duplicated data in {out}: " + f.message for f in __import__("contract.duplicates", fromlist=["find"]).find(m)]
    assert any("source 'mirror'" in w and "of its data repeats data packed before it" in w for w in warned)
    warned = [w for w in warned if not w.startswith("duplicated data")]
    assert warned == [f"source {n!r} repeats {400 / records[n]:,.1f} times in the planned 100 steps (an epoch "
                      f"every {records[n] / 4:,.1f} steps), over 4 epochs, beyond which repeated data helps less "
                      "and less (Muennighoff et al. 2023); lower its weight, add documents to it, or plan fewer steps"
                      for n in ("web", "mirror") if 400 / records[n] > 4]
    assert any(r.getMessage().startswith("epochs: web: ") for r in caplog.records)
    # with a skip window, the skipped data steps are not drawn
    skipping = loader.build(str(d / "report.yaml"), str(out), global_batch=8, skip_windows=[(10, 19)])
    assert sum(e.rows for e in skipping.epochs(100)) == 800
    assert {e.source: e.rows for e in skipping.epochs(100)} == {
        n: float(sum(1 for s in range(100) for r in skipping.rows_at(s) if r.source == n)) for n in records}


def test_the_duplicates_cell_names_each_count_when_kept_copies_are_both_within_and_elsewhere():
    dup = {"mode": "report", "by_source": {"books": {"documents": 3, "of": {"web": 2, "books": 1}},
                                           "web": {"documents": 5, "of": {"web": 5}},
                                           "mirror": {"documents": 10, "of": {"web": 10}}}}
    assert summary.duplicates_cell(dup, "books") == "3 (2 of web, 1 within)"  # was "3 (of web)"
    assert summary.duplicates_cell(dup, "web") == "5"
    assert summary.duplicates_cell(dup, "mirror") == "10 (of web)"
    assert summary.duplicates_cell({**dup, "mode": "exact"}, "books") == "3 dropped (2 of web, 1 within)"
    assert summary.duplicates_cell(None, "web") == "-"
