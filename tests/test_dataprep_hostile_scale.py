"""Regression tests for a hostile review of dataprep at corpus scale (issue 9's rework).

Each test pins one fault found by using the pipeline as a user with messy corpora and a
real fleet would: input listings that left files out silently, output and spill folders
that failed only after the work had started, two runs into one output, what killed runs
left behind, inputs changing during a run, weight-0 sources failing the pack, Parquet
row groups read whole, progress output killing a finished run, report.png on odd datasets.
"""

import errno
import io
import os
import pathlib
import threading

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from contract.config import ConfigError, SourceConfig, SourceFormat, load_mixture, mixture_from_dict
from contract.manifest import Ledger, Manifest, ShardInfo, SourceEntry
from dataprep import fsutil, pack, pipeline, preflight, progress, readers, report, testing, tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    sha = testing.train_small_tokenizer(str(d / "tok.model"))
    return d / "tok.model", sha


def _config(d, tok_path, sources, **extra):
    cfg = {"name": "t", "version": 1, "seq_len": 32, "tokenizer": {"path": str(tok_path)}, "sources": sources}
    cfg.update(extra)
    (d / "mix.yaml").write_text(yaml.safe_dump(cfg))
    return d / "mix.yaml"


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


# --- listing the inputs ------------------------------------------------------------------


def test_glob_follows_a_link_to_a_folder_and_not_a_link_back_up(tmp_path, tok):
    # Was: Beam's local listing (os.walk) does not follow links to folders: every file under
    # in/linked/ was left out of the pack without a word.
    (tmp_path / "in/real").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "in/real/a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "elsewhere/b.jsonl").write_text('{"text": "b"}\n')
    os.symlink(tmp_path / "elsewhere", tmp_path / "in/linked")
    os.symlink("..", tmp_path / "in/real/up")  # a loop: must not be walked for ever
    cfg = load_mixture(str(_config(tmp_path, tok[0], [{"name": "a", "paths": ["in/**/*.jsonl"], "format": "jsonl"}])))
    assert preflight.match_inputs(cfg) == {
        "a": (str(tmp_path / "in/linked/b.jsonl"), str(tmp_path / "in/real/a.jsonl"))
    }


def _listing_error(tmp_path, tok, pattern="in/*.jsonl"):
    """The ConfigError message of listing a one-source config over ``pattern``, less the config
    file's path in front (checked here)."""
    path = str(_config(tmp_path, tok[0], [{"name": "a", "paths": [pattern], "format": "jsonl"}]))
    cfg = load_mixture(path)
    with pytest.raises(ConfigError) as e:
        preflight.match_inputs(cfg)
    assert str(e.value).startswith(f"{path}: ")
    return str(e.value)[len(path) + 2:]


def test_dangling_link_matched_by_a_glob_is_a_config_error(tmp_path, tok):
    # Was: left out silently (Beam's listing skips a file whose size it cannot read).
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.jsonl").write_text('{"text": "a"}\n')
    os.symlink("gone.jsonl", tmp_path / "in/b.jsonl")
    assert _listing_error(tmp_path, tok) == (
        f"sources[0].paths[0]: {tmp_path}/in/b.jsonl is a symbolic link to 'gone.jsonl', which does not exist; "
        "restore the target or remove the link"
    )


def test_folder_that_cannot_be_listed_is_a_config_error(tmp_path, tok, monkeypatch):
    # Was: os.walk ignores the error and the folder's files were left out silently.
    (tmp_path / "in/locked").mkdir(parents=True)
    (tmp_path / "in/a.jsonl").write_text('{"text": "a"}\n')
    locked = str(tmp_path / "in/locked")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path) == locked:
            raise PermissionError(errno.EACCES, "Permission denied", locked)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert _listing_error(tmp_path, tok, "in/**.jsonl") == (
        f"sources[0].paths[0]: cannot list folder {locked} (Permission denied): the files in it would be left "
        "out; make it readable or narrow the pattern"
    )


