"""The manifest schema (contract/manifest.py)."""

import json

import pytest

from contract.manifest import Ledger, Manifest, ManifestError, ShardInfo, SourceEntry, shard_name


def _manifest(**ledger_overrides):
    shard = ShardInfo(
        path="web/data-00000-of-00001.array_record",
        records=2,
        tokens=10,
        padding=6,
        documents=3,
        segments=4,
        sha256="ab" * 32,
        bytes=100,
    )
    ledger = dict(
        read=5, packed=3, rejected={"invalid_json": 2}, tokens_in=10, tokens_packed=10, docs_split=1
    )
    ledger.update(ledger_overrides)
    return Manifest(
        name="t",
        version=1,
        record_format_version=1,
        config={"name": "t"},
        config_sha256="c" * 64,
        tokenizer={"sha256": "d" * 64, "vocab_size": 1000, "eos_id": 2},
        seq_len=8,
        token_dtype="uint16",
        sources={"web": SourceEntry((shard,), Ledger(**ledger))},
        tools={"python": "3.11"},
    )


def test_round_trip_is_canonical():
    m = _manifest()
    text = m.to_json()
    assert text.endswith("}\n") and json.loads(text)["sources"]["web"]["totals"]["records"] == 2
    again = Manifest.from_json(text)
    assert again.to_json() == text and again.problems() == []


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (dict(read=6), "documents read 6 != packed 3 + rejected 2"),
        (dict(tokens_in=11), "tokens in 11 != tokens packed 10"),
        (dict(packed=4, read=6), "shard documents 3 != ledger packed 4"),
    ],
)
def test_problems_name_what_does_not_reconcile(overrides, problem):
    assert any(problem in p for p in _manifest(**overrides).problems())


def test_missing_field_and_bad_json():
    raw = json.loads(_manifest().to_json())
    del raw["sources"]["web"]["ledger"]["tokens_in"]
    with pytest.raises(ManifestError, match="tokens_in"):
        Manifest.from_dict(raw)
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json("{")


def test_shard_name():
    assert shard_name(3, 12) == "data-00003-of-00012.array_record"
    with pytest.raises(ValueError, match="not in"):
        shard_name(12, 12)
