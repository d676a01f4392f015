"""The reference trainer: a sharded, fingerprinted train step implementing ``replay.run.protocol.Trainer``.

Mesh and sharding
-----------------
A ``jax.sharding.Mesh`` with axes ``("data", "expert")`` (:func:`make_mesh`; devices in id
order, data-major). The global batch ``[B, S]`` is split over both axes
(``PartitionSpec(("data", "expert"))``): every device computes the forward and backward
pass of its own ``B / n_devices`` rows. Expert weights (``w_in``, ``w_out``) and their AdamW
moments are *stored* split over the ``expert`` axis (first dimension, when ``E`` divides).
With ``model.dispatch == "gather"`` the step gathers them for compute (jit inserts the
all-gather), so the per-device gradient is a full-size local contribution that can be
fingerprinted before the reduction. With ``"all_to_all"`` (expert parallelism) they enter
``shard_map`` split (``PartitionSpec("expert")``) and are never gathered: each device's tokens
reach their experts' devices by ``lax.all_to_all`` and come back by a second one
(``replay.reference.model``); a device's local gradient is then the whole gradient of the
replicated weights from its rows and its own experts' shard, the shard is reduced over the
other axes only, and each device also fingerprints what it sends at each all-to-all, forward
and backward (``StepFingerprints.sends``; docs/trainer.md, "Expert parallelism").

One step (``jax.jit`` with explicit in/out shardings; the per-device part in
``jax.shard_map`` so that each device's local gradient is visible)::

    per device d (shard_map over all mesh axes):
        g_d      = grad of local_loss(params, rows of d)        # its contribution
        g_d      = flip_bit(g_d, fault) if d is the drill's device
        fp_dev_d = fingerprint(g_d) per leaf                     # BEFORE the reduction
        g        = psum_d g_d                                    # data-parallel reduction
        fp_leaf  = psum_d fingerprint(row block d of g)          # blocks add up mod 2^32
    grad_norm = ||g||_2 ; AdamW update (optax)

The fault is a traced ``int32[9]`` input ``[enabled, device_id, leaf_index, element, bit, site,
layer, mode, value]`` (:meth:`ReferenceTrainer.fault_array`; ``site`` may also plant the flip inside the
computation: an expert output, an expert weight's gradient, an attention output, the sites of
``replay.run.protocol.INNER_SITES``; or, with ``optimizer_update``, in one device's copy of a leaf of
the updated state after the optimizer step), so a drill never recompiles. Fingerprints only read gradients: the update is bit-identical
with and without them (tested).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from contract.validation import Int, Number, section
from replay.run import fingerprint as fpm
from replay.run.protocol import (
    CHECKPOINTS_DIR,
    DriftSpec,
    ExpertLoad,
    FaultSpec,
    ReplicaNorm,
    RouterLayerStats,
    StepFingerprints,
    StepSignals,
    send_sites_in_program_order,
)
from replay.run.protocol import FAULT_MODES, TRANSIT_SITES
from replay.reference.model import (
    BATCH_KEYS,
    FAULT_LEN,
    SITE_CODE,
    ExpertParallel,
    Hooks,
    ModelConfig,
    corrupt_element,
    count_target_tokens,
    init_params,
    local_loss,
    probe_fingerprints,
    router_bias_update,
)

DEFAULT_AXES = ("data", "expert")
EXPERT_LEAVES = ("w_in", "w_out")


class TrainerConfigError(ValueError):
    """An optimizer or mesh setting is out of range; the message names it and the allowed range."""


class FaultSpecError(ValueError):
    """A drill's fault names a leaf, element, bit or device that does not exist."""


@section("optimizer", TrainerConfigError)
class OptimizerConfig:
    """AdamW (Loshchilov & Hutter 2019, ``optax.adamw``) with linear warm-up then constant (the run
    config's ``optimizer:``; built or read, a value out of range is a :class:`TrainerConfigError`).

    Attributes:
      learning_rate: peak learning rate, > 0.
      warmup_steps: linear warm-up from 0, >= 0 steps.
      b1, b2: Adam moment decays, in [0, 1).
      eps: Adam epsilon, > 0.
      weight_decay: decoupled weight decay, >= 0.
      clip_norm: global-norm gradient clipping threshold, > 0, or ``None`` (off).
    """

    learning_rate: Number("> 0", gt=0) = 3e-3
    warmup_steps: Int("an int >= 0", ge=0) = 10
    b1: Number("in [0, 1)", ge=0, lt=1) = 0.9
    b2: Number("in [0, 1)", ge=0, lt=1) = 0.95
    eps: Number("> 0", gt=0) = 1e-8
    weight_decay: Number(">= 0", ge=0) = 0.01
    clip_norm: Optional[Number("> 0 or null", gt=0)] = 1.0

    def build(self) -> optax.GradientTransformation:
        if self.warmup_steps:
            lr = optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        else:
            lr = self.learning_rate
        adam = optax.adamw(lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        if self.clip_norm is None:
            return adam
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), adam)


def make_mesh(axes: Mapping[str, int], devices: Optional[Sequence[Any]] = None) -> Mesh:
    """Builds the trainer's mesh, devices in ascending id order, first axis major.

    Args:
      axes: axis name -> size, in mesh order, e.g. ``{"data": 4, "expert": 2}``; at most one
        size may be ``-1`` (all remaining devices). Must include ``"data"`` and ``"expert"``.
      devices: devices to use (default ``jax.devices()``).

    Raises:
      TrainerConfigError: missing axes, sizes < 1, or a product that is not the device count.
    """
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: d.id)
    names = list(axes)
    for need in DEFAULT_AXES:
        if need not in names:
            raise TrainerConfigError(f"mesh: needs axis {need!r}, got axes {names}")
    sizes = [int(axes[n]) for n in names]
    if sum(1 for s in sizes if s == -1) > 1 or any(s < 1 and s != -1 for s in sizes):
        raise TrainerConfigError(f"mesh: sizes must be >= 1 with at most one -1, got {dict(axes)}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise TrainerConfigError(f"mesh: {len(devices)} devices do not divide by the fixed sizes {dict(axes)}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise TrainerConfigError(
            f"mesh: sizes {dict(zip(names, sizes))} use {math.prod(sizes)} devices, {len(devices)} available"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), tuple(names))


def device_coords(mesh: Mesh) -> dict[int, dict[str, int]]:
    """Per device id its mesh coordinates ``{axis: index}``."""
    out = {}
    for pos in np.ndindex(mesh.devices.shape):
        out[int(mesh.devices[pos].id)] = {n: int(i) for n, i in zip(mesh.axis_names, pos)}
    return out


def leaf_paths(tree: Any) -> list[str]:
    """``jax.tree_util.keystr`` of each leaf, in flattening order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _fault_row(fault: FaultSpec, index: int, layer: int, where: str, dtype: Any, what: str,
               mesh_ids: Sequence[int]) -> np.ndarray:
    """The traced fault input ``int32[FAULT_LEN]`` of a checked ``fault`` (its bit against ``dtype``'s width,
    its device against ``mesh_ids``): ``[1, device_id, index, element, bit, site, layer, mode, value]``.

    Raises:
      FaultSpecError: the bit or the device does not exist (``what`` names the buffer in the message).
    """
    bits = _leaf_bits(dtype)
    if not 0 <= fault.bit < bits:
        raise FaultSpecError(f"fault.bit {fault.bit} outside [0, {bits}) for {what}")
    if fault.device_id not in mesh_ids:
        raise FaultSpecError(f"fault.device_id {fault.device_id} not in the mesh's devices {sorted(mesh_ids)}")
    value = int(np.asarray(fault.value, np.float32).view(np.int32))
    return np.asarray([1, fault.device_id, index, fault.element, fault.bit, SITE_CODE[where], layer,
                       FAULT_MODES.index(fault.mode), value], np.int32)


def _leaf_bits(dtype) -> int:
    return 8 * jnp.dtype(dtype).itemsize


def is_expert_leaf(path: str) -> bool:
    """True for an expert weight's leaf path (``...['w_in']`` or ``...['w_out']``)."""
    return any(path.endswith(f"['{k}']") for k in EXPERT_LEAVES)


