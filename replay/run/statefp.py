"""State fingerprints of checkpoints: what a checkpoint held, per leaf, per shard and per replica.

A checkpoint's *state record* says, in integers, exactly which values the train state being saved
held, so that a restore can check the bytes it read (a *damaged* checkpoint: the file does not match
its own record), the copies of replicated state can be compared (replicas that disagree: an SDC in
the update or in memory, the checkpoint *poisoned*), and ``replay certify`` can check that a segment
replayed on good devices reaches the next checkpoint's record (docs/replay.md, "Certify").

Fingerprints are those of ``replay.run.fingerprint`` (the same order-independent formula as the
gradients': global element indices, so shard fingerprints add up to the leaf's), computed **on the
devices** from the arrays being saved, in one program (:func:`state_fingerprints`)::

    per device d (shard_map over the state's mesh, each leaf with its own PartitionSpec):
        for each leaf l:  f[d, l] = fingerprint(d's local block of l, global indices)   # uint32[4]
    all_gather over the mesh -> f[devices, leaves, 4] on every device (a few KB), then to the host

A replicated leaf (``PartitionSpec()``) is fingerprinted on *every* device that holds a copy, so a
copy that differs is seen whatever copy Orbax writes. The copies outside a strict majority are named;
copies that split with no strict majority (two copies, e.g. an expert shard on two data replicas) are a
*tie*, listed with no device named, since nothing in the record says which is wrong: ``replay certify``
replays the segment on good devices and names the copy the replay does not reach (:func:`resolve_ties`). Orbax writes the copy of ``replica_id`` 0 of
each shard: the first device, in the mesh's device order, that holds it (``saved_by``).

Record (``<run>/checkpoint_records/<step>.json``, :data:`RECORDS_DIR`; the ``checkpoint`` event
carries :func:`event_fields`)::

    {"version": 1, "fingerprint_version": 2, "step": S,
     "leaves": {path: {"fp": 16 hex (the leaf: sum of its shards' saved copies), "nan": n, "inf": n,
                       "shape": [...], "dtype": "float32",
                       "shards": [{"index": "[0:2, :]", "saved_by": device, "fp": hex,
                                   "replicas": {device: hex}}]}},
     "loader": {"sha256": hex of the canonical JSON of the loader state},
     "finite": bool, "nonfinite": {path: nan + inf},
     "replicas_agree": bool, "disagree": [{"leaf", "shard", "devices" (odd ones), "agree" (the rest)}, ...,
                                          {"leaf", "shard", "tie": true, "groups", "replicas", "devices": []}],
     "seconds": s}

Glossary: *leaf path* is ``jax.tree_util.keystr`` of a leaf of the whole train state (e.g.
``['params']['embed']``, ``['opt_state'][1][0].mu['embed']``); *shard* is a distinct block of a leaf
(its index in the global array, NumPy slice notation); *replica* is one device's copy of a shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from replay.run import fingerprint as fpm

RECORD_VERSION = 1
RECORDS_DIR = "checkpoint_records"
"""Folder of the run directory holding one state record per checkpoint step (``<step>.json``)."""


class DamagedCheckpointError(RuntimeError):
    """A restored checkpoint does not match its own state record: its files were damaged after the
    save (or hold another state). Never evidence against a device. ``step``, ``leaf``, ``shard``
    name the first mismatch."""

    def __init__(self, message: str, *, step: int, leaf: Optional[str] = None, shard: Optional[str] = None):
        super().__init__(message)
        self.step, self.leaf, self.shard = int(step), leaf, shard


class PoisonedCheckpointError(RuntimeError):
    """The checkpoint's own record says its replicated state disagreed at the save (an SDC in the
    update or in memory): it must not be restored as healthy. ``devices``: the odd replicas."""

    def __init__(self, message: str, *, step: int, devices: Sequence[int] = ()):
        super().__init__(message)
        self.step, self.devices = int(step), sorted(int(d) for d in devices)


class NonFiniteCheckpointError(RuntimeError):
    """The checkpoint's record says its state holds NaN or Inf values."""


# ----------------------------------------------------------------------------- on the devices


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


_FNS: dict[Any, Any] = {}


