"""The sharded, fingerprinted train step of the reference trainer (8 CPU devices)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from replay.run import fingerprint as fpm
from replay.run.protocol import DriftSpec, FaultSpec, StepFingerprints, StepSignals, Trainer
from replay.reference import checkpoint as ckpt
from replay.reference.testing import random_batch, tiny_model_config
from replay.reference.trainer import (
    FaultSpecError,
    OptimizerConfig,
    ReferenceTrainer,
    TrainerConfigError,
    device_rows,
    make_mesh,
)

V, S, B = 128, 32, 8


def _bits(tree):
    out = []
    for x in jax.tree_util.tree_leaves(jax.device_get(tree)):
        x = np.asarray(x)
        out.append(x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32).tobytes() if x.dtype.kind == "f"
                   else x.tobytes())
    return out


@pytest.fixture(scope="module")
def env():
    trainer = ReferenceTrainer(tiny_model_config(V), OptimizerConfig(warmup_steps=0))
    mesh = make_mesh({"data": 4, "expert": 2})
    state = trainer.init_state(mesh, seed=0)
    batch = random_batch(7, B, S, V)
    new_state, fp = trainer.train_step(state, batch, step=3)
    return trainer, mesh, state, batch, new_state, fp


def test_implements_the_protocol_and_shards_experts(env):
    trainer, mesh, state = env[:3]
    assert isinstance(trainer, Trainer)
    from jax.sharding import PartitionSpec as P

    layer = state["params"]["layers"][0]
    assert layer["w_in"].sharding.spec == P("expert") and layer["w_out"].sharding.spec == P("expert")
    assert layer["wq"].sharding.spec == P()
    mu = state["opt_state"][1][0].mu["layers"][0]["w_in"]  # clip_by_global_norm, then adamw's ScaleByAdamState
    assert mu.sharding.spec == P("expert")


def test_step_is_bit_deterministic(env):
    trainer, mesh, state, batch, new_state, fp = env
    again_state, again = trainer.train_step(state, batch, step=3)
    assert again.bits_equal(fp)
    assert _bits(again_state) == _bits(new_state)


def test_fingerprints_do_not_change_the_update(env):
    trainer, mesh, state, batch, new_state, fp = env
    plain = ReferenceTrainer(trainer.model, trainer.optimizer_config, fingerprints=False)
    plain_state, plain_fp = plain.train_step(state, batch, step=3)
    assert _bits(plain_state) == _bits(new_state)  # params and AdamW moments, bit for bit
    assert (plain_fp.loss_bits, plain_fp.grad_norm_bits, plain_fp.batch_hash) == (
        fp.loss_bits, fp.grad_norm_bits, fp.batch_hash)
    assert plain_fp.leaves == {} and plain_fp.devices == {}


def test_device_contributions_fingerprint_and_sum_to_the_step(env):
    """8-device run vs the sum of its per-device contributions."""
    trainer, mesh, state, batch, new_state, fp = env
    per_device, reduced, fp_c = trainer.device_contributions(state, batch, step=3)
    assert sorted(per_device) == sorted(fp.devices) == list(range(8))
    fp = fp_c
    for dev, grads in per_device.items():
        got = {p: fpm.fingerprint_int(fpm.fingerprint_np(g))
               for p, g in zip(trainer.leaf_paths, jax.tree_util.tree_leaves(grads))}
        assert got == fp.devices[dev]
    # the float sum of the contributions in device order is the reduced gradient, bit for bit
    order = [int(d.id) for d in mesh.devices.reshape(-1)]
    total = per_device[order[0]]
    for dev in order[1:]:
        total = jax.tree_util.tree_map(np.add, total, per_device[dev])
    summed = {p: fpm.summarize(fpm.fingerprint_np(g)) for p, g in zip(trainer.leaf_paths, jax.tree_util.tree_leaves(total))}
    assert summed == fp.leaves
    assert _bits(total) == _bits(reduced)


def test_device_coords_and_batch_hash(env):
    trainer, mesh, state, batch, new_state, fp = env
    assert fp.device_coords == {i: {"data": i // 2, "expert": i % 2} for i in range(8)}
    assert fp.batch_hash == fpm.fingerprint_hex(fpm.fingerprint_np(batch["inputs"]))
    assert device_rows(mesh, B) == {i: slice(i, i + 1) for i in range(8)}


def test_router_health_figures(env):
    fp = env[-1]
    r = fp.router
    assert sum(r["expert_share"]) == pytest.approx(1.0)
    assert len(r["expert_share"]) == 4
    assert 0.0 <= r["dropped_fraction"] < 1.0
    assert 0.0 < r["entropy"] <= np.log(4) + 1e-6
    assert r["z_loss"] > 0 and np.isfinite(r["loss"])
    assert np.float32(r["loss"]).view(np.uint32) == fp.loss_bits


def test_json_round_trip(env):
    fp = env[-1]
    back = StepFingerprints.from_json(fp.to_json())
    assert back == fp and back.bits_equal(fp)


def test_fault_flips_exactly_one_device_leaf_without_recompiling(env):
    trainer, mesh, state, batch, new_state, fp = env
    step_fn = trainer._step_fn(mesh, B)
    compiled_before = step_fn._cache_size()
    rng = np.random.default_rng(0)
    for i, leaf in enumerate(trainer.leaf_paths):
        device = int(rng.integers(0, 8))
        element = int(rng.integers(0, trainer.leaf_sizes[i]))
        bit = [0, 1, 22, 31][i % 4]  # lowest mantissa bit, exponent, sign among them
        fault = FaultSpec(step=3, device_id=device, leaf=leaf, element=element, bit=bit)
        _, hit = trainer.train_step(state, batch, step=3, fault=fault)
        for dev in range(8):
            for p in trainer.leaf_paths:
                same = hit.devices[dev][p] == fp.devices[dev][p]
                assert same == (not (dev == device and p == leaf)), (leaf, dev, p)
        assert hit.batch_hash == fp.batch_hash
    assert step_fn._cache_size() == compiled_before  # the fault is a traced input


def test_fault_at_another_step_does_nothing(env):
    trainer, mesh, state, batch, new_state, fp = env
    fault = FaultSpec(step=4, device_id=1, leaf=trainer.leaf_paths[0], element=0, bit=0)
    _, out = trainer.train_step(state, batch, step=3, fault=fault)
    assert out.bits_equal(fp)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"leaf": "['nope']"}, r"fault.leaf .\['nope'\]. is not a parameter leaf"),
        ({"element": 10**9}, r"fault.element 1000000000 outside \[0, "),
        ({"bit": 32}, r"fault.bit 32 outside \[0, 32\)"),
        ({"device_id": 99}, r"fault.device_id 99 not in the mesh's devices"),
    ],
)
def test_bad_fault_is_a_clear_error(env, change, match):
    trainer, mesh, state, batch, _, _ = env
    fault = dataclasses.replace(FaultSpec(step=3, device_id=0, leaf="['embed']", element=0, bit=0), **change)
    with pytest.raises(FaultSpecError, match=match):
        trainer.train_step(state, batch, step=3, fault=fault)


def test_single_device_fingerprints_for_canaries(env):
    trainer, mesh, state, batch, _, _ = env
    devs = sorted(jax.devices(), key=lambda d: d.id)
    a = trainer.single_device_fingerprints(state, batch, devs[0])
    b = trainer.single_device_fingerprints(state, batch, devs[5])
    assert a == b and sorted(a) == sorted(trainer.leaf_paths)
    leaf = "['layers'][1]['router']"
    fault = FaultSpec(step=0, device_id=5, leaf=leaf, element=3, bit=0)
    c = trainer.single_device_fingerprints(state, batch, devs[5], fault=fault)
    assert [p for p in a if a[p] != c[p]] == [leaf]
    assert trainer.single_device_fingerprints(state, batch, devs[0], fault=fault) == a  # not that device


def test_checkpoint_round_trip_resumes_bit_identically(env, tmp_path):
    trainer, mesh, state, batch, new_state, fp = env
    mngr = ckpt.manager(str(tmp_path))
    ckpt.save(mngr, 3, state, {"next_step": 3})
    mngr.wait_until_finished()
    mngr.close()
    assert ckpt.all_steps(str(tmp_path)) == [3]
    restored, loader_state = ckpt.restore(str(tmp_path), 3, trainer.abstract_state(mesh))
    assert loader_state == {"next_step": 3}
    assert _bits(restored) == _bits(state)
    _, again = trainer.train_step(restored, batch, step=3)
    assert again.bits_equal(fp)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint at step 4 .* present: \[3\]"):
        ckpt.restore(str(tmp_path), 4, trainer.abstract_state(mesh))


def test_bad_mesh_and_batch_are_clear_errors(env):
    trainer, mesh, state, batch, _, _ = env
    with pytest.raises(TrainerConfigError, match=r"use 6 devices, 8 available"):
        make_mesh({"data": 3, "expert": 2})
    with pytest.raises(TrainerConfigError, match=r"needs axis 'expert'"):
        make_mesh({"data": 8})
    with pytest.raises(ValueError, match=r"global batch 4 must be a multiple of the device count 8"):
        trainer.train_step(state, {k: v[:4] for k, v in batch.items()}, step=0)
    with pytest.raises(ValueError, match=r"batch lacks keys \['targets'\]"):
        trainer.train_step(state, {k: v for k, v in batch.items() if k != "targets"}, step=0)


def test_contributions_program_matches_the_step_here(env):
    """On this CPU build the extra outputs do not change the step's bits (not promised elsewhere)."""
    trainer, mesh, state, batch, new_state, fp = env
    _, _, fp_c = trainer.device_contributions(state, batch, step=3)
    assert fp_c.bits_equal(fp)


