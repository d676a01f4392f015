"""`replay triage`, `replay skip` and `replay scan --follow`: each check on hand-made logs, the exact
restore check, the conclusion's exit codes, the triage drills on real short runs, the skip and the
resume after it."""

import json
import math
import os
import shutil
import sys

import numpy as np
import pytest

from replay import triage_drill
from replay.cli import main
from replay.run import protocol as proto
from replay.run.codes import ExitCode
from replay.run.runlog import load_run
from replay.screen import scan as scan_mod
from replay.screen import triage as tr
from test_replay_scan import make_run


def _patch_lines(path, fn):
    """Rewrites a JSON-lines file, each line's dict through ``fn(dict) -> dict``, sealed again when it was
    (the line its writer would have written: ``protocol.seal``)."""
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    with open(path, "w") as f:
        f.writelines(json.dumps(_resealed(fn(d))) + "\n" for d in lines)


def _resealed(d):
    return proto.seal(d) if proto.LINE_CHECK in d else d


def _hash(d):
    return f"{d:016x}"


def _with_hashes(root, shift_from=None, shift=0):
    """Batch hash of step s: that of its data step (s, or s + shift from ``shift_from`` on)."""
    def fix(d):
        s = d["step"]
        d["batch_hash"] = _hash(s + shift if shift_from is not None and s >= shift_from else s)
        return d

    _patch_lines(os.path.join(root, "fingerprints.jsonl"), fix)
    return root


def triage(root, step, **kw):
    return tr.triage_run(load_run(root), step, **kw)


# ----------------------------------------------------------------------------- 1. events and the restore check


def test_the_exact_restore_check_from_the_logged_loader_state(tmp_path):
    """A restore at 30 whose loader resumed at 27: data of steps 27..29 trained twice, 3 steps."""
    ev = [{"event": "checkpoint", "step": 30},
          {"event": "restore", "step": 30, "checkpoint": 30, "previous_end": 34,
           "loader_state": {"next_step": 27, "data_step": 27}}]
    root = _with_hashes(make_run(str(tmp_path / "r"), steps=40, events=ev), shift_from=30, shift=-3)
    rep = triage(root, 32)
    ev_check = rep.checks["events"]
    (res,) = ev_check.evidence["restores"]
    assert (res["verdict"], res["offset"], res["loader_next_step"]) == ("repeated", -3, 27)
    # without the dataset, the shifted hashes are found among the lineage's own earlier steps
    assert [h.get("found_at_offset") for h in res["hashes"] if h["expected"] is not None] in ([], [-3, -3, -3])
    assert ev_check.status == "suspect" and "repeated 3 step(s) of data" in res["detail"]
    assert rep.conclusion.cause == "restart" and rep.exit_code == ExitCode.TRIAGE_RESTART == 11
    assert rep.conclusion.command.startswith("python -m replay.reference.train --run ") and \
        "--from-checkpoint 30" in rep.conclusion.command


def test_the_exact_restore_check_from_batch_hashes_alone_a_skip(tmp_path):
    """No loader state logged (a user's trainer): the hashes after the restore at 20 are those the
    superseded attempt logged at 22.. (skipped 2 steps); a clean restore at 10 is exact."""
    ev = [{"event": "restore", "step": 10, "checkpoint": 10, "previous_end": 10},
          {"event": "restore", "step": 20, "checkpoint": 20, "previous_end": 26}]
    root = _with_hashes(make_run(str(tmp_path / "s"), steps=40, events=ev), shift_from=20, shift=2)
    os.makedirs(os.path.join(root, "superseded"))
    with open(os.path.join(root, "superseded", "fingerprints.jsonl"), "w") as f:  # attempt 2's steps 20..25
        for s in range(20, 26):
            f.write(json.dumps({"step": s, "batch_hash": _hash(s), "attempt": 2, "superseded_by": 3}) + "\n")
    rep = triage(root, 24)
    r10, r20 = rep.checks["events"].evidence["restores"]
    assert r10["verdict"] == "not checkable" or r10["verdict"] == "exact"
    assert (r20["verdict"], r20["offset"]) == ("skipped", 2)
    assert r20["hashes"][0]["source"] == "the superseded attempt's log"
    assert rep.conclusion.cause == "restart" and rep.conclusion.subject["restores"][0]["step"] == 20