def leaf_layer(path: str) -> Optional[int]:
    """The layer index of a per-layer leaf path (``['layers'][3]['w_in']`` -> 3), else None."""
    import re

    m = re.match(r"\['layers'\]\[(\d+)\]", path)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class _StepLayout:
    """What the compiled step needs of its mesh: the axes, the device table (global ids, row-major), the
    expert parallelism (None: gather dispatch), per leaf whether it is an expert shard (reduced over
    the other axes only; ``param_specs``: the leaves' partition specs), the other axes and their size,
    the expert rows a shard holds, and whether the step fingerprints the all-to-all sends."""

    mesh: Mesh
    axes: tuple[str, ...]
    dev_table: Any
    ep: Optional[ExpertParallel]
    treedef: Any
    sharded: tuple[bool, ...]
    param_specs: Any
    others: tuple[str, ...]
    n_others: int
    shard_rows: int
    take_sends: bool

    def others_index(self):
        """Inside ``shard_map``: this device's row-major position over the axes other than ``expert``."""
        lin = 0
        for a in self.others:
            lin = lin * self.mesh.shape[a] + jax.lax.axis_index(a)
        return lin


class ReferenceTrainer:
    """The reference MoE trainer; implements :class:`replay.run.protocol.Trainer`.

    Args:
      model: model sizes.
      optimizer: AdamW settings.
      fingerprints: compute fingerprints in the step (``False``: the plain step, for the
        overhead benchmark and the no-interference test; ``StepFingerprints`` then carry
        only loss, gradient-norm bits and the batch hash).
      signals: compute the screening signals (:class:`replay.run.protocol.StepSignals`: per-device
        and per-replica gradient norms before the reduction, non-finite counts per leaf and
        device, per-layer router health and, under expert parallelism, the tokens each expert
        device received) in the step; default: as ``fingerprints``, so that
        ``fingerprints=False`` is the plain step with none of the instrumentation.
      sends: under expert parallelism, fingerprint what each device sends at each all-to-all
        (``StepFingerprints.sends``, what localizes a fault through the exchanges); default: as
        ``fingerprints`` (``False`` only to measure their cost: ``benchmarks/fingerprint.py --ep``).

    The train state is a dict ``{"params": ..., "opt_state": ..., "router_bias": float32 [L, E]}``
    of global ``jax.Array`` (``router_bias``: the loss-free balancing bias, zeros unless
    ``model.router_bias_rate > 0``).
    """

    def __init__(self, model: ModelConfig, optimizer: OptimizerConfig = OptimizerConfig(), *, fingerprints: bool = True,
                 signals: Optional[bool] = None, sends: Optional[bool] = None):
        self.model = model
        self.optimizer_config = optimizer
        self.optimizer = optimizer.build()
        self.fingerprints = fingerprints
        self.signals = fingerprints if signals is None else bool(signals)
        self.sends = fingerprints if sends is None else bool(sends)
        if self.sends and not fingerprints:
            raise TrainerConfigError("sends: fingerprinting the all-to-all sends needs fingerprints=True")
        abstract = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
        self.leaf_paths = leaf_paths(abstract)
        flat = jax.tree_util.tree_leaves(abstract)
        self.leaf_sizes = [int(np.prod(x.shape)) for x in flat]
        self.leaf_dtypes = [x.dtype for x in flat]
        self._abstract_params = abstract
        self._compiled: dict[Any, Any] = {}
        self.state_leaf_paths = leaf_paths(self._abstract_state_shapes())  # what an optimizer_update fault names

    # ------------------------------------------------------------------ shardings

    def expert_parallel(self, mesh: Mesh) -> Optional[ExpertParallel]:
        """The expert parallelism of the step on ``mesh`` (``model.dispatch == "all_to_all"``), else None.

        Raises:
          TrainerConfigError: ``n_experts`` does not divide by the mesh's ``expert`` size.
        """
        if self.model.dispatch != "all_to_all":
            return None
        X = int(mesh.shape["expert"])
        if self.model.n_experts % X:
            raise TrainerConfigError(
                f"model.dispatch all_to_all: n_experts {self.model.n_experts} must divide by the mesh's expert "
                f"axis size {X} (each device holds n_experts / expert experts)")
        return ExpertParallel("expert", X)

    def param_shardings(self, mesh: Mesh) -> Any:
        """NamedSharding per parameter: expert leaves split over ``expert`` (dim 0), rest replicated.

        With gather dispatch an expert leaf whose first dimension does not divide by the axis size
        is replicated; with all-to-all dispatch that is an error (:meth:`expert_parallel`).
        """
        n_expert = mesh.shape["expert"]
        self.expert_parallel(mesh)

        def spec(path, x):
            if is_expert_leaf(jax.tree_util.keystr(path)) and x.shape[0] % n_expert == 0:
                return NamedSharding(mesh, P("expert"))
            return NamedSharding(mesh, P())

        return jax.tree_util.tree_map_with_path(spec, self._abstract_params)

    def local_leaf_shapes(self, mesh_shape: Mapping[str, int]) -> list[tuple[int, ...]]:
        """Per leaf (in :attr:`leaf_paths` order) the shape of one device's local gradient
        contribution on a mesh of ``mesh_shape`` (``{axis: size}``): the whole leaf, but an expert
        leaf's ``1 / expert`` shard under all-to-all dispatch."""
        X = int(mesh_shape["expert"])
        shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(self._abstract_params)]
        if self.model.dispatch != "all_to_all":
            return shapes
        return [(s[0] // X, *s[1:]) if is_expert_leaf(p) else s for p, s in zip(self.leaf_paths, shapes)]

    def local_leaf_sizes(self, mesh_shape: Mapping[str, int]) -> list[int]:
        """Element counts of :meth:`local_leaf_shapes`: the range of ``FaultSpec.element`` per leaf."""
        return [int(np.prod(s)) for s in self.local_leaf_shapes(mesh_shape)]

    def activation_shapes(self, mesh_shape: Mapping[str, int], global_batch: int, seq_len: int
                          ) -> dict[str, tuple[int, ...]]:
        """One device's buffers that ``expert_forward`` and ``attention`` faults index (per layer).

        ``B = global_batch / devices`` rows, ``C = model.capacity(seq_len)``:
        ``expert_forward``: the experts' output, ``[X, E / X, B, C, D]`` under all-to-all dispatch
        (what the device sends at the layer's combine: part ``x`` goes to the ``x``-th device of its
        expert group and holds that device's tokens' slots of this device's ``E / X`` experts), or
        ``[B, E, C, D]`` with gather dispatch; ``attention``: the attention block's output ``[B, S, D]``.
        """
        n = int(np.prod([int(v) for v in mesh_shape.values()]))
        B, C, E, D = global_batch // n, self.model.capacity(seq_len), self.model.n_experts, self.model.d_model
        X = int(mesh_shape["expert"])
        ep = self.model.dispatch == "all_to_all"
        fwd = (X, E // X, B, C, D) if ep else (B, E, C, D)
        out = {"expert_forward": fwd, "attention": (B, seq_len, D)}
        # issue 27's sites inside the computation (replay.run.protocol.INNER_SITES), per device and layer
        m, S = self.model, seq_len
        hid = (X, E // X, B, C, m.d_ff) if ep else (B, E, C, m.d_ff)
        out.update({"ffn_up": hid, "ffn_down": hid, "ffn_up_grad_input": hid, "ffn_up_grad_weight": hid,
                    "ffn_down_grad_input": fwd, "ffn_down_grad_weight": fwd,
                    "attn_scores": (B, m.n_heads, S, S), "attn_probs": (B, m.n_heads, S, S),
                    "attn_pv": (B, S, m.n_heads, m.head_dim), "router_logits": (B, S, E), "host_batch": (B, S)})
        if ep:
            out.update({k: fwd for k in TRANSIT_SITES})
        return out

    def site_bits(self, where: str) -> int:
        """Bits of one element of the buffer a fault at ``where`` hits (32 for the float32 attention scores
        and router logits and the int32 host batch, else the parameter dtype's)."""
        if where in ("attn_scores", "router_logits", "host_batch"):
            return 32
        if where in ("local_gradient", "expert_backward"):
            raise ValueError(f"{where}: a leaf's bits are its dtype's (leaf_dtypes)")
        return _leaf_bits(self.model.dtype)

    def link_of(self, mesh_shape: Mapping[str, int], global_batch: int, seq_len: int, fault: FaultSpec,
                device_coords: Mapping[int, Mapping[str, int]]) -> Optional[tuple[int, int]]:
        """``(sender, receiver)`` of a transit fault (``TRANSIT_SITES``): the receiver is the fault's device;
        the sender the device of its expert group whose part of the received buffer holds the element
        (part ``i`` of ``[X, ...]`` came from the ``i``-th device of the group). None for other sites."""
        if fault.where not in TRANSIT_SITES:
            return None
        shape = self.activation_shapes(mesh_shape, global_batch, seq_len)[fault.where]
        part = int(fault.element) // int(np.prod(shape[1:]))
        mine = dict(device_coords[fault.device_id])
        want = {**mine, "expert": part}
        sender = next(int(d) for d, c in device_coords.items() if dict(c) == want)
        return sender, int(fault.device_id)

    def state_shardings(self, mesh: Mesh) -> dict[str, Any]:
        """Shardings of the train state: AdamW moments follow their parameters."""
        psh = self.param_shardings(mesh)
        abstract_opt = jax.eval_shape(self.optimizer.init, self._abstract_params)
        osh = optax.tree_map_params(
            self.optimizer, lambda _, s: s, abstract_opt, psh,
            transform_non_params=lambda _: NamedSharding(mesh, P()),
        )
        return {"params": psh, "opt_state": osh, "router_bias": NamedSharding(mesh, P())}

    def abstract_state(self, mesh: Mesh) -> dict[str, Any]:
        """``jax.ShapeDtypeStruct`` tree of the state with shardings (an Orbax restore target)."""
        sh = self.state_shardings(mesh)
        shapes = {"params": self._abstract_params, "opt_state": jax.eval_shape(self.optimizer.init, self._abstract_params),
                  "router_bias": jax.ShapeDtypeStruct(self._bias_shape, jnp.float32)}
        return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, sh)

    @property
    def _bias_shape(self) -> tuple[int, int]:
        return (self.model.n_layers, self.model.n_experts)

    @staticmethod
    def batch_sharding(mesh: Mesh) -> NamedSharding:
        """Rows over every mesh axis (``("data", "expert", ...)``), sequence unsplit."""
        return NamedSharding(mesh, P(tuple(mesh.axis_names), None))

    # ------------------------------------------------------------------ protocol

    def init_state(self, mesh: Mesh, seed: int) -> dict[str, Any]:
        """Fresh parameters from ``jax.random.key(seed)`` and AdamW state, placed on ``mesh``."""
        sh = self.state_shardings(mesh)
        params = self.init_params(mesh, seed)
        key = ("opt_init", mesh)
        if key not in self._compiled:
            self._compiled[key] = jax.jit(self.optimizer.init, out_shardings=sh["opt_state"])
        opt_state = self._compiled[key](params)
        bias = jax.device_put(np.zeros(self._bias_shape, np.float32), sh["router_bias"])
        return {"params": params, "opt_state": opt_state, "router_bias": bias}

    def init_params(self, mesh: Mesh, seed: int) -> Any:
        """The parameters of :meth:`init_state` alone (canary weights need no optimizer state)."""
        key = ("init", mesh)
        if key not in self._compiled:  # compiled once per mesh (a run per seed reuses it)
            self._compiled[key] = jax.jit(lambda k: init_params(self.model, k), out_shardings=self.param_shardings(mesh))
        return self._compiled[key](jax.random.key(seed))

    def restore(self, run_dir: str, step: int, mesh: Mesh) -> tuple[dict[str, Any], Mapping[str, Any]]:
        """Restores, read-only, the checkpoint of ``step`` under ``<run_dir>/checkpoints`` onto ``mesh``.

        Raises:
          FileNotFoundError: no complete checkpoint at ``step``.
        """
        from replay.reference import checkpoint

        return checkpoint.restore(os.path.join(run_dir, CHECKPOINTS_DIR), step, self.abstract_state(mesh))

    def save(self, run_dir: str, step: int, state: Mapping[str, Any], loader_state: Mapping[str, Any]) -> None:
        """Saves ``state`` and ``loader_state`` as checkpoint ``step`` under ``<run_dir>/checkpoints`` and
        waits for its commit (the optional protocol method drills write a faulty run's state with)."""
        from replay.reference import checkpoint

        mngr = checkpoint.manager(os.path.join(run_dir, CHECKPOINTS_DIR))
        try:
            checkpoint.save(mngr, step, state, loader_state)
            mngr.wait_until_finished()
        finally:
            mngr.close()

    def fault_array(self, fault: Optional[FaultSpec], step: Optional[int], mesh_ids: Sequence[int], *,
                    sizes: Optional[Mapping[str, Any]] = None) -> np.ndarray:
        """``int32[9] = [enabled, device_id, leaf_index, element, bit, site, layer, mode, value]`` for the traced
        fault input (``replay.reference.model.FAULT_LEN``; ``site``: the index of ``fault.where`` in
        ``replay.run.protocol.FAULT_SITES``; ``layer``: the fault's layer, -1 for a local-gradient one).

        ``enabled`` is 1 when ``fault`` is given and (``step`` is None or ``fault.step == step``).

        Args:
          sizes: the step's buffer sizes (:meth:`fault_sizes`) to check ``element`` against; without
            them a leaf's element is checked against the whole leaf and an activation's not at all
            (``flip_bit`` clips it into range).

        Raises:
          FaultSpecError: unknown leaf, layer or device, an ``expert_backward`` leaf that is not an
            expert weight, element outside the buffer, or bit outside ``[0, bits of the dtype)``.
        """
        if fault is None or (step is not None and fault.step != step):
            return np.zeros(FAULT_LEN, np.int32)
        where = fault.where
        if where == "optimizer_update":
            return self._state_fault_array(fault, mesh_ids, sizes)
        if where in ("local_gradient", "expert_backward"):
            if fault.leaf not in self.leaf_paths:
                raise FaultSpecError(f"fault.leaf {fault.leaf!r} is not a parameter leaf; leaves: {self.leaf_paths}")
            i = self.leaf_paths.index(fault.leaf)
            if where == "expert_backward" and not is_expert_leaf(fault.leaf):
                experts = [p for p in self.leaf_paths if is_expert_leaf(p)]
                raise FaultSpecError(f"fault.leaf {fault.leaf!r}: an expert_backward fault hits an expert weight's "
                                     f"gradient; expert leaves: {experts}")
            size = (sizes or {}).get("leaves", self.leaf_sizes)[i]
            layer = leaf_layer(fault.leaf) if where == "expert_backward" else -1
            dtype, what = self.leaf_dtypes[i], fault.leaf
        elif where == "host_batch":
            i, layer = 0, -1
            size = (sizes or {}).get(where)
            dtype, what = jnp.int32, "the device's rows of the batch's inputs"
        else:
            i, layer = 0, int(fault.layer)
            if not 0 <= layer < self.model.n_layers:
                raise FaultSpecError(f"fault.layer {layer} outside [0, {self.model.n_layers})")
            if where in TRANSIT_SITES and self.model.dispatch != "all_to_all":
                raise FaultSpecError(f"fault.where {where!r}: a transit fault needs model.dispatch all_to_all "
                                     "(with gather dispatch nothing is exchanged)")
            size = (sizes or {}).get(where)
            dtype = jnp.float32 if where in ("attn_scores", "router_logits") else self.model.dtype
            what = f"the {where} buffer of layer {layer}"
        if size is not None and not 0 <= fault.element < size:
            raise FaultSpecError(f"fault.element {fault.element} outside [0, {size}) for {what}")
        return _fault_row(fault, i, layer, where, dtype, what, mesh_ids)

    def _state_fault_array(self, fault: FaultSpec, mesh_ids: Sequence[int], sizes: Optional[Mapping[str, Any]]
                           ) -> np.ndarray:
        """:meth:`fault_array` of an ``optimizer_update`` fault: ``leaf_index`` indexes
        :attr:`state_leaf_paths`, ``element`` the device's local shard of that state leaf."""
        if fault.leaf not in self.state_leaf_paths:
            raise FaultSpecError(f"fault.leaf {fault.leaf!r}: an optimizer_update fault names a leaf of the train "
                                 f"state; leaves: {self.state_leaf_paths}")
        i = self.state_leaf_paths.index(fault.leaf)
        size = (sizes or {}).get("state")
        size = size[i] if size is not None else None
        if size is not None and not 0 <= fault.element < size:
            raise FaultSpecError(f"fault.element {fault.element} outside [0, {size}) for the device's shard of "
                                 f"{fault.leaf}")
        dtype = jax.tree_util.tree_leaves(self._abstract_state_shapes())[i].dtype
        return _fault_row(fault, i, -1, "optimizer_update", dtype, fault.leaf, mesh_ids)

    def _abstract_state_shapes(self) -> dict[str, Any]:
        return {"params": self._abstract_params, "opt_state": jax.eval_shape(self.optimizer.init, self._abstract_params),
                "router_bias": jax.ShapeDtypeStruct(self._bias_shape, jnp.float32)}

    def local_state_sizes(self, mesh: Mesh) -> list[int]:
        """Per leaf of the train state (:attr:`state_leaf_paths` order) the element count of one device's
        shard on ``mesh``: the range of an ``optimizer_update`` fault's ``element``."""
        shapes = jax.tree_util.tree_leaves(self._abstract_state_shapes())
        shardings = jax.tree_util.tree_leaves(self.state_shardings(mesh))
        return [int(np.prod(sh.shard_shape(x.shape))) for x, sh in zip(shapes, shardings)]

    def _poison(self, mesh: Mesh, state: Any, fault) -> Any:
        """The ``optimizer_update`` fault site: corrupts (``model.corrupt_element``: a bit flip, a scale or a
        set value) one element of its device's copy of one leaf of the updated ``state`` (inside ``shard_map``, so a replicated leaf's copy on that device alone
        changes); with the fault off every leaf is bit-identical (``flip_bit`` XORs 0)."""
        specs = jax.tree_util.tree_map(lambda sh: sh.spec, self.state_shardings(mesh))
        dev_table = jnp.asarray([d.id for d in mesh.devices.reshape(-1)], jnp.int32)

        def per_device(st, f):
            leaves, treedef = jax.tree_util.tree_flatten(st)
            hit = (f[0] == 1) & (f[1] == dev_table[self._linear_index(mesh)]) & (f[5] == SITE_CODE["optimizer_update"])
            out = [corrupt_element(x, f, hit & (f[2] == i)) if jnp.issubdtype(x.dtype, jnp.floating) else x
                   for i, x in enumerate(leaves)]
            return jax.tree_util.tree_unflatten(treedef, out)

        return jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P()), out_specs=specs, check_vma=False)(state, fault)

    def fault_sizes(self, mesh: Mesh, global_batch: int, seq_len: int) -> dict[str, Any]:
        """What :meth:`fault_array` checks elements against on ``mesh`` for a ``[global_batch,
        seq_len]`` batch: ``{"leaves": local leaf sizes, "expert_forward": n, "attention": n}``."""
        shape = dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape)))
        acts = self.activation_shapes(shape, global_batch, seq_len)
        return {"leaves": self.local_leaf_sizes(shape), **{k: int(np.prod(v)) for k, v in acts.items()},
                "state": self.local_state_sizes(mesh)}

    def drift_array(self, drift: Optional[DriftSpec], step: int, mesh_ids: Sequence[int]) -> np.ndarray:
        """``float32[4] = [enabled, device_id, kind (0 scale, 1 bias, 2 expert output), magnitude]`` for the traced
        drift input; ``enabled`` is 1 when ``drift`` is given and active at ``step``.

        Raises:
          FaultSpecError: the device is not in the mesh.
        """
        if drift is None or not drift.active(step):
            return np.zeros(4, np.float32)
        if drift.device_id not in mesh_ids:
            raise FaultSpecError(f"drift.device_id {drift.device_id} not in the mesh's devices {sorted(mesh_ids)}")
        if drift.kind == "expert_output" and self.model.dispatch != "all_to_all":
            raise FaultSpecError("drift.kind expert_output: the device's experts are its own only under expert "
                                 "parallelism (model.dispatch all_to_all)")
        kind = {"scale": 0, "bias": 1, "expert_output": 2}[drift.kind]
        return np.asarray([1, drift.device_id, kind, drift.magnitude], np.float32)

    @staticmethod
    def split_faults(fault: Any, step: Optional[int]) -> tuple[Optional[FaultSpec], Optional[DriftSpec]]:
        """The bit flip firing at ``step`` and the drift active there, from ``fault``: a
        :class:`FaultSpec`, a :class:`DriftSpec`, a sequence of them (an intermittent fault: flips
        at several steps), or None. ``step`` None: the first flip, whatever its step."""
        items = [] if fault is None else list(fault) if isinstance(fault, (list, tuple)) else [fault]
        flips = [f for f in items if isinstance(f, FaultSpec) and (step is None or f.step == step)]
        drifts = [f for f in items if isinstance(f, DriftSpec) and (step is None or f.active(step))]
        bad = [f for f in items if not isinstance(f, (FaultSpec, DriftSpec))]
        if bad:
            raise FaultSpecError(f"a fault must be a FaultSpec or a DriftSpec, got {type(bad[0]).__name__}")
        if len(flips) > 1 or len(drifts) > 1:
            raise FaultSpecError(f"at most one bit flip and one drift per step; step {step} has "
                                 f"{len(flips)} and {len(drifts)}")
        return (flips[0] if flips else None), (drifts[0] if drifts else None)

    def _inject(self, grads, fault, device_id):
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        hit_dev = (fault[0] == 1) & (fault[1] == device_id) & (fault[5] == SITE_CODE["local_gradient"])
        out = [corrupt_element(g, fault, hit_dev & (fault[2] == i)) for i, g in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, out)

    @staticmethod
    def _drift(grads, drift, device_id):
        """Applies the traced drift (``drift_array``) on its device; a ``lax.cond``, so the healthy
        step computes nothing for it."""

        def hit(gs):
            m = drift[3]

            def one(g):
                gf = g.astype(jnp.float32)
                rms = jnp.sqrt(jnp.mean(gf * gf))
                return jnp.where(drift[2] == 0, gf * (1.0 + m), gf + m * rms).astype(g.dtype)

            return jax.tree_util.tree_map(one, gs)

        on = (drift[0] == 1) & (drift[1] == device_id.astype(jnp.float32)) & (drift[2] < 2)  # 2: in the forward pass
        return jax.lax.cond(on, hit, lambda gs: gs, grads)

    @staticmethod
    def _linear_index(mesh: Mesh):
        """Inside ``shard_map``: this device's row-major position in ``mesh`` (traced int32)."""
        lin = 0
        for a in mesh.axis_names:
            lin = lin * mesh.shape[a] + jax.lax.axis_index(a)
        return lin

    def _step_fn(self, mesh: Mesh, global_batch: int, keep_local: bool = False):
        """The compiled step on ``mesh`` (cached): ``step(state, batch, fault, drift) -> (new_state, out)``,
        its per-device part a ``shard_map`` (:meth:`_per_device_fn`) inside the jitted update
        (:meth:`_update_fn`). ``keep_local``: also return each device's local and the reduced gradient."""
        key = ("step", mesh, global_batch, self.fingerprints, self.signals, self.sends, keep_local)
        if key in self._compiled:
            return self._compiled[key]
        lay = self._step_layout(mesh)
        sharded_fn = jax.shard_map(
            self._per_device_fn(lay, keep_local),
            mesh=mesh,
            in_specs=(lay.param_specs, P(), P(lay.axes), P(), P(), P(), P()),
            out_specs=(lay.param_specs, self._out_specs(lay, keep_local)),
            check_vma=False,  # grads of replicated params stay local until our psum
        )
        b_sh, rep = self.batch_sharding(mesh), NamedSharding(mesh, P())
        fn = jax.jit(
            self._update_fn(lay, sharded_fn, global_batch),
            in_shardings=(self.state_shardings(mesh), {k: b_sh for k in BATCH_KEYS}, rep, rep),
            out_shardings=(self.state_shardings(mesh), rep),
        )
        self._compiled[key] = fn
        return fn

    def _step_layout(self, mesh: Mesh) -> "_StepLayout":
        ep = self.expert_parallel(mesh)
        axes = tuple(mesh.axis_names)
        others = tuple(a for a in axes if a != "expert")
        treedef = jax.tree_util.tree_structure(self._abstract_params)
        # Under expert parallelism an expert leaf is one shard per device of the expert axis, reduced
        # over the other axes only; every other leaf is whole on every device, reduced over all.
        sharded = tuple(ep is not None and is_expert_leaf(p) for p in self.leaf_paths)
        return _StepLayout(
            mesh=mesh, axes=axes, ep=ep, treedef=treedef, sharded=sharded, others=others,
            dev_table=jnp.asarray([d.id for d in mesh.devices.reshape(-1)], jnp.int32),
            param_specs=jax.tree_util.tree_unflatten(treedef, [P("expert") if s else P() for s in sharded]),
            n_others=int(np.prod([mesh.shape[a] for a in others])),
            shard_rows=self.model.n_experts // ep.size if ep is not None else 0,
            take_sends=self.fingerprints and self.sends and ep is not None)

    def _out_specs(self, lay: "_StepLayout", keep_local: bool) -> dict[str, Any]:
        """The partition specs of the per-device part's outputs (besides the reduced gradient)."""
        axes = lay.axes
        specs = {"loss": P(), "stats": P(), "max_logit": P()}
        if self.fingerprints:
            specs.update(devices=P(axes), leaves=P())
        if lay.take_sends:
            specs.update(sends=P(axes), recvs=P(axes))
        if self.signals:
            specs.update(dev_norm_sq=P(axes), dev_nonfinite=P(axes), dev_dot=P(axes))
            if lay.ep is not None:
                specs.update(recv_tokens=P(axes), out_sq=P(axes), probe=P(axes))
        if keep_local:
            specs.update(local_grads=P(axes), reduced_grads=lay.param_specs)
        return specs

    def _per_device_fn(self, lay: "_StepLayout", keep_local: bool):
        """The per-device body of the step (inside ``shard_map``): this device's loss and gradient (the
        drill's faults planted), what it fingerprints before the reduction (:meth:`_local_outputs`), the
        reduction, and what it fingerprints of the reduced gradient (:meth:`_reduced_outputs`)."""
        cfg, mesh, ep = self.model, lay.mesh, lay.ep
        instrumented = self.fingerprints or self.signals
        rate = cfg.router_bias_rate

        def per_device(params, bias, batch, fault, drift, total_tokens, total_rows):
            dev = lay.dev_table[self._linear_index(mesh)]
            xi = jax.lax.axis_index("expert") if ep is not None else 0
            hooks = Hooks(fault=fault if instrumented else None, device=dev, drift=drift if self.signals else None)

            def loss_fn(p, probes):
                return local_loss(p, batch, cfg, total_tokens, total_rows, bias if rate > 0 else None, ep=ep,
                                  hooks=dataclasses.replace(hooks, probes=probes))

            probe_ct = None
            if lay.take_sends:  # the backward pass's send fingerprints come back as the probes' cotangents
                (loss_c, aux), (grads, probe_ct) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
                    params, jnp.zeros((cfg.n_layers, 2, 1 + ep.size, 4), jnp.float32))
            else:
                (loss_c, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, None)
            aux = dict(aux)
            if instrumented:
                grads = self._drift(self._inject(grads, fault, dev), drift, dev)
            local = jax.tree_util.tree_leaves(grads)
            out = self._local_outputs(lay, local, xi, aux, probe_ct)
            if keep_local:
                out["local_grads"] = jax.tree_util.tree_map(lambda g: g[None], grads)
            reduced = [jax.lax.psum(g, lay.others) if s else jax.lax.psum(g, lay.axes)
                       for g, s in zip(local, lay.sharded)]
            grads = jax.tree_util.tree_unflatten(lay.treedef, reduced)
            if keep_local:
                out["reduced_grads"] = grads
            out.update(self._reduced_outputs(lay, local, reduced, xi))
            out["loss"] = jax.lax.psum(loss_c, lay.axes)
            out["stats"] = jax.lax.psum({k: v for k, v in aux.items() if k != "max_logit"}, lay.axes)
            out["max_logit"] = jax.lax.pmax(aux["max_logit"], lay.axes)
            return grads, out

        return per_device

    def _local_outputs(self, lay: "_StepLayout", local: list, xi, aux: dict, probe_ct) -> dict[str, Any]:
        """Inside ``shard_map``, before the reduction: this device's gradient fingerprints (``devices``), under
        expert parallelism what it sent and received at each all-to-all (``sends``, ``recvs``), and its
        screening signals (``dev_norm_sq``, ``dev_nonfinite``, ``recv_tokens``, ``out_sq``, ``probe``). Takes the
        model's exchange outputs out of ``aux``, leaving the router statistics."""
        n_layers = self.model.n_layers
        fwd_sends, kept = aux.pop("sends", None), aux.pop("kept")
        fwd_recvs, out_sq, probe = aux.pop("recvs", None), aux.pop("out_sq", None), aux.pop("probe", None)
        out = {}
        if self.fingerprints:
            out["devices"] = jnp.stack([
                fpm.fingerprint_row_block(g, 0, 1, counts=False, row_offset=xi * lay.shard_rows) if s
                else fpm.fingerprint(g, counts=False) for g, s in zip(local, lay.sharded)])[None]
        if lay.take_sends:  # [4L, 2] lanes, in program order (replay.run.protocol.send_sites_in_program_order)
            bwd = probe_fingerprints(probe_ct)  # [L, (combine, dispatch), 1 + X, 2]: send, then each part received
            order = [fwd_sends[i, k] for i in range(n_layers) for k in (0, 1)]
            order += [bwd[i, k, 0] for i in reversed(range(n_layers)) for k in (0, 1)]
            out["sends"] = jnp.stack(order)[None]
            got = [fwd_recvs[i, k] for i in range(n_layers) for k in (0, 1)]
            got += [bwd[i, k, 1:] for i in reversed(range(n_layers)) for k in (0, 1)]
            out["recvs"] = jnp.stack(got)[None]  # [1, 4L, X, 2], the sites' order
        if self.signals:  # the local contribution, before the reduction: float32 sums of squares
            sq = jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in local])
            out["dev_norm_sq"] = jnp.sum(sq)[None]
            out["dev_nonfinite"] = jnp.stack([jnp.sum(~jnp.isfinite(g), dtype=jnp.int32) for g in local])[None]
            if lay.ep is not None:  # tokens this device's experts received from its expert group, per layer
                group = jax.lax.psum(kept, "expert").reshape(n_layers, lay.ep.size, lay.shard_rows)
                out["recv_tokens"] = jnp.sum(jnp.take(group, xi, axis=1), axis=-1)[None]
                if out_sq is not None:  # [1, L]: sum of squares of this device's experts' output per layer
                    out["out_sq"] = out_sq[None]
                if probe is not None:  # [1, L, 2]: its experts' output for the probe token (model._expert_probe)
                    out["probe"] = probe[None]
        return out

    def _reduced_outputs(self, lay: "_StepLayout", local: list, reduced: list, xi) -> dict[str, Any]:
        """Inside ``shard_map``, after the reduction: ``<g_d, g>`` (``dev_dot``) and the reduced gradient's
        fingerprints (``leaves``)."""
        out = {}
        if self.signals:  # <g_d, g> (over the part of g the device holds): sums over devices to ||g||^2
            dots = [jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32)) for a, b in zip(local, reduced)]
            out["dev_dot"] = jnp.sum(jnp.stack(dots))[None]
        if self.fingerprints:
            # each device fingerprints one row block of the reduced gradient (of an expert leaf's
            # shard: one block per device of the other axes); the uint32 partials add up to the
            # whole leaf's fingerprint
            lin, o = self._linear_index(lay.mesh), lay.others_index()
            parts = [fpm.fingerprint_row_block(g, o, lay.n_others, row_offset=xi * lay.shard_rows) if s
                     else fpm.fingerprint_row_block(g, lin, lay.mesh.size) for g, s in zip(reduced, lay.sharded)]
            out["leaves"] = jax.lax.psum(jnp.stack(parts), lay.axes)
        return out

    def _update_fn(self, lay: "_StepLayout", sharded_fn, global_batch: int):
        """The jitted step around the per-device part: a ``host_batch`` drill's flipped token, the
        reduction's inputs, the global gradient norm, the AdamW update, the router bias, an
        ``optimizer_update`` drill's poisoned copy."""
        opt, rate, mesh = self.optimizer, self.model.router_bias_rate, lay.mesh
        instrumented = self.fingerprints or self.signals
        n_dev, dev_table = mesh.size, lay.dev_table

        def step(state, batch, fault, drift):
            batch = {k: batch[k] for k in BATCH_KEYS}
            if instrumented:  # a host_batch drill: one token of the device's rows, after the loader handed it over
                rows_per, seq = global_batch // n_dev, batch["inputs"].shape[1]
                pos = jnp.argmax(dev_table == fault[1]).astype(jnp.int32)
                hit = (fault[0] == 1) & (fault[5] == SITE_CODE["host_batch"])
                batch["inputs"] = fpm.flip_bit(batch["inputs"], pos * rows_per * seq + fault[3], fault[4], hit)
            total_tokens = count_target_tokens(batch)
            # Rows as a traced value, as local_gradients passes it (XLA may compile a
            # constant divisor as a multiply by its reciprocal, which rounds differently).
            total_rows = jnp.asarray(batch["inputs"].shape[0], jnp.float32) + fault[0].astype(jnp.float32) * 0
            grads, out = sharded_fn(state["params"], state["router_bias"], batch, fault, drift, total_tokens,
                                    total_rows)
            grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(grads)))
            updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            bias = state["router_bias"]
            if rate > 0:
                bias = router_bias_update(bias, out["stats"]["assigned"], rate)
            out["grad_norm"] = grad_norm
            out["batch"] = fpm.fingerprint(batch["inputs"])
            new_state = {"params": params, "opt_state": opt_state, "router_bias": bias}
            if instrumented:  # the optimizer_update fault site: after the update, gradients right
                new_state = self._poison(mesh, new_state, fault)
            return new_state, out

        return step

    def _fault_inputs(self, fault: Any, step: int, ids: Sequence[int], mesh: Mesh, batch: Mapping[str, Any]
                      ) -> tuple[np.ndarray, np.ndarray]:
        flip, drift = self.split_faults(fault, step)
        sizes = None
        if flip is not None:
            rows, seq_len = (int(n) for n in batch["inputs"].shape)
            sizes = self.fault_sizes(mesh, rows, seq_len)
        fault_arr, drift_arr = self.fault_array(flip, step, ids, sizes=sizes), self.drift_array(drift, step, ids)
        if (fault_arr[0] or drift_arr[0]) and not (self.fingerprints or self.signals):
            raise FaultSpecError("fault injection needs a trainer built with fingerprints or signals")
        return fault_arr, drift_arr

    def device_contributions(
        self, state: Mapping[str, Any], batch: Mapping[str, Any], step: int, fault: Any = None
    ) -> tuple[dict[int, Any], Any, StepFingerprints]:
        """Runs :meth:`train_step`'s program with each device's local gradient and the reduced
        gradient as extra outputs (no update is kept).

        For triage that needs the numbers, not only their fingerprints, and for the test
        that the per-device fingerprints are those of the contributions and that the
        contributions sum (in device order) to the reduced gradient. Extra outputs can
        change how XLA fuses the program, so compare these values with this call's own
        fingerprints (the third result).

        Returns:
          ``({device id: grads pytree (host NumPy)}, reduced grads (host NumPy), fingerprints)``.
        """
        mesh = jax.tree_util.tree_leaves(state["params"])[0].sharding.mesh
        ids = [int(d.id) for d in mesh.devices.reshape(-1)]
        rows = int(batch["inputs"].shape[0])
        fault_arr, drift_arr = self._fault_inputs(fault, step, ids, mesh, batch)
        _, out = self._step_fn(mesh, rows, keep_local=True)(state, batch, fault_arr, drift_arr)
        out = jax.device_get(out)
        local, reduced = out.pop("local_grads"), out.pop("reduced_grads")
        per = {dev: jax.tree_util.tree_map(lambda g, r=r: g[r], local) for r, dev in enumerate(ids)}
        return per, reduced, self._to_fingerprints(step, out, ids, device_coords(mesh), rows)

    def train_step(
        self, state: Mapping[str, Any], batch: Mapping[str, Any], step: int, fault: Any = None
    ) -> tuple[dict[str, Any], StepFingerprints]:
        """One AdamW step on the global ``batch``; returns ``(new_state, fingerprints)``.

        Args:
          state: ``{"params", "opt_state", "router_bias"}`` on a mesh from :func:`make_mesh`.
          batch: the six int32 ``[global_batch, seq_len]`` arrays of
            ``replay.reference.model.BATCH_KEYS`` (global ``jax.Array`` or NumPy);
            ``global_batch`` must divide by the device count.
          step: the global step (recorded; selects whether ``fault`` fires).
          fault: a drill (``split_faults``): a :class:`FaultSpec` flips the named bit in device
            ``fault.device_id``'s local gradient before the reduction when ``fault.step == step``;
            a :class:`DriftSpec` changes that device's local gradient while it is active; a
            list of them combines (e.g. flips at several steps).

        The fingerprints' ``signals`` (when the trainer computes them) hold the step's
        :class:`StepSignals` without timings (the training loop adds those).

        Raises:
          ValueError: batch keys missing, or rows not divisible by the device count.
          FaultSpecError: the fault names no existing leaf/element/bit/device.
        """
        mesh = jax.tree_util.tree_leaves(state["params"])[0].sharding.mesh
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(f"batch lacks keys {missing}; needs {list(BATCH_KEYS)}")
        rows = int(batch["inputs"].shape[0])
        if rows % mesh.size:
            raise ValueError(f"global batch {rows} must be a multiple of the device count {mesh.size}")
        ids = [int(d.id) for d in mesh.devices.reshape(-1)]
        fault_arr, drift_arr = self._fault_inputs(fault, step, ids, mesh, batch)
        new_state, out = self._step_fn(mesh, rows)(state, batch, fault_arr, drift_arr)
        out = jax.device_get(out)
        return new_state, self._to_fingerprints(step, out, ids, device_coords(mesh), rows)

    def _router_layers(self, out, rows) -> tuple[RouterLayerStats, ...]:
        st = out["stats"]
        layers = []
        for i in range(self.model.n_layers):
            assigned = np.asarray(st["assigned"][i], np.float64)
            total = float(assigned.sum())
            tokens = max(float(st["tokens"][i]), 1.0)
            layers.append(RouterLayerStats(
                entropy=float(st["entropy_sum"][i]) / tokens,
                expert_share=tuple(float(a / total) if total else 0.0 for a in assigned),
                dropped_fraction=float(st["dropped"][i]) / total if total else 0.0,
                max_logit=float(out["max_logit"][i]),
                z_loss=float(st["z_sum"][i]) / tokens,
                aux_loss=float(st["lb_sum"][i]) / rows,
            ))
        return tuple(layers)

    def _signals(self, step, out, ids, rows) -> StepSignals:
        devices, replicas = {}, []
        for r, dev in enumerate(ids):
            counts = out["dev_nonfinite"][r]
            devices[dev] = {"norm_sq": float(out["dev_norm_sq"][r]),
                            "nonfinite": {p: int(counts[i]) for i, p in enumerate(self.leaf_paths) if counts[i]}}
            replicas.append(ReplicaNorm(replica=r, devices=(dev,), norm_sq=float(out["dev_norm_sq"][r]),
                                        dot=float(out["dev_dot"][r])))
        load = ()
        if "recv_tokens" in out:
            recv = np.asarray(out["recv_tokens"])  # [devices, L]
            sq = np.asarray(out["out_sq"]) if "out_sq" in out else None  # [devices, L]
            probe = np.asarray(out["probe"]) if "probe" in out else None  # [devices, L, 2]
            load = tuple(ExpertLoad.from_counts({dev: int(round(float(recv[r, i]))) for r, dev in enumerate(ids)},
                                                None if sq is None else {dev: float(sq[r, i]) for r, dev in enumerate(ids)},
                                                None if probe is None else
                                                {dev: fpm.fingerprint_int(probe[r, i]) for r, dev in enumerate(ids)})
                         for i in range(recv.shape[1]))
        return StepSignals(step=int(step), loss=float(out["loss"]), grad_norm=float(out["grad_norm"]),
                           replicas=tuple(replicas), devices=devices, router=self._router_layers(out, rows),
                           expert_load=load)

    def _to_fingerprints(self, step, out, ids, coords, rows) -> StepFingerprints:
        stats = out["stats"]
        assigned = np.asarray(stats["assigned"], np.float64).sum(axis=0)
        total_assigned = float(assigned.sum())
        tokens = max(float(np.sum(stats["tokens"])), 1.0)
        router = {
            "expert_share": [float(a / total_assigned) if total_assigned else 0.0 for a in assigned],
            "dropped_fraction": float(np.sum(stats["dropped"])) / total_assigned if total_assigned else 0.0,
            "entropy": float(np.sum(stats["entropy_sum"])) / tokens,
            "z_loss": float(np.sum(stats["z_sum"])) / tokens,
            "load_balance_loss": float(np.sum(stats["lb_sum"])) / (rows * self.model.n_layers),
            "loss": float(out["loss"]),
        }
        leaves, devices = {}, {}
        if "leaves" in out:
            leaves = {p: fpm.summarize(out["leaves"][i]) for i, p in enumerate(self.leaf_paths)}
            devices = {
                dev: {p: fpm.fingerprint_int(out["devices"][r, i]) for i, p in enumerate(self.leaf_paths)}
                for r, dev in enumerate(ids)
            }
        sites, sends, recvs = (), {}, {}
        if "sends" in out:
            sites = send_sites_in_program_order(self.model.n_layers)
            sends = {dev: tuple(fpm.fingerprint_int(out["sends"][r, k]) for k in range(len(sites)))
                     for r, dev in enumerate(ids)}
        if "recvs" in out:
            got = np.asarray(out["recvs"])  # [devices, sites, X, 2]
            recvs = {dev: tuple(tuple(fpm.fingerprint_int(got[r, k, i]) for i in range(got.shape[2]))
                                for k in range(len(sites))) for r, dev in enumerate(ids)}
        return StepFingerprints(
            step=int(step),
            loss_bits=int(np.asarray(out["loss"], np.float32).view(np.uint32)),
            grad_norm_bits=int(np.asarray(out["grad_norm"], np.float32).view(np.uint32)),
            batch_hash=fpm.fingerprint_hex(out["batch"]),
            leaves=leaves,
            devices=devices,
            router=router,
            device_coords=coords,
            send_sites=sites,
            sends=sends,
            recvs=recvs,
            signals=self._signals(step, out, ids, rows) if "dev_norm_sq" in out else None,
        )

    # ------------------------------------------------------------------ canary

    def _canary_fn(self, mesh: Mesh, rows: int):
        """jit(shard_map) over the run's mesh: every device computes the gradient of the same
        (replicated) canary batch with the same weights and fingerprints it: one program, all
        devices at once, so healthy devices agree bit for bit."""
        key = ("canary", mesh, rows)
        if key in self._compiled:
            return self._compiled[key]
        axes = tuple(mesh.axis_names)
        dev_table = jnp.asarray([d.id for d in mesh.devices.reshape(-1)], jnp.int32)
        cfg = self.model

        def per_device(params, batch, fault, drift, total_tokens, total_rows):
            dev = dev_table[self._linear_index(mesh)]
            # a persistent fault of the device fires here too: a fault inside the computation, and a drift
            # (the device's experts' output inside the forward pass, or its local gradient)
            hooks = Hooks(fault=fault, device=dev, drift=drift)
            (_, _), grads = jax.value_and_grad(local_loss, has_aux=True)(params, batch, cfg, total_tokens, total_rows,
                                                                         hooks=hooks)
            grads = self._drift(self._inject(grads, fault, dev), drift, dev)
            return jnp.stack([fpm.fingerprint(g, counts=False) for g in jax.tree_util.tree_leaves(grads)])[None]

        sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), P(), P(), P()), out_specs=P(axes),
                                check_vma=False)

        def fn(params, batch, fault, drift):
            batch = {k: batch[k] for k in BATCH_KEYS}
            total_rows = jnp.asarray(rows, jnp.float32) + fault[0].astype(jnp.float32) * 0
            return sharded(params, batch, fault, drift, count_target_tokens(batch), total_rows)

        rep = NamedSharding(mesh, P())
        self._compiled[key] = jax.jit(fn, in_shardings=(self.param_shardings(mesh), {k: rep for k in BATCH_KEYS}, rep,
                                                        rep), out_shardings=rep)
        return self._compiled[key]

    def canary_fingerprints(self, params: Any, batch: Mapping[str, Any], fault: Optional[FaultSpec] = None, *,
                            persistent: Any = None, step: Optional[int] = None) -> dict[int, dict[str, int]]:
        """Forward and backward of the whole canary ``batch`` on *every* device of ``params``'s
        mesh at once (no update): ``{device id: {leaf path: 64-bit fingerprint}}``.

        Args:
          params: the canary weights (e.g. :meth:`init_params`), on the run's mesh.
          batch: the six int32 ``[rows, S]`` arrays (host NumPy), replicated to every device.
          fault: a drill: flips its bit in device ``fault.device_id``'s canary gradient
            (``fault.step`` ignored).
          persistent: the training step's drill faults (:meth:`train_step`'s ``fault``): the
            :class:`DriftSpec` among them active at ``step`` (None: its first step) is a persistent fault
            of its device, and a device's persistent fault applies to every program that runs the faulty
            site on it, so it fires in the canary program too (``expert_output``: the output of every
            expert the device computes, here all of them; ``scale``/``bias``: its canary gradient). The
            one-step bit flips among them (:class:`FaultSpec`) belong to their training step only.

        Raises:
          FaultSpecError: the drift's device is not in the mesh, or an ``expert_output`` drift without
            expert parallelism (as :meth:`drift_array`).

        Healthy devices of one kind give identical values (one SPMD program on identical
        inputs, no collective inside); a device that computes wrong bits does not. The values
        are those of this program: they need not equal :meth:`single_device_fingerprints`'.
        """
        mesh = jax.tree_util.tree_leaves(params)[0].sharding.mesh
        ids = [int(d.id) for d in mesh.devices.reshape(-1)]
        rows = int(np.asarray(batch["inputs"]).shape[0])
        fault_arr = self.fault_array(fault, None, ids) if fault is not None else np.zeros(FAULT_LEN, np.int32)
        items = [] if persistent is None else list(persistent) if isinstance(persistent, (list, tuple)) else [persistent]
        drifts = [f for f in items if isinstance(f, DriftSpec) and (step is None or f.active(step))]
        drift_arr = self.drift_array(drifts[0], drifts[0].start if step is None else step, ids) if drifts \
            else np.zeros(4, np.float32)
        host = {k: np.asarray(batch[k], np.int32) for k in BATCH_KEYS}
        fps = np.asarray(jax.device_get(self._canary_fn(mesh, rows)(params, host, fault_arr, drift_arr)))
        return {dev: {p: fpm.fingerprint_int(fps[r, i]) for i, p in enumerate(self.leaf_paths)}
                for r, dev in enumerate(ids)}

    # ------------------------------------------------------------------ single device

    def _local_grad_fn(self, device):
        """jit(shard_map) over a one-device mesh with the step's axes (same body as the step)."""
        key = ("local", device.id)
        if key in self._compiled:
            return self._compiled[key]
        cfg = self.model
        axes = DEFAULT_AXES
        mesh1 = Mesh(np.asarray([device], dtype=object).reshape((1,) * len(axes)), axes)

        def per_device(params, batch, fault, total_tokens, total_rows):
            (loss, _), grads = jax.value_and_grad(local_loss, has_aux=True)(params, batch, cfg, total_tokens, total_rows)
            grads = self._inject(grads, fault, jnp.int32(device.id))
            fps = jnp.stack([fpm.fingerprint(g, counts=False) for g in jax.tree_util.tree_leaves(grads)])
            return grads, loss, fps

        sharded = jax.shard_map(
            per_device, mesh=mesh1, in_specs=(P(), P(axes), P(), P(), P()), out_specs=(P(), P(), P()),
            check_vma=False,
        )

        def fn(params, batch, fault, total_tokens, total_rows):
            batch = {k: batch[k] for k in BATCH_KEYS}
            return sharded(params, batch, fault, total_tokens, total_rows)

        self._compiled[key] = (jax.jit(fn), mesh1)
        return self._compiled[key]

    def local_gradients(
        self,
        state: Mapping[str, Any],
        batch: Mapping[str, Any],
        device: Any,
        *,
        total_tokens: Optional[float] = None,
        total_rows: Optional[int] = None,
        fault: Optional[FaultSpec] = None,
    ) -> tuple[Any, float, dict[str, int]]:
        """Forward and backward of ``batch`` on one ``device`` (no update, no collective).

        Args:
          state: a train state (any placement; parameters are copied to ``device``).
          batch: int32 ``[b, S]`` arrays (NumPy or jax).
          device: the ``jax.Device`` to run on.
          total_tokens / total_rows: normalizers of the loss contribution (defaults: this
            batch's own target-token count and rows, i.e. the batch alone is the global
            batch). Pass the global batch's values to recompute one device's share of a
            sharded step (its ``devices`` fingerprint).
          fault: flips its bit when ``fault.device_id == device.id`` (``fault.step`` ignored).

        Bits: results of this one-device program are reproducible and equal across healthy
        devices of one kind (what canaries need), but on XLA:CPU they can differ in the last
        bits from the same rows' share inside an 8-device step (measured: ULP-level
        differences in most leaves; the compiler emits different code for a one-device
        and a multi-device program). To recompute a device's share of a step bit for bit,
        run the step's mesh shape (:meth:`device_contributions` or :meth:`train_step`).

        Returns:
          ``(grads on device, loss contribution, {leaf path: 64-bit fingerprint})``.
        """
        params = jax.device_put(state["params"], device)
        b = {k: jax.device_put(np.asarray(batch[k], np.int32), device) for k in BATCH_KEYS}
        if total_tokens is None:
            total_tokens = float(np.sum(np.asarray(batch["targets_segmentation"]) != 0))
        if total_rows is None:
            total_rows = int(np.asarray(batch["inputs"]).shape[0])
        fault_arr = self.fault_array(fault, None, [device.id]) if fault is not None and fault.device_id == device.id \
            else np.zeros(FAULT_LEN, np.int32)
        fn, mesh1 = self._local_grad_fn(device)
        # Its own one-device mesh as the context mesh: inside a caller's ``jax.set_mesh(run mesh)``
        # shard_map would otherwise refuse a mesh that is not the context's.
        with jax.set_mesh(mesh1):
            grads, loss, fps = fn(
                params, b, jax.device_put(fault_arr, device),
                jax.device_put(np.float32(total_tokens), device), jax.device_put(np.float32(total_rows), device),
            )
        fps = np.asarray(fps)
        return grads, float(loss), {p: fpm.fingerprint_int(fps[i]) for i, p in enumerate(self.leaf_paths)}

    def single_device_fingerprints(
        self, state: Mapping[str, Any], batch: Mapping[str, Any], device: Any, fault: Optional[FaultSpec] = None
    ) -> dict[str, int]:
        """``{leaf path: 64-bit fingerprint}`` of the gradient of the whole ``batch`` on one device.

        For canary batches: the same state and batch on two healthy devices of one kind
        give identical values; a device that computes wrong bits does not. No update.
        """
        return self.local_gradients(state, batch, device, fault=fault)[2]


def numpy_batch(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Host copy of a batch's six arrays (int32)."""
    return {k: np.asarray(jax.device_get(batch[k]), np.int32) for k in BATCH_KEYS}


def device_rows(mesh: Mesh, global_batch: int) -> dict[int, slice]:
    """Per device id, the rows of the global batch it computes (``batch_sharding`` layout)."""
    n = mesh.size
    per = global_batch // n
    return {int(d.id): slice(r * per, (r + 1) * per) for r, d in enumerate(mesh.devices.reshape(-1))}
