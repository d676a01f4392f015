"""What replay and training say to a person (issue 23): exact messages, progress lines and tables.

No trained run is needed here: the messages come from pure functions and renderers fed with
hand-made inputs; the pictures are in tests/test_replay_pictures.py.
"""

from __future__ import annotations

import io

from replay.verify import verdict
from replay.verify.verdict import Evidence, ReplayOutcome, Verdict


def _reproduced(ev=Evidence.PER_SHARD):
    return [ReplayOutcome((0, 1), ev, None, "s"), ReplayOutcome((2, 3), ev, None, "s")]


# ----------------------------------------------------------------------------- acquittal


def test_acquittal_with_nothing_suspected_names_no_cause():
    d = verdict.decide(_reproduced(), num_devices=4)
    assert d.verdict is Verdict.ACQUITTED
    assert d.explanation == "the replay reproduces the log: no device computed wrong numbers in these steps"
    assert "data or the software" not in d.explanation


def test_acquittal_within_tolerance_says_it_is_weaker():
    d = verdict.decide(_reproduced(Evidence.TOLERANCE)[:1], num_devices=4)
    assert d.explanation == ("the replay reproduces the log (within tolerance only: weaker evidence): no device is "
                             "shown to have computed wrong numbers in these steps")


def test_acquittal_of_suspect_devices_says_where_the_suspicion_comes_from():
    d = verdict.decide(_reproduced(), num_devices=4, suspected=[3, 1])
    assert d.verdict is Verdict.ACQUITTED
    assert d.explanation == (
        "the replay reproduces the log: the devices are acquitted, suspect device(s) [1, 3] included; what made them "
        "suspect is in the data or the software, not in these steps' computations: run 'replay inspect' on the steps "
        "of interest")


def _console(width=100, terminal=False):
    from rich.console import Console

    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=terminal, color_system=None, soft_wrap=True), buf


# ----------------------------------------------------------------------------- the run directory


def _fake_run(path):
    """A folder that ``is_run_dir`` takes for a run directory (its three files, empty)."""
    from replay.run.runlog import RUN_DIR_FILES

    path.mkdir(parents=True)
    for name in RUN_DIR_FILES:
        (path / name).write_text("")
    (path / "checkpoints" / "10").mkdir(parents=True)
    return path


def test_nearest_run_dir(tmp_path, monkeypatch):
    from replay.run.runlog import nearest_run_dir

    _fake_run(tmp_path / "build" / "demo" / "run")
    _fake_run(tmp_path / "build" / "demo" / "run-long")
    (tmp_path / "build" / "demo" / "dataset").mkdir()
    monkeypatch.chdir(tmp_path)
    assert nearest_run_dir("build/demo/rnu") == "build/demo/run"  # a typo of the last part
    assert nearest_run_dir("buidl/demo/run") == "build/demo/run"  # of a part further up
    assert nearest_run_dir("build/demo/run-lnog") == "build/demo/run-long"
    assert nearest_run_dir("build/demo") == "build/demo/run"  # the folder above a run
    assert nearest_run_dir("build/demo/run/checkpoints") == "build/demo/run"  # a folder inside one
    assert nearest_run_dir(str(tmp_path / "build" / "demo" / "rnu")) == str(tmp_path / "build" / "demo" / "run")
    assert nearest_run_dir("build/demo/dataset") == "build/demo/run"
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    assert nearest_run_dir(str(empty / "run")) is None  # nothing below the nearest existing folder: no guess
    assert nearest_run_dir(str(empty)) == str(tmp_path / "build" / "demo" / "run")  # a folder: its siblings too
    assert nearest_run_dir(str(empty), siblings=False) is None
    assert nearest_run_dir("/no-such-root-folder/run") is None  # never a search of the whole file system


def test_a_run_directory_that_is_not_there_gets_the_nearest(tmp_path, monkeypatch):
    import pytest

    from replay.run.runlog import RunDirError, load_run

    _fake_run(tmp_path / "runs" / "run")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunDirError) as e:
        load_run("runs/rnu")
    assert str(e.value) == "run directory not found: runs/rnu; the nearest run directory is runs/run"
    assert e.value.nearest == "runs/run"
    with pytest.raises(RunDirError) as e:
        load_run("runs")
    assert str(e.value) == ("runs is not a run directory: run_config.yaml is missing; the nearest run directory "
                            "is runs/run")
    with pytest.raises(RunDirError) as e:
        load_run("other/run")
    assert str(e.value) == "run directory not found: other/run; the nearest run directory is runs/run"


