"""A second trainer, written apart from the reference one: a small dense decoder in plain JAX and optax.

It shows (and the tests prove) that a user's own trainer plugs into every ``replay`` command: it
imports nothing of ``replay.reference``, only the ground room's kit (``replay.run``) and the loader.
What it adds for replay, the lines whose comment says so (docs/trainer.md, "Your own trainer", shows
them as a user pastes them):

* in the step, inside its ``shard_map``: the drill's faults, the per-device fingerprints and signals
  before the reduction, the reduced gradient's fingerprint after it (``replay.run.probe``);
* in the loop: the public writer (``replay.run.writer.RunWriter``): run config with its factory,
  environment record, each step's fingerprints and signals, checkpoint events;
* :func:`make_setup`, the factory its run config names (``trainer: dense_trainer:make_setup``).

Model: token embedding, ``n_layers`` pre-norm blocks (causal self-attention within packed documents,
a GELU MLP), final norm, untied unembedding; loss: mean cross entropy over the global batch's target
tokens (``targets_segmentation != 0``). Data-parallel over every mesh axis; parameters replicated.
Checkpoints: Orbax, ``<run>/checkpoints/<step>/{state,loader}``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replay.run import fingerprint as fpm
from replay.run import probe, writer  # replay
from replay.run.setup import RunSetup, mesh_record

KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position")
FACTORY = "dense_trainer:make_setup"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseConfig:
    """The run config of this trainer (a plain mapping in YAML; paths as given)."""

    name: str
    mixture: str
    dataset: str
    global_batch: int
    vocab_size: int
    seed: int = 0
    data: int = -1
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 2
    d_ff: int = 64
    learning_rate: float = 1e-3
    checkpoint_every: int = 4
    canary_step: int = 0
    canary_seed: int = 7

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must divide by n_heads {self.n_heads}")
        if self.global_batch < 1 or self.checkpoint_every < 1:
            raise ValueError("global_batch and checkpoint_every must be >= 1")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DenseConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def make_mesh(cfg: DenseConfig, devices=None) -> Mesh:
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: d.id)
    n = len(devices) if cfg.data == -1 else cfg.data
    return Mesh(np.asarray(devices[:n], dtype=object), ("data",))


# ----------------------------------------------------------------------------- the model


def init_params(cfg: DenseConfig, key) -> dict:
    ks = iter(jax.random.split(key, 4 + 6 * cfg.n_layers))

    def w(shape, scale):
        return jax.random.normal(next(ks), shape, jnp.float32) * scale

    d, f = cfg.d_model, cfg.d_ff
    layers = [{"ln1": jnp.ones((d,)), "qkv": w((d, 3 * d), d ** -0.5), "proj": w((d, d), d ** -0.5),
               "ln2": jnp.ones((d,)), "up": w((d, f), d ** -0.5), "down": w((f, d), f ** -0.5)}
              for _ in range(cfg.n_layers)]
    return {"embed": w((cfg.vocab_size, d), 0.02), "layers": layers, "ln_f": jnp.ones((d,)),
            "unembed": w((d, cfg.vocab_size), d ** -0.5)}


def _norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def forward(params: dict, batch: Mapping[str, Any], cfg: DenseConfig):
    """Logits float32 ``[b, S, V]`` of int32 ``[b, S]`` inputs; attention is causal within each document."""
    x = params["embed"][batch["inputs"]]
    seg = batch["inputs_segmentation"]
    S, h = x.shape[1], cfg.n_heads
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    for lyr in params["layers"]:
        q, k, v = jnp.split(_norm(x, lyr["ln1"]) @ lyr["qkv"], 3, axis=-1)
        q, k, v = (t.reshape(*t.shape[:2], h, -1) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(mask[:, None], att, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape) @ lyr["proj"]
        x = x + jax.nn.gelu(_norm(x, lyr["ln2"]) @ lyr["up"]) @ lyr["down"]
    return _norm(x, params["ln_f"]) @ params["unembed"]


def loss_sum(params: dict, batch: Mapping[str, Any], cfg: DenseConfig, total_tokens):
    """This rows' share of the global mean cross entropy: ``sum(CE over target tokens) / total_tokens``."""
    logits = forward(params, batch, cfg)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(jnp.where(batch["targets_segmentation"] != 0, ce, 0.0)) / total_tokens


# ----------------------------------------------------------------------------- the trainer


