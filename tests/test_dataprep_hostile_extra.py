"""Regression tests for what a hostile review of dataprep broke (configs, inputs, output folder).

Each test pins one fixed failure: a config mistake that crashed or passed silently, an input
that was lost silently or crashed the pipeline, an output folder problem found only at the
pipeline's last step, a Beam option dropped silently.
"""

import gzip
import json
import os
import pathlib
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from contract.config import ConfigError, SourceConfig, SourceFormat, TextSplit, load_mixture, mixture_from_dict
from dataprep import pack, preflight, readers, testing

REPO = pathlib.Path(__file__).resolve().parents[1]


def _base(**extra):
    cfg = {
        "name": "t",
        "version": 1,
        "tokenizer": {"path": "tok.model"},
        "sources": [{"name": "a", "paths": ["in/*.jsonl"], "format": "jsonl"}],
    }
    cfg.update(extra)
    return cfg


def _src(root, fmt, split=TextSplit.FILE):
    return SourceConfig(name="s", paths=(str(root),), root=str(root), format=SourceFormat(fmt), text_split=split)


def _items(root, fmt, name, data, split=TextSplit.FILE):
    p = pathlib.Path(root) / name
    p.write_bytes(data)
    return list(readers.read_file(_src(root, fmt, split), str(p)))


# --- config ----------------------------------------------------------------------------


def test_step0_phase_with_non_numeric_weight_is_a_config_error():
    # Was: ValueError "could not convert string to float" (a traceback, not exit status 2).
    raw = _base(phases=[{"from_step": 0, "weights": {"a": "x"}}])
    with pytest.raises(ConfigError, match=r"^phases\[0\]\.weights\.a: must be a number, got 'x'$"):
        mixture_from_dict(raw, base_dir="/d")
    raw = _base(phases=[{"from_step": 0, "weights": {"a": 1.0, "zz": 1.0}}])
    with pytest.raises(ConfigError, match=r"phases\[0\]\.weights: unknown source\(s\) \['zz'\]"):
        mixture_from_dict(raw, base_dir="/d")
    # The normalized form still reads back (manifest.json writes the step-0 phase).
    cfg = mixture_from_dict(_base(), base_dir="/d")
    assert mixture_from_dict(cfg.to_dict(), base_dir="/d") == cfg


def test_yaml_key_given_twice_is_a_config_error(tmp_path):
    # Was: the last value won silently (weight 1 then weight 0 gave weight 0).
    p = tmp_path / "mix.yaml"
    p.write_text(
        "name: t\nversion: 1\ntokenizer: {path: tok.model}\nsources:\n"
        "  - name: a\n    paths: [in/a.jsonl]\n    format: jsonl\n    weight: 1\n    weight: 0\n"
    )
    with pytest.raises(ConfigError) as e:
        load_mixture(str(p))
    assert "found duplicate key 'weight' (first at line 8)" in str(e.value)
    assert 'line 9' in str(e.value)


@pytest.mark.parametrize("name", ["errors", "Errors", "manifest.json", "MANIFEST.JSON"])
def test_source_names_that_collide_with_the_dataset_layout_are_refused(name):
    # Was: accepted; a source "manifest.json" makes <output>/manifest.json a folder, and a
    # source "errors" mixes its shards into the dead-letter folder.
    raw = _base()
    raw["sources"][0]["name"] = name
    with pytest.raises(ConfigError, match=r"^sources\[0\]\.name: '.*' is reserved"):
        mixture_from_dict(raw, base_dir="/d")


def test_config_path_that_is_a_folder_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):
        load_mixture(str(tmp_path))


# --- preflight -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    sha = testing.train_small_tokenizer(str(d / "tok.model"))
    return d / "tok.model", sha


