"""End-to-end runs of the Beam packing pipeline (dataprep.pack.run) on temporary inputs.

Byte-identical output across worker counts and retried bundles, every input format, a
non-local Beam file system, config mistakes reported before any work, the ledger.
"""

import gzip
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import zstandard
from array_record.python.array_record_module import ArrayRecordReader

from contract.codec import decode_row
from contract.config import ConfigError, mixture_from_dict
from contract.manifest import Manifest
from dataprep import faults, pack, testing

REPO = pathlib.Path(__file__).resolve().parents[1]
SEQ_LEN = 128


def _texts():
    return testing.pydoc_text(10**9)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Inputs in every format plus a small tokenizer; returns (folder, config path, tokenizer path)."""
    d = tmp_path_factory.mktemp("corpus")
    tok = d / "tok.model"
    sha = testing.train_small_tokenizer(str(tok))
    texts = _texts()
    (d / "in/jsonl").mkdir(parents=True)
    with open(d / "in/jsonl/a.jsonl", "w") as f:
        for i, t in enumerate(texts[:8]):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
        f.write("\n")  # a blank line is not a document
        f.write(json.dumps({"id": "short", "text": "Hello </s> world."}) + "\n")
    with gzip.open(d / "in/jsonl/b.jsonl.gz", "wt") as f:
        for i, t in enumerate(texts[8:14]):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    (d / "in/zst").mkdir()
    with open(d / "in/zst/c.jsonl.zst", "wb") as f:
        payload = "".join(json.dumps({"text": t}) + "\n" for t in texts[14:20]).encode()
        f.write(zstandard.ZstdCompressor(level=3).compress(payload))
    (d / "in/pq").mkdir()
    pq.write_table(
        pa.table({"text": texts[20:30], "id": list(range(10))}), d / "in/pq/d.parquet", row_group_size=4
    )
    (d / "in/txt/sub").mkdir(parents=True)
    (d / "in/txt/one.txt").write_text(texts[30])
    (d / "in/txt/sub/two.txt").write_text(texts[31])
    (d / "in/blocks").mkdir()
    (d / "in/blocks/b.txt").write_text(
        "\n\n".join(" ".join(t.split()) for t in texts[32:40]) + "\r\n\r\n  \r\nlast block\r\n"
    )
    config = {
        "name": "t",
        "version": 1,
        "seq_len": SEQ_LEN,
        "seed": 7,
        "shards_per_source": 3,
        "max_segments_per_row": 4,
        "tokenizer": {"path": "tok.model", "sha256": sha},
        "sources": [
            {"name": "json", "paths": ["in/jsonl/*.jsonl"], "format": "jsonl", "weight": 1.0},
            {"name": "gz", "paths": ["in/jsonl/*.jsonl.gz"], "format": "jsonl.gz"},
            {"name": "zst", "paths": ["in/zst/*.jsonl.zst"], "format": "jsonl.zst", "weight": 1.0},
            {"name": "pq", "paths": ["in/pq/*.parquet"], "format": "parquet", "weight": 1.0},
            {
                "name": "txt",
                "paths": ["in/txt/*.txt", "in/txt/**/*.txt"],
                "root": "in/txt",
                "format": "text",
                "weight": 1.0,
            },
            {
                "name": "blocks",
                "paths": ["in/blocks/b.txt"],
                "format": "text",
                "text_split": "blank_lines",
                "weight": 0.0,
            },
        ],
    }
    import yaml

    (d / "mix.yaml").write_text(yaml.safe_dump(config))
    return d, d / "mix.yaml", tok


def _files(folder):
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(pathlib.Path(folder).rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One run with one in-process worker: the bytes every other run must reproduce."""
    d, cfg, _ = corpus
    out = tmp_path_factory.mktemp("ref") / "ds"
    result = pack.run(
        ["--config", str(cfg), "--output", str(out), "--direct_num_workers=1"], print_summary=False
    )
    return out, result


