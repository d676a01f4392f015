"""Regression tests from a hostile review (branch hostile-fixes): each pins one fixed failure."""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from contract.config import SourceConfig, SourceFormat
from dataprep import pack, readers, testing


def _src(root):
    return SourceConfig(name="s", paths=(str(root),), root=str(root), format=SourceFormat.PARQUET)


def _damaged_footer(path: pathlib.Path) -> None:
    """Overwrites the Parquet footer's thrift metadata (kept: its length and the magic)."""
    data = bytearray(path.read_bytes())
    meta_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - meta_len
    data[start : start + meta_len] = b"\xff" * meta_len
    path.write_bytes(bytes(data))


def test_parquet_with_damaged_footer_is_an_unreadable_file_dead_letter(tmp_path):
    # Was: pyarrow's plain OSError ("Couldn't deserialize thrift") escaped read_file and failed
    # the whole pack with a worker traceback; about half of all single-byte corruptions of a
    # small Parquet file did so (thrift, page decompression, levels).
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "d.parquet")
    _damaged_footer(tmp_path / "d.parquet")
    got = list(readers.read_file(_src(tmp_path), str(tmp_path / "d.parquet")))
    assert len(got) == 1
    assert (got[0].key, got[0].reason, got[0].raw) == ("s/d.parquet:file", readers.Reason.UNREADABLE_FILE, b"")
    assert got[0].detail == "OSError: Couldn't deserialize thrift: don't know what type: \x0f"


def test_parquet_file_system_error_is_still_raised(tmp_path, monkeypatch):
    # An OSError of the file object itself (a network error reading gs://) still fails the
    # bundle, so that the runner retries it (not a dead letter: reruns stay byte-identical).
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "d.parquet")

    class Flaky:
        def __init__(self, f):
            self._f = f

        def __getattr__(self, name):
            return getattr(self._f, name)

        def read(self, *args):
            raise OSError("connection reset")

    from dataprep import fsutil

    real = fsutil.open_raw
    monkeypatch.setattr(fsutil, "open_raw", lambda p: _Ctx(Flaky(real(p).__enter__())))
    with pytest.raises(OSError, match="^connection reset$"):
        list(readers.read_file(_src(tmp_path), str(tmp_path / "d.parquet")))


class _Ctx:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        return False