def test_events_list_the_lineage_and_never_explain_a_non_finite_loss(tmp_path):
    from test_replay_lineage import ROLLBACK

    root = make_run(str(tmp_path / "e"), steps=40, events=ROLLBACK[1:] + [{"event": "phase_change", "step": 30,
                                                                            "attempt": 3}],
                    loss_spike=30)
    rep = triage(root, 30)
    listed = [(e["event"], e["step"]) for e in rep.checks["events"].evidence["events"]]
    assert ("restore", 10) not in listed and ("restore", 5) in listed and ("phase_change", 30) in listed
    assert rep.checks["events"].evidence["may_explain"] == ["phase_change at step 30"]
    assert any("attempt 2" in x for x in rep.lineage)  # the report lists the superseded attempts
    # the same spike, non-finite: the phase change cannot explain it
    _patch_lines(os.path.join(root, "fingerprints.jsonl"), lambda d: {
        **d, "loss_bits": int(np.float32("nan").view(np.uint32)) if d["step"] == 30 else d["loss_bits"]})
    rep = triage(root, 30)
    assert rep.checks["events"].evidence["may_explain"] == []
    assert any("cannot explain a non-finite loss" in x for x in rep.checks["events"].lines)
    assert "non-finite" in rep.conclusion.explanation and rep.to_dict()["loss_finite"] is False


# ----------------------------------------------------------------------------- 2-4 on hand-made logs


def test_replicas_data_router_on_hand_made_logs(tmp_path):
    drift = triage(make_run(str(tmp_path / "d"), steps=80, drift=(2, 50, 1.6)), 79)
    assert drift.checks["replicas"].status == "suspect" and drift.checks["replicas"].subject["devices"] == [2]
    assert drift.conclusion.cause == "hardware" and drift.exit_code == ExitCode.TRIAGE_HARDWARE == 10
    assert drift.conclusion.command.startswith("replay --run ") and "--devices good" in drift.conclusion.command
    # the data check needs the dataset: hand-made logs have none, and say so (never "clear")
    assert drift.checks["data"].status == "not available" and "cannot be rebuilt" in drift.checks["data"].summary
    bare = triage(make_run(str(tmp_path / "n"), steps=40, signals=False), 39)
    assert bare.checks["replicas"].status == "not available" and bare.checks["router"].status == "not available"
    assert bare.conclusion.cause == "optimization" and bare.conclusion.confidence == "low"
    assert "not available: replicas, data, router" in bare.conclusion.explanation
    # router: layer 1's max logit grows 4x and its z-loss 8x from step 60
    root = make_run(str(tmp_path / "r"), steps=70)

    def unstable(d):
        if d["step"] >= 60:
            d["router"][1].update(max_logit=8.0, z_loss=24.0, entropy=0.2)
        return d

    _patch_lines(os.path.join(root, "signals.jsonl"), unstable)
    rep = triage(root, 62)
    assert rep.checks["router"].status == "suspect" and rep.checks["router"].subject["layers"] == [1]
    assert rep.conclusion.cause == "router" and rep.exit_code == ExitCode.TRIAGE_ROUTER == 13
    assert "layer 1" in rep.conclusion.advice and rep.conclusion.command.startswith("replay scan --run ")


