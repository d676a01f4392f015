"""`replay scan` over hand-made run logs (tables), its command line, and screening drills on real short runs."""

import json
import math
import os
import random

import numpy as np
import pytest
import yaml

from replay.run import protocol as proto
from replay.screen import scan as scan_mod
from replay.screen import screening as sc
from replay.cli import main
from replay.runtime.devices import DeviceInfo, select_devices
from replay.run.runlog import load_run
from replay.run.codes import ExitCode

LEAF = "['w']"


def make_run(root, *, steps=80, replicas=4, seed=0, drift=None, canary=None, nonfinite=(), router_bad=(),
             loss_spike=None, waits=(), events=(), config=None, signals=True):
    """A run directory with hand-made logs. ``drift``: (replica, start, factor on the norm);
    ``canary``: (device, first step, every); ``nonfinite``: [(step, device or 'all')];
    ``router_bad``: [(step, layer)] with one expert at 0.02 of the tokens; ``waits``: [(step, s)]."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    cfg = {"name": "hand", "router_health": {"warmup_steps": 10}, **(config or {})}
    with open(os.path.join(root, "run_config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    ids = list(range(replicas))
    with open(os.path.join(root, "env.json"), "w") as f:
        json.dump({"mesh": {"axis_names": ["data", "expert"], "shape": [replicas, 1], "device_ids": ids}}, f)
    loss = 5.0 + 2.0 * np.exp(-np.arange(steps) / 20) + rng.normal(0, 0.01, steps)
    if loss_spike is not None:
        loss[loss_spike] += 1.5
    with open(os.path.join(root, "events.jsonl"), "w") as f:
        for e in [{"event": "start", "step": 0}, *events]:
            f.write(json.dumps(e) + "\n")
    fps, sigs, cans = [], [], []
    for s in range(steps):
        base = math.exp(-s / 30)
        norms = base * np.exp(2 * rng.normal(0, 0.08, replicas))
        if drift is not None and s >= drift[1]:
            norms[drift[0]] *= drift[2] ** 2
        devs = {d: {"norm_sq": float(norms[d]), "nonfinite": {}} for d in ids}
        for (fs, who) in nonfinite:
            if fs == s:
                for d in (ids if who == "all" else [who]):
                    devs[d] = {"norm_sq": math.nan, "nonfinite": {LEAF: 2}}
                    norms[d] = math.nan
        layers = []
        for layer in range(2):
            share = np.full(4, 0.25)
            if (s, layer) in router_bad:
                share = np.array([0.02, 0.3, 0.34, 0.34])
            layers.append(proto.RouterLayerStats(entropy=1.3, expert_share=tuple(share), dropped_fraction=0.0,
                                                 max_logit=2.0, z_loss=3.0, aux_loss=1.0))
        wait = dict(waits).get(s, 1e-4)
        sigs.append(proto.StepSignals(
            step=s, loss=float(loss[s]), grad_norm=float(np.sqrt(np.nansum(norms))),
            replicas=tuple(proto.ReplicaNorm(replica=d, devices=(d,), norm_sq=float(norms[d])) for d in ids),
            devices=devs, router=tuple(layers), step_time_s=0.1, loader_wait_s=wait, loader_occupancy=2))
        fps.append(proto.StepFingerprints(
            step=s, loss_bits=int(np.float32(loss[s]).view(np.uint32)), grad_norm_bits=0, batch_hash="00",
            leaves={LEAF: {"fp": 1, "nan": 0, "inf": 0}}, devices={d: {LEAF: 1} for d in ids},
            device_coords={d: {"data": d, "expert": 0} for d in ids}))
        if canary is not None and s % canary[2] == 0:
            for d in ids:
                bad = d == canary[0] and s >= canary[1]
                cans.append(proto.CanaryRecord(step=s, device=d, signature="bad" if bad else "good",
                                               status="differs_from_golden" if bad else "ok", golden="matched",
                                               canary="c", seconds=0.01))
    with open(os.path.join(root, "fingerprints.jsonl"), "w") as f:
        f.writelines(fp.to_json() + "\n" for fp in fps)
    if signals:
        with open(os.path.join(root, "signals.jsonl"), "w") as f:
            f.writelines(x.to_json() + "\n" for x in sigs)
    if canary is not None:
        with open(os.path.join(root, "canary.jsonl"), "w") as f:
            f.writelines(c.to_json() + "\n" for c in cans)
    return root


def scan(root, start=None, stop=None):
    return scan_mod.scan_run(load_run(root), start, stop)


def test_clean_logs_are_clean_and_missing_signals_are_not_available(tmp_path):
    rep = scan(make_run(str(tmp_path / "a")))
    assert rep.suspects == [] and rep.exit_code == ExitCode.CLEAN == 0
    assert {k: v["status"] for k, v in rep.checks.items()} == {
        "canary": "not available", "nonfinite": "clear", "norm_spike": "clear", "norm_drift": "clear",
        "expert_drift": "not available", "router": "clear", "expert_load": "not available", "loss_spike": "clear",
        "loader_stall": "clear", "input": "clear"}
    bare = scan(make_run(str(tmp_path / "b"), signals=False))
    statuses = {k: v["status"] for k, v in bare.checks.items()}
    assert statuses["norm_drift"] == statuses["router"] == statuses["loader_stall"] == statuses["input"] \
        == "not available"
    assert statuses["loss_spike"] == "clear"  # the loss comes from fingerprints.jsonl


@pytest.mark.parametrize("replica,start,factor", [(2, 30, 1.3), (0, 45, 0.75), (3, 25, 2.0)])
def test_a_drifting_replica_is_named_with_its_onset_and_the_replay_to_run(tmp_path, replica, start, factor):
    root = make_run(str(tmp_path / "r"), drift=(replica, start, factor), seed=replica)
    rep = scan(root)
    assert rep.suspect_devices == [replica]
    top = rep.suspects[0]
    assert top.subject == f"device {replica}" and top.evidence[0].check == "norm_drift"
    assert abs(top.first_step - start) <= 3 and top.strength >= 1
    lo, hi = rep.onset["range"]  # the suggested replay starts where the onset could first lie
    assert lo <= top.first_step <= hi and rep.onset["step"] == top.first_step
    assert rep.suggestion == f"replay --run {root} --steps {lo}:80 --devices good"
    assert rep.exit_code == ExitCode.SUSPECTS == 8


def test_ranking_puts_a_canary_mismatch_first_and_suspects_json_feeds_devices_suspect(tmp_path):
    root = make_run(str(tmp_path / "r"), drift=(3, 40, 1.5), canary=(1, 20, 5))
    rep = scan(root)
    assert [s.subject for s in rep.suspects] == ["device 1", "device 3"]
    ev = rep.suspects[0].evidence[0]
    assert (ev.check, ev.first_step, ev.last_step) == ("canary", 20, 75)
    assert "12 of 16 canaries" in ev.detail
    scan_mod.write_suspects(rep)
    run = load_run(root)
    assert run.suspects == {1, 3} and run.quarantine == frozenset()
    infos = [DeviceInfo(i) for i in range(6)]
    assert [d.id for d in select_devices("suspect", infos, run.held_suspect)] == [1, 3]
    assert [d.id for d in select_devices("good", infos, run.held_suspect)] == [0, 2, 4, 5]


def test_non_finite_gradients_name_the_device_or_the_run(tmp_path):
    rep = scan(make_run(str(tmp_path / "r"), nonfinite=[(40, 3), (41, 3), (60, "all")]))
    by = {s.subject: s for s in rep.suspects}
    assert by["device 3"].first_step == 40 and by["device 3"].evidence[0].check == "nonfinite"
    assert by["run"].evidence[0].check == "nonfinite" and by["run"].first_step == 60
    assert "every device" in by["run"].evidence[0].detail
    assert rep.suspect_devices == [3]  # a divergence of every device is not one device's fault


def test_router_breaches_per_layer_after_warm_up(tmp_path):
    rep = scan(make_run(str(tmp_path / "r"), router_bad=[(5, 0), (15, 1), (16, 1), (30, 1)]))
    assert [s.subject for s in rep.suspects] == ["layer 1"]  # step 5 is in the warm-up
    ev = rep.suspects[0].evidence[0]
    assert (ev.first_step, ev.last_step) == (15, 30) and "3 of 70 steps" in ev.detail
    assert "12.50x uniform; shares in [0.0833, 0.7500] (within 3x of uniform 1/4)" in ev.detail
    assert rep.suspect_devices == []


def test_the_share_band_of_a_small_run_is_widened_by_its_rows_and_never_below_the_dead_floor(tmp_path):
    """4 experts, 8 rows a step, a 5-step window: an expert at 0.044 of the assignments (5.68x under
    uniform) is what 40 rows give a balanced router by chance (3 sigma, sigma 0.068), not a fault; one at 0 is
    dead on any run."""
    lo, hi, rule = scan_mod.share_band(4, sc.RouterHealth(window_steps=5), 8)
    assert (round(lo, 4), round(hi, 4)) == (0.0125, 0.75) and "40-row window" in rule and "dead-expert floor" in rule
    assert scan_mod.share_band(4, sc.RouterHealth(), None)[:2] == (1 / 12, 0.75)  # no row count: the band alone
    assert scan_mod.share_band(4, sc.RouterHealth(window_steps=8), 8)[0] == pytest.approx(0.25 - 3.5 * (
        0.25 * 0.75 / 64) ** 0.5)  # between the dead floor and the band: the rows' own spread
    assert scan_mod.share_band(4, sc.RouterHealth(window_steps=50), 8)[0] == 1 / 12  # a long window: the band

    def low(root, share):
        path = os.path.join(root, "signals.jsonl")
        rows = [json.loads(x) for x in open(path)]
        with open(path, "w") as f:
            for r in rows:
                if r["step"] >= 20:
                    r["router"][1]["expert_share"] = [share, 0.3, 0.35, 0.35 - share]
                f.write(json.dumps(proto.seal(r)) + "\n")  # as its writer would have sealed it
        return root

    small = {"global_batch": 8, "router_health": {"warmup_steps": 10, "window_steps": 5}}
    assert scan(low(make_run(str(tmp_path / "a"), steps=40, config=small), 0.044)).checks["router"]["status"] == "clear"
    bare = {"router_health": {"warmup_steps": 10, "window_steps": 5}}  # no global_batch: the band alone
    assert [s.subject for s in scan(low(make_run(str(tmp_path / "b"), steps=40, config=bare), 0.044)).suspects] == [
        "layer 1"]
    dead = scan(low(make_run(str(tmp_path / "c"), steps=40, config=small), 0.0))
    assert [(s.subject, s.first_step) for s in dead.suspects] == [("layer 1", 24)]  # its 5-step window all dead


def test_the_expert_load_check_says_why_its_figures_are_missing(tmp_path):
    a2a = scan(make_run(str(tmp_path / "a"), steps=20, config={"model": {"dispatch": "all_to_all"}}))
    assert "model.dispatch is all_to_all, but its trainer logged no expert-load" in a2a.checks["expert_load"]["detail"]
    gather = scan(make_run(str(tmp_path / "g"), steps=20, config={"model": {"n_experts": 4}}))
    assert "model.dispatch is gather, not all_to_all" in gather.checks["expert_load"]["detail"]


def test_loss_spikes_unless_an_event_explains_them(tmp_path):
    rep = scan(make_run(str(tmp_path / "a"), loss_spike=50))
    assert [(s.subject, s.first_step) for s in rep.suspects] == [("run", 50)]
    explained = scan(make_run(str(tmp_path / "b"), loss_spike=50, events=[{"event": "phase_change", "step": 50}]))
    assert explained.suspects == [] and explained.explained[0]["explained_by"] == "phase_change"


def test_loader_stalls_above_the_budget_but_not_at_the_start(tmp_path):
    rep = scan(make_run(str(tmp_path / "a"), waits=[(0, 2.0), (20, 0.2), (21, 0.3)]))
    assert [s.subject for s in rep.suspects] == ["loader"]
    assert (rep.suspects[0].first_step, rep.suspects[0].evidence[0].last_step) == (20, 21)
    few = scan(make_run(str(tmp_path / "b"), waits=[(0, 2.0), (20, 0.06)]))  # under 5% of 8 s of steps
    assert few.suspects == [] and "1 waiting step(s)" in few.checks["loader_stall"]["detail"]


def test_steps_limit_the_findings_but_history_still_counts(tmp_path):
    root = make_run(str(tmp_path / "r"), canary=(2, 10, 5), drift=(0, 50, 1.6))
    assert [s.subject for s in scan(root, 60, 80).suspects] == ["device 2", "device 0"]
    assert [s.subject for s in scan(root, 0, 30).suspects] == ["device 2"]  # the drift starts later
    with pytest.raises(Exception, match=r"outside the logged steps 0:80"):
        scan(root, 100, 120)


def test_thresholds_come_from_the_run_config(tmp_path):
    root = make_run(str(tmp_path / "r"), router_bad=[(15, 1)], config={"router_health": {"max_share_ratio": 20}})
    assert scan(root).suspects == []
    bad = make_run(str(tmp_path / "b"), config={"screening": {"cusum_h": -1}})
    with pytest.raises(Exception, match=r"screening.cusum_h: must be > 0"):
        scan(bad)


# ----------------------------------------------------------------------------- command line


def test_cli_exit_codes_outputs_and_refusals(tmp_path, capsys):
    clean = make_run(str(tmp_path / "clean"))
    assert main(["scan", "--run", clean]) == 0
    out = capsys.readouterr().out
    assert "CLEAN (exit code 0)" in out and "suspects.json" in out
    assert json.loads(open(os.path.join(clean, "suspects.json")).read())["suspect_devices"] == []
    bad = make_run(str(tmp_path / "bad"), drift=(1, 30, 1.5))
    js, png = str(tmp_path / "scan.json"), str(tmp_path / "scan.png")
    assert main(["scan", "--run", bad, "--json", js, "--plot", png]) == 8
    out = capsys.readouterr().out
    assert "SUSPECTS (exit code 8): device 1" in out and f"next: replay --run {bad} --steps" in out
    report = json.loads(open(js).read())
    assert report["suspects"][0]["rank"] == 1 and report["suspect_devices"] == [1]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["scan", "--run", bad, "--steps", "9:3"]) == 2
    assert main(["scan", "--run", bad, "--json", os.path.join(bad, "signals.jsonl")]) == 2
    assert main(["scan", "--run", str(tmp_path / "nope")]) == 5
    with open(os.path.join(bad, "signals.jsonl"), "a") as f:
        f.write('{"step": 80, "lo')  # a torn last line: skipped
    assert main(["scan", "--run", bad]) == 8
    with open(os.path.join(bad, "signals.jsonl"), "a") as f:
        f.write('ss"}\n{"step": 81}\n')  # now a malformed line inside the file
    assert main(["scan", "--run", bad]) == 5
    assert "signals.jsonl" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real short runs


def test_scan_of_the_shared_killed_and_resumed_run(run_dir):
    """The replay tests' run: 4 replicas, 12 steps, killed after step 5 and resumed."""
    rep = scan_mod.scan_run(load_run(run_dir))
    assert rep.suspect_devices == []
    assert rep.checks["canary"]["status"] == "not available"
    assert rep.checks["nonfinite"]["status"] == "clear"
    assert "4 replicas, 12 steps" in rep.checks["norm_drift"]["detail"]
    sig = proto.read_signals(run_dir)
    assert sorted(sig) == list(range(12))  # once per step across the kill


