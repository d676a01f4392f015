"""Triage drills (``replay drill --scenario NAME|all [--grid]``, names in :data:`SCENARIOS`): short
training runs with one planted cause each, at magnitudes from a fixed grid (:data:`GRIDS`), and the
check that ``replay triage`` names it.

Each drill trains its own run of the reference trainer (the tiny model on a synthetic dataset, a
2x2 mesh on devices 0-3, so that devices 4-7 are free for the range replay), plants one cause at a
step ``k`` drawn from the seed, and runs :func:`replay.screen.triage.triage_run` at the step where
the symptom shows::

    scenario      planted (seeded: device, step, shard, layer, shift; magnitude m from GRIDS)   triage must say
    sdc           DriftSpec: one device's local gradient x(1 + m) from step k              hardware, that device
                  (triage runs with the range replay: a conviction)
    restart       the run crashes after checkpoint c and resumes with a loader state m     restart fault, the restore
                  steps off (data repeated or skipped); the restore event logs the         at c with its shift
                  checkpoint's own state, so only the batches tell
    data          one shard's rows read from step k on: the first share m of each          data, that shard
                  segment one token repeated, in a copy of the dataset
    duplicate     m shards of source b copies of its shard 0 (consistent manifest),        data, the copied shards
                  b's weight 0.3 -> 0.9 from step k
    router        layer L's router learning rate x m from step k, z-loss off              router, layer L
    router_scale  layer L's router weights x m once (first used at step k), triaged     router, layer L
                  at k + 4
    nonfinite     one device's local gradient x(1 + m), m nan or inf, at step k            hardware, that device
    clean         the learning rate x m for steps k..k+2, logged as a config change       optimization event, and no
                  (triage at the step of the highest loss in k..k+4)                       check suspect

The trainers are built once (their steps compile once) and reused across seeds: the per-seed
plan (step, layer) lives in the optimizer's state, not in the compiled program.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from typing import Any, Callable, Mapping, Optional, Sequence

SCENARIOS = ("sdc", "restart", "data", "duplicate", "router", "router_scale", "nonfinite", "clean")
EXPECTED_CAUSE = {"sdc": "hardware", "restart": "restart", "data": "data", "duplicate": "data", "router": "router",
                  "router_scale": "router", "nonfinite": "hardware", "clean": "optimization"}
# Each scenario's magnitudes, largest first, down to its check's stated floor (the first is a drill's
# default): sdc, the local gradient's relative drift (range replay convicts any change of bits: the
# floor is what changes a bit); restart, the loader's shift in steps (1: the smallest wrong resume);
# data, the share of each garbage row's tokens made one repeated token (the repeat-rate fence: 3 IQR
# floored at 0.05 above the baseline's Q3); duplicate, the copies of one shard of source b (its rows
# at the onset, after b's weight rises, judged against the baseline's pair rate); router, the router
# learning rate's factor (z-loss off); router_scale, layer L's router weights multiplied once, triaged
# 4 steps after; nonfinite, the value one device's local gradient is multiplied into; clean, the whole
# model's learning-rate jump (an optimization event: no check may accuse anything).
GRIDS = {"sdc": (1.0, 0.3, 0.1, 0.03), "restart": (3, 2, 1), "data": (1.0, 0.5, 0.25, 0.125),
         "duplicate": (3, 2, 1), "router": (100.0, 30.0, 10.0), "router_scale": (20.0, 10.0, 5.0, 2.0),
         "nonfinite": ("nan", "inf"), "clean": (10.0, 5.0)}
STEPS = 40
CHECKPOINT_EVERY = 10
MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 8, "n_experts": 4, "top_k": 2, "d_ff": 32,
         "capacity_factor": 2.0}
ROWS = {"a": 300, "b": 150}
SEQ_LEN, VOCAB, GLOBAL_BATCH, SHARDS = 32, 128, 8, 4
LR_JUMP_STEPS, ROUTER_SCALE_AFTER, DUPLICATE_PHASE = 3, 4, {"a": 0.1, "b": 0.9}


def drill_optimizer(base: Any, mode: str, factor: float, plan: Mapping[str, Any]) -> Any:
    """``base`` (an optax transform) followed by a planted change: at steps ``plan["start"]`` to
    ``plan["stop"]`` (exclusive; default: on) the updates are multiplied by ``factor``, of every leaf
    (``mode="all"``: a learning-rate jump) or of layer ``plan["layer"]``'s router (``mode="router"``);
    with ``mode="router"`` and ``plan["scale"]`` (default 1), at step ``start`` alone that router's
    weights are also multiplied by ``scale`` (the update adds ``(scale - 1) * w``: a fault in saved or
    updated state, once). ``init`` writes the plan (start, stop, layer, factor, scale) into the
    optimizer state and ``update`` reads it from there, so one compiled step serves every plan; a new
    plan is a new transform (a new ``init``, which JAX traces anew)."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(params):
        return {"inner": base.init(params), "count": jnp.zeros((), jnp.int32),
                "start": jnp.asarray(plan["start"], jnp.int32), "layer": jnp.asarray(plan.get("layer", -1), jnp.int32),
                "stop": jnp.asarray(plan.get("stop", 2**30), jnp.int32),
                "factor": jnp.asarray(factor, jnp.float32), "scale": jnp.asarray(plan.get("scale", 1.0), jnp.float32)}

    def update(updates, state, params=None):
        u, inner = base.update(updates, state["inner"], params)
        on = (state["count"] >= state["start"]) & (state["count"] < state["stop"])

        def scale(path, x, w):
            key = jax.tree_util.keystr(path)
            if mode == "all":
                return jnp.where(on, x * state["factor"].astype(x.dtype), x)
            if not (key.endswith("['router']") and key.startswith("['layers'][")):
                return x
            hit = state["layer"] == int(key.split("[")[2].rstrip("]"))
            x = jnp.where(hit & on, x * state["factor"].astype(x.dtype), x)
            once = hit & (state["count"] == state["start"])
            return jnp.where(once, x + (state["scale"] - 1).astype(x.dtype) * w, x)

        u = jax.tree_util.tree_map_with_path(scale, u, params)
        return u, {**state, "inner": inner, "count": state["count"] + 1}

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass
class DrillResult:
    """One drill: the scenario, its seed, what was planted and expected, what triage found, whether
    it is correct, the run directory and the seconds it took."""

    scenario: str
    seed: int
    planted: dict[str, Any]
    expected: dict[str, Any]
    found: dict[str, Any]
    correct: bool
    run_dir: str
    seconds: float
    triage: dict[str, Any] = dataclasses.field(repr=False, default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "seed": self.seed, "planted": self.planted, "expected": self.expected,
                "found": self.found, "correct": self.correct, "run_dir": self.run_dir,
                "seconds": round(self.seconds, 2), "found_text": found_text(self.found),
                "checks": {k: v["status"] for k, v in self.triage.get("checks", {}).items()}}