def _program(mesh, specs: Sequence[Any], shapes: Sequence[tuple], dtypes: Sequence[Any]):
    """jit(shard_map) giving ``uint32[devices, leaves, 4]`` (every device's fingerprint of its block
    of every leaf), replicated on every device; cached per layout."""
    key = (mesh, tuple(str(s) for s in specs), tuple(shapes), tuple(str(d) for d in dtypes))
    if key in _FNS:
        return _FNS[key]
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    axes = tuple(mesh.axis_names)

    def linear(names):
        lin = 0
        for a in names:
            lin = lin * mesh.shape[a] + jax.lax.axis_index(a)
        return lin

    def per_device(*leaves):
        rows = []
        for x, spec, shape in zip(leaves, specs, shapes):
            if x.ndim == 0:
                rows.append(fpm.fingerprint(x.reshape(1)))
                continue
            offsets = []
            for d in range(x.ndim):
                names = _spec_axes(spec[d]) if d < len(spec) else ()
                offsets.append(linear(names) * x.shape[d] if names else 0)
            rows.append(fpm.fingerprint(x, global_shape=shape, offsets=offsets))
        local = jnp.stack(rows)[None]  # [1, L, 4]
        return jax.lax.all_gather(local, axes, tiled=True)  # [devices, L, 4], mesh order

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False))
    _FNS[key] = fn
    return fn


def _leaf_index(sharding, shape) -> dict[int, tuple]:
    return {int(d.id): idx for d, idx in sharding.devices_indices_map(tuple(shape)).items()}


def _index_text(idx: tuple, shape: Sequence[int]) -> str:
    parts = []
    for s, n in zip(idx, shape):
        lo, hi, _ = s.indices(int(n))
        parts.append(":" if (lo, hi) == (0, int(n)) else f"{lo}:{hi}")
    return "[" + ", ".join(parts) + "]" if parts else "[]"


@dataclasses.dataclass
class StateRecord:
    """A state record (module docstring) as a mapping; :meth:`to_dict` is the JSON form."""

    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    @property
    def finite(self) -> bool:
        return bool(self.data.get("finite", True))

    @property
    def replicas_agree(self) -> bool:
        return bool(self.data.get("replicas_agree", True))

    def leaf_fps(self) -> dict[str, str]:
        """``{leaf path: 16 hex}``: the fingerprint of each leaf's saved value."""
        return {p: v["fp"] for p, v in self.data.get("leaves", {}).items() if "fp" in v}

    def odd_devices(self) -> list[int]:
        """The devices whose copies lost a strict majority vote (a tie names none: :meth:`tied`)."""
        return sorted({int(d) for x in self.data.get("disagree", []) if not x.get("tie") for d in x.get("devices", [])})

    def tied(self) -> list[dict[str, Any]]:
        """The disagreements without a strict majority (two copies that differ, or a split in halves): the
        record cannot say which copy is wrong, so it names none; ``replay certify`` asks a replay of the
        segment (:func:`resolve_ties`)."""
        return [x for x in self.data.get("disagree", []) if x.get("tie")]


def loader_sha256(loader_state: Optional[Mapping[str, Any]]) -> Optional[str]:
    """sha256 of the canonical JSON (sorted keys) of a loader state, or None without one."""
    if loader_state is None:
        return None
    return hashlib.sha256(json.dumps(dict(loader_state), sort_keys=True, default=str).encode()).hexdigest()


