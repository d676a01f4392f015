"""The reference MoE decoder: document isolation, routing and capacity, losses, config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replay.reference import model as m
from replay.reference.testing import packed_batch, random_batch, tiny_model_config

V, S = 128, 24
_moe = jax.jit(m._moe, static_argnums=3)
_local_loss = jax.jit(m.local_loss, static_argnums=2)


@pytest.fixture(scope="module")
def setup():
    # capacity_factor = E / R: capacity C = S, so no token is dropped and documents cannot
    # compete for expert slots (with a smaller capacity they can: a documented MoE property).
    cfg = tiny_model_config(V, capacity_factor=2.0)
    params = m.init_params(cfg, jax.random.key(0))
    fwd = jax.jit(lambda p, b: m.forward(p, b, cfg))
    return cfg, params, fwd


def test_packed_documents_do_not_attend_to_each_other(setup):
    cfg, params, fwd = setup
    rng = np.random.default_rng(0)
    doc1, doc2, doc3 = (rng.integers(1, V, n).tolist() for n in (9, 8, 5))
    base = packed_batch([[doc1, doc2, doc3]], S)
    changed = packed_batch([[rng.integers(1, V, 9).tolist(), doc2, doc3]], S)
    assert not np.array_equal(base["inputs"], changed["inputs"])
    la, _ = fwd(params, {k: jnp.asarray(v) for k, v in base.items()})
    lb, _ = fwd(params, {k: jnp.asarray(v) for k, v in changed.items()})
    la, lb = np.asarray(la), np.asarray(lb)
    first = base["inputs_segmentation"][0] == 1
    later = base["inputs_segmentation"][0] >= 2
    assert later.sum() == 11
    # later documents: bit-identical logits; the first document's own logits did change
    assert la[0, later].view(np.uint32).tolist() == lb[0, later].view(np.uint32).tolist()
    assert not np.array_equal(la[0, first], lb[0, first])


def test_same_document_alone_or_packed_gives_identical_logits(setup):
    """A document's logits do not depend on its neighbours, only on its own tokens."""
    cfg, params, fwd = setup
    rng = np.random.default_rng(1)
    doc1, doc2 = rng.integers(1, V, 10).tolist(), rng.integers(1, V, 7).tolist()
    packed = packed_batch([[doc1, doc2]], S)
    alone = packed_batch([[doc2]], S)  # doc2 at slot 0, position 0 as in the packed row
    lp, _ = fwd(params, {k: jnp.asarray(v) for k, v in packed.items()})
    la, _ = fwd(params, {k: jnp.asarray(v) for k, v in alone.items()})
    n = len(doc2) - 1
    np.testing.assert_allclose(np.asarray(lp)[0, 9:9 + n], np.asarray(la)[0, :n], rtol=1e-5, atol=1e-5)


def test_attention_mask_exact():
    seg = jnp.asarray([[1, 1, 2, 2, 0]])
    got = np.asarray(m.attention_mask(seg))[0].astype(int)
    assert got.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0],
    ]


def _moe_inputs(cfg, seq_len, valid_len):
    D = cfg.d_model
    p = {"router": jnp.zeros((D, cfg.n_experts)).at[:, 0].set(2.0).at[:, 1].set(1.0),
         "w_in": jnp.ones((cfg.n_experts, D, cfg.d_ff)) * 0.01, "w_out": jnp.ones((cfg.n_experts, cfg.d_ff, D)) * 0.01}
    x = jnp.ones((1, seq_len, D)) * 0.1
    valid = jnp.arange(seq_len)[None] < valid_len
    return p, x, valid


