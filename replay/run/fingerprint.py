"""Order-independent integer fingerprints of arrays (docs/design.md, "Gradient fingerprints").

A fingerprint says, in four integers, exactly which values an array (a gradient leaf, a
batch of tokens) held, so that two runs, two devices or a run and its replay compare bit
for bit, while the value does not depend on how the elements were sharded or in which
order a reduction visited them.

Formula (version :data:`FINGERPRINT_VERSION` = 2)
-------------------------------------------------
Legend: ``N`` is the number of elements of an array ``x`` of global shape ``S`` (any rank).
Element ``x[n]`` has the global row-major flat index ``i = sum_d n_d * stride_d(S)`` (taken
mod 2^32) and contributes, in uint32 arithmetic that wraps::

    w   = bit pattern of x[n] as uint32   (float32/int32/uint32: bitcast;
                                           bfloat16/float16: bitcast to uint16, zero-extended)
    u   = w XOR (i * K)                   the index key
    a   = xs15(xs16(u) * M1)              first round
    m_0 = xs16(a * M2)                    lane 0  (= lowbias32(u))
    m_1 = xs16((a XOR B) * M3)            lane 1  (second round with its own constants)

    with xs_s(h) = h XOR (h >> s)

    fp_L = ( sum over the N elements of m_L )  mod 2^32,   L in {0, 1}
    nan  = number of NaN elements,  inf = number of +-Inf elements

``K, M1, M2, B, M3`` are :data:`MIX_CONSTANTS`. The result is a ``uint32[4]`` array
``[fp_0, fp_1, nan, inf]``; ``(fp_1 << 32) | fp_0`` is the 64-bit fingerprint written to
logs (:func:`fingerprint_int`). Sources: ``xs16 / *M1 / xs15 / *M2 / xs16`` is
``lowbias32`` (C. Wellons, "Prospecting for Hash Functions", nullprogram.com, 2018;
github.com/skeeto/hash-prospector), a bijective 32-bit mixer found by search for the lowest
avalanche bias (0.17 in that measure: one flipped input bit flips each output bit with a
probability very close to 1/2);
``K = 0x9E3779B1 = 2654435761`` is the prime nearest 2^32/phi (Knuth's multiplicative
hashing, TAOCP vol. 3, 6.4; xxHash's ``PRIME32_1``); ``M3`` is xxHash's ``PRIME32_3``;
``B`` is the low word of splitmix64's ``0x9E3779B97F4A7C15``.
NaN and Inf are counted from the bits (exponent all ones; a NaN has a non-zero mantissa).

Cost: 14 uint32 operations per element for the two terms (4 multiplies), no 64-bit
arithmetic, in one fused, vectorized pass that reads every element once and writes no
temporary array: the lanes (and the non-finite count) are summed by one *variadic* reduce.
(XLA:CPU's tree-reduction rewrite turns a single-operand integer sum into a chain of
``reduce-window`` ops that first writes every term to memory, several times slower; it
leaves variadic reduces alone.)

Properties (each tested in ``tests/test_fingerprint.py``):

* For a fixed index ``i``, ``w -> m_0`` and ``w -> m_1`` are bijections of uint32, since
  each step is: XOR with a constant (its own inverse); multiplication by an odd constant
  (odd numbers are units mod 2^32); ``xs_s`` with ``s >= 1`` (the top ``s`` bits pass
  unchanged and each lower bit is recovered from those above it). So changing any one
  element, by any bit, moves both lanes' sums by a non-zero amount mod 2^32: it is never
  a "maybe".
* Integer addition mod 2^32 is associative and commutative, so the value does not depend on
  reduction order, and the fingerprints of disjoint shards (each using *global* indices)
  add up, lane by lane and count by count, mod 2^32, to the fingerprint of the whole array
  (:func:`add_fingerprints`; ``jax.lax.psum`` of ``uint32`` does the same inside
  ``shard_map``).
* Position: ``i -> i * K`` is a bijection mod 2^32 (``K`` odd), so every position has its
  own key, and a value moved to another position meets another key before the mixer; the
  sum is not XOR-only (which would be blind to order and to pairs of equal changes).
* Avalanche before and after each multiply: ``xs16`` first brings high bits down, which a
  multiply alone never does (with ``m = (w XOR key) * M`` a flip of bit 31 moves the term
  by exactly 2^31, and two sign flips cancel in the sum one time in four). The two lanes
  share the first round and differ in the second (constant ``B``, multiplier ``M3``), so
  neither term is an affine function of the other, and a change of several elements
  escapes only if it cancels in both sums.

Everything here is pure ``jax.numpy``/``jax.lax`` and works inside ``jax.jit`` and
``shard_map``; :func:`fingerprint_np` is the NumPy twin used on hosts and in tests. x64 mode
is not needed and not enabled.

Versions: 1 (no ``versions.fingerprint`` in a run's env.json) was
``m_0 = fmix32((w XOR (i*A))*C + i)``, ``m_1 = xs16((m_0 XOR B)*D)``; 2 is the formula above.
Values of different versions never compare (:func:`version_mismatch`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

FINGERPRINT_VERSION = 2
"""The formula's version, recorded as ``versions.fingerprint`` in a run's env.json (replay.run.env)."""

# (K, M1, M2, B, M3): odd multipliers K, M1, M2, M3; B arbitrary (module docstring).
MIX_CONSTANTS: tuple[int, int, int, int, int] = (0x9E3779B1, 0x7FEB352D, 0x846CA68B, 0x7F4A7C15, 0xC2B2AE3D)
FINGERPRINT_FIELDS = ("fp0", "fp1", "nan", "inf")

_SUPPORTED = ("float32", "bfloat16", "float16", "int32", "uint32")
# Per float dtype: (left shift that drops the sign bit and puts the exponent at the top of a
# uint32, exponent-all-ones threshold). Non-finite: shifted >= threshold; NaN: > threshold.
_NONFINITE_TEST = {"float32": (1, 0xFF000000), "bfloat16": (17, 0xFF000000), "float16": (17, 0xF8000000)}


class FingerprintDtypeError(TypeError):
    """The array's dtype has no fingerprint bit pattern (see ``_SUPPORTED``)."""


