"""Tokenizer training (dataprep.train_tokenizer) and batch encoding (dataprep.tokenizer)."""

import json

import numpy as np
import pytest
import yaml

from contract.config import load_mixture
from dataprep import testing, tokenizer, train_tokenizer


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