def test_no_run_given_names_the_nearest(tmp_path, monkeypatch):
    import pytest

    from replay.run.runlog import RunNotGivenError, resolve_run_dir

    _fake_run(tmp_path / "runs" / "run")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunNotGivenError) as e:
        resolve_run_dir(None, environ={})
    assert str(e.value).endswith(f"(the current folder {tmp_path} is not one: it lacks run_config.yaml, env.json, "
                                 "fingerprints.jsonl); the nearest run directory is runs/run")


def test_replay_says_the_nearest_run_and_the_command_to_paste(tmp_path, monkeypatch, capsys):
    from replay import cli
    from replay.run.codes import ExitCode

    _fake_run(tmp_path / "build" / "demo" / "run")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REPLAY_RUN", raising=False)
    assert cli.main(["--run", "build/demo/rnu", "--steps", "20:30", "--devices", "good"]) == ExitCode.RUN_ERROR
    assert capsys.readouterr().err.splitlines() == [
        "run directory or data error: run directory not found: build/demo/rnu; the nearest run directory is "
        "build/demo/run",
        "next: replay --run build/demo/run --steps 20:30 --devices good"]
    assert cli.main(["inspect", "--run=build/demo/rnu", "--steps", "27"]) == ExitCode.RUN_ERROR
    assert capsys.readouterr().err.splitlines()[-1] == "next: replay inspect --run=build/demo/run --steps 27"
    monkeypatch.setenv("REPLAY_RUN", "build/demo/rnu")
    assert cli.main(["scan"]) == ExitCode.RUN_ERROR
    assert capsys.readouterr().err.splitlines()[-1] == "next: replay scan --run build/demo/run"


def test_training_into_a_new_folder_names_the_nearest_run(tmp_path, monkeypatch):
    from replay.reference.loop import _new_run_note

    _fake_run(tmp_path / "build" / "demo" / "run")
    monkeypatch.chdir(tmp_path)
    assert _new_run_note("build/demo/rnu", existed=False, seed=0) == (
        "new run directory build/demo/rnu (it did not exist; the nearest existing run directory is build/demo/run, "
        "in case --run meant it): initializing the parameters (seed 0) and saving checkpoint 0")
    assert _new_run_note("build/demo/rnu", existed=True, seed=3) == (
        "new run in build/demo/rnu: initializing the parameters (seed 3) and saving checkpoint 0")


# ----------------------------------------------------------------------------- progress and losses


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_training_says_what_it_waits_for_before_the_first_step():
    from replay.runtime.progress import note, step_progress

    clock, out = _Clock(), io.StringIO()
    note("train", "resuming build/demo/run from checkpoint 20", stream=out)
    with step_progress("train", 20, 23, stream=out, interval=0, clock=clock,
                       first="compiling the train step: the first step takes longer") as shown:
        for step, secs in ((20, 43.15), (21, 2.5), (22, 2.5)):
            clock.t += secs
            shown.update(step, step_s=secs, loss=6.123456)
    assert out.getvalue().splitlines() == [
        "train: resuming build/demo/run from checkpoint 20",
        "train: step 20 of 20:23: compiling the train step: the first step takes longer",
        "train: step 20 of 20:23 (33%), step 43.15 s (compiling included), loss 6.1235",
        "train: step 21 of 20:23 (67%), 0.40 steps/s, step 2.50 s, loss 6.1235, ETA 2.5 s",
        "train: step 22 of 20:23 (100%), 0.40 steps/s, step 2.50 s, loss 6.1235",
        "train: steps 20:23 done in 48 s (0.40 steps/s)",
    ]


def test_range_replay_progress_says_it_counts_steps_times_placements():
    from replay.runtime.progress import StepProgress

    clock, out = _Clock(), io.StringIO()
    shown = StepProgress("replay 25:30", 0, 20, stream=out, interval=0, counted=True, clock=clock,
                         breakdown="10 steps from checkpoint 20 x 2 placements",
                         first="restoring checkpoint 20 and compiling the step: the first step takes longer")
    for _ in range(20):
        clock.t += 1.0
        shown.advance()
    shown.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == ("replay 25:30: 0 of 20 steps (10 steps from checkpoint 20 x 2 placements): restoring "
                        "checkpoint 20 and compiling the step: the first step takes longer")
    assert lines[1] == "replay 25:30: 1 of 20 steps (10 steps from checkpoint 20 x 2 placements, 5%)"
    assert lines[-1] == "replay 25:30: 20 steps (10 steps from checkpoint 20 x 2 placements) done in 20 s (1.0 steps/s)"


