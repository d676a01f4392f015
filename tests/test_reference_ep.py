"""Expert parallelism in the reference trainer (``model.dispatch: all_to_all``) and the verdicts that
still name the one faulty device when the all-to-alls spread its error (issue 18).

One module-scoped run: the tiny model with 4 experts on a ``{data: 2, expert: 4}`` mesh of the 8 CPU
devices (one expert per device), drop-free capacity, balanced (aux loss, loss-free bias), 40 steps
(killed after step 24 and resumed from checkpoint 20), checkpoints every 10, a canary every 5 steps.
"""

import dataclasses
import json
import os
import random
import re

import jax
import numpy as np
import pytest

from replay.reference.model import FAULT_LEN
from replay.reference.testing import random_batch, tiny_model_config, write_tiny_run
from replay.reference.trainer import ReferenceTrainer, make_mesh
from replay.run.codes import Verdict
from replay.run.protocol import FaultSpec, read_fingerprints, read_signals, send_sites_in_program_order
from replay.verify import compare

EP_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 8, "n_experts": 4, "top_k": 2, "d_ff": 32,
            "capacity_factor": 2.0, "aux_loss_weight": 0.1, "router_bias_rate": 0.02, "dispatch": "all_to_all"}
MESH = {"data": 2, "expert": 4}


@pytest.fixture(scope="module")
def pair():
    """(gather trainer, all-to-all trainer, mesh, state of each from one seed, a fixed batch)."""
    mesh = make_mesh(MESH)
    cfg = tiny_model_config(n_experts=8, capacity_factor=4.0)  # C = S: nothing can drop
    tg, ta = ReferenceTrainer(cfg), ReferenceTrainer(dataclasses.replace(cfg, dispatch="all_to_all"))
    return tg, ta, mesh, tg.init_state(mesh, 0), ta.init_state(mesh, 0), random_batch(0, 8, 32, 128)


def test_all_to_all_agrees_with_gather_on_a_fixed_batch(pair):
    tg, ta, mesh, sg, sa, batch = pair
    for x, y in zip(jax.tree_util.tree_leaves(sg), jax.tree_util.tree_leaves(sa)):  # same initial state
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    _, red_g, fp_g = tg.device_contributions(sg, batch, 0)
    _, red_a, fp_a = ta.device_contributions(sa, batch, 0)
    assert fp_g.router["dropped_fraction"] == fp_a.router["dropped_fraction"] == 0.0
    assert fp_g.router["expert_share"] == fp_a.router["expert_share"]  # same routing, bit for bit
    loss = [compare.f32(f.loss_bits) for f in (fp_g, fp_a)]
    assert loss[1] == pytest.approx(loss[0], rel=1e-6)
    for (path, g), a in zip(jax.tree_util.tree_flatten_with_path(red_g)[0], jax.tree_util.tree_leaves(red_a)):
        g, a = np.asarray(g), np.asarray(a)
        scale = float(np.max(np.abs(g))) or 1.0
        assert np.max(np.abs(g - a)) <= 1e-5 * scale, jax.tree_util.keystr(path)  # float32 rounding
    assert fp_a.send_sites == send_sites_in_program_order(2) and not fp_g.send_sites


