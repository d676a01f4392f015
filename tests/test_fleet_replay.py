"""Targeted and concurrent range replay, its plan, the scan's onset, and the many-process bookkeeping
(the run directory's shards, device names, process settings), in one process."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replay_scan import make_run

from replay import cli, drill
from replay.runtime import devices as dv
from replay.run import env as envm, protocol as proto, runlog
from replay.runtime import distributed
from replay.run.codes import Verdict
from replay.run.protocol import FaultSpec
from replay.run.writer import RunDir
from replay.screen import scan as scan_mod
from replay.screen import screening as sc
from replay.verify import engine, plan

# ----------------------------------------------------------------------------- the plan (pure)


@given(first=st.integers(0, 50), length=st.integers(1, 60), every=st.integers(1, 12))
def test_segments_tile_the_replayed_steps(first, length, every):
    stop = first + length
    ckpts = list(range(0, stop + every, every))
    segs = plan.segments(first, stop, ckpts)
    assert segs[0].start == first and segs[-1].stop == stop
    assert all(a.stop == b.start for a, b in zip(segs, segs[1:]))
    assert all(s.start in ckpts or s.start == first for s in segs) and all(s.steps <= every for s in segs[1:])
    for step in range(first, stop):
        assert sum(s.start <= step < s.stop for s in segs) == 1  # in exactly one segment


@given(n=st.integers(1, 12), lo=st.integers(0, 130), width=st.integers(0, 30), exhaustive=st.booleans())
def test_rounds_put_the_onsets_segments_first_and_replay_each_once(n, lo, width, exhaustive):
    segs = plan.segments(0, 10 * n, list(range(0, 10 * n, 10)))
    onset = plan.Onset(lo, lo, lo + width, "--onset")
    rounds = plan.rounds(segs, onset, exhaustive)
    assert sorted(i for r in rounds for i in r) == list(range(n))
    hit = [i for i, s in enumerate(segs) if s.overlaps(onset.lo, onset.hi)]
    if exhaustive or not hit:
        assert rounds == [list(range(n))]
    else:
        assert rounds[0] == hit


def test_lanes_keep_shared_devices_and_shared_processes_apart():
    proc = {d: d // 4 for d in range(8)}
    assert plan.lanes([(0, 1, 2, 3), (4, 5, 6, 7)], proc) == [[0], [1]]  # disjoint, one process each: concurrent
    assert plan.lanes([(0, 1, 2, 3), (1, 2, 3, 0)], proc) == [[0, 1]]  # a rotation shares devices
    assert plan.lanes([(0, 1, 4, 5), (2, 3, 6, 7)], proc) == [[0, 1]]  # both span processes 0 and 1
    assert plan.lanes([(0, 1), (2, 3), (4, 5)], proc) == [[0], [1], [2]]


@settings(max_examples=50)
@given(st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True), min_size=1, max_size=5))
def test_placements_in_different_lanes_never_share_a_device(assignments):
    proc = {d: d // 4 for d in range(12)}
    lanes = plan.lanes(assignments, proc)
    assert sorted(i for lane in lanes for i in lane) == list(range(len(assignments)))
    for a in lanes:
        for b in lanes:
            if a is not b:
                assert not any(set(assignments[i]) & set(assignments[j]) for i in a for j in b)


def test_an_onset_outside_its_range_is_refused():
    with pytest.raises(ValueError, match="onset 5 outside its range"):
        plan.Onset(5, 6, 9, "x")
    with pytest.raises(ValueError, match="--onset: must be a step >= 0"):
        plan.Onset.at(-1)


# ----------------------------------------------------------------------------- targeted replay


@pytest.fixture(scope="module")
def session(replay_session):
    return replay_session


@pytest.fixture(scope="module")
def faulty_log(session):
    """The shared run's log with a bit flip on device 3 at step 6 (the segment 4:8 of checkpoints 0, 4, 8, 12)."""
    f = FaultSpec(step=6, device_id=3, leaf=session.setup.trainer.leaf_paths[1], element=5, bit=22)
    return f, drill.drilled_log(session, f)


