"""Hostile inputs to ``replay`` and the reference trainer: corrupted run directories, bad options,
restarts with another config, concurrent canaries. Each test pins a bug found by a hostile pass.

Reuses the session's shared run (``test_replay_support``) and its compiled set-up; every case that
mutates a run works on a copy. No test here compiles a train step.
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from test_replay_support import STEPS

from replay.run.canary import read_golden, update_golden
from replay.verify import canary
from replay import cli
from replay.runtime import devices
from replay import drill
from replay.verify import engine
from replay.run import env
from replay.run import protocol as proto
from replay.run import runlog
from replay.run.codes import ExitCode


def _snapshot(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _has(err, message):
    """Rich wraps long lines anywhere (paths included): compare with all whitespace removed."""
    return "".join(message.split()) in "".join(err.split())


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def _env_with(run, **mesh):
    with open(os.path.join(run, "env.json")) as f:
        rec = json.load(f)
    rec["mesh"].update(mesh)
    return json.dumps(rec)


def _truncate_checkpoint_data(run, step):
    files = [p for p in glob.glob(os.path.join(run, "checkpoints", str(step), "state", "**", "*"), recursive=True)
             if os.path.isfile(p) and os.sep + "d" + os.sep in p]
    assert files
    for p in files:
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 3)


CORRUPTIONS = [
    # (name, mutate(run), argv tail, exit code, message)
    ("run_config.yaml not UTF-8", lambda r: _write(f"{r}/run_config.yaml", b"\xff\xfe\x00junk"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "run_config.yaml: not UTF-8 text"),
    ("env.json a list", lambda r: _write(f"{r}/env.json", "[1, 2]"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "env.json: expected a JSON object, got list"),
    ("env.json not UTF-8", lambda r: _write(f"{r}/env.json", b"\xff\xfe"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "env.json: not UTF-8 text"),
    ("fingerprints.jsonl not UTF-8", lambda r: _write(f"{r}/fingerprints.jsonl", b"\xff\n\xfe\n"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "fingerprints.jsonl: not UTF-8 text"),
    ("quarantine.txt a folder", lambda r: os.makedirs(f"{r}/quarantine.txt"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "quarantine.txt: cannot read"),
    ("quarantine.txt not UTF-8", lambda r: _write(f"{r}/quarantine.txt", b"\xff\xfe3\n"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "not a text file of device ids"),
    ("quarantine.txt superscript digit", lambda r: _write(f"{r}/quarantine.txt", "\u00b2\n"),
     ["--steps", "1:2"], ExitCode.RUN_ERROR, "expected a device id (integer >= 0), got '\u00b2'"),
    ("golden.json not JSON", lambda r: _write(f"{r}/canary/golden.json", "{garbage"),
     ["canary", "--devices", "0"], ExitCode.RUN_ERROR, "canary golden file"),
    ("golden.json a list", lambda r: _write(f"{r}/canary/golden.json", "[1]"),
     ["canary", "--devices", "0"], ExitCode.RUN_ERROR, "is not a table of golden values"),
    ("golden.json entry without signature", lambda r: _write(f"{r}/canary/golden.json", '{"k": {"x": 1}}'),
     ["canary", "--devices", "0"], ExitCode.RUN_ERROR, "is not a table of golden values (entries ['k'])"),
    ("checkpoint data truncated", lambda r: _truncate_checkpoint_data(r, 4),
     ["--steps", "5:6"], ExitCode.RUN_ERROR, "checkpoint 4 of"),
    ("checkpoint emptied", lambda r: (shutil.rmtree(f"{r}/checkpoints/4"), os.makedirs(f"{r}/checkpoints/4")),
     ["--steps", "5:6"], ExitCode.RUN_ERROR, "checkpoint"),
    ("canary checkpoint truncated", lambda r: _truncate_checkpoint_data(r, 4),
     ["canary", "--devices", "0", "--checkpoint", "4"], ExitCode.RUN_ERROR, "cannot be restored"),
]


@pytest.mark.parametrize("name,mutate,tail,code,message", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_run_directory_is_a_run_error_not_a_traceback(run_copy, capsys, name, mutate, tail, code,
                                                                 message):
    mutate(run_copy)
    before = _snapshot(run_copy)
    argv = ([tail[0], "--run", run_copy, *tail[1:]] if tail[0] in ("canary", "inspect", "drill")
            else ["--run", run_copy, *tail])
    got = cli.main([*argv, "--no-progress"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert got == code, (name, got, err)
    assert _has(err, message), (name, err)
    assert _snapshot(run_copy) == before  # read-only, also when refusing


_REAL_DEFAULT_SETUP = engine.default_setup  # the CLI tests patch it to reuse the compiled set-up


@pytest.mark.parametrize("mesh,message", [
    ({"shape": ["x", 2]}, "malformed mesh record"),
    ({"shape": [2, 2, 1]}, "malformed mesh record: axis_names ['data', 'expert'], shape [2, 2, 1]"),
    ({"shape": [2, 0]}, "malformed mesh record"),
    ({"device_ids": [0, 1]}, "mesh device_ids [0, 1] do not fill the mesh shape [2, 2]"),
    ({"axis_names": None}, "no mesh recorded"),
])
def test_malformed_mesh_record_is_a_run_error(replay_made, tmp_path, mesh, message):
    run = str(tmp_path / "run")
    shutil.copytree(replay_made[0], run)
    _write(f"{run}/env.json", _env_with(run, **mesh))
    with pytest.raises(runlog.RunDirError) as e:
        _REAL_DEFAULT_SETUP(runlog.load_run(run))
    assert message in str(e.value)


def test_truncated_checkpoint_message_points_to_an_older_one(run_copy, capsys):
    _truncate_checkpoint_data(run_copy, 4)
    assert cli.main(["--run", run_copy, "--steps", "5:6", "--no-progress"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert _has(err, "damaged or incomplete") and _has(err, "replay from an older checkpoint ([0]) with --steps C:B")


def test_bad_options_are_usage_errors(run_dir, run_copy, tmp_path, capsys):
    log = os.path.join(run_copy, "fingerprints.jsonl")
    before = _snapshot(run_copy)
    afile = tmp_path / "a_file"
    afile.write_text("x")
    cases = [
        (["canary", "--run", run_dir, "--rows", "0"], "--rows must be in [1, 8] (the run's global batch), got 0"),
        (["canary", "--run", run_dir, "--rows", "9"], "--rows must be in [1, 8]"),
        (["canary", "--run", run_dir, "--step", "-1"], "--step must be >= 0, got -1"),
        (["drill", "--run", run_dir, "--to-disk", str(afile)], "must be a new or empty folder"),
        (["--run", run_dir, "--steps", "1:2", "--devices", "0-4000000000"], "at most 65536"),
        (["--run", run_dir, "--steps", "1:2", "--devices", "process:0-4000000000"], "at most 65536"),
        (["--run", run_copy, "--steps", "1:2", "--json", log], "would write into the run's own files"),
        (["--run", run_copy, "--steps", "1:2", "--plot", os.path.join(run_copy, "checkpoints", "4", "x.png")],
         "would write into the run's own files"),
        (["inspect", "--run", run_copy, "--steps", "1", "--json", os.path.join(run_copy, "env.json")],
         "would write into the run's own files"),
        (["canary", "--run", run_copy, "--golden", os.path.join(run_copy, "run_config.yaml")],
         "would write into the run's own files"),
        (["--run", run_dir, "--steps", "1:2", "--json", str(tmp_path)], "is a folder; give a file name"),
    ]
    for argv, message in cases:
        got = cli.main([*argv, "--no-progress"] if argv[0] != "inspect" else argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert got == ExitCode.USAGE, (argv, got, err)
        assert _has(err, message), (argv, err)
    assert _snapshot(run_copy) == before


def test_device_range_is_never_materialized():
    infos = [devices.DeviceInfo(i) for i in range(8)]
    with pytest.raises(devices.DeviceSpecError, match="names 10000000001 device ids; at most 65536"):
        devices.select_devices("0-10000000000", infos, minimum=1)
    assert [d.id for d in devices.select_devices("6-7", infos)] == [6, 7]


def test_events_with_a_torn_middle_line_still_load(run_copy):
    path = os.path.join(run_copy, "events.jsonl")
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:  # a kill tore a line, then the resumed run appended after it
        f.writelines(lines[:2] + ['{"event": "chec' + lines[2]] + lines[3:])
    run = runlog.load_run(run_copy)
    assert len(run.all_events) == len(lines) - 1  # every event; run.events: the lineage's
    assert all(isinstance(e, dict) and "event" in e for e in run.all_events)
    assert len(run.events) + len(run.lineage.superseded_events) == len(run.all_events)


def test_xla_flags_in_another_order_are_no_drift():
    rec = {"env": {"XLA_FLAGS": "--a=1  --b=2"}}
    assert env.compare_environment(rec, {"env": {"XLA_FLAGS": "--b=2 --a=1"}}) == []
    assert env.compare_environment(rec, {"env": {"XLA_FLAGS": "--a=1"}}) == [
        "env.XLA_FLAGS: recorded '--a=1  --b=2', current '--a=1'"]


@pytest.mark.parametrize("recorded,added", [
    (["--xla_force_host_platform_device_count=8", *env.DETERMINISM_XLA_FLAGS], list(env.DETERMINISM_XLA_FLAGS)),
    (["--xla_force_host_platform_device_count=8"], []),  # a run trained through the library: nothing pinned
])
def test_replay_command_pins_the_determinism_flags_the_run_recorded(tmp_path, recorded, added):
    # `python -m replay.reference.train` pins them (and records them in env.json); the replay
    # command must compile under the same flags, else every CLI-trained run is refused as drift.
    _write(str(tmp_path / "env.json"), json.dumps({"env": {"XLA_FLAGS": " ".join(recorded)}}))
    code = ("import os, sys; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
            "from replay import cli; print(cli._pin_determinism_flags(sys.argv[1])); print(os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == [str(added), " ".join(["--xla_force_host_platform_device_count=8", *added])]


def test_no_flag_pinning_once_the_backend_runs(replay_session, tmp_path, monkeypatch):
    _write(str(tmp_path / "env.json"), json.dumps({"env": {"XLA_FLAGS": " ".join(env.DETERMINISM_XLA_FLAGS)}}))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    # The session's backend is initialized: pinning would only make the recorded environment lie.
    assert cli._pin_determinism_flags(str(tmp_path)) == []
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_run_devices_takes_the_run_configs_mesh_pairs(replay_session):
    from replay.reference import run as ref_run

    cfg = ref_run.run_config_from_dict(replay_session.run.config, replay_session.run.run_dir)
    assert isinstance(cfg.mesh, tuple)
    assert [d.id for d in ref_run.run_devices(cfg.mesh)] == [0, 1, 2, 3]
    _, mesh, _ = ref_run.make_trainer(cfg)  # crashed: 'tuple' object has no attribute 'values'
    assert [d.id for d in mesh.devices.flat] == [0, 1, 2, 3]


def test_refused_restart_leaves_the_run_config_as_used(replay_made, run_copy):
    import jax

    from replay.reference import run as ref_run
    from replay.reference import loop
    from replay.reference.trainer import make_mesh

    _, trainer = replay_made
    run = runlog.load_run(run_copy)
    cfg = ref_run.run_config_from_dict({**run.config, "skip_windows": [[2, 3], [8, 8]]}, run_copy)
    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    before = _snapshot(run_copy)
    with pytest.raises(ValueError):  # the loader refuses a window before the saved next step
        loop.train(run_copy, cfg, STEPS + 2, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    # The run's config still says what the run used (was rewritten with [2, 3], and replay then
    # called steps 2-3 a data difference), and no restore event was logged for the refused start.
    assert _snapshot(run_copy) == before


def test_restart_drops_a_torn_event_line(replay_made, run_copy):
    import jax

    from replay.reference import run as ref_run
    from replay.reference import loop
    from replay.reference.trainer import make_mesh

    _, trainer = replay_made
    run = runlog.load_run(run_copy)
    cfg = ref_run.run_config_from_dict(run.config, run_copy)
    path = os.path.join(run_copy, "events.jsonl")
    n = len(open(path).readlines())
    with open(path, "a") as f:
        f.write('{"event": "checkp')
    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    loop.train(run_copy, cfg, STEPS, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    events = [json.loads(line) for line in open(path)]  # the torn line dropped; nothing to do appends nothing
    assert len(events) == n and events[-1]["event"] == "end"
    loop.train(run_copy, cfg, STEPS + 1, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    events = [json.loads(line) for line in open(path)]  # one more step: its attempt appends after the repaired end
    assert [e["event"] for e in events[n:]][:1] == ["restore"] and events[-1]["event"] == "end"


def test_golden_updates_are_atomic_and_keep_concurrent_entries(tmp_path):
    path = str(tmp_path / "canary" / "golden.json")
    barrier = threading.Barrier(8)

    def add(i):
        barrier.wait()
        update_golden(path, f"key{i}", {"signature": f"s{i}"}, reset=False)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read_golden(path) == {f"key{i}": {"signature": f"s{i}"} for i in range(8)}
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    assert sorted(os.listdir(tmp_path / "canary")) == [".golden.json.lock", "golden.json"]
    _write(path, "{torn")
    with pytest.raises(runlog.RunDirError, match="pass --reset-golden"):
        update_golden(path, "k", {"signature": "s"}, reset=False)
    update_golden(path, "k", {"signature": "s"}, reset=True)
    assert read_golden(path) == {"k": {"signature": "s"}}


def test_drill_canary_always_includes_the_faulty_device(replay_session, monkeypatch):
    from replay.run.protocol import FaultSpec

    seen = {}

    class _Rep:
        verdict = drill.Verdict.CONVICTED
        decision = type("D", (), {"devices": (2,), "step": 5})()

    def fake_canary(session, **kw):
        seen["spec"] = kw["device_spec"]
        return type("C", (), {"decision": type("D", (), {"verdict": drill.Verdict.CONVICTED,
                                                         "odd_devices": (2,)})()})()

    monkeypatch.setattr(drill, "drilled_log", lambda session, fault: {})
    monkeypatch.setattr(engine, "replay_range", lambda *a, **k: _Rep())
    monkeypatch.setattr(canary, "run_canary", fake_canary)
    fault = FaultSpec(step=5, device_id=2, leaf=replay_session.setup.trainer.leaf_paths[0], element=0, bit=0)
    rep = drill.run_drill(replay_session, fault, device_spec="4-7")
    assert seen["spec"] == "4-7+2" and rep.caught
    ids = [d.id for d in devices.select_devices(seen["spec"], replay_session.device_infos())]
    assert ids == [2, 4, 5, 6, 7]


def _rewrite_log(run, edit):
    path = os.path.join(run, "fingerprints.jsonl")
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    entries = edit(entries)
    with open(path, "w") as f:  # sealed again: the lines a writer with these values would have written
        f.writelines(json.dumps(proto.seal(e) if proto.LINE_CHECK in e else e) + "\n" for e in entries)


def test_sparse_log_is_refused_without_walking_every_step(run_copy, capsys):
    # One stray line at step 10**9: replay must not build a list of 10**9 steps (it was killed for memory).
    far = 10**9
    _rewrite_log(run_copy, lambda es: es + [{**es[-1], "step": far}])
    cases = [
        (["--run", run_copy, "--steps", str(far), "--no-progress"], ExitCode.RUN_ERROR,
         f"steps [12, 13, 14, 15, 16, 17, 18, 19, 20, 21] between checkpoint {STEPS} and {far} have no logged"),
        (["--run", run_copy, "--steps", f"5:{far + 1}", "--no-progress"], ExitCode.RUN_ERROR,
         f"steps [12, 13, 14, 15, 16, 17, 18, 19, 20, 21] of 5:{far + 1} have no logged fingerprints"),
        (["drill", "--run", run_copy, "--step", str(far)], ExitCode.USAGE,
         f"--step {far}: must be a logged step with a checkpoint at or before it, in [0, {STEPS - 1}]"),
    ]
    for argv, code, message in cases:
        got = cli.main(argv)
        err = capsys.readouterr().err
        assert got == code, (argv, got, err)
        assert _has(err, message), (argv, err)
    assert runlog.missing_steps({0: 1, far: 1}, 0, far + 1, limit=3) == [1, 2, 3]


def test_inspect_a_far_step_is_a_lookup(run_copy, tmp_path, capsys):
    far = 10**9
    _rewrite_log(run_copy, lambda es: es + [{**es[-1], "step": far}])
    out = tmp_path / "far.json"
    assert cli.main(["inspect", "--run", run_copy, "--steps", str(far), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [far] * 8 and [r["position"] for r in rows] == list(range(8))


@pytest.mark.parametrize("damage,reason", [
    (lambda e: e["devices"]["3"].pop(sorted(e["leaves"])[0]), "device 3's leaves differ from the step's leaves"),
    (lambda e: e["devices"].pop("3"), "devices [0, 1, 2] do not match the mesh coordinates' devices [0, 1, 2, 3]"),
])
def test_structurally_damaged_log_line_is_not_a_device_fault(run_copy, capsys, damage, reason):
    # A device entry missing from the log compared with a replay would convict that device.
    def edit(entries):
        damage(entries[5])
        return entries

    _rewrite_log(run_copy, edit)
    run = runlog.load_run(run_copy)
    assert 5 not in run.fingerprints and reason in run.malformed[5]
    run.check_range(6, 7)
    assert cli.main(["--run", run_copy, "--steps", "5:6", "--no-progress"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert _has(err, "step 5: its logged fingerprints are malformed") and _has(err, "not a device fault")
    assert drill._replayable_steps(run) == [0, 1, 2, 3, 4, 8, 9, 10, 11]
    run.check_range(5, 6, allow_malformed=True)
    assert cli.main(["inspect", "--run", run_copy, "--steps", "5"]) == 0  # forensics needs no fingerprints


def test_output_path_errors(run_dir, tmp_path, monkeypatch, capsys):
    from replay import report

    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert cli.main(["inspect", "--run", run_dir, "--steps", "1", "--json", str(afile / "sub" / "x.json")]) == 2
    assert _has(capsys.readouterr().err, f"--json {afile / 'sub' / 'x.json'}: {afile} is not a folder")

    def denied(report_dict, path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(report, "write_json", denied)
    got = cli.main(["inspect", "--run", run_dir, "--steps", "1", "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert got == ExitCode.RUN_ERROR and "Traceback" not in err
    assert _has(err, f"cannot read or write {tmp_path / 'x.json'}: Permission denied")


def test_resume_from_a_damaged_checkpoint_names_it(replay_made, run_copy):
    import jax

    from replay.reference import run as ref_run
    from replay.reference import loop
    from replay.reference.trainer import make_mesh

    _, trainer = replay_made
    cfg = ref_run.run_config_from_dict(runlog.load_run(run_copy).config, run_copy)
    _truncate_checkpoint_data(run_copy, STEPS)
    before = _snapshot(run_copy)
    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    with pytest.raises(ref_run.RunConfigError) as e:
        loop.train(run_copy, cfg, STEPS + 2, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    msg = str(e.value)
    assert f"checkpoint {STEPS} is damaged" in msg
    assert msg.endswith(f"move {os.path.join(run_copy, 'checkpoints', str(STEPS))} aside to resume from 8")
    assert _snapshot(run_copy) == before


def test_canary_verdict_survives_an_unwritable_golden_file(run_copy, tmp_path, monkeypatch, capsys):
    def denied(path, table):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("replay.run.canary.write_golden", denied)
    out = tmp_path / "c.json"
    assert cli.main(["canary", "--run", run_copy, "--devices", "0", "--repeats", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["verdict"] == "acquitted" and rep["golden"]["status"] == "created-not-saved"
    assert rep["explanation"].endswith("could not be saved to "
                                       f"{os.path.join(run_copy, 'canary', 'golden.json')}: Permission denied; "
                                       "pass --golden FILE)")
    assert not os.path.exists(os.path.join(run_copy, "canary", "golden.json"))


def test_training_command_reports_os_errors(tmp_path, capsys, monkeypatch):
    from replay.reference import train as train_cmd

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() pins flags: restore them after

    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert train_cmd.main(["--run", str(tmp_path / "r"), "--config", str(tmp_path), "--steps", "2"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: Is a directory\n"


def test_damaged_checkpoint_command_prints_no_traceback(run_copy):
    # TensorStore's aborted reads printed a 'RuntimeError: Event loop is closed' traceback per array,
    # during the restore and at interpreter exit; the command must print its one message only.
    _truncate_checkpoint_data(run_copy, 4)
    code = "import sys; from replay import cli; sys.exit(cli.main())"
    proc = subprocess.run([sys.executable, "-c", code, "--run", run_copy, "--steps", "5:6", "--no-progress"],
                          capture_output=True, text=True)
    assert proc.returncode == ExitCode.RUN_ERROR, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    assert _has(proc.stderr, "checkpoint 4 of") and _has(proc.stderr, "cannot be restored")


def test_a_step_logged_twice_with_different_lines_convicts_no_device(run_copy, capsys):
    """A second line for step 5 whose device 1 fingerprint of one leaf differs (a damaged log, or a user's trainer
    that appends a retrained step): the replay differs from the line kept (the last) on device 1 alone, which would
    convict it; the log contradicts itself there, so the verdict is ambiguous (LOG_CONFLICT), never a conviction."""
    log = os.path.join(run_copy, "fingerprints.jsonl")
    lines = open(log, encoding="utf-8").read().splitlines(True)
    (i,) = [n for n, line in enumerate(lines) if json.loads(line)["step"] == 5]
    rec = json.loads(lines[i])
    leaf = sorted(rec["devices"]["1"])[0]
    rec["devices"]["1"][leaf] = rec["devices"]["1"][leaf] ^ 1
    lines.insert(i + 1, json.dumps(proto.seal(rec)) + "\n")  # sealed as its writer wrote it: not damage
    with open(log, "w", encoding="utf-8") as f:
        f.writelines(lines)
    out = os.path.join(run_copy, "..", "relogged.json")
    assert cli.main(["--run", run_copy, "--steps", "5:6", "--no-progress", "--json", out]) == ExitCode.AMBIGUOUS
    rep = json.load(open(out))
    assert rep["relogged_conflicts"] == [5] and rep["convicted_devices"] == []
    assert rep["cause"] == "log_conflict" and "logged twice" in capsys.readouterr().out


def _edit_step_line(run, step, edit):
    """Changes ``step``'s line of fingerprints.jsonl in place (``edit(record)``) and writes it back with the
    checksum its writer gave it: the line a disk, a copy or a hand changed after it was written."""
    log = os.path.join(run, "fingerprints.jsonl")
    lines = open(log, encoding="utf-8").read().splitlines(True)
    (i,) = [n for n, line in enumerate(lines) if json.loads(line)["step"] == step]
    rec = json.loads(lines[i])
    assert proto.LINE_CHECK in rec  # the writer sealed it
    edit(rec)
    lines[i] = json.dumps(rec, sort_keys=True) + "\n"
    with open(log, "w", encoding="utf-8") as f:
        f.writelines(lines)


@pytest.mark.parametrize("what", ["a device's fingerprint", "a reduced leaf's fingerprint", "the loss bits",
                                  "a device's fingerprint, its step written 5.0", "a device's fingerprint, step '5'",
                                  "a device's fingerprint, its crc32 removed"])
def test_a_line_changed_after_it_was_written_convicts_no_device(run_copy, capsys, what):
    """One bit of step 5's line changed in the file (device 1's fingerprint of one leaf, the reduced gradient's
    fingerprint of a leaf, or the loss): compared with a replay the first convicts device 1 (exit 3, before
    2026-12-07) and the others call the step irreproducible; the line's checksum fails, so the step is a
    damaged log (exit 5) naming the file and what to do, and the steps before it are still judged."""
    def edit(rec):
        if what.startswith("a device's fingerprint"):
            leaf = sorted(rec["devices"]["1"])[0]
            rec["devices"]["1"][leaf] ^= 1 << 17
            # found by a hostile test: a step the parser still reads as 5 skipped the check, and so did a line
            # whose crc32 was removed with the edit (the other lines of the file are sealed)
            if what.endswith("5.0"):
                rec["step"] = 5.0
            elif what.endswith("'5'"):
                rec["step"] = "5"
            elif what.endswith("removed"):
                del rec[proto.LINE_CHECK]
        elif what == "a reduced leaf's fingerprint":
            leaf = sorted(rec["leaves"])[0]
            rec["leaves"][leaf]["fp"] ^= 1
        else:
            rec["loss_bits"] ^= 1 << 3
    _edit_step_line(run_copy, 5, edit)
    out = os.path.join(run_copy, "..", "damaged.json")
    assert cli.main(["--run", run_copy, "--steps", "5:6", "--no-progress", "--json", out]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert _has(err, "the line is damaged: it carries no crc32" if what.endswith("removed") else
                "the line is damaged: its crc32") and _has(err, "not a device fault")
    assert "fingerprints.jsonl entry" in err and not os.path.exists(out)
    # the step before it is still judged (replayed from checkpoint 4)
    assert cli.main(["--run", run_copy, "--steps", "4:5", "--no-progress"]) == ExitCode.ACQUITTED


def test_a_line_without_a_checksum_is_read_as_before(run_copy):
    """Runs written before the checksum (and writers that do not seal) still read: lines without crc32 before
    the first sealed line of their file are not checked (a run resumed by a writer that seals); one after a
    sealed line is damage (above)."""
    log = os.path.join(run_copy, "fingerprints.jsonl")
    lines = [json.loads(x) for x in open(log, encoding="utf-8")]
    for d in lines[:6]:
        del d[proto.LINE_CHECK]
    with open(log, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, sort_keys=True) + "\n" for d in lines)
    # such a run's env.json does not say that its writer sealed every line (this writer's does)
    env_path = os.path.join(run_copy, proto.ENV_NAME)
    env = json.load(open(env_path, encoding="utf-8"))
    assert env.pop(proto.RUN_LINE_CHECK) == proto.LINE_CHECK
    with open(env_path, "w", encoding="utf-8") as f:
        json.dump(env, f)
    run = runlog.load_run(run_copy)
    assert {0, 1, 2, 3, 4, 5, 6} <= set(run.fingerprints) and not run.malformed


def test_a_first_line_whose_checksum_was_removed_convicts_no_device(run_copy, capsys):
    """The first line of fingerprints.jsonl changed and its crc32 removed with the edit: with no sealed line
    before it, it read unchecked and convicted device 1 (known and left on 2026-12-07). The run's env.json
    now says that its writer sealed every line (``step_log_check``), so it is damage wherever it is: exit 5,
    no device named; the canary and signals logs of such a run read the same way."""
    log = os.path.join(run_copy, "fingerprints.jsonl")
    first = json.loads(open(log, encoding="utf-8").readline())["step"]

    def edit(rec):
        leaf = sorted(rec["devices"]["1"])[0]
        rec["devices"]["1"][leaf] ^= 1 << 17
        del rec[proto.LINE_CHECK]
    _edit_step_line(run_copy, first, edit)
    out = os.path.join(run_copy, "..", "first.json")
    assert cli.main(["--run", run_copy, "--steps", f"{first}:{first + 1}", "--no-progress", "--json", out]) \
        == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert _has(err, "the line is damaged: it carries no crc32 where its run's writer sealed every line")
    assert _has(err, "not a device fault") and not os.path.exists(out)
    signals = os.path.join(run_copy, proto.SIGNALS_NAME)
    lines = open(signals, encoding="utf-8").read().splitlines(True)
    rec = json.loads(lines[0])
    del rec[proto.LINE_CHECK]
    lines[0] = json.dumps(rec) + "\n"
    with open(signals, "w", encoding="utf-8") as f:
        f.writelines(lines)
    with pytest.raises(proto.StepLogLineError, match="signals.jsonl:1: the line is damaged: it carries no crc32"):
        proto.read_raw_lines(signals)


def test_certify_and_triage_name_a_damaged_line_and_judge_nothing_from_it(run_copy, capsys):
    """Step 5's line changed in the file: triage of step 5 is a run error (before, the missing loss read as a
    non-finite one), and certify certifies what replay reaches before step 5 and calls the checkpoints past it
    not certifiable, naming the line (before, it crashed with a KeyError: exit 1)."""
    def edit(rec):
        leaf = sorted(rec["devices"]["1"])[0]
        rec["devices"]["1"][leaf] ^= 1
    _edit_step_line(run_copy, 5, edit)
    assert cli.main(["triage", "--run", run_copy, "--step", "5", "--no-progress"]) == ExitCode.RUN_ERROR
    assert _has(capsys.readouterr().err, "triage cannot judge it (a damaged log, not a device fault)")
    out = os.path.join(run_copy, "..", "certify.json")
    assert cli.main(["certify", "--run", run_copy, "--no-progress", "--json", out]) == ExitCode.AMBIGUOUS
    rep = json.load(open(out))
    assert [(c["checkpoint"], c["verdict"]) for c in rep["chain"]] == [
        (0, "trusted"), (4, "certified"), (8, "not_certifiable"), (12, "not_certifiable")]
    assert rep["certified"] == 4 and "the line is damaged: its crc32" in rep["chain"][2]["reason"]