def test_unreadable_input_file_is_a_config_error(tmp_path, tok, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.jsonl").write_text('{"text": "a"}\n')
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).endswith("a.jsonl") else real_access(p, mode))
    assert _listing_error(tmp_path, tok) == f"sources[0].paths[0]: {tmp_path}/in/a.jsonl is not readable (permission denied)"


def test_same_file_twice_in_one_source_names_both_paths(tmp_path, tok):
    # Was: "x is also an input of source 'a' ...; a file may belong to one source only", about
    # the source itself.
    (tmp_path / "in").mkdir()
    (tmp_path / "in/x.jsonl").write_text('{"text": "x"}\n')
    os.symlink("x.jsonl", tmp_path / "in/y.jsonl")
    assert _listing_error(tmp_path, tok) == (
        f"sources[0].paths: {tmp_path}/in/x.jsonl and {tmp_path}/in/y.jsonl are the same file "
        f"({tmp_path}/in/x.jsonl, through a symbolic link): its documents would be read twice; narrow the paths "
        "or globs to one of them"
    )


# --- Parquet -------------------------------------------------------------------------------


def test_parquet_is_read_in_bounded_batches_not_whole_row_groups(tmp_path, monkeypatch):
    # Was: read_row_group(...).to_pylist(): a worker held a whole row group of text (1.4 GB
    # peak RSS for one 300 MB row group, the common pandas layout; 231 MB in batches).
    texts = [f"document {i}" for i in range(2500)]
    pq.write_table(pa.table({"text": texts, "id": list(range(2500))}), tmp_path / "a.parquet", row_group_size=1000)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", None)  # must not be needed
    seen = []
    real = pq.ParquetFile.iter_batches

    def iter_batches(self, *args, **kwargs):
        for batch in real(self, *args, **kwargs):
            seen.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    src = SourceConfig(name="s", paths=(str(tmp_path),), root=str(tmp_path), format=SourceFormat.PARQUET)
    items = list(readers.read_file(src, str(tmp_path / "a.parquet")))
    assert items == [readers.Document(f"s/a.parquet:{i}", t, str(i)) for i, t in enumerate(texts)]  # ids: column "id"
    assert sum(seen) == 2500 and max(seen) <= readers.PARQUET_BATCH_ROWS


def test_parquet_text_over_the_document_limit_is_too_long(tmp_path, monkeypatch):
    # Was: no limit for Parquet (JSONL lines and text files had one): a cell of any size went on.
    monkeypatch.setattr(readers, "MAX_DOCUMENT_BYTES", 10)
    pq.write_table(pa.table({"text": ["short", "\u00e9" * 6, "x" * 11]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([b"y" * 11], pa.binary())}), tmp_path / "b.parquet")
    src = SourceConfig(name="s", paths=(str(tmp_path),), root=str(tmp_path), format=SourceFormat.PARQUET)
    items = list(readers.read_file(src, str(tmp_path / "a.parquet"))) + list(readers.read_file(src, str(tmp_path / "b.parquet")))
    assert [(type(i).__name__, getattr(i, "reason", None), getattr(i, "detail", None)) for i in items] == [
        ("Document", None, None),
        ("Rejected", readers.Reason.TOO_LONG, "12 bytes, over the limit of 10; raw holds the first 12"),
        ("Rejected", readers.Reason.TOO_LONG, "11 bytes, over the limit of 10; raw holds the first 11"),
        ("Rejected", readers.Reason.TOO_LONG, "11 bytes, over the limit of 10; raw holds the first 11"),
    ]


def test_parquet_with_the_text_column_twice_is_one_dead_letter(tmp_path):
    # Was: pyarrow read the first of the two "text" columns silently.
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    pq.write_table(table, tmp_path / "d.parquet")
    src = SourceConfig(name="s", paths=(str(tmp_path),), root=str(tmp_path), format=SourceFormat.PARQUET)
    assert list(readers.read_file(src, str(tmp_path / "d.parquet"))) == [
        readers.Rejected("s/d.parquet:file", readers.Reason.UNREADABLE_FILE, b"",
                         "the file has 2 columns named 'text'; rewrite it with one")
    ]