def found_text(found: Mapping[str, Any]) -> str:
    subj = {k: v for k, v in (found.get("subject") or {}).items() if k in ("devices", "restores", "shards", "layers")}
    if "restores" in subj:
        subj["restores"] = [(r["step"], r.get("offset")) for r in subj["restores"]]
    return f"{found.get('cause')} {subj}" if subj else str(found.get("cause"))


def result_line(r: DrillResult) -> str:
    mark = "[green]correct[/]" if r.correct else "[red]WRONG[/]"
    return (f"drill {r.scenario} seed {r.seed}: {mark}: planted {r.planted}, triage: {found_text(r.found)} "
            f"({r.seconds:.1f} s; {r.run_dir})")


class Drills:
    """The shared part of a set of drills: the dataset, the mesh and the trainers (compiled once)."""

    def __init__(self, root: str, log: Optional[Callable[[str], None]] = None):
        import jax

        from loader.synthetic import synthetic_mixture, write_synthetic_dataset
        from replay.reference import run as ref_run
        from replay.reference.model import ModelConfig
        from replay.reference.trainer import OptimizerConfig, ReferenceTrainer, make_mesh

        self.root = root
        os.makedirs(root, exist_ok=True)
        self.log = log or (lambda s: None)
        mix = synthetic_mixture({"a": 0.7, "b": 0.3}, seq_len=SEQ_LEN, shards_per_source=SHARDS)
        self.mixture = os.path.join(root, "mixture.yaml")
        import yaml

        with open(self.mixture, "w", encoding="utf-8") as f:
            yaml.safe_dump(mix.to_dict(), f, sort_keys=False)
        self.dataset = os.path.join(root, "dataset")
        if not os.path.exists(os.path.join(self.dataset, "manifest.json")):
            write_synthetic_dataset(self.dataset, ROWS, seq_len=SEQ_LEN, shards_per_source=SHARDS, vocab_size=VOCAB,
                                    mixture=mix)
        self.mesh = make_mesh({"data": 2, "expert": 2}, sorted(jax.devices(), key=lambda d: d.id)[:4])
        model = ModelConfig.from_dict({"vocab_size": VOCAB, **MODEL})
        opt = OptimizerConfig(warmup_steps=5)
        self.trainer = ReferenceTrainer(model, opt)
        self.opt = opt
        self.router_trainer = ReferenceTrainer(dataclasses.replace(model, z_loss_weight=0.0), opt)
        self.clean_trainer = ReferenceTrainer(model, opt)
        self.ref_run = ref_run

    def config(self, seed: int, dataset: Optional[str] = None):
        raw = {"name": "triage-drill", "mixture": self.mixture, "dataset": dataset or self.dataset,
               "global_batch": GLOBAL_BATCH, "seed": seed, "mesh": {"data": 2, "expert": 2}, "model": MODEL,
               "optimizer": {"warmup_steps": 5}, "checkpoint_every": CHECKPOINT_EVERY,
               "router_health": {"window_steps": 4}}
        return self.ref_run.run_config_from_dict(raw, self.root)

    def train(self, run_dir: str, cfg, steps: int, trainer=None, *, drill=None, launch=None,
              on_step: Optional[Callable[[int, float], None]] = None) -> dict[str, Any]:
        """``replay.reference.loop.train`` on the drills' mesh, quietly; ``drill``: a
        ``replay.reference.drills.DrillHooks``; ``launch``: a ``replay.reference.loop.Launch``."""
        import warnings

        from replay.reference import loop

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return loop.train(run_dir, cfg, steps, trainer=trainer or self.trainer, mesh=self.mesh, launch=launch,
                              output=loop.Output(log=lambda s: None, plot=False, progress=_Quiet(), on_step=on_step),
                              drill=drill)

    def triage(self, run_dir: str, step: int, replay: bool = False, trainer=None) -> dict[str, Any]:
        from replay.run.runlog import load_run
        from replay.screen.triage import triage_run
        from replay.verify import engine

        run = load_run(run_dir)
        setup = dataclasses.replace(engine.default_setup(run), trainer=trainer or self.trainer)
        return triage_run(run, step, replay=replay, session=engine.Session(run, setup)).to_dict()

    # ------------------------------------------------------------------------- scenarios

    def run(self, scenario: str, seed: int, magnitude: Any = None) -> DrillResult:
        """One drill (module docstring) at ``magnitude`` (default: the largest of :data:`GRIDS`)."""
        rng = random.Random(f"triage-drill:{scenario}:{seed}")
        magnitude = GRIDS[scenario][0] if magnitude is None else magnitude
        out = os.path.join(self.root, f"{scenario}-{seed}-{magnitude}")
        if os.path.exists(out):
            shutil.rmtree(out)
        t0 = time.perf_counter()
        planted, expected, step, kw = getattr(self, f"_{scenario}")(out, seed, rng, magnitude)
        planted["magnitude"] = magnitude
        rep = self.triage(out, step, **kw)
        con = rep["conclusion"]
        found = {"cause": con["cause"], "subject": con["subject"], "confidence": con["confidence"]}
        return DrillResult(scenario, seed, planted, expected, found, judge(scenario, expected, rep), out,
                           time.perf_counter() - t0, rep)

    def _sdc(self, out, seed, rng, magnitude):
        from replay.reference.drills import DrillHooks
        from replay.run.protocol import DriftSpec

        device, k = rng.choice([0, 1, 2, 3]), rng.randrange(20, 28)
        self.train(out, self.config(seed), STEPS,
                   drill=DrillHooks(faults=DriftSpec(device_id=device, start=k, magnitude=magnitude)))
        return ({"device": device, "step": k}, {"cause": "hardware", "devices": [device]},
                min(k + 10, STEPS - 1), {"replay": True})

    def _nonfinite(self, out, seed, rng, magnitude):
        from replay.reference.drills import DrillHooks
        from replay.run.protocol import DriftSpec

        device, k = rng.choice([0, 1, 2, 3]), rng.randrange(20, 28)
        value = float(magnitude)  # g * (1 + nan) is NaN; g * (1 + inf) is +-Inf (and 0 * inf NaN)
        # non_finite: warn, as a trainer without the guard would go on (the default, stop, halts at the
        # step before any checkpoint holds the NaN: tests/test_checkpoint_trust.py); triage must name the device
        cfg = dataclasses.replace(self.config(seed), non_finite="warn")
        self.train(out, cfg, STEPS, drill=DrillHooks(faults=DriftSpec(device_id=device, start=k, stop=k + 1,
                                                                      magnitude=value)))
        return ({"device": device, "step": k, "value": magnitude}, {"cause": "hardware", "devices": [device]},
                min(k + 2, STEPS - 1), {})

    def _restart(self, out, seed, rng, magnitude):
        from replay.reference.drills import DrillHooks

        c = rng.choice([20, 30])
        crash, shift = c + rng.randrange(2, 8), rng.choice([-1, 1]) * int(magnitude)
        cfg = self.config(seed)

        def crash_at(step, loss):
            if step == crash:
                raise _Crash(step)

        try:
            self.train(out, cfg, STEPS, on_step=crash_at)
        except _Crash:
            pass
        # the restore event logs the checkpoint's own state, the loader starts `shift` steps off
        self.train(out, cfg, STEPS, drill=DrillHooks(loader_shift=shift))
        return ({"restore": c, "crash_after": crash, "loader_shift": shift},
                {"cause": "restart", "restore": c, "offset": shift}, min(c + 3, STEPS - 1), {})

    def _data(self, out, seed, rng, magnitude):
        k = rng.randrange(20, 30)
        cfg = self.config(seed)
        shard, records = self._pick_shard(cfg, k, rng)
        dataset = corrupt_shard(self.dataset, os.path.join(out + "-dataset"), shard, records, share=float(magnitude))
        self.train(out, self.config(seed, dataset), STEPS)
        return ({"shard": shard, "step": k, "rows": len(records)}, {"cause": "data", "shards": [shard]},
                k + 3, {})

    def _duplicate(self, out, seed, rng, magnitude):
        import yaml

        k = rng.randrange(20, 30)
        dataset = duplicate_shards(self.dataset, out + "-dataset", "b", int(magnitude))
        with open(self.mixture, encoding="utf-8") as f:
            mix = yaml.safe_load(f)
        mix["phases"] = [{"from_step": 0, "weights": dict(mix["phases"][0]["weights"])},
                         {"from_step": k, "weights": dict(DUPLICATE_PHASE)}]
        mixture = out + "-mixture.yaml"
        with open(mixture, "w", encoding="utf-8") as f:
            yaml.safe_dump(mix, f, sort_keys=False)
        cfg = self.ref_run.run_config_from_dict({**self.config(seed, dataset).to_dict(), "mixture": mixture}, "/")
        self.train(out, cfg, STEPS)
        copies = [f"b/data-0000{i}-of-0000{SHARDS}.array_record" for i in range(int(magnitude) + 1)]
        return ({"source": "b", "copies": int(magnitude), "phase_from": k, "weights": DUPLICATE_PHASE},
                {"cause": "data", "shards": copies}, k + 3, {})

    def _router(self, out, seed, rng, magnitude):
        k, layer = rng.randrange(20, 30), rng.choice([0, 1])
        self._fresh_plan(self.router_trainer, "router", float(magnitude), start=k, layer=layer)
        self.train(out, self.config(seed), STEPS, trainer=self.router_trainer)
        return ({"layer": layer, "step": k, "z_loss": 0}, {"cause": "router", "layers": [layer]}, k + 4,
                {"trainer": self.router_trainer})

    def _router_scale(self, out, seed, rng, magnitude):
        k, layer = rng.randrange(20, 30), rng.choice([0, 1])
        # the update of step k - 1 scales the weights: step k is the first to route with them
        self._fresh_plan(self.router_trainer, "router", 1.0, start=k - 1, layer=layer, scale=float(magnitude))
        self.train(out, self.config(seed), STEPS, trainer=self.router_trainer)
        return ({"layer": layer, "step": k, "z_loss": 0}, {"cause": "router", "layers": [layer], "first_step": k},
                k + ROUTER_SCALE_AFTER, {"trainer": self.router_trainer})

    def _clean(self, out, seed, rng, magnitude):
        from replay.run.writer import RunDir

        k = rng.randrange(20, 30)
        self._fresh_plan(self.clean_trainer, "all", float(magnitude), start=k, layer=-1, stop=k + LR_JUMP_STEPS)
        cfg = self.config(seed)

        def log_change(step, loss):
            if step == k - 1:  # what a trainer logs when its learning rate is changed before step k
                RunDir(out).event("config_change", k, field="optimizer.learning_rate", factor=float(magnitude),
                                  steps=[k, k + LR_JUMP_STEPS], reason="drill: a learning-rate jump")

        self.train(out, cfg, STEPS, trainer=self.clean_trainer, on_step=log_change)
        rep_step = self._spike_step(out, k)
        return ({"step": k, "steps": LR_JUMP_STEPS}, {"cause": "optimization"}, rep_step,
                {"trainer": self.clean_trainer})

    def _fresh_plan(self, trainer, mode: str, factor: float, *, start: int, layer: int,
                    stop: int = 2**30, scale: float = 1.0) -> None:
        """Gives ``trainer`` the planted optimizer of this drill (``drill_optimizer``): its init
        compiles again (a small program); its step, compiled once, reads the plan from the state."""
        trainer.optimizer = drill_optimizer(self.opt.build(), mode, factor,
                                            {"start": start, "layer": layer, "stop": stop, "scale": scale})
        trainer._compiled.pop(("opt_init", self.mesh), None)

    def _spike_step(self, run_dir: str, k: int) -> int:
        """The step with the highest loss in ``[k, k + 4]`` (where the jump's spike shows)."""
        from replay.run.runlog import load_run
        import numpy as np

        run = load_run(run_dir)
        cands = [s for s in range(k, min(k + 5, STEPS)) if s in run.fingerprints]
        loss = [float(np.uint32(run.fingerprints[s].loss_bits).view(np.float32)) for s in cands]
        return cands[int(np.nanargmax(loss))]

    def _pick_shard(self, cfg, k: int, rng: random.Random) -> tuple[str, list[int]]:
        """A shard with rows in steps ``k .. k + 3`` (at least 2), and its records read from step ``k`` on."""
        from replay.reference.run import build_loader
        from jax.sharding import Mesh
        import numpy as np

        mesh = Mesh(np.asarray(self.mesh.devices.reshape(-1)[:1]).reshape(1, 1), ("data", "expert"))
        data = build_loader(cfg, mesh)
        near: dict[str, int] = {}
        for s in range(k, k + 4):
            for ref in data.rows_at(s):
                near[ref.shard] = near.get(ref.shard, 0) + 1
        shard = rng.choice(sorted(n for n, c in near.items() if c >= 2))
        records = sorted({ref.record_in_shard for s in range(k, STEPS) for ref in data.rows_at(s) if ref.shard == shard})
        return shard, records


