"""A replay ``Trainer`` for MaxText runs: MaxText's model, optimizer and checkpoints; a step with per-device fingerprints.

MaxText's own ``train_step`` takes ``jax.value_and_grad`` over the whole global batch under GSPMD: the
data-parallel reduction happens inside XLA and no device's gradient before it is ever a value. This
step computes the same update in a form replay can check (``replay.run.probe``): one ``jax.shard_map``
over every axis of MaxText's mesh, in which each device runs MaxText's ``loss_fn`` forward and backward
on its own rows of the batch (MaxText's input sharding gives each device its rows), its gradient is
fingerprinted, the drill's faults (traced inputs) are applied to it, then a ``psum`` reduces; after it,
MaxText's gradient clipping and ``TrainStateNNX.apply_gradients`` (its optimizer) update the state.

**One device's contribution** (the MoE batch-level terms). MaxText's loss (``train.loss_fn``, 0.2.5) is
``L = xent_sum / (W + EPS) + moe_lb_loss``: ``xent_sum`` the cross entropy (z-loss included, as MaxText's
``cross_entropy_with_logits`` adds it) summed over the batch's target tokens, ``W`` the count of target
tokens (``targets_segmentation != 0``), ``moe_lb_loss`` the mean over MoE layers of each layer's
load-balancing loss, which MaxText computes *per sequence* (``RoutedMoE.load_balance_loss``: token
density and router probability averaged over each row, their product averaged over rows and experts).
A device's contribution here is

    c_d = xent_sum_d / W  +  moe_lb_loss_d / N

with ``xent_sum_d`` and ``moe_lb_loss_d`` MaxText's own terms over the device's rows (its ``B / N`` rows of
the global batch), ``W`` the *global* count of target tokens (a batch-level term, computed once before
the ``shard_map`` so that every device divides by the same number) and ``N`` the devices. Both terms are
sums or means of per-row quantities, so ``sum_d c_d = L`` exactly in real arithmetic (every device holds
the same number of rows; ``EPS`` is below float32's resolution of ``W >= 1``): the step's gradient is
MaxText's, summed in another order, and a device's contribution depends on its rows and the weights
alone. Tested: the loss and gradient norm of this step equal MaxText's own ``train_step``'s on the same
state and batch to float rounding, with ``load_balance_loss_weight > 0``.

**Expert parallelism.** Inside the ``shard_map`` every weight is whole on every device (the expert
weights, stored split over ``expert`` by MaxText, are gathered for the step, like the reference
trainer's ``dispatch: gather``): a device computes every expert for its own rows and exchanges nothing
before the reduction, so its gradient depends on its rows and the weights alone and a wrong number on
one chip shows in that chip's fingerprint only. MaxText's own step does the same work for the dense MoE
path (``sparse_matmul=false``): GSPMD all-gathers each layer's expert weights over ``expert`` and every
device computes all experts for its rows (its compiled program has the same matmuls, of the same
shapes, as this step's). MaxText's expert-parallel exchanges (``sparse_matmul=true``: a
``ragged_all_to_all``, or ``use_ring_of_experts``' all-gather and ``psum_scatter``) live inside its own
``shard_map`` in ``layers/moe.py``, which this step's ``shard_map`` cannot contain; docs/trainer.md
("The step, and what localization reaches") says what probing them takes.

Supported configs: those MaxText's step handles without its optional branches (no gradient
accumulation, host offload, diloco, MTP, router bias updates, QK-clip, dropless fallback, dropout):
:func:`check_config` names the key to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib
import json
import os
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from integrations.maxtext import internals

FACTORY = "integrations.maxtext.trainer:make_setup"
KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")


class MaxTextConfigError(ValueError):
    """A MaxText config this integration cannot train or replay (names the key and what to set)."""


# (config key, the value the step needs, why): what check_config refuses
_UNSUPPORTED = (
    ("gradient_accumulation_steps", 1, "gradient accumulation"),
    ("parameter_memory_host_offload", False, "parameter host offload"),
    ("optimizer_memory_host_offload", False, "optimizer host offload"),
    ("shard_optimizer_over_data", False, "optimizer sharding over data"),
    ("enable_diloco", False, "DiLoCo"),
    ("mtp_num_layers", 0, "multi-token prediction"),
    ("use_qk_clip", False, "QK-clip"),
    ("skip_step_on_spikes", False, "skipping steps on spikes"),
    ("enable_dropout", False, "dropout (its random masks would be the same on every device of the shard_map)"),
    ("use_multimodal", False, "multimodal inputs"),
)


def check_config(config: Any) -> None:
    """Raises :class:`MaxTextConfigError` for a MaxText option the fingerprinted step does not implement."""
    for key, want, what in _UNSUPPORTED:
        have = getattr(config, key, want)
        if have != want:
            raise MaxTextConfigError(f"MaxText config {key}={have!r}: {what} is not supported by the replayable step; "
                                     f"set {key}={want}")
    if getattr(config, "routed_bias", False) and getattr(config, "routed_bias_update_rate", 0.0) > 0:
        raise MaxTextConfigError("MaxText config routed_bias_update_rate > 0: router bias updates are not supported by "
                                 "the replayable step; set routed_bias_update_rate=0")
    fallback = getattr(config, "moe_dropless_fallback", None)
    if fallback not in (None, "None", "none", ""):
        raise MaxTextConfigError(f"MaxText config moe_dropless_fallback={fallback!r} is not supported; leave it None")


def maxtext_config(base_yml: str, overrides: Sequence[str], **extra: Any) -> Any:
    """MaxText's config (``pyconfig.initialize``) from its base YAML, ``key=value`` overrides and ``extra``
    (keyword overrides that win). ``dataset_type=grain`` is set so that MaxText's checkpoint keeps the
    iterator's state (``internals``: the checkpoint fallback for non-Grain iterators), with
    ``grain_train_files`` naming the loader (MaxText's config requires one; its Grain pipeline is never
    built, the loader is installed in its place)."""
    internals.decouple_gcloud()
    argv = ["integrations.maxtext", base_yml, *overrides, "dataset_type=grain", "grain_train_files=toolkit-loader",
            *[f"{k}={v}" for k, v in extra.items()]]
    return internals.get("maxtext.configs.pyconfig", "initialize")(argv)


@contextlib.contextmanager
def installed_iterator(make: Callable[[Any, Any], tuple[Any, Any]]):
    """Sets ``input_pipeline_interface.create_data_iterator`` to ``make`` (``(config, mesh) -> (train, eval)``)
    for the block: ``setup_train_loop`` imports it inside the function, so this reaches it."""
    name = "maxtext.input_pipeline.input_pipeline_interface"
    internals.get(name, "create_data_iterator")  # MaxTextMovedError, naming it, if a release moved it
    mod = importlib.import_module(name)
    old = mod.create_data_iterator
    mod.create_data_iterator = make
    try:
        yield
    finally:
        mod.create_data_iterator = old


@dataclasses.dataclass
class Context:
    """What MaxText's ``setup_train_loop`` built: config, mesh, checkpoint manager (or None), the train
    state's graph definition, the pure state, its shardings and the data iterator it was given."""

    config: Any
    mesh: Any
    checkpoint_manager: Any
    graphdef: Any
    state: Any
    state_shardings: Any
    iterator: Any


