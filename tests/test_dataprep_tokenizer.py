"""Tokenizer training (dataprep.train_tokenizer) and batch encoding (dataprep.tokenizer)."""

import hashlib
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import yaml

from contract.config import load_mixture
from dataprep import preflight, testing, tokenizer, train_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = d / "tok.model"
    testing.train_small_tokenizer(str(tok), vocab_size=400)
    sp, sha = tokenizer.load(str(tok))
    return d, tok, sp, sha


def test_literal_control_text_is_not_a_control_id(small):
    _, _, sp, _ = small
    (ids,) = tokenizer.encode_batch(sp, ["a </s> b <s> c <unk> d <pad>"], add_bos=True, add_eos=True)
    assert ids[0] == sp.bos_id() == 1 and ids[-1] == sp.eos_id() == 2
    assert 1 not in ids[1:].tolist() and 2 not in ids[:-1].tolist() and 3 not in ids.tolist()
    assert sp.decode(ids[1:-1].tolist()) == "a </s> b <s> c <unk> d <pad>"  # byte fallback keeps < and >


def test_empty_and_whitespace_give_no_tokens(small):
    _, _, sp, _ = small
    out = tokenizer.encode_batch(sp, ["", "   ", "x"], add_bos=False, add_eos=True, dtype=np.uint16)
    assert [o.tolist() for o in out[:2]] == [[], []] and out[2][-1] == 2 and out[2].dtype == np.uint16


def test_sha_mismatch(small):
    _, tok, _, sha = small
    with pytest.raises(ValueError, match="sha256"):
        tokenizer.load(str(tok), "0" * 64)
    assert tokenizer.load(str(tok), sha)[1] == sha


def test_cut_keeps_utf8_whole():
    line = "é" * 5000  # 10000 bytes
    pieces = list(train_tokenizer._cut(line, 4192))
    assert "".join(pieces) == line and all(len(p.encode()) <= 4192 for p in pieces)


def test_training_is_deterministic_and_writes_sha256(tmp_path):
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in/d.jsonl", "w") as f:
        for t in testing.pydoc_text(150_000):
            f.write(json.dumps({"text": t}) + "\n")
    (tmp_path / "m.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "version": 1,
                "tokenizer": {"path": "tok.model"},
                "sources": [{"name": "d", "paths": ["in/*.jsonl"], "format": "jsonl"}],
            }
        )
    )
    cfg = load_mixture(str(tmp_path / "m.yaml"))
    a = train_tokenizer.train(cfg, 600, str(tmp_path / "a.model"), sample_fraction=0.5, seed=1, num_threads=1)
    b = train_tokenizer.train(cfg, 600, str(tmp_path / "b.model"), sample_fraction=0.5, seed=1, num_threads=1)
    assert a == b and (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert (tmp_path / "a.model.sha256").read_text() == f"{a}  a.model\n"
    sp, _ = tokenizer.load(str(tmp_path / "a.model"))
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    assert sp.piece_to_id("<0xFF>") > 3  # byte fallback pieces exist
    lines = list(train_tokenizer.sample_lines(cfg, {"d": [str(tmp_path / "in/d.jsonl")]}, 0.5, 1))
    assert lines == list(train_tokenizer.sample_lines(cfg, {"d": [str(tmp_path / "in/d.jsonl")]}, 0.5, 1))
    assert (
        0
        < len(lines)
        < len(list(train_tokenizer.sample_lines(cfg, {"d": [str(tmp_path / "in/d.jsonl")]}, 1.0, 1)))
    )
    assert (
        train_tokenizer.main(
            ["--config", str(tmp_path / "m.yaml"), "--vocab-size", "8", "--out", str(tmp_path / "c.model")]
        )
        == 2
    )


def _mixture(tmp_path, files=2):
    """pydoc prose split over ``files`` JSONL files: about 4,500 non-blank lines in all."""
    testing.write_pydoc_jsonl(tmp_path / "in", files, 400_000, stem="d")
    cfg = tmp_path / "m.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "t", "version": 1, "tokenizer": {"path": "tok.model"},
        "sources": [{"name": "d", "paths": ["in/*.jsonl"], "format": "jsonl"}],
    }))
    return cfg