def test_reference_run_reconciles_and_decodes(corpus, reference):
    d, _, tok = corpus
    out, result = reference
    m = Manifest.from_json((out / "manifest.json").read_text())
    assert m.problems() == []
    assert m.to_json() == result.manifest.to_json()
    assert set(m.sources) == {"json", "gz", "zst", "pq", "txt", "blocks"}
    read = {n: e.ledger.read for n, e in m.sources.items()}
    assert read == {"json": 9, "gz": 6, "zst": 6, "pq": 10, "txt": 2, "blocks": 9}
    assert all(e.ledger.rejected == {} for e in m.sources.values())
    assert m.token_dtype == "uint16" and m.seq_len == SEQ_LEN
    assert m.tokenizer["eos_id"] == 2 and m.tokenizer["vocab_size"] == 400
    assert not (out / "_stats.json").exists()
    assert mixture_from_dict(m.config).sha256() == m.config_sha256  # the loader can re-read the config
    # the Beam counters agree with the ledger
    for n, e in m.sources.items():
        assert result.metrics[f"{n}.read"] == e.ledger.read
        assert result.metrics[f"{n}.tokens_packed"] == e.ledger.tokens_packed

    sp = spm.SentencePieceProcessor(model_file=str(tok))
    texts = _texts()
    expected_text = {f"json/a.jsonl:{i + 1}": t for i, t in enumerate(texts[:8])}
    expected_text["json/a.jsonl:10"] = "Hello </s> world."
    expected_text.update({f"pq/d.parquet:{i}": t for i, t in enumerate(texts[20:30])})
    expected_text["txt/one.txt:0"] = texts[30]
    expected_text["txt/sub/two.txt:0"] = texts[31]
    chunks, ids = {}, {}
    for entry in m.sources.values():
        for shard in entry.shards:
            reader = ArrayRecordReader(str(out / shard.path))
            assert reader.ok() and reader.num_records() == shard.records
            data = reader.read_all()
            reader.close()
            assert hashlib.sha256((out / shard.path).read_bytes()).hexdigest() == shard.sha256
            for rec in data:
                row = decode_row(rec)
                assert row.num_tokens <= SEQ_LEN and 1 <= row.num_segments <= 4
                for key, c, seg, doc_id in zip(row.doc_keys, row.chunk_indices, row.segments(), row.doc_ids):
                    assert (key, int(c)) not in chunks
                    chunks[(key, int(c))] = seg
                    assert ids.setdefault(key, doc_id) == doc_id  # every chunk carries its document's id
    # the inputs' own ids (id_field "id"): JSON numbers and strings as text, Parquet ints; none in zst
    assert {k: v for k, v in ids.items() if k.startswith("json/")} == {
        **{f"json/a.jsonl:{i + 1}": str(i) for i in range(8)}, "json/a.jsonl:10": "short"}
    assert {k: v for k, v in ids.items() if k.startswith("pq/")} == {f"pq/d.parquet:{i}": str(i) for i in range(10)}
    assert {v for k, v in ids.items() if not k.startswith(("json/", "gz/", "pq/"))} == {""}
    docs = {}
    for key, c in sorted(chunks):
        docs.setdefault(key, []).append(chunks[(key, c)])
    assert len(docs) == sum(e.ledger.packed for e in m.sources.values())
    split = 0
    for key, parts in docs.items():
        assert all(len(p) == SEQ_LEN for p in parts[:-1])
        split += len(parts) > 1
        tokens = np.concatenate(parts).tolist()
        assert tokens[-1] == 2 and 2 not in tokens[:-1]  # one EOS, by id, at the end; "</s>" text is not EOS
        if key in expected_text:
            assert sp.decode(tokens[:-1]) == sp.decode(sp.encode(expected_text[key]))
    assert split == sum(e.ledger.docs_split for e in m.sources.values()) > 0
    blocks = sorted(k for k in docs if k.startswith("blocks/"))
    assert blocks == [f"blocks/b.txt:{i}" for i in range(9)]


def test_two_processes_give_identical_bytes(corpus, reference, tmp_path):
    _, cfg, _ = corpus
    out = tmp_path / "ds"
    pack.run(
        [
            "--config",
            str(cfg),
            "--output",
            str(out),
            "--direct_num_workers=2",
            "--direct_running_mode=multi_processing",
        ],
        print_summary=False,
    )
    assert _files(out) == _files(reference[0])


def test_shuffle_transport_gives_the_spilled_bytes(corpus, reference, tmp_path):
    """--spill off sends token segments through the GroupByKey (as on Dataflow): same bytes."""
    _, cfg, _ = corpus
    out = tmp_path / "ds"
    pack.run(["--config", str(cfg), "--output", str(out), "--spill", "off"], print_summary=False)
    assert _files(out) == _files(reference[0])
    assert not (reference[0] / "_tmp").exists()  # the spill folder of the reference run is gone


@pytest.mark.parametrize("point", faults.POINTS)
def test_retried_bundle_gives_identical_bytes(corpus, reference, tmp_path, monkeypatch, point):
    """A bundle's first attempt raises; the BundleBasedDirectRunner retries it (executor.py)."""
    _, cfg, _ = corpus
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(faults.ENV, f"{point}@{markers}")
    out = tmp_path / "ds"
    pack.run(
        ["--config", str(cfg), "--output", str(out), "--runner", "BundleBasedDirectRunner"],
        print_summary=False,
    )
    assert (markers / f"{point}.fired").exists()  # the fault really fired
    assert _files(out) == _files(reference[0])  # no duplicate, no missing document