# --- config --------------------------------------------------------------------------------


def _raw(**extra):
    raw = {"name": "t", "version": 1, "seq_len": 64, "tokenizer": {"path": "/t.model"},
           "sources": [{"name": "a", "paths": ["/in/*.jsonl"], "format": "jsonl"}]}
    raw.update(extra)
    return raw


def test_shards_per_source_auto_means_counts_from_input_sizes():
    # Was: "shards_per_source: must be an integer, got 'auto'".
    auto = mixture_from_dict(_raw(shards_per_source="auto"))
    assert auto.shards_per_source is None and auto == mixture_from_dict(_raw())
    assert auto.sha256() == mixture_from_dict(_raw()).sha256()
    with pytest.raises(ConfigError) as e:
        mixture_from_dict(_raw(shards_per_source="many"))
    assert str(e.value) == (
        "shards_per_source: must be an integer >= 1, or auto (or left out) for counts from the input sizes "
        "and target_shard_tokens, got 'many'"
    )


def test_seq_len_above_the_default_target_names_the_default():
    # Was: "target_shard_tokens: must be >= seq_len ..., got 268435456" for a key not in the file.
    with pytest.raises(ConfigError) as e:
        mixture_from_dict(_raw(seq_len=2**29))
    assert str(e.value) == (
        "target_shard_tokens: must be >= seq_len (536870912), got 268435456 (the default); a shard holds whole "
        "rows: set target_shard_tokens to at least 536870912"
    )


def test_spill_on_with_a_distributed_runner_needs_shared_storage(tmp_path):
    # Was: spill files in each Dataflow worker's own /tmp, unreadable by the packing workers.
    options = pack.pipeline_options(["--runner", "DataflowRunner"])
    with pytest.raises(ConfigError, match=r"^--spill on: the spill folder .* is on this machine's disk"):
        pack.spill_base("on", options, str(tmp_path / "ds"))
    assert pack.spill_base("auto", options, str(tmp_path / "ds")) is None
    local = pack.pipeline_options([])
    assert pack.spill_base("auto", local, str(tmp_path / "ds")) == str(tmp_path / "ds/_tmp")


# --- output and spill folders, locking -----------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("small")
    testing.write_pydoc_jsonl(d / "in", 2, 20_000)
    (d / "in0").mkdir()
    (d / "in0/empty.txt").write_bytes(b"")  # a weight-0 source that packs nothing
    cfg = _config(
        d, tok[0],
        [{"name": "docs", "paths": ["in/*.jsonl"], "format": "jsonl"},
         {"name": "later", "paths": ["in0/*.txt"], "format": "text", "weight": 0.0}],
        shards_per_source=2,
    )
    return d, cfg


def test_temp_location_that_is_a_file_fails_before_any_work(small, tmp_path, capsys):
    # Was: a 109-line traceback from inside the tokenize step, after the work had started.
    d, cfg = small
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "ds"
    code = pack.main(["--config", str(cfg), "--output", str(out), "--temp_location", str(tmp_path / "afile")])
    assert code == pack.EXIT_CONFIG
    assert capsys.readouterr().err == f"error: --temp_location {tmp_path}/afile: is a file, or inside one; it must be a folder\n"
    assert not out.exists()