def test_a_known_onset_replays_its_segment_first_and_stops_at_the_conviction(session, faulty_log):
    f, log = faulty_log
    rep = engine.replay_range(session, 0, 12, device_spec="all", log=log, onset=plan.Onset.at(6))
    assert rep.verdict is Verdict.CONVICTED and rep.decision.devices == (3,) and rep.decision.step == 6
    out = rep.to_dict()
    assert [(s["start"], s["stop"], s["replayed"]) for s in out["segments"]] == [
        (0, 4, False), (4, 8, True), (8, 12, False)]
    assert out["stopped_early"] and out["unreplayed_segments"] == [[0, 4], [8, 12]]
    # the segment from checkpoint 4 to the divergence at 6: 3 steps on each placement
    assert out["timing"]["steps_replayed_per_placement"] == {"0": 3, "1": 3}
    assert out["targeted"] == {"step": 6, "range": [6, 6], "uncertain": False, "source": "--onset", "devices": []}
    assert out["convicted"][0]["label"].startswith("device 3 (host ") and out["convicted"][0]["mesh"] == {
        "data": 1, "expert": 1}


def test_exhaustive_replays_every_segment_and_gives_the_same_verdict(session, faulty_log):
    _, log = faulty_log
    rep = engine.replay_range(session, 0, 12, device_spec="all", log=log, onset=plan.Onset.at(6), exhaustive=True)
    out = rep.to_dict()
    assert rep.verdict is Verdict.CONVICTED and rep.decision.devices == (3,) and rep.decision.step == 6
    assert not out["stopped_early"] and out["unreplayed_segments"] == []
    assert out["timing"]["steps_replayed_per_placement"] == {"0": 11, "1": 11}  # 4 + 3 (to the divergence) + 4


def test_an_acquittal_replays_every_step_once_per_placement(session):
    rep = engine.replay_range(session, 0, 12, device_spec="all", onset=plan.Onset.at(6))
    out = rep.to_dict()
    assert rep.verdict is Verdict.ACQUITTED and not out["stopped_early"]
    assert [s["round"] for s in out["segments"]] == [1, 0, 1]
    assert out["timing"]["steps_replayed_per_placement"] == {"0": 12, "1": 12}


def test_the_onset_of_suspects_json_targets_the_replay(session, faulty_log, tmp_path):
    _, log = faulty_log
    run_dir = str(tmp_path / "run")
    shutil.copytree(session.run.run_dir, run_dir)
    with open(os.path.join(run_dir, "suspects.json"), "w") as f:
        json.dump({"suspect_devices": [3], "onset": {"step": 9, "range": [5, 9], "uncertain": True,
                                                     "check": "norm_drift", "devices": [3]}}, f)
    other = engine.Session(runlog.load_run(run_dir), session.setup)
    rep = engine.replay_range(other, 0, 12, device_spec="0-2,4-7", log=log, replays=2)
    out = rep.to_dict()
    assert out["targeted"]["range"] == [5, 9] and out["targeted"]["source"].startswith("suspects.json: norm_drift")
    assert [s["replayed"] for s in out["segments"]] == [False, True, True]  # 4:8 and 8:12 hold steps 5..9
    assert rep.verdict is Verdict.CONVICTED and rep.decision.devices == (3,)