def setup(config: Any, make_iterator: Optional[Callable[[Any, Any], Any]] = None, devices=None) -> Context:
    """Runs MaxText's ``setup_train_loop`` with ``make_iterator(config, mesh)`` installed as its train iterator
    (None: an iterator that is never read) on ``devices`` (None: all)."""
    from flax import nnx

    check_config(config)

    def make(cfg, mesh):
        return (make_iterator(cfg, mesh) if make_iterator else iter(())), None

    with installed_iterator(make):
        out = internals.get("maxtext.utils.train_utils", "setup_train_loop")(config, None, devices)
    _, ckm, state_shardings, _, mesh, _, iterator, *_, train_state = out
    graphdef, state = nnx.split(train_state)
    return Context(config=config, mesh=mesh, checkpoint_manager=ckm, graphdef=graphdef, state=state,
                   state_shardings=state_shardings, iterator=iterator)


def iterator_state(checkpoint_dir: str, step: int) -> dict:
    """The loader state MaxText saved with checkpoint ``step`` (``<dir>/<step>/iter/process_*-of-*.json``;
    every process's file holds the same global state).

    Raises:
      FileNotFoundError: the checkpoint has no iterator state (names the folder).
    """
    files = sorted(glob.glob(os.path.join(checkpoint_dir, str(step), "iter", "process_*-of-*.json")))
    if not files:
        raise FileNotFoundError(f"{os.path.join(checkpoint_dir, str(step), 'iter')}: no loader state in MaxText "
                                "checkpoint (a run trained by integrations.maxtext.train saves one)")
    with open(files[0], encoding="utf-8") as f:
        return json.load(f)


