"""The trainer's kit for a replayable step: per-device fingerprints and screening signals, drill faults.

What a user's trainer adds to its step function so that every ``replay`` command works on its runs
(docs/trainer.md, "Your own trainer"). Inside the per-device body of a ``jax.shard_map`` over the
run's mesh (every device computes its own rows' gradient, then a ``psum`` reduces)::

    grads = probe.inject(grads, fault, drift, probe.device_id(mesh))   # drills only: flip / drift
    out = probe.local(grads)                  # BEFORE the reduction: this device's contribution
    reduced = jax.lax.psum(grads, axes)
    out.update(probe.reduced(grads, reduced, mesh))   # AFTER: the reduced gradient's fingerprint
    ... out_specs={**probe.specs(mesh), ...}

and on the host, from the step's outputs (replicated, so every process has them)::

    fp = probe.step_fingerprints(step, jax.device_get(out), mesh, leaf_paths, loss=..., grad_norm=...,
                                 batch=...)   # batch: fingerprint(batch["inputs"]) computed in the step

Legend: ``L`` parameter leaves (``jax.tree_util.tree_leaves`` order), ``D`` devices of the mesh
(row-major). Fingerprints are ``replay.run.fingerprint``'s (``uint32[4]`` per array).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from replay.run import fingerprint as fpm
from replay.run.protocol import DriftSpec, FaultSpec, ReplicaNorm, StepFingerprints, StepSignals


class FaultError(ValueError):
    """A drill's fault names a leaf, element, bit or device that does not exist."""


def leaf_info(params: Any) -> tuple[list[str], list[int], list[Any]]:
    """``(leaf_paths, leaf_sizes, leaf_dtypes)`` of a parameter pytree (arrays or ``jax.ShapeDtypeStruct``s,
    e.g. ``jax.eval_shape`` of the init), in ``jax.tree_util.tree_leaves`` order: the trainer attributes
    drills use (``jax.tree_util.keystr`` paths; element counts; ``numpy`` dtypes)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return ([jax.tree_util.keystr(p) for p, _ in flat], [int(np.prod(x.shape)) for _, x in flat],
            [np.dtype(x.dtype) for _, x in flat])


_ONE_DEVICE: dict = {}


def one_device_fingerprints(grad_fn: Any, params: Any, batch: Mapping[str, Any], device: Any, fault: Any,
                            leaf_paths: Sequence[str], leaf_sizes: Sequence[int],
                            leaf_dtypes: Sequence[Any]) -> dict[str, int]:
    """``Trainer.single_device_fingerprints`` for any trainer: ``{leaf path: 64-bit fingerprint}`` of
    ``grad_fn(params, batch)``, the whole batch's gradient computed on ``device`` alone (``replay canary``),
    with a drill's bit flip applied when ``fault`` (a ``FaultSpec``) names this device.

    Args:
      grad_fn: ``(params, batch) -> grads`` (a pytree like ``params``), traceable; one compiled program
        per ``(grad_fn, device)`` is kept, so pass the same function (a bound method is) every time.
      params: the parameters (any placement: copied to ``device``); batch: int32 ``[B, S]`` arrays
        (numpy or JAX), copied to ``device``.
      device: a ``jax.Device``; fault: None or a ``FaultSpec`` (ignored unless on this device).

    Raises:
      FaultError: the fault names an unknown leaf, an element or bit out of range.
    """
    key = (grad_fn, int(device.id))
    if key not in _ONE_DEVICE:
        def fn(p, b, flip):
            grads = inject(grad_fn(p, b), flip, jnp.zeros(4, jnp.float32), jnp.int32(device.id))
            return jnp.stack([fpm.fingerprint(g, counts=False) for g in jax.tree_util.tree_leaves(grads)])

        _ONE_DEVICE[key] = jax.jit(fn)
    mine = fault if fault is not None and fault.device_id == device.id else None  # a drill: its device only
    flip, _ = fault_inputs(mine, None, leaf_paths, leaf_sizes, leaf_dtypes, [device.id])
    b = {k: jax.device_put(np.asarray(v, np.int32), device) for k, v in batch.items()}
    fps = np.asarray(_ONE_DEVICE[key](jax.device_put(params, device), b, jax.device_put(flip, device)))
    return {p: fpm.fingerprint_int(fps[i]) for i, p in enumerate(leaf_paths)}


def linear_index(mesh: Any) -> Any:
    """Inside ``shard_map``: this device's row-major position in ``mesh`` (traced int32)."""
    lin = 0
    for a in mesh.axis_names:
        lin = lin * mesh.shape[a] + jax.lax.axis_index(a)
    return lin