def state_fingerprints(state: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """Every device's fingerprint of its block of every leaf of ``state``, computed on the devices.

    Args:
      state: a pytree of global ``jax.Array`` with ``NamedSharding`` on one mesh (float32, bfloat16,
        float16, int32, uint32 leaves; a leaf of another dtype is listed with ``unsupported``).

    Returns:
      ``(paths, leaves)``: per leaf path its ``{"shape", "dtype", "shards": [{"index", "saved_by",
      "replicas": {device id: uint32[4]}}]}`` (shards in first-device order).

    Raises:
      ValueError: a leaf is not a ``jax.Array`` with a ``NamedSharding``, or leaves use different meshes.
    """
    import jax
    from jax.sharding import NamedSharding

    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    arrays = [x for _, x in flat]
    mesh = None
    for p, x in zip(paths, arrays):
        sh = getattr(x, "sharding", None)
        if not isinstance(sh, NamedSharding):
            raise ValueError(f"state leaf {p}: a state fingerprint needs global jax.Arrays with a NamedSharding, got "
                             f"{type(sh).__name__ if sh is not None else type(x).__name__}")
        if mesh is None:
            mesh = sh.mesh
        elif sh.mesh != mesh:
            raise ValueError(f"state leaf {p}: on another mesh than the first leaf's; fingerprint each mesh's part")
    ok = [i for i, x in enumerate(arrays) if np.dtype(x.dtype).name in fpm._SUPPORTED]
    out = [{"shape": list(x.shape), "dtype": np.dtype(x.dtype).name} for x in arrays]
    for i, x in enumerate(arrays):
        if i not in ok:
            out[i]["unsupported"] = np.dtype(x.dtype).name
    if not ok:
        return paths, out
    specs = [arrays[i].sharding.spec for i in ok]
    fn = _program(mesh, specs, [tuple(arrays[i].shape) for i in ok], [arrays[i].dtype for i in ok])
    fps = np.asarray(jax.device_get(fn(*[arrays[i] for i in ok])))  # [devices, L, 4]
    order = [int(d.id) for d in mesh.devices.reshape(-1)]
    for k, i in enumerate(ok):
        x = arrays[i]
        index = _leaf_index(x.sharding, x.shape)
        shards: dict[str, dict[str, Any]] = {}
        for r, dev in enumerate(order):
            text = _index_text(index[dev], x.shape)
            sh = shards.setdefault(text, {"index": text, "saved_by": dev, "replicas": {}})
            sh["replicas"][dev] = fps[r, k]
        out[i]["shards"] = list(shards.values())
    return paths, out


def _majority(replicas: Mapping[int, Any]) -> tuple[Optional[str], list[int], list[int], list[list[int]]]:
    """``(value, devices agreeing with it, the others, groups)``: the value of a strict majority of the
    copies and who differs from it; without a strict majority (two copies that differ, a split in halves)
    ``(None, [], [], groups of equal copies)``: no copy is assumed right, not even the one Orbax writes."""
    groups: dict[str, list[int]] = {}
    for dev, fp in sorted(replicas.items()):
        groups.setdefault(fpm.fingerprint_hex(fp), []).append(int(dev))
    best = max(groups, key=lambda v: (len(groups[v]), -min(groups[v])))
    split = sorted(groups.values())
    if 2 * len(groups[best]) <= len(replicas) and len(groups) > 1:
        return None, [], [], split
    return best, groups[best], sorted(d for v, ds in groups.items() if v != best for d in ds), split


def disagreement_text(entry: Mapping[str, Any]) -> str:
    """One ``disagree`` entry of a record in words: ``device(s) [3] against [0, 1, 2]`` or, for a tie,
    ``devices [3] and [7], no majority: a replay of the segment tells which``."""
    if entry.get("tie"):
        return (" and ".join(str(g) for g in entry.get("groups", [])) + " hold different values with no majority "
                "(the record cannot say which is wrong: 'replay certify' replays the segment to tell)")
    return f"device(s) {entry['devices']} against {entry['agree']}"


def record_state(state: Any, loader_state: Optional[Mapping[str, Any]], step: int) -> StateRecord:
    """The state record (module docstring) of ``state`` and ``loader_state`` as checkpoint ``step``.

    Computed on the devices (:func:`state_fingerprints`); every process gets the whole record (an
    all-gather inside the program), so every process of a run must call it, in the same order.
    Per shard, ``fp`` is the fingerprint of the copy Orbax writes (``saved_by``); a leaf's ``fp``,
    ``nan`` and ``inf`` add up its shards'. Replicas that differ are listed in ``disagree``.
    """
    t0 = time.perf_counter()
    paths, leaves = state_fingerprints(state)
    rec: dict[str, Any] = {"version": RECORD_VERSION, "fingerprint_version": fpm.FINGERPRINT_VERSION,
                           "step": int(step), "leaves": {}, "loader": {"sha256": loader_sha256(loader_state)}}
    nonfinite, disagree = {}, []
    for p, leaf in zip(paths, leaves):
        entry = {k: v for k, v in leaf.items() if k != "shards"}
        if "shards" in leaf:
            total, shards = [], []
            for sh in leaf["shards"]:
                saved = sh["replicas"][sh["saved_by"]]
                total.append(saved)
                value, agree, odd, split = _majority(sh["replicas"])
                if value is None:  # a tie: no copy is named, the saved one included
                    disagree.append({"leaf": p, "shard": sh["index"], "devices": [], "agree": [], "tie": True,
                                     "groups": split, "saved_by": sh["saved_by"], "saved_is_odd": None,
                                     "replicas": {str(d): fpm.fingerprint_hex(v) for d, v in
                                                  sorted(sh["replicas"].items())}})
                elif odd:
                    disagree.append({"leaf": p, "shard": sh["index"], "devices": odd, "agree": agree,
                                     "saved_by": sh["saved_by"], "saved_is_odd": sh["saved_by"] in odd})
                shards.append({"index": sh["index"], "saved_by": sh["saved_by"], "fp": fpm.fingerprint_hex(saved),
                               "replicas": {str(d): fpm.fingerprint_hex(v) for d, v in sorted(sh["replicas"].items())}})
            s = fpm.add_fingerprints(*total)
            entry.update(fp=fpm.fingerprint_hex(s), nan=int(s[2]), inf=int(s[3]), shards=shards)
            if s[2] or s[3]:
                nonfinite[p] = int(s[2]) + int(s[3])
        rec["leaves"][p] = entry
    disagree.sort(key=lambda x: bool(x.get("tie")))  # the ones a majority decides first
    rec.update(finite=not nonfinite, nonfinite=nonfinite, replicas_agree=not disagree, disagree=disagree,
               seconds=round(time.perf_counter() - t0, 6))
    return StateRecord(rec)


def state_total(record: StateRecord) -> str:
    """One 16-hex fingerprint of the whole saved state: the leaves' fingerprints hashed in path order."""
    h = hashlib.blake2b(digest_size=8)
    for p, v in sorted(record.leaf_fps().items()):
        h.update(f"{p}={v};".encode())
    h.update(str(record.data.get("loader", {}).get("sha256")).encode())
    return h.hexdigest()


def event_fields(record: StateRecord, path: Optional[str] = None) -> dict[str, Any]:
    """What the ``checkpoint`` event carries of ``record``: ``state`` = ``{"fingerprint" (the whole
    state, :func:`state_total`), "leaves" ({path: hex}), "loader_sha256", "finite", "nonfinite",
    "replicas_agree", "disagree" (when not), "record" (the record file, relative to the run)}``."""
    d = record.data
    out = {"fingerprint": state_total(record), "leaves": record.leaf_fps(), "loader_sha256": d["loader"]["sha256"],
           "finite": record.finite, "nonfinite": d.get("nonfinite", {}), "replicas_agree": record.replicas_agree,
           "fingerprint_s": d.get("seconds")}
    if not record.replicas_agree:
        out["disagree"] = d["disagree"]
    if path is not None:
        out["record"] = path
    return {"state": out}


# ----------------------------------------------------------------------------- the record on disk


def record_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, RECORDS_DIR, f"{int(step)}.json")


