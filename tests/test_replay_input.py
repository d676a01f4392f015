"""The input side in the run log: scan's ``input`` finding (the buffer drained, the stage named),
goodput's input wait part split by stage, and triage's input check, on hand-made logs."""

import json
import os

import pytest

from replay.run import protocol as proto
from replay.run.runlog import load_run
from replay.screen import goodput as gp
from replay.screen import scan as scan_mod
from replay.screen.triage import check_input
from replay.screen.screening import ScreeningConfig
from test_replay_scan import make_run

T0 = 1_700_000_000.0
STEP_S = 0.1  # make_run's step_time_s
# (step, wait s, stages): the buffer empty at the ask, the wait mostly in storage reads
DRAINED = {
    30: (0.5, {"read": 0.48, "decode": 0.01, "rows": 0.004, "transfer": 0.003, "other": 0.003}),
    31: (0.25, {"read": 0.2, "other": 0.05}),
    50: (0.3, {"index": 0.001, "read": 0.299}),
}


def _plant(root, drained=DRAINED, timed=False):
    """Rewrites make_run's signals: planted waits at ``drained`` (occupancy 0), every other step's
    batch ready (occupancy 2, stages {}); with ``timed``, the recorder's timestamps goodput needs."""
    path = os.path.join(root, "signals.jsonl")
    rows = [json.loads(x) for x in open(path)]
    t = T0
    for r in rows:
        s = r["step"]
        wait, stages = drained.get(s, (1e-4, {}))
        t += wait + STEP_S + 0.001  # wait, compute, 1 ms of the loop's own
        r.update(loader_wait_s=wait, loader_occupancy=0 if s in drained else 2, loader_occupancy_min=0 if s in
                 drained else 1, loader_wait_stages=stages)
        if timed:
            r.update(t=round(t, 6), compile_s=0.0, canary_s=0.0, checkpoint_s=0.0, tokens=100)
    with open(path, "w") as f:
        f.writelines(json.dumps(proto.seal(r)) + "\n" for r in rows)  # as its writer would have sealed it
    if timed:
        events = [{"event": "start", "step": 0, "t": T0, "launched_at": T0 - 2.0, "attempt": 1,
                   "tokens_per_step": 256},
                  {"event": "end", "step": len(rows), "t": round(t + 0.01, 6), "attempt": 1}]
        with open(os.path.join(root, "events.jsonl"), "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)
    return root


def test_scan_finds_the_drained_buffer_and_names_storage_reads(tmp_path):
    run = load_run(_plant(make_run(str(tmp_path / "r"))))
    rep = scan_mod.scan_run(run)
    assert rep.checks["input"]["status"] == "found"
    (loader,) = [s for s in rep.suspects if s.kind == "loader"]
    ev = {e.check: e for e in loader.evidence}
    assert (ev["input"].first_step, ev["input"].last_step) == (30, 50)
    assert "[30, 31, 50]" in ev["input"].detail and "storage reads held 93% of it" in ev["input"].detail
    assert "buffer empty at 3 of 80 asks" in rep.checks["input"]["detail"]
    assert rep.series["input"]["stages"] == pytest.approx({"read": 0.979, "decode": 0.01, "rows": 0.004,
                                                           "transfer": 0.003, "other": 0.053, "index": 0.001})


def test_scan_input_is_clear_when_the_buffer_held_and_not_available_without_occupancy(tmp_path):
    # the same waits with a batch ready at every ask: the hand-off is not a drain
    ready = make_run(str(tmp_path / "ready"), waits=[(30, 0.5), (31, 0.25), (50, 0.3)])
    rep = scan_mod.scan_run(load_run(ready))
    assert rep.checks["input"]["status"] == "clear" and rep.checks["loader_stall"]["status"] == "found"
    old = make_run(str(tmp_path / "old"))
    path = os.path.join(old, "signals.jsonl")
    rows = [{k: v for k, v in json.loads(x).items() if k != "loader_occupancy"} for x in open(path)]
    with open(path, "w") as f:
        f.writelines(json.dumps(proto.seal(r)) + "\n" for r in rows)
    assert scan_mod.scan_run(load_run(old)).checks["input"]["status"] == "not available"


def test_goodput_input_wait_is_the_planted_waits_exactly_split_by_stage(tmp_path):
    run = load_run(_plant(make_run(str(tmp_path / "g")), timed=True))
    rep = gp.account(run)
    planted_us = {s: round((DRAINED[s][0] if s in DRAINED else 1e-4) * 1e6) for s in range(80)}
    assert rep.time_us["loader_wait"] == sum(planted_us.values())
    inp = rep.input
    assert inp["adds_up"] and inp["charged_us"] == rep.time_us["loader_wait"]
    assert inp["us"]["read"] == 480_000 + 200_000 + 299_000
    assert inp["us"]["handoff"] == 77 * 100 and inp["us"]["not_split"] == 0
    assert inp["drained_steps"] == 3 and inp["steps_with_occupancy"] == 80
    assert inp["worst"][0] == (30, 0.5, "read")
    assert sum(rep.time_us.values()) == rep.wall_us
    assert rep.to_dict()["input"]["us"]["read"] == 979_000


def test_triage_reports_a_drained_buffer_beside_the_other_checks():
    def sig(s, occ, wait, stages):
        return proto.StepSignals(step=s, loss=1.0, grad_norm=1.0, step_time_s=STEP_S, loader_wait_s=wait,
                                 loader_occupancy=occ, loader_wait_stages=stages)

    signals = {s: sig(s, 2, 1e-4, {}) for s in range(20)}
    signals[17] = sig(17, 0, 0.4, {"read": 0.1, "transfer": 0.3})
    got = check_input(signals, 0, 19, 15, ScreeningConfig())
    assert got.status == "suspect" and got.subject == {"stage": "transfer", "steps": [17]}
    assert "75% of the wait" in got.summary
    assert check_input(signals, 0, 19, 18, ScreeningConfig()).status == "clear"  # the drain was before the onset
    assert check_input({s: sig(s, None, 0.4, None) for s in range(5)}, 0, 4, 0,
                       ScreeningConfig()).status == "not available"


def test_the_writer_takes_the_loaders_metrics_as_they_are():
    from replay.run.writer import input_signals

    m = {"wait_s_last_step": 0.1234567, "occupancy_at_ask": 0, "occupancy_min": 0, "prefetch_occupancy": 1,
         "wait_stages_s": {"read": 0.1200004, "other": 0.0034563}}
    assert input_signals(m) == {"loader_wait_s": 0.123457, "loader_occupancy": 0, "loader_occupancy_min": 0,
                                "loader_wait_stages": {"read": 0.12, "other": 0.003456}}
    assert input_signals(m, wait_s=0.5, occupancy=3)["loader_wait_s"] == 0.5
    assert input_signals(None) == {"loader_wait_s": None, "loader_occupancy": None, "loader_occupancy_min": None,
                                   "loader_wait_stages": None}
    line = proto.StepSignals(step=0, loss=1.0, grad_norm=1.0, **input_signals(m)).to_json()
    back = proto.StepSignals.from_dict(json.loads(line))
    assert (back.loader_occupancy_min, back.loader_wait_stages) == (0, {"read": 0.12, "other": 0.003456})
