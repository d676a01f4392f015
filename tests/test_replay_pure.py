"""Pure parts of replay: device specs, comparisons, verdicts, run-directory reading, reports.

No JAX here: hand-made StepFingerprints stand in for a trainer's.
"""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.verify import compare
from replay.runtime import devices
from replay import report
from replay.run import runlog
from replay.verify import verdict
from replay.run.protocol import StepFingerprints
from replay.run.codes import ExitCode, Verdict
from replay.verify.verdict import Cause, Divergence, DivergenceKind, Evidence, ReplayOutcome

DEVS = [devices.DeviceInfo(i, process_index=i // 4) for i in range(8)]
LEAVES = ("['w1']", "['w2']")


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    "spec, quarantine, want",
    [
        ("all", (), list(range(8))),
        ("good", (3, 5), [0, 1, 2, 4, 6, 7]),
        ("suspect", (3, 5), [3, 5]),
        ("0,3,5-7", (), [0, 3, 5, 6, 7]),
        ("7,0", (), [0, 7]),  # order of the device list, never of the spec
        ("process:1", (), [4, 5, 6, 7]),
        ("process:0-1", (), list(range(8))),
        ("process:0+6", (), [0, 1, 2, 3, 6]),
        (" GOOD ", (0,), list(range(1, 8))),
    ],
)
def test_select_devices(spec, quarantine, want):
    got = devices.select_devices(spec, DEVS, quarantine)
    assert [d.id for d in got] == want


@pytest.mark.parametrize(
    "spec, quarantine, minimum, message",
    [
        ("", (), 1, "empty"),
        ("3-1", (), 1, "range '3-1' is empty"),
        ("0,x", (), 1, "unknown name 'x'"),
        ("9", (), 1, "no device with id [9]; device ids are [0, 1, 2, 3, 4, 5, 6, 7]"),
        ("process:2", (), 1, "no process [2]; processes are [0, 1]"),
        ("suspect", (), 1, "no device is held suspect"),
        ("good", (0, 1, 2, 3, 4), 4, "leaves 3 device(s) [5, 6, 7], but the run's mesh needs 4"),
        ("0-2", (), 4, "needs 4"),
    ],
)
def test_select_devices_errors(spec, quarantine, minimum, message):
    with pytest.raises(devices.DeviceSpecError) as e:
        devices.select_devices(spec, DEVS, quarantine, minimum=minimum)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_read_quarantine(tmp_path):
    p = tmp_path / "q.txt"
    p.write_text("# held suspect after the spike\n3\n\n 5  # second\n")
    assert devices.read_quarantine(str(p)) == {3, 5}
    p.write_text("3\nfive\n")
    with pytest.raises(devices.DeviceSpecError, match=r"q.txt:2: expected a device id"):
        devices.read_quarantine(str(p))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 64), mesh=st.integers(1, 64), count=st.integers(1, 4))
def test_independent_assignments(n, mesh, count):
    ids = list(range(100, 100 + n))
    if n < mesh:
        with pytest.raises(devices.DeviceSpecError):
            devices.independent_assignments(ids, mesh, count)
        return
    out = devices.independent_assignments(ids, mesh, count)
    assert len(out) == count
    for a in out:
        assert len(a) == mesh and len(set(a)) == mesh and set(a) <= set(ids)
    if n >= 2:  # consecutive assignments never put the same device at a mesh position
        for a, b in zip(out, out[1:]):
            assert all(x != y for x, y in zip(a, b, strict=True))
    if n >= count * mesh:  # enough devices: disjoint sets
        assert len({d for a in out for d in a}) == count * mesh
    assert verdict.count_independent(out[:2]) == (2 if n >= 2 and count >= 2 else 1)


# ----------------------------------------------------------------------------- compare


def fp(step, *, batch="b", loss=0x3F800000, norm=0x40000000, dev_fps=None, leaves=None, coords=None):
    dev_fps = dev_fps or {d: {leaf: 1000 * d + i for i, leaf in enumerate(LEAVES)} for d in range(4)}
    leaves = leaves or {leaf: {"fp": 7 + i, "nan": 0, "inf": 0} for i, leaf in enumerate(LEAVES)}
    coords = coords or {d: {"data": d} for d in dev_fps}
    return StepFingerprints(step, loss, norm, batch, leaves, dev_fps, {}, coords)


