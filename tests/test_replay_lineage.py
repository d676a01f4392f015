"""Attempts and lineage (replay.run.lineage): hand-made event logs, scans that must read only the
lineage, old run directories, a real rollback, and the run's own copy of its mixture."""

import json
import os
import shutil

import pytest
import yaml

from replay.cli import main
from replay.run import lineage as lin
from replay.run import protocol as proto
from replay.run.codes import ExitCode
from replay.run.runlog import load_run
from replay.screen import scan as scan_mod
from test_replay_scan import make_run


def kinds(events):
    return [(e["event"], e["step"]) for e in events]


# The case of issue 20: train, crash at 15, resume from checkpoint 10 (attempt 2) to 20, roll back to
# checkpoint 5 (attempt 3) and train on to 40.
ROLLBACK = [
    {"event": "start", "step": 0, "attempt": 1}, {"event": "checkpoint", "step": 0, "attempt": 1},
    {"event": "checkpoint", "step": 5, "attempt": 1}, {"event": "checkpoint", "step": 10, "attempt": 1},
    {"event": "restore", "step": 10, "attempt": 2, "previous_end": 15, "reason": "resume"},
    {"event": "checkpoint", "step": 15, "attempt": 2},
    {"event": "restore", "step": 5, "attempt": 3, "previous_end": 20, "reason": "rollback"},
    {"event": "checkpoint", "step": 10, "attempt": 3}, {"event": "checkpoint", "step": 15, "attempt": 3},
]


def test_the_rollback_case_attempts_lineage_and_superseded_steps():
    lineage = lin.build_lineage(ROLLBACK, 40)
    a1, a2, a3 = lineage.attempts
    assert (a1.lineage, a1.superseded, a1.trained_end) == ((0, 5), (5, 15), 15)
    assert (a2.lineage_steps, a2.superseded, a2.kind) == (0, (10, 20), "resume")
    assert (a3.lineage, a3.superseded, a3.kind) == ((5, 40), None, "rollback")
    assert (lineage.first, lineage.end) == (0, 40)
    assert [lineage.attempt_of(s) for s in (0, 4, 5, 39, 40)] == [1, 1, 3, 3, None]
    # steps 10..14 of attempt 1 were lost to its crash (cut by attempt 2's resume), 5..9 by the rollback
    assert lineage.superseded_spans() == [
        {"attempt": 1, "steps": [10, 15], "cut_by": 2, "kind": "resume"},
        {"attempt": 1, "steps": [5, 10], "cut_by": 3, "kind": "rollback"},
        {"attempt": 2, "steps": [10, 20], "cut_by": 3, "kind": "rollback"}]
    assert a1.cut_of(12) == 2 and a1.cut_of(7) == 3 and a1.cut_of(3) is None
    # attempt 2's restore and checkpoint are history, not lineage; the checkpoints 0 and 5 it restored are
    assert ("restore", 10) not in kinds(lineage.events) and ("restore", 10) in kinds(lineage.superseded_events)
    assert kinds(lineage.events) == [("start", 0), ("checkpoint", 0), ("checkpoint", 5), ("restore", 5),
                                     ("checkpoint", 10), ("checkpoint", 15)]
    text = "\n".join(lineage.describe())
    assert "steps 10:20 of attempt 2 (resume from checkpoint 10, trained to step 20) are superseded: attempt 3 " \
           "rolled back to checkpoint 5" in text
    assert lineage.restarts() == [0, 5] and lineage.next_attempt() == 4


def test_a_second_rollback_cuts_again():
    events = ROLLBACK + [{"event": "restore", "step": 10, "attempt": 4, "previous_end": 40, "reason": "rollback"}]
    lineage = lin.build_lineage(events, 30)
    a1, a2, a3, a4 = lineage.attempts
    assert (a3.lineage, a3.superseded) == ((5, 10), (10, 40))
    assert (a4.lineage, lineage.end) == ((10, 30), 30)
    assert [lineage.attempt_of(s) for s in (4, 9, 10)] == [1, 3, 4]
    assert ("checkpoint", 10) in kinds(lineage.events)  # attempt 3's checkpoint 10: what attempt 4 restored
    assert ("checkpoint", 15) not in kinds(lineage.events)


