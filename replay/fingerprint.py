"""Order-independent integer fingerprints of arrays (DESIGN.md, "Gradient fingerprints").

A fingerprint says, in four integers, exactly which values an array (a gradient leaf, a
batch of tokens) held, so that two runs, two devices or a run and its replay compare bit
for bit, while the value does not depend on how the elements were sharded or in which
order a reduction visited them.

Formula
-------
For an array ``x`` of global shape ``S`` (any rank), each element ``x[n]`` with global
row-major flat index ``i = sum_d n_d * stride_d(S)`` (taken mod 2^32) contributes::

    w     = bit pattern of x[n] as uint32   (float32/int32/uint32: bitcast;
                                             bfloat16/float16: bitcast to uint16, zero-extended)
    m_0   = fmix32((w XOR (i * A)) * C + i)           lane 0
    t     = (m_0 XOR B) * D
    m_1   = t XOR (t >> 16)                           lane 1

    fp_L  = ( sum over elements of m_L )  mod 2^32,   L in {0, 1}
    nan   = number of NaN elements,  inf = number of +-Inf elements

with ``fmix32`` MurmurHash3's 32-bit finalizer (Appleby, MurmurHash3.cpp,
``fmix32``: ``h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16``)
and the constants ``A, B, C, D`` of :data:`MIX_CONSTANTS` (``A, C, D`` odd). All arithmetic
is uint32 and wraps. The result is a ``uint32[4]`` array ``[fp_0, fp_1, nan, inf]``;
``(fp_1 << 32) | fp_0`` is the 64-bit fingerprint written to logs (:func:`fingerprint_int`).
About 15 integer operations per element, in one fused pass.

Properties (each tested in ``tests/test_fingerprint.py``):

* For a fixed index ``i``, ``w -> m_0`` and ``w -> m_1`` are bijections of uint32: XOR
  with a constant, multiplication by an odd constant, addition of a constant,
  ``t -> t XOR (t >> k)`` and ``fmix32`` are each invertible mod 2^32. So changing any
  one element, by any bit, changes both lanes'
  sums (the sum moves by a non-zero amount mod 2^32): it is never a "maybe".
* Integer addition mod 2^32 is associative and commutative, so the value does not depend on
  reduction order, and the fingerprints of disjoint shards (each using *global* indices)
  add up, lane by lane and count by count, mod 2^32, to the fingerprint of the whole array
  (:func:`add_fingerprints`; ``jax.lax.psum`` of ``uint32`` does the same inside
  ``shard_map``).
* The index enters twice before the non-linear ``fmix32``, so moving a value to another
  position changes the sum (no XOR-only reduction, which would be blind to order and to
  pairs of equal changes). Lane 1 is a non-affine bijection of lane 0's term, so its sum
  carries 32 further bits.

Everything here is pure ``jax.numpy`` and works inside ``jax.jit`` and ``shard_map``;
:func:`fingerprint_np` is the NumPy twin used on hosts and in tests. x64 mode is not
needed and not enabled.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# (A, B, C, D): odd multipliers A, C, D (golden ratio, xxHash PRIME32_2 and _3), B arbitrary.
MIX_CONSTANTS: tuple[int, int, int, int] = (0x9E3779B1, 0x7F4A7C15, 0x85EBCA77, 0xC2B2AE3D)
_FMIX_M1 = 0x85EBCA6B
_FMIX_M2 = 0xC2B2AE35
FINGERPRINT_FIELDS = ("fp0", "fp1", "nan", "inf")

_SUPPORTED = ("float32", "bfloat16", "float16", "int32", "uint32")


class FingerprintDtypeError(TypeError):
    """The array's dtype has no fingerprint bit pattern (see ``_SUPPORTED``)."""


# ----------------------------------------------------------------------------- jnp


def _u32(v: int) -> jnp.ndarray:
    return jnp.uint32(v & 0xFFFFFFFF)