def _write_config(d, tok_path, sources, **extra):
    cfg = {"name": "t", "version": 1, "tokenizer": {"path": str(tok_path)}, "sources": sources}
    cfg.update(extra)
    (d / "mix.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return d / "mix.yaml"


def test_glob_matching_folders_and_fifos_keeps_only_files(tmp_path, tok):
    (tmp_path / "in/sub.jsonl").mkdir(parents=True)
    (tmp_path / "in/a.jsonl").write_text('{"text": "x"}\n')
    os.mkfifo(tmp_path / "in/pipe.jsonl")  # reading it would block the pipeline for ever
    cfg = load_mixture(str(_write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/*"], "format": "jsonl"}])))
    assert preflight.match_inputs(cfg) == {"a": (str(tmp_path / "in/a.jsonl"),)}


def test_explicit_folder_path_is_a_config_error(tmp_path, tok):
    # Was: accepted; the folder was then "read" and reported as an unreadable file.
    (tmp_path / "in/d.jsonl").mkdir(parents=True)
    cfg = load_mixture(str(_write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/d.jsonl"], "format": "jsonl"}])))
    with pytest.raises(ConfigError, match=r"^.*/mix\.yaml: sources\[0\]\.paths\[0\]: '.*/in/d.jsonl' is a folder"):
        preflight.match_inputs(cfg)
    cfg = load_mixture(str(_write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/*"], "format": "jsonl"}])))
    # the message names the config file as well as the field
    with pytest.raises(ConfigError) as e:
        preflight.match_inputs(cfg)
    assert str(e.value) == (
        f"{tmp_path}/mix.yaml: sources[0].paths[0]: '{tmp_path}/in/*' matches no file; check the path (relative "
        f"paths are read from the config file's folder {tmp_path}): {tmp_path}/in holds: d.jsonl")


def test_a_path_that_matches_nothing_says_where_relative_paths_start_and_what_is_there(tmp_path, tok):
    # Was: "sources[0].paths[0]: '.../data/*.jsonl' matches no file", with no next step.
    (tmp_path / "in").mkdir()
    for name in ("a.json", "b.txt"):
        (tmp_path / "in" / name).write_text("{}\n")
    for path, tail in (("in/*.jsonl", f"{tmp_path}/in holds: a.json, b.txt"),
                       ("data/x/*.jsonl", f"{tmp_path}/data does not exist; {tmp_path} holds: in, mix.yaml")):
        cfg = load_mixture(str(_write_config(tmp_path, tok[0], [{"name": "a", "paths": [path], "format": "jsonl"}])))
        with pytest.raises(ConfigError) as e:
            preflight.match_inputs(cfg)
        assert str(e.value) == (f"{tmp_path}/mix.yaml: sources[0].paths[0]: '{tmp_path}/{path}' matches no file; check "
                                f"the path (relative paths are read from the config file's folder {tmp_path}): {tail}")


def test_a_tokenizer_sha256_mismatch_says_to_point_at_the_right_model_or_pin_it(tmp_path, tok):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.jsonl").write_text('{"text": "x"}\n')
    cfg = load_mixture(str(_write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/*"], "format": "jsonl"}])))
    import dataclasses

    cfg = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, sha256="0" * 64))
    sha = tok[1]
    with pytest.raises(ConfigError) as e:
        preflight.preflight(cfg)
    assert str(e.value) == (
        f"{tmp_path}/mix.yaml: tokenizer.sha256: the config pins {'0' * 64}, but {tok[0]} has sha256 {sha}; point "
        f"tokenizer.path at the model the pin is for, or, if {tok[0]} is the right model, pin it: set "
        f"tokenizer.sha256: {sha} (python -m dataprep.train_tokenizer ... --pin writes it when it trains a model)")


def test_file_name_that_is_not_utf8_is_a_config_error_before_any_work(tmp_path, tok):
    # Was: UnicodeEncodeError from Beam's Create while building the pipeline (a traceback).
    (tmp_path / "in").mkdir()
    (tmp_path / "in/ok.jsonl").write_text('{"text": "x"}\n')
    with open(os.path.join(os.fsencode(tmp_path / "in"), b"bad\xffname.jsonl"), "wb") as f:
        f.write(b'{"text": "y"}\n')
    cfg_path = _write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/*.jsonl"], "format": "jsonl"}])
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"sources\[0\]\.paths\[0\]: .* matches the file b'.*bad\\xffname\.jsonl'"):
        pack.run(["--config", str(cfg_path), "--output", str(out)], print_summary=False)
    assert not out.exists()


def test_file_name_with_glob_characters_given_literally(tmp_path, tok):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a[1].jsonl").write_text('{"text": "x"}\n')
    cfg = load_mixture(str(_write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/a[1].jsonl"], "format": "jsonl"}])))
    assert preflight.match_inputs(cfg) == {"a": (str(tmp_path / "in/a[1].jsonl"),)}


# --- readers ---------------------------------------------------------------------------


def test_bom_at_file_start_is_not_part_of_the_first_document(tmp_path):
    # Was: the first JSONL line of a file with a BOM was rejected as invalid JSON.
    got = _items(tmp_path, "jsonl", "b.jsonl", b'\xef\xbb\xbf{"text": "one"}\r\n{"text": "two"}\n')
    assert got == [readers.Document("s/b.jsonl:1", "one"), readers.Document("s/b.jsonl:2", "two")]
    got = _items(tmp_path, "jsonl", "only.jsonl", b"\xef\xbb\xbf\n")
    assert got == []
    # Files with BOMs concatenated ("cat a.jsonl b.jsonl"): the BOM starts a later line.
    got = _items(tmp_path, "jsonl", "cat.jsonl", b'\xef\xbb\xbf{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\n')
    assert got == [readers.Document("s/cat.jsonl:1", "a"), readers.Document("s/cat.jsonl:2", "b")]
    got = _items(tmp_path, "text", "b.txt", b"\xef\xbb\xbfplain text\r\n")
    assert got == [readers.Document("s/b.txt:0", "plain text\r\n")]
    got = _items(tmp_path, "text", "k.txt", b"\xef\xbb\xbf\n\nblock one\n\nblock two\n", TextSplit.BLANK_LINES)
    assert got == [readers.Document("s/k.txt:0", "block one"), readers.Document("s/k.txt:1", "block two")]


def _lines(n):
    return b"".join(b'{"text": "line %d %s"}\n' % (i, str(i * 7919 % 1000003).encode() * 20) for i in range(n))


def test_truncated_zst_is_a_dead_letter_not_a_silent_loss(tmp_path):
    # Was: zstandard's stream_reader ends a truncated stream cleanly: no document, no dead
    # letter, the file vanished from the ledger.
    z = zstandard.ZstdCompressor(level=3).compress(_lines(20000))
    got = _items(tmp_path, "jsonl.zst", "t.jsonl.zst", z[: len(z) // 2])
    docs, last = got[:-1], got[-1]
    assert all(isinstance(d, readers.Document) for d in docs)
    assert [d.key for d in docs] == [f"s/t.jsonl.zst:{i}" for i in range(1, len(docs) + 1)]
    assert len(docs) > 1000  # the complete lines before the cut are kept
    assert last.key == "s/t.jsonl.zst:file" and last.reason is readers.Reason.UNREADABLE_FILE
    assert last.detail == "ZstdError: zstd stream ends inside a frame (truncated file)"
    assert _lines(20000).startswith(b"".join(json.dumps({"text": d.text}).encode() + b"\n" for d in docs) + last.raw)
    # Several frames back to back read as one stream; an empty file is no document.
    two = _items(tmp_path, "jsonl.zst", "two.jsonl.zst", zstandard.ZstdCompressor().compress(_lines(3)) * 2)
    assert [d.key for d in two] == [f"s/two.jsonl.zst:{i}" for i in range(1, 7)]
    assert _items(tmp_path, "jsonl.zst", "e.jsonl.zst", b"") == []


def test_truncated_gz_keeps_the_lines_before_the_cut(tmp_path):
    # Was: the whole last 1 MB read buffer (every line of a small file) was lost.
    g = gzip.compress(_lines(20000), mtime=0)
    got = _items(tmp_path, "jsonl.gz", "t.jsonl.gz", g[: len(g) // 2])
    docs, last = got[:-1], got[-1]
    assert len(docs) > 1000 and all(isinstance(d, readers.Document) for d in docs)
    assert last.key == "s/t.jsonl.gz:file" and last.reason is readers.Reason.UNREADABLE_FILE
    assert last.detail.startswith("EOFError: Compressed file ended before the end-of-stream marker")
    assert _lines(20000).startswith(b"".join(json.dumps({"text": d.text}).encode() + b"\n" for d in docs) + last.raw)


def test_parquet_binary_text_column_is_read_as_utf8(tmp_path):
    # Was: every row of a BINARY (no UTF8 annotation) column rejected as non_string_text.
    pq.write_table(pa.table({"text": pa.array([b"caf\xc3\xa9", b"\xff\xfe", None], pa.binary())}), tmp_path / "b.parquet")
    got = list(readers.read_file(_src(tmp_path, "parquet"), str(tmp_path / "b.parquet")))
    assert got[0] == readers.Document("s/b.parquet:0", "café")
    assert (got[1].key, got[1].reason, got[1].raw) == ("s/b.parquet:1", readers.Reason.INVALID_UTF8, b"\xff\xfe")
    assert (got[2].key, got[2].reason) == ("s/b.parquet:2", readers.Reason.NON_STRING_TEXT)


# --- the command -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("small")
    (d / "in").mkdir()
    (d / "in/a.jsonl").write_bytes(
        b'\xef\xbb\xbf{"text": "first after a BOM"}\n{"text": "</s> <unk>"}\nnot json\n{"text": null}\n'
    )
    z = zstandard.ZstdCompressor().compress(_lines(200))
    (d / "in/t.jsonl.zst").write_bytes(z[: len(z) // 2])
    cfg = _write_config(
        d,
        tok[0],
        [
            {"name": "a", "paths": ["in/*.jsonl"], "format": "jsonl"},
            # A truncated file: it rejects all it reads and packs nothing, allowed at weight 0 only.
            {"name": "z", "paths": ["in/*.jsonl.zst"], "format": "jsonl.zst", "weight": 0.0},
        ],
        seq_len=16,
        shards_per_source=2,
        max_rejected_fraction=1.0,  # hostile on purpose
    )
    return d, cfg


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


def test_hostile_small_run_reconciles_and_reruns_identically(small, tmp_path):
    d, cfg = small
    out = tmp_path / "ds"
    m = pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False).manifest
    a, z = m.sources["a"].ledger, m.sources["z"].ledger
    assert (a.read, a.packed, a.rejected) == (4, 2, {"invalid_json": 1, "non_string_text": 1})
    assert z.read == z.packed + 1 and z.rejected == {"unreadable_file": 1}
    assert m.problems() == []
    letters = [json.loads(x) for p in sorted((out / "errors").glob("*.jsonl")) for x in p.read_text().splitlines()]
    assert sorted((x["key"], x["reason"]) for x in letters) == [
        ("a/a.jsonl:3", "invalid_json"),
        ("a/a.jsonl:4", "non_string_text"),
        ("z/t.jsonl.zst:file", "unreadable_file"),
    ]
    # A crash before the commit (manifest missing, shards present), then a rerun: same bytes.
    first = _files(out)
    (out / "manifest.json").unlink()
    pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    assert _files(out) == first


def test_rerun_with_fewer_shards_removes_stale_shards(small, tmp_path):
    d, cfg = small
    out = tmp_path / "ds"
    pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    raw = yaml.safe_load(cfg.read_text())
    raw["shards_per_source"] = 1
    cfg1 = d / "mix1.yaml"
    cfg1.write_text(yaml.safe_dump(raw))
    pack.run(["--config", str(cfg1), "--output", str(out), "--overwrite"], print_summary=False)
    assert sorted(p.name for p in (out / "a").iterdir()) == ["data-00000-of-00001.array_record"]
    assert sorted(p.name for p in (out / "z").iterdir()) == ["data-00000-of-00001.array_record"]


def test_output_that_is_a_file_fails_before_any_work(small, tmp_path):
    # Was: a NotADirectoryError traceback from the pipeline's last step.
    _, cfg = small
    f = tmp_path / "afile"
    f.write_bytes(b"keep me")
    with pytest.raises(pack.OutputNotAFolderError, match=r"^--output .*/afile is a file, not a folder$"):
        pack.run(["--config", str(cfg), "--output", str(f)], print_summary=False)
    with pytest.raises(pack.OutputNotAFolderError, match=r"^--output .*/afile/ds is inside .*/afile, which is a file"):
        pack.run(["--config", str(cfg), "--output", str(f / "ds")], print_summary=False)
    assert pack.main(["--config", str(cfg), "--output", str(f / "ds")]) == pack.EXIT_CONFIG
    assert f.read_bytes() == b"keep me"


def test_unknown_option_is_an_error_not_silently_dropped(small, tmp_path):
    # Was: "--overwite" (a typo) or "--direct_num_worker=2" were dropped by Beam with a warning.
    _, cfg = small
    out = tmp_path / "ds"
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['--overwite'\]"):
        pack.run(["--config", str(cfg), "--output", str(out), "--overwite"], print_summary=False)
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['stray', '-x'\]"):
        pack.run(["--config", str(cfg), "--output", str(out), "stray", "-x"], print_summary=False)
    o = pack.pipeline_options(["--runner", "DataflowRunner", "--project", "p", "--region", "r",
                               "--temp_location", "gs://b/t", "--setup_file", "./pyproject.toml",
                               "--experiments=use_runner_v2", "--save_main_session", "--labels", "k=v"])
    assert o.get_all_options()["project"] == "p"
    assert pack.main(["--config", str(cfg), "--output", str(out), "--direct_num_worker=2"]) == pack.EXIT_CONFIG
    assert not out.exists()


def test_bad_runner_with_overwrite_keeps_the_committed_dataset(small, tmp_path):
    # Was: manifest.json deleted (--overwrite) before Beam refused the runner name.
    _, cfg = small
    out = tmp_path / "ds"
    pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    before = _files(out)
    with pytest.raises(ConfigError, match="Beam options: Unexpected pipeline runner: Bogus"):
        pack.run(["--config", str(cfg), "--output", str(out), "--overwrite", "--runner", "Bogus"], print_summary=False)
    assert _files(out) == before


@pytest.mark.parametrize("form", [["-m", "dataprep.pack"], ["dataprep/pack.py"]])
def test_help_is_complete(form):
    proc = subprocess.run([sys.executable, *form, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for needle in ("--config", "--output", "--overwrite", "Beam pipeline option", "DataflowRunner", "exit status"):
        assert needle in proc.stdout


def test_empty_output_is_refused_not_the_root_folder(small):
    # Was: "" became "/" (rstrip("/") or "/"), so the dataset would go to the root folder.
    _, cfg = small
    with pytest.raises(ConfigError, match=r"^--output: must name a folder, got an empty string$"):
        pack.run(["--config", str(cfg), "--output", ""], print_summary=False)


def test_same_file_through_a_symlink_in_two_sources_is_a_config_error(tmp_path, tok):
    # Was: accepted; every document of the file was packed twice, under two keys.
    (tmp_path / "in/a").mkdir(parents=True)
    (tmp_path / "in/b").mkdir()
    (tmp_path / "in/a/x.jsonl").write_text('{"text": "x"}\n')
    os.symlink(tmp_path / "in/a/x.jsonl", tmp_path / "in/b/y.jsonl")
    cfg = load_mixture(
        str(
            _write_config(
                tmp_path,
                tok[0],
                [
                    {"name": "a", "paths": ["in/a/*.jsonl"], "format": "jsonl"},
                    {"name": "b", "paths": ["in/b/*.jsonl"], "format": "jsonl"},
                ],
            )
        )
    )
    with pytest.raises(
        ConfigError, match=r"^.*/mix\.yaml: sources\[1\]\.paths: .*/in/b/y\.jsonl is also an input of source 'a' \(as .*/in/a/x\.jsonl\)"
    ):
        preflight.match_inputs(cfg)


# --- tokenizer training ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        # SentencePiece's own message named its flag --character_coverage, not an option of this command.
        (["--vocab-size", "20"], r"SentencePiece refused to train: the sample's characters \(at --character-coverage "
                                 r"0\.9995\) and the special pieces need \d+ pieces, more than --vocab-size 20; set "
                                 r"--vocab-size to at least \d+, or lower --character-coverage\n"),
        (["--vocab-size", "300", "--character-coverage", "0"], r"--character-coverage must be in \(0, 1\], got 0\.0"),
        (["--vocab-size", "300", "--seed", "-1"], r"--seed \(default: the config's seed\) must be an integer in \[0, 2\*\*32\), got -1"),
        (["--vocab-size", "300", "--max-sentences", "0"], "--max-sentences must be >= 1, got 0"),
        (["--vocab-size", "300", "--out", "{d}"], "--out {d} is a folder; name the model file"),
        (["--vocab-size", "300", "--out", "{d}/mix.yaml/t.model"], "--out {d}/mix.yaml/t.model is inside {d}/mix.yaml, which is a file"),
    ],
)
def test_train_tokenizer_mistakes_are_errors_not_tracebacks(small, args, message, capsys):
    # Was: tracebacks (RuntimeError, OverflowError/TypeError, ValueError, IsADirectoryError,
    # FileExistsError) from SentencePiece or the file system.
    from dataprep import train_tokenizer

    d, cfg = small
    args = [a.replace("{d}", str(d)) for a in args]
    if "--out" not in args:
        args += ["--out", str(d / "never.model")]
    assert train_tokenizer.main(["--config", str(cfg), *args]) == 2
    import re

    assert re.search(message.replace("{d}", re.escape(str(d))), capsys.readouterr().err)
    assert not (d / "never.model").exists()


# --- damaged bytes versus a failing file system ----------------------------------------


def test_damaged_deflate_stream_is_a_dead_letter_not_a_crash(tmp_path):
    # Was: zlib.error ("invalid distance too far back") escaped read_file and failed the run.
    data = bytearray(gzip.compress(_lines(20000), mtime=0))
    data[100:150] = b"\xff" * 50
    got = _items(tmp_path, "jsonl.gz", "c.jsonl.gz", bytes(data))
    assert got[-1].key == "s/c.jsonl.gz:file" and got[-1].reason is readers.Reason.UNREADABLE_FILE
    assert got[-1].detail == "error: Error -3 while decompressing data: invalid distance too far back"
    assert all(not isinstance(d, readers.Rejected) or d.reason is readers.Reason.INVALID_JSON for d in got[:-1])


class _FlakyFile:
    """A file object whose second read fails like a dropped network connection."""

    def __init__(self, data):
        self._f = __import__("io").BytesIO(data)
        self._reads = 0

    def read(self, n=-1):
        self._reads += 1
        if self._reads > 1:
            raise ConnectionResetError("connection reset by peer")
        return self._f.read(min(n, 64) if n and n > 0 else 64)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fmt, data", [("jsonl", _lines(50)), ("jsonl.gz", gzip.compress(_lines(50), mtime=0))])
def test_file_system_errors_are_raised_for_a_retry_not_turned_into_dead_letters(tmp_path, monkeypatch, fmt, data):
    # Was: any OSError became an "unreadable_file" dead letter: a transient gs:// error cut
    # the file short in one run and not the next (no byte-identical rerun, data lost).
    from dataprep import fsutil

    monkeypatch.setattr(fsutil, "open_raw", lambda path: _FlakyFile(data))
    with pytest.raises(ConnectionResetError):
        list(readers.read_file(_src(tmp_path, fmt), str(tmp_path / f"x.{fmt}")))


def test_inputs_inside_the_output_folder_are_refused(tmp_path, tok):
    # Was: accepted; with "**/*.jsonl", a rerun read the first run's errors/*.jsonl back in.
    (tmp_path / "corpus/ds/errors").mkdir(parents=True)
    (tmp_path / "corpus/ds/errors/a-00000-of-00001.jsonl").write_text('{"text": "a dead letter"}\n')
    (tmp_path / "corpus/x").mkdir()
    (tmp_path / "corpus/x/a.jsonl").write_text('{"text": "x"}\n')
    cfg = _write_config(tmp_path, tok[0], [{"name": "a", "paths": ["corpus/**/*.jsonl"], "format": "jsonl"}])
    out = tmp_path / "corpus/ds"
    with pytest.raises(ConfigError, match=r"^sources: .*/corpus/ds/errors/a-00000-of-00001\.jsonl \(source 'a'\) lies inside --output"):
        pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    assert sorted(p.name for p in out.rglob("*")) == ["a-00000-of-00001.jsonl", "errors"]


def test_source_that_packs_nothing_but_has_weight_fails_without_a_manifest(small, tmp_path, capsys):
    # Was: a warning line and exit 0; the loader refused the mixture later, on the training fleet.
    d, cfg = small
    (d / "in0").mkdir(exist_ok=True)
    (d / "in0/bad.jsonl").write_text("not json\n")
    raw = yaml.safe_load(cfg.read_text())
    raw["sources"].append({"name": "bad", "paths": ["in0/*.jsonl"], "format": "jsonl", "weight": 0.0})
    raw["phases"] = [{"from_step": 100, "weights": {"a": 1.0, "bad": 0.5}}]
    cfg2 = d / "mix-empty.yaml"
    cfg2.write_text(yaml.safe_dump(raw))
    out = tmp_path / "ds"
    assert pack.main(["--config", str(cfg2), "--output", str(out), "--quiet"]) == pack.EXIT_LOSS == 4
    err = capsys.readouterr().err
    assert err == (
        "error: a source lost too much, manifest.json not written:\n"
        "  source 'bad' packed no rows but has weight 0.5 from step 100: read 1, packed 0, rejected 1: "
        "invalid_json 1 (first: bad/bad.jsonl:1: Expecting value: line 1 column 1 (char 0)); "
        f"dead letters in {out}/errors/bad-*.jsonl\n"
        "next: fix the input or the source's format/text_field and rerun; to train without the source, "
        "set its weight to 0 in every phase (max_rejected_fraction is already 1: a source that packs no row "
        "cannot be accepted, since a loader could not draw from it)\n"
        f"report: {out}/report.png\n"
    )
    assert not (out / "manifest.json").exists() and (out / "report.png").exists()
    assert not (out / "_stats.json").exists() and not (out / "_tmp").exists()
    assert (out / "errors/bad-00000-of-00002.jsonl").exists() or (out / "errors/bad-00001-of-00002.jsonl").exists()


def test_source_rejecting_more_than_max_rejected_fraction_fails(small, tmp_path, capsys):
    d, cfg = small
    raw = yaml.safe_load(cfg.read_text())
    raw["max_rejected_fraction"] = 0.25  # "a" rejects 2 of its 4 documents; "z" all of its one
    cfg2 = d / "mix-strict.yaml"
    cfg2.write_text(yaml.safe_dump(raw))
    out = tmp_path / "ds"
    with pytest.raises(pack.DataLossError) as e:
        pack.run(["--config", str(cfg2), "--output", str(out), "--no-report"], print_summary=False)
    lines = str(e.value).splitlines()
    assert lines[1] == (
        "  source 'a' rejected 50% of its documents, over max_rejected_fraction 0.25: read 4, packed 2, "
        "rejected 2: invalid_json 1 (first: a/a.jsonl:3: Expecting value: line 1 column 1 (char 0)); "
        f"non_string_text 1 (first: a/a.jsonl:4: text is NoneType); dead letters in {out}/errors/a-*.jsonl"
    )
    # "z" (weight 0 in every phase) rejects everything too, but this mixture never draws from it:
    # it is warned about, not a reason to fail (see test_dataprep_hostile_scale.py).
    assert len(lines) == 3 and lines[2].endswith("raise max_rejected_fraction in the config (now 0.25)")
    assert not (out / "manifest.json").exists() and not (out / "report.png").exists()
    # At the limit (0.5 of "a") it packs.
    raw["max_rejected_fraction"] = 0.5
    cfg2.write_text(yaml.safe_dump(raw))
    assert pack.run(["--config", str(cfg2), "--output", str(out), "--no-report"], print_summary=False).manifest


def test_missing_parquet_column_is_a_config_error_naming_the_columns(tmp_path, tok):
    # Was: every row dead-lettered as "no column 'text'", exit 0, manifest written.
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": ["a", "b"], "id": [1, 2]}), tmp_path / "in/a.parquet")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "in/b.parquet")
    cfg = _write_config(tmp_path, tok[0], [{"name": "legal", "paths": ["in/*.parquet"], "format": "parquet"}])
    with pytest.raises(ConfigError, match=re.escape(
        f"sources[0].text_field: {tmp_path}/in/a.parquet has no column 'text'; its columns are ['body', 'id']; "
        "set text_field to the column that holds the text"
    )):
        pack.run(["--config", str(cfg), "--output", str(tmp_path / "ds")], print_summary=False)
    # A later file without the column: its rows are dead letters naming the columns it has.
    (tmp_path / "in/a.parquet").rename(tmp_path / "in/c.parquet")
    got = list(readers.read_file(load_mixture(str(cfg)).sources[0], str(tmp_path / "in/c.parquet")))
    assert [g.detail for g in got] == [
        "no column 'text'; the file has columns ['body', 'id']; set text_field to the one that holds the text"
    ] * 2
    got = _items(tmp_path, "jsonl", "d.jsonl", b'{"body": "x", "id": 1}\n')
    assert got[0].detail == "no field 'text'; the object has fields ['body', 'id']; set text_field to the one that holds the text"


def test_source_names_differing_only_in_case_are_refused():
    # Was: accepted; "Web" and "web" write to one folder on a case-insensitive file system.
    raw = _base()
    raw["sources"].append({"name": "A", "paths": ["in/*.txt"], "format": "text"})
    with pytest.raises(ConfigError, match=r"^sources\[1\]\.name: 'A' differs from source 'a' only in case$"):
        mixture_from_dict(raw, base_dir="/d")


# --- memory bombs ----------------------------------------------------------------------


def test_zstd_bomb_decompresses_in_bounded_pieces():
    # A 64 MiB run of zeros compresses to a few KiB; decompressing a whole read of it at once
    # would put it in memory in one piece (a 1 MiB bomb would be tens of GiB).
    import io

    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (64 << 20))
    assert len(bomb) < 1 << 16
    frames = readers._ZstdFrames(io.BytesIO(bomb))
    total, largest, buf = 0, 0, bytearray(1 << 20)
    while n := frames.readinto(buf):
        total += n
        largest = max(largest, len(frames._out))
    assert total == 64 << 20
    assert largest <= 1024 * 32768  # one 1 KiB feed: at most 32 MiB


def test_overlong_line_and_file_are_rejected_as_too_long(tmp_path, monkeypatch):
    # Was: a line (or whole-file document) of any size was read into memory: a gzip or zstd
    # bomb without a newline exhausted the worker.
    monkeypatch.setattr(readers, "MAX_DOCUMENT_BYTES", 100)
    got = _items(tmp_path, "jsonl.gz", "a.jsonl.gz",
                 gzip.compress(b'{"text": "ok"}\n' + b"\0" * 5000 + b'\n{"text": "after"}\n', mtime=0))
    assert [(g.key, getattr(g, "reason", None)) for g in got] == [
        ("s/a.jsonl.gz:1", None),
        ("s/a.jsonl.gz:2", readers.Reason.TOO_LONG),
        ("s/a.jsonl.gz:3", None),
    ]
    assert got[1].raw == b"\0" * 101 and got[1].detail == "5001 bytes, over the limit of 100; raw holds the first 101"
    assert got[2].text == "after"
    got = _items(tmp_path, "text", "big.txt", b"z" * 3000)
    assert (got[0].key, got[0].reason, got[0].raw) == ("s/big.txt:0", readers.Reason.TOO_LONG, b"z" * 101)
    assert got[0].detail == "3000 bytes, over the limit of 100; raw holds the first 101"
    assert _items(tmp_path, "text", "ok.txt", b"z" * 100) == [readers.Document("s/ok.txt:0", "z" * 100)]


@pytest.mark.parametrize("path", ["/dev/zero", "{d}"])
def test_tokenizer_path_that_is_no_regular_file_is_a_config_error(tmp_path, path):
    # Was: /dev/zero was read for ever (the run hung, then ran out of memory).
    path = path.replace("{d}", str(tmp_path))
    raw = _base()
    raw["tokenizer"]["path"] = path
    cfg = mixture_from_dict(raw, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^tokenizer\.path: {path} is a folder or other non-regular file"):
        preflight.check_tokenizer(cfg)


def test_unknown_url_scheme_is_a_config_error_naming_the_field(small, tmp_path):
    # Was: a ValueError traceback from Beam's FileSystems ("Unable to get filesystem ...").
    _, cfg = small
    with pytest.raises(ConfigError, match=r"^--output nofs://bucket/ds: Unable to get filesystem"):
        pack.run(["--config", str(cfg), "--output", "nofs://bucket/ds"], print_summary=False)
    raw = _base()
    raw["tokenizer"]["path"] = "nofs://bucket/tok.model"
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: Unable to get filesystem"):
        preflight.check_tokenizer(mixture_from_dict(raw, base_dir=str(tmp_path)))
    raw = _base()
    raw["sources"][0]["paths"] = ["nofs://bucket/*.jsonl"]
    with pytest.raises(ConfigError, match=r"^sources\[0\]\.paths\[0\]: Unable to get filesystem"):
        preflight.match_inputs(mixture_from_dict(raw, base_dir=str(tmp_path)))


def test_demo_with_a_bad_vocab_size_exits_2_with_a_message(tmp_path, capsys):
    # Was: a TrainError traceback.
    from dataprep import demo

    assert demo.main(["--out", str(tmp_path / "demo"), "--max-code-mb", "0.2", "--vocab-size", "5"]) == 2
    assert capsys.readouterr().err == "error: --vocab-size must be >= 16, got 5\n"


def test_output_with_glob_characters_is_refused_before_any_work(small, tmp_path):
    # Was: IndexError from the shard size check (FileSystems.match read "ds[1]" as a glob),
    # after the pipeline had written shards.
    _, cfg = small
    out = tmp_path / "ds[1]"
    with pytest.raises(ConfigError, match=r"^--output .*/ds\[1\]: must not contain the glob characters"):
        pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False)
    assert not out.exists()


def test_paths_with_spaces_and_unicode_pack(tmp_path, tok):
    (tmp_path / "in dir ü").mkdir()
    (tmp_path / "in dir ü/dóc 1.jsonl").write_text('{"text": "héllo wörld"}\n', encoding="utf-8")
    cfg = _write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in dir ü/*.jsonl"], "format": "jsonl"}])
    out = tmp_path / "out dir é"
    m = pack.run(["--config", str(cfg), "--output", str(out)], print_summary=False).manifest
    assert (m.sources["a"].ledger.read, m.sources["a"].ledger.packed) == (1, 1)
    from array_record.python.array_record_module import ArrayRecordReader
    from contract.codec import decode_row

    r = ArrayRecordReader(str(out / m.sources["a"].shards[0].path))
    assert decode_row(r.read([0])[0]).doc_keys == ("a/dóc 1.jsonl:1",)
    r.close()


@pytest.mark.parametrize(
    "text, message",
    [
        ("1: 2\nfoo: 3\nname: t\n", r"config: unknown key\(s\) \['foo', 1\]"),
        (
            "name: t\nversion: 1\ntokenizer: {path: x}\nsources:\n - {name: a, paths: [x], format: jsonl, 1: 2, foo: 3}\n",
            r"sources\[0\]: unknown key\(s\) \['foo', 1\]",
        ),
        (
            "name: t\nversion: 1\ntokenizer: {path: x}\nsources:\n - {name: a, paths: [x], format: jsonl}\n"
            "phases:\n - {from_step: 5, weights: {1: 1, b: 2}}\n",
            r"phases\[0\]\.weights: unknown source\(s\) \['b', 1\]",
        ),
    ],
)
def test_unknown_keys_of_mixed_types_are_a_config_error(tmp_path, text, message):
    # Was: TypeError "'<' not supported between instances of 'str' and 'int'" (sorting them).
    p = tmp_path / "mix.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_mixture(str(p))


def test_compressed_file_read_as_plain_jsonl_is_one_dead_letter(tmp_path):
    # Was: the compressed bytes were split at every 0x0a byte and each piece rejected (a
    # flood of invalid_utf8 / invalid_json dead letters, none saying what was wrong).
    got = _items(tmp_path, "jsonl", "a.jsonl", gzip.compress(_lines(100), mtime=0))
    assert got == [readers.Rejected("s/a.jsonl:file", readers.Reason.UNREADABLE_FILE, b"",
                                    "the file is gzip-compressed but the source's format is 'jsonl'; use 'jsonl.gz'")]
    got = _items(tmp_path, "jsonl", "b.jsonl", zstandard.ZstdCompressor().compress(_lines(100)))
    assert got[0].detail == "the file is zstd-compressed but the source's format is 'jsonl'; use 'jsonl.zst'"
    assert len(got) == 1
    # A plain file whose first line is short still reads (peek needs no 4 bytes).
    assert _items(tmp_path, "jsonl", "c.jsonl", b"{}") == [
        readers.Rejected("s/c.jsonl:1", readers.Reason.MISSING_TEXT, b"{}", "no field 'text'; the object has no fields")
    ]


def test_valid_json_line_with_a_very_long_integer_is_read(tmp_path):
    # Was: rejected as invalid_json (Python refuses int() of more than 4300 digits), though
    # the line is valid JSON and its text a string.
    data = (
        b'{"text": "ok", "n": ' + b"1" * 5000 + b"}\n"
        + b'{"text": ' + b"7" * 5000 + b"}\n"
        + b'{"text": "small", "n": 12}\n'
    )
    got = _items(tmp_path, "jsonl", "n.jsonl", data)
    assert got[0] == readers.Document("s/n.jsonl:1", "ok")
    assert (got[1].key, got[1].reason, got[1].detail) == ("s/n.jsonl:2", readers.Reason.NON_STRING_TEXT, "text is int")
    assert got[2] == readers.Document("s/n.jsonl:3", "small")


def test_utf16_jsonl_file_is_one_dead_letter_saying_so(tmp_path):
    # Was: one dead letter per line (invalid_utf8, then invalid_json for every other line).
    got = _items(tmp_path, "jsonl", "u.jsonl", '{"text": "a"}\r\n{"text": "b"}\r\n'.encode("utf-16"))
    assert got == [readers.Rejected("s/u.jsonl:file", readers.Reason.INVALID_UTF8, b"",
                                    "the file is UTF-16 (it starts with a UTF-16 byte order mark); convert it to UTF-8")]


# --- blank-line text, streamed ---------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_pieces = st.sampled_from([b"a", b"b", b" ", b"\t", b"\r", b"\n", b"\x0b", b"\x0c", b"\n\n", b"\r\n", b" \n", b"\xc3\xa9"])


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(_pieces, max_size=40))
def test_streamed_blank_line_split_equals_the_regex_split(parts):
    # Was: the whole file was read into memory and split with the regex; the stream must
    # give the same blocks.
    import io

    data = b"".join(parts)
    want = [b for b in readers._BLANK_LINES.split(data) if b.strip()]
    got = [b for b in readers.split_blank_lines(io.BufferedReader(io.BytesIO(data))) if b.strip()]
    assert got == want


def test_blank_line_blocks_are_read_in_bounded_pieces(tmp_path, monkeypatch):
    # Was: a blank-line text file was read whole (a multi-GB corpus dump exhausted a worker).
    monkeypatch.setattr(readers, "MAX_DOCUMENT_BYTES", 100)
    data = b"\xef\xbb\xbffirst block\r\n\r\n" + b"x" * 150 + b"\nmore\n\n \nlast  block\n"
    got = _items(tmp_path, "text", "b.txt", data, TextSplit.BLANK_LINES)
    assert got[0] == readers.Document("s/b.txt:0", "first block")
    # raw: the block's first bytes, up to the line that took it over the limit
    assert (got[1].key, got[1].reason, got[1].raw) == ("s/b.txt:1", readers.Reason.TOO_LONG, b"x" * 150 + b"\n")
    assert got[1].detail == "155 bytes, over the limit of 100; raw holds the first 151"
    assert got[2] == readers.Document("s/b.txt:2", "last  block")
    assert len(got) == 3
    # A long line is read in pieces; a piece that looks like a blank line is not one.
    import io

    blocks = list(readers.split_blank_lines(io.BufferedReader(io.BytesIO(b"abcdefgh   \nnext\n\nz")), piece=8))
    assert blocks == [b"abcdefgh   \nnext", b"z"]


def test_first_dead_letter_is_first_by_position_in_the_file(tmp_path, tok):
    # Was: the first by key order: line 10 ("a/a.jsonl:10" < "a/a.jsonl:2"), not line 2.
    lines = ['{"text": "good document"}'] * 12
    lines[1], lines[9] = "not json at line 2", "not json at line 10"
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.jsonl").write_text("\n".join(lines) + "\n")
    cfg = _write_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/a.jsonl"], "format": "jsonl"}],
                        max_rejected_fraction=0.1, shards_per_source=1)
    out = tmp_path / "ds"
    with pytest.raises(pack.DataLossError) as e:
        pack.run(["--config", str(cfg), "--output", str(out), "--no-report"], print_summary=False)
    assert str(e.value).splitlines()[1] == (
        "  source 'a' rejected 17% of its documents, over max_rejected_fraction 0.1: read 12, packed 10, "
        "rejected 2: invalid_json 2 (first: a/a.jsonl:2: Expecting value: line 1 column 1 (char 0)); "
        f"dead letters in {out}/errors/a-*.jsonl")
    letters = [json.loads(x)["key"] for x in (out / "errors/a-00000-of-00001.jsonl").read_text().splitlines()]
    assert letters == ["a/a.jsonl:2", "a/a.jsonl:10"]  # the dead-letter file is in input order too