def device_id(mesh: Any) -> Any:
    """Inside ``shard_map``: this device's global id (``jax.Device.id``, traced int32)."""
    table = jnp.asarray([d.id for d in mesh.devices.reshape(-1)], jnp.int32)
    return table[linear_index(mesh)]


def specs(mesh: Any, dot: bool = True) -> dict[str, Any]:
    """``out_specs`` of :func:`local` and :func:`reduced`'s outputs: per-device rows over every axis
    (``dot``: as passed to :func:`reduced`)."""
    axes = tuple(mesh.axis_names)
    out = {"devices": P(axes), "dev_norm_sq": P(axes), "dev_nonfinite": P(axes), "dev_dot": P(axes), "leaves": P()}
    if not dot:
        del out["dev_dot"]
    return out


def local(grads: Any) -> dict[str, Any]:
    """Inside ``shard_map``, before the reduction: this device's contribution.

    Returns:
      ``devices``: uint32 ``[1, L, 4]`` fingerprints of each local gradient leaf (``[fp_0, fp_1, nan,
      inf]``); ``dev_norm_sq``: float32 ``[1]`` sum of squares of the contribution; ``dev_nonfinite``:
      int32 ``[1, L]`` NaN + Inf count per leaf.

    Two passes over each leaf: the fingerprint, whose one variadic reduce also counts the non-finite
    elements (its NaN and Inf lanes give ``dev_nonfinite``: a separate ``sum(~isfinite(g))`` is an
    integer sum that XLA:CPU rewrites into a slower tree of ``reduce-window``), and the sum of squares.
    """
    leaves = jax.tree_util.tree_leaves(grads)
    sq = jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves])
    fps = jnp.stack([fpm.fingerprint(g, counts=True) for g in leaves])
    return {"devices": fps[None], "dev_norm_sq": jnp.sum(sq)[None],
            "dev_nonfinite": (fps[:, 2] + fps[:, 3]).astype(jnp.int32)[None]}


def reduced(local_grads: Any, reduced_grads: Any, mesh: Any, dot: bool = True) -> dict[str, Any]:
    """Inside ``shard_map``, after the reduction (``reduced_grads = psum(local_grads)``).

    Args:
      dot: also compute ``dev_dot`` (a pass over both gradients; ``False``: the step's
        ``ReplicaNorm.dot`` is None, which the protocol allows and nothing compares).

    Returns:
      ``leaves``: uint32 ``[L, 4]`` fingerprints of the reduced gradient (each device fingerprints one
      row block, a ``psum`` adds the blocks: ``fingerprint_row_block``); with ``dot``, ``dev_dot``:
      float32 ``[1]`` ``<g_local, g_reduced>`` (these add up to ``||g||^2`` over the devices).
    """
    axes = tuple(mesh.axis_names)
    lin = linear_index(mesh)
    red = jax.tree_util.tree_leaves(reduced_grads)
    parts = jnp.stack([fpm.fingerprint_row_block(g, lin, mesh.size) for g in red])
    out = {"leaves": jax.lax.psum(parts, axes)}
    if dot:
        dots = [jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
                for a, b in zip(jax.tree_util.tree_leaves(local_grads), red)]
        out["dev_dot"] = jnp.sum(jnp.stack(dots))[None]
    return out


