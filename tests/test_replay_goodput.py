"""`replay goodput`: a drill run with two kills, one rollback and one skip window, whose per-part
step and token counts are the planted ones exactly and whose times add up to the wall time; old
run directories; the command."""

import json
import os

import pytest

from replay.cli import main
from replay.reference.loop import Launch
from replay.run import lineage as lin
from replay.run.runlog import load_run
from replay.screen import goodput as gp
from replay.run import protocol as proto

ROW_TOKENS = 8 * 32  # the drill config: global batch 8, seq_len 32


class _Kill(RuntimeError):
    pass


def _kill_after(step):
    def hook(s, loss):
        if s == step:
            raise _Kill(s)
    return hook


@pytest.fixture(scope="module")
def drilled(triage_drills):
    """The planted history (checkpoints every 10 steps):

    attempt 1  trains 0..13, killed                          -> 10..13 lost (4), resumed from 10
    attempt 2  trains 10..24, killed                         -> 20..24 lost (5), resumed from 20
    attempt 3  trains 20..34, ends at 35
    attempt 4  rolls back to checkpoint 30, trains 30..44    -> 30..34 rewound (5)
    replay skip --steps 40:43 --checkpoint 40
    attempt 5  resumes from 40 with data 40..42 skipped,     -> 40..42 trained on a later-skipped window (3),
               trains 40..49                                    43..44 rewound (2); 3 data steps skipped
    """
    drills = triage_drills
    run = os.path.join(drills.root, "goodput-run")
    cfg = drills.config(2)
    for kill in (13, 24):
        with pytest.raises(_Kill):
            drills.train(run, cfg, 60, on_step=_kill_after(kill))
    drills.train(run, cfg, 35)
    drills.train(run, cfg, 45, launch=Launch(rewind_to=30, rewind_reason="rollback"))
    assert main(["skip", "--run", run, "--steps", "40:43", "--checkpoint", "40", "--reason", "spike"]) == 0
    drills.train(run, cfg, 50)
    return run


def test_the_drill_runs_counts_are_the_planted_ones_and_its_times_add_up(drilled):
    run = load_run(drilled)
    kinds = [(a.id, a.kind, a.start) for a in run.lineage.attempts]
    assert kinds == [(1, "start", 0), (2, "resume", 10), (3, "resume", 20), (4, "rollback", 30), (5, "rewind", 40)]
    rep = gp.account(run)
    planted = {"productive": 50, "non_finite": 0, "lost": 4 + 5, "rewound": 5 + 2, "skipped_window": 3,
               "skipped_data": 3}
    assert rep.steps == planted
    assert rep.tokens == {k: v * ROW_TOKENS for k, v in planted.items()}
    assert rep.reconcile["trained_steps"] == rep.reconcile["trained_steps_by_attempt"] == 14 + 15 + 15 + 15 + 10
    assert rep.reconcile["data_steps_add_up"] and rep.reconcile["lineage_data_steps"] == [0, 53]
    # non-padding tokens: the logged counts of exactly those steps, superseded lines included
    sup = {(d["attempt"], d["step"]): d["tokens"] for d in lin.read_superseded(drilled, "signals.jsonl")}
    assert rep.nonpad_tokens["lost"] == sum(v for (a, s), v in sup.items() if (a, s) in
                                            {(1, s) for s in range(10, 14)} | {(2, s) for s in range(20, 25)})
    # the time: every part in integer microseconds, adding up to the wall time exactly, which is the
    # first launch to the last record
    events = run.all_events
    first = round(events[0]["launched_at"] * 1e6)
    last = round(max(e["t"] for e in events if e.get("attempt") == 5) * 1e6)
    assert rep.wall_us == last - first and sum(rep.time_us.values()) == rep.wall_us
    assert rep.time_us["unknown"] == 0 and rep.unknown == []
    assert all(rep.time_us[p] > 0 for p in ("productive", "startup", "restore", "lost", "rewound", "skipped_window",
                                             "checkpoint_save", "gap"))
    assert 0 < rep.goodput < 1 and rep.token_goodput == pytest.approx(50 / 69)
    assert rep.mfu["status"] == "ok" and rep.mfu["illustrative"] and rep.mfu["median"] > 0
    assert rep.young["status"] == "ok" and rep.young["crashes"] == 2
    d = rep.to_dict()
    assert d["time_adds_up"] and d["time"]["lost"]["ml_goodput_measurement"] == "WASTED_PROGRESS_FROM_DISRUPTION"