@pytest.fixture(scope="module")
def drill_run(tmp_path_factory):
    """A 40-step run of the tiny model on 8 devices with a periodic canary, checkpoints every 20."""
    from replay.verify import engine
    from replay.reference import run as runm
    from replay.reference import loop
    from replay.reference.testing import write_tiny_run

    folder = tmp_path_factory.mktemp("drill_run")
    path = write_tiny_run(str(folder), seq_len=64, global_batch=16, rows={"a": 300, "b": 150}, checkpoint_every=20,
                          phases=(), model={"d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 8, "n_experts": 4,
                                            "top_k": 2, "d_ff": 32, "capacity_factor": 2.0},
                          extra={"canary_every": 5})
    cfg = runm.load_run_config(path)
    trainer, mesh, _ = runm.make_trainer(cfg)
    run_dir = str(folder / "run")
    loop.train(run_dir, cfg, 40, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    run = load_run(run_dir)
    import dataclasses

    return engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=trainer))


@pytest.mark.parametrize("scenario,kw", [("drift", {"magnitude": 1.0, "start": 22}), ("flip", {"start": 25, "bit": 30}),
                                         ("canary", {"start": 23})])
def test_screening_drills_name_the_device_and_first_step(drill_run, tmp_path, scenario, kw):
    from replay import drill

    res = drill.run_scenario(drill_run, scenario, str(tmp_path / scenario), rng=random.Random(7), device=5, **kw)
    assert res.caught, (res.named, res.scan["suspects"])
    assert res.named["devices"] == [5]
    want = {"drift": 22, "flip": 25, "canary": 25}[scenario]
    assert abs(res.named["first_step"] - want) <= res.tolerance
    assert drill.judge_scan(res.scan, scenario, 6, want, res.tolerance) is False  # another device would not pass