def test_output_that_cannot_be_written_fails_before_any_work(tmp_path, monkeypatch):
    # Was (read-only mount): a 115-line traceback from the tokenize step, exit 1.
    def refuse(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(pack.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(ConfigError) as e:
        pack.check_writable_folder(str(tmp_path / "ds"), "--output")
    assert str(e.value) == (
        f"--output {tmp_path}/ds: cannot write there (Read-only file system); choose a folder this user can write to"
    )


def test_second_pack_into_a_locked_output_exits_2_and_touches_nothing(small, tmp_path, capsys):
    # Was: the second run deleted the first one's spill and half-written shard files at its
    # start, and the first run crashed ("open() failed: No such file or directory").
    d, cfg = small
    out = tmp_path / "ds"
    (out / "errors").mkdir(parents=True)
    (out / "errors/docs-00000-of-00002.jsonl").write_text("{}\n")  # what the first run is writing
    lock = pack.lock_output(str(out))
    try:
        code = pack.main(["--config", str(cfg), "--output", str(out), "--overwrite"])
    finally:
        os.close(lock)
    assert code == pack.EXIT_CONFIG
    assert capsys.readouterr().err == (
        f"error: --output {out}: another dataprep.pack run is writing there (it holds the folder's lock); "
        "wait for it to end, or choose another --output\n"
    )
    assert (out / "errors/docs-00000-of-00002.jsonl").read_text() == "{}\n"


def test_killed_runs_leftovers_are_removed_and_the_rerun_matches(small, tmp_path, capsys):
    # Was: a killed run's spill folder stayed in <output>/_tmp after the rerun (the cleanup
    # matched files only, not folders), and under --temp_location for ever.
    d, cfg = small
    out, temp = tmp_path / "ds", tmp_path / "temp"
    args = ["--config", str(cfg), "--output", str(out), "--temp_location", str(temp), "--no-report", "--quiet"]
    pack.run(args, print_summary=False)
    clean = _files(out)
    assert not (out / "_tmp").exists() and list(temp.iterdir()) == []
    key = pack._output_key(str(out))
    for stale in (out / "_tmp/dataprep-spill-0123456789ab", temp / f"dataprep-spill-{key}-0123456789ab"):
        stale.mkdir(parents=True)
        (stale / "ab.seg").write_bytes(b"\0" * 64)
    other = temp / "dataprep-spill-ffffffffffff-0123456789ab"  # another output's run, still going
    other.mkdir()
    (other / "cd.seg").write_bytes(b"\0")
    (out / "manifest.json").unlink()  # killed before the commit
    pack.run(args, print_summary=False)
    assert _files(out) == clean
    assert sorted(p.name for p in temp.iterdir()) == [other.name]
    # The lock is released when a run ends.
    os.close(pack.lock_output(str(out)))
    # The weight-0 source packed nothing and rejected its one (empty) document: a warning, not a failure.
    err = capsys.readouterr().err
    assert err == (
        "warning: source 'later' (weight 0 in every phase) rejected 100% of its documents, over "
        "max_rejected_fraction 0.5: read 1, packed 0, rejected 1: empty_after_tokenization 1 (first: "
        "later/empty.txt:0: no token: the text is empty); dead letters in "
        f"{out}/errors/later-*.jsonl; fix its input before a mixture gives it weight\n"
    ) * 2


def test_temp_location_inside_the_inputs_is_refused(tmp_path, tok, capsys):
    # Was: accepted; a killed run's spill files (<temp>/dataprep-spill-*/*.seg) matched the
    # input glob of the rerun and were listed as documents (then vanished under it).
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("a document")
    cfg = _config(tmp_path, tok[0], [{"name": "docs", "paths": ["in/**"], "format": "text"}])
    temp = tmp_path / "in/tmp"
    code = pack.main(["--config", str(cfg), "--output", str(tmp_path / "ds"), "--temp_location", str(temp)])
    assert code == pack.EXIT_CONFIG
    probe = f"{temp}/dataprep-spill-000000000000-000000000000/{'0' * 32}.seg"
    assert capsys.readouterr().err == (
        f"error: sources[0].paths[0]: '{tmp_path}/in/**' would match the spill files under --temp_location "
        f"{temp} (e.g. {probe}); those of a killed run would be read back as inputs: narrow the glob or move "
        "--temp_location\n"
    )
    assert not temp.exists() and not (tmp_path / "ds").exists()


def test_manifest_is_committed_atomically(tmp_path, monkeypatch):
    # Was: written in place: a run killed while writing it left a truncated manifest.json,
    # which both the loader and a rerun (without --overwrite) take for a committed dataset.
    path = tmp_path / "ds/manifest.json"
    fsutil.write_bytes_atomic(str(path), b"{}\n")
    assert path.read_bytes() == b"{}\n"

    def killed(src, dst):
        raise OSError(errno.EIO, "killed while committing")

    monkeypatch.setattr(fsutil.os, "replace", killed)
    with pytest.raises(OSError):
        fsutil.write_bytes_atomic(str(path), b'{"a": 1}\n')
    assert path.read_bytes() == b"{}\n" and sorted(p.name for p in path.parent.iterdir()) == ["manifest.json"]


def test_input_that_changes_after_the_listing_fails_the_run(small, tmp_path, monkeypatch, capsys):
    # Was: read as it was then, with shard counts planned on the old size: no run on the
    # files as they are now reproduces that dataset.
    d, cfg = small
    real = fsutil.list_inputs
    monkeypatch.setattr(fsutil, "list_inputs", lambda p: [(f, n + 1) for f, n in real(p)])  # listed, then cut
    out = tmp_path / "ds"
    assert pack.main(["--config", str(cfg), "--output", str(out), "--quiet"]) == pack.EXIT_PIPELINE == 1
    last = capsys.readouterr().err.rstrip("\n").splitlines()[-2:]
    assert last[0].startswith("error: the pipeline failed, manifest.json not written: ")
    assert "InputChangedError: input " in last[0] and " was listed with " in last[0]
    assert " bytes before the run but has " in last[0] and "inputs must not change while pack runs" in last[0]
    assert last[1] == ("next: an input changed while the pack ran: rerun once the inputs are stable (their "
                       "listing is taken at the start)")
    assert not (out / "manifest.json").exists() and not (out / "_tmp").exists()
    with pytest.raises(pipeline.InputChangedError, match=r"cannot be found when its reading started"):
        pipeline.check_input_unchanged(str(tmp_path / "gone.jsonl"), 10, "when its reading started")
    pipeline.check_input_unchanged(str(tmp_path / "gone.jsonl"), -1, "")  # unknown size: not checked


def test_failure_of_a_worker_process_names_its_error_not_traceback():
    # Was (multi_processing): "error: the pipeline failed, ...: RuntimeError: Traceback (most
    # recent call last):", the first line of the worker's traceback.
    e = RuntimeError(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    g()\n"
        "ValueError: bad spec\n\nDuring handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n  File \"y.py\", line 2, in h\n"
        "ValueError: bad spec [while running 'Pack/PackAndWrite']\n"
    )
    assert pack._pipeline_failure(e, "/data/ds", None).splitlines()[0] == (
        "the pipeline failed, manifest.json not written: ValueError: bad spec [while running 'Pack/PackAndWrite']"
    )


def test_too_little_free_disk_is_warned_about_before_any_work(tmp_path, monkeypatch):
    # Was: no word until the disk filled, hours into a run (then a traceback).
    import collections

    from dataprep import sizing

    plan = sizing.ShardPlan(input_bytes=4_000_000_000, estimated_tokens=2_000_000_000, num_shards=8, auto=True)
    pre = preflight.Preflight(files={}, tokenizer_sha256="", tokenizer_info={}, shards={"web": plan})
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(pack.shutil, "disk_usage", lambda p: usage(0, 0, 5_000_000_000))
    (tmp_path / "ds").mkdir()
    assert pack.disk_space_warnings(pre, str(tmp_path / "ds"), str(tmp_path / "ds/_tmp"), 2) == [
        f"{tmp_path}/ds has 5.0 GB free; this run may need up to 6.0 GB there (spill files 2 bytes a token and "
        "shards, from the estimated tokens, which are high on purpose); if the disk fills, the run fails with "
        "exit status 1"
    ]
    monkeypatch.setattr(pack.shutil, "disk_usage", lambda p: usage(0, 0, 7_000_000_000))
    assert pack.disk_space_warnings(pre, str(tmp_path / "ds"), str(tmp_path / "ds/_tmp"), 2) == []
    assert pack.disk_space_warnings(pre, "memfs://ds", None, 2) == []  # object stores: no check


def test_full_disk_failure_says_what_to_free():
    e = RuntimeError("OSError: [Errno 28] No space left on device [while running 'Pack/ReadAndTokenize']")
    assert pack._pipeline_failure(e, "/data/ds", "/scratch/dataprep-spill-k-r") == (
        "the pipeline failed, manifest.json not written: RuntimeError: OSError: [Errno 28] No space left on "
        "device [while running 'Pack/ReadAndTokenize']\n"
        "next: the disk is full: free space under /data/ds and /scratch (spill files), or point --temp_location "
        "at a larger disk (spill files need about 2 bytes a token, 4 above 65,536 pieces, and are removed at "
        "the end); then rerun"
    )


# --- progress output -----------------------------------------------------------------------


class _Closed(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_progress_to_a_closed_pipe_does_not_fail_the_run(monkeypatch):
    # Was: `pack ... 2>&1 | head -2` lost a finished pipeline's work: the last progress line
    # raised BrokenPipeError before the manifest was written.
    m = progress.Monitor(100, 1, _Closed(), interval=0.0, terminal=False)
    stages = {"read": {"first": 0.0, "last": 1.0, "documents": 1, "bytes": 100},
              "tokenize": {"first": 0.0, "last": 1.0, "tokens": 5},
              "pack": {"first": 1.0, "last": 2.0, "shards": 1, "rows": 1, "tokens": 5}}
    m.update(stages)
    m.update(stages, final=True)
    m.close()
    assert m.durations == {"read and tokenize": 1.0 - m._start, "pack and write": 1.0}
    monkeypatch.setattr("sys.stderr", _Closed())
    pack._say(False, "pack: manifest written")  # no exception


def test_heartbeat_folders_of_killed_runs_are_removed(tmp_path, monkeypatch):
    # Was: a killed run's <tmp>/dataprep-progress-* folder stayed for ever.
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"dataprep-progress-{gone.pid}-abc"
    alive = tmp_path / f"dataprep-progress-{os.getpid()}-abc"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "read-1.json").write_text("{}")
    mine = progress.heartbeat_folder()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, os.path.basename(mine)])
    assert os.path.basename(mine).startswith(f"dataprep-progress-{os.getpid()}-")


