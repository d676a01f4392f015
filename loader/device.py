"""The jitted half of batch assembly: derive targets and positions on the trainer's mesh.

Hosts send one array ``[B, 3, L]`` holding tokens, segment ids and positions (one
transfer instead of three); this function, compiled once per loader (static shapes),
unpacks it and computes the targets keys on the devices. It is the twin of the numpy ``loader.reader.derive_batch`` (tests check that
they agree bit for bit): integer ops only, so the result is exact. The loader uses it only
when the sequence dimension is not sharded: then every device holds whole rows and the
program has no collectives, so the prefetch thread may launch it beside the trainer's own
programs without any risk of a cross-device ordering deadlock (tests check the compiled
program for collectives).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def derive(inputs: jax.Array, seg: jax.Array, pos: jax.Array) -> dict[str, jax.Array]:
    """Six int32 ``[B, L]`` arrays from tokens, segment ids and positions (see ``derive_batch``).

    The inputs may be narrower integers (uint16 tokens, int16 ids and positions); they are
    widened to int32 here.

    Elementwise work and a one-slot shift only (a scan such as ``lax.cummax`` is slow on
    CPU backends, so positions come from the host).
    """
    n = seg.shape[0]
    inputs, seg, pos = (x.astype(jnp.int32) for x in (inputs, seg, pos))
    valid = jnp.concatenate([(seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0), jnp.zeros((n, 1), bool)], axis=1)
    nxt = jnp.concatenate([inputs[:, 1:], jnp.zeros((n, 1), inputs.dtype)], axis=1)
    zero = jnp.zeros_like(seg)
    return {
        "inputs": inputs,
        "targets": jnp.where(valid, nxt, zero),
        "inputs_segmentation": seg,
        "targets_segmentation": jnp.where(valid, seg, zero),
        "inputs_position": pos,
        "targets_position": jnp.where(valid, pos, zero),
    }


def derive_packed(packed: jax.Array) -> dict[str, jax.Array]:
    """:func:`derive` of ``packed[:, 0]`` (tokens), ``packed[:, 1]`` (ids), ``packed[:, 2]`` (positions).

    ``packed`` is ``[B, 3, L]`` uint16 or int32 (ids and positions are non-negative, so
    their uint16 form is their value).
    """
    return derive(packed[:, 0], packed[:, 1], packed[:, 2])


def make_derive(sharding, packed_sharding):
    """:func:`derive_packed` jitted: input on ``packed_sharding`` (``[B, 3, L]``), outputs on ``sharding``."""
    keys = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")
    return jax.jit(derive_packed, in_shardings=packed_sharding, out_shardings={k: sharding for k in keys})
