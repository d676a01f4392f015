"""Messages of the ``replay`` command that say what to do: where the run directory came from, a
range outside the logged steps, a misspelt device name, each command's help, and one width policy.

``replay.cli.main`` runs in-process on the shared short run (``tests/test_replay_support.py``,
logged steps ``0:STEPS``); every case here stops before device work, so none replays a step. One
case runs the console script in a subprocess, to see the output as a pipe gets it.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from test_replay_support import STEPS

from replay import cli
from replay.runtime.devices import DeviceSpecError, parse_spec
from replay.run.runlog import RunNotGivenError, StepRangeError, resolve_run_dir
from replay.run.codes import ExitCode

NO_RUN = "no run directory: pass --run DIR, set REPLAY_RUN=DIR, or run replay from inside a run directory"


def _flat(text):
    return " ".join(text.split())


# --- the run directory: --run, $REPLAY_RUN, or the current folder ---------------------------------------------


@pytest.mark.parametrize("argv", [["--steps", "799000:800000", "--devices", "good"], ["range", "--steps", "1"],
                                  ["canary"], ["inspect", "--steps", "1"], ["scan"], ["drill"]])
def test_no_run_anywhere_names_all_three_ways(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("REPLAY_RUN", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"usage error: {NO_RUN} (the current folder {os.getcwd()} is not one: it lacks "
                          "run_config.yaml, env.json, fingerprints.jsonl)")


def test_run_from_replay_run_is_said_on_stderr(run_dir, monkeypatch, capsys):
    monkeypatch.setenv("REPLAY_RUN", run_dir)
    assert cli.main(["--steps", "799000:800000", "--devices", "good"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"run: {run_dir} (from REPLAY_RUN)"
    assert f"steps 799000:800000 are outside the logged steps 0:{STEPS} of {run_dir}" in err


def test_run_from_replay_run_gives_what_run_gives(run_copy, monkeypatch, tmp_path, capsys):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    code = cli.main(["scan", "--run", run_copy, "--json", a])
    assert "(from" not in capsys.readouterr().err  # --run given: nothing to say
    monkeypatch.setenv("REPLAY_RUN", run_copy)
    assert cli.main(["scan", "--json", b]) == code
    assert capsys.readouterr().err.splitlines()[0] == f"run: {run_copy} (from REPLAY_RUN)"
    assert json.load(open(a)) == json.load(open(b))


def test_run_flag_wins_over_replay_run(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REPLAY_RUN", str(tmp_path / "elsewhere"))
    assert cli.main(["--run", run_dir, "--steps", "799000:800000"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert "REPLAY_RUN" not in err and "are outside the logged steps" in err


def test_wrong_replay_run_is_a_run_error_that_names_its_source(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "nope")
    monkeypatch.setenv("REPLAY_RUN", missing)
    assert cli.main(["scan"]) == ExitCode.RUN_ERROR
    assert capsys.readouterr().err.splitlines() == [
        f"run: {missing} (from REPLAY_RUN)", f"run directory or data error: run directory not found: {missing}"]


def test_run_from_the_current_folder(run_copy, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("REPLAY_RUN", raising=False)
    monkeypatch.chdir(run_copy)
    j = str(tmp_path / "i.json")
    assert cli.main(["inspect", "--steps", "3", "--json", j]) == 0
    assert capsys.readouterr().err.splitlines()[0] == f"run: {os.getcwd()} (from the current folder)"
    assert [r["step"] for r in json.load(open(j))["rows"]] == [3] * 8


def test_resolve_run_dir_order(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run_config.yaml", "env.json"):
        (run / name).write_text("{}")
    with pytest.raises(RunNotGivenError, match="it lacks fingerprints.jsonl"):
        resolve_run_dir(None, {}, str(run))
    (run / "fingerprints.jsonl").write_text("")
    assert resolve_run_dir(None, {}, str(run)) == (str(run), "the current folder")
    assert resolve_run_dir(None, {"REPLAY_RUN": "x"}, str(run)) == ("x", "REPLAY_RUN")
    assert resolve_run_dir(None, {"REPLAY_RUN": ""}, str(run)) == (str(run), "the current folder")
    assert resolve_run_dir("y", {"REPLAY_RUN": "x"}, str(run)) == ("y", "--run")


# --- a range outside the logged steps -----------------------------------------------------------------------


def test_range_entirely_outside_suggests_inspect_and_the_logged_steps(run_dir, capsys):
    assert cli.main(["--run", run_dir, "--steps", "799000:800000", "--devices", "good"]) == ExitCode.RUN_ERROR
    run = shlex.quote(run_dir)
    assert capsys.readouterr().err.splitlines() == [
        f"run directory or data error: steps 799000:800000 are outside the logged steps 0:{STEPS} of {run_dir}; "
        f"all {STEPS} logged steps are 0:{STEPS} (fewer than the 1000 asked for)",
        f"next: replay --run {run} --steps 0:{STEPS} --devices good   (the nearest logged range)",
        f"  or: replay inspect --run {run} --steps 799000:800000   (lists the documents of any step, logged or not)",
    ]


def test_range_entirely_outside_suggests_the_same_length_at_the_near_end(run_dir, capsys):
    assert cli.main(["range", "--run", run_dir, "--steps=100:105", "--no-progress"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert f"the nearest logged range of the same length is {STEPS - 5}:{STEPS}" in err
    assert f"next: replay range --run {shlex.quote(run_dir)} --steps={STEPS - 5}:{STEPS} --no-progress" in err


def test_range_partly_outside_says_which_part_and_suggests_the_logged_part(run_dir, capsys):
    assert cli.main(["--run", run_dir, "--steps", f"10:{STEPS + 3}"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert (f"steps 10:{STEPS + 3} are partly outside the logged steps 0:{STEPS} of {run_dir}: steps "
            f"{STEPS}:{STEPS + 3} were not logged; the logged part is 10:{STEPS}") in err
    assert f"next: replay --run {shlex.quote(run_dir)} --steps 10:{STEPS}   (the nearest logged range)" in err
    assert f"  or: replay inspect --run {shlex.quote(run_dir)} --steps 10:{STEPS + 3}" in err


def test_scan_outside_suggests_a_scan_of_the_logged_steps(run_copy, capsys):
    assert cli.main(["scan", "--run", run_copy, "--steps", "100:110"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert f"the nearest logged range of the same length is {STEPS - 10}:{STEPS}" in err
    assert f"next: replay scan --run {shlex.quote(run_copy)} --steps {STEPS - 10}:{STEPS}" in err


def test_triage_outside_suggests_the_nearest_logged_step_as_a_command_that_runs(run_copy, capsys):
    assert cli.main(["triage", "--run", run_copy, "--step", "500"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert f"next: replay triage --run {shlex.quote(run_copy)} --step {STEPS - 1}   (the nearest logged step)" in err
    assert "--steps 500" not in err.split("next:")[1].split("or:")[0]  # triage takes --step, not --steps
    assert cli.main(["triage", "--run", run_copy, "--step", "-4"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert f"next: replay triage --run {shlex.quote(run_copy)} --step 0" in err and "--steps -4" not in err


@pytest.mark.parametrize("start, stop, first, end, message, suggestion", [
    (15, 25, 0, 20, "steps 15:25 are partly outside the logged steps 0:20 of R: steps 20:25 were not logged; the "
                    "logged part is 15:20", (15, 20)),
    (2, 10, 5, 20, "steps 2:10 are partly outside the logged steps 5:20 of R: steps 2:5 were not logged; the "
                   "logged part is 5:10", (5, 10)),
    (0, 30, 5, 20, "steps 0:30 are partly outside the logged steps 5:20 of R: steps 0:5 and 20:30 were not "
                   "logged; the logged part is 5:20", (5, 20)),
    (799000, 800000, 0, 40, "steps 799000:800000 are outside the logged steps 0:40 of R; all 40 logged steps are "
                            "0:40 (fewer than the 1000 asked for)", (0, 40)),
    (799000, 799010, 0, 40, "steps 799000:799010 are outside the logged steps 0:40 of R; the nearest logged range "
                            "of the same length is 30:40", (30, 40)),
    (0, 3, 5, 20, "steps 0:3 are outside the logged steps 5:20 of R; the nearest logged range of the same length "
                  "is 5:8", (5, 8)),
])
def test_step_range_error_names_the_part_outside(start, stop, first, end, message, suggestion):
    e = StepRangeError.outside(start, stop, first, end, "R")
    assert str(e) == message and e.suggestion == suggestion and (e.start, e.stop) == (start, stop)


# --- a misspelt device name ---------------------------------------------------------------------------------


def test_device_name_typo_lists_the_names_and_suggests_the_nearest(run_dir, capsys):
    assert cli.main(["--run", run_dir, "--steps", "1:2", "--devices", "goood"]) == ExitCode.USAGE
    assert capsys.readouterr().err == (
        "usage error: device spec: unknown name 'goood'; did you mean 'good'? (names: all, good, suspect, "
        "process:N; device ids like 0,3,5-7; parts join with '+')\n")


def test_device_typo_is_reported_before_any_work(tmp_path, capsys):
    # No run is read: the spec is checked first (the missing run would be exit 5).
    assert cli.main(["canary", "--run", str(tmp_path / "nope"), "--devices", "sus"]) == ExitCode.USAGE
    assert "did you mean 'suspect'?" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("goood", "unknown name 'goood'; did you mean 'good'?"),
    ("alll+4", "unknown name 'alll'; did you mean 'all'?"),
    ("proces:1", "unknown name 'proces:1'; did you mean 'process:1'?"),
    ("xyz", "unknown name 'xyz'; (names: all, good, suspect, process:N;"),
    ("good,3", "'good' is a name, not a device id; names and ids join with '+': 'good+3'"),
    ("5-", "bad device id '5-'; expected an integer or an inclusive range like 5-7"),
    ("process:x", "bad process index 'x'; expected an integer"),
])
def test_parse_spec_messages(spec, message):
    with pytest.raises(DeviceSpecError) as e:
        parse_spec(spec)
    assert message in str(e.value)


def test_parse_spec_parts():
    assert parse_spec("Good + 0-2,5 + process:1") == [("good", ()), ("ids", (0, 1, 2, 5)), ("process", (1,))]


# --- help -----------------------------------------------------------------------------------------------------


def _help(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def _codes(text):
    return {int(m) for m in re.findall(r"^  ([0-9]+)  ", text, flags=re.M)}


def test_top_level_help_shows_range_options_and_one_line_per_command(monkeypatch, capsys):
    out = _help(["--help"], monkeypatch, capsys)
    for option in ("--run DIR", "--steps A:B", "--devices SPEC", "--plot OUT.png", "--placements", "--repeats",
                   "--tolerance RTOL", "--allow-env-drift", "--quarantine FILE", "--json OUT"):
        assert re.search(rf"^  {re.escape(option)}", out, flags=re.M), option
    assert "range options (the default command" in out
    lines = out.splitlines()
    for command in cli.COMMANDS:  # one line each: the next line is not a continuation
        [n] = [n for n, text in enumerate(lines) if re.match(rf"^    {command} +\S", text)]
        assert not lines[n + 1].startswith(" " * 6), lines[n:n + 2]
    assert _codes(out) == {int(c) for c in ExitCode}
    assert "$REPLAY_RUN, else the current folder" in out


@pytest.mark.parametrize("command, codes, absent", [
    ("range", {0, 1, 2, 3, 4, 5, 6, 20, 21, 23}, ["drill not caught", "suspects found"]),
    ("canary", {0, 1, 2, 3, 4, 5, 20, 21}, ["drill not caught", "suspects found", "environment drift",
                                    "replays on >= 2", "--allow-env-drift"]),
    ("inspect", {0, 2, 5}, ["convicted", "acquitted", "drill not caught", "environment drift", "replays"]),
    ("drill", {0, 1, 2, 5, 7}, ["suspects found", "environment drift", "ambiguous", "replays disagree"]),
    ("scan", {0, 2, 5, 8}, ["drill not caught", "convicted"]),
    ("triage", {0, 2, 5, 10, 11, 12, 13}, ["drill not caught", "environment drift"]),
    ("skip", {0, 2, 5}, ["drill not caught", "convicted", "suspects found"]),
    ("certify", {0, 2, 4, 5, 6, 20, 21}, ["drill not caught", "suspects found", "convicted"]),
])
def test_each_help_lists_only_its_own_exit_codes(command, codes, absent, monkeypatch, capsys):
    out = _help([command, "--help"], monkeypatch, capsys)
    assert _codes(out) == codes
    for text in absent:
        assert text not in out, text
    assert "$REPLAY_RUN" in out  # every command takes its run from --run, $REPLAY_RUN or the current folder


def test_inspect_help_says_decoded_text_is_normalized(monkeypatch, capsys):
    out = _flat(_help(["inspect", "--help"], monkeypatch, capsys))
    for text in ("decoded text (--text) is the tokenizer's normalization, not the original bytes",
                 "U+FE30 becomes '..'", "'ﬁ' (U+FB01) becomes 'fi'", "full-width digits become ASCII",
                 "runs of whitespace (newlines too) collapse to one space", "shows as ' ⁇ '",
                 "a row boundary inside a multi-byte character decodes to U+FFFD on each side",
                 "For the exact tokens use --json OUT: every document carries its token_ids"):
        assert text in out, text


# --- inspect --json carries the token ids ---------------------------------------------------------------------


def test_inspect_json_carries_each_documents_token_ids(replay_session, run_copy, tmp_path):
    j = str(tmp_path / "i.json")
    assert cli.main(["inspect", "--run", run_copy, "--steps", "3:5", "--json", j]) == 0
    rows = json.load(open(j))["rows"]
    data = replay_session.lookup_loader()
    stored = {step: data.read_rows(step) for step in (3, 4)}
    n = 0
    for r in rows:
        tokens = stored[r["step"]][r["position"]].tokens
        for d in r["documents"]:
            b, e = d["span"]
            assert d["token_ids"] == [int(t) for t in tokens[b:e]] and len(d["token_ids"]) == d["tokens"]
            n += 1
    assert n >= 16


# --- one width policy: messages never wrap when piped ---------------------------------------------------------


def test_piped_errors_are_one_line_whatever_their_length(tmp_path):
    missing = str(tmp_path / ("a-long-folder-name-" * 8) / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "REPLAY_RUN")}
    got = subprocess.run([sys.executable, "-m", "replay.cli", "--run", missing, "--steps", "1", "--devices",
                          "goood"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert got.returncode == ExitCode.USAGE
    assert got.stderr.splitlines() == ["usage error: device spec: unknown name 'goood'; did you mean 'good'? "
                                       "(names: all, good, suspect, process:N; device ids like 0,3,5-7; parts "
                                       "join with '+')"]
    got = subprocess.run([sys.executable, "-m", "replay.cli", "scan", "--run", missing], capture_output=True,
                         text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert got.returncode == ExitCode.RUN_ERROR
    assert got.stderr.splitlines() == [f"run directory or data error: run directory not found: {missing}"]


def test_console_width_policy():
    from replay.report import PIPED_WIDTH, make_console

    console = make_console(stderr=True)  # under pytest, not a terminal
    assert not console.is_terminal and console.width == PIPED_WIDTH and console.soft_wrap
    with console.capture() as cap:
        console.print("[red]x[/] " + "/path/" * 60)
    assert cap.get().count("\n") == 1


def test_panels_wrap_inside_their_border_when_piped():
    """A verdict's explanation is longer than the piped width: it wraps inside the panel, whole."""
    from replay import report

    console = report.make_console()
    tail = "run 'replay inspect' on the steps of interest"
    explanation = "the replay reproduces the log: " + "word " * 40 + tail
    with console.capture() as cap:
        report.render_range({"verdict": "acquitted", "exit_code": 0, "explanation": explanation,
                             "steps": {"start": 3, "stop": 4}, "replays": []}, console)
    text = cap.get()
    assert all(len(line) <= report.PIPED_WIDTH for line in text.splitlines())
    inside = " ".join(line.strip("│ ") for line in text.splitlines() if line.startswith("│"))
    assert _flat(explanation) in _flat(inside)