def test_stderr_filter_keeps_draining_when_the_real_stderr_is_closed():
    # Was: the forwarding thread died on the first failed write and closed its pipe: every
    # later write to fd 2 (the driver's, the workers') raised BrokenPipeError. Now it drains
    # (and drops) what it cannot forward, so writers neither fail nor block on a full pipe.
    read_end, write_end = os.pipe()
    os.close(read_end)  # the real stderr's reader is gone: writes raise EPIPE
    saved = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)
    done = threading.Event()

    def noisy():
        with progress.filtered_stderr(True):
            for _ in range(2000):  # 200 KB: three times what a pipe buffers
                os.write(2, b"ERROR: a line a worker writes to its stderr ........................ x\n")
        done.set()

    try:
        t = threading.Thread(target=noisy, daemon=True)
        t.start()
        t.join(timeout=30)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert done.is_set()


# --- report.png on odd datasets ------------------------------------------------------------


def _manifest(names, tokens):
    sources = {}
    for n, t in zip(names, tokens):
        shard = ShardInfo(path=f"{n}/data-00000-of-00001.array_record", records=1 if t else 0, tokens=t,
                          padding=(32 - t) if t else 0, documents=1 if t else 0, segments=1 if t else 0,
                          sha256="0" * 64, bytes=131072)
        led = Ledger(read=1, packed=1 if t else 0, rejected={} if t else {"invalid_json": 1},
                     tokens_in=t, tokens_packed=t, docs_split=0)
        sources[n] = SourceEntry((shard,), led)
    return Manifest(name="t", version=1, record_format_version=1, config={}, config_sha256="0" * 64,
                    tokenizer={"sha256": "0" * 64, "vocab_size": 400}, seq_len=32, token_dtype="uint16",
                    sources=sources, tools={})