def leaf_table(graphdef: Any, state: Any) -> tuple[list[str], list[int], list[Any]]:
    """``(paths, sizes, dtypes)`` of the model's parameter leaves (``jax.tree_util`` order of its ``nnx.Param``
    state): the leaves fingerprinted per device."""
    import jax
    from flax import nnx

    ts = nnx.merge(graphdef, state)
    _, params, _ = nnx.split(ts.model, nnx.Param, ...)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return ([jax.tree_util.keystr(p) for p, _ in flat], [int(np.prod(x.shape)) for _, x in flat],
            [x.dtype for _, x in flat])


def make_step(ctx: Context, leaf_paths: Sequence[str], fingerprints: bool = True) -> Callable:
    """The jitted step ``(state, batch, flip, drift) -> (state, out)`` on ``ctx.mesh`` (module docstring);
    ``out`` holds ``replay.run.probe``'s per-device and reduced fingerprints, loss, gradient norm and batch hash
    (``fingerprints=False``: the same step without the probe, loss and gradient norm only: what
    ``benchmarks/maxtext_step.py`` times it against)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from replay.run import fingerprint as fpm
    from replay.run import probe

    config, mesh, graphdef = ctx.config, ctx.mesh, ctx.graphdef
    axes, n = tuple(mesh.axis_names), int(mesh.size)
    loss_fn = internals.get("maxtext.trainers.pre_train.train", "loss_fn")
    clip = internals.get("maxtext.utils.maxtext_utils", "apply_gradient_clipping")

    def step(state, batch, flip, drift):
        ts = nnx.merge(graphdef, state)
        nnx.pop(ts.model, nnx.Intermediate)
        gdef, params, rest = nnx.split(ts.model, nnx.Param, ...)
        batch = {k: batch[k] for k in KEYS}
        total = jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32)  # W: a batch-level term

        def per_device(params, rest, b, total, flip, drift):
            def contribution(p):
                lm = nnx.merge(gdef, p, rest, copy=True)
                _, aux = loss_fn(lm, config, dict(b), None, None, is_train=True)
                return aux["xent_sum"] / total + aux["moe_lb_loss"] / n

            loss, grads = jax.value_and_grad(contribution)(params)
            if not fingerprints:
                return jax.lax.psum(grads, axes), jax.lax.psum(loss, axes)
            grads = probe.inject(grads, flip, drift, probe.device_id(mesh))
            reduced = jax.lax.psum(grads, axes)
            # the device's block of the batch hash (global row indices) and its loss contribution ride in
            # the probe's row: the step's per-device outputs leave in one all-gather
            rows = b["inputs"].shape[0]
            block = fpm.fingerprint(b["inputs"], global_shape=(rows * n, b["inputs"].shape[1]),
                                    offsets=(probe.linear_index(mesh) * rows, 0))
            extra = jnp.concatenate([jax.lax.bitcast_convert_type(loss, jnp.uint32)[None], block])
            return reduced, probe.row(grads, reduced, mesh, extra)

        grads, second = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P(), P(axes), P(), P(), P()),
            out_specs=(P(), P(axes) if fingerprints else P()), check_vma=False)(params, rest, batch, total, flip, drift)
        if fingerprints:
            out = probe.unrow(second, len(leaf_paths))
            extra = out.pop("extra")
            loss = jnp.sum(jax.lax.bitcast_convert_type(extra[:, 0], jnp.float32))
            out["batch"] = jnp.sum(extra[:, 1:5], axis=0, dtype=jnp.uint32)
        else:
            out, loss = {}, second
        grads = jax.tree_util.tree_map(lambda x: x.astype(config.grad_dtype) if x.dtype == jnp.float32 else x, grads)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(grads)))
        if config.gradient_clipping_threshold > 0:
            grads = clip(grads, None, config.gradient_clipping_threshold)
        ts.apply_gradients(grads)
        out = dict(out, loss=loss, grad_norm=norm)
        return nnx.state(ts, nnx.Not(nnx.Intermediate)), out

    rep = NamedSharding(mesh, P())
    data = {k: NamedSharding(mesh, P(axes)) for k in KEYS}
    return jax.jit(step, in_shardings=(ctx.state_shardings, data, rep, rep), out_shardings=(ctx.state_shardings, rep))


class MaxTextTrainer:
    """Implements ``replay.run.protocol.Trainer`` for a MaxText run (and the leaf table drills use).

    Args:
      base_yml, overrides: the run's MaxText config (as the launcher was given it).
      checkpoint_dir: the run's MaxText checkpoints (``<run>/checkpoints``).
      make_loader: ``(config, mesh) -> loader.DataLoader`` for the run's dataset and mixture.
    """

    def __init__(self, base_yml: str, overrides: Sequence[str], checkpoint_dir: str,
                 make_loader: Callable[[Any, Any], Any]):
        self.base_yml, self.overrides = base_yml, list(overrides)
        self.checkpoint_dir, self.make_loader = checkpoint_dir, make_loader
        self._contexts: dict = {}
        self._steps: dict = {}
        self._table: Optional[tuple] = None
        self._scratch = tempfile.mkdtemp(prefix="maxtext-replay-")
        self._made = 0

    # ------------------------------------------------------------------ contexts and the leaf table
    def context(self, devices: Sequence[Any], **extra: Any) -> Context:
        """MaxText's set-up on ``devices`` (its own mesh over them), ``extra`` overrides; its checkpoint manager
        points at an empty scratch folder (MaxText restores ``load_full_state_path`` only with checkpointing
        on, and only when its own folder has no checkpoint), never at the run's checkpoints."""
        self._made += 1
        devices = list(devices)
        if len(devices) == 1:  # one device (replay's lookups and canary): every parallelism the run set is 1
            extra = {**{o.split("=", 1)[0]: 1 for o in self.overrides
                        if o.startswith(("ici_", "dcn_")) and o.split("=", 1)[0].endswith("_parallelism")}, **extra}
        config = maxtext_config(self.base_yml, self.overrides, enable_checkpointing="true", async_checkpointing="false",
                                base_output_directory=self._scratch, run_name=f"replay{self._made}", **extra)
        ctx = setup(config, None, list(devices))
        self._contexts[tuple(int(d.id) for d in ctx.mesh.devices.reshape(-1))] = ctx
        if self._table is None:
            self._table = leaf_table(ctx.graphdef, ctx.state)
        return ctx

    def _table_or_build(self):
        if self._table is None:
            import jax

            size = int(np.prod([int(v) for v in self.mesh_shape])) if getattr(self, "mesh_shape", None) else None
            self.context(jax.devices()[:size] if size else jax.devices())
        return self._table

    @property
    def leaf_paths(self) -> list[str]:
        return self._table_or_build()[0]

    @property
    def leaf_sizes(self) -> list[int]:
        return self._table_or_build()[1]

    @property
    def leaf_dtypes(self) -> list[Any]:
        return self._table_or_build()[2]

    # ------------------------------------------------------------------ the protocol
    def init_state(self, mesh: Any, seed: int) -> Any:
        """A fresh MaxText train state (``init_weights_seed=seed``) on ``mesh``'s devices."""
        return self.context(mesh.devices.reshape(-1), init_weights_seed=int(seed)).state

    def restore(self, run_dir: str, step: int, mesh: Any) -> tuple[Any, dict]:
        """MaxText checkpoint ``step`` (``load_full_state_path=<checkpoints>/<step>/items``) on ``mesh``'s
        devices, and the loader state saved with it.

        Raises:
          FileNotFoundError: no checkpoint ``step`` (lists those there are) or no loader state in it.
        """
        items = os.path.join(self.checkpoint_dir, str(step), "items")
        if not os.path.isdir(items):
            have = sorted(int(n) for n in os.listdir(self.checkpoint_dir) if n.isdigit()) \
                if os.path.isdir(self.checkpoint_dir) else []
            raise FileNotFoundError(f"no MaxText checkpoint {step} under {self.checkpoint_dir}; present: {have}")
        loader_state = iterator_state(self.checkpoint_dir, step)
        ctx = self.context(mesh.devices.reshape(-1), load_full_state_path=items)
        return ctx.state, loader_state

    def _mesh_of(self, state: Any) -> Any:
        import jax

        return jax.tree_util.tree_leaves(state)[0].sharding.mesh

    def step_fn(self, state: Any) -> tuple[Context, Callable]:
        mesh = self._mesh_of(state)
        key = tuple(int(d.id) for d in mesh.devices.reshape(-1))
        if key not in self._contexts:
            raise ValueError(f"no MaxText set-up on devices {key}: get the state from init_state or restore")
        if key not in self._steps:
            self._steps[key] = make_step(self._contexts[key], self.leaf_paths)
        return self._contexts[key], self._steps[key]

    def train_step(self, state: Any, batch: Mapping[str, Any], step: int, fault: Any = None):
        """One MaxText optimizer step with per-device fingerprints (module docstring); ``fault``: a drill's
        ``FaultSpec``/``DriftSpec`` (or a list), planted through traced inputs (no recompilation)."""
        import jax

        from replay.run import probe

        ctx, fn = self.step_fn(state)
        ids = [int(d.id) for d in ctx.mesh.devices.reshape(-1)]
        flip, drift = probe.fault_inputs(fault, step, self.leaf_paths, self.leaf_sizes, self.leaf_dtypes, ids)
        # MaxText's mesh, without its logical axis rules: inside the shard_map every axis is manual, and
        # MaxText's activation constraints (logical names -> those axes) would name manual axes
        with jax.set_mesh(ctx.mesh):
            state, out = fn(state, batch, flip, drift)
        out = jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_data(0)), out)  # replicated: any process
        return state, probe.step_fingerprints(step, out, ctx.mesh, self.leaf_paths, loss=out["loss"],
                                              grad_norm=out["grad_norm"], batch=out["batch"])


    def single_device_fingerprints(self, state: Any, batch: Mapping[str, Any], device: Any, fault: Any = None):
        """``{leaf: fingerprint}`` of the gradient of ``batch``'s loss (``xent_sum / W + moe_lb_loss``, the
        whole batch on one device) with ``state``'s weights on ``device``: ``replay canary``'s one-device
        program. A MaxText set-up on that device alone (every parallelism 1) is made once per device."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from replay.run import fingerprint as fpm
        from replay.run import probe

        key = ("one", int(device.id))
        if key not in self._steps:
            ctx = self.context([device])
            loss_fn = internals.get("maxtext.trainers.pre_train.train", "loss_fn")
            graphdef = ctx.graphdef

            def fn(state, b, flip):
                ts = nnx.merge(graphdef, state)
                nnx.pop(ts.model, nnx.Intermediate)
                gdef, params, rest = nnx.split(ts.model, nnx.Param, ...)
                total = jnp.sum(b["targets_segmentation"] != 0).astype(jnp.float32)

                def loss(p):
                    _, aux = loss_fn(nnx.merge(gdef, p, rest, copy=True), ctx.config, dict(b), None, None,
                                     is_train=True)
                    return aux["xent_sum"] / total + aux["moe_lb_loss"]

                grads = probe.inject(jax.grad(loss)(params), flip, jnp.zeros(4, jnp.float32), jnp.int32(device.id))
                return jnp.stack([fpm.fingerprint(g, counts=False) for g in jax.tree_util.tree_leaves(grads)])

            self._steps[key] = (ctx, jax.jit(fn))
        ctx, fn = self._steps[key]
        here = jax.device_put(state, ctx.state_shardings)
        b = {k: jax.device_put(np.asarray(batch[k], np.int32), device) for k in KEYS}
        mine = fault if fault is not None and getattr(fault, "device_id", None) == device.id else None
        flip, _ = probe.fault_inputs(mine, None, self.leaf_paths, self.leaf_sizes, self.leaf_dtypes, [device.id])
        with jax.set_mesh(ctx.mesh):
            fps = np.asarray(fn(here, b, jax.device_put(flip, device)))
        return {p: fpm.fingerprint_int(fps[i]) for i, p in enumerate(self.leaf_paths)}


def make_setup(run: Any) -> Any:
    """The factory a MaxText run's config names (``trainer: integrations.maxtext.trainer:make_setup``)."""
    from integrations.maxtext.iterator import build_loader
    from replay.run.setup import RunSetup, mesh_record

    cfg = run.config
    mx = cfg["maxtext"]
    axis_names, shape, ids = mesh_record(run)
    checkpoint_dir = os.path.join(run.run_dir, "checkpoints")
    trainer = MaxTextTrainer(mx["base_yml"], mx["overrides"], checkpoint_dir, None)
    trainer.mesh_shape = shape

    def make_loader(mesh):
        ctx = trainer._contexts.get(tuple(int(d.id) for d in mesh.devices.reshape(-1)))
        config = ctx.config if ctx is not None else maxtext_config(mx["base_yml"], mx["overrides"])
        return build_loader(config, mesh, mixture=cfg["mixture"], dataset=cfg["dataset"], seed=int(cfg["seed"]),
                            global_batch=int(cfg["global_batch"]))

    return RunSetup(trainer=trainer, axis_names=tuple(axis_names), shape=tuple(shape), run_device_ids=tuple(ids),
                    make_loader=make_loader, seed=int(cfg["seed"]), global_batch=int(cfg["global_batch"]),
                    mixture=cfg["mixture"], dataset=cfg["dataset"], canary_step=0, canary_seed=7, canary_rows=1,
                    factory=FACTORY)
