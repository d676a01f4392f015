"""`replay goodput`: a drill run with two kills, one rollback and one skip window, whose per-part
step and token counts are the planted ones exactly and whose times add up to the wall time; old
run directories; the command."""

import json
import os

import pytest

from replay.cli import main
from replay.run import lineage as lin
from replay.run.runlog import load_run
from replay.screen import goodput as gp

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
    drills.train(run, cfg, 45, rewind_to=30, rewind_reason="rollback")
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
                f.write(json.dumps(r) + "\n")
    rep = gp.account(load_run(old))
    assert rep.time_us["unknown"] == rep.wall_us > 0 and rep.time_us["productive"] == 0
    assert any("whole seconds" in u for u in rep.unknown)
    assert rep.steps["productive"] == 50 and rep.steps["lost"] == 9