def test_failed_run_commits_nothing_and_rerun_matches(corpus, reference, tmp_path, monkeypatch):
    """FnApiRunner does not retry bundles: the run fails, no manifest; a rerun completes it."""
    _, cfg, _ = corpus
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(faults.ENV, f"pack@{markers}")
    out = tmp_path / "ds"
    with pytest.raises(Exception, match="injected failure"):
        pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    assert not (out / "manifest.json").exists()
    (out / "errors").mkdir(exist_ok=True)
    (out / "errors/json-00001-of-00003.jsonl").write_text('{"stale": true}\n')  # from an older run
    pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    assert _files(out) == _files(reference[0])


def test_non_local_file_system(corpus, reference):
    """Inputs, tokenizer and outputs all on memfs://, a Beam FileSystem registered for the test."""
    d, cfg, tok = corpus
    import yaml

    raw = yaml.safe_load(cfg.read_text())
    for path, data in _files(d / "in").items():
        testing.MEMFS_FILES[f"memfs://bucket/in/{path}"] = data
    testing.MEMFS_FILES["memfs://bucket/tok.model"] = tok.read_bytes()
    raw["tokenizer"]["path"] = "memfs://bucket/tok.model"
    for s in raw["sources"]:
        s["paths"] = [f"memfs://bucket/{p}" for p in s["paths"]]
        s["root"] = f"memfs://bucket/{s.get('root', os.path.dirname(s['paths'][0]).split('bucket/', 1)[1])}"
    mem_cfg = d / "mem.yaml"
    mem_cfg.write_text(yaml.safe_dump(raw))
    try:
        pack.run(["--config", str(mem_cfg), "--output", "memfs://bucket/out"], print_summary=False)
        got = {
            k[len("memfs://bucket/out/") :]: v
            for k, v in testing.MEMFS_FILES.items()
            if k.startswith("memfs://bucket/out/")
        }
        # Spill files through the same FileSystems, under --temp_location: same bytes, removed after.
        pack.run(["--config", str(mem_cfg), "--output", "memfs://bucket/out2", "--spill", "on",
                  "--temp_location", "memfs://bucket/tmp", "--no-report"], print_summary=False)
        spilled = {k[len("memfs://bucket/out2/") :]: v for k, v in testing.MEMFS_FILES.items()
                   if k.startswith("memfs://bucket/out2/")}
        assert [k for k in testing.MEMFS_FILES if k.startswith("memfs://bucket/tmp")] == []
    finally:
        testing.MEMFS_FILES.clear()
    assert {k: v for k, v in got.items() if k != "report.png"} == spilled
    ref = _files(reference[0])
    shards = sorted(k for k in ref if k.endswith(".array_record"))
    assert sorted(k for k in got if k.endswith(".array_record")) == shards
    assert all(got[k] == ref[k] for k in shards)
    m = Manifest.from_json(got["manifest.json"].decode())
    assert m.problems() == [] and m.tokenizer["path"] == "memfs://bucket/tok.model"


