"""Placement on the trainer's mesh: host-local arrays -> global ``jax.Array`` batches.

Legend: ``B`` global batch (rows), ``L`` seq_len (tokens per row), ``n`` rows this process holds.

:class:`Placement` knows the batch's ``NamedSharding`` (batch over the data axes, sequence
over the context axis), which rows this process's devices hold
(``addressable_devices_indices_map``), and where the ``targets*`` keys are derived:

- on the host (``loader.arrays``: ``pack_records(six=True)``, or ``derive_packed`` for the
  packed batches Grain workers send) with a context axis (the targets' one-slot shift would
  cross devices; hosts hold whole rows) and on CPU devices, where the six arrays are built
  in one 64-byte-aligned block that XLA's CPU client aliases
  instead of copying (measured ahead at 1,024 to 8,192 tokens a row: ``benchmarks/load.py``;
  a jitted derive costs CPU on the same cores); one process then hands the six arrays to
  the devices with JAX's per-array transfer (:meth:`Placement._put`);
- else on the devices: the host sends one ``[n, 3, L]`` array (tokens, segment ids,
  positions: one transfer instead of three) and :func:`make_derive`'s jitted function,
  compiled once per loader (static shapes), computes the six keys. Integer ops only, so the
  result is exact (tests check it against ``loader.testing.derive_batch`` bit for bit).
  Without a context axis every device holds whole rows, so the program has no collectives
  and the prefetch thread may launch it beside the trainer's own programs without any risk
  of a cross-device ordering deadlock (tests check the compiled program for collectives).

May import: ``loader.arrays`` (``BATCH_KEYS``, ``derive_packed``), JAX.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from loader.arrays import BATCH_KEYS, derive_packed as host_derive_packed

log = logging.getLogger("loader")
_FAST_PUT_CHECKED = False  # Placement._put's fast path was checked against jax.device_put in this process


def derive(inputs: jax.Array, seg: jax.Array, pos: jax.Array) -> dict[str, jax.Array]:
    """Six int32 ``[B, L]`` arrays from tokens, segment ids and positions (the keys and
    values of ``loader.testing.derive_batch``: no target crosses a segment).

    The inputs may be narrower integers (uint16 tokens, int16 ids and positions), ``[B, L]``;
    they are widened to int32 here.

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
    return jax.jit(derive_packed, in_shardings=packed_sharding, out_shardings={k: sharding for k in BATCH_KEYS})