def test_an_old_run_directory_reads_the_same_lineage():
    """Events written before attempts were recorded: no attempt, no previous_end, only the trainer's
    count of dropped fingerprint lines (which counted a torn line too, so it is not taken as exact)."""
    old = [{k: v for k, v in e.items() if k not in ("attempt", "previous_end", "reason")} for e in ROLLBACK]
    old[4]["dropped_fingerprint_lines"], old[6]["dropped_fingerprint_lines"] = 6, 15
    lineage = lin.build_lineage(old, 40)
    assert [a.lineage for a in lineage.attempts] == [(0, 5), (10, 5), (5, 40)]
    assert [a.kind for a in lineage.attempts] == ["start", "resume", "rollback"]
    assert kinds(lineage.events) == kinds(lin.build_lineage(ROLLBACK, 40).events)
    assert lineage.attempts[0].trained_end is None and "is not recorded" in lineage.describe()[0]
    # a restore that dropped no line trained exactly to its step
    clean = [{"event": "start", "step": 0}, {"event": "restore", "step": 10, "dropped_fingerprint_lines": 0}]
    assert lin.build_lineage(clean, 20).attempts[0].trained_end == 10


def test_a_pending_rewind_cuts_the_lineage_until_training_resumes():
    events = [{"event": "start", "step": 0, "attempt": 1}, {"event": "checkpoint", "step": 20, "attempt": 1},
              {"event": "end", "step": 30, "attempt": 1},
              {"event": "skip_window", "step": 22, "start": 22, "end": 25, "attempt": 1},
              {"event": "rewind", "step": 20, "checkpoint": 20, "previous_end": 30, "attempt": 1}]
    lineage = lin.build_lineage(events, 30)
    assert (lineage.end, lineage.skip_windows) == (20, ((22, 25),))
    assert lineage.pending_rewind["checkpoint"] == 20 and lineage.attempts[0].superseded == (20, 30)
    assert "a rewind to checkpoint 20 was requested" in lineage.describe()[0]
    resumed = lin.build_lineage(events + [{"event": "restore", "step": 20, "attempt": 2, "previous_end": 30}], 31)
    assert resumed.pending_rewind is None and resumed.attempts[1].kind == "rewind"
    assert resumed.superseded_spans() == [{"attempt": 1, "steps": [20, 30], "cut_by": 2, "kind": "rewind"}]


def _rollback_logs(root, **kw):
    return make_run(root, steps=40, events=ROLLBACK[1:], **kw)


def test_scan_reads_only_the_lineage(tmp_path):
    """Issue 20's failure: a spike at step 11 of attempt 3 was explained by attempt 2's superseded
    restore at 10, and a 3 s loader stall at step 10 was excused as the first step after it."""
    root = _rollback_logs(str(tmp_path / "r"), loss_spike=11, waits=[(10, 3.0)])
    rep = scan_mod.scan_run(load_run(root))
    assert rep.checks["loss_spike"]["status"] == "found" and not rep.explained
    assert any(s.subject == "run" and s.evidence[0].first_step == 11 for s in rep.suspects)
    assert rep.checks["loader_stall"]["status"] == "found"
    assert any(s.kind == "loader" and s.first_step == 10 for s in rep.suspects)
    assert any("of attempt 2" in x and "rolled back to checkpoint 5" in x for x in rep.to_dict()["lineage"])
    # the same spike at the lineage's own restore (step 5) is explained by it
    rep5 = scan_mod.scan_run(load_run(_rollback_logs(str(tmp_path / "r5"), loss_spike=5)))
    assert [e["step"] for e in rep5.explained] == [5] and rep5.explained[0]["explained_by"] == "restore"


def test_an_event_never_explains_a_non_finite_loss(tmp_path):
    root = make_run(str(tmp_path / "n"), steps=40, events=[{"event": "phase_change", "step": 25}])
    lines = (tmp_path / "n" / "fingerprints.jsonl").read_text().splitlines()
    import numpy as np

    d = json.loads(lines[25])
    d["loss_bits"] = int(np.float32("nan").view(np.uint32))
    lines[25] = json.dumps(proto.seal(d))  # a NaN loss as the run logged it
    (tmp_path / "n" / "fingerprints.jsonl").write_text("\n".join(lines) + "\n")
    rep = scan_mod.scan_run(load_run(root))
    assert not rep.explained and any(s.subject == "run" and s.first_step == 25 for s in rep.suspects)


# ----------------------------------------------------------------------------- a real rollback


@pytest.fixture(scope="module")
def rolled_back(replay_made, tmp_path_factory):
    """Run U trained 0..12 uninterrupted; run R trained to 10, rolled back to checkpoint 4
    (``rewind_to``) and trained to 12: attempt 1's steps 4..9 superseded. Same config and trainer
    as the shared run (its compiled step)."""
    import jax

    from replay.reference import loop
    from replay.reference.trainer import make_mesh
    from test_replay_support import run_config, write_run_inputs

    _, trainer = replay_made
    root = str(tmp_path_factory.mktemp("lineage_run"))
    cfg = run_config(root, write_run_inputs(root))
    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    quiet = {"trainer": trainer, "mesh": mesh, "output": loop.Output(log=lambda s: None, plot=False)}
    u, r = os.path.join(root, "u"), os.path.join(root, "r")
    loop.train(u, cfg, 12, **quiet)
    loop.train(r, cfg, 10, **quiet)
    out = loop.train(r, cfg, 12, **quiet, launch=loop.Launch(rewind_to=4, rewind_reason="loss spike at 9"))
    return root, u, r, cfg, out


