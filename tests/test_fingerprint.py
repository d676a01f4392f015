"""Gradient fingerprints (replay.run.fingerprint) and the environment record (replay.run.env)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replay.run import env as envm
from replay.run import fingerprint as fpm

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
BITS = {"float32": 32, "bfloat16": 16}


def _array(seed, shape, dtype):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])


@pytest.fixture(scope="module")
def fp_jit():
    return jax.jit(fpm.fingerprint)


def test_pinned_golden_values():
    """Guards the formula against silent change: values computed once (by the plain-Python
    formula below, the NumPy twin and the jnp version alike) and pinned. A change of these
    values is a new formula: bump FINGERPRINT_VERSION with it."""
    assert fpm.FINGERPRINT_VERSION == 2
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    assert fpm.fingerprint_np(x).tolist() == np.asarray(fpm.fingerprint(jnp.asarray(x))).tolist()
    assert fpm.fingerprint_hex(fpm.fingerprint_np(x)) == GOLDEN_F32
    assert fpm.fingerprint_hex(fpm.fingerprint_np(x.astype(ml_dtypes.bfloat16))) == GOLDEN_BF16
    assert fpm.fingerprint_hex(fpm.fingerprint_np(np.arange(10, dtype=np.int32))) == GOLDEN_I32
    assert _py_fingerprint_hex(x.reshape(-1).view(np.uint32).tolist()) == GOLDEN_F32
    assert _py_fingerprint_hex(x.astype(ml_dtypes.bfloat16).reshape(-1).view(np.uint16).tolist()) == GOLDEN_BF16
    assert _py_fingerprint_hex(list(range(10))) == GOLDEN_I32


# Version 2 (version 1, fmix32-based, gave b1b8fa8b7edbaa42, e57faf6c542647ab, 59a9c32055fc8f62).
GOLDEN_F32 = "3029a6db017d5db6"
GOLDEN_BF16 = "098eae9c4cbd0524"
GOLDEN_I32 = "24d82f7ab6ad8de9"
_M32 = 0xFFFFFFFF


def _py_xs(h, s):
    return h ^ (h >> s)


def _py_terms(w, i):
    """The module docstring's formula for one element, in Python ints."""
    k, m1, m2, b, m3 = fpm.MIX_CONSTANTS
    a = _py_xs((_py_xs(w ^ ((i * k) & _M32), 16) * m1) & _M32, 15)
    return _py_xs((a * m2) & _M32, 16), _py_xs(((a ^ b) * m3) & _M32, 16)


def _py_fingerprint_hex(bits):
    lanes = [sum(t) & _M32 for t in zip(*(_py_terms(w, i) for i, w in enumerate(bits)))]
    return f"{(lanes[1] << 32) | lanes[0]:016x}"


def test_formula_written_out_in_plain_python():
    """The docstring formula, element by element in Python ints, equals both implementations."""
    x = np.array([[1.5, -2.0, 3.25], [0.0, -0.0, 1e-30]], np.float32)
    lanes = [0, 0]
    for i, w in enumerate(x.reshape(-1).view(np.uint32).tolist()):
        m0, m1 = _py_terms(w, i)
        lanes[0] += m0
        lanes[1] += m1
    lanes = [v & _M32 for v in lanes]
    assert fpm.fingerprint_np(x).tolist() == [*lanes, 0, 0]
    assert np.asarray(fpm.fingerprint(jnp.asarray(x))).tolist() == [*lanes, 0, 0]


def test_each_term_is_a_bijection_of_the_bit_pattern():
    """For a fixed index, w -> m_0 and w -> m_1 are one-to-one: checked exhaustively on two
    slices of 2^16 patterns (low half varying, then high half varying) at four indices; the
    proof for all 2^32 patterns is in the module docstring."""
    lo = np.arange(1 << 16, dtype=np.uint32)
    for i in (0, 1, 12345, 2**32 - 1):
        for w in (lo, (lo << np.uint32(16)) | np.uint32(0x3F80)):
            terms = [_np_terms(w, i)[lane] for lane in (0, 1)]
            assert [len(np.unique(t)) for t in terms] == [1 << 16, 1 << 16]


def _np_terms(w, i):
    k, m1, m2, b, m3 = (np.uint32(c) for c in fpm.MIX_CONSTANTS)
    with np.errstate(over="ignore"):
        u = w ^ np.uint32((i * int(k)) & _M32)
        a = u ^ (u >> np.uint32(16))
        a = a * m1
        a = a ^ (a >> np.uint32(15))
        p, q = a * m2, (a ^ b) * m3
    return p ^ (p >> np.uint32(16)), q ^ (q >> np.uint32(16))