def version_mismatch(env: Mapping[str, Any]) -> Optional[str]:
    """Why fingerprints logged under the environment record ``env`` cannot be compared here.

    Args:
      env: a run's environment record (env.json, :func:`replay.run.env.record_environment`);
        ``versions.fingerprint`` absent means version 1 (runs logged before versioning).

    Returns:
      ``None`` when the run's fingerprint version is :data:`FINGERPRINT_VERSION`, otherwise a
      message that names both versions and says what to do.
    """
    versions = env.get("versions", {}) if isinstance(env, Mapping) else {}
    versions = versions if isinstance(versions, Mapping) else {}
    recorded = versions.get("fingerprint", 1)
    if recorded == FINGERPRINT_VERSION:
        return None
    release = ("from before fingerprint versions (its replay/run/fingerprint.py has no FINGERPRINT_VERSION)"
               if recorded == 1 else f"whose replay/run/fingerprint.py has FINGERPRINT_VERSION = {recorded!r}")
    return (f"the run logged fingerprints with version {recorded!r} of the formula (env.json versions.fingerprint"
            f"{'' if 'fingerprint' in versions else ' absent: logged before fingerprints were versioned'}), this "
            f"code computes version {FINGERPRINT_VERSION}: every leaf would differ whatever the hardware did. "
            f"Replay this run with the toolkit release that trained it, a release {release}; 'replay canary' "
            f"and 'replay inspect' compare no logged fingerprints and work as they are")


# ----------------------------------------------------------------------------- jnp


def _u32(v: int) -> jnp.ndarray:
    return jnp.uint32(v & 0xFFFFFFFF)


def _xs(h, s: int):
    return h ^ (h >> s)


def bit_pattern(x: jnp.ndarray) -> jnp.ndarray:
    """Returns the bit pattern of ``x`` as ``uint32`` of the same shape.

    Args:
      x: float32, bfloat16, float16, int32 or uint32 array.

    Raises:
      FingerprintDtypeError: any other dtype.
    """
    name = jnp.dtype(x.dtype).name
    if name in ("float32", "int32"):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if name == "uint32":
        return x
    if name in ("bfloat16", "float16"):
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    raise FingerprintDtypeError(f"cannot fingerprint dtype {name}; supported: {', '.join(_SUPPORTED)}")


def _strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc & 0xFFFFFFFF)
        acc *= int(n)
    return list(reversed(strides))