def _lines(path, name=proto.FINGERPRINTS_NAME):
    return (open(os.path.join(path, name)).read().splitlines())


def test_a_rollback_keeps_the_superseded_steps_and_the_lineage_equals_an_uninterrupted_run(rolled_back):
    root, u, r, cfg, out = rolled_back
    assert out["attempt"] == 2 and out["start"] == 4
    assert _lines(r) == _lines(u)  # the lineage's log is the uninterrupted run's, byte for byte
    sup = lin.read_superseded(r, proto.FINGERPRINTS_NAME)
    assert [(d["step"], d["attempt"], d["superseded_by"]) for d in sup] == [(s, 1, 2) for s in range(4, 10)]
    # the superseded steps trained the same data from the same state: the same bits as the lineage's
    assert [json.loads(x)["loss_bits"] for x in _lines(u)[4:10]] == [d["loss_bits"] for d in sup]
    assert sorted(os.listdir(os.path.join(r, "superseded", "attempt-2", "checkpoints"))) == ["10", "8"]
    run = load_run(r)
    assert sorted(run.fingerprints) == list(range(12)) and run.checkpoints == [0, 4, 8, 12]
    a1, a2 = run.lineage.attempts
    assert (a1.lineage, a1.superseded, a2.kind, a2.lineage) == ((0, 4), (4, 10), "rollback", (4, 12))
    events = run.all_events
    rewind = next(e for e in events if e["event"] == "rewind")
    assert (rewind["checkpoint"], rewind["reason"], rewind["previous_end"]) == (4, "loss spike at 9", 10)
    restore = next(e for e in events if e["event"] == "restore")
    assert restore["superseded"]["steps"] == [4, 10] and restore["superseded"]["checkpoints"] == [8, 10]
    assert restore["loader_state"]["next_step"] == 4 and restore["attempt"] == 2
    assert ("end", 10) not in kinds(run.events) and ("end", 10) in kinds(run.lineage.superseded_events)


def test_rollback_refuses_a_checkpoint_the_lineage_does_not_have(rolled_back, replay_made):
    import jax

    from replay.reference import run as ref_run
    from replay.reference import loop
    from replay.reference.trainer import make_mesh

    root, u, r, cfg, _ = rolled_back
    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    with pytest.raises(ref_run.RunConfigError, match=r"--from-checkpoint 6: checkpoint 6: not a checkpoint"):
        loop.train(r, cfg, 12, trainer=replay_made[1], mesh=mesh, launch=loop.Launch(rewind_to=6),
                   output=loop.Output(plot=False))


# ----------------------------------------------------------------------------- what the run trained with


def _inspect(run, tmp_path, name):
    out = tmp_path / f"{name}.json"
    code = main(["inspect", "--run", run, "--steps", "6:8", "--json", str(out)])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def _set_config(run, **changes):
    """Edits the run directory's run_config.yaml (as a user would: by hand)."""
    path = os.path.join(run, "run_config.yaml")
    conf = yaml.safe_load(open(path))
    conf.update(changes)
    yaml.safe_dump(conf, open(path, "w"))


def _inspect_error(run, tmp_path, name, capsys):
    capsys.readouterr()
    code, _ = _inspect(run, tmp_path, name)
    return code, capsys.readouterr().err


def test_an_edited_mixture_is_not_used_the_runs_copy_is(rolled_back, tmp_path, capsys, monkeypatch):
    root, u, r, cfg, _ = rolled_back
    run = str(tmp_path / "run")
    shutil.copytree(u, run)
    code, before = _inspect(run, tmp_path, "before")
    assert code == 0
    with monkeypatch.context() as m:  # a relative --run: the copy's path must not be joined to it twice
        m.chdir(tmp_path)
        assert main(["inspect", "--run", "run", "--steps", "6"]) == 0
    mix = yaml.safe_load(open(cfg.mixture))
    edited = str(tmp_path / "mixture.yaml")
    mix["phases"][1]["weights"] = {"a": 0.9, "b": 0.1}  # the phase from step 6: other rows
    with open(edited, "w") as f:
        yaml.safe_dump(mix, f)
    inputs = json.load(open(os.path.join(run, "inputs.json")))
    inputs["mixture"]["path"] = edited  # as if the file the run named were edited
    _set_config(run, mixture=edited)
    json.dump(inputs, open(os.path.join(run, "inputs.json"), "w"))
    capsys.readouterr()
    code, after = _inspect(run, tmp_path, "after")
    err = capsys.readouterr().err
    assert code == 0 and after["rows"] == before["rows"]
    assert "changed since the run trained with it" in err and "using the run's copy" in err