class Placement:
    """Host-local arrays of this process -> global ``jax.Array`` s on the trainer's mesh.

    Args:
      mesh: the trainer's ``jax.sharding.Mesh``.
      data_axes: mesh axes the batch dimension is split over.
      context_axis: mesh axis the sequence dimension is split over, or ``None``.
      global_shape: ``(B, L)``.

    Attributes:
      sharding: ``NamedSharding(mesh, P(data_axes, context_axis))`` of every batch array.
      local_rows: int64 ``[n]``, the sorted global-batch positions this process's devices hold.
      host_derive: the ``targets*`` keys are derived on the host (a context axis, or CPU
        devices; see the module docstring), so the host hands over the six keys.
    """

    def __init__(self, mesh, data_axes: Sequence[str], context_axis: str | None, global_shape: tuple[int, int]):
        self.mesh = mesh
        self.sharding = NamedSharding(mesh, PartitionSpec(tuple(data_axes), context_axis))
        self.global_shape = global_shape
        global_batch = global_shape[0]
        index_map = self.sharding.addressable_devices_indices_map(global_shape)
        row_slices = {(s[0].start or 0, s[0].stop if s[0].stop is not None else global_batch)
                      for s in index_map.values()}
        local = sorted({r for a, b in row_slices for r in range(a, b)})
        self.local_rows = np.asarray(local, np.int64)
        self._pos = {r: i for i, r in enumerate(local)}
        self._index_cache: dict = {}
        self._derive = None
        self.host_derive = context_axis is not None or all(d.platform == "cpu" for d in mesh.devices.flat)
        self._single_host = self.sharding.is_fully_addressable and len(local) == global_batch
        self.fast_put = None  # see _put

    def to_global(self, host: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The six global arrays, int32 ``[B, L]`` on :attr:`sharding`, from this process's rows.

        Args:
          host: the six keys (:data:`loader.arrays.BATCH_KEYS`), int32 ``[n, L]``, or
            ``packed`` (tokens, segment ids and positions, uint16 or int32 ``[n, 3, L]``),
            rows in :attr:`local_rows` order; then the ``targets*`` keys are derived where
            :attr:`host_derive` says: on the host (``loader.arrays.derive_packed``) or on
            the devices (:func:`make_derive`'s function, device-local).
        """
        if "targets" not in host and self.host_derive:
            # Where the targets are derived on the host, a packed batch (from a Grain worker)
            # is derived here too: with a context axis the one-slot shift would cross devices
            # (a collective, unsafe to launch from the prefetch thread next to the trainer's
            # programs), and on CPU devices a jitted derive costs the same cores.
            host = host_derive_packed(host["packed"])
        if "targets" in host:  # the six keys
            if self._single_host:  # every row is local: the six arrays straight onto the devices
                return dict(zip(BATCH_KEYS, self._put([host[k] for k in BATCH_KEYS])))
            return {k: jax.make_array_from_callback(self.global_shape, self.sharding, self._slice_for(host[k]))
                    for k in BATCH_KEYS}
        packed = host["packed"]

        def packed_cb(index):
            rows, _, cols = index
            return packed[self._local_index(rows), :, cols]

        if self._derive is None:
            spec = self.sharding.spec
            self._packed_sharding = NamedSharding(self.mesh, PartitionSpec(spec[0], None, None))
            self._derive = make_derive(self.sharding, self._packed_sharding)
        b, L = self.global_shape
        return self._derive(jax.make_array_from_callback((b, 3, L), self._packed_sharding, packed_cb))

    def _slice_for(self, arr: np.ndarray):
        def cb(index):
            rows, cols = index
            return arr[self._local_index(rows), cols]
        return cb

    def _put(self, arrays: Sequence[np.ndarray]) -> list:
        """``jax.device_put(arrays, self.sharding)`` for int32 ``[B, L]`` host arrays when every row
        is local.

        Uses JAX's per-array transfer (``xla_client.batched_device_put``, what
        ``device_put`` calls for each array) with the device slices computed once: half the
        cost of ``device_put`` on a many-device host. The first use in the process checks it
        against ``jax.device_put`` (values and sharding); on any difference or error this
        placement uses ``jax.device_put`` instead.
        """
        fast = self.fast_put
        if fast is None:  # first call: set up and check the fast path
            fast = False
            try:
                from jax._src import core as jcore
                from jax._src.lib import xla_client as xc

                devices = list(self.sharding._addressable_device_assignment)  # noqa: SLF001
                imap = self.sharding.addressable_devices_indices_map(self.global_shape)
                slices = [imap[d] for d in devices]
                aval = jcore.ShapedArray(self.global_shape, np.dtype(np.int32))

                def fast(xs):
                    return [xc.batched_device_put(aval, self.sharding, [x[i] for i in slices], devices, True)
                            for x in xs]

                global _FAST_PUT_CHECKED
                if not _FAST_PUT_CHECKED:  # once per process: the JAX installed does what we expect
                    got, want = fast(arrays), jax.device_put(list(arrays), self.sharding)
                    same = all(g.sharding == w.sharding and g.shape == w.shape and g.dtype == w.dtype
                               and np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))
                    if not same:
                        raise RuntimeError("batched_device_put differs from jax.device_put")
                    _FAST_PUT_CHECKED = True
            except Exception as e:  # noqa: BLE001 - private API moved: the public one works
                log.info("fast device transfer unavailable (%r); using jax.device_put", e)
                fast = False
            self.fast_put = fast
        if fast is False or any(a.dtype != np.int32 or a.shape != self.global_shape for a in arrays):
            return jax.device_put(list(arrays), self.sharding)
        return fast(arrays)

    def _local_index(self, rows: slice):
        """Host-array index of a device's global row slice: a slice (a view) when contiguous."""
        key = (rows.start, rows.stop)
        hit = self._index_cache.get(key)
        if hit is None:
            start = rows.start or 0
            stop = rows.stop if rows.stop is not None else self.global_shape[0]
            pos = [self._pos[r] for r in range(start, stop)]
            contiguous = pos and pos == list(range(pos[0], pos[0] + len(pos)))
            hit = slice(pos[0], pos[-1] + 1) if contiguous else np.asarray(pos, np.int64)
            self._index_cache[key] = hit
        return hit