def test_report_names_long_sources_apart_and_groups_phases():
    # Was: the totals table cut every name to 13 characters ("source_with_a" ten times), and
    # 13 phases drew 14 bars a source with overlapping labels.
    names = [f"source_with_a_long_name_number_{i}" for i in range(10)]
    assert report.short_names(names, 24) == [f"source_with\u2026ame_number_{i}" for i in range(10)]
    assert report.short_names(["web", "code"], 24) == ["web", "code"]
    raw = _raw(sources=[{"name": n, "paths": [f"/in/{n}"], "format": "jsonl"} for n in names[:3]],
               phases=[{"from_step": 10 * (k + 1), "weights": {names[k % 2]: 1.0}} for k in range(5)])
    groups = report._phase_groups(mixture_from_dict(raw), names[:3])
    assert [steps for steps, _ in groups] == [[0], [10, 30, 50], [20, 40]]
    np.testing.assert_array_equal(groups[1][1], [100.0, 0.0, 0.0])


def test_report_of_an_all_rejected_failed_run_draws_without_warnings(recwarn):
    # Was: an empty legend (a matplotlib UserWarning on stderr), "131072.000 bytes a token" for
    # no token, and nothing in the picture said the run had failed.
    cfg = mixture_from_dict(_raw(sources=[{"name": "only", "paths": ["/in/x"], "format": "jsonl"}]))
    m = _manifest(["only"], [0])
    failed = report.render(m, cfg, {"only": np.zeros(32, np.int64)}, failure="a source lost too much")
    assert failed[:8] == b"\x89PNG\r\n\x1a\n"
    assert failed != report.render(m, cfg, {"only": np.zeros(32, np.int64)})
    assert [str(w.message) for w in recwarn] == []



