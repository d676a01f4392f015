"""Progress lines, step durations and report.png of a packing run (dataprep.progress, dataprep.report)."""

import io
import re
import struct

import pytest
import yaml

from dataprep import pack, progress, testing


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_plain_lines_every_interval_and_step_durations():
    clock, out = _Clock(), io.StringIO()
    m = progress.Monitor(100_000_000, 4, out, interval=10, terminal=False, clock=clock)
    clock.t += 5
    m.update({})
    assert out.getvalue() == ""  # under 10 s: nothing yet
    clock.t += 5
    m.update({})
    read = {"first": 1001.0, "last": 1010.0, "documents": 1200, "bytes": 25_000_000}
    tok = {"first": 1001.0, "last": 1010.0, "tokens": 12_000_000}
    clock.t += 10
    m.update({"read": read, "tokenize": tok})
    clock.t += 3
    m.update({"read": read, "tokenize": tok})  # 3 s after the last line: no line
    done = {"read": {**read, "last": 1030.0, "bytes": 100_000_000},
            "tokenize": {**tok, "last": 1030.0, "tokens": 48_000_000}}
    clock.t = 1032.0
    m.update({**done, "pack": {"first": 1031.0, "last": 1032.0, "shards": 1, "rows": 100, "tokens": 800_000}})
    clock.t = 1042.0
    m.update({**done, "pack": {"first": 1031.0, "last": 1041.0, "shards": 2, "rows": 2000, "tokens": 16_000_000}})
    clock.t = 1050.0
    m.update({**done, "pack": {"first": 1031.0, "last": 1049.0, "shards": 4, "rows": 4000, "tokens": 32_000_000}},
             final=True)
    assert out.getvalue().splitlines() == [
        "pack: started 10 s ago, no document read yet (workers starting)",
        "pack: read 25.0 MB of 100.0 MB (25%), 1,200 documents, 12.0 M tokens, 0.6 M tokens/s, ETA 1 min 00 s",
        "pack: read and tokenize done in 30 s (48.0 M tokens, 1.6 M tokens/s)",
        "pack: wrote 1 of 4 shards, 100 rows, 0.8 M tokens, ETA 6.0 s",
        "pack: wrote 2 of 4 shards, 2,000 rows, 16.0 M tokens, ETA 12 s",
        "pack: pack and write done in 19 s (4 shards, 4,000 rows)",
    ]
    assert m.durations == {"read and tokenize": 30.0, "pack and write": 19.0}


def test_bar_on_a_terminal_shows_both_steps():
    out = io.StringIO()
    m = progress.Monitor(1000, 2, out, terminal=True)
    m.update({"read": {"first": 0, "last": 1, "bytes": 500, "documents": 3}, "tokenize": {"first": 0, "last": 1, "tokens": 9}})
    m.update({"read": {"first": 0, "last": 1, "bytes": 1000, "documents": 6},
              "tokenize": {"first": 0, "last": 1, "tokens": 20},
              "pack": {"first": 2, "last": 3, "shards": 2, "rows": 5, "tokens": 20}}, final=True)
    m.close()
    text = out.getvalue()
    assert "read and tokenize" in text and "pack and write" in text and "5 rows" in text


@pytest.mark.parametrize("duration, text", [(0.25, "0.2 s"), (9.94, "9.9 s"), (59.6, "1 min 00 s"),
                                             (125, "2 min 05 s"), (3725, "1 h 02 min")])
def test_duration(duration, text):
    assert progress.duration(duration) == text