def _all_gather_shapes(trainer, mesh, state, batch):
    fn = trainer._step_fn(mesh, batch["inputs"].shape[0])
    sh = trainer.batch_sharding(mesh)
    text = fn.lower(state, {k: jax.device_put(v, sh) for k, v in batch.items()}, np.zeros(FAULT_LEN, np.int32),
                    np.zeros(4, np.float32)).compile().as_text()
    return {tuple(int(n) for n in dims.split(",") if n) for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", text)}


def test_expert_weights_and_moments_are_never_gathered(pair):
    _, ta, mesh, _, sa, batch = pair
    expert_shapes = {tuple(x.shape) for p, x in zip(ta.leaf_paths, jax.tree_util.tree_leaves(sa["params"]))
                     if p.endswith("['w_in']") or p.endswith("['w_out']")}
    gathered = _all_gather_shapes(ta, mesh, sa, batch)
    assert gathered and not expert_shapes & gathered  # the step's all-gathers: fingerprints and scalars only
    new, _ = ta.train_step(sa, batch, 0)
    for tree in (new["params"], new["opt_state"]):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if tuple(x.shape) in expert_shapes:  # parameters and AdamW moments stay split over 'expert'
                assert x.sharding.spec[0] == "expert", jax.tree_util.keystr(path)
                assert {s.data.shape[0] for s in x.addressable_shards} == {x.shape[0] // 4}


def test_two_runs_and_a_fresh_compile_are_bit_identical(pair):
    _, ta, mesh, _, sa, batch = pair
    _, a = ta.train_step(sa, batch, 3)
    _, b = ta.train_step(sa, batch, 3)
    _, c = ReferenceTrainer(ta.model).train_step(sa, batch, 3)
    assert a.bits_equal(b) and a.bits_equal(c) and a.sends == c.sends and len(a.sends[0]) == 8
    assert len(set(a.sends[0])) == 8  # every site's buffer has its own fingerprint


def test_fingerprints_and_send_fingerprints_do_not_change_the_update(pair):
    _, ta, mesh, _, sa, batch = pair
    plain = ReferenceTrainer(ta.model, fingerprints=False)
    a, _ = ta.train_step(sa, batch, 2)
    b, fp = plain.train_step(sa, batch, 2)
    assert not fp.sends and fp.signals is None
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


def test_signals_reconcile_and_count_the_tokens_each_expert_device_received(pair):
    _, ta, mesh, _, sa, batch = pair
    _, fp = ta.train_step(sa, batch, 0)
    sig = fp.signals
    assert sum(r.dot for r in sig.replicas) == pytest.approx(sig.grad_norm ** 2, rel=1e-4)
    assert len(sig.expert_load) == 2
    routed = int(np.sum(batch["inputs_segmentation"] != 0))
    for layer, load in zip(sig.router, sig.expert_load):
        assert sorted(load.received) == list(range(8)) and layer.dropped_fraction == 0.0
        # each of a token's top-2 assignments is received by exactly one expert device
        assert sum(load.received.values()) == 2 * routed
        vals = list(load.received.values())
        assert load.max_over_mean == pytest.approx(max(vals) / (sum(vals) / len(vals)))


def test_localization_of_each_fault_kind_on_one_step(pair):
    """Faults planted inside one device's computation: the first divergent buffer names it alone, even
    when its error reached the other devices of its expert group within the step."""
    _, ta, mesh, _, sa, batch = pair
    _, clean = ta.train_step(sa, batch, 5)
    ident = {d: d for d in clean.devices}
    sizes = ta.fault_sizes(mesh, 8, 32)
    seg = batch["inputs_segmentation"]
    row, pos = np.argwhere(seg[2:3] != 0)[5]  # device 2's first row, a token that is not padding
    cases = [
        (FaultSpec(5, 2, "", (row * 32 + pos) * 32 + 3, 22, where="attention", layer=1), "layer1.dispatch.forward"),
        (FaultSpec(5, 6, "", 123, 26, where="expert_forward", layer=0), "layer0.combine.forward"),
        (FaultSpec(5, 1, "['layers'][0]['w_out']", 17, 3, where="expert_backward"), "local_gradient"),
        (FaultSpec(5, 7, "['layers'][1]['wq']", 5, 0), "local_gradient"),
    ]
    for fault, site in cases:
        _, bad = ta.train_step(sa, batch, 5, fault)
        diff = compare.compare_step(bad, clean, ident)
        assert diff.localization.site == site and diff.suspects == (fault.device_id,), (fault, diff.localization)
        div = diff.divergence()
        assert div.devices == (fault.device_id,) and div.site == site
    # the attention fault reached its whole expert group (devices 0-3), through what device 2 sent
    _, bad = ta.train_step(sa, batch, 5, cases[0][0])
    diff = compare.compare_step(bad, clean, ident)
    assert diff.localization.reached == (0, 1, 2, 3) and set(diff.devices) == {0, 1, 2, 3}
    assert sizes["expert_forward"] == 4 * 2 * 1 * 32 * 32 and sizes["attention"] == 32 * 32  # [X, E/X, B, C, D]


def test_bad_in_computation_faults_are_clear_errors(pair):
    _, ta, mesh, _, sa, batch = pair
    from replay.reference.trainer import FaultSpecError

    with pytest.raises(FaultSpecError, match="expert weight"):
        ta.train_step(sa, batch, 0, FaultSpec(0, 1, "['layers'][0]['wq']", 0, 0, where="expert_backward"))
    with pytest.raises(FaultSpecError, match=r"outside \[0, 2\)"):
        ta.train_step(sa, batch, 0, FaultSpec(0, 1, "", 0, 0, where="attention", layer=2))
    with pytest.raises(FaultSpecError, match="element"):
        ta.train_step(sa, batch, 0, FaultSpec(0, 1, "", 10 ** 9, 0, where="expert_forward", layer=0))
    with pytest.raises(FaultSpecError, match="element"):  # an expert leaf's local shard is 1/4 of it
        n = ta.leaf_sizes[ta.leaf_paths.index("['layers'][0]['w_in']")]
        ta.train_step(sa, batch, 0, FaultSpec(0, 1, "['layers'][0]['w_in']", n // 4, 0))
    with pytest.raises(ValueError, match="layer"):
        FaultSpec(0, 1, "", 0, 0, where="attention")


def test_run_config_refuses_experts_that_do_not_split(tmp_path):
    from replay.reference import run as runm

    path = write_tiny_run(str(tmp_path), mesh={"data": 2, "expert": 4}, model={**EP_MODEL, "n_experts": 6})
    with pytest.raises(runm.RunConfigError, match="n_experts 6 must divide by the mesh's expert axis size 4"):
        runm.load_run_config(path)


# ----------------------------------------------------------------------------- a trained run


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """(session, trainer, mesh, cfg, folder) of the module docstring's run."""
    from replay.reference import run as runm
    from replay.reference import loop
    from replay.run.runlog import load_run
    from replay.verify import engine

    folder = tmp_path_factory.mktemp("ep_run")
    path = write_tiny_run(str(folder), seq_len=32, global_batch=16, rows={"a": 300, "b": 150}, checkpoint_every=10,
                          phases=(), mesh=MESH, model=EP_MODEL,
                          extra={"canary_every": 5, "router_health": {"window_steps": 10}})
    cfg = runm.load_run_config(path)
    trainer, mesh, _ = runm.make_trainer(cfg)
    run_dir = str(folder / "run")
    loop.train(run_dir, cfg, 25, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None, plot=False))
    import shutil

    shutil.rmtree(os.path.join(run_dir, "checkpoints", "25"))  # killed before checkpoint 25 committed:
    loop.train(run_dir, cfg, 40, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None, plot=False))  # resumed from 20
    run = load_run(run_dir)
    session = engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=trainer))
    return session, trainer, mesh, cfg, folder