def test_concurrent_and_sequential_placements_give_the_same_replay(session):
    a = engine.replay_range(session, 2, 9, device_spec="all", onset=None)
    b = engine.replay_range(session, 2, 9, device_spec="all", onset=None, concurrent=False)
    assert [r.outcome().signature for r in a.replays] == [r.outcome().signature for r in b.replays]
    assert a.verdict is b.verdict is Verdict.ACQUITTED and a.concurrent and not b.concurrent
    assert [p["devices"] for p in a.placements] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_range_command_takes_onset_and_exhaustive(run_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["--run", run_dir, "--steps", "1:10", "--onset", "5", "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["targeted"]["step"] == 5 and [s["round"] for s in rep["segments"]] == [1, 0, 1]
    text = capsys.readouterr().out
    assert "onset: step 5, from --onset" in text and "segments replayed in round 1: 4:8" in text
    assert cli.main(["--run", run_dir, "--steps", "1:10", "--onset", "5", "--exhaustive", "--sequential",
                     "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["exhaustive"] and not rep["concurrent"] and {s["round"] for s in rep["segments"]} == {0}
    assert cli.main(["--run", run_dir, "--steps", "1:10", "--onset", "-3", "--no-progress"]) == 2


# ----------------------------------------------------------------------------- the scan's onset


def test_a_change_point_is_never_put_before_scoring_began():
    z = np.full(30, np.nan)
    z[11], z[12:] = 2.0, 3.0  # one noisy scored step, then the drift
    tau, lo, hi = sc.change_point_range(z, 16, 40, 11, 4.0)
    assert (tau, lo, hi) == (11, 11, 12)  # was put at step 0: the flat NaN region won the search
    z = np.full(30, np.nan)
    z[12:] = 3.0  # scoring began with the drift: the change may be older
    assert sc.change_point_range(z, 16, 40, 12, 4.0) == (12, 12, 12)
    z = np.r_[np.random.default_rng(1).normal(0.3, 1.0, 50), np.random.default_rng(2).normal(3.0, 1.0, 10)]
    tau, lo, hi = sc.change_point_range(z, 55, 40, 42)
    assert tau == 50 and lo <= 50 <= hi and hi - lo <= 3


@pytest.mark.parametrize("seed", range(4))
def test_a_drift_right_after_scoring_starts_has_its_onset_or_an_honest_range(tmp_path, seed):
    # 4 replicas, 30 steps, min_history 10: scoring starts about step 11, the drift at 12
    root = make_run(str(tmp_path / "r"), steps=30, replicas=4, drift=(3, 12, 1.8), seed=seed)
    rep = scan_mod.scan_run(runlog.load_run(root))
    assert rep.suspect_devices == [3]
    ev = next(e for e in rep.suspects[0].evidence if e.check == "norm_drift")
    lo, hi = ev.onset_range
    assert ev.first_step >= 10 and lo >= 10  # never before scoring began
    assert abs(ev.first_step - 12) <= 5 or (ev.uncertain and lo <= 12 <= hi)
    assert rep.onset["range"] == [lo, hi] and rep.suggestion.split("--steps ")[1].startswith(f"{lo}:")
    assert drill.judge_scan(rep.to_dict(), "drift", 3, 12, drill.DRIFT_TOLERANCE)


# ----------------------------------------------------------------------------- many processes, one directory


def _fp(step, devices):
    leaf = {"['w']": {"fp": 7, "nan": 0, "inf": 0}}
    return proto.StepFingerprints(step=step, loss_bits=1, grad_norm_bits=2, batch_hash="ab", leaves=leaf,
                                  devices={d: {"['w']": 100 + d} for d in devices},
                                  device_coords={d: {"data": i} for i, d in enumerate(devices)})


def _sig(step, devices):
    return proto.StepSignals(step=step, loss=1.0, grad_norm=2.0,
                             replicas=tuple(proto.ReplicaNorm(i, (d,), float(d)) for i, d in enumerate(devices)),
                             devices={d: {"norm_sq": float(d), "nonfinite": {}} for d in devices})


def test_two_processes_write_their_own_files_and_readers_merge_them(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, steps=1)
    env = json.load(open(os.path.join(run, "env.json")))
    env["backend"] = {"process_count": 2}
    json.dump(env, open(os.path.join(run, "env.json"), "w"))
    everyone = [0, 1, 2048, 2049]
    p0 = RunDir(run, process_index=0, process_count=2, local_devices=[0, 1])
    p1 = RunDir(run, process_index=1, process_count=2, local_devices=[2048, 2049])
    for rd in (p0, p1):
        rd.truncate_log("fingerprints.jsonl", 0)
        rd.truncate_log("signals.jsonl", 0)
        for s in range(3):
            rd.append_fingerprints(_fp(s, everyone))
            rd.append_signals(_sig(s, everyone))
        rd.event("start", 0)
    assert sorted(json.loads(open(os.path.join(run, "fingerprints.p00001.jsonl")).readline())["devices"]) == [
        "2048", "2049"]
    assert set(json.loads(open(os.path.join(run, "fingerprints.jsonl")).readline())["devices"]) == {"0", "1"}
    loaded = runlog.load_run(run)
    assert sorted(loaded.fingerprints) == [0, 1, 2] and sorted(loaded.fingerprints[1].devices) == everyone
    events = [json.loads(x)["event"] for x in open(os.path.join(run, "events.jsonl"))]
    assert events.count("start") == 2  # make_run's own, and process 0's (once)
    sig = proto.read_signals(run)
    assert sorted(sig[2].devices) == everyone and [r.replica for r in sig[2].replicas] == [0, 1, 2, 3]
    # process 1 died before logging step 3: that step is set aside, naming its file
    p0.append_fingerprints(_fp(3, everyone))
    loaded = runlog.load_run(run)
    assert 3 not in loaded.fingerprints and "fingerprints.p00001.jsonl has no line for step 3" in loaded.malformed[3]
    # a restart: each process drops its own lines from the checkpoint on
    assert p1.truncate_log("fingerprints.jsonl", 2) == 1 and p0.truncate_log("fingerprints.jsonl", 2) == 2
    assert sorted(runlog.load_run(run).fingerprints) == [0, 1]


def test_devices_are_named_as_an_operator_finds_them():
    rec = {"devices": {"2049": {"process": 1, "local": 1, "host": "h1", "kind": "cpu"}},
           "mesh": {"device_coords": {"2049": {"data": 2, "expert": 1}}}}
    table = dv.device_table(rec)
    assert table[2049].label({"data": 2, "expert": 1}) == "device 2049 (host h1, process 1, local device 1, mesh " \
                                                         "data=2,expert=1)"
    old = {"hostname": "h0", "backend": {"process_count": 1}, "mesh": {"device_ids": [0, 1]}}  # before the table
    assert dv.device_table(old)[1].label() == "device 1 (host h0, process 0, local device 1)"
    named = dv.name_devices([7], {})
    assert named == [{"id": 7, "host": "", "process": 0, "local_device": None, "mesh": {}, "label": "device 7 (process 0)"}]


def test_the_environment_compares_collectives_not_device_counts():
    rec = {"backend": {"collectives": "gloo", "process_count": 2, "device_count": 8}, "env": {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_gpu_deterministic_ops=true"}}
    cur = {"backend": {"collectives": "in-process", "process_count": 1, "device_count": 8}, "env": {
        "XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_force_host_platform_device_count=8"}}
    diffs = envm.compare_environment(rec, cur)
    assert [d for d in diffs if not d.startswith("note: ")] == [
        "backend.collectives: recorded 'gloo', current 'in-process'"]
    older = {"backend": {"process_count": 1}, "env": cur["env"]}  # a record from before the field
    assert not [d for d in envm.compare_environment(older, cur) if not d.startswith("note: ")]


@pytest.mark.parametrize("environ,cluster", [
    ({}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),
    ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "open-mpi"),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "cloud-tpu"),
    ({"TPU_WORKER_HOSTNAMES": "a"}, None),
    ({"KUBERNETES_SERVICE_HOST": "k", "JOB_COMPLETION_INDEX": "0"}, "kubernetes"),
])
def test_the_cluster_jax_would_detect(environ, cluster):
    assert distributed.cluster_in_environment(environ) == cluster


def test_process_settings_name_what_is_missing():
    class A:
        coordinator_address, num_processes, process_id, heartbeat_timeout = None, None, None, 10

    assert distributed.from_args(A(), {}) is None
    a = A()
    a.process_id = 1
    with pytest.raises(distributed.DistributedConfigError, match="need --coordinator-address, --num-processes too"):
        distributed.from_args(a, {})
    a.coordinator_address, a.num_processes = "127.0.0.1:1234", 2
    got = distributed.from_args(a, {})
    assert got.flags == ["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]
    a.process_id = 2
    with pytest.raises(distributed.DistributedConfigError, match="--process-id 2: must be < --num-processes 2"):
        distributed.from_args(a, {})
    b = A()
    assert distributed.from_args(b, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"}).cluster == "slurm"
    with pytest.raises(distributed.DistributedConfigError, match="expected HOST:PORT"):
        distributed.DistributedArgs(coordinator_address="nohost")
    assert "stopped sending heartbeats" in distributed.lost_peers(
        "The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks")
    assert distributed.lost_peers("... Socket closed ...").startswith("the coordinator (process 0)")
    assert dataclasses.replace(got, heartbeat_timeout_s=3).heartbeat_timeout_s == 3


# ----------------------------------------------------------------------------- rooms


def _replay_imports(path):
    import ast

    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("replay"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("replay"))
    return out


@pytest.mark.parametrize("room,allowed", [
    ("runtime", ("replay.runtime",)),
    ("run", ("replay.runtime", "replay.run")),
    ("verify", ("replay.runtime", "replay.run", "replay.verify")),
    ("screen", ("replay.runtime", "replay.run", "replay.verify", "replay.screen")),
])
def test_lower_rooms_never_import_higher_ones_nor_a_trainer(room, allowed):
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay", room)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            bad = sorted(m for m in _replay_imports(os.path.join(folder, name))
                         if not any(m == a or m.startswith(a + ".") for a in allowed) and m != "replay")
            assert not bad, f"replay/{room}/{name} imports {bad}"


def test_the_command_and_the_drills_reach_the_trainer_through_the_run_s_factory():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay")
    for name in ("cli.py", "drill.py", "report.py"):
        mods = _replay_imports(os.path.join(root, name))
        assert not [m for m in mods if m.startswith("replay.reference")], name


def test_a_cluster_beats_the_coordinator_address_alone():
    environ = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}
    assert distributed.cluster_in_environment(environ) == "slurm"