@pytest.mark.parametrize("capacity_factor,valid_len", [(0.25, 16), (0.5, 16), (2.0, 16), (0.25, 3)])
def test_capacity_drops_exactly_the_overflow(capacity_factor, valid_len):
    """Every token routes to experts 0 and 1; each keeps C of them, in position order."""
    cfg = tiny_model_config(V, capacity_factor=capacity_factor)
    seq = 16
    C = cfg.capacity(seq)
    assert C == max(1, math.ceil(capacity_factor * seq * 2 / 4))
    p, x, valid = _moe_inputs(cfg, seq, valid_len)
    y, stats = _moe(p, x, valid, cfg)
    kept = min(C, valid_len)
    assert float(stats["dropped"]) == 2 * (valid_len - kept)
    assert np.asarray(stats["assigned"]).tolist() == [valid_len, valid_len, 0, 0]
    y = np.asarray(y)[0]
    assert np.all(np.abs(y[:kept]).sum(-1) > 0)
    assert np.all(y[kept:] == 0.0)  # dropped (or padding) tokens get no expert output


def test_aux_and_z_loss_values_for_a_uniform_router():
    cfg = tiny_model_config(V, capacity_factor=2.0)
    p, x, valid = _moe_inputs(cfg, 8, 8)
    p["router"] = jnp.zeros_like(p["router"])
    _, stats = _moe(p, x, valid, cfg)
    # probs = 1/4 each; ties go to experts 0 and 1: f = [1/2, 1/2, 0, 0]; lb = 4 * 2 * (1/2 * 1/4) = 1
    assert float(stats["lb_sum"]) == pytest.approx(1.0, rel=1e-6)
    assert float(stats["z_sum"]) == pytest.approx(8 * math.log(4) ** 2, rel=1e-5)
    assert float(stats["entropy_sum"]) == pytest.approx(8 * math.log(4), rel=1e-5)


def test_loss_ignores_padding_targets(setup):
    cfg, params, _ = setup
    b = random_batch(0, 2, S, V)
    assert (b["targets_segmentation"] == 0).any()
    b2 = {k: v.copy() for k, v in b.items()}
    b2["targets"][b["targets_segmentation"] == 0] = 7
    f = jax.jit(lambda p, bb: m.local_loss(p, bb, cfg, m.count_target_tokens(bb), 2.0)[0])
    assert float(f(params, b)) == float(f(params, b2))


def test_local_losses_sum_to_the_global_loss(setup):
    cfg, params, _ = setup
    b = {k: jnp.asarray(v) for k, v in random_batch(2, 4, S, V).items()}
    n = m.count_target_tokens(b)
    whole = float(_local_loss(params, b, cfg, n, 4.0)[0])
    parts = sum(float(_local_loss(params, {k: v[i:i + 1] for k, v in b.items()}, cfg, n, 4.0)[0]) for i in range(4))
    assert parts == pytest.approx(whole, rel=1e-5)


def test_bfloat16_parameters_run():
    cfg = tiny_model_config(V, param_dtype="bfloat16")
    params = m.init_params(cfg, jax.random.key(0))
    assert params["layers"][0]["w_in"].dtype == jnp.bfloat16
    b = {k: jnp.asarray(v) for k, v in random_batch(3, 2, S, V).items()}
    logits, _ = jax.jit(m.forward, static_argnums=2)(params, b, cfg)
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"top_k": 5}, r"top_k: must be an int in \[1, n_experts=4\], got 5"),
        ({"head_dim": 7}, r"head_dim: must be an even int >= 2, got 7"),
        ({"capacity_factor": 0}, r"capacity_factor: must be > 0, got 0"),
        ({"param_dtype": "float16"}, r"param_dtype: must be 'float32' or 'bfloat16', got 'float16'"),
    ],
)
def test_config_errors_name_field_value_and_range(kwargs, match):
    with pytest.raises(m.ModelConfigError, match=match):
        tiny_model_config(V, **kwargs)


def test_unknown_model_key_is_refused():
    with pytest.raises(m.ModelConfigError, match="unknown keys \\['n_layer'\\]"):
        m.ModelConfig.from_dict({"vocab_size": 10, "n_layer": 2})