def test_loss_precision():
    from replay.runtime.progress import loss_text

    assert [loss_text(x) for x in (5.08694314956665, 0.000123456, 12.0, 1234.5678, float("nan"), "inf")] == [
        "5.0869", "0.0001", "12.0000", "1235", "nan", "inf"]


def test_replay_table_prints_losses_at_four_decimals():
    from replay import report

    step = {"step": 20, "ok": True, "kind": None, "devices": {}, "loss": {"logged": 5.08694314956665,
                                                                          "replayed": 5.08694314956665}}
    nan = dict(step, step=21, loss={"logged": "nan", "replayed": "nan"})
    rep = {"steps": {"start": 20, "stop": 22}, "checkpoints": [20], "run_devices": [0, 1],
           "replays": [{"index": 0, "assignment": [0, 1], "steps": [step, nan]}], "verdict": "acquitted",
           "exit_code": 0, "explanation": "x", "environment": {"differences": []}}
    console, buf = _console(width=120)
    report.render_range(rep, console)
    rows = [line for line in buf.getvalue().splitlines() if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    assert [line.split("│")[2].strip() for line in rows] == ["5.0869", "nan"]


# ----------------------------------------------------------------------------- inspect


def _inspect_report(text=True, rows=3):
    out = []
    for i in range(rows):
        docs = [{"key": f"web/crawl-2024/web-documents-00{i}.parquet:{j}", "chunk": 0, "span": [10 * j, 10 * j + 10],
                 **({"text": "Lorem ipsum dolor sit amet\n" * 5} if text else {})} for j in range(2)]
        out.append({"step": 27, "position": i, "source": "web-documents", "documents": docs,
                    "shard": f"web-documents/data-0000{i}-of-00004.array_record", "record_in_shard": 1234 + i})
    return {"steps": {"start": 27, "stop": 28}, "rows": out,
            "sources": {"web-documents": {"rows": rows, "documents": 2 * rows, "tokens": 100, "padding": 3}},
            "shards": {r["shard"]: [r["record_in_shard"]] for r in out}}


import pytest  # noqa: E402


@pytest.mark.parametrize("width, terminal", [(60, True), (100, True), (160, False), (80, False)])
@pytest.mark.parametrize("text", [True, False])
def test_inspect_never_breaks_a_key_or_a_path(width, terminal, text):
    from replay import report

    rep = _inspect_report(text=text)
    console, buf = _console(width=width, terminal=terminal)
    report.render_inspect(rep, console)
    lines = buf.getvalue().splitlines()
    for r in rep["rows"]:
        assert any(r["shard"] in line for line in lines)
        for d in r["documents"]:  # whole, on one line, with the row's shard on the same line
            assert any(d["key"] in line and r["shard"] in line for line in lines), (d["key"], buf.getvalue())
    hint = ("text: the start of each document's piece in that row (a document split over rows starts mid-text in the "
            "later rows; its repr, cut with …); --json OUT writes each whole, with its token ids")
    assert (hint in lines) == text
    wide = [line for line in lines if line.startswith("(the table is")]
    assert bool(wide) == (terminal and width < 150)
    if wide:
        assert wide[0].endswith(f"columns wide and this terminal {width}: keys and paths are whole; pipe through "
                                "'less -S' to see it unfolded)")


def test_inspect_text_column_uses_the_room_left_and_is_cut_with_an_ellipsis():
    from replay import report

    console, buf = _console(width=260, terminal=False)
    report.render_inspect(_inspect_report(), console)
    row = next(line for line in buf.getvalue().splitlines() if "parquet:0" in line)
    cell = row.split("│")[-2].strip()
    assert cell.endswith("…") and cell.startswith("'Lorem ipsum dolor sit amet\\nLorem")
    assert len(cell) == report.INSPECT_TEXT_CHARS  # the cap: 260 columns leave more room
    console, buf = _console(width=220, terminal=False)
    report.render_inspect(_inspect_report(), console)
    row = next(line for line in buf.getvalue().splitlines() if "parquet:0" in line)
    assert len(row) == 220 and len(row.split("│")[-2].strip()) == 68  # the room left: 220 - 149 - 3 columns