def test_pair_devices_by_position():
    logged = {0: compare.position_key({"data": 0}), 1: compare.position_key({"data": 1})}
    replayed = {5: compare.position_key({"data": 1}), 6: compare.position_key({"data": 0})}
    assert compare.pair_devices(logged, replayed) == {0: 6, 1: 5}
    with pytest.raises(compare.PairingError, match="mesh positions differ"):
        compare.pair_devices(logged, {5: compare.position_key({"data": 2}), 6: compare.position_key({"data": 0})})


def test_compare_identical_is_bit_exact_match():
    d = compare.compare_step(fp(3), fp(3), {i: i for i in range(4)})
    assert d.ok and d.evidence is Evidence.BIT_EXACT and d.divergence() is None


def test_compare_other_devices_is_per_shard():
    other = fp(3, dev_fps={d + 4: {leaf: 1000 * d + i for i, leaf in enumerate(LEAVES)} for d in range(4)},
               coords={d + 4: {"data": d} for d in range(4)})
    pairing = compare.pair_devices(compare.coords_of(fp(3)), compare.coords_of(other))
    d = compare.compare_step(fp(3), other, pairing)
    assert d.ok and d.evidence is Evidence.PER_SHARD


def test_compare_localizes_one_device_and_leaf():
    bad = fp(3)
    logged_devs = {k: dict(v) for k, v in bad.devices.items()}
    logged_devs[2]["['w2']"] ^= 1  # the log holds one corrupted contribution
    logged = fp(3, dev_fps=logged_devs, leaves={"['w1']": {"fp": 7, "nan": 0, "inf": 0},
                                                "['w2']": {"fp": 9, "nan": 0, "inf": 0}})
    d = compare.compare_step(logged, fp(3), {i: i for i in range(4)})
    assert d.kind is DivergenceKind.DEVICE
    assert dict(d.devices) == {2: ("['w2']",)}
    assert d.divergence() == Divergence(3, DivergenceKind.DEVICE, (2,), ("['w2']",))


def test_compare_batch_hash_is_data_difference():
    d = compare.compare_step(fp(3, batch="swapped", loss=0x3F800001), fp(3), {i: i for i in range(4)})
    assert d.kind is DivergenceKind.DATA


def test_compare_nan_counts_compare():
    logged = fp(3, leaves={"['w1']": {"fp": 7, "nan": 1, "inf": 0}, "['w2']": {"fp": 8, "nan": 0, "inf": 0}})
    d = compare.compare_step(logged, fp(3), {i: i for i in range(4)})
    assert d.leaves == ("['w1']",) and d.kind is DivergenceKind.GLOBAL


def test_compare_tolerance_mode():
    import struct

    def bits(x):
        return struct.unpack("<I", struct.pack("<f", x))[0]

    a, b = fp(3, loss=bits(2.0)), fp(3, loss=bits(2.0000002), dev_fps={d: {} for d in range(4)})
    d = compare.compare_step(a, b, {i: i for i in range(4)}, tolerance=1e-6)
    assert d.ok and d.evidence is Evidence.TOLERANCE
    d = compare.compare_step(a, fp(3, loss=bits(2.1)), {i: i for i in range(4)}, tolerance=1e-6)
    assert d.kind is DivergenceKind.TOLERANCE
    assert compare.close(bits(float("nan")), bits(float("nan")) | 1, 0.1)
    assert not compare.close(bits(float("nan")), bits(1.0), 0.1)
    with pytest.raises(ValueError, match=r"tolerance must be in \(0, 1\), got 2"):
        compare.compare_step(a, b, {}, tolerance=2)


def test_signature_and_disagreement_are_positional():
    a = [fp(1), fp(2)]
    moved = {d + 4: v for d, v in fp(1).devices.items()}
    b = [fp(1, dev_fps=moved, coords={d + 4: {"data": d} for d in range(4)}),
         fp(2, dev_fps={d + 4: v for d, v in fp(2).devices.items()}, coords={d + 4: {"data": d} for d in range(4)})]
    ca, cb = compare.coords_of(a[0]), compare.coords_of(b[0])
    assert compare.signature(a, ca) == compare.signature(b, cb)
    assert compare.disagreement(a, b, ca, cb) is None
    flaky = {k: dict(v) for k, v in moved.items()}
    flaky[5]["['w1']"] += 1
    b[1] = fp(2, dev_fps=flaky, coords={d + 4: {"data": d} for d in range(4)})
    assert compare.signature(a, ca) != compare.signature(b, cb)
    assert compare.disagreement(a, b, ca, cb) == {
        "step": 2, "positions": ["data=1"], "devices_a": [1], "devices_b": [5], "suspects": []}