class _Crash(RuntimeError):
    """The planted crash of the restart drill."""


class _Quiet:
    """A text stream that drops what is written (the drills' training progress)."""

    def write(self, s):
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False


def corrupt_shard(dataset: str, out: str, shard: str, records: Sequence[int], share: float = 1.0) -> str:
    """A copy of ``dataset`` at ``out`` whose ``shard`` has ``records`` replaced by garbage rows (in each
    segment, the first ``share`` of its tokens made one repeated token; the segment lengths and
    document keys kept), with its manifest
    updated to the new file's sha256 and size (a source whose content changed, repacked: the loader
    accepts it, only the rows' content is wrong). Returns ``out``."""
    import hashlib

    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
    import numpy as np

    from contract import codec

    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(dataset, out)
    path = os.path.join(out, shard)
    reader = ArrayRecordReader(path)
    raw = [reader.read([i])[0] for i in range(reader.num_records())]
    reader.close()
    bad = set(records)
    writer = ArrayRecordWriter(path + ".tmp", "group_size:1")
    for i, data in enumerate(raw):
        if i in bad:
            row = codec.decode_row(data)
            tok = int(row.tokens[0]) if row.num_tokens else 1
            segs, at = [], 0
            for n in (int(x) for x in row.segment_lengths):
                seg = np.array(row.tokens[at:at + n])
                seg[:int(round(share * n))] = tok
                segs.append(seg)
                at += n
            data = codec.encode_row(segs, list(row.doc_keys), list(row.chunk_indices), row.seq_len, row.tokens.dtype)
        writer.write(data)
    writer.close()
    os.replace(path + ".tmp", path)
    with open(path, "rb") as f:
        blob = f.read()
    man_path = os.path.join(out, "manifest.json")
    with open(man_path, encoding="utf-8") as f:
        man = json.load(f)
    src = shard.split("/")[0]
    total = 0
    for sh in man["sources"][src]["shards"]:
        if sh["path"] == shard:
            sh["sha256"], sh["bytes"] = hashlib.sha256(blob).hexdigest(), len(blob)
        total += sh["bytes"]
    man["sources"][src]["totals"]["bytes"] = total
    with open(man_path, "w", encoding="utf-8") as f:
        json.dump(man, f, indent=1, sort_keys=True)
    return out