def test_resume_gives_the_uninterrupted_runs_fingerprints(ep_run):
    from replay.reference import loop

    session, trainer, mesh, cfg, folder = ep_run
    straight = str(folder / "straight")
    loop.train(straight, cfg, 40, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None, plot=False))
    a = open(os.path.join(session.run.run_dir, "fingerprints.jsonl"), "rb").read()
    b = open(os.path.join(straight, "fingerprints.jsonl"), "rb").read()
    assert a == b and b.count(b"\n") == 40
    assert [e["step"] for e in session.run.events_of("restore")] == [20]
    line = read_fingerprints(straight)[33]
    assert line.send_sites == send_sites_in_program_order(2) and sorted(line.sends) == list(range(8))


def test_replay_on_another_placement_reproduces_the_log(ep_run):
    from replay.verify import engine
    from replay.verify.verdict import Evidence

    session = ep_run[0]
    rep = engine.replay_range(session, 31, 34, device_spec="all")
    assert rep.verdict is Verdict.ACQUITTED
    exact, rotated = rep.replays
    assert exact.assignment == tuple(range(8)) and rotated.assignment != exact.assignment
    assert {d.evidence for d in rotated.diffs} == {Evidence.PER_SHARD} and all(d.ok for d in rotated.diffs)


@pytest.mark.parametrize("where,seed", [("expert_forward", 1), ("expert_forward", 2), ("expert_backward", 3),
                                        ("attention", 4), ("attention", 5), ("local_gradient", 6)])
def test_each_drill_kind_convicts_the_faulty_device_alone(ep_run, where, seed):
    from replay import drill

    session = ep_run[0]
    rng = random.Random(seed)
    fault = drill.random_fault(session, rng, step=rng.choice([30, 31, 32]), where=where,
                               bit=rng.randrange(20, 31) if where == "attention" else None)
    res = drill.run_drill(session, fault, canary=False)
    d = res.range_report.decision
    assert res.convicted_ok and d.devices == (fault.device_id,) and d.step == fault.step, (fault, d)
    assert res.site_ok, (fault, d.site, drill.expected_site(fault))
    out = res.range_report.to_dict()
    assert out["first_divergent_site"]["site"] == drill.expected_site(fault)
    if where != "local_gradient" and where != "expert_backward":
        assert out["first_divergent_site"]["layer"] == fault.layer
    else:
        assert out["first_divergent_site"]["layer"] == int(fault.leaf.split("]")[1].strip("["))