# ----------------------------------------------------------------------------- verdicts


def outcome(assign, div=None, sig="s", ev=Evidence.PER_SHARD):
    return ReplayOutcome(tuple(assign), ev, div, sig)


DEV_DIV = Divergence(5, DivergenceKind.DEVICE, (2,), ("['w1']",))


@pytest.mark.parametrize(
    "outcomes, want_verdict, want_cause, want_devices",
    [
        ([outcome([0, 1]), outcome([2, 3])], Verdict.ACQUITTED, Cause.REPRODUCED, ()),
        ([outcome([0, 1], DEV_DIV), outcome([2, 3], DEV_DIV)], Verdict.CONVICTED, Cause.DEVICE_FAULT, (2,)),
        ([outcome([0, 1], DEV_DIV), outcome([0, 1], DEV_DIV)], Verdict.AMBIGUOUS, Cause.TOO_FEW_REPLAYS, ()),
        ([outcome([0, 1], DEV_DIV), outcome([1, 0], DEV_DIV)], Verdict.CONVICTED, Cause.DEVICE_FAULT, (2,)),
        ([outcome([0, 1], DEV_DIV)], Verdict.AMBIGUOUS, Cause.TOO_FEW_REPLAYS, ()),
        ([outcome([0, 1], DEV_DIV), outcome([2, 3], DEV_DIV, sig="t")], Verdict.AMBIGUOUS,
         Cause.REPLAYS_DISAGREE, ()),
        ([outcome([0, 1], None), outcome([2, 3], DEV_DIV, sig="t")], Verdict.AMBIGUOUS, Cause.REPLAYS_DISAGREE, ()),
        ([outcome([0, 1], Divergence(5, DivergenceKind.DATA))], Verdict.ACQUITTED, Cause.DATA_ORDER, ()),
        ([outcome([0, 1], Divergence(5, DivergenceKind.ALL_DEVICES, (0, 1, 2, 3))),
          outcome([2, 3], Divergence(5, DivergenceKind.ALL_DEVICES, (0, 1, 2, 3)))],
         Verdict.AMBIGUOUS, Cause.UNLOCALIZED, ()),
        ([outcome([0, 1], Divergence(5, DivergenceKind.GLOBAL, (), ("['w1']",))),
          outcome([2, 3], Divergence(5, DivergenceKind.GLOBAL, (), ("['w1']",)))],
         Verdict.AMBIGUOUS, Cause.UNLOCALIZED, ()),
        ([outcome([0, 1], Divergence(5, DivergenceKind.TOLERANCE), ev=Evidence.TOLERANCE),
          outcome([2, 3], Divergence(5, DivergenceKind.TOLERANCE), ev=Evidence.TOLERANCE)],
         Verdict.AMBIGUOUS, Cause.TOLERANCE_ONLY, ()),
        ([outcome([0, 1], ev=Evidence.TOLERANCE)], Verdict.ACQUITTED, Cause.REPRODUCED, ()),
    ],
)
def test_decide(outcomes, want_verdict, want_cause, want_devices):
    d = verdict.decide(outcomes, num_devices=4)
    assert (d.verdict, d.cause, d.devices) == (want_verdict, want_cause, want_devices)
    if want_verdict is Verdict.CONVICTED:
        assert d.step == 5 and d.leaves == ("['w1']",)
    if want_cause is Cause.REPRODUCED and outcomes[0].evidence is Evidence.TOLERANCE:
        assert "weaker evidence" in d.explanation
    if want_cause is Cause.DATA_ORDER:
        assert "replay inspect" in d.explanation


def test_exit_codes_are_distinct():
    codes = [c.value for c in ExitCode]
    assert len(set(codes)) == len(codes)
    assert Verdict.CONVICTED.exit_code == ExitCode.CONVICTED == 3
    assert Verdict.ACQUITTED.exit_code == 0 and Verdict.AMBIGUOUS.exit_code == 4
    with pytest.raises(ValueError):
        verdict.decide([], 4)


# ----------------------------------------------------------------------------- run directory