def test_drill_command_runs_a_scenario(drill_run, tmp_path, capsys, monkeypatch):
    import dataclasses

    from replay.verify import engine

    monkeypatch.setattr(engine, "default_setup", lambda run: dataclasses.replace(drill_run.setup))
    out = str(tmp_path / "drills")
    code = main(["drill", "--run", drill_run.run.run_dir, "--scenario", "canary", "--device", "2", "--step", "21",
                 "--to-disk", out, "--json", str(tmp_path / "d.json")])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "drill canary on device 2 from step 25: caught" in text and os.path.isdir(os.path.join(out, "canary-0"))
    assert json.loads((tmp_path / "d.json").read_text())["caught"] == 1


def test_a_canary_line_whose_checksum_was_removed_names_no_device(drill_run, tmp_path, capsys):
    """canary.jsonl: one line set to differs_from_golden and its crc32 removed (the other lines sealed) named
    that device a suspect (scan exit 8); now it is a damaged line, exit 5."""
    import shutil

    from replay import cli
    from replay.run.codes import ExitCode

    run = str(tmp_path / "run")
    shutil.copytree(drill_run.run.run_dir, run)
    path = os.path.join(run, "canary.jsonl")
    lines = [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]
    lines[-2]["status"] = "differs_from_golden"
    del lines[-2][proto.LINE_CHECK]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, sort_keys=True) + "\n" for d in lines)
    assert cli.main(["scan", "--run", run]) == ExitCode.RUN_ERROR
    err = "".join(capsys.readouterr().err.split())
    # its run's env.json says every line is sealed (step_log_check): the message says so
    assert "itcarriesnocrc32whereitsrun'swritersealedeveryline" in err
    assert not os.path.exists(os.path.join(run, "suspects.json")) or \
        json.load(open(os.path.join(run, "suspects.json"))).get("suspect_devices") in ([], None)