def test_the_command_prints_the_table_and_the_headline_and_writes_json_and_png(drilled, tmp_path, capsys):
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    assert main(["goodput", "--run", drilled, "--json", str(out), "--plot", str(png), "--peak-flops", "1e11"]) == 0
    text = capsys.readouterr().out
    assert "the parts add up to the wall time exactly" in text and "goodput " in text
    assert "lost to crashes (redone after a resume)" in text and "reconciles with the loader's arithmetic: True" in text
    rep = json.loads(out.read_text())
    assert rep["mfu"]["peak_from"] == "--peak-flops" and not rep["mfu"]["illustrative"]
    assert sum(p["us"] for p in rep["time"].values()) == round(rep["wall_s"] * 1e6)
    assert png.stat().st_size > 20_000
    assert main(["goodput", "--run", drilled, "--peak-flops", "nan"]) == 2


def test_an_old_run_directory_says_what_is_unknown(drilled, tmp_path):
    """Events and signals without the recorder's timestamps (written before it existed): the wall
    time from the events' whole-second clock, all of it unknown, and the step ledger still exact."""
    import shutil

    old = str(tmp_path / "old")
    shutil.copytree(drilled, old)
    keep = ("event", "step", "time", "checkpoint", "dropped_fingerprint_lines", "start", "end", "stop", "skip",
            "previous_end", "reason", "kind", "attempt")
    for name, fields in (("events.jsonl", keep), ("signals.jsonl", None)):
        path = os.path.join(old, name)
        rows = [json.loads(x) for x in open(path)]
        with open(path, "w") as f:
            for r in rows:
                if fields is None:
                    r = {k: v for k, v in r.items() if k not in ("t", "compile_s", "canary_s", "checkpoint_s")}
                else:
                    r = {k: v for k, v in r.items() if k in fields}
                f.write(json.dumps(proto.seal(r) if proto.LINE_CHECK in r else r) + "\n")
    rep = gp.account(load_run(old))
    assert rep.time_us["unknown"] == rep.wall_us > 0 and rep.time_us["productive"] == 0
    assert any("whole seconds" in u for u in rep.unknown)
    assert rep.steps["productive"] == 50 and rep.steps["lost"] == 9


def _shift_attempt(run_dir, attempt, seconds):
    """Moves every timestamp attempt ``attempt`` wrote (its events' t and launched_at, its steps' t, in the
    lineage's logs and in superseded/) by ``seconds``: a resumed attempt whose machine's clock is off."""
    from replay.run.runlog import load_run as _load

    lineage = _load(run_dir).lineage
    ids = lin.event_attempts(_load(run_dir).all_events)
    path = os.path.join(run_dir, "events.jsonl")
    rows = [json.loads(x) for x in open(path) if x.strip()]
    with open(path, "w") as f:
        for r, a in zip(rows, ids):
            if a == attempt:
                for k in ("t", "launched_at", "save_start_t", "commit_t"):
                    if k in r:
                        r[k] += seconds
            f.write(json.dumps(r) + "\n")
    for path in (os.path.join(run_dir, "signals.jsonl"), os.path.join(run_dir, "superseded", "signals.jsonl")):
        rows = [json.loads(x) for x in open(path) if x.strip()]
        with open(path, "w") as f:
            for r in rows:
                mine = r.get("attempt") == attempt if "superseded_by" in r else lineage.attempt_of(r["step"]) == attempt
                if mine and "t" in r:
                    r["t"] += seconds
                f.write(json.dumps(proto.seal(r) if proto.LINE_CHECK in r else r) + "\n")