def test_equal_bit_flips_in_two_elements_do_not_cancel():
    """The same bit flipped in two elements (two sign flips, two exponent flips, ...) always
    changes the fingerprint here. With a multiply-only mix, m = (w XOR key) * M, a flip of bit
    31 moves each term by exactly 2^31 (odd M), and two of them cancel in the sum: the case
    a leading xorshift exists for. 100 random pairs per bit, a fixed seed."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(4096).astype(np.float32)
    x[::7] = 0.0  # zeros are common in gradients
    base = fpm.fingerprint_int(fpm.fingerprint_np(x))
    changed = 0
    for bit in range(32):
        for _ in range(100):
            e1, e2 = rng.choice(x.size, 2, replace=False)
            y = x.view(np.uint32).copy()
            y[[e1, e2]] ^= np.uint32(1 << bit)
            changed += fpm.fingerprint_int(fpm.fingerprint_np(y.view(np.float32))) != base
    assert changed == 3200


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_jnp_equals_numpy_twin(fp_jit, shape, dtype, seed):
    x = _array(seed, shape, dtype)
    np.testing.assert_array_equal(np.asarray(fp_jit(jnp.asarray(x))), fpm.fingerprint_np(x))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**31 - 1))
def test_any_single_bit_flip_changes_both_lanes(fp_jit, data, dtype, seed):
    shape = data.draw(st.lists(st.integers(1, 16), min_size=1, max_size=3).map(tuple))
    x = _array(seed, shape, dtype)
    element = data.draw(st.integers(0, x.size - 1))
    bit = data.draw(st.sampled_from([0, 1, BITS[dtype] - 1]) | st.integers(0, BITS[dtype] - 1))
    before = np.asarray(fp_jit(jnp.asarray(x)))
    flipped = np.asarray(fpm.flip_bit(jnp.asarray(x), element, bit, True))
    # exactly that bit of that element changed
    u = np.uint16 if dtype == "bfloat16" else np.uint32
    diff = flipped.view(u).reshape(-1) ^ x.view(u).reshape(-1)
    intended = x.reshape(-1).view(u).copy()
    intended[element] ^= u(1 << bit)
    if np.isnan(intended.view(x.dtype)[element]) and dtype != "float32":
        # A flip that makes a 16-bit NaN: XLA:CPU may not keep a NaN's payload bits (seen: a
        # bfloat16 signalling NaN 0x7F95 came back as 0x7F80); the element still changed.
        assert diff[element] != 0 and not np.delete(diff, element).any()
    else:
        assert diff.tolist() == [(1 << bit) if i == element else 0 for i in range(x.size)]
    after = np.asarray(fp_jit(jnp.asarray(flipped)))
    assert before[0] != after[0] and before[1] != after[1]
    np.testing.assert_array_equal(after, fpm.fingerprint_np(flipped))


def test_lowest_mantissa_bit_of_every_element_is_seen(fp_jit):
    """Exhaustive over one leaf: flipping bit 0 of any element changes the fingerprint."""
    x = _array(3, (7, 9), "float32")
    base = fpm.fingerprint_np(x)
    flat = x.reshape(-1).view(np.uint32)
    for e in range(x.size):
        y = flat.copy()
        y[e] ^= 1
        assert fpm.fingerprint_int(fpm.fingerprint_np(y.view(np.float32).reshape(x.shape))) != fpm.fingerprint_int(base)


def test_disabled_flip_is_identity():
    x = _array(5, (33,), "bfloat16")
    y = np.asarray(fpm.flip_bit(jnp.asarray(x), 4, 15, False))
    assert y.view(np.uint16).tolist() == x.view(np.uint16).tolist()


def test_swapping_two_elements_changes_it():
    x = _array(1, (64,), "float32")
    y = x.copy()
    y[[3, 40]] = y[[40, 3]]
    assert fpm.fingerprint_int(fpm.fingerprint_np(x)) != fpm.fingerprint_int(fpm.fingerprint_np(y))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), cuts=st.lists(st.integers(0, 200), max_size=6),
       order=st.randoms(use_true_random=False))
def test_blocks_in_any_order_add_up_to_the_whole(seed, n, cuts, order):
    """Summing the per-element contributions in another grouping/order gives the same value."""
    x = _array(seed, (n,), "float32")
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    parts = [fpm.fingerprint_np(x[a:b], global_shape=(n,), offsets=(a,)) for a, b in zip(bounds, bounds[1:])]
    order.shuffle(parts)
    np.testing.assert_array_equal(fpm.add_fingerprints(*parts), fpm.fingerprint_np(x))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 100), chunks=st.integers(1, 9))
def test_flat_chunks_padded_add_up(seed, n, chunks):
    x = _array(seed, (n,), "float32")
    c = -(-n // chunks)
    flat = np.pad(x, (0, c * chunks - n))
    f = jax.jit(fpm.fingerprint_flat_chunk, static_argnums=2)
    parts = [np.asarray(f(jnp.asarray(flat[i * c:(i + 1) * c]), jnp.int32(i * c), n)) for i in range(chunks)]
    np.testing.assert_array_equal(fpm.add_fingerprints(*parts), fpm.fingerprint_np(x))


@pytest.mark.parametrize("spec", [P("a", "b"), P("b", "a"), P(("a", "b"), None), P(None, ("b", "a")), P("a", None)])
def test_device_partials_psum_to_global_under_any_sharding(spec):
    """Inside shard_map, each device fingerprints its block with global indices; psum == global."""
    mesh = Mesh(np.asarray(sorted(jax.devices(), key=lambda d: d.id)).reshape(4, 2), ("a", "b"))
    x = _array(11, (8, 16), "float32")
    xs = jax.device_put(x, NamedSharding(mesh, spec))

    def per_device(block):
        offsets = []
        for dim, axes in enumerate(spec):
            axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
            lin = 0
            for a in axes:
                lin = lin * mesh.shape[a] + jax.lax.axis_index(a)
            offsets.append(lin * block.shape[dim])
        part = fpm.fingerprint(block, global_shape=x.shape, offsets=offsets)
        # only devices holding distinct blocks count: divide out replication by masking
        used = set(a for axes in spec if axes is not None for a in (axes if isinstance(axes, tuple) else (axes,)))
        keep = jnp.bool_(True)
        for a in mesh.axis_names:
            if a not in used:
                keep = keep & (jax.lax.axis_index(a) == 0)
        return jax.lax.psum(jnp.where(keep, part, jnp.zeros_like(part)), mesh.axis_names)

    out = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False))(xs)
    np.testing.assert_array_equal(np.asarray(out), fpm.fingerprint_np(x))


def test_nan_and_inf_counted():
    x = np.array([1.0, np.nan, np.inf, -np.inf, np.nan, 0.0], np.float32)
    fp = fpm.fingerprint_np(x)
    assert fp[2:].tolist() == [2, 2]
    np.testing.assert_array_equal(np.asarray(fpm.fingerprint(jnp.asarray(x))), fp)
    assert fpm.summarize(fp)["nan"] == 2 and fpm.summarize(fp)["inf"] == 2


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_nan_and_inf_counted_from_the_bits_on_every_path(dtype):
    """The jnp version counts from the exponent bits; NumPy's isnan/isinf agree, for every
    float dtype, NaN payload and sign, on the whole array, row blocks and padded chunks."""
    bits = {np.float32: 32, ml_dtypes.bfloat16: 16, np.float16: 16}[dtype]
    u = np.uint32 if bits == 32 else np.uint16
    x = np.linspace(-3, 3, 60).astype(dtype)
    big = float(ml_dtypes.finfo(dtype).max)
    specials = [np.inf, -np.inf, np.nan, -np.nan, big, -big]
    x[[3, 10, 11, 20, 30, 31]] = np.array(specials, np.float32).astype(dtype)
    payload = x.view(u).copy()
    payload[40] = u(payload[10] | 1)  # -Inf with the lowest mantissa bit set: a NaN of another payload
    x = payload.view(dtype).reshape(6, 10)
    fp = fpm.fingerprint_np(x)
    assert fp[2:].tolist() == [3, 2]
    np.testing.assert_array_equal(np.asarray(fpm.fingerprint(jnp.asarray(x))), fp)
    f = jax.jit(fpm.fingerprint_row_block, static_argnums=2)
    for n_blocks in (1, 4, 6, 7):
        parts = [np.asarray(f(jnp.asarray(x), jnp.int32(k), n_blocks)) for k in range(n_blocks)]
        np.testing.assert_array_equal(fpm.add_fingerprints(*parts), fp)
    flat = np.pad(x.reshape(-1), (0, 4))
    g = jax.jit(fpm.fingerprint_flat_chunk, static_argnums=2)
    parts = [np.asarray(g(jnp.asarray(flat[i:i + 16]), jnp.int32(i), x.size)) for i in range(0, 64, 16)]
    np.testing.assert_array_equal(fpm.add_fingerprints(*parts), fp)
    assert np.asarray(fpm.fingerprint(jnp.asarray(x), counts=False))[2:].tolist() == [0, 0]


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(fpm.FingerprintDtypeError, match="int8"):
        fpm.fingerprint(jnp.zeros(3, jnp.int8))
    with pytest.raises(TypeError, match="float64"):
        fpm.fingerprint_np(np.zeros(3, np.float64))


def test_environment_record_and_compare():
    mesh = Mesh(np.asarray(sorted(jax.devices(), key=lambda d: d.id)).reshape(4, 2), ("data", "expert"))
    rec = envm.record_environment(mesh)
    assert rec["versions"]["jax"] == jax.__version__
    assert rec["backend"]["device_count"] == 8 and rec["backend"]["platform"] == "cpu"
    assert rec["mesh"] == {
        "axis_names": ["data", "expert"], "shape": [4, 2], "device_ids": list(range(8)),
        "device_coords": {str(i): {"data": i // 2, "expert": i % 2} for i in range(8)},
    }
    assert "jax_enable_x64" in rec["jax_config"] and "jax_default_prng_impl" in rec["jax_config"]
    assert "XLA_FLAGS" in rec["env"]
    assert rec["versions"]["fingerprint"] == fpm.FINGERPRINT_VERSION
    assert envm.compare_environment(rec, rec) == []
    other = {**rec, "versions": {**rec["versions"], "jax": "0.0.1"}, "hostname": "elsewhere",
             "mesh": {**rec["mesh"], "device_ids": list(reversed(range(8)))}}
    diffs = envm.compare_environment(rec, other)
    assert any(d.startswith("versions.jax: recorded") and "'0.0.1'" in d for d in diffs)
    assert any(d.startswith("mesh.device_ids") for d in diffs)
    assert any(d.startswith("note: hostname") for d in diffs)
    assert len(diffs) == 3


def test_pin_determinism_flags_appends_once():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert envm.pin_determinism_flags(environ) == ["--xla_gpu_deterministic_ops=true"]
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true"
    assert envm.pin_determinism_flags(environ) == []
    mine = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    assert envm.pin_determinism_flags(mine) == [] and mine["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"


@settings(max_examples=10, deadline=None)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), n_blocks=st.integers(1, 9),
       seed=st.integers(0, 2**31 - 1))
def test_row_blocks_add_up_to_the_whole(shape, n_blocks, seed):
    x = _array(seed, shape, "float32")
    x.reshape(-1)[seed % x.size] = np.nan
    f = jax.jit(fpm.fingerprint_row_block, static_argnums=2)
    parts = [np.asarray(f(jnp.asarray(x), jnp.int32(k), n_blocks)) for k in range(n_blocks)]
    np.testing.assert_array_equal(fpm.add_fingerprints(*parts), fpm.fingerprint_np(x))
    assert fpm.add_fingerprints(*parts)[2] == 1


def test_version_mismatch_says_which_versions_and_what_to_do():
    assert fpm.version_mismatch({"versions": {"fingerprint": fpm.FINGERPRINT_VERSION}}) is None
    old = fpm.version_mismatch({"versions": {"jax": "0.10.2"}})
    assert "version 1 of the formula" in old and "absent: logged before fingerprints were versioned" in old
    assert f"this code computes version {fpm.FINGERPRINT_VERSION}" in old
    assert "Replay this run with the toolkit release that trained it, a release from before fingerprint versions" in old
    newer = fpm.version_mismatch({"versions": {"fingerprint": 3}})
    assert "version 3 of the formula" in newer and "a release whose replay/run/fingerprint.py has FINGERPRINT_VERSION = 3" \
        in newer and "absent" not in newer
    assert fpm.version_mismatch({}) is not None and fpm.version_mismatch({"versions": [1]}) is not None


@pytest.mark.parametrize("recorded", [1, None])
def test_replay_refuses_a_run_logged_with_another_fingerprint_version(tmp_path, recorded):
    """Comparing fingerprints of two formulas would convict every device: replay_range refuses
    before any device work, even with allow_env_drift or a tolerance, naming env.json (the CLI
    exits RUN_ERROR on a RunDirError). A stand-in session over a run log with nothing but its env
    record: the refusal reads only that, and the shared trained run stays out of this module."""
    import types

    from replay.verify import engine
    from replay.run.runlog import RunDirError, RunLog

    versions = {"jax": jax.__version__} if recorded is None else {"fingerprint": recorded}
    run = RunLog(run_dir=str(tmp_path), config={}, env={"versions": versions}, events=[], fingerprints={},
                 relogged_conflicts=[], checkpoints=[], quarantine=frozenset())
    session = types.SimpleNamespace(run=run, setup=None)
    for kwargs in ({}, {"allow_env_drift": True}, {"tolerance": 1e-3}):
        with pytest.raises(RunDirError) as err:
            engine.replay_range(session, 0, 1, **kwargs)
        msg = str(err.value)
        assert msg.startswith(f"{tmp_path}/env.json: the run logged fingerprints with version 1 of the formula")
        assert f"this code computes version {fpm.FINGERPRINT_VERSION}" in msg