def global_index(local_shape: Sequence[int], global_shape: Sequence[int], offsets: Any = None) -> jnp.ndarray:
    """Returns uint32 global row-major flat indices (mod 2^32) of a block's elements.

    Args:
      local_shape: shape of the block (a device's shard).
      global_shape: shape of the whole array; same rank.
      offsets: per-dimension start of the block in the global array (ints or traced int
        scalars, e.g. ``jax.lax.axis_index(...) * block``); ``None``: all zero.

    Returns:
      uint32 array of ``local_shape``.

    Raises:
      ValueError: ranks differ.
    """
    local_shape, global_shape = tuple(local_shape), tuple(global_shape)
    if len(local_shape) != len(global_shape):
        raise ValueError(f"block rank {len(local_shape)} != global rank {len(global_shape)}")
    idx = jnp.zeros(local_shape, jnp.uint32)
    for d, stride in enumerate(_strides(global_shape)):
        coord = jax.lax.broadcasted_iota(jnp.uint32, local_shape, d)
        if offsets is not None:
            coord = coord + jnp.asarray(offsets[d]).astype(jnp.uint32)
        idx = idx + coord * _u32(stride)
    return idx


def fingerprint(
    x: jnp.ndarray, *, global_shape: Optional[Sequence[int]] = None, offsets: Any = None, counts: bool = True
) -> jnp.ndarray:
    """Returns the fingerprint ``uint32[4] = [fp_0, fp_1, nan, inf]`` of ``x`` (module formula).

    Args:
      x: float32, bfloat16, float16, int32 or uint32 array, any shape (a whole array, or one
        block of it when ``global_shape`` is given).
      global_shape: shape of the whole array ``x`` is a block of (default: ``x.shape``).
      offsets: per-dimension start of the block in the whole array (ints or traced
        scalars); default zeros.
      counts: also count NaN and Inf (``False``: those two fields are 0; a third summed
        lane, about a fifth more time on CPU; the trainer's per-device fingerprints skip it).

    Returns:
      uint32[4]. Fingerprints of disjoint blocks of one array add up (uint32 wrap) to the
      whole array's.

    Raises:
      FingerprintDtypeError: unsupported dtype.
    """
    if global_shape is None and offsets is None:
        idx = jax.lax.iota(jnp.uint32, x.size)
    else:
        idx = global_index(x.shape, x.shape if global_shape is None else global_shape, offsets).reshape(-1)
    return _reduce(x, _flatten, idx, None, counts)


def _flatten(v: jnp.ndarray) -> jnp.ndarray:
    return v.reshape(-1)