def duplicate_shards(dataset: str, out: str, source: str, copies: int) -> str:
    """A copy of ``dataset`` at ``out`` whose source ``source`` has its shards ``1 .. copies`` replaced by
    copies of its shard 0 (the same bytes), with a manifest that agrees (each copy's sha256, bytes,
    records, tokens and documents those of shard 0; the source's totals and ledger counted again): what
    a packer that wrote one shard several times leaves, which the loader's shard checks accept.
    Returns ``out``.

    Raises:
      ValueError: ``copies`` not in ``[1, shards of the source - 1]``.
    """
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(dataset, out)
    man_path = os.path.join(out, "manifest.json")
    with open(man_path, encoding="utf-8") as f:
        man = json.load(f)
    entry = man["sources"][source]
    shards = entry["shards"]
    if not 1 <= copies < len(shards):
        raise ValueError(f"copies: must be in [1, {len(shards) - 1}] for source {source!r}, got {copies}")
    first = shards[0]
    for sh in shards[1:copies + 1]:
        shutil.copyfile(os.path.join(out, first["path"]), os.path.join(out, sh["path"]))
        sh.update({k: v for k, v in first.items() if k != "path"})
    entry["totals"] = {k: sum(sh[k] for sh in shards) for k in entry["totals"]}
    led = entry["ledger"]
    docs = sum(sh["documents"] for sh in shards)
    led["read"] += docs - led["packed"]
    led["packed"] = docs
    tokens = entry["totals"]["tokens"]
    led["tokens_in"] += tokens - led["tokens_packed"]
    led["tokens_packed"] = tokens
    with open(man_path, "w", encoding="utf-8") as f:
        json.dump(man, f, indent=1, sort_keys=True)
    return out


