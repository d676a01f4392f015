"""Your own trainer, replayable: a small decoder in plain JAX and optax, data parallel, Orbax checkpoints
with the loader's state, and every line ``replay`` needs (each ends with a comment that starts with
``replay``; nothing else is there for replay). Copy it, swap in your model, keep the marked lines.
Walk-through: README.md here.

    python examples/own_trainer/own_trainer.py --run build/own/run --config examples/own_trainer/run.yaml --steps 8
    PYTHONPATH=examples/own_trainer replay --run build/own/run --steps 4:8 --devices good

Model: token embedding, ``n_layers`` pre-norm blocks (causal self-attention within each packed document,
a GELU MLP), final norm, unembedding; loss: mean cross entropy over the global batch's target tokens.
Mesh: one axis ``data`` over ``data`` devices (-1: all); parameters replicated, the batch split over
``data``, gradients summed by a ``psum`` inside ``jax.shard_map``. Checkpoints:
``<run>/checkpoints/<step>/{state,loader}`` (Orbax), at step 0, every ``checkpoint_every`` steps and at
the end; the command resumes from the newest. Many processes: ``--coordinator-address``,
``--num-processes``, ``--process-id`` (``jax.distributed``), the same command in every process.
Contracts: docs/trainer.md, "The contract".
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import loader
from replay.run import probe, writer  # replay
from replay.runtime import distributed  # replay
from replay.run import fingerprint as fpm  # replay
from replay.run.setup import RunSetup, checked_loader, config_from, mesh_record  # replay

FACTORY = "own_trainer:make_setup"  # replay: the module:function replay rebuilds a run with
KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The run config (YAML; relative paths against the file's folder). Unknown keys are refused."""

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

    def __post_init__(self):
        if self.d_model % self.n_heads or min(self.global_batch, self.checkpoint_every) < 1:
            raise ValueError("d_model must divide by n_heads; global_batch, checkpoint_every >= 1")


def load_config(path: str) -> Config:
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    for key in ("mixture", "dataset"):  # a path relative to the file's folder; a URL (gs://...) as it is
        if isinstance(raw, dict) and isinstance(raw.get(key), str) and "://" not in raw[key]:
            raw[key] = os.path.join(os.path.dirname(os.path.abspath(path)), raw[key])
    return config_from(Config, raw, path)


def make_mesh(cfg: Config) -> Mesh:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    return Mesh(np.asarray(devices[: len(devices) if cfg.data == -1 else cfg.data]), ("data",))


def build_loader(cfg: Config, mesh: Mesh):
    return loader.build(mixture=cfg.mixture, dataset=cfg.dataset, global_batch=cfg.global_batch, mesh=mesh,
                        seed=cfg.seed, data_axes=("data",))


# ----------------------------------------------------------------------------- the model


def init_params(cfg: Config, key) -> dict:
    ks = iter(jax.random.split(key, 2 + 4 * cfg.n_layers))
    d, f = cfg.d_model, cfg.d_ff

    def w(shape, fan_in):
        return jax.random.normal(next(ks), shape, jnp.float32) * fan_in ** -0.5

    layers = [{"ln1": jnp.ones(d), "qkv": w((d, 3 * d), d), "proj": w((d, d), d), "ln2": jnp.ones(d),
               "up": w((d, f), d), "down": w((f, d), f)} for _ in range(cfg.n_layers)]
    return {"embed": w((cfg.vocab_size, d), 2500), "layers": layers, "ln_f": jnp.ones(d),
            "unembed": w((d, cfg.vocab_size), d)}


