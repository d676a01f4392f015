"""Per-transform tests with TestPipeline + beam.Create + assert_that (Beam's examples style)."""

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from contract.config import SourceConfig, SourceFormat
from dataprep import packing, pipeline, testing, tokenizer

RUNNER = ["--runner=FnApiRunner"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    sha = testing.train_small_tokenizer(str(path))
    return str(path), sha


def test_read_files_splits_documents_rejections_and_counts(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "one"}\n{bad\n{"text": "two"}\n')
    src = SourceConfig(
        name="s", paths=(str(tmp_path / "*.jsonl"),), root=str(tmp_path), format=SourceFormat.JSONL
    )
    with BeamTestPipeline(argv=RUNNER) as p:
        out = (
            p
            | beam.Create([("s", str(tmp_path / "a.jsonl"))])
            | beam.ParDo(pipeline.ReadFiles({"s": src})).with_outputs(
                pipeline.REJECTED, pipeline.STATS, main="docs"
            )
        )
        assert_that(out.docs, equal_to([("s", "s/a.jsonl:1", "one"), ("s", "s/a.jsonl:3", "two")]), "docs")
        rejected = out[pipeline.REJECTED] | beam.Map(lambda r: r[:3])
        assert_that(rejected, equal_to([("s", "s/a.jsonl:2", "invalid_json")]), "rejected")
        assert_that(out[pipeline.STATS], equal_to([("read", "s", 3)]), "stats")


def test_tokenize_batches_and_rejects_empty(tok):
    path, sha = tok
    texts = [f"Document number {i} about Python." for i in range(50)] + [" "]
    sp, _ = tokenizer.load(path)
    expected = [("s", f"k{i}", sp.encode(t) + [2]) for i, t in enumerate(texts[:-1])]
    with BeamTestPipeline(argv=RUNNER) as p:
        out = (
            p
            | beam.Create([("s", f"k{i}", t) for i, t in enumerate(texts)])
            | beam.ParDo(pipeline.Tokenize(path, sha, False, True, "uint16", batch_docs=7)).with_outputs(
                pipeline.REJECTED, pipeline.STATS, main="tokens"
            )
        )
        as_lists = out.tokens | beam.Map(lambda e: (e[0], e[1], e[2].tolist()))
        assert_that(as_lists, equal_to(expected), "tokens")
        assert_that(
            out[pipeline.REJECTED] | beam.Map(lambda r: r[1:3]),
            equal_to([("k50", "empty_after_tokenization")]),
            "rejected",
        )
        total = out[pipeline.STATS] | beam.Map(lambda s: s[2]) | beam.CombineGlobally(sum)
        assert_that(total, equal_to([sum(len(t) for _, _, t in expected)]), "tokens_in")


def test_chunk_and_bucket():
    out = list(pipeline.chunk_and_bucket(("web", "web/a:1", np.arange(20, dtype=np.uint16)), 3, 8, 5))
    bucket = packing.bucket_of(3, "web", "web/a:1", 5)
    assert [(k, v[0], v[1], v[2].tolist()) for k, v in out] == [
        (("web", bucket), "web/a:1", 0, list(range(8))),
        (("web", bucket), "web/a:1", 1, list(range(8, 16))),
        (("web", bucket), "web/a:1", 2, list(range(16, 20))),
    ]


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