def test_bfloat16_parameters_train_and_take_16_bit_faults(env):
    trainer32, mesh, _, batch, _, _ = env
    trainer = ReferenceTrainer(tiny_model_config(V, param_dtype="bfloat16"), OptimizerConfig(warmup_steps=0))
    state = trainer.init_state(mesh, seed=0)
    new_state, fp = trainer.train_step(state, batch, step=0)
    assert new_state["params"]["embed"].dtype == jax.numpy.bfloat16
    assert np.isfinite(fp.router["loss"]) and all(v["nan"] == 0 and v["inf"] == 0 for v in fp.leaves.values())
    leaf = "['layers'][0]['w_out']"
    fault = FaultSpec(step=0, device_id=6, leaf=leaf, element=5, bit=15)  # the sign bit of a bfloat16
    _, hit = trainer.train_step(state, batch, step=0, fault=fault)
    assert [(d, p) for d in hit.devices for p in hit.devices[d] if hit.devices[d][p] != fp.devices[d][p]] == [(6, leaf)]
    with pytest.raises(FaultSpecError, match=r"fault.bit 16 outside \[0, 16\)"):
        trainer.train_step(state, batch, step=0, fault=dataclasses.replace(fault, bit=16))


# ----------------------------------------------------------------------------- screening signals