def _norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def loss_fn(params: dict, batch: dict, cfg: Config, total_tokens):
    """This device's rows' share of the global mean cross entropy (int32 ``[b, S]`` batch)."""
    x, seg = params["embed"][batch["inputs"]], batch["inputs_segmentation"]
    S, h = x.shape[1], cfg.n_heads
    mask = (jnp.tril(jnp.ones((S, S), bool))[None] & (seg[:, :, None] == seg[:, None, :])
            & (seg[:, :, None] > 0))[:, None]
    for lyr in params["layers"]:
        q, k, v = (t.reshape(*t.shape[:2], h, -1) for t in jnp.split(_norm(x, lyr["ln1"]) @ lyr["qkv"], 3, -1))
        att = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]), -1e9)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(x.shape) @ lyr["proj"]
        x = x + jax.nn.gelu(_norm(x, lyr["ln2"]) @ lyr["up"]) @ lyr["down"]
    logits = _norm(x, params["ln_f"]) @ params["unembed"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(jnp.where(batch["targets_segmentation"] != 0, ce, 0.0)) / total_tokens


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """``replay.run.protocol.Trainer``: init_state, restore, train_step (and save, for the loop and drills)."""

    def __init__(self, cfg: Config):
        self.cfg, self.opt = cfg, optax.adamw(cfg.learning_rate)
        self.abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        self.leaf_paths, self.leaf_sizes, self.leaf_dtypes = probe.leaf_info(self.abstract)  # replay
        self.step_fns: dict = {}

    def init_state(self, mesh: Mesh, seed: int) -> dict:
        rep = NamedSharding(mesh, P())
        params = jax.jit(lambda k: init_params(self.cfg, k), out_shardings=rep)(jax.random.key(seed))
        return {"params": params, "opt": jax.jit(self.opt.init, out_shardings=rep)(params)}

    def save(self, run_dir: str, step: int, state: dict, loader_state: dict) -> None:
        with ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")), item_names=("state", "loader")) as m:
            m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 loader=ocp.args.JsonSave(dict(loader_state))), force=True)

    def restore(self, run_dir: str, step: int, mesh: Mesh) -> tuple[dict, dict]:
        rep = NamedSharding(mesh, P())
        tree = {"params": self.abstract, "opt": jax.eval_shape(self.opt.init, self.abstract)}
        target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)
        folder = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        opts = ocp.CheckpointManagerOptions(read_only=True, create=False)
        with ocp.CheckpointManager(folder, options=opts, item_names=("state", "loader")) as m:
            if step not in m.all_steps():
                raise FileNotFoundError(f"no checkpoint {step} under {folder}; present: {sorted(m.all_steps())}")
            out = m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                          loader=ocp.args.JsonRestore()))
        return out["state"], dict(out["loader"] or {})

    def step_fn(self, mesh: Mesh):
        if mesh not in self.step_fns:
            cfg = self.cfg

            def per_device(params, batch, total, flip, drift):
                loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg, total)
                grads = probe.inject(grads, flip, drift, probe.device_id(mesh))  # replay: drills' faults
                out = probe.local(grads)  # replay: this device's fingerprints and signals
                reduced = jax.lax.psum(grads, "data")
                out.update(probe.reduced(grads, reduced, mesh))  # replay: the reduced gradient's
                return reduced, jax.lax.psum(loss, "data"), out

            sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P(), P(), P()),
                                    out_specs=(P(), P(), probe.specs(mesh)), check_vma=False)  # replay: specs

            def step(state, batch, flip, drift):
                total = jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32)
                grads, loss, out = sharded(state["params"], {k: batch[k] for k in KEYS}, total, flip, drift)
                updates, opt = self.opt.update(grads, state["opt"], state["params"])
                out.update(loss=loss, grad_norm=optax.tree.norm(grads),
                           batch=fpm.fingerprint(batch["inputs"]))  # replay: the batch hash
                return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, out

            rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
            self.step_fns[mesh] = jax.jit(step, in_shardings=(rep, {k: rows for k in KEYS}, rep, rep),
                                          out_shardings=(rep, rep))
        return self.step_fns[mesh]

    def train_step(self, state: dict, batch: dict, step: int, fault=None):
        mesh = jax.tree_util.tree_leaves(state["params"])[0].sharding.mesh
        flip, drift = probe.fault_inputs(fault, step, self.leaf_paths, self.leaf_sizes,  # replay
                                         self.leaf_dtypes, [d.id for d in mesh.devices.flat])  # replay
        state, out = self.step_fn(mesh)(state, {k: batch[k] for k in KEYS}, flip, drift)
        return state, probe.step_fingerprints(step, jax.device_get(out), mesh, self.leaf_paths)  # replay

    def grads(self, params: dict, batch: dict) -> dict:  # replay: the canary's whole-batch gradient
        return jax.grad(loss_fn)(params, batch, self.cfg, jnp.sum(batch["targets_segmentation"] != 0))  # replay

    def single_device_fingerprints(self, state: dict, batch: dict, device, fault=None):  # replay: canary
        return probe.one_device_fingerprints(self.grads, state["params"], {k: batch[k] for k in KEYS},  # replay
                                             device, fault, self.leaf_paths, self.leaf_sizes, self.leaf_dtypes)  # replay