def row(local_grads: Any, reduced_grads: Any, mesh: Any, extra: Any = None) -> Any:
    """Inside ``shard_map``, after the reduction: :func:`local` and this device's part of :func:`reduced`
    (``dot=False``) packed in one uint32 row, so that the step's per-device outputs leave the ``shard_map``
    as one array: one collective (the all-gather that replicates it) instead of one per output and the
    ``psum`` of the reduced fingerprint's row blocks (:func:`unrow` adds them after the gather).

    Args:
      extra: optional uint32 1-D array appended to the row (a trainer's own per-device values, e.g. its
        loss contribution's bits; :func:`unrow` returns it as ``extra``).

    Returns:
      uint32 ``[1, 9 L + 1 + X]``: ``devices`` (``4 L``), ``dev_norm_sq``'s bits (1), ``dev_nonfinite`` (``L``),
      this device's row block of each reduced leaf's fingerprint (``4 L``), ``extra`` (``X``). ``out_specs``:
      ``PartitionSpec(tuple(mesh.axis_names))``.
    """
    loc = local(local_grads)
    lin = linear_index(mesh)
    parts = jnp.stack([fpm.fingerprint_row_block(g, lin, mesh.size) for g in jax.tree_util.tree_leaves(reduced_grads)])
    pieces = [loc["devices"].reshape(-1), jax.lax.bitcast_convert_type(loc["dev_norm_sq"], jnp.uint32),
              loc["dev_nonfinite"].astype(jnp.uint32).reshape(-1), parts.reshape(-1)]
    if extra is not None:
        pieces.append(jnp.asarray(extra, jnp.uint32).reshape(-1))
    return jnp.concatenate(pieces)[None]


def unrow(rows: Any, n_leaves: int) -> dict[str, Any]:
    """The outputs of :func:`local` and :func:`reduced` (``dot=False``) from :func:`row`'s rows gathered over
    the mesh (uint32 ``[D, K]``, rows in the mesh's row-major order), in or out of ``jax.jit``: ``devices``,
    ``dev_norm_sq``, ``dev_nonfinite``, ``leaves`` (the row blocks added, uint32 wrap) and ``extra``
    (uint32 ``[D, X]``)."""
    L, D = int(n_leaves), rows.shape[0]
    parts = rows[:, 5 * L + 1:9 * L + 1].reshape(D, L, 4)
    return {"devices": rows[:, :4 * L].reshape(D, L, 4),
            "dev_norm_sq": jax.lax.bitcast_convert_type(rows[:, 4 * L], jnp.float32),
            "dev_nonfinite": rows[:, 4 * L + 1:5 * L + 1].astype(jnp.int32),
            "leaves": jnp.sum(parts, axis=0, dtype=jnp.uint32), "extra": rows[:, 9 * L + 1:]}