def test_signals_reconcile_with_the_contributions(env):
    """Per-device norms are those of the local contributions (before the reduction), the
    per-replica dots sum to the global norm squared, router shares sum to 1 per layer."""
    trainer, mesh, state, batch, new_state, fp = env
    per_device, reduced, fp_c = trainer.device_contributions(state, batch, step=3)
    sig = fp.signals
    assert sig is not None and sig.step == 3 and sig.loss == fp.router["loss"]
    assert [r.replica for r in sig.replicas] == list(range(8)) and [r.devices for r in sig.replicas] == [(i,) for i in range(8)]
    for r in sig.replicas:
        dev = r.devices[0]
        host = sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in jax.tree_util.tree_leaves(per_device[dev]))
        assert r.norm_sq == pytest.approx(host, rel=1e-5)
        assert sig.devices[dev]["norm_sq"] == r.norm_sq and sig.devices[dev]["nonfinite"] == {}
        dot = sum(float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))
                  for a, b in zip(jax.tree_util.tree_leaves(per_device[dev]), jax.tree_util.tree_leaves(reduced)))
        assert r.dot == pytest.approx(dot, rel=1e-4, abs=1e-9)
    # sum_r <g_r, g> = ||g||^2: the per-replica figures combine to the global norm
    assert sum(r.dot for r in sig.replicas) == pytest.approx(sig.grad_norm ** 2, rel=1e-5)
    assert np.float32(sig.grad_norm).view(np.uint32) == fp.grad_norm_bits
    # and the norms of the contributions are not the global norm's parts (cross terms): measured
    assert sum(r.norm_sq for r in sig.replicas) != pytest.approx(sig.grad_norm ** 2, rel=1e-3)
    assert len(sig.router) == trainer.model.n_layers
    for layer in sig.router:
        assert sum(layer.expert_share) == pytest.approx(1.0, abs=1e-12) and len(layer.expert_share) == 4
        assert 0 <= layer.dropped_fraction < 1 and 0 < layer.entropy <= np.log(4) + 1e-6
        assert layer.z_loss > 0 and layer.aux_loss > 0 and np.isfinite(layer.max_logit)
    # the per-layer figures add up to the step's aggregate ones
    agg = fp.router
    assert np.mean([r.z_loss for r in sig.router]) == pytest.approx(agg["z_loss"], rel=1e-6)
    assert np.mean([r.aux_loss for r in sig.router]) == pytest.approx(agg["load_balance_loss"], rel=1e-6)
    back = StepSignals.from_dict(json.loads(sig.to_json()))
    assert back == sig