class DenseTrainer:
    """Implements ``replay.run.protocol.Trainer`` (and what drills and ``replay canary`` use)."""

    def __init__(self, cfg: DenseConfig):
        self.cfg = cfg
        self.opt = optax.adamw(cfg.learning_rate)
        abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
        self.leaf_paths = [jax.tree_util.keystr(p) for p, _ in flat]
        self.leaf_sizes = [int(np.prod(x.shape)) for _, x in flat]
        self.leaf_dtypes = [x.dtype for _, x in flat]
        self._abstract = abstract
        self._fns: dict = {}

    def init_state(self, mesh: Mesh, seed: int) -> dict:
        rep = NamedSharding(mesh, P())
        params = jax.jit(lambda k: init_params(self.cfg, k), out_shardings=rep)(jax.random.key(seed))
        return {"params": params, "opt": jax.jit(self.opt.init, out_shardings=rep)(params)}

    def _abstract_state(self, mesh: Mesh) -> dict:
        rep = NamedSharding(mesh, P())
        tree = {"params": self._abstract, "opt": jax.eval_shape(self.opt.init, self._abstract)}
        return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)

    def save(self, run_dir: str, step: int, state: dict, loader_state: Mapping[str, Any]) -> None:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"), item_names=("state", "loader")) as m:
            m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 loader=ocp.args.JsonSave(dict(loader_state))), force=True)
            m.wait_until_finished()

    def restore(self, run_dir: str, step: int, mesh: Mesh) -> tuple[dict, dict]:
        import orbax.checkpoint as ocp

        folder = os.path.join(run_dir, "checkpoints")
        opts = ocp.CheckpointManagerOptions(read_only=True, create=False)
        with ocp.CheckpointManager(folder, options=opts, item_names=("state", "loader")) as m:
            if step not in m.all_steps():
                raise FileNotFoundError(f"no checkpoint {step} under {folder}; present: {sorted(m.all_steps())}")
            out = m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(self._abstract_state(mesh)),
                                                          loader=ocp.args.JsonRestore()))
        return out["state"], dict(out["loader"] or {})

    def _step_fn(self, mesh: Mesh):
        if mesh in self._fns:
            return self._fns[mesh]
        axes, cfg = tuple(mesh.axis_names), self.cfg

        def per_device(params, batch, total, flip, drift):
            loss, grads = jax.value_and_grad(loss_sum)(params, batch, cfg, total)
            grads = probe.inject(grads, flip, drift, probe.device_id(mesh))  # replay
            out = probe.local(grads)  # replay
            reduced = jax.lax.psum(grads, axes)
            out.update(probe.reduced(grads, reduced, mesh))  # replay
            return reduced, jax.lax.psum(loss, axes), out

        sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axes), P(), P(), P()),
                                out_specs=(P(), P(), probe.specs(mesh)), check_vma=False)  # replay (specs)

        def step(state, batch, flip, drift):
            batch = {k: batch[k] for k in KEYS}
            total = jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32)
            grads, loss, out = sharded(state["params"], batch, total, flip, drift)
            norm = optax.tree.norm(grads)
            updates, opt = self.opt.update(grads, state["opt"], state["params"])
            out.update(loss=loss, grad_norm=norm, batch=fpm.fingerprint(batch["inputs"]))  # replay (batch hash)
            return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, out

        rep = NamedSharding(mesh, P())
        self._fns[mesh] = jax.jit(step, in_shardings=(rep, {k: NamedSharding(mesh, P(axes)) for k in KEYS}, rep, rep),
                                  out_shardings=(rep, rep))
        return self._fns[mesh]

    def train_step(self, state: dict, batch: Mapping[str, Any], step: int, fault: Any = None):
        mesh = jax.tree_util.tree_leaves(state["params"])[0].sharding.mesh
        ids = [int(d.id) for d in mesh.devices.reshape(-1)]
        flip, drift = probe.fault_inputs(fault, step, self.leaf_paths, self.leaf_sizes,  # replay
                                         self.leaf_dtypes, ids)
        state, out = self._step_fn(mesh)(state, batch, flip, drift)
        out = jax.device_get(out)
        return state, probe.step_fingerprints(step, out, mesh, self.leaf_paths, loss=out["loss"],  # replay
                                              grad_norm=out["grad_norm"], batch=out["batch"])

    def single_device_fingerprints(self, state: dict, batch: Mapping[str, Any], device: Any, fault: Any = None):
        """``{leaf: fingerprint}`` of the whole ``batch``'s gradient on one device (``replay canary``)."""
        key = ("one", device.id)
        if key not in self._fns:
            cfg = self.cfg

            def fn(params, b, flip):
                total = jnp.sum(b["targets_segmentation"] != 0).astype(jnp.float32)
                grads = jax.grad(loss_sum)(params, b, cfg, total)
                grads = probe.inject(grads, flip, jnp.zeros(4, jnp.float32), jnp.int32(device.id))
                return jnp.stack([fpm.fingerprint(g, counts=False) for g in jax.tree_util.tree_leaves(grads)])

            self._fns[key] = jax.jit(fn)
        params = jax.device_put(state["params"], device)
        b = {k: jax.device_put(np.asarray(batch[k], np.int32), device) for k in KEYS}
        mine = fault if fault is not None and fault.device_id == device.id else None  # a drill: its device only
        flip, _ = probe.fault_inputs(mine, None, self.leaf_paths, self.leaf_sizes, self.leaf_dtypes, [device.id])
        fps = np.asarray(self._fns[key](params, b, jax.device_put(flip, device)))
        return {p: fpm.fingerprint_int(fps[i]) for i, p in enumerate(self.leaf_paths)}


