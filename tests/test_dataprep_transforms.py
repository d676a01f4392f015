"""Per-transform tests with TestPipeline + beam.Create + assert_that (Beam's examples style)."""

import json

import apache_beam as beam
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from contract.config import SourceConfig, SourceFormat
from dataprep import packing, pipeline, staging, testing, tokenizer

RUNNER = ["--runner=FnApiRunner"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    sha = testing.train_small_tokenizer(str(path))
    return str(path), sha


def _records(values):
    """(key, token list) of every record in staged values, sorted by key."""
    group = staging.StagedGroup(values)
    data = group.gather_all()
    return sorted((k, np.frombuffer(d, np.uint16).tolist()) for k, d in zip(group.keys, data))


@pytest.mark.parametrize("spill", [False, True])
def test_read_and_tokenize_stages_tokens_by_bucket(tok, tmp_path, spill):
    path, sha = tok
    texts = [f"Document number {i} about Python." for i in range(50)]
    lines = [json.dumps({"text": t}) for t in texts[:20]] + ["{bad", json.dumps({"text": " "})]
    lines += [json.dumps({"text": t}) for t in texts[20:]]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    src = SourceConfig(name="s", paths=(str(tmp_path / "*.jsonl"),), root=str(tmp_path), format=SourceFormat.JSONL)
    sp, _ = tokenizer.load(path)
    keys = [f"s/a.jsonl:{i}" for i in range(1, 21)] + [f"s/a.jsonl:{i}" for i in range(23, 53)]
    expected = sorted((k, sp.encode(t) + [2]) for k, t in zip(keys, texts))
    spill_dir = str(tmp_path / "spill") if spill else None
    dofn = pipeline.ReadAndTokenize({"s": src}, path, sha, False, True, "uint16", 3, {"s": 4}, spill_dir,
                                    batch_docs=7, flush_bytes=500)
    with BeamTestPipeline(argv=RUNNER) as p:
        out = (
            p
            | beam.Create([("s", str(tmp_path / "a.jsonl"), (tmp_path / "a.jsonl").stat().st_size)])
            | beam.ParDo(dofn).with_outputs(pipeline.REJECTED, pipeline.STATS, main="staged")
        )
        grouped = out.staged | beam.GroupByKey() | beam.MapTuple(lambda g, vs: (g, _records(vs)))
        assert_that(
            grouped | beam.FlatMap(lambda gv: [(gv[0], k) for k, _ in gv[1]]),
            equal_to([(("s", packing.bucket_of(3, "s", k, 4)), k) for k, _ in expected]),
            "buckets",
        )
        assert_that(grouped | beam.FlatMap(lambda gv: gv[1]), equal_to(expected), "tokens")
        assert_that(
            out[pipeline.REJECTED] | beam.Map(lambda r: r[1:3]),
            equal_to([("s/a.jsonl:21", "invalid_json"), ("s/a.jsonl:22", "empty_after_tokenization")]),
            "rejected",
        )
        assert_that(
            out[pipeline.STATS],
            equal_to([("read", "s", 52), ("tokens_in", "s", sum(len(t) for _, t in expected))]),
            "stats",
        )
    if spill:  # several flushes (500 bytes each), one spill file each; the run's driver removes them
        assert len(list((tmp_path / "spill").glob("*.seg"))) > 3


def test_stager_inline_and_spilled_give_the_same_records(tmp_path):
    payloads = [("g1", "k1", np.arange(5, dtype=np.uint16), ""), ("g2", "k2", b"xyz", ""), ("g1", "k3", b"", ""),
                ("g1", "k\u00e9", np.arange(3, dtype=np.uint32), "https://x/\u00e9")]
    results = []
    for spill in (None, str(tmp_path / "sp")):
        stager = staging.Stager(spill, flush_bytes=10)
        flushed = []
        for g, k, p, i in payloads:
            stager.add(g, k, p, doc_id=i)
            if stager.full():
                flushed += stager.flush()
        flushed += stager.flush()
        assert stager.flush() == []
        by_group = {}
        for g, v in flushed:
            by_group.setdefault(g, []).append(v)
        out = {}
        for g, values in sorted(by_group.items()):
            group = staging.StagedGroup(values)
            n = len(group)
            data = group.gather(np.arange(n)[::-1], np.zeros(n, np.int64), group.nbytes[::-1])[::-1]
            out[g] = list(zip(group.keys, map(bytes, data), group.ids or [None] * n))
        results.append(out)
    assert results[0] == results[1] == {
        "g1": [("k1", np.arange(5, dtype=np.uint16).tobytes(), ""), ("k3", b"", ""),
               ("k\u00e9", np.arange(3, dtype=np.uint32).tobytes(), "https://x/\u00e9")],
        "g2": [("k2", b"xyz", None)],  # no record of the group has an id
    }
    assert len(staging.StagedGroup([])) == 0
    staging.remove_spill(str(tmp_path / "sp"))
    assert not (tmp_path / "sp").exists()


def test_segment_header_round_trips_and_rejects_truncation():
    header = staging.encode_header(["a", "\u00e9t\u00e9", ""], [3, 0, 7])
    keys, ids, lengths, size = staging.decode_header(header + b"payload")
    assert (keys, ids, lengths.tolist(), size) == (["a", "\u00e9t\u00e9", ""], None, [3, 0, 7], len(header))
    with_ids = staging.encode_header(["a", "b"], [1, 2], ["", "id-b"])
    assert staging.decode_header(with_ids)[:2] == (["a", "b"], ["", "id-b"])
    for cut in (2, 10, len(header) - 1):
        with pytest.raises(ValueError, match="segment header truncated"):
            staging.decode_header(header[:cut])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.text(min_size=1).filter(lambda t: "/" not in t), st.text(), st.integers(1, 10**5))
def test_bucket_of_many_keys_equals_bucket_of(seed, source, key, n):
    assert packing.BucketOf(seed, source, n)(key) == packing.bucket_of(seed, source, key, n)


def test_dead_letter_keeps_raw_input():
    assert pipeline.dead_letter("s", "k", "invalid_utf8", b"\xff", "x") == {
        "source": "s",
        "key": "k",
        "reason": "invalid_utf8",
        "detail": "x",
        "raw_base64": "/w==",
    }
    assert pipeline.dead_letter("s", "k", "invalid_unicode", "a\ud800", "")["raw_base64"] == "Ye2ggA=="
    assert pipeline.dead_letter("s", "k", "empty_after_tokenization", "  ", "")["raw"] == "  "