def test_worker_noise_is_recognized():
    assert progress.is_worker_noise("INFO:__main__:Logging handler created.\n")
    assert progress.is_worker_noise("WARNING:__main__:No semi_persistent_directory found: ...\n")
    assert not progress.is_worker_noise("Traceback (most recent call last):\n")
    assert not progress.is_worker_noise("pack: read 1.0 MB of 2.0 MB (50%)\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("progress")
    sha = testing.train_small_tokenizer(str(d / "tok.model"))
    for path in testing.write_pydoc_jsonl(d / "in", 4, 300_000):
        with open(path, "a") as f:
            f.write("not json\n")
    raw = {"name": "prog", "version": 3, "seq_len": 256, "shards_per_source": 3,
           "tokenizer": {"path": "tok.model", "sha256": sha},
           "sources": [{"name": "docs", "paths": ["in/p[01].jsonl"], "format": "jsonl", "weight": 0.25},
                       {"name": "more", "paths": ["in/p[23].jsonl"], "format": "jsonl", "weight": 0.75}],
           "phases": [{"from_step": 100, "weights": {"docs": 0.5, "more": 0.5}}]}
    (d / "mix.yaml").write_text(yaml.safe_dump(raw))
    return d


def test_progress_lines_when_stderr_is_not_a_terminal(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    assert pack.main(["--config", str(corpus / "mix.yaml"), "--output", str(out), "--progress-every", "0.001"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    patterns = [
        r"pack: checks done in \d+\.\d s \(4 files, 0\.3 MB; shards: docs 3, more 3\)",
        r"pack: (started .* ago, no document read yet \(workers starting\)|read [\d.]+ MB of 0\.3 MB \(\d+%\), "
        r"[\d,]+ documents, [\d.,]+ (M )?tokens, [\d.]+ M tokens/s(, ETA .*)?)",
        r"pack: read and tokenize done in [\d.]+ s \([\d.,]+ (M )?tokens, [\d.]+ M tokens/s\)",
        r"pack: pack and write done in [\d.]+ s \(6 shards, [\d,]+ rows\)",
        rf"pack: manifest written in [\d.]+ s: {re.escape(str(out / 'manifest.json'))}",
        rf"pack: report drawn in [\d.]+ s: {re.escape(str(out / 'report.png'))}",
        r"pack: done in [\d.]+ s \(checks [\d.]+ s, read and tokenize [\d.]+ s, pack and write [\d.]+ s, "
        r"manifest [\d.]+ s, report [\d.]+ s\)",
    ]
    # how long an epoch of each source lasts (no planned run given), after the manifest
    at = lines.index("pack: epochs (pass --train-steps or --train-tokens with --global-batch for those of a "
                     "planned run):")
    assert re.fullmatch(r"  docs: [\d,]+ rows, one epoch every [\d,]+ rows of training \(weight 0\.25 from step 0\)",
                        lines[at + 1])
    assert re.fullmatch(r"  more: [\d,]+ rows, one epoch every [\d,]+ rows of training \(weight 0\.75 from step 0\)",
                        lines[at + 2])
    lines = lines[:at] + lines[at + 3:]
    steps = [ln for ln in lines if re.search(r" (done|written|drawn) in ", ln)]
    for pattern, line in zip([patterns[0]] + patterns[2:], steps, strict=True):
        assert re.fullmatch(pattern, line), line
    ticks = [ln for ln in lines if ln not in steps]
    assert ticks and all(re.fullmatch(patterns[1], ln) or ln.startswith("pack: wrote ") for ln in ticks), ticks
    assert lines.index(steps[1]) > lines.index(ticks[0])  # progress came before the step ended
    # --quiet: nothing on stderr
    assert pack.main(["--config", str(corpus / "mix.yaml"), "--output", str(out), "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_report_png_is_drawn_next_to_the_manifest_and_reproduces(corpus, tmp_path):
    a = pack.run(["--config", str(corpus / "mix.yaml"), "--output", str(tmp_path / "a")], print_summary=False)
    pack.run(["--config", str(corpus / "mix.yaml"), "--output", str(tmp_path / "b")], print_summary=False)
    assert a.report == str(tmp_path / "a/report.png")
    data = (tmp_path / "a/report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1600, 1200)
    assert data == (tmp_path / "b/report.png").read_bytes()
    assert "report.png" not in (tmp_path / "a/manifest.json").read_text()  # a view, not part of the dataset
    assert not (tmp_path / "c").exists()
    pack.run(["--config", str(corpus / "mix.yaml"), "--output", str(tmp_path / "c"), "--no-report"], print_summary=False)
    assert not (tmp_path / "c/report.png").exists()


def test_counters_of_a_distributed_run_become_stages():
    """What the driver polls on Dataflow: Beam counters summed over sources."""
    counters = {"web.read": 10, "web.bytes_read": 1000, "web.tokens_in": 500, "code.read": 2,
                "code.bytes_read": 50, "code.tokens_in": 40, "web.rejected.invalid_json": 1}
    assert progress.counters_as_stages(counters, 1.0, 2.0) == {
        "read": {"first": 1.0, "last": 2.0, "documents": 12, "bytes": 1050},
        "tokenize": {"first": 1.0, "last": 2.0, "tokens": 540},
    }
    counters.update({"web.rows": 7, "web.shards": 1, "web.tokens_packed": 300})
    assert progress.counters_as_stages(counters, 1.0, 2.0)["pack"] == {
        "first": 1.0, "last": 2.0, "shards": 1, "rows": 7, "tokens": 300}