def write_record(run_dir: str, record: StateRecord) -> str:
    """Writes ``record`` beside the checkpoints (temporary name, then renamed); returns its path
    relative to ``run_dir``. Process 0 of a run calls it."""
    path = record_path(run_dir, record.data["step"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record.data, f, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return os.path.relpath(path, run_dir)


def read_record(run_dir: str, step: int) -> Optional[StateRecord]:
    """The state record of checkpoint ``step``, or None when the run has none (written before records).

    Raises:
      DamagedCheckpointError: the record file exists but is not a record (torn or edited).
    """
    path = record_path(run_dir, step)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or int(data.get("step", -1)) != int(step) or "leaves" not in data:
            raise ValueError("not a state record of this step")
    except (ValueError, OSError) as e:
        raise DamagedCheckpointError(
            f"checkpoint {step}: its state record {path} is unreadable ({e}); the checkpoint cannot be trusted: "
            f"restore the previous checkpoint, or run 'replay certify --run {run_dir}'", step=step) from None
    return StateRecord(data)


# ----------------------------------------------------------------------------- at a restore


@dataclasses.dataclass(frozen=True)
class Verification:
    """What a restore's check found: ``status`` ``"verified"`` or ``"unverified"`` (no record: a run
    written before records) and a ``note`` to show."""

    step: int
    status: str
    note: str = ""
    seconds: float = 0.0


def _next_steps(run_dir: str, step: int) -> str:
    older = []
    ck = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ck):
        older = sorted(int(n) for n in os.listdir(ck) if n.isdigit() and int(n) < step)
    prev = f"restore the previous checkpoint ({older[-1]})" if older else "no earlier checkpoint: retrain from scratch"
    return f"{prev}, or run 'replay certify --run {run_dir}' to find the newest checkpoint that is clean"


def _host_shard_fp(x, idx: tuple) -> Optional[np.ndarray]:
    """Fingerprint of block ``idx`` of the restored array ``x`` (on the host, from a device shard
    holding exactly that block, or from the whole array when this process holds it all)."""
    for sh in getattr(x, "addressable_shards", []):
        if tuple(sh.index) == tuple(idx):
            data = np.asarray(sh.data)
            offs = [s.indices(n)[0] for s, n in zip(idx, x.shape)]
            return fpm.fingerprint_np(data, global_shape=x.shape, offsets=offs)
    if getattr(x, "is_fully_addressable", False):
        whole = np.asarray(x)
        offs = [s.indices(n)[0] for s, n in zip(idx, x.shape)]
        return fpm.fingerprint_np(whole[idx], global_shape=x.shape, offsets=offs)
    return None


def _parse_index(text: str, shape: Sequence[int]) -> tuple:
    parts = [p.strip() for p in text.strip("[]").split(",")] if shape else []
    out = []
    for p, n in zip(parts, shape):
        if p == ":":
            out.append(slice(0, int(n)))
        else:
            lo, hi = p.split(":")
            out.append(slice(int(lo), int(hi)))
    return tuple(out)


def verify_restored(run_dir: str, step: int, state: Any, loader_state: Optional[Mapping[str, Any]] = None, *,
                    allow_poisoned: bool = False) -> Verification:
    """Checks a restored checkpoint against its state record before it is used.

    The restored state is fingerprinted on its devices (whatever mesh it was restored onto: leaf
    fingerprints do not depend on the sharding) and compared leaf by leaf with the record; on a
    mismatch the first differing shard of that leaf is found on the host and named.

    Args:
      run_dir: the run directory (``checkpoint_records/<step>.json`` is read).
      step: the checkpoint's step.
      state: the restored train state (global ``jax.Array`` leaves).
      loader_state: the restored loader state (its sha256 is checked when the record has one).
      allow_poisoned: do not refuse a checkpoint whose record lists replicas that disagreed
        (``replay certify`` judges those itself).

    Returns:
      a :class:`Verification`: ``verified``, or ``unverified`` (no record) with a note saying so.

    Raises:
      DamagedCheckpointError: a leaf, shard or the loader state differs from the record, or a leaf
        of the record is missing from the restored state (or the other way).
      PoisonedCheckpointError: the record says the replicas disagreed at the save.
    """
    t0 = time.perf_counter()
    record = read_record(run_dir, step)
    if record is None:
        return Verification(step, "unverified", f"checkpoint {step} of {run_dir} has no state record (a run "
                                                f"written before checkpoint fingerprints): it cannot be verified")
    if not record.replicas_agree and not allow_poisoned:
        odd = record.odd_devices()
        first = record.data["disagree"][0]
        raise PoisonedCheckpointError(
            f"checkpoint {step} is poisoned: at its save the copies of {first['leaf']} shard {first['shard']} "
            f"disagreed, {disagreement_text(first)} (an SDC in the update or in memory; "
            f"{len(record.data['disagree'])} shard(s) in all, odd devices {odd}); do not resume from it: "
            + _next_steps(run_dir, step), step=step, devices=odd)
    import jax

    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    restored = {jax.tree_util.keystr(p): x for p, x in flat}
    want = record.data["leaves"]
    missing = sorted(set(want) - set(restored))
    extra = sorted(set(restored) - set(want))
    if missing or extra:
        raise DamagedCheckpointError(
            f"checkpoint {step} does not match its state record: "
            + (f"leaves {missing[:3]} of the record are not in the restored state" if missing else
               f"restored leaves {extra[:3]} are not in the record")
            + "; the checkpoint holds another state than the one saved: " + _next_steps(run_dir, step),
            step=step, leaf=(missing or extra)[0])
    got = record_state(state, None, step)
    for p, rec in want.items():
        if "fp" not in rec:
            continue
        now = got.data["leaves"][p]
        if now.get("fp") == rec["fp"] and not (got.data["disagree"] and any(x["leaf"] == p for x in got.data["disagree"])):
            continue
        shard, where = None, ""
        for sh in rec.get("shards", []):
            idx = _parse_index(sh["index"], rec["shape"])
            fp = _host_shard_fp(restored[p], idx)
            if fp is not None and fpm.fingerprint_hex(fp) != sh["fp"]:
                shard = sh["index"]
                where = f", shard {shard} (saved from device {sh['saved_by']})"
                break
        raise DamagedCheckpointError(
            f"checkpoint {step} is damaged: leaf {p}{where} restored with fingerprint {now.get('fp')}, its state "
            f"record says {rec['fp']} (the checkpoint's files changed after the save: bit rot, a partial copy or "
            f"an edit; not a device fault, so no replay verdict is given from it); " + _next_steps(run_dir, step),
            step=step, leaf=p, shard=shard)
    want_loader = record.data.get("loader", {}).get("sha256")
    if loader_state is not None and want_loader is not None and loader_sha256(loader_state) != want_loader:
        raise DamagedCheckpointError(
            f"checkpoint {step} is damaged: its loader state restored with sha256 {loader_sha256(loader_state)[:12]}, "
            f"its state record says {want_loader[:12]}; " + _next_steps(run_dir, step), step=step, leaf="loader")
    return Verification(step, "verified", seconds=round(time.perf_counter() - t0, 6))


def resolve_ties(record: StateRecord, replayed: StateRecord) -> tuple[list[int], list[dict[str, Any]]]:
    """``(odd devices, unresolved ties)``: each tie of ``record`` (:meth:`StateRecord.tied`) judged by the
    state a replay on good devices reached (``replayed``, the record of that state): the copies that differ
    from the replayed value of the shard are named when exactly one group of copies equals it; otherwise
    (the replay reached neither copy: the state went wrong earlier, which a logged step shows) the tie
    stays unresolved."""
    odd: set[int] = set()
    unresolved = []
    for x in record.tied():
        shards = {sh["index"]: sh for sh in replayed.data["leaves"].get(x["leaf"], {}).get("shards", [])}
        got = shards.get(x["shard"], {}).get("fp")
        copies = x.get("replicas", {})
        right = [int(d) for d, v in copies.items() if v == got]
        if got is None or not right:
            unresolved.append(x)
            continue
        odd |= {int(d) for d, v in copies.items() if v != got}
    return sorted(odd), unresolved


def compare_with_record(record: StateRecord, state: Any) -> list[dict[str, Any]]:
    """Leaves of ``state`` (e.g. a replayed state) whose fingerprint differs from the record's, each
    ``{"leaf", "want", "got", "replicas"}`` (``replicas``: the recorded copies of its shards that the
    replayed value matches, by device), in path order; empty when the state reproduces the record."""
    got = record_state(state, None, record.data["step"])
    out = []
    for p, rec in sorted(record.data["leaves"].items()):
        if "fp" not in rec:
            continue
        now = got.data["leaves"].get(p, {})
        if now.get("fp") == rec.get("fp"):
            continue
        match = []
        for sh_rec, sh_now in zip(rec.get("shards", []), now.get("shards", [])):
            match += [int(d) for d, v in sh_rec.get("replicas", {}).items() if v == sh_now.get("fp")]
        out.append({"leaf": p, "want": rec.get("fp"), "got": now.get("fp"), "replicas_matching_replay": sorted(match)})
    return out