def test_drill_command_takes_where(ep_run, capsys, monkeypatch, tmp_path):
    from replay.cli import main
    from replay.verify import engine

    session = ep_run[0]
    monkeypatch.setattr(engine, "default_setup", lambda run: dataclasses.replace(session.setup))
    code = main(["drill", "--run", session.run.run_dir, "--where", "expert_forward", "--layer", "1", "--step", "31",
                 "--device", "5", "--seed", "3", "--json", str(tmp_path / "d.json"), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "first divergent buffer: layer1.combine.forward" in text and "NOT where planted" not in text
    got = json.loads((tmp_path / "d.json").read_text())["drills"][0]
    assert got["fault"]["where"] == "expert_forward" and got["site_as_planted"] is True


def test_expert_load_is_logged_and_judged_by_scan(ep_run, tmp_path):
    import shutil

    import yaml

    from replay.run.runlog import load_run
    from replay.screen.scan import scan_run

    session = ep_run[0]
    sig = read_signals(session.run.run_dir)
    assert all(len(s.expert_load) == 2 and len(s.expert_load[0].received) == 8 for s in sig.values())
    rep = scan_run(session.run)
    assert rep.checks["expert_load"]["status"] == "clear" and "limit 2x" in rep.checks["expert_load"]["detail"]
    from replay import report

    fig = report.scan_figure(rep)  # the board's expert-load row, between the router's and the loader's
    assert len(fig.axes) >= 6 and any(ax.get_title().startswith("expert load (clear)") for ax in fig.axes)
    worst = max(s.expert_load[0].max_over_mean for k, s in sig.items() if k >= 10)
    # the same logs against a limit under the layer's worst load: the layer is named, with its device
    low = str(tmp_path / "low")
    shutil.copytree(session.run.run_dir, low)
    raw = yaml.safe_load(open(os.path.join(low, "run_config.yaml")))
    raw["router_health"] = {**raw.get("router_health", {}), "max_expert_load_ratio": 1.0, "window_steps": 1}
    yaml.safe_dump(raw, open(os.path.join(low, "run_config.yaml"), "w"))
    rep = scan_run(load_run(low))
    assert rep.checks["expert_load"]["status"] == "found" and worst > 1.0
    layer = [s for s in rep.suspects if s.kind == "layer" and any(e.check == "expert_load" for e in s.evidence)]
    assert layer and not layer[0].devices and "received" in layer[0].evidence[-1].detail
    assert rep.suspect_devices == []  # a load imbalance is the router's, not a device's fault


def test_drift_on_an_expert_device_is_named_by_scan(ep_run, tmp_path):
    """Replica-norm screening under expert parallelism: each device's local contribution (its rows'
    gradient of the replicated weights, and its experts' shard) is one replica, but it moves with anything
    its expert group computes (the devices it exchanges tokens with), so a drift of device 6's contribution
    is named as its group (data replica 1: devices 4-7), and the periodic canary, whose program computes
    the same drifting local gradient on device 6, names device 6 alone."""
    from replay import drill

    session = ep_run[0]
    res = drill.run_scenario(session, "drift", str(tmp_path / "drift"), rng=random.Random(7), device=6,
                             magnitude=1.0, start=22)
    assert res.caught, (res.named, res.scan["suspects"])
    by = {tuple(s["devices"]): [e["check"] for e in s["evidence"]] for s in res.scan["suspects"]
          if s["kind"] in ("device", "replica")}
    assert by[(6,)] == ["canary"] and "norm_drift" in by[(4, 5, 6, 7)], by
    assert res.scan["suspect_devices"] == [4, 5, 6, 7] and res.resolution == ((2, 6), (4, 5, 6, 7))


def test_canary_under_expert_parallelism_names_a_faulty_device(ep_run):
    session, trainer, mesh, cfg, _ = ep_run
    from replay.run.protocol import read_canary

    assert {c.status for c in read_canary(session.run.run_dir)} == {"ok"}
    params = trainer.init_params(mesh, 1234)
    batch = {k: v[:1] for k, v in session.numpy_batch(0, tuple(range(8))).items()}
    fps = trainer.canary_fingerprints(params, batch, FaultSpec(0, 3, "['layers'][0]['w_in']", 4, 7))
    sig = {d: json.dumps(v, sort_keys=True) for d, v in fps.items()}
    assert len({sig[d] for d in sig if d != 3}) == 1 and sig[3] != sig[0]


# ----------------------------------------------------------------------------- issue 27: an honest fault campaign


def _unmasked_drill(ctx, rng, site, persistence="once", tries=20):
    """Drills at ``site`` with every field (magnitude class included: bits 0-31 and the scales) drawn from
    ``rng`` until one is not masked; each masked one on the way must be shown bit-identical."""
    from replay.verify import faults as fm

    for _ in range(tries):
        mags = [m for m in fm.MAGNITUDES if site != "host_batch" or m in fm.BIT_CLASSES]
        fault = fm.draw_fault(ctx.session, rng, site, rng.choice(mags), persistence)
        row = fm.run_fault_drill(ctx, fault, segment=1 if persistence == "once" else 2, screening=False,
                                 canary=False)
        if row["outcome"] != "masked":
            return row
        assert row["shown_identical"] is True, row
    raise AssertionError(f"{site}: {tries} drills in a row were masked")


@pytest.mark.parametrize("site,seed", [(s, 2700 + i) for i, s in enumerate((
    "ffn_up", "ffn_down", "ffn_up_grad_input", "ffn_up_grad_weight", "ffn_down_grad_input", "ffn_down_grad_weight",
    "attn_scores", "attn_probs", "attn_pv", "router_logits", "transit_dispatch", "transit_combine",
    "transit_dispatch_grad", "transit_combine_grad", "host_batch"))])
def test_each_site_inside_the_computation_convicts_through_replay(ep_run, site, seed):
    from replay.verify import faults as fm

    row = _unmasked_drill(fm.DrillContext(ep_run[0]), random.Random(seed), site)
    assert row["outcome"] == "right_alone", row
    if site.startswith("transit"):
        assert row["finding"] == "link" and row["devices"] == [] and row["links"] == row["expected"]["links"], row
    elif site == "host_batch":
        assert row["cause"] == "data_order" and row["devices"] == [], row
    else:
        assert row["devices"] == [row["fault"]["device"]] and row["finding"] in ("sent", "local_gradient"), row


def test_a_transit_fault_names_the_link_and_neither_chip(ep_run, capsys, monkeypatch, tmp_path):
    from replay.cli import main
    from replay.verify import engine

    session = ep_run[0]
    monkeypatch.setattr(engine, "default_setup", lambda run: dataclasses.replace(session.setup))
    # device 5 = (data 1, expert 1) receives part 3 of its combine buffer from device 7 = (data 1, expert 3)
    shape = ep_run[1].activation_shapes(MESH, 16, 32)["transit_combine"]  # [X=4, E/X=1, B=2, C=32, D=32]
    part = int(np.prod(shape[1:]))  # elements per part
    code = main(["drill", "--run", session.run.run_dir, "--where", "transit_combine", "--layer", "0", "--step", "30",
                 "--device", "5", "--element", str(3 * part + 17), "--bit", "4", "--no-canary",
                 "--json", str(tmp_path / "d.json"), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    got = json.loads((tmp_path / "d.json").read_text())["drills"][0]["range"]
    assert got["convicted_links"] == [[7, 5]] and got["convicted_devices"] == [] and got["exit_code"] == 23
    assert got["cause"] == "link_fault" and "7 -> 5" in got["explanation"]


def test_an_optimizer_update_fault_is_named_by_certify_at_the_next_save_even_in_a_tie(ep_run):
    """Device 2's copy of an expert leaf's Adam moment (its twin, device 6, holds the other copy: two copies, no
    majority) flipped after step 33's update: the state record of the save at 40 names neither copy, and
    certify's replay of 30:40 on another placement tells which one is wrong (before, the lower id won ties)."""
    from replay.verify import faults as fm

    fault = fm.Fault(site="optimizer_update", device=2, start=33, element=5, bit=21, magnitude="high_mantissa",
                     leaf="['opt_state'][1][0].mu['layers'][1]['w_out']")
    row = fm.run_fault_drill(fm.DrillContext(ep_run[0]), fault)
    assert row["judge"] == "certify" and row["checkpoint"] == 40, row
    assert row["outcome"] == "right_alone" and row["devices"] == [2] and row["leaf_named"], row
    assert row["detected"]["state_record"] and row["detected"]["certify"], row


def test_a_replay_on_another_mesh_shape_is_refused_before_any_work(ep_run):
    from replay.verify import compare, engine

    session = ep_run[0]
    other = dataclasses.replace(session.setup, shape=(4, 2))
    with pytest.raises(compare.PairingError, match=r"\{'data': 2, 'expert': 4\}.*\{'data': 4, 'expert': 2\}"):
        engine.replay_range(engine.Session(session.run, other), 30, 31, allow_env_drift=True)


def test_a_masked_fault_leaves_the_final_state_bit_identical(ep_run):
    from replay.verify import faults as fm

    # QK^T of query 0 against key 5 of row 0: causally masked, so no bit of anything can change
    fault = fm.Fault(site="attn_scores", device=3, start=30, element=5, layer=1, bit=30, magnitude="exponent",
                     persistence="every")
    row = fm.run_fault_drill(fm.DrillContext(ep_run[0]), fault, segment=2, screening=False, canary=False)
    assert row["outcome"] == "masked" and row["shown_identical"] is True and row["steps_trained"] == 2, row


def test_nan_and_scale_faults_and_the_expert_drift_signal(ep_run, tmp_path):
    from replay import drill
    from replay.run.protocol import FaultSpec

    session, trainer, mesh, _, _ = ep_run
    state = session.restore(30, session.home_assignment())
    batch = session.batch(30, session.home_assignment())
    _, clean = trainer.train_step(state, batch, 30)
    _, nan = trainer.train_step(state, batch, 30, FaultSpec(30, 2, "", 9, 0, where="ffn_up", layer=0, mode="set",
                                                            value=float("nan")))
    assert nan.signals.devices[2]["nonfinite"] and not clean.signals.devices[2]["nonfinite"]
    _, tiny = trainer.train_step(state, batch, 30, FaultSpec(30, 2, "", 9, 0, where="ffn_up", layer=0, mode="scale",
                                                             value=1.0))
    assert tiny.bits_equal(clean) and tiny.recvs == clean.recvs  # x 1 changes no bit
    # one expert device's experts' output x1.2 from step 22: replay scan names it by expert_drift, with its twin
    # (device 2 holds the same expert on the other data replica: two twins cannot be told apart), from the
    # step the probes first differ; the periodic canary (every 5 steps) names device 6 alone at the next one
    res = drill.run_scenario(session, "expert_drift", str(tmp_path / "ed"), rng=random.Random(2799), device=6,
                             magnitude=0.2, start=22)
    assert res.caught and not res.alone, res.scan["suspects"]
    by = {tuple(s["devices"]): s for s in res.scan["suspects"] if s["kind"] in ("device", "replica")}
    assert by[(2, 6)]["evidence"][0]["check"] == "expert_drift" and by[(2, 6)]["first_step"] == 22, by
    assert [e["check"] for e in by[(6,)]["evidence"]] == ["canary"] and by[(6,)]["first_step"] == 25, by
    assert all(6 in d for d in by), by  # no suspect of healthy devices only


def test_a_drifting_expert_device_is_named_by_the_periodic_canary(ep_run):
    """A device's persistent fault applies to every program that runs the faulty site on it: the canary's
    program computes every expert on every device, so an expert-output drift of x(1 + 1e-6) on device 3 (a
    float32 ulp is about 1.2e-7 relative) changes its canary checksum and no other device's."""
    from replay.run.protocol import DriftSpec, FaultSpec

    session, trainer, mesh, _, _ = ep_run
    params = trainer.init_params(mesh, 1234)
    batch = {k: v[:1] for k, v in session.numpy_batch(0, tuple(range(8))).items()}
    sig = {}
    for name, persistent in (("clean", None), ("drift", DriftSpec(3, 10, 1e-6, kind="expert_output")),
                             ("before", DriftSpec(3, 30, 1e-6, kind="expert_output")),
                             ("flip", FaultSpec(10, 3, "", 4, 30, where="ffn_up", layer=0))):
        fps = trainer.canary_fingerprints(params, batch, persistent=persistent, step=20)
        sig[name] = {d: json.dumps(v, sort_keys=True) for d, v in fps.items()}
    assert len(set(sig["clean"].values())) == 1
    assert {d for d in sig["drift"] if sig["drift"][d] != sig["clean"][d]} == {3}
    assert sig["before"] == sig["clean"]  # not active yet at step 20
    assert sig["flip"] == sig["clean"]  # a one-step bit flip of a training step is not a persistent fault