def test_a_drift_scales_one_device_contribution_without_recompiling(env):
    trainer, mesh, state, batch, new_state, fp = env
    step_fn = trainer._step_fn(mesh, B)
    before = step_fn._cache_size()
    _, hit = trainer.train_step(state, batch, step=3, fault=DriftSpec(device_id=5, start=2, magnitude=0.25))
    base = {r.devices[0]: r.norm_sq for r in fp.signals.replicas}
    got = {r.devices[0]: r.norm_sq for r in hit.signals.replicas}
    assert got[5] == pytest.approx(base[5] * 1.25 ** 2, rel=1e-5)
    assert all(got[d] == base[d] for d in base if d != 5)  # the others' contributions, bit for bit
    assert [d for d in fp.devices if hit.devices[d] != fp.devices[d]] == [5]
    _, bias = trainer.train_step(state, batch, step=3, fault=DriftSpec(device_id=2, start=0, magnitude=0.5, kind="bias"))
    assert bias.signals.replicas[2].norm_sq > base[2] and bias.signals.replicas[3].norm_sq == base[3]
    _, late = trainer.train_step(state, batch, step=3, fault=DriftSpec(device_id=2, start=4, magnitude=0.5))
    assert late.bits_equal(fp)  # not active yet
    # a flip and a drift together, as a list (an intermittent fault plus a persistent one)
    flip = FaultSpec(step=3, device_id=1, leaf="['embed']", element=0, bit=30)
    _, both = trainer.train_step(state, batch, step=3, fault=[flip, DriftSpec(device_id=5, start=0, magnitude=0.25)])
    assert {d for d in fp.devices if both.devices[d] != fp.devices[d]} == {1, 5}
    assert step_fn._cache_size() == before
    with pytest.raises(FaultSpecError, match=r"at most one bit flip and one drift per step"):
        trainer.train_step(state, batch, step=3, fault=[flip, flip])


def test_canary_program_agrees_across_devices_and_names_a_faulty_one(env):
    trainer, mesh, state, batch, _, _ = env
    params = trainer.init_params(mesh, 1234)
    rows = {k: v[:1] for k, v in batch.items()}
    a = trainer.canary_fingerprints(params, rows)
    assert sorted(a) == list(range(8)) and len({json.dumps(v, sort_keys=True) for v in a.values()}) == 1
    assert trainer.canary_fingerprints(params, rows) == a  # across time
    leaf = "['layers'][0]['wq']"
    hit = trainer.canary_fingerprints(params, rows, FaultSpec(step=0, device_id=6, leaf=leaf, element=1, bit=0))
    assert [d for d in hit if hit[d] != a[d]] == [6] and [p for p in hit[6] if hit[6][p] != a[6][p]] == [leaf]


def test_public_functions_work_inside_the_runs_own_set_mesh(env, tmp_path):
    """google/orbax#3164-like: inside ``jax.set_mesh(mesh)`` shard_map refused a one-device mesh."""
    trainer, mesh, state, batch, new_state, fp = env
    devs = sorted(jax.devices(), key=lambda d: d.id)
    outside = trainer.single_device_fingerprints(state, batch, devs[2])
    mngr = ckpt.manager(str(tmp_path))
    ckpt.save(mngr, 3, state, {"next_step": 3})
    mngr.wait_until_finished()
    mngr.close()
    with jax.set_mesh(mesh):
        fresh = trainer.init_state(mesh, seed=0)
        assert _bits(fresh) == _bits(state)
        _, again = trainer.train_step(state, batch, step=3)
        assert again.bits_equal(fp)
        per, _, _ = trainer.device_contributions(state, batch, step=3)
        assert sorted(per) == list(range(8))
        assert trainer.single_device_fingerprints(state, batch, devs[2]) == outside
        assert trainer.local_gradients(state, batch, devs[3])[2] == outside
        assert len(trainer.canary_fingerprints(trainer.init_params(mesh, 1), {k: v[:1] for k, v in batch.items()})) == 8
        restored, _ = ckpt.restore(str(tmp_path), 3, trainer.abstract_state(mesh))
        assert _bits(restored) == _bits(state)
