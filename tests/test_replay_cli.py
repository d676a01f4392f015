"""The ``replay`` command line: help, exit codes, JSON fields and messages for good and bad usage.

``replay.cli.main`` runs in-process. ``engine.default_setup`` is patched to hand back the shared
session's set-up, so the CLI reuses the already compiled train step (the set-up itself is tested in
``test_replay_engine``); everything else (argument parsing, run loading, checks, reports, exit
codes) is the real path.
"""

import json
import os
import shutil

import jax
import pytest
from test_replay_support import STEPS

from replay import cli
from replay.run.codes import ExitCode


@pytest.mark.parametrize("argv", [["--help"], ["range", "--help"], ["canary", "--help"], ["drill", "--help"]])
def test_help_explains_device_spec_verdicts_and_exit_codes(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    needles = ["convicted", "usage error", "run directory or data error",
               "device spec", "good ", "suspect", "0,3,5-7", "process:1"]
    for needle in needles:
        assert needle in out, needle
    # Each help lists its own exit codes (tests/test_replay_messages.py); the top-level help all of them.
    for code in ExitCode if argv == ["--help"] else (ExitCode.ACQUITTED, ExitCode.USAGE, ExitCode.RUN_ERROR):
        assert f"  {int(code)}  " in out


def test_inspect_help_gives_its_own_exit_codes_not_verdicts(capsys):
    assert cli.main(["inspect", "--help"]) == 0
    out = capsys.readouterr().out
    assert "convicted" not in out and "any step can be" in " ".join(out.split())
    for code in (ExitCode.ACQUITTED, ExitCode.USAGE, ExitCode.RUN_ERROR):
        assert f"  {int(code)}  " in out


def test_no_arguments_is_usage(capsys):
    assert cli.main([]) == ExitCode.USAGE


def test_range_report_json_and_plot(run_dir, tmp_path, capsys):
    j, p = str(tmp_path / "r.json"), str(tmp_path / "r.png")
    code = cli.main(["--run", run_dir, "--steps", "9:11", "--devices", "all", "--json", j, "--plot", p,
                     "--no-progress"])
    assert code == ExitCode.ACQUITTED == 0
    out = json.load(open(j))
    assert set(out) >= {
        "kind", "run", "steps", "checkpoint", "checkpoints", "replayed_steps", "device_spec", "devices", "quarantine",
        "run_devices", "mesh", "environment", "tolerance", "evidence", "replays", "replay_disagreement", "verdict",
        "exit_code", "cause", "explanation", "first_divergent_step", "convicted_devices", "leaves",
        "differing_elements", "independent_replays", "relogged_conflicts", "skip_windows", "phase_changes", "timing"}
    assert out["steps"] == {"start": 9, "stop": 11} and out["checkpoint"] == 8
    assert out["verdict"] == "acquitted" and out["cause"] == "reproduced" and out["exit_code"] == 0
    assert out["mesh"] == {"axis_names": ["data", "expert"], "shape": [2, 2]}
    assert [r["assignment"] for r in out["replays"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [s["step"] for s in out["replays"][1]["steps"]] == [8, 9, 10]
    assert set(out["replays"][0]["steps"][0]) >= {"step", "ok", "kind", "batch_match", "loss_match", "devices",
                                                  "leaves", "evidence", "loss", "grad_norm"}
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "ACQUITTED" in capsys.readouterr().out


def test_bad_usage_exit_codes_and_messages(run_dir, run_copy, tmp_path, capsys):
    shutil.rmtree(os.path.join(run_copy, "checkpoints", "0"))
    cases = [
        (["--run", str(tmp_path / "nope"), "--steps", "1:2"], ExitCode.RUN_ERROR, "run directory not found"),
        (["--run", run_dir, "--steps", f"10:{STEPS + 5}"], ExitCode.RUN_ERROR,
         f"steps 10:{STEPS + 5} are partly outside the logged steps 0:{STEPS}"),
        (["--run", run_dir, "--steps", "5:3"], ExitCode.USAGE, "empty range"),
        (["--run", run_dir, "--steps", "x"], ExitCode.USAGE, "expected A:B"),
        (["--run", run_dir, "--steps", "1:2", "--devices", "0-2"], ExitCode.USAGE,
         "leaves 3 device(s) [0, 1, 2], but the run's mesh needs 4"),
        (["--run", run_dir, "--steps", "1:2", "--devices", "12"], ExitCode.USAGE, "no device with id [12]"),
        (["--run", run_dir, "--steps", "1:2", "--devices", "suspect"], ExitCode.USAGE, "no device is held suspect"),
        (["--run", run_copy, "--steps", "1:2"], ExitCode.RUN_ERROR, "no checkpoint at or before step 1"),
        (["--run", run_dir, "--steps", "1:2", "--tolerance", "2"], ExitCode.USAGE, "--tolerance must be in (0, 1)"),
        (["--run", run_dir, "--steps", "1:2", "--repeats", "0"], ExitCode.USAGE, "--repeats must be >= 1"),
        (["--run", run_dir, "--steps", "1:2", "--bogus"], ExitCode.USAGE, "unrecognized arguments: --bogus"),
        (["canary", "--run", run_dir, "--checkpoint", "5"], ExitCode.RUN_ERROR, "no checkpoint 5"),
        (["inspect", "--run", run_dir, "--steps", "0:10001"], ExitCode.USAGE, "inspect lists at most 10000 a call"),
        (["drill", "--run", run_dir, "--leaf", "nope"], ExitCode.USAGE, "--leaf 'nope': not a parameter leaf"),
        (["drill", "--run", run_dir, "--device", "6"], ExitCode.USAGE, "--device 6: not a device of the run's mesh"),
        (["drill", "--run", run_dir, "--bit", "32"], ExitCode.USAGE, "--bit 32: must be in [0, 32)"),
    ]
    for argv, code, message in cases:
        got = cli.main(argv)
        err = capsys.readouterr().err
        assert got == code, (argv, got, err)
        assert message in " ".join(err.split()), (argv, err)


def test_quarantine_file(run_dir, tmp_path, capsys):
    q = tmp_path / "q.txt"
    q.write_text("# suspect after the spike\n4\n5 # and its neighbours\n6\n7\n")
    j = str(tmp_path / "r.json")
    assert cli.main(["--run", run_dir, "--steps", "9", "--quarantine", str(q), "--json", j, "--no-progress"]) == 0
    out = json.load(open(j))
    assert out["quarantine"] == [4, 5, 6, 7] and out["devices"] == [0, 1, 2, 3]
    assert [r["assignment"] for r in out["replays"]] == [[0, 1, 2, 3], [1, 2, 3, 0]]
    assert out["independent_replays"] == 2
    assert cli.main(["--run", run_dir, "--steps", "9", "--quarantine", str(tmp_path / "none.txt")]) == \
        ExitCode.RUN_ERROR
    assert "quarantine file not found" in capsys.readouterr().err


def test_environment_drift_refused_unless_allowed(run_copy, tmp_path, capsys):
    env_path = os.path.join(run_copy, "env.json")
    env = json.load(open(env_path))
    env["versions"]["jax"] = "0.0.1"
    json.dump(env, open(env_path, "w"))
    assert cli.main(["--run", run_copy, "--steps", "9"]) == ExitCode.ENV_DRIFT
    err = " ".join(capsys.readouterr().err.split())
    assert "versions.jax: recorded '0.0.1'" in err and "--allow-env-drift" in err
    j = str(tmp_path / "r.json")
    assert cli.main(["--run", run_copy, "--steps", "9", "--allow-env-drift", "--json", j, "--no-progress"]) == 0
    out = json.load(open(j))
    assert out["environment"]["drift"] and out["environment"]["allow_env_drift"]
    assert any(d.startswith("versions.jax") for d in out["environment"]["differences"])
    assert cli.main(["--run", run_copy, "--steps", "9", "--tolerance", "1e-6", "--json", j, "--no-progress"]) == 0
    assert json.load(open(j))["evidence"] == "tolerance"


def test_swapped_rows_in_logged_file_reported_as_data_order(replay_session, run_copy, tmp_path, capsys):
    session = replay_session
    step = 9
    _, _, kept = session.run_steps((0, 1, 2, 3), 8, step, keep_state_at=step - 1)
    batch = session.numpy_batch(step, (0, 1, 2, 3))
    for v in batch.values():
        v[[0, 7]] = v[[7, 0]]
    sharding = session.setup.trainer.batch_sharding(session.mesh((0, 1, 2, 3)))
    _, fp = session.setup.trainer.train_step(kept[step - 1], {k: jax.device_put(v, sharding) for k, v in batch.items()},
                                             step)
    path = os.path.join(run_copy, "fingerprints.jsonl")
    lines = [json.loads(x) for x in open(path)]
    lines[step] = json.loads(fp.to_json())  # the line as a run logs it (sealed)
    with open(path, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    j = str(tmp_path / "r.json")
    assert cli.main(["--run", run_copy, "--steps", f"{step}:{step + 1}", "--json", j, "--no-progress"]) == 0
    out = json.load(open(j))
    assert out["verdict"] == "acquitted" and out["cause"] == "data_order" and out["first_divergent_step"] == step
    assert out["convicted_devices"] == [] and "replay inspect" in out["explanation"]


def test_canary_command(run_copy, tmp_path):
    j = str(tmp_path / "c.json")
    assert cli.main(["canary", "--run", run_copy, "--devices", "all", "--repeats", "1", "--json", j]) == 0
    out = json.load(open(j))
    assert out["golden"]["status"] == "created" and len(out["devices"]) == 8
    assert os.path.exists(os.path.join(run_copy, "canary", "golden.json"))
    assert cli.main(["canary", "--run", run_copy, "--devices", "process:0", "--repeats", "1", "--json", j]) == 0
    assert json.load(open(j))["golden"]["status"] == "matched"


def test_inspect_command(run_copy, tmp_path, capsys):
    j = str(tmp_path / "i.json")
    assert cli.main(["inspect", "--run", run_copy, "--steps", "3:5", "--json", j]) == 0
    out = json.load(open(j))
    assert len(out["rows"]) == 16 and set(out["sources"]) == {"a", "b"}
    assert "documents in steps 3:5" in capsys.readouterr().out
    assert cli.main(["inspect", "--run", run_copy, "--steps", "3", "--text"]) == ExitCode.RUN_ERROR
    assert "tokenizer" in capsys.readouterr().err
    # A lookup, not a replay: a step the run never logged (or has not reached) lists the same way.
    far = 10**9
    assert cli.main(["inspect", "--run", run_copy, "--steps", str(far), "--json", j]) == 0
    rows = json.load(open(j))["rows"]
    assert [r["step"] for r in rows] == [far] * 8 and [r["position"] for r in rows] == list(range(8))
    assert all(r["documents"] and r["source"] in {"a", "b"} for r in rows)


def test_drill_command(replay_session, run_copy, tmp_path, capsys):
    j = str(tmp_path / "d.json")
    assert cli.main(["drill", "--run", run_copy, "--count", "3", "--seed", "5", "--json", j]) == 0
    out = json.load(open(j))
    assert out["caught"] == out["total"] == 3
    d = out["drills"][0]
    assert d["range"]["convicted_devices"] == [d["fault"]["device_id"]]
    assert d["range"]["first_divergent_step"] == d["fault"]["step"]
    assert d["canary"]["odd_devices"] == [d["fault"]["device_id"]]
    disk = tmp_path / "drills"
    assert cli.main(["drill", "--run", run_copy, "--seed", "8", "--no-canary", "--to-disk", str(disk), "--json", j]) == 0
    out = json.load(open(j))
    assert out["caught"] == 1 and out["drills"][0]["range"]["run"] == str(disk / "drill-0")
    assert out["drills"][0]["range"]["differing_elements"] is not None  # checkpoint after the faulty step
    assert cli.main(["drill", "--run", run_copy, "--to-disk", str(disk)]) == ExitCode.USAGE
    assert "must be a new or empty folder" in " ".join(capsys.readouterr().err.split())
    leaf = replay_session.setup.trainer.leaf_paths[0]
    assert cli.main(["drill", "--run", run_copy, "--step", "3", "--device", "1", "--leaf", leaf, "--element", "0",
                     "--bit", "0", "--no-canary"]) == 0
    assert f"device_id=1, leaf=\"{leaf}\", element=0, bit=0): caught" in " ".join(capsys.readouterr().out.split())