# ----------------------------------------------------------------------------- replay's factory


def make_setup(run) -> RunSetup:
    """The factory named by this trainer's run config (``trainer: dense_trainer:make_setup``)."""
    import loader

    cfg = DenseConfig.from_dict(run.config)
    axis_names, shape, ids = mesh_record(run)

    def make_loader(mesh):
        return loader.build(mixture=cfg.mixture, dataset=cfg.dataset, global_batch=cfg.global_batch, mesh=mesh,
                            seed=cfg.seed, data_axes=tuple(mesh.axis_names))

    return RunSetup(trainer=DenseTrainer(cfg), axis_names=axis_names, shape=shape, run_device_ids=ids,
                    make_loader=make_loader, seed=cfg.seed, global_batch=cfg.global_batch, mixture=cfg.mixture,
                    dataset=cfg.dataset, canary_step=cfg.canary_step, canary_seed=cfg.canary_seed, canary_rows=1)


# ----------------------------------------------------------------------------- the training loop


def latest_checkpoint(run_dir: str) -> Optional[int]:
    folder = os.path.join(run_dir, "checkpoints")
    done = [int(n) for n in (os.listdir(folder) if os.path.isdir(folder) else []) if n.isdigit()]
    return max(done) if done else None


def train(run_dir: str, config: Mapping[str, Any], steps: int, *, faults: Any = None) -> dict[int, float]:
    """Trains to step ``steps`` (resuming from the run's last checkpoint); returns ``{step: loss}``."""
    import loader

    cfg = DenseConfig.from_dict(config)
    mesh, trainer = make_mesh(cfg), DenseTrainer(cfg)
    data = loader.build(mixture=cfg.mixture, dataset=cfg.dataset, global_batch=cfg.global_batch, mesh=mesh,
                        seed=cfg.seed, data_axes=tuple(mesh.axis_names))
    latest = latest_checkpoint(run_dir)
    log = writer.RunWriter(run_dir, config=config, trainer=FACTORY, mesh=mesh)  # replay
    start = log.start(latest)  # replay
    if latest is None:
        state = trainer.init_state(mesh, cfg.seed)
        log.record_checkpoint(0, state, data.state().to_dict())  # replay
        trainer.save(run_dir, 0, state, data.state().to_dict())
        log.event("checkpoint", 0)  # replay
    else:
        state, loader_state = trainer.restore(run_dir, latest, mesh)
        log.verify_restore(latest, state, loader_state)  # replay
        data = data.restore(loader_state)
    losses = {}
    for step, batch in data.iterate(start) if start < steps else ():
        t0 = time.perf_counter()
        state, fp = trainer.train_step(state, batch, step, faults)
        log.log_step(fp, step_time_s=time.perf_counter() - t0,  # replay
                     loader_wait_s=data.metrics()["wait_s_last_step"])  # replay
        losses[step] = fp.signals.loss
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
            log.record_checkpoint(step + 1, state, data.state().to_dict())  # replay
            trainer.save(run_dir, step + 1, state, data.state().to_dict())
            log.event("checkpoint", step + 1)  # replay
        if step + 1 >= steps:
            break
    log.end(max(start, steps))  # replay
    return losses