def test_conclude_order_and_exit_codes():
    def check(name, status, subject=None, **ev):
        return tr.Check(name, status, f"{name} {status}", evidence=ev, subject=subject or {}, command=f"cmd-{name}")

    clear = {n: check(n, "clear") for n in tr.CHECKS}
    kw = {"run_dir": "RUN", "step": 50, "onset": 48, "loss_finite": True,
          "plan": {"checkpoint": 40, "start": 48, "stop": 54}}
    opt = tr.conclude({**clear, "events": check("events", "clear", may_explain=[])}, **kw)
    assert (opt.cause, opt.exit_code) == ("optimization", 0)
    assert opt.command == ("replay skip --run RUN --steps 48:54 --checkpoint 40 --reason 'loss spike at step 50: "
                           "replay triage found no fault (optimization event)'")
    data = tr.conclude({**clear, "data": check("data", "suspect", {"shards": ["a/x"]}, altered_shards=[])}, **kw)
    assert (data.cause, data.exit_code, data.confidence) == ("data", 12, "medium")
    # one-step norm spikes at steps whose rows are bad are the data's doing, not a device's
    spikes = check("replicas", "suspect", {"devices": [3], "evidence": ["norm_spike"], "first_step": 48})
    both = tr.conclude({**clear, "replicas": spikes, "data": check("data", "suspect", {"shards": ["a/x"]},
                                                                   altered_shards=[])}, **kw)
    assert both.cause == "data" and any(a.startswith("replicas:") for a in both.also)
    drift = check("replicas", "suspect", {"devices": [3], "evidence": ["norm_drift"], "first_step": 44})
    hw = tr.conclude({**clear, "replicas": drift, "router": check("router", "suspect", {"layers": [0]})}, **kw)
    assert (hw.cause, hw.exit_code, hw.subject["devices"]) == ("hardware", 10, [3])
    restart = check("events", "suspect", {"restores": [{"step": 44, "checkpoint": 44, "offset": -2,
                                                        "verdict": "repeated"}]})
    r = tr.conclude({**clear, "events": restart, "replicas": drift}, **kw)
    assert (r.cause, r.exit_code, r.confidence) == ("restart", 11, "high")
    assert {int(c) for c in (opt.exit_code, data.exit_code, hw.exit_code, r.exit_code, 13)} == {0, 10, 11, 12, 13}