def test_two_runs_with_a_sample_over_the_limit_give_the_same_model_bytes(tmp_path):
    """Each run in a fresh process: SentencePiece's own sampler differed from process to process."""
    cfg = _mixture(tmp_path)
    lines = list(train_tokenizer.sample_lines(load_mixture(str(cfg)), preflight.match_inputs(load_mixture(str(cfg))),
                                              1.0, 0))
    assert len(lines) > 3 * 1000  # the sample is over --max-sentences 1000
    digests = []
    for name in ("a", "b"):
        run = subprocess.run(
            [sys.executable, "-m", "dataprep.train_tokenizer", "--config", str(cfg), "--vocab-size", "500",
             "--max-sentences", "1000", "--out", str(tmp_path / f"{name}.model")],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )
        assert run.returncode == 0, run.stderr
        digests.append(hashlib.sha256((tmp_path / f"{name}.model").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert run.stdout.splitlines()[1:4] == [
        "vocabulary: 500 pieces",
        "normalization: nmt_nfkc: Unicode NFKC, plus NMT rules (control characters removed, some spaces "
        "unified); runs of whitespace collapse to one space; decoded text is the normalized text, not the "
        "original bytes (--normalization identity keeps it byte-exact)",
        "threads: 4 (recorded in the model; the same value gives the same model bytes)",
    ]
    assert run.stdout.splitlines()[-1] == f'      sha256: "{digests[1]}"'  # the line to pin it


def test_the_sample_does_not_depend_on_file_order_and_is_capped(tmp_path):
    cfg = load_mixture(str(_mixture(tmp_path)))
    files = preflight.match_inputs(cfg)
    lines = list(train_tokenizer.sample_lines(cfg, files, 1.0, 5))
    chosen = train_tokenizer.choose_sentences(iter(lines), 5, 700)
    assert len(chosen) == 700 < len(lines)
    assert train_tokenizer.choose_sentences(iter(lines[::-1]), 5, 700) == chosen
    swapped = list(train_tokenizer.sample_lines(cfg, {"d": files["d"][::-1]}, 1.0, 5))
    assert train_tokenizer.choose_sentences(iter(swapped), 5, 700) == chosen
    assert train_tokenizer.choose_sentences(iter(lines), 6, 700) != chosen  # the seed chooses
    # Under the cap everything is kept, in hash order (not file order).
    every = train_tokenizer.choose_sentences(iter(lines), 5, 10**6)
    assert sorted(every) == sorted(t for *_, t in lines) and every != [t for *_, t in lines]


def test_thread_count_is_part_of_the_model(tmp_path):
    cfg = load_mixture(str(_mixture(tmp_path)))
    a = train_tokenizer.train(cfg, 500, str(tmp_path / "a.model"), max_sentences=800, num_threads=1)
    b = train_tokenizer.train(cfg, 500, str(tmp_path / "b.model"), max_sentences=800, num_threads=2)
    assert a != b  # hence fixed, never the machine's core count
    assert train_tokenizer.train(cfg, 500, str(tmp_path / "c.model"), max_sentences=800, num_threads=1) == a


def test_identity_normalization_keeps_text_byte_exact(tmp_path):
    cfg = load_mixture(str(_mixture(tmp_path)))
    train_tokenizer.train(cfg, 400, str(tmp_path / "id.model"), max_sentences=2000, normalization="identity")
    train_tokenizer.train(cfg, 400, str(tmp_path / "nfkc.model"), max_sentences=2000)
    ident, _ = tokenizer.load(str(tmp_path / "id.model"))
    nfkc, _ = tokenizer.load(str(tmp_path / "nfkc.model"))
    texts = ["a\ufe30b", "\ufb01le", "\uff11\uff12\uff13", "a   b\t\tc\nd", "  lead", "snow \u2603 \u4e2d\u6587", "x\u00e9y"]
    assert [ident.decode(ident.encode(t)) for t in texts] == texts
    assert [nfkc.decode(nfkc.encode(t)) for t in texts] == [
        "a..b", "file", "123", "a b c d", "lead", "snow \u2603 \u4e2d\u6587", "x\u00e9y"
    ]
    train_tokenizer.train(cfg, 400, str(tmp_path / "nobf.model"), max_sentences=2000, byte_fallback=False)
    nobf, _ = tokenizer.load(str(tmp_path / "nobf.model"))
    assert nobf.decode(nobf.encode("snow \u2603 man \u4e2d\u6587")) == "snow  \u2047  man  \u2047 "
    # A row boundary inside a multi-byte character (byte fallback): U+FFFD on each side.
    ids = nfkc.encode("\u4e2d")
    pieces = [nfkc.id_to_piece(i) for i in ids]
    assert pieces[-3:] == ["<0xE4>", "<0xB8>", "<0xAD>"]
    assert nfkc.decode(ids[:-2]).endswith("\ufffd") and nfkc.decode(ids[-2:]) == "\ufffd\ufffd"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-threads", "0"], "error: --num-threads must be in [1, 1024], got 0; keep it fixed: the model depends on it\n"),
        (["--normalization", "identity", "--no-byte-fallback"],
         "error: --normalization identity keeps text byte-exact only with byte fallback; drop --no-byte-fallback\n"),
    ],
)
def test_train_tokenizer_option_mistakes(tmp_path, args, message, capsys):
    cfg = _mixture(tmp_path)
    assert train_tokenizer.main(["--config", str(cfg), "--vocab-size", "300", "--out", str(tmp_path / "x.model"),
                                 *args]) == 2
    assert capsys.readouterr().err == message and not (tmp_path / "x.model").exists()