def _mix(w: jnp.ndarray, idx: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    k, m1, m2, b, m3 = (_u32(c) for c in MIX_CONSTANTS)
    a = _xs(_xs(w ^ (idx * k), 16) * m1, 15)
    return _xs(a * m2, 16), _xs((a ^ b) * m3, 16)


def _sum_lanes(*terms: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
    """Wrapping uint32 sums of 1-D ``terms`` (two or more, same length) in one fused pass."""
    zeros = tuple(jnp.uint32(0) for _ in terms)
    return tuple(jax.lax.reduce(terms, zeros, lambda p, q: tuple(s + t for s, t in zip(p, q)), (0,)))


def _reduce(src, read, idx, span=None, counts: bool = True) -> jnp.ndarray:
    """``[fp_0, fp_1, nan, inf]`` of the 1-D block ``flat = read(src)`` at global indices ``idx``.

    ``span = (lo, hi)`` (uint32 scalars): only flat positions ``lo <= j < hi`` count. One
    variadic reduce sums the lanes and, for floats with ``counts``, the non-finite count;
    NaNs and Infs are then counted apart (a second pass) only when that count is non-zero. The
    conditional's operand is ``src`` itself (an existing buffer), and the block and the mask
    are rebuilt inside it: an operand computed in the main pass would be written out first.
    """
    flat = read(src)

    def mask():
        if span is None:
            return None
        j = jax.lax.iota(jnp.uint32, flat.shape[0])
        return (j >= span[0]) & (j < span[1])

    w = bit_pattern(flat)
    m0, m1 = _mix(w, idx)
    zero = jnp.uint32(0)
    valid = mask()
    if valid is not None:
        m0, m1 = jnp.where(valid, m0, zero), jnp.where(valid, m1, zero)
    test = _NONFINITE_TEST.get(jnp.dtype(flat.dtype).name) if counts else None
    if test is None:
        fp0, fp1 = _sum_lanes(m0, m1)
        return jnp.stack([fp0, fp1, zero, zero])
    shift, threshold = test

    def flagged(v, kind):
        s = bit_pattern(v) << shift
        hit = {"nonfinite": s >= _u32(threshold), "nan": s > _u32(threshold), "inf": s == _u32(threshold)}[kind]
        inside = mask()
        return (hit if inside is None else hit & inside).astype(jnp.uint32)

    fp0, fp1, n_bad = _sum_lanes(m0, m1, flagged(flat, "nonfinite"))
    n_nan, n_inf = jax.lax.cond(n_bad > 0, lambda v: _sum_lanes(flagged(read(v), "nan"), flagged(read(v), "inf")),
                                lambda v: (zero, zero), src)
    return jnp.stack([fp0, fp1, n_nan, n_inf])


def fingerprint_flat_chunk(flat: jnp.ndarray, start: Any, total: int) -> jnp.ndarray:
    """Fingerprint of ``flat``, a contiguous chunk of a flattened array, masked past ``total``.

    Args:
      flat: 1-D chunk (possibly zero-padded past the array's end).
      start: global flat index of ``flat[0]`` (int or traced int32 scalar).
      total: number of elements of the whole array; chunk elements at ``>= total`` do not
        count.

    Returns:
      uint32[4]; summing the chunks' fingerprints gives ``fingerprint(array)``.
    """
    start = jnp.asarray(start, jnp.int32)
    idx = jax.lax.iota(jnp.uint32, flat.shape[0]) + start.astype(jnp.uint32)
    return _reduce(flat, _flatten, idx, (jnp.uint32(0), jnp.maximum(total - start, 0).astype(jnp.uint32)))


def fingerprint_row_block(x: jnp.ndarray, block_index: Any, n_blocks: int, *, counts: bool = True,
                          row_offset: Any = 0) -> jnp.ndarray:
    """Fingerprint of block ``block_index`` of ``n_blocks`` row blocks of ``x`` (global indices).

    Rows (first dimension, ``d0``) are split in ``n_blocks`` blocks of ``c = ceil(d0 / n_blocks)``
    rows; block ``k`` holds rows ``[k*c, min((k+1)*c, d0))`` (empty when ``k*c >= d0``). The
    block is read in place (``dynamic_slice`` of ``c`` rows), so no copy of ``x`` is made;
    its rows are contiguous in row-major order, so its elements' global indices are
    ``start * row_size + j`` for its flat position ``j``. When ``n_blocks`` does not divide
    ``d0`` the slice's start is clamped into range and the rows outside block ``k`` are
    masked. Summing the ``n_blocks`` results gives ``fingerprint(x)``: the trainer lets each
    device fingerprint one block of the reduced gradient and adds them with a ``psum``.

    Args:
      x: array of rank >= 1 (rank 0 is treated as shape ``(1,)``).
      block_index: int or traced int32 scalar in ``[0, n_blocks)``.
      n_blocks: number of blocks, >= 1.
      row_offset: when ``x`` is itself the row shard ``[row_offset, row_offset + d0)`` of a larger
        array (an expert-parallel weight's shard), its first row's index there (int or traced
        int32): the indices are then those of the larger array, and the blocks of all shards add
        up to its fingerprint.

    Returns:
      uint32[4].

    Raises:
      ValueError: ``n_blocks < 1``.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    if x.ndim == 0:
        x = x.reshape(1)
    d0 = x.shape[0]
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    c = -(-d0 // n_blocks)
    lo = jnp.asarray(block_index, jnp.int32) * c
    start = lo if d0 % n_blocks == 0 else jnp.clip(lo, 0, d0 - c)

    def read(v):
        return jax.lax.dynamic_slice_in_dim(v, start, c, axis=0).reshape(-1)

    first = start.astype(jnp.uint32) + jnp.asarray(row_offset).astype(jnp.uint32)
    idx = jax.lax.iota(jnp.uint32, c * row) + first * _u32(row)
    span = None
    if d0 % n_blocks:
        span = tuple((v - start).astype(jnp.uint32) * _u32(row) for v in (lo, jnp.minimum(lo + c, d0)))
    return _reduce(x, read, idx, span, counts)


def flip_bit(x: jnp.ndarray, element: Any, bit: Any, enabled: Any) -> jnp.ndarray:
    """Returns ``x`` with bit ``bit`` of flat element ``element`` flipped where ``enabled``.

    A fault injector for drills; all three controls may be traced, so one compiled step
    serves every drill. With ``enabled`` false the result is bit-identical to ``x``
    (XOR with 0). A flip that turns a 16-bit element into a NaN may come back as another NaN
    bit pattern (XLA:CPU does not keep NaN payloads of bfloat16/float16); the element still
    changes, which is all a drill needs.

    Args:
      x: float32/bfloat16/float16 array.
      element: flat (row-major) index into ``x``; clipped into range.
      bit: bit position, 0 = lowest mantissa bit; ``< 32`` (float32) or ``< 16`` (16-bit).
      enabled: bool or int scalar.
    """
    width = 16 if jnp.dtype(x.dtype).itemsize == 2 else 32
    utype = jnp.uint16 if width == 16 else jnp.uint32
    e = jnp.clip(jnp.asarray(element, jnp.int32), 0, max(x.size - 1, 0))
    mask = (jnp.asarray(enabled).astype(jnp.uint32) << jnp.asarray(bit).astype(jnp.uint32)).astype(utype)
    # In x's own shape (no reshape around the update), so that XLA updates the buffer in place.
    at = jnp.unravel_index(e, x.shape) if x.ndim else ()
    one = (1,) * x.ndim
    old = jax.lax.bitcast_convert_type(jax.lax.dynamic_slice(x, at, one), utype)
    return jax.lax.dynamic_update_slice(x, jax.lax.bitcast_convert_type(old ^ mask, x.dtype), at)


# ----------------------------------------------------------------------------- host side


def add_fingerprints(*fps: Any) -> np.ndarray:
    """Adds fingerprints (``uint32[4]`` each) lane by lane, mod 2^32: the shard combiner."""
    acc = np.zeros(4, np.uint64)
    for fp in fps:
        acc = (acc + np.asarray(fp, np.uint64)) & 0xFFFFFFFF
    return acc.astype(np.uint32)


def fingerprint_int(fp: Any) -> int:
    """The 64-bit value ``(fp_1 << 32) | fp_0`` of a ``uint32[4]`` fingerprint, for logs."""
    a = np.asarray(fp, np.uint64)
    return (int(a[1]) << 32) | int(a[0])


def fingerprint_hex(fp: Any) -> str:
    """``fingerprint_int`` as 16 hex digits."""
    return f"{fingerprint_int(fp):016x}"


def fingerprint_np(
    x: Any, *, global_shape: Optional[Sequence[int]] = None, offsets: Optional[Sequence[int]] = None
) -> np.ndarray:
    """NumPy twin of :func:`fingerprint` (same formula, same ``uint32[4]`` result).

    NaN and Inf are counted with ``np.isnan``/``np.isinf`` (the jnp version tests the bits),
    so the two implementations check each other.

    Args:
      x: NumPy (or host-convertible) float32, bfloat16 (``ml_dtypes``), float16, int32 or
        uint32 array.

    Raises:
      FingerprintDtypeError: unsupported dtype.
    """
    x = np.asarray(x)
    name = x.dtype.name
    if name in ("float32", "int32", "uint32"):
        w = x.view(np.uint32)
    elif name in ("bfloat16", "float16"):
        w = x.view(np.uint16).astype(np.uint32)
    else:
        raise FingerprintDtypeError(f"cannot fingerprint dtype {name}; supported: {', '.join(_SUPPORTED)}")
    gshape = x.shape if global_shape is None else tuple(global_shape)
    offs = [0] * x.ndim if offsets is None else list(offsets)
    idx = np.zeros(x.shape, np.uint64)
    for d, stride in enumerate(_strides(gshape)):
        shape = [1] * x.ndim
        shape[d] = x.shape[d]
        coord = (np.arange(x.shape[d], dtype=np.uint64) + np.uint64(offs[d])).reshape(shape)
        idx = (idx + coord * np.uint64(stride)) & np.uint64(0xFFFFFFFF)
    idx = idx.astype(np.uint32)
    k, m1, m2, b, m3 = (np.uint32(v) for v in MIX_CONSTANTS)

    def xs(h, s):
        return h ^ (h >> np.uint32(s))

    with np.errstate(over="ignore"):
        a = xs(xs(w ^ (idx * k), 16) * m1, 15)
        lanes = (xs(a * m2, 16), xs((a ^ b) * m3, 16))
    out = np.zeros(4, np.uint32)
    for lane, m in enumerate(lanes):
        out[lane] = np.uint32(int(m.astype(np.uint64).sum()) & 0xFFFFFFFF)
    if name in _NONFINITE_TEST:
        xf = x.astype(np.float32)
        out[2] = np.count_nonzero(np.isnan(xf))
        out[3] = np.count_nonzero(np.isinf(xf))
    return out


def summarize(fp: Any) -> Mapping[str, int]:
    """``{"fp": 64-bit int, "nan": int, "inf": int}`` of a ``uint32[4]`` fingerprint (log form)."""
    a = np.asarray(fp)
    return {"fp": fingerprint_int(a), "nan": int(a[2]), "inf": int(a[3])}