def test_cli_triage_json_and_dashboard(tmp_path, capsys):
    root = make_run(str(tmp_path / "c"), steps=80, drift=(1, 50, 1.6))
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    code = main(["triage", "--run", root, "--step", "75", "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == ExitCode.TRIAGE_HARDWARE
    for n, name in enumerate(tr.CHECKS, 1):
        assert f"{n}. {name}:" in text
    assert "HARDWARE" in text and "next: replay --run" in text
    rep = json.loads(out.read_text())
    assert rep["cause"] == "hardware" and rep["exit_code"] == 10 and set(rep["checks"]) == {*tr.CHECKS, "input"}
    assert rep["checks"]["replicas"]["subject"]["devices"] == [1]
    assert png.stat().st_size > 10_000
    assert main(["triage", "--run", root, "--step", "500"]) == ExitCode.RUN_ERROR
    assert main(["triage", "--run", root]) == ExitCode.USAGE


# ----------------------------------------------------------------------------- scan: next steps and --follow


def test_router_and_loss_suspects_come_with_their_next_step(tmp_path):
    rep = scan_mod.scan_run(load_run(make_run(str(tmp_path / "x"), steps=60, router_bad=[(40, 1)], loss_spike=50)))
    kinds = {s.kind: s.next for s in rep.suspects}
    assert kinds["layer"]["command"].startswith("replay triage --run ") and "--step 40" in kinds["layer"]["command"]
    assert "router" in kinds["layer"]["sentence"]
    assert kinds["run"]["command"].endswith("--step 50") and kinds["run"]["sentence"]
    assert all(s["next"] for s in rep.to_dict()["suspects"])


def test_follow_reports_new_suspects_and_runs_on_suspect_once(tmp_path, capsys):
    """A run that grows while it is watched: its drift appears at some look, and the --on-suspect
    command gets it on stdin, once."""
    full = make_run(str(tmp_path / "full"), steps=90, drift=(3, 40, 1.6))
    live = str(tmp_path / "live")
    os.makedirs(live)
    for name in ("run_config.yaml", "env.json", "events.jsonl"):
        shutil.copy(os.path.join(full, name), live)
    lines = {n: open(os.path.join(full, n)).read().splitlines(True) for n in ("fingerprints.jsonl", "signals.jsonl")}
    grown = [0]

    def grow(_):  # the training run writes 15 more steps between looks, then its end
        grown[0] += 15
        for n, ls in lines.items():
            with open(os.path.join(live, n), "w") as f:
                f.writelines(ls[:grown[0]])
        if grown[0] >= 90:
            proto.append_line(os.path.join(live, "events.jsonl"), json.dumps({"event": "end", "step": 90}))

    new, first = [], []
    res = scan_mod.follow(live, on_new=lambda s, r: new.append(s), on_first=lambda s, r: first.append(s),
                          interval=0, sleep=grow, timeout=None)
    assert res["ended"] and res["steps"] == 90 and len(first) == 1
    assert first[0]["devices"] == [3] and first[0]["next"]["command"].startswith("replay --run ")
    assert [s["subject"] for s in new].count("device 3") == 1
    # the command: its stdin is the suspect's JSON
    got = tmp_path / "paged.json"
    code = main(["scan", "--run", full, "--follow", "--timeout", "5", "--interval", "0.1",
                 "--on-suspect", f"{sys.executable} -c \"import sys; open({str(got)!r}, 'w').write(sys.stdin.read())\""])
    assert code == ExitCode.SUSPECTS
    payload = json.loads(got.read_text())
    assert payload["suspect"]["devices"] == [3] and payload["next"]["command"].startswith("replay --run ")
    assert main(["scan", "--run", full, "--on-suspect", "true"]) == ExitCode.USAGE


# ----------------------------------------------------------------------------- drills


def test_drill_options_are_checked():
    assert main(["drill", "--magnitude", "nan"]) == ExitCode.USAGE
    assert main(["drill", "--magnitude", "0", "--scenario", "drift"]) == ExitCode.USAGE
    assert main(["drill", "--scenario", "nonfinite", "--value", "zero"]) == ExitCode.USAGE  # nan or inf


@pytest.fixture
def drills(triage_drills):
    return triage_drills


@pytest.mark.parametrize("scenario", ["sdc", "restart", "data", "duplicate", "router", "router_scale", "nonfinite",
                                      "clean"])
def test_each_triage_drill_names_its_planted_cause(drills, scenario):
    r = drills.run(scenario, 11)
    assert r.correct, (r.planted, r.found, {k: (v["status"], v["summary"]) for k, v in r.triage["checks"].items()})
    assert r.planted["magnitude"] == triage_drill.GRIDS[scenario][0]  # the largest of the scenario's grid
    if scenario == "sdc":  # the range replay convicted the device
        assert r.triage["checks"]["replicas"]["subject"].get("convicted") and r.found["confidence"] == "high"
    if scenario == "clean":
        assert all(c["status"] != "suspect" for c in r.triage["checks"].values())
    if scenario == "restart":  # the restore event says the loader resumed exactly: the batches tell the shift
        (ev,) = [e for e in load_run(r.run_dir).events if e["event"] == "restore"]
        assert ev["loader_state"]["next_step"] == ev["step"] == r.planted["restore"]
    if scenario == "duplicate":  # 3 copies of b's shard 0 (one sha256), found by the rows after b's weight rose
        assert r.triage["exit_code"] == ExitCode.TRIAGE_DATA == 12 and r.found["confidence"] == "high"
        data = r.triage["checks"]["data"]
        assert data["evidence"]["duplicates"]["suspect"] and data["evidence"]["shard_copies"]
        assert data["subject"]["duplicated"] and data["subject"]["documents"]
        assert "duplicated rows" in r.triage["conclusion"]["explanation"]
    if scenario == "router_scale":  # weights x20 at k, triaged at k + 4: the departure is dated from k
        router = r.triage["checks"]["router"]
        assert router["subject"]["first_step"] == r.planted["step"] == r.expected["first_step"]
    if scenario == "nonfinite":
        assert r.triage["checks"]["replicas"]["subject"]["first_step"] == r.planted["step"]


def test_triage_drills_on_the_grid_count_detections_per_magnitude(drills, monkeypatch):
    monkeypatch.setitem(triage_drill.GRIDS, "restart", (1,))  # the floor alone: a loader one step off
    res = triage_drill.run_drills(["restart"], [12], drills.root, grid=True, drills=drills)
    assert res["scenarios"]["restart"]["by_magnitude"] == {"1": {"correct": 1, "total": 1}}
    assert abs(res["scenarios"]["restart"]["runs"][0]["planted"]["loader_shift"]) == 1


def test_the_router_check_looks_back_names_a_dead_expert_and_never_passes_non_finite_figures(tmp_path):
    root = make_run(str(tmp_path / "r"), steps=40)
    path = os.path.join(root, "signals.jsonl")

    def dead_from(step, expert=1):
        def fix(d):
            if d["step"] >= step:
                share = [0.3, 0.3, 0.4, 0.0]
                d["router"][1]["expert_share"] = share[:expert] + [0.0] + share[expert:3]
            return d
        return fix

    _patch_lines(path, dead_from(30))
    dead = triage(root, 33).checks["router"]
    assert dead.status == "suspect" and dead.subject["layers"] == [1] and dead.subject["first_step"] == 30
    assert any("expert 1 is dead" in w for w in dead.lines)
    # the same departure triaged 8 steps after it began: judged 30..33 is in the baseline of 36..39 now
    later = triage(root, 39).checks["router"]
    assert later.status == "suspect" and later.subject["first_step"] == 30 and later.evidence["layer 1"]["looked_back"]
    # NaN entropy and an infinite max logit at a judged step: not judged, never "within bounds"
    nan = make_run(str(tmp_path / "n"), steps=40)
    _patch_lines(os.path.join(nan, "signals.jsonl"), lambda d: {**d, "router": [
        {**r, "entropy": float("nan"), "max_logit": float("-inf")} if d["step"] == 38 else r for r in d["router"]]})
    check = triage(nan, 39).checks["router"]
    assert check.status == "not available" and "not finite at step(s) [38]" in check.summary
    assert "never within bounds" in check.summary


def test_duplicates_count_repeated_rows_by_pair_rate_and_never_the_pieces_of_a_split_document():
    from types import SimpleNamespace

    def row(tokens, keys, chunks):
        return SimpleNamespace(tokens=np.asarray(tokens), segment_lengths=np.asarray([len(tokens)]),
                               doc_keys=tuple(keys), chunk_indices=np.asarray(chunks))

    ref = SimpleNamespace(shard="s/0", record_in_shard=0)
    # a document split across three rows: chunks 0, 1, 2 of one key, different tokens: no duplicate
    base = [(s, 0, ref, row([s, s + 1, s + 2], ["d/long"], [s - 1])) for s in (1, 2, 3)]
    base += [(10 + i, 0, ref, row([100 + i], [f"d/{i}"], [0])) for i in range(30)]
    onset = [(50, i, ref, row([7, 7, 7], ["d/copy"], [0])) for i in range(3)] + [(51, 0, ref, row([9], ["d/x"], [0]))]
    out = tr.duplicates(onset, base, 1e-3)
    assert out["documents"] == [{"document": "d/copy", "chunk": 0, "rows": [[50, 0], [50, 1], [50, 2]]}]
    assert (out["onset"]["pairs"], out["baseline"]["pairs"], out["suspect"]) == (3, 0, True)
    assert out["p"] == pytest.approx(tr.poisson_tail(3, 0.5 / (33 * 32 / 2) * 6))
    assert [r["same_as"] for r in out["rows"]] == [[50, 0], [50, 0]]
    calm = tr.duplicates(onset[:2] + onset[3:], base, 1e-3)  # one pair is not a finding
    assert calm["onset"]["pairs"] == 1 and not calm["suspect"]


def test_restores_are_labelled_as_what_happened_and_a_hand_edited_loader_state_says_what_to_do(drills, tmp_path):
    from replay.reference.run import RunConfigError

    run = str(tmp_path / "run")
    cfg = drills.config(4)
    drills.train(run, cfg, 21)  # checkpoints 0, 10, 20, 21
    for lost in ("20", "21"):  # the newest checkpoints lost: the next start resumes from 10, a resume
        shutil.rmtree(os.path.join(run, "checkpoints", lost))
    drills.train(run, cfg, 22)
    (ev,) = [e for e in load_run(run).events if e["event"] == "restore"]
    assert (ev["reason"], ev["checkpoint"], ev["checkpoints_missing"]) == ("resume", 10, [20, 21])
    assert [a.kind for a in load_run(run).lineage.attempts] == ["start", "resume"]
    meta = os.path.join(run, "checkpoints", "22", "loader", "metadata")
    state = json.load(open(meta))
    json.dump({**state, "next_step": 25}, open(meta, "w"))  # edited by hand
    from replay.run.statefp import DamagedCheckpointError
    from test_replay_support import as_saved_before_records

    with pytest.raises(DamagedCheckpointError, match="checkpoint 22 is damaged: its loader state"):
        drills.train(run, cfg, 24)  # its state record (issue 28) sees the edit first
    as_saved_before_records(run, [22])  # as a run saved before state records
    with pytest.raises(RunConfigError) as e:
        drills.train(run, cfg, 24)
    msg = str(e.value)
    assert msg.startswith("checkpoint 22 holds loader state for step 25, not 22") and "skip data" in msg
    assert "next: put back the loader state" in msg and "--from-checkpoint 20 (committed: [0, 10, 20])" in msg


def test_an_edited_run_copy_is_never_called_the_config_it_trained_with(drills, tmp_path):
    from replay.run import inputs

    run = str(tmp_path / "run")
    drills.train(run, drills.config(6), 2)
    rec = json.load(open(os.path.join(run, "inputs.json")))
    rec["mixture"]["path"] = str(tmp_path / "gone.yaml")  # the original is missing now
    json.dump(rec, open(os.path.join(run, "inputs.json"), "w"))
    assert inputs.resolve(run, {}).notes[0].endswith("the config it trained with")
    copy = os.path.join(run, "mixture.yaml")
    open(copy, "w").write(open(copy).read().replace("weight: 0.7", "weight: 0.6"))
    (note,) = inputs.resolve(run, {}).notes
    assert "the config it trained with" not in note and "itself edited since" in note


def test_drill_all_command_table_and_json(drills, tmp_path, capsys, monkeypatch):
    from replay import triage_drill

    monkeypatch.setattr(triage_drill, "Drills", lambda root: drills)  # the compiled trainers of the fixture
    out = tmp_path / "d.json"
    code = main(["drill", "--scenario", "all", "--count", "1", "--seed", "3", "--json", str(out),
                 "--to-disk", str(tmp_path / "dr")])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert code == 0, text
    assert set(res["scenarios"]) == set(triage_drill.SCENARIOS) and res["correct"] == res["total"] == 8
    for sc in res["scenarios"].values():
        assert set(sc) >= {"expected", "found", "correct", "total"} and sc["correct"] == 1
    assert "triage drills: 8 of 8 correct" in text


# ----------------------------------------------------------------------------- skip


def test_skip_validates_records_and_the_next_training_run_follows(drills, tmp_path, capsys):
    from replay.reference.train import main as train_main

    run = str(tmp_path / "run")
    drills.train(run, drills.config(5), 40)
    before = load_run(run)
    data_of_33 = before.fingerprints[33].batch_hash
    # validation: each refusal names the value and what fits (exit 2), and writes nothing
    events = open(os.path.join(run, "events.jsonl")).read()
    for argv, msg in ((["--steps", "45:50"], "not a step of the run's lineage 0:40"),
                      (["--steps", "30:34", "--checkpoint", "35"], "must be a checkpoint of the run at or before"),
                      (["--steps", "30:30"], "empty range")):
        capsys.readouterr()
        assert main(["skip", "--run", run, "--reason", "x", *argv]) == ExitCode.USAGE
        assert msg in capsys.readouterr().err
    assert open(os.path.join(run, "events.jsonl")).read() == events
    # record: skip the data of 30..32, rewind to 30 (the newest checkpoint at or before 30)
    assert main(["skip", "--run", run, "--steps", "30:33", "--reason", "loss spike at 31"]) == 0
    assert "next: python -m replay.reference.train --run" in capsys.readouterr().out
    pending = load_run(run)
    assert pending.lineage.pending_rewind["checkpoint"] == 30 and sorted(pending.fingerprints) == list(range(30))
    assert pending.config["skip_windows"] == [[30, 32]] and pending.config_file.get("skip_windows") == []
    assert main(["skip", "--run", run, "--steps", "35:36", "--reason", "again"]) == ExitCode.USAGE  # one at a time
    # inspect follows the window at once: step 30 now reads the rows of data step 33
    capsys.readouterr()
    assert main(["inspect", "--run", run, "--steps", "30", "--json", str(tmp_path / "i30.json")]) == 0
    rows30 = json.loads((tmp_path / "i30.json").read_text())["rows"]
    assert [r["global_row"] for r in rows30] == [33 * 8 + i for i in range(8)]
    # the resume: python -m replay.reference.train --run DIR, nothing else (in process, the fixture's trainer)
    import replay.reference.run as ref_run

    real = ref_run.make_trainer
    ref_run.make_trainer = lambda cfg, **kw: (drills.trainer, drills.mesh, 128)
    try:
        assert train_main(["--run", run]) == 0
    finally:
        ref_run.make_trainer = real
    after = load_run(run)
    a1, a2 = after.lineage.attempts
    assert (a2.kind, a2.start, a1.superseded, after.lineage.pending_rewind) == ("rewind", 30, (30, 40), None)
    assert sorted(after.fingerprints) == list(range(40))
    assert after.fingerprints[30].batch_hash == data_of_33  # step 30 trained on the data of step 33
    assert after.config_file["skip_windows"] == [[30, 32]]
    sup = [d["step"] for d in __import__("replay.run.lineage", fromlist=["x"]).read_superseded(run, "fingerprints.jsonl")]
    assert sup == list(range(30, 40))  # history kept, never rewritten
    assert any(e["event"] == "skipped_window" and e["step"] == 30 for e in after.events)
    assert math.isfinite(tr._loss_of(after, 39))


def test_a_shard_altered_after_packing_is_named(tmp_path):
    """The data check hashes a suspect shard's file against the manifest's sha256."""
    import hashlib
    from types import SimpleNamespace

    good, bad = tmp_path / "a" / "s0", tmp_path / "a" / "s1"
    good.parent.mkdir()
    good.write_bytes(b"rows")
    bad.write_bytes(b"rows, then a bad copy")
    sha = hashlib.sha256(b"rows").hexdigest()
    shards = [SimpleNamespace(path="a/s0", sha256=sha), SimpleNamespace(path="a/s1", sha256=sha)]
    data = SimpleNamespace(dataset=str(tmp_path), manifest=SimpleNamespace(sources={"a": SimpleNamespace(shards=shards)}))
    assert tr._altered_shards(data, ["a/s0", "a/s1", "a/missing"]) == ["a/s1"]


def test_triage_says_when_there_is_no_spike_and_which_router_fix_helps(tmp_path, capsys):
    # a step without a loss spike: triage still runs every check, and says the loss check found none
    root = make_run(str(tmp_path / "q"), steps=40)
    calm = triage(root, 39)
    assert calm.spike_found is False and calm.to_dict()["spike_found"] is False
    assert main(["triage", "--run", root, "--step", "39"]) == 0
    assert "finds no loss spike at step 39" in capsys.readouterr().out
    # and advises no rewind: the next command lists the spikes
    assert calm.conclusion.cause == "optimization" and calm.conclusion.command == f"replay scan --run {root}"
    assert "no rewind" in calm.conclusion.advice and "rewind to checkpoint" not in calm.conclusion.advice
    spiky = triage(make_run(str(tmp_path / "s"), steps=40, loss_spike=35), 35)
    assert spiky.spike_found is True and spiky.onset == 35
    # router: judged steps inside the warm-up (10): a longer --window cannot help, and it says so
    early = triage(root, 8).checks["router"]
    assert early.status == "not available" and "no longer --window helps" in early.summary
    # a window that cuts the baseline off: a longer one helps
    short = triage(root, 39, window=3).checks["router"]
    assert short.status == "not available" and short.summary.endswith("give a longer --window")