def test_an_old_run_directory_with_an_edited_mixture_or_another_dataset_is_refused(rolled_back, tmp_path, capsys):
    root, u, r, cfg, _ = rolled_back
    run = str(tmp_path / "old")
    shutil.copytree(u, run)
    for name in ("inputs.json", "mixture.yaml"):  # a run directory from before the copy was kept
        os.remove(os.path.join(run, name))
    assert _inspect(run, tmp_path, "old")[0] == 0  # unchanged inputs: checked against checkpoint 0
    mix = yaml.safe_load(open(cfg.mixture))
    mix["phases"][1]["weights"] = {"a": 0.9, "b": 0.1}
    edited = str(tmp_path / "mixture.yaml")
    yaml.safe_dump(mix, open(edited, "w"))
    _set_config(run, mixture=edited)
    code, err = _inspect_error(run, tmp_path, "old_edited", capsys)
    assert code == ExitCode.RUN_ERROR and "the mixture schedule differs" in err and "phases" in err
    # a new run directory whose dataset was replaced: refused, whatever the mixture
    run2 = str(tmp_path / "new")
    shutil.copytree(u, run2)
    data2 = str(tmp_path / "dataset2")
    shutil.copytree(cfg.dataset, data2)
    man = json.load(open(os.path.join(data2, "manifest.json")))
    man["name"] = "another"
    json.dump(man, open(os.path.join(data2, "manifest.json"), "w"))
    _set_config(run2, dataset=data2)
    code, err = _inspect_error(run2, tmp_path, "new_dataset", capsys)
    assert code == ExitCode.RUN_ERROR and "is not the one the run trained with" in err


def test_resuming_with_an_edited_mixture_is_refused_and_the_runs_own_config_resumes(rolled_back, replay_made,
                                                                                    tmp_path, capsys):
    import jax

    from replay.reference import run as ref_run
    from replay.reference import loop
    from replay.reference.trainer import make_mesh

    root, u, r, cfg, _ = rolled_back
    run = str(tmp_path / "run")
    shutil.copytree(u, run)
    mix = yaml.safe_load(open(cfg.mixture))
    mix["phases"][1]["weights"] = {"a": 0.9, "b": 0.1}
    edited = str(tmp_path / "m.yaml")
    yaml.safe_dump(mix, open(edited, "w"))
    _set_config(run, mixture=edited)  # as if the file the run named were edited in place
    import dataclasses

    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    with pytest.raises(ref_run.RunConfigError, match="is not the one run .* trained with"):
        loop.train(run, dataclasses.replace(cfg, mixture=edited), 13, trainer=replay_made[1], mesh=mesh,
                   output=loop.Output(plot=False))
    own = ref_run.run_config_from_dict({**yaml.safe_load(open(os.path.join(run, "run_config.yaml"))),
                                        "mixture": os.path.join(run, "mixture.yaml")}, run)
    loop.train(run, own, 13, trainer=replay_made[1], mesh=mesh, output=loop.Output(plot=False, log=lambda s: None))
    assert sorted(load_run(run).fingerprints) == list(range(13))
    assert yaml.safe_load(open(os.path.join(run, "run_config.yaml")))["mixture"] == edited  # not the copy's path


def test_superseded_lines_stay_sealed_and_a_damaged_one_stays_damaged(tmp_path):
    """RunDir.supersede tags each moved line with its attempts: an intact sealed line is sealed again with the
    tags (its checksum still holds), a line damaged before the move keeps its failing checksum, and an unsealed
    line stays unsealed."""
    from replay.run.writer import RunDir

    rd = RunDir(str(tmp_path))
    lines = [proto.seal({"step": 0, "loss": 1.0}), proto.seal({"step": 1, "loss": 2.0}),
             {**proto.seal({"step": 2, "loss": 3.0}), "loss": 3.5}, {"step": 3, "loss": 4.0}]
    with open(rd.file(proto.SIGNALS_NAME), "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in lines)
    assert rd.supersede(1, lambda s: 1, 2, names=(proto.SIGNALS_NAME,)) == {proto.SIGNALS_NAME: 3}
    moved = [json.loads(x) for x in open(os.path.join(rd.file(proto.SUPERSEDED_DIR), proto.SIGNALS_NAME))]
    assert [(d["step"], d["attempt"], d["superseded_by"]) for d in moved] == [(1, 1, 2), (2, 1, 2), (3, 1, 2)]
    assert proto.line_damage(moved[0]) is None and proto.LINE_CHECK in moved[0]
    assert proto.line_damage(moved[1]) is not None  # damaged before the move: still visible
    assert proto.LINE_CHECK not in moved[2]
    assert [json.loads(x)["step"] for x in open(rd.file(proto.SIGNALS_NAME))] == [0]