# ----------------------------------------------------------------------------- replay's factory


def make_setup(run) -> RunSetup:  # replay: named by run_config.yaml's trainer: key
    cfg = config_from(Config, run.config, os.path.join(run.run_dir, "run_config.yaml"))  # replay
    axis_names, shape, ids = mesh_record(run)  # replay
    return RunSetup(trainer=Trainer(cfg), axis_names=axis_names, shape=shape, run_device_ids=ids,  # replay
                    make_loader=lambda mesh: checked_loader(run, build_loader(cfg, mesh)),  # replay
                    seed=cfg.seed, global_batch=cfg.global_batch, canary_rows=1)  # replay


# ----------------------------------------------------------------------------- the training loop


def train(run_dir: str, cfg: Config, steps: int) -> dict[int, float]:
    """Trains to step ``steps``, resuming from the run's newest checkpoint; returns ``{step: loss}``."""
    mesh, trainer = make_mesh(cfg), Trainer(cfg)
    data = build_loader(cfg, mesh)
    folder = os.path.join(run_dir, "checkpoints")
    latest = max((int(n) for n in os.listdir(folder) if n.isdigit()), default=None) if os.path.isdir(folder) \
        else None
    log = writer.RunWriter(run_dir, config=dataclasses.asdict(cfg), trainer=FACTORY, mesh=mesh)  # replay
    start = log.start(latest)  # replay
    log.record_inputs(data)  # replay: what it trained with (inputs.json, mixture.yaml)
    if latest is None:
        state = trainer.init_state(mesh, cfg.seed)
        log.record_checkpoint(0, state, data.state().to_dict())  # replay: the state record, checked at restores
        trainer.save(run_dir, 0, state, data.state().to_dict())
        log.event("checkpoint", 0)  # replay
    else:
        state, loader_state = trainer.restore(run_dir, latest, mesh)
        log.verify_restore(latest, state, loader_state)  # replay: a damaged checkpoint is refused
        data = data.restore(loader_state)
    losses = {}
    for step, batch in data.iterate(start) if start < steps else ():
        t0 = time.perf_counter()
        state, fp = trainer.train_step(state, batch, step)
        log.log_step(fp, step_time_s=time.perf_counter() - t0,  # replay
                     loader=data.metrics())  # replay: the input figures (wait, buffer levels, stages)
        losses[step] = fp.signals.loss
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
            log.record_checkpoint(step + 1, state, data.state().to_dict())  # replay
            trainer.save(run_dir, step + 1, state, data.state().to_dict())
            log.event("checkpoint", step + 1)  # replay
            print(f"step {step}: loss {fp.signals.loss:.4f}, checkpoint {step + 1} saved", file=sys.stderr)
        if step + 1 >= steps:
            break
    log.end(max(start, steps))  # replay
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="the run directory")
    ap.add_argument("--config", required=True, help="the run config (YAML)")
    ap.add_argument("--steps", type=int, required=True, help="the step to stop at")
    distributed.add_arguments(ap)  # --coordinator-address, --num-processes, --process-id (as replay's)
    args = ap.parse_args(argv)
    try:
        if (dargs := distributed.from_args(args)) is not None:
            distributed.initialize(dargs)  # jax.distributed, gloo collectives on CPU
        cfg = load_config(args.config)
        losses = train(args.run, cfg, args.steps)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if losses and jax.process_index() == 0:
        print(f"trained steps {min(losses)}..{max(losses)}: loss {losses[min(losses)]:.4f} -> "
              f"{losses[max(losses)]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