def judge(scenario: str, expected: Mapping[str, Any], report: Mapping[str, Any]) -> bool:
    """Whether triage's report names the planted cause (module docstring), with the right device,
    restore, shard or layer, and for ``clean`` no suspect check at all."""
    con = report["conclusion"]
    if con["cause"] != expected["cause"]:
        return False
    subj = con["subject"]
    if scenario == "sdc":
        return list(subj.get("devices") or []) == expected["devices"]
    if scenario == "restart":
        r = (subj.get("restores") or [{}])[0]
        return r.get("step") == expected["restore"] and r.get("offset") == expected["offset"]
    if scenario == "data":
        return list(subj.get("shards") or []) == expected["shards"]
    if scenario == "duplicate":  # the shards named are copies of one another (no other shard)
        return bool(subj.get("shards")) and set(subj["shards"]) <= set(expected["shards"])
    if scenario in ("router", "router_scale"):
        return list(subj.get("layers") or [])[:1] == expected["layers"]
    if scenario == "nonfinite":
        return list(subj.get("devices") or []) == expected["devices"]
    return all(c["status"] != "suspect" for c in report["checks"].values())


def run_drills(scenarios: Sequence[str], seeds: Sequence[int], root: str,
               on_result: Optional[Callable[[DrillResult, int], None]] = None, grid: bool = False,
               drills: Optional["Drills"] = None) -> dict[str, Any]:
    """Runs every scenario for every seed under ``root`` (with ``grid``: at every magnitude of
    :data:`GRIDS`, else at the largest); returns the JSON-ready summary: per scenario ``expected``,
    ``found`` (per drill), ``correct`` and ``total``, ``by_magnitude`` (per magnitude, correct and
    total), and the run time.

    Raises:
      ValueError: an unknown scenario.
    """
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"unknown triage scenario(s) {bad}; known: {list(SCENARIOS)}")
    t0 = time.perf_counter()
    drills = drills or Drills(root)
    out: dict[str, Any] = {"kind": "triage_drills", "root": root, "seeds": list(seeds), "grid": grid,
                           "scenarios": {}}
    n = 0
    for scenario in scenarios:
        runs = []
        for magnitude in GRIDS[scenario] if grid else GRIDS[scenario][:1]:
            for seed in seeds:
                r = drills.run(scenario, seed, magnitude)
                runs.append(r)
                n += 1
                if on_result is not None:
                    on_result(r, n)
        by_mag: dict[str, dict[str, int]] = {}
        for r in runs:
            e = by_mag.setdefault(str(r.planted["magnitude"]), {"correct": 0, "total": 0})
            e["correct"] += int(r.correct)
            e["total"] += 1
        out["scenarios"][scenario] = {
            "expected": EXPECTED_CAUSE[scenario], "expected_text": _expected_text(scenario),
            "found": [r.found for r in runs], "correct": sum(r.correct for r in runs), "total": len(runs),
            "by_magnitude": by_mag, "runs": [r.to_dict() for r in runs]}
    out["correct"] = sum(s["correct"] for s in out["scenarios"].values())
    out["total"] = sum(s["total"] for s in out["scenarios"].values())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _expected_text(scenario: str) -> str:
    return {"sdc": "hardware: the faulty device", "restart": "restart fault: the restore and its shift",
            "data": "data: the garbage shard", "duplicate": "data: the copied shards",
            "router": "router: the unstable layer", "router_scale": "router: the layer whose weights were scaled",
            "nonfinite": "hardware: the device whose gradient went non-finite",
            "clean": "optimization event, no check suspect"}[scenario]