def test_pack_keeps_going_past_a_damaged_parquet_file_and_reconciles(tmp_path):
    tok = tmp_path / "tok.model"
    testing.train_small_tokenizer(str(tok))
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": ["hello world", "a second document"]}), tmp_path / "in/a.parquet")
    pq.write_table(pa.table({"text": ["lost"]}), tmp_path / "in/b.parquet")
    _damaged_footer(tmp_path / "in/b.parquet")
    cfg = {"name": "t", "version": 1, "seq_len": 64, "shards_per_source": 1, "max_rejected_fraction": 1.0,
           "tokenizer": {"path": str(tok)},
           "sources": [{"name": "p", "paths": ["in/*.parquet"], "format": "parquet"}]}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "ds"
    assert pack.main(["--config", str(tmp_path / "mix.yaml"), "--output", str(out), "--quiet", "--no-report"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    letters = [json.loads(line) for f in sorted((out / "errors").glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert [(d["key"], d["reason"]) for d in letters] == [("p/b.parquet:file", "unreadable_file")]
    assert "p" in json.dumps(manifest)


def test_goodput_of_a_run_whose_signals_are_not_utf8_names_the_file(run_copy, capsys):
    # Was: UnicodeDecodeError traceback from replay/screen/goodput.py (scan and triage said
    # "run directory or data error" for the same run directory).
    import os

    from replay.cli import main

    path = os.path.join(run_copy, "signals.jsonl")
    data = bytearray(open(path, "rb").read())
    at = data.index(b"\n") + 5  # inside the second line
    data[at] = 0xFF
    open(path, "wb").write(bytes(data))
    assert main(["goodput", "--run", run_copy]) == 5
    err = capsys.readouterr().err
    assert f"{path}: not UTF-8 text (invalid start byte at byte {at}): corrupted?" in err
    assert "Traceback" not in err


def test_goodput_of_a_signals_line_with_a_bad_value_is_the_scan_error(run_copy, capsys):
    # Was: ValueError "could not convert string to float: 'slow'" traceback from goodput._step_of.
    import json
    import os

    from replay.cli import main
    from replay.run import protocol as proto

    path = os.path.join(run_copy, "signals.jsonl")
    rows = [json.loads(x) for x in open(path)]
    rows[1]["step_time_s"] = "slow"
    with open(path, "w") as f:  # a trainer that logged a string: sealed as written
        f.writelines(json.dumps(proto.seal(r)) + "\n" for r in rows)
    assert main(["goodput", "--run", run_copy]) == 5
    err = capsys.readouterr().err
    assert f"run directory or data error: {path}:2: unreadable (could not convert string to float: 'slow')\n" in err
    assert main(["scan", "--run", run_copy]) == 5  # the same words as scan
    assert f"run directory or data error: {path}:2: unreadable (could not convert string to float: 'slow')\n" in (
        capsys.readouterr().err)


def test_a_bad_signals_value_names_its_line_in_the_file_it_came_from(tmp_path):
    # Was: "<run>/signals.jsonl: unreadable (could not convert string to float: 'slow')", no line; a bad
    # value in another process's signals.pNNNNN.jsonl was blamed on signals.jsonl.
    import json

    import pytest

    from replay.run import protocol as proto

    rows = [{"step": s, "loss": 1.0, "grad_norm": 1.0, "step_time_s": 0.5} for s in range(4)]
    main_file = tmp_path / "signals.jsonl"
    main_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(proto.read_signals(str(tmp_path))) == [0, 1, 2, 3]
    rows[2]["step_time_s"] = "slow"
    main_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(proto.StepLogLineError) as e:
        proto.read_signals(str(tmp_path))
    assert str(e.value) == f"{main_file}:3: unreadable (could not convert string to float: 'slow')"


def test_superseding_a_step_log_that_is_not_utf8_names_it_and_moves_nothing(tmp_path):
    # Was: resuming after `replay skip` on a run whose signals.jsonl had one damaged byte moved the
    # fingerprints' lines to superseded/, then stopped with "error: 'utf-8' codec can't decode byte
    # 0xff in position 7003: invalid start byte" (no file named, the step logs left half-moved).
    import json

    from replay.run.writer import RunDir

    run = tmp_path / "run"
    run.mkdir()
    fp = "".join(json.dumps({"step": s, "x": 1}) + "\n" for s in range(4))
    (run / "fingerprints.jsonl").write_text(fp)
    sig = bytearray(fp.encode())
    at = sig.index(b'"x"', fp.index('{"step": 2'))
    sig[at] = 0xFF
    (run / "signals.jsonl").write_bytes(bytes(sig))
    rd = RunDir(str(run))
    with pytest.raises(ValueError) as e:
        rd.supersede(2, lambda s: 1, 2)
    assert str(e.value) == (
        f"{run}/signals.jsonl: not UTF-8 text (invalid start byte at byte {at}): corrupted?; nothing was moved or "
        "rewritten: restore the file from a copy, or delete its damaged line (that step's record is lost), and rerun"
    )
    assert (run / "fingerprints.jsonl").read_text() == fp and not (run / "superseded").exists()
    with pytest.raises(ValueError, match=r"signals\.jsonl: not UTF-8 text \(invalid start byte at byte \d+\)"):
        rd.truncate_log("signals.jsonl", 1)
    assert (run / "signals.jsonl").read_bytes() == bytes(sig)
    # an intact log still moves as before
    assert rd.supersede(2, lambda s: 1, 2, names=("fingerprints.jsonl",)) == {"fingerprints.jsonl": 2}
    assert (run / "fingerprints.jsonl").read_text() == "".join(fp.splitlines(keepends=True)[:2])


def test_a_bad_signals_value_of_another_process_names_that_file_and_line(tmp_path):
    import json

    import pytest

    from replay.run import protocol as proto

    rows = [{"step": s, "loss": 1.0, "grad_norm": 1.0} for s in range(3)]
    (tmp_path / "signals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    part = tmp_path / "signals.p00001.jsonl"
    part.write_text("".join(json.dumps({"step": s, "devices": {"4": {"norm_sq": "x" if s == 1 else 1.0}}}) + "\n"
                            for s in range(3)))
    with pytest.raises(proto.StepLogLineError) as e:
        proto.read_signals(str(tmp_path))
    assert str(e.value) == f"{part}:2: unreadable (could not convert string to float: 'x')"
    del rows[1]["loss"]
    (tmp_path / "signals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(proto.StepLogLineError) as e:
        proto.read_signals(str(tmp_path))
    assert str(e.value) == f"{tmp_path / 'signals.jsonl'}:2: unreadable (missing field 'loss')"


def _identity_tokenizer(path: pathlib.Path) -> None:
    """A small model that keeps whitespace as tokens (identity normalization, no whitespace collapsing)."""
    import io

    import sentencepiece as spm

    lines = [ln.strip() for t in testing.pydoc_text(30_000) for ln in t.splitlines() if ln.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=400,
                                   model_type="unigram", byte_fallback=True, character_coverage=1.0, num_threads=1,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=3, hard_vocab_limit=False, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    path.write_bytes(model.getvalue())


def _pack_in(tmp_path, tok):
    """Packs ``tmp_path/in/*.jsonl`` (one source ``j``, seq_len 64) with tokenizer ``tok``; returns the
    source's ledger and the dead letters, in file order."""
    cfg = {"name": "t", "version": 1, "seq_len": 64, "shards_per_source": 1, "max_rejected_fraction": 1.0,
           "tokenizer": {"path": str(tok)}, "sources": [{"name": "j", "paths": ["in/*.jsonl"], "format": "jsonl"}]}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "ds"
    assert pack.main(["--config", str(tmp_path / "mix.yaml"), "--output", str(out), "--quiet", "--no-report"]) == 0
    ledger = json.loads((out / "manifest.json").read_text())["sources"]["j"]["ledger"]
    letters = [json.loads(line) for f in sorted((out / "errors").glob("*.jsonl")) for line in f.read_text().splitlines()]
    return ledger, letters


def test_a_whitespace_only_document_is_empty_whatever_the_tokenizer_keeps(tmp_path):
    # Was: with a tokenizer that keeps whitespace (--normalization identity) "   \n\t " was packed as a
    # document of whitespace tokens, while "" was rejected as empty_after_tokenization.
    import sentencepiece as spm

    tok = tmp_path / "tok.model"
    _identity_tokenizer(tok)
    assert len(spm.SentencePieceProcessor(model_file=str(tok)).encode("   \n\t ")) > 0  # the model keeps it
    (tmp_path / "in").mkdir()
    docs = ["a document", "", "   \n\t ", "another one", " \u3000\u00a0" * 30]
    (tmp_path / "in/a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    ledger, letters = _pack_in(tmp_path, tok)
    assert (ledger["read"], ledger["packed"], ledger["rejected"]) == (5, 2, {"empty_after_tokenization": 3})
    assert [(d["key"], d["reason"], d["detail"]) for d in letters] == [
        ("j/a.jsonl:2", "empty_after_tokenization", "no token: the text is empty"),
        ("j/a.jsonl:3", "empty_after_tokenization", "the text is only whitespace (6 characters: '   \\n\\t ')"),
        ("j/a.jsonl:5", "empty_after_tokenization",
         "the text is only whitespace (90 characters: ' " + "\\u3000\\xa0 " * 13 + "'...)"),
    ]


def test_a_jsonl_line_that_repeats_a_key_is_an_invalid_json_dead_letter(tmp_path):
    # Was: {"text":"a","text":"b"} packed "b" silently (Python's json keeps the last value).
    src = SourceConfig(name="s", paths=(str(tmp_path),), root=str(tmp_path), format=SourceFormat.JSONL)
    (tmp_path / "a.jsonl").write_bytes(b'{"text":"a","text":"b"}\n{"text":"ok","meta":{"u":1,"u":2}}\n'
                                       b'{"text":"fine","id":"x"}\n')
    got = list(readers.read_file(src, str(tmp_path / "a.jsonl")))
    assert [(g.key, getattr(g, "reason", None), getattr(g, "detail", None)) for g in got] == [
        ("s/a.jsonl:1", readers.Reason.INVALID_JSON,
         "key 'text' repeated in one object (JSON would keep only its last value); write each key once"),
        ("s/a.jsonl:2", readers.Reason.INVALID_JSON,
         "key 'u' repeated in one object (JSON would keep only its last value); write each key once"),
        ("s/a.jsonl:3", None, None),
    ]
    tok = tmp_path / "tok.model"
    testing.train_small_tokenizer(str(tok))
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.jsonl").write_bytes((tmp_path / "a.jsonl").read_bytes())
    ledger, letters = _pack_in(tmp_path, tok)
    assert (ledger["read"], ledger["packed"], ledger["rejected"]) == (3, 1, {"invalid_json": 2})
    assert [(d["key"], d["reason"], d["raw"]) for d in letters] == [
        ("j/a.jsonl:1", "invalid_json", '{"text":"a","text":"b"}'),
        ("j/a.jsonl:2", "invalid_json", '{"text":"ok","meta":{"u":1,"u":2}}'),
    ]