# --- killed drivers ------------------------------------------------------------------------


def test_local_worker_exits_when_the_driver_is_killed():
    # Was: Beam's multi_processing workers outlived a driver killed by SIGKILL (or SIGTERM
    # while they worked): two processes of about 150 MB each stayed for ever, per run.
    import subprocess
    import sys

    driver = subprocess.Popen(["sleep", "60"])
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from dataprep.pipeline import exit_with_driver; "
         f"exit_with_driver({driver.pid}, 0.05); print('watching', flush=True); time.sleep(60)"],
        cwd=str(pathlib.Path(__file__).resolve().parents[1]), stdout=subprocess.PIPE,
    )
    try:
        assert worker.stdout.readline() == b"watching\n"
        driver.kill()
        driver.wait()
        assert worker.wait(timeout=20) == 1
    finally:
        for proc in (driver, worker):
            if proc.poll() is None:
                proc.kill()
    pipeline.exit_with_driver(os.getpid())  # the driver's own process: nothing to watch
    pipeline.exit_with_driver(None)


def test_sigterm_stops_the_run_like_ctrl_c(monkeypatch, capsys):
    # Was: SIGTERM (a scheduler's stop, `timeout`) killed the driver on the spot: no cleanup
    # of the spill files, and the workers were orphaned.
    with pytest.raises(KeyboardInterrupt):
        pack._terminate(15, None)

    for error, message in [
        (pack.Interrupted("/d/ds", False), "interrupted; nothing was committed (no manifest.json in /d/ds); rerun to pack"),
        (pack.Interrupted("/d/ds", True), "interrupted after manifest.json was written: the dataset /d/ds is "
                                          "complete (report.png may be missing)"),
        (KeyboardInterrupt(), "interrupted before any work; nothing was written"),
    ]:
        def interrupted(argv, error=error):
            raise error

        monkeypatch.setattr(pack, "run", interrupted)
        assert pack.main(["--config", "x", "--output", "y"]) == 130
        assert capsys.readouterr().err == f"error: {message}\n"