def write_run(path, steps, *, checkpoints=(0,), extra_lines=(), quarantine=None):
    os.makedirs(path / "checkpoints", exist_ok=True)
    (path / "run_config.yaml").write_text("seed: 1\nglobal_batch: 8\n")
    (path / "env.json").write_text(json.dumps({"mesh": {"shape": [4], "axis_names": ["data"],
                                                         "device_ids": [0, 1, 2, 3]}}))
    (path / "events.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    with open(path / "fingerprints.jsonl", "w") as f:
        for s in steps:
            f.write(fp(s).to_json() + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    for c in checkpoints:
        os.makedirs(path / "checkpoints" / str(c), exist_ok=True)
    os.makedirs(path / "checkpoints" / "7.orbax-checkpoint-tmp-123", exist_ok=True)
    if quarantine is not None:
        (path / "quarantine.txt").write_text(quarantine)


def test_load_run(tmp_path):
    write_run(tmp_path, range(10), checkpoints=(0, 5), extra_lines=[fp(4, loss=1).to_json(), '{"step": 9, "lo'],
              quarantine="2\n")
    run = runlog.load_run(str(tmp_path))
    assert run.logged_steps == (0, 10)
    assert run.checkpoints == [0, 5]
    assert run.relogged_conflicts == [4]
    assert run.fingerprints[4].loss_bits == 1  # the last line of a re-logged step wins
    assert run.quarantine == {2}
    assert run.mesh_size == 4
    assert run.checkpoint_for(4) == 0 and run.checkpoint_for(5) == 5 and run.checkpoint_for(9) == 5
    run.check_range(3, 10)
    with pytest.raises(runlog.StepRangeError, match="steps 3:11 are partly outside the logged steps 0:10"):
        run.check_range(3, 11)


def test_load_run_errors(tmp_path):
    with pytest.raises(runlog.RunDirError, match="run directory not found"):
        runlog.load_run(str(tmp_path / "nope"))
    write_run(tmp_path, range(3), checkpoints=(2,))
    run = runlog.load_run(str(tmp_path))
    with pytest.raises(runlog.MissingCheckpointError, match=r"no checkpoint at or before step 1 .*checkpoints: \[2\]"):
        run.checkpoint_for(1)
    (tmp_path / "fingerprints.jsonl").write_text('{"step": 0}\n' + fp(1).to_json() + "\n")
    with pytest.raises(runlog.RunDirError, match="entry 1 is not a StepFingerprints"):
        runlog.load_run(str(tmp_path))
    (tmp_path / "fingerprints.jsonl").write_text("{torn\n" + fp(1).to_json() + "\n")
    with pytest.raises(runlog.RunDirError, match=r"fingerprints.jsonl:1: not JSON"):
        runlog.load_run(str(tmp_path))
    os.remove(tmp_path / "env.json")
    with pytest.raises(runlog.RunDirError, match="env.json is missing"):
        runlog.load_run(str(tmp_path))


@pytest.mark.parametrize("spec, want", [("3:7", (3, 7)), ("5", (5, 6)), (" 0 : 2 ", (0, 2))])
def test_parse_steps(spec, want):
    assert runlog.parse_steps(spec) == want


@pytest.mark.parametrize("spec", ["7:3", "3:3", "-1:2", "a:b", "1:2:3", ""])
def test_parse_steps_errors(spec):
    with pytest.raises(runlog.StepsSpecError, match="--steps"):
        runlog.parse_steps(spec)


# ----------------------------------------------------------------------------- reports


def test_plot_and_json(tmp_path):
    logged = [fp(s) for s in range(3)]
    bad = {k: dict(v) for k, v in logged[1].devices.items()}
    bad[2]["['w1']"] += 1
    logged[1] = fp(1, dev_fps=bad)
    pairing = {i: i for i in range(4)}
    diffs = [compare.compare_step(lf, fp(lf.step), pairing) for lf in logged]
    rep = {
        "steps": {"start": 0, "stop": 3}, "checkpoints": [0], "run_devices": [0, 1, 2, 3],
        "replays": [{"index": 0, "assignment": [0, 1, 2, 3], "steps": [d.to_dict() for d in diffs]}],
        "verdict": "convicted", "exit_code": 3, "explanation": "x", "first_divergent_step": 1,
        "convicted_devices": [2], "leaves": ["['w1']"], "environment": {"differences": []},
    }
    report.plot_range(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.write_json(rep, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["replays"][0]["steps"][1]["devices"] == {"2": ["['w1']"]}
    from rich.console import Console

    console = Console(record=True, width=200)
    report.render_range(rep, console)
    text = console.export_text()
    assert "CONVICTED" in text and "device [2]" in text and "device dev" not in text


# ----------------------------------------------------------------------------- canary decision


def dev(i, *sigs):
    from replay.run.canary import DeviceResult

    return DeviceResult(i, tuple(sigs), {})


@pytest.mark.parametrize(
    "results, golden, want, odd, status",
    [
        ([dev(0, "g", "g"), dev(1, "g", "g")], "g", Verdict.ACQUITTED, (), "matched"),
        ([dev(0, "g", "g"), dev(1, "x", "x"), dev(2, "g", "g")], "g", Verdict.CONVICTED, (1,), "matched"),
        ([dev(0, "g", "g"), dev(1, "g", "x")], "g", Verdict.CONVICTED, (1,), "matched"),  # inconsistent chip
        ([dev(0, "a"), dev(1, "a"), dev(2, "b")], None, Verdict.CONVICTED, (2,), "created"),
        ([dev(0, "a"), dev(1, "a"), dev(2, "a")], None, Verdict.ACQUITTED, (), "created"),
        ([dev(0, "a"), dev(1, "b")], None, Verdict.AMBIGUOUS, (), "absent-no-majority"),
        ([dev(0, "a"), dev(1, "b"), dev(2, "c"), dev(3, "a")], None, Verdict.AMBIGUOUS, (), "absent-no-majority"),
        ([dev(0, "a"), dev(1, "a")], "g", Verdict.AMBIGUOUS, (), "mismatch-all"),  # environment changed
        ([dev(0, "a"), dev(1, "b")], "g", Verdict.CONVICTED, (0, 1), "matched"),
    ],
)
def test_decide_canary(results, golden, want, odd, status):
    from replay.run.canary import decide_canary

    d = decide_canary(results, golden)
    assert (d.verdict, d.odd_devices, d.golden_status) == (want, odd, status)
    if status == "created":
        assert d.reference == "a"


def test_canary_table_says_when_repeats_were_not_compared():
    """One run per device compares nothing: the table says n/a, not True."""
    import io

    from rich.console import Console

    from replay.report import render_canary

    def report(signatures):
        return {"canary": {"name": "c", "version": 1}, "golden": {"status": "created"}, "verdict": "acquitted",
                "exit_code": 0, "explanation": "x",
                "devices": [{"id": 0, "signature": signatures[0], "signatures": signatures,
                             "repeats_agree": len(set(signatures)) == 1, "status": "ok"}]}

    for sigs, want in ((["ab" * 8], "n/a (1 run)"), (["ab" * 8] * 3, "True (3 runs)"),
                       (["ab" * 8, "cd" * 8], "False (2 runs)")):
        out = io.StringIO()
        render_canary(report(sigs), Console(file=out, width=160))
        assert want in out.getvalue(), out.getvalue()


def test_range_verdict_panel_names_the_quarantine():
    import io

    from rich.console import Console

    from replay.report import _verdict_panel

    base = {"verdict": "acquitted", "exit_code": 0, "explanation": "x", "device_spec": "good", "devices": [0, 1, 2, 3]}
    for quarantine, want in (([5, 6], "quarantined (left out of 'good'): [5, 6]"), ([], "no device quarantined")):
        out = io.StringIO()
        Console(file=out, width=200).print(_verdict_panel({**base, "quarantine": quarantine}))
        assert "devices: 'good' -> [0, 1, 2, 3]; " + want in out.getvalue()


def test_evidence_names_each_placement_when_they_differ():
    rep = {"evidence": "per-shard", "run_devices": [0, 1, 2, 3],
           "replays": [{"assignment": [0, 1, 2, 3], "evidence": "bit-exact"},
                       {"assignment": [4, 5, 6, 7], "evidence": "per-shard"},
                       {"assignment": [0, 1, 2, 3], "evidence": "bit-exact"}]}
    assert report.evidence_text(rep) == "bit-exact on [0, 1, 2, 3] (the run's own devices), per-shard on [4, 5, 6, 7]"
    rep["replays"][0]["evidence"] = rep["replays"][2]["evidence"] = "per-shard"
    assert report.evidence_text(rep) == "per-shard"


@pytest.mark.parametrize("step,replayed,want", [
    (8, {2: 0}, 1),        # a conviction at segment 2's first step: segment 1 may hold the fault's start
    (9, {2: 0}, None),     # inside its segment: the step before it replayed right
    (8, {1: 1, 2: 0}, None),  # segment 1 already replayed (and right)
    (0, {0: 0}, None),     # the range's first segment: nothing before it to replay
    (None, {}, None),
])
def test_walk_back_replays_the_segment_before_a_conviction_at_a_checkpoint(step, replayed, want):
    from replay.verify import plan
    from replay.verify.engine import walk_back

    segs = plan.segments(0, 12, [0, 4, 8])
    assert walk_back(segs, step, replayed) == want