def fault_inputs(fault: Any, step: Optional[int], leaf_paths: Sequence[str], leaf_sizes: Sequence[int],
                 leaf_dtypes: Sequence[Any], mesh_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The traced fault inputs of a step (so that drills never recompile):
    ``int32[5] = [enabled, device id, leaf index, element, bit]`` for the bit flip firing at ``step``
    (``step`` None: the first, whatever its step) and ``float32[4] = [enabled, device id, kind (0 scale,
    1 bias), magnitude]`` for the drift active at ``step``.

    Args:
      fault: None, a ``FaultSpec``, a ``DriftSpec``, or a list of them (at most one of each per step).

    Raises:
      FaultError: an unknown leaf or device, an element or bit out of range, two flips at one step.
    """
    items = [] if fault is None else list(fault) if isinstance(fault, (list, tuple)) else [fault]
    flips = [f for f in items if isinstance(f, FaultSpec) and (step is None or f.step == step)]
    drifts = [f for f in items if isinstance(f, DriftSpec) and (step is None or f.active(step))]
    if any(not isinstance(f, (FaultSpec, DriftSpec)) for f in items):
        raise FaultError(f"a fault must be a FaultSpec or a DriftSpec, got {[type(f).__name__ for f in items]}")
    if len(flips) > 1 or len(drifts) > 1:
        raise FaultError(f"at most one bit flip and one drift per step; step {step} has {len(flips)} and {len(drifts)}")
    flip_arr, drift_arr = np.zeros(5, np.int32), np.zeros(4, np.float32)
    for f in flips + drifts:
        if f.device_id not in mesh_ids:
            raise FaultError(f"fault device {f.device_id} is not in the mesh's devices {sorted(mesh_ids)}")
    if flips:
        f = flips[0]
        if f.leaf not in leaf_paths:
            raise FaultError(f"fault.leaf {f.leaf!r} is not a parameter leaf; leaves: {list(leaf_paths)}")
        i = list(leaf_paths).index(f.leaf)
        if not 0 <= f.element < leaf_sizes[i]:
            raise FaultError(f"fault.element {f.element} outside [0, {leaf_sizes[i]}) for {f.leaf}")
        bits = 8 * jnp.dtype(leaf_dtypes[i]).itemsize
        if not 0 <= f.bit < bits:
            raise FaultError(f"fault.bit {f.bit} outside [0, {bits}) for {f.leaf}")
        flip_arr = np.asarray([1, f.device_id, i, f.element, f.bit], np.int32)
    if drifts:
        d = drifts[0]
        drift_arr = np.asarray([1, d.device_id, 0 if d.kind == "scale" else 1, d.magnitude], np.float32)
    return flip_arr, drift_arr


def inject(grads: Any, flip: Any, drift: Any, device: Any) -> Any:
    """Inside ``shard_map``: the local gradient with the drill's faults of :func:`fault_inputs` applied
    on their device (``device``: :func:`device_id`): bit ``flip[4]`` of element ``flip[3]`` of leaf
    ``flip[2]`` flipped; then, while the drift is on, ``g * (1 + m)`` (scale) or ``g + m * rms(g)``
    (bias) per leaf. Bit-identical to ``grads`` when neither is enabled."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    hit = (flip[0] == 1) & (flip[1] == device)
    leaves = [fpm.flip_bit(g, flip[3], flip[4], hit & (flip[2] == i)) for i, g in enumerate(leaves)]

    def drifted(gs):
        def one(g):
            gf = g.astype(jnp.float32)
            rms = jnp.sqrt(jnp.mean(gf * gf))
            return jnp.where(drift[2] == 0, gf * (1.0 + drift[3]), gf + drift[3] * rms).astype(g.dtype)

        return [one(g) for g in gs]

    on = (drift[0] == 1) & (drift[1] == device.astype(jnp.float32))
    leaves = jax.lax.cond(on, drifted, lambda gs: list(gs), leaves)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def step_fingerprints(step: int, out: Mapping[str, Any], mesh: Any, leaf_paths: Sequence[str], *, loss: Any = None,
                      grad_norm: Any = None, batch: Any = None,
                      router: Optional[Mapping[str, Any]] = None) -> StepFingerprints:
    """The step's :class:`StepFingerprints` (with its :class:`StepSignals`) from the host copy of the
    probe outputs (:func:`local`, :func:`reduced`; per-device rows in the mesh's row-major order).

    Args:
      loss, grad_norm: the step's float32 loss and global gradient norm (None: ``out["loss"]``,
        ``out["grad_norm"]``).
      batch: uint32 ``[4]``, ``replay.run.fingerprint.fingerprint(batch["inputs"])`` computed in the step
        (the batch hash; in the step, so that no process needs the whole batch on its host; None:
        ``out["batch"]``).
      router: optional figures for humans (never compared).

    Raises:
      KeyError: an argument left None whose key ``out`` lacks.
    """
    loss = out["loss"] if loss is None else loss
    grad_norm = out["grad_norm"] if grad_norm is None else grad_norm
    batch = out["batch"] if batch is None else batch
    ids = [int(d.id) for d in mesh.devices.reshape(-1)]
    coords = {}
    for pos in np.ndindex(mesh.devices.shape):
        coords[int(mesh.devices[pos].id)] = {a: int(i) for a, i in zip(mesh.axis_names, pos)}
    loss32, norm32 = np.float32(loss), np.float32(grad_norm)
    devices, sig_dev, replicas = {}, {}, []
    for r, dev in enumerate(ids):
        devices[dev] = {p: fpm.fingerprint_int(out["devices"][r, i]) for i, p in enumerate(leaf_paths)}
        counts = out["dev_nonfinite"][r]
        sig_dev[dev] = {"norm_sq": float(out["dev_norm_sq"][r]),
                        "nonfinite": {p: int(counts[i]) for i, p in enumerate(leaf_paths) if counts[i]}}
        replicas.append(ReplicaNorm(replica=r, devices=(dev,), norm_sq=float(out["dev_norm_sq"][r]),
                                    dot=float(out["dev_dot"][r]) if "dev_dot" in out else None))
    return StepFingerprints(
        step=int(step), loss_bits=int(np.asarray(loss32).view(np.uint32)),
        grad_norm_bits=int(np.asarray(norm32).view(np.uint32)), batch_hash=fpm.fingerprint_hex(batch),
        leaves={p: fpm.summarize(out["leaves"][i]) for i, p in enumerate(leaf_paths)}, devices=devices,
        router={"loss": float(loss32), **dict(router or {})}, device_coords=coords,
        signals=StepSignals(step=int(step), loss=float(loss32), grad_norm=float(norm32), replicas=tuple(replicas),
                            devices=sig_dev))