# --- long documents --------------------------------------------------------------------------


def _model(**options):
    import sentencepiece as spm

    lines = [ln.strip() for t in testing.pydoc_text(30_000) for ln in t.splitlines() if ln.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=500,
                                   model_type="unigram", byte_fallback=True, character_coverage=1.0,
                                   num_threads=1, hard_vocab_limit=False, minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def models(tok):
    import sentencepiece as spm

    out = {"nmt_nfkc": spm.SentencePieceProcessor(model_file=str(tok[0]))}
    shared = pathlib.Path(__file__).resolve().parents[1] / "../shared/tokenizers/en_unigram_1000.model"
    if shared.exists():  # the shared corpora's tokenizer keeps newlines and tabs as characters
        out["shared"] = spm.SentencePieceProcessor(model_file=str(shared))
    return {name: (sp, tokenizer.safe_cuts(sp)) for name, sp in out.items()}


def test_long_documents_are_cut_only_where_the_model_allows_it(models):
    # Was: a long document went to SentencePiece whole, at about 44 bytes of RAM a character
    # (2.1 GB for one 50 MB document, 0.4 GB in pieces; a document may have 256 MiB: 11 GB).
    assert models["nmt_nfkc"][1] == " \n"
    # Whitespace kept as it is: a piece cut before a space would get a second dummy prefix.
    assert tokenizer.safe_cuts(_model(normalization_rule_name="identity", remove_extra_whitespaces=False)) == ""
    assert tokenizer.safe_cuts(_model(treat_whitespace_as_suffix=True)) == ""  # pieces end with it
    if "shared" in models:  # "\n" is a character of its own there: cutting before it is not safe
        assert models["shared"][1] == " "


_TRICKY = " \t\n\r\u00a0\u3000\u0301\u00a8\ufb01\uff21\u4e2d\U0001f642ae1.<>/s"


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(text=st.text(alphabet=_TRICKY, max_size=120), piece=st.integers(1, 12))
def test_long_documents_encoded_in_pieces_decode_to_the_same_text(models, text, piece):
    pieces = tokenizer._cut(text, " \n", piece)
    assert "".join(pieces) == text and all(p[0] in " \n" for p in pieces[1:])
    assert all(len(p) <= piece or not any(c in p[1:] for c in " \n") for p in pieces)
    for sp, cuts in models.values():
        whole = tokenizer.encode_batch(sp, [text, "short one"], False, True, np.uint16)
        saved = tokenizer.LONG_TEXT_CHARS, tokenizer.PIECE_CHARS
        tokenizer.LONG_TEXT_CHARS, tokenizer.PIECE_CHARS = 4, piece
        try:
            cut = tokenizer.encode_batch(sp, [text, "short one"], False, True, np.uint16, cuts=cuts)
            again = tokenizer.encode_batch(sp, [text, "short one"], False, True, np.uint16, cuts=cuts)
        finally:
            tokenizer.LONG_TEXT_CHARS, tokenizer.PIECE_CHARS = saved
        assert [c.tolist() for c in cut] == [a.tolist() for a in again]  # a function of the text
        assert sp.decode(cut[0][:-1].tolist()) == sp.decode(whole[0][:-1].tolist())
        assert cut[1].tolist() == whole[1].tolist() and cut[0].dtype == np.uint16
        assert cut[0].size == whole[0].size == 0 or cut[0][-1] == sp.eos_id()