def _hostile_lines():
    big = " ".join(_texts())
    big = (big * (10_500_000 // len(big) + 1))[:10_500_000]
    return [
        b'{"text": "fine document one"}',
        b'{"text": "broken json',  # invalid JSON
        b'{"text": null}',
        b'{"text": 42}',
        b'{"body": "no text field"}',
        b"[1, 2, 3]",
        b'{"text": "bad bytes \xff\xfe here"}',  # invalid UTF-8
        b'{"text": ""}',  # empty document
        b'{"text": "   "}',  # only whitespace
        json.dumps({"text": big}).encode(),  # a 10 MB document
        json.dumps({"text": "NUL \u0000 and \u0001\u0007\u001b controls"}).encode(),
        b'{"text": "lone \\ud800 surrogate"}',
        b'{"text": "windows\\r\\nline endings\\r\\n"}\r',
        json.dumps({"text": "tabs\t\tand    runs   of  spaces"}).encode(),
        b'{"text": "literal </s> and <s> and <unk>"}',
    ]


def test_hostile_input_packs_or_lands_in_errors(corpus, tmp_path):
    _, _, tok = corpus
    (tmp_path / "in").mkdir()
    (tmp_path / "in/h.jsonl").write_bytes(b"\n".join(_hostile_lines()) + b"\r\n")
    (tmp_path / "in/empty.txt").write_bytes(b"")
    (tmp_path / "in/latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    import yaml

    (tmp_path / "mix.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "hostile",
                "version": 1,
                "seq_len": 8192,
                "shards_per_source": 2,
                "max_rejected_fraction": 1.0,  # hostile on purpose: most of it is rejected
                "tokenizer": {"path": str(tok)},
                "sources": [
                    {"name": "h", "paths": ["in/*.jsonl"], "format": "jsonl"},
                    # packs nothing (every document rejected): allowed only at weight 0
                    {"name": "t", "paths": ["in/*.txt"], "format": "text", "weight": 0.0},
                ],
            }
        )
    )
    out = tmp_path / "ds"
    result = pack.run(["--config", str(tmp_path / "mix.yaml"), "--output", str(out)], print_summary=False)
    m = result.manifest
    h, t = m.sources["h"].ledger, m.sources["t"].ledger
    assert h.read == 15 and t.read == 2
    assert h.rejected == {
        "empty_after_tokenization": 2,
        "invalid_json": 1,
        "invalid_unicode": 1,
        "invalid_utf8": 1,
        "missing_text": 1,
        "non_string_text": 2,
        "not_a_json_object": 1,
    }
    assert h.packed == 6 and h.docs_split == 1
    assert t.rejected == {"empty_after_tokenization": 1, "invalid_utf8": 1}
    assert m.problems() == []
    letters = [
        json.loads(line)
        for p in sorted((out / "errors").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    by_key = {x["key"]: x for x in letters}
    assert len(letters) == sum(h.rejected.values()) + sum(t.rejected.values())
    assert (
        by_key["h/h.jsonl:2"]["reason"] == "invalid_json"
        and by_key["h/h.jsonl:2"]["raw"] == '{"text": "broken json'
    )
    bad = by_key["h/h.jsonl:7"]
    assert bad["reason"] == "invalid_utf8" and "raw" not in bad
    import base64

    assert base64.b64decode(bad["raw_base64"]) == b'{"text": "bad bytes \xff\xfe here"}'
    assert by_key["h/h.jsonl:12"]["reason"] == "invalid_unicode"
    assert by_key["t/empty.txt:0"]["reason"] == "empty_after_tokenization"
    assert by_key["t/latin1.txt:0"]["reason"] == "invalid_utf8"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: c.update(colour="blue"), "unknown key"),
        (lambda c: c["sources"].append(dict(c["sources"][0])), "duplicate source name"),
        (lambda c: c["sources"][0].update(weight=-1), "sources[0].weight"),
        (lambda c: [s.update(weight=0) for s in c["sources"]], "all weights are zero"),
        (lambda c: c.update(seq_len=0), "seq_len"),
        (lambda c: c["sources"][2].update(paths=["in/pq/*.nothing"]), "sources[2].paths[0]"),
        (lambda c: c["tokenizer"].update(sha256="0" * 64), "tokenizer.sha256"),
        (lambda c: c["tokenizer"].update(path="missing.model", sha256=None), "tokenizer.path"),
    ],
)
def test_config_mistakes_stop_before_any_work(corpus, tmp_path, mutate, field):
    d, cfg, _ = corpus
    import yaml

    raw = yaml.safe_load(cfg.read_text())
    mutate(raw)
    bad = d / f"bad-{tmp_path.name}.yaml"  # beside the good config: same relative paths
    bad.write_text(yaml.safe_dump(raw))
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match=field.replace("[", "\\[").replace("]", "\\]")):
        pack.run(["--config", str(bad), "--output", str(out)], print_summary=False)
    assert not out.exists()
    assert pack.main(["--config", str(bad), "--output", str(out)]) == pack.EXIT_CONFIG


def test_ledger_mismatch_fails_loudly(corpus, tmp_path, monkeypatch):
    _, cfg, _ = corpus
    original = pack.build_manifest

    def lose_one(config, pre, stats):
        stats = [list(s) for s in stats]
        next(s for s in stats if s[0] == "read")[2] += 1  # one document read and never seen again
        return original(config, pre, stats)

    monkeypatch.setattr(pack, "build_manifest", lose_one)
    out = tmp_path / "ds"
    with pytest.raises(pack.LedgerError, match="documents read"):
        pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    assert not (out / "manifest.json").exists()


def test_committed_output_is_not_overwritten(corpus, reference):
    _, cfg, _ = corpus
    with pytest.raises(pack.OutputExistsError, match="--overwrite"):
        pack.run(["--config", str(cfg), "--output", str(reference[0])], print_summary=False)


def test_script_form_runs(corpus, tmp_path):
    _, cfg, _ = corpus
    out = tmp_path / "ds"
    proc = subprocess.run(
        [sys.executable, str(REPO / "dataprep/pack.py"), "--config", str(cfg), "--output", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reconciled" in proc.stdout and (out / "manifest.json").exists()