def _fmix32(h: jnp.ndarray) -> jnp.ndarray:
    h = h ^ (h >> 16)
    h = h * _u32(_FMIX_M1)
    h = h ^ (h >> 13)
    h = h * _u32(_FMIX_M2)
    return h ^ (h >> 16)


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
      counts: also count NaN and Inf (``False``: those two fields are 0, and the cost
        drops by about half on CPU; the trainer's per-device fingerprints skip them).

    Returns:
      uint32[4]. Fingerprints of disjoint blocks of one array add up (uint32 wrap) to the
      whole array's.

    Raises:
      FingerprintDtypeError: unsupported dtype.
    """
    w = bit_pattern(x)
    if global_shape is None and offsets is None:
        idx = jax.lax.iota(jnp.uint32, w.size).reshape(w.shape)
    else:
        idx = global_index(x.shape, x.shape if global_shape is None else global_shape, offsets)
    return _reduce(w, idx, x, None, counts)


def _mix(w: jnp.ndarray, idx: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    a, b, c, d = MIX_CONSTANTS
    m0 = _fmix32((w ^ (idx * _u32(a))) * _u32(c) + idx)
    t = (m0 ^ _u32(b)) * _u32(d)
    return m0, t ^ (t >> 16)


def _reduce(w, idx, x, valid, counts: bool = True) -> jnp.ndarray:
    """Sums of the terms. On XLA:CPU a fused sum of four terms (or a stacked ``[N, 4]`` sum)
    runs several times slower than three, so the hot path sums ``m_0``, ``m_1`` and the
    non-finite count, and the NaN count is taken (``lax.cond``) only when that is non-zero."""
    m0, m1 = _mix(w, idx)
    zero = jnp.uint32(0)
    if valid is not None:
        m0, m1 = jnp.where(valid, m0, zero), jnp.where(valid, m1, zero)
    out = [jnp.sum(m0, dtype=jnp.uint32), jnp.sum(m1, dtype=jnp.uint32)]
    if counts and jnp.issubdtype(x.dtype, jnp.floating):
        nonfinite = ~jnp.isfinite(x)
        if valid is not None:
            nonfinite = nonfinite & valid
        n_bad = jnp.sum(nonfinite, dtype=jnp.uint32)

        def count_nan(_):
            nan = jnp.isnan(x) if valid is None else jnp.isnan(x) & valid
            return jnp.sum(nan, dtype=jnp.uint32)

        n_nan = jax.lax.cond(n_bad > 0, count_nan, lambda _: zero, None)
        out += [n_nan, n_bad - n_nan]
    else:
        out += [zero, zero]
    return jnp.stack(out)


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
    n = flat.shape[0]
    pos = jax.lax.iota(jnp.int32, n) + jnp.asarray(start, jnp.int32)
    return _reduce(bit_pattern(flat), pos.astype(jnp.uint32), flat, pos < total)


def fingerprint_row_block(x: jnp.ndarray, block_index: Any, n_blocks: int, *, counts: bool = True) -> jnp.ndarray:
    """Fingerprint of block ``block_index`` of ``n_blocks`` row blocks of ``x`` (global indices).

    Rows (first dimension, ``d0``) are split in ``n_blocks`` blocks of ``c = ceil(d0 / n_blocks)``
    rows; block ``k`` holds rows ``[k*c, min((k+1)*c, d0))`` (empty when ``k*c >= d0``). The
    block is read in place (``dynamic_slice`` with its start clamped, rows outside the block
    masked), so no copy of ``x`` is made. Summing the ``n_blocks`` results gives
    ``fingerprint(x)``: the trainer lets each device fingerprint one block of the reduced
    gradient and adds them with a ``psum``.

    Args:
      x: array of rank >= 1 (rank 0 is treated as shape ``(1,)``).
      block_index: int or traced int32 scalar in ``[0, n_blocks)``.
      n_blocks: number of blocks, >= 1.
    """
    if x.ndim == 0:
        x = x.reshape(1)
    d0 = x.shape[0]
    c = -(-d0 // n_blocks)
    lo = jnp.asarray(block_index, jnp.int32) * c
    start = jnp.clip(lo, 0, d0 - c)
    blk = jax.lax.dynamic_slice_in_dim(x, start, c, axis=0)
    rows = start + jax.lax.iota(jnp.int32, c)
    valid_rows = (rows >= lo) & (rows < jnp.minimum(lo + c, d0))
    valid = jnp.broadcast_to(valid_rows.reshape((c,) + (1,) * (x.ndim - 1)), blk.shape)
    idx = global_index(blk.shape, x.shape, (start,) + (0,) * (x.ndim - 1))
    return _reduce(bit_pattern(blk), idx, blk, valid, counts)


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
    flat = x.reshape(-1)
    e = jnp.clip(jnp.asarray(element, jnp.int32), 0, flat.shape[0] - 1)
    mask = (jnp.asarray(enabled).astype(jnp.uint32) << jnp.asarray(bit).astype(jnp.uint32)).astype(utype)
    old = jax.lax.bitcast_convert_type(jax.lax.dynamic_slice(flat, (e,), (1,)), utype)
    new = jax.lax.bitcast_convert_type(old ^ mask, x.dtype)
    return jax.lax.dynamic_update_slice(flat, new, (e,)).reshape(x.shape)


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


def _np_fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_FMIX_M1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_FMIX_M2)
    return h ^ (h >> np.uint32(16))


def fingerprint_np(
    x: Any, *, global_shape: Optional[Sequence[int]] = None, offsets: Optional[Sequence[int]] = None
) -> np.ndarray:
    """NumPy twin of :func:`fingerprint` (same formula, same ``uint32[4]`` result).

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
    out = np.zeros(4, np.uint32)
    a, b, c, d = (np.uint32(v) for v in MIX_CONSTANTS)
    with np.errstate(over="ignore"):
        m0 = _np_fmix32((w ^ (idx * a)) * c + idx)
        t = (m0 ^ b) * d
        m1 = t ^ (t >> np.uint32(16))
    out[0] = np.uint32(int(m0.astype(np.uint64).sum()) & 0xFFFFFFFF)
    out[1] = np.uint32(int(m1.astype(np.uint64).sum()) & 0xFFFFFFFF)
    if np.issubdtype(x.dtype, np.floating) or name == "bfloat16":
        xf = x.astype(np.float32)
        out[2] = np.count_nonzero(np.isnan(xf))
        out[3] = np.count_nonzero(np.isinf(xf))
    return out


def tree_fingerprints(tree: Any) -> dict[str, jnp.ndarray]:
    """Per leaf path (``jax.tree_util.keystr``) the :func:`fingerprint` of each leaf (jit-able)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): fingerprint(v) for p, v in flat}


def summarize(fp: Any) -> Mapping[str, int]:
    """``{"fp": 64-bit int, "nan": int, "inf": int}`` of a ``uint32[4]`` fingerprint (log form)."""
    a = np.asarray(fp)
    return {"fp": fingerprint_int(a), "nan": int(a[2]), "inf": int(a[3])}