def test_inspect_table_says_when_it_shows_only_the_first_documents(run_dir, capsys):
    assert cli.main(["inspect", "--run", run_dir, "--steps", "3:5", "--max-rows", "2"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"showing the first 2 of (\d+) documents: --max-rows (\d+) shows all, --json OUT writes every "
                  r"document with its token ids", out)
    assert m and m.group(1) == m.group(2) and int(m.group(1)) > 2


@pytest.mark.parametrize("command", ["range", "canary", "inspect", "scan", "drill"])
def test_each_commands_usage_line_is_its_own(command, monkeypatch, capsys):
    out = _help([command, "--help"], monkeypatch, capsys)
    assert out.startswith(f"usage: replay {command} [-h]")


@pytest.mark.parametrize("argv", [["--steps", "-5:3"], ["--steps=-5:3"], ["range", "--steps", "-5:3"],
                                  ["inspect", "--steps", "-5:3"], ["scan", "--steps", "-5:3"], ["--steps", "-5"],
                                  ["skip", "--steps", "3:-1", "--reason", "r"]])
def test_a_negative_steps_range_is_the_tools_usage_error(argv, tmp_path, capsys):
    # Was (for "--steps -5:3"): argparse's "argument --steps: expected one argument" (it took -5:3 for an
    # option). No run is read: the range is checked first (the missing run would be exit 5).
    assert cli.main([*argv, "--run", str(tmp_path / "nope")]) == ExitCode.USAGE
    spec = next(a for a in argv if a[-1].isdigit()).removeprefix("--steps=")
    assert capsys.readouterr().err == (
        f"usage error: --steps: steps count from 0, got {spec!r}; give A:B with 0 <= A < B (half-open, steps "
        f"A..B-1) or one step A >= 0\n")


def test_a_malformed_steps_value_starting_with_a_dash_is_the_tools_usage_error(tmp_path, capsys):
    assert cli.main(["--steps", "-1.5", "--run", str(tmp_path / "nope")]) == ExitCode.USAGE
    assert capsys.readouterr().err == (
        "usage error: --steps: expected A:B (half-open, steps A..B-1) or A, got '-1.5'\n")
    assert cli.main(["--steps", "--run", str(tmp_path / "nope")]) == ExitCode.USAGE  # a missing value: argparse's
    assert "argument --steps: expected one argument" in capsys.readouterr().err