@pytest.mark.parametrize("behind", [3600.0, 640.0])
def test_a_resumed_attempt_whose_clock_runs_behind_is_a_clock_disagreement(drilled, tmp_path, behind, capsys):
    """Attempt 2's clock 3,600 s (and 640 s) behind attempt 1's: reported as clocks that disagree, by how
    much and which attempt; never a crash or a negative part, and the parts still add up."""
    import shutil

    shifted = str(tmp_path / "shifted")
    shutil.copytree(drilled, shifted)
    clean = gp.account(load_run(drilled))
    _shift_attempt(shifted, 2, -behind)
    rep = gp.account(load_run(shifted))
    assert rep.problems == [] and all(v >= 0 for v in rep.time_us.values())
    (c,) = [c for c in rep.clocks if c["attempt"] == 2]
    gap_1_2 = clean.attempts[1]["begin_s"] - (clean.attempts[0]["end_s"])  # the real gap, now hidden
    assert c["previous_attempt"] == 1 and c["behind_s"] == pytest.approx(behind - gap_1_2, abs=1e-5)
    # attempt 2 is placed from attempt 1's last record: its hidden gap shows before attempt 3 (whose
    # clock is right), so the wall time and the total gap are the clean run's
    assert rep.wall_us == clean.wall_us and rep.time_us["gap"] == clean.time_us["gap"]
    assert rep.steps == clean.steps and rep.time_us["productive"] == clean.time_us["productive"]
    assert main(["goodput", "--run", shifted]) == 0
    text = capsys.readouterr().out
    assert "clocks disagree: attempt 2's launch is" in text and "every part >= 0" in text


def test_the_audit_fails_when_a_part_is_counted_twice(drilled, monkeypatch, capsys):
    """The check can fail: a split that counts each step's compute twice (as compute and as compile)
    no longer adds up to the wall time, which account takes from the records, not from the parts."""
    real = gp.split_interval

    def twice(interval, compute, comp):
        parts, excess = real(interval, compute, comp)
        return dict(parts, compile=parts["compile"] + parts["compute"]), excess

    monkeypatch.setattr(gp, "split_interval", twice)
    rep = gp.account(load_run(drilled))
    assert rep.problems and "the parts add up to" in rep.problems[0] and not rep.to_dict()["time_adds_up"]
    assert main(["goodput", "--run", drilled]) == 0
    assert "THE PARTS DO NOT ADD UP" in capsys.readouterr().out
    assert gp.audit({"productive": 5, "other": -1}, 4) == ["other is negative (-0.000001 s)"]
    assert real(10, 8, {"loader_wait": 5, "compile": 1}) == (
        {"compute": 8, "loader_wait": 2, "compile": 0, "other": 0}, 4)


def test_young_uses_the_saves_own_times_and_a_stated_mtbf(drilled, tmp_path, capsys):
    """Checkpoint events carry save_start_t and commit_t; the interval is measured from them (10 steps
    apart, not the end-of-run stamps); the MTBF is the design point unless the flag or config sets it."""
    run = load_run(drilled)
    saves = [e for e in run.all_events if e["event"] == "checkpoint"]
    assert saves and all(e["save_start_t"] <= e["commit_t"] <= e["t"] for e in saves)
    y = gp.account(run).young
    assert y["status"] == "ok" and y["mtbf_s"] == gp.DESIGN_MTBF_S == 8800.0 and "design point" in y["mtbf_from"]
    assert y["interval_from"].startswith("measured") and y["observed_mtbf_s"] > 0
    step_s = gp._median_step(run)[0]
    assert 5 * step_s < y["interval_s"] < 100 * step_s  # about 10 steps, not the events' stamps
    assert y["optimal_interval_s"] == pytest.approx((2 * y["checkpoint_cost_s"] * 8800.0) ** 0.5)
    assert gp.account(run, mtbf_s=100.0).young["mtbf_from"] == "replay goodput --mtbf"
    assert main(["goodput", "--run", drilled, "--mtbf", "3600"]) == 0
    assert "MTBF 60.0 min" in capsys.readouterr().out.replace("\n", " ")
    assert main(["goodput", "--run", drilled, "--mtbf", "-1"]) == 2