def test_pin_config_edits_only_the_tokenizer_lines():
    text = ("# my corpus\nname: mine\nversion: 1\ntokenizer:\n  path: old.model   # trained last week\n"
            "  add_eos: true\n\n# the sources\nsources:\n  - {name: a, paths: [a.jsonl], format: jsonl}\n")
    sha = "1234e5678" + "0" * 55  # digits and one e: a float to YAML unless quoted
    got = train_tokenizer.pin_config(text, {"path": "../tok.model", "sha256": sha})
    assert got == ("# my corpus\nname: mine\nversion: 1\ntokenizer:\n  path: \"../tok.model\"   # trained last week\n"
                   f"  add_eos: true\n  sha256: \"{sha}\"\n\n# the sources\nsources:\n"
                   "  - {name: a, paths: [a.jsonl], format: jsonl}\n")
    assert yaml.safe_load(got)["tokenizer"]["sha256"] == sha
    assert train_tokenizer.pin_config(got, {"sha256": "f" * 64}) == got.replace(sha, "f" * 64)  # replaced in place
    with pytest.raises(train_tokenizer.PinError, match="no block-style 'tokenizer:' section"):
        train_tokenizer.pin_config("name: x\ntokenizer: {path: a.model}\n", {"sha256": sha})


def test_train_tokenizer_prints_the_lines_to_pin_and_pin_writes_them(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in/d.jsonl", "w") as f:
        for t in testing.pydoc_text(60_000):
            f.write(json.dumps({"text": t}) + "\n")
    cfg = tmp_path / "conf" / "m.yaml"
    cfg.parent.mkdir()
    text = ("# comments stay\nname: m\nversion: 1\ntokenizer:\n  path: ../old.model\nsources:\n"
            "  - name: d\n    paths: [../in/*.jsonl]\n    format: jsonl\n")
    cfg.write_text(text)
    out = tmp_path / "tok.model"
    args = ["--config", str(cfg), "--vocab-size", "400", "--out", str(out), "--max-sentences", "2000"]
    assert train_tokenizer.main(args) == 0
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    printed = capsys.readouterr().out
    assert printed.endswith(f"to pin it, set these in {cfg} (or rerun with --pin to write them there):\n"
                            f"    tokenizer:\n      path: \"../tok.model\"\n      sha256: \"{sha}\"\n")
    assert cfg.read_text() == text  # not without --pin
    assert train_tokenizer.main(args + ["--pin"]) == 0
    assert capsys.readouterr().out.endswith(f"pinned in {cfg}: tokenizer.path and tokenizer.sha256\n")
    assert cfg.read_text() == text.replace("  path: ../old.model\n",
                                           f"  path: \"../tok.model\"\n  sha256: \"{sha}\"\n")
    pinned = load_mixture(str(cfg))
    assert pinned.tokenizer.sha256 == sha and pinned.tokenizer.path == str(out)
    preflight.check_tokenizer(pinned)  # the pinned config passes the sha256 check
    assert train_tokenizer.main(args + ["--pin"]) == 0  # again: the path is the config's now, only sha256
    assert capsys.readouterr().out.endswith(f"pinned in {cfg}: tokenizer.sha256\n")
    assert "vocabulary: 400 pieces\n" in printed
    # a vocabulary the sample cannot fill: SentencePiece stops short (hard_vocab_limit=False), and it says so
    big = ["--config", str(cfg), "--vocab-size", "30000", "--out", str(tmp_path / "big.model"), "--max-sentences", "200"]
    assert train_tokenizer.main(big) == 0
    got = capsys.readouterr().out
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "big.model")).get_piece_size()
    assert pieces < 30000 and f"vocabulary: {pieces:,} pieces, fewer than the 30,000 asked" in got
