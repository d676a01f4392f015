"""State fingerprints of checkpoints: what a checkpoint held, per leaf, per shard and per replica.

A checkpoint's *state record* says, in integers, exactly which values the train state being saved
held, so that a restore can check the bytes it read (a *damaged* checkpoint: the file does not match
its own record), the copies of replicated state can be compared (replicas that disagree: an SDC in
the update or in memory, the checkpoint *poisoned*), and ``replay certify`` can check that a segment
replayed on good devices reaches the next checkpoint's record (docs/replay.md, "Certify").

Fingerprints are those of ``replay.run.fingerprint`` (the same order-independent formula as the
gradients': global element indices, so shard fingerprints add up to the leaf's), computed **on the
devices** from the arrays being saved, in one program (:func:`start_record`: dispatched without
waiting, one device-to-host transfer of its result)::

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
     "replicas_agree": bool, "disagree": [dispute, ...] (below), "seconds": s}

Replicas that disagree (:func:`judge_copies`): the copies of one shard are grouped by value. When one
value is held by more than half of the copies (a strict majority), the others are *odd*: the dispute's
``devices``, ``"majority": true``. Without a strict majority (two copies that differ, the usual case
of an expert shard replicated over a data axis of 2; or 2 against 2) the copies cannot say which is
wrong: ``devices`` lists every copy as a *suspect*, ``"majority": false``, and ``groups`` the devices of
each value; ``replay certify`` decides between them with a replay (``replay.verify.certify``). A
dispute is ``{"leaf", "shard", "devices", "agree" (the majority's devices, or []), "majority",
"groups", "saved_by", "saved_is_odd" (left out without a majority: not known)}``. No copy is assumed
right because Orbax saved it, and no tie is broken by device order: that would name a healthy chip.

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
import pydantic
from typing_extensions import NotRequired, TypedDict  # pydantic's TypedDict before Python 3.12

from contract.validation import adapter, problem
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
    update or in memory): it must not be restored as healthy. ``devices``: the copies a strict majority
    of their replicas names odd; ``suspects``: those and every copy of a shard without a majority."""

    def __init__(self, message: str, *, step: int, devices: Sequence[int] = (), suspects: Sequence[int] = ()):
        super().__init__(message)
        self.step, self.devices = int(step), sorted(int(d) for d in devices)
        self.suspects = sorted({int(d) for d in suspects} | set(self.devices))


# ----------------------------------------------------------------------------- on the devices


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


_LAYOUTS: dict[Any, "_Layout"] = {}


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What one state layout (mesh, leaf specs, shapes, dtypes) fixes once, for every save of it: the
    compiled program and, per fingerprinted leaf, its shards (``(index text, saved_by, rows)``, ``rows``
    being the positions in the program's device axis of the devices holding a copy, mesh order)."""

    fn: Any
    ok: tuple[int, ...]  # the leaves fingerprinted (supported dtypes), in flat order
    devices: tuple[int, ...]  # device id of each row of the program's output, mesh order
    shards: tuple[tuple[tuple[str, int, tuple[int, ...]], ...], ...]  # per leaf of ``ok``


def _program(mesh, specs: Sequence[Any], shapes: Sequence[tuple]):
    """jit(shard_map) giving ``uint32[devices, leaves, 4]`` (every device's fingerprint of its block
    of every leaf), replicated on every device."""
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

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False))


def _layout(mesh, arrays: Sequence[Any]) -> _Layout:
    """The cached :class:`_Layout` of ``arrays`` (global ``jax.Array`` leaves on ``mesh``)."""
    key = (mesh, tuple((str(x.sharding.spec), tuple(x.shape), str(x.dtype)) for x in arrays))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    ok = tuple(i for i, x in enumerate(arrays) if np.dtype(x.dtype).name in fpm._SUPPORTED)
    order = tuple(int(d.id) for d in mesh.devices.reshape(-1))
    row_of = {dev: r for r, dev in enumerate(order)}
    shards = []
    for i in ok:
        x = arrays[i]
        index = _leaf_index(x.sharding, x.shape)
        by_text: dict[str, tuple[str, int, list[int]]] = {}
        for dev in order:
            text = _index_text(index[dev], x.shape)
            by_text.setdefault(text, (text, dev, []))[2].append(row_of[dev])
        shards.append(tuple((t, saved, tuple(rows)) for t, saved, rows in by_text.values()))
    fn = _program(mesh, [arrays[i].sharding.spec for i in ok], [tuple(arrays[i].shape) for i in ok]) if ok else None
    out = _Layout(fn, ok, order, tuple(shards))
    if len(_LAYOUTS) > 32:
        _LAYOUTS.clear()
    _LAYOUTS[key] = out
    return out


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

    def disputes(self) -> list[dict[str, Any]]:
        """The shards whose copies disagree (module docstring, "Replicas that disagree"), judged again from
        the copies' fingerprints the record keeps (so a record written before the majority rule is read
        by it too), in leaf path order."""
        out = []
        for p, leaf in sorted(self.data.get("leaves", {}).items()):
            for sh in leaf.get("shards", []):
                reps = sh.get("replicas") or {}
                if len(set(reps.values())) > 1:
                    out.append(judge_copies(p, sh["index"], {int(d): v for d, v in reps.items()}, int(sh["saved_by"])))
        return out

    def odd_devices(self) -> list[int]:
        """Devices whose copy a strict majority of the other copies names odd."""
        return sorted({int(d) for x in self.disputes() if x["majority"] for d in x["devices"]})

    def suspect_devices(self) -> list[int]:
        """:meth:`odd_devices` and every copy of a shard whose copies have no majority."""
        return sorted({int(d) for x in self.disputes() for d in x["devices"]})


def loader_sha256(loader_state: Optional[Mapping[str, Any]]) -> Optional[str]:
    """sha256 of the canonical JSON (sorted keys) of a loader state, or None without one."""
    if loader_state is None:
        return None
    return hashlib.sha256(json.dumps(dict(loader_state), sort_keys=True, default=str).encode()).hexdigest()


def judge_copies(leaf: str, shard: str, copies: Mapping[int, str], saved_by: int) -> dict[str, Any]:
    """The dispute over one shard whose copies differ (module docstring, "Replicas that disagree").

    Args:
      leaf, shard: the leaf path and the shard's index text.
      copies: device id -> the fingerprint (16 hex) of that device's copy.
      saved_by: the device whose copy Orbax writes.

    Returns:
      ``{"leaf", "shard", "devices", "agree", "majority", "groups", "saved_by", "saved_is_odd"}``: with a
      strict majority (a value held by more than half of the copies) ``devices`` are the others; without
      one, every copy is a suspect, ``agree`` is empty and ``saved_is_odd`` is left out (not known).
    """
    groups: dict[str, list[int]] = {}
    for dev, fp in sorted(copies.items()):
        groups.setdefault(fp, []).append(int(dev))
    ranked = sorted(groups.values(), key=lambda ds: (-len(ds), ds[0]))
    majority = 2 * len(ranked[0]) > len(copies)
    if majority:
        agree, devices = ranked[0], sorted(d for ds in ranked[1:] for d in ds)
    else:
        agree, devices = [], sorted(copies)
    out = {"leaf": leaf, "shard": shard, "devices": devices, "agree": agree, "majority": majority, "groups": ranked,
           "saved_by": int(saved_by)}
    if majority:  # without one, whether the saved copy is the wrong one is not known: the key is left out
        out["saved_is_odd"] = saved_by in devices
    return out


def dispute_text(x: Mapping[str, Any]) -> str:
    """One dispute in words: "the copies of L shard S disagree: device(s) [..] against [..]" or, without a
    majority, which devices hold which value and that the copies alone cannot say which is wrong."""
    if x.get("majority", True):
        return (f"the copies of {x['leaf']} shard {x['shard']} disagree: device(s) {x['devices']} against "
                f"{x['agree']}")
    groups = " vs ".join(str(g) for g in x.get("groups") or [x["devices"]])
    return (f"the {len(x['devices'])} copies of {x['leaf']} shard {x['shard']} disagree ({groups}) with no "
            f"majority: one of device(s) {x['devices']} holds a wrong copy, and the copies alone cannot say which "
            "('replay certify' compares them with a replay on good devices)")


class PendingRecord:
    """A state record whose fingerprints are being computed on the devices (:func:`start_record`):
    :meth:`result` waits for them (one device-to-host transfer of ``uint32[devices, leaves, 4]``) and
    builds the record on the host. Between the two the host is free (e.g. to build the loader state)."""

    def __init__(self, paths: list[str], arrays: list[Any], layout: Optional[_Layout], out: Any, t0: float):
        self._paths, self._arrays, self._layout, self._out, self._t0 = paths, arrays, layout, out, t0

    def result(self, loader_state: Optional[Mapping[str, Any]], step: int) -> "StateRecord":
        """The state record (module docstring) of the state, with ``loader_state``, as checkpoint ``step``."""
        import jax

        lay = self._layout
        rec: dict[str, Any] = {"version": RECORD_VERSION, "fingerprint_version": fpm.FINGERPRINT_VERSION,
                               "step": int(step), "leaves": {}, "loader": {"sha256": loader_sha256(loader_state)}}
        leaves = rec["leaves"]
        for p, x in zip(self._paths, self._arrays):
            leaves[p] = {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
        nonfinite, disagree = {}, []
        if lay is not None and lay.ok:
            fps = np.asarray(jax.device_get(self._out))  # [devices, L, 4] uint32
            words = (fps[..., 1].astype(np.uint64) << np.uint64(32)) | fps[..., 0].astype(np.uint64)
            hexes = [[f"{int(v):016x}" for v in row] for row in words.T.tolist()]  # [L][devices]
            for k, i in enumerate(lay.ok):
                p = self._paths[i]
                col, hx = fps[:, k, :], hexes[k]
                total = np.zeros(4, np.uint64)
                shards = []
                for text, saved, rows in lay.shards[k]:
                    saved_row = lay.devices.index(saved)
                    total += col[saved_row].astype(np.uint64)
                    copies = {lay.devices[r]: hx[r] for r in rows}
                    if len(rows) > 1 and len({hx[r] for r in rows}) > 1:
                        disagree.append(judge_copies(p, text, copies, saved))
                    shards.append({"index": text, "saved_by": saved, "fp": hx[saved_row],
                                   "replicas": {str(d): v for d, v in sorted(copies.items())}})
                s_ = (total & np.uint64(0xFFFFFFFF)).astype(np.uint32)
                leaves[p].update(fp=fpm.fingerprint_hex(s_), nan=int(s_[2]), inf=int(s_[3]), shards=shards)
                if s_[2] or s_[3]:
                    nonfinite[p] = int(s_[2]) + int(s_[3])
        for p, x in zip(self._paths, self._arrays):
            if np.dtype(x.dtype).name not in fpm._SUPPORTED:
                leaves[p]["unsupported"] = np.dtype(x.dtype).name
        rec.update(finite=not nonfinite, nonfinite=nonfinite, replicas_agree=not disagree, disagree=disagree,
                   seconds=round(time.perf_counter() - self._t0, 6))
        return StateRecord(rec)


_PATHS: dict[Any, list[str]] = {}


def _flatten_state(state: Any) -> tuple[list[str], list[Any]]:
    """``(leaf paths, leaves)`` of ``state``; the paths are cached per tree structure."""
    import jax

    arrays, treedef = jax.tree_util.tree_flatten(state)
    paths = _PATHS.get(treedef)
    if paths is None:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        if len(_PATHS) > 32:
            _PATHS.clear()
        _PATHS[treedef] = paths
    return paths, arrays


def start_record(state: Any) -> PendingRecord:
    """Starts fingerprinting every leaf, shard and replica of ``state`` on its devices: one program over
    all leaves, dispatched without waiting (compiled once per layout); :meth:`PendingRecord.result`
    gives the record. Every process of a run must call it, in the same order (the program all-gathers).

    Args:
      state: a pytree of global ``jax.Array`` with ``NamedSharding`` on one mesh (float32, bfloat16,
        float16, int32, uint32 leaves; a leaf of another dtype is listed with ``unsupported``).

    Raises:
      ValueError: a leaf is not a ``jax.Array`` with a ``NamedSharding``, or leaves use different meshes.
    """
    from jax.sharding import NamedSharding

    t0 = time.perf_counter()
    paths, arrays = _flatten_state(state)
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
    if mesh is None:
        return PendingRecord(paths, arrays, None, None, t0)
    lay = _layout(mesh, arrays)
    out = lay.fn(*[arrays[i] for i in lay.ok]) if lay.ok else None
    return PendingRecord(paths, arrays, lay, out, t0)


def record_state(state: Any, loader_state: Optional[Mapping[str, Any]], step: int) -> StateRecord:
    """The state record (module docstring) of ``state`` and ``loader_state`` as checkpoint ``step``:
    :func:`start_record` then :meth:`PendingRecord.result`.

    Computed on the devices; every process gets the whole record (an all-gather inside the program), so
    every process of a run must call it, in the same order. Per shard, ``fp`` is the fingerprint of the
    copy Orbax writes (``saved_by``); a leaf's ``fp``, ``nan`` and ``inf`` add up its shards'. Shards whose
    copies differ are listed in ``disagree`` (:func:`judge_copies`).
    """
    return start_record(state).result(loader_state, step)


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


def disagree_event(record: StateRecord) -> dict[str, Any]:
    """The ``state_replicas_disagree`` event's fields of a record whose copies disagree: ``devices`` (odd by
    a strict majority), ``suspects`` (those and every copy of a shard without a majority), ``disagree``
    (the first 20 disputes), ``shards`` (how many)."""
    d = record.data["disagree"]
    return {"devices": record.odd_devices(), "suspects": record.suspect_devices(), "disagree": d[:20],
            "shards": len(d)}


def poisoned_warning(record: StateRecord, run_dir: str) -> str:
    """What a trainer says when the checkpoint it saves has copies that disagree."""
    return (f"WARNING: checkpoint {record.data['step']} is poisoned: {dispute_text(record.data['disagree'][0])} "
            f"(silent data corruption in the update or in memory); no restore will take it as healthy: run "
            f"'replay certify --run {run_dir}'")


# ----------------------------------------------------------------------------- the record, declared
#
# The state record's JSON form (module docstring), declared for pydantic: read_record validates a record
# file against it, and its JSON Schema is schemas/run_log/checkpoint_record.schema.json (replay.schema).


class ShardRecord(TypedDict):
    """One shard of a leaf: its block, the device whose copy Orbax writes, and every replica's fingerprint."""

    index: str
    """the shard's block of the global array, NumPy slice notation (``[0:2, :]``)"""
    saved_by: int
    """the device whose copy Orbax writes (``replica_id`` 0)"""
    fp: str
    """the fingerprint of that copy (16 hex)"""
    replicas: dict[str, str]
    """per device id holding a copy, its copy's fingerprint"""


class LeafRecord(TypedDict, total=False):
    """One leaf of the saved state."""

    fp: str
    """the leaf's fingerprint: the sum of its shards' saved copies (16 hex)"""
    nan: int
    inf: int
    shape: list[int]
    dtype: str
    shards: list[ShardRecord]
    unsupported: str
    """a leaf of a dtype the fingerprint does not take: the dtype (no fingerprint)"""


class Disagreement(TypedDict, total=False):
    """A shard whose replicas disagreed at the save."""

    leaf: str
    shard: str
    devices: list[int]
    """the odd replicas' devices (with a strict majority); without one, every copy: all are suspects"""
    agree: list[int]
    """the devices of the agreeing majority ([] without one)"""
    majority: bool
    """a value is held by more than half of the copies"""
    groups: list[list[int]]
    """the devices holding each distinct value, the largest group first"""
    saved_by: int
    saved_is_odd: bool


class LoaderRecord(TypedDict):
    sha256: Optional[str]
    """sha256 of the canonical JSON of the loader state (null: saved without one)"""


class StateRecordFile(TypedDict):
    """The state record of one checkpoint (``checkpoint_records/<step>.json``): what the saved train state
    held, per leaf, shard and replica, in integers that compare bit for bit (replay.run.statefp)."""

    version: NotRequired[int]
    fingerprint_version: NotRequired[int]
    step: int
    """the checkpoint's step"""
    leaves: dict[str, LeafRecord]
    """per leaf path (``jax.tree_util.keystr`` of the whole train state)"""
    loader: NotRequired[LoaderRecord]
    finite: NotRequired[bool]
    nonfinite: NotRequired[dict[str, int]]
    """per leaf path with NaN or Inf values, their count"""
    replicas_agree: NotRequired[bool]
    disagree: NotRequired[list[Disagreement]]
    seconds: NotRequired[float]
    """wall seconds the record took"""


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
        f.write(json.dumps(record.data, sort_keys=True, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return os.path.relpath(path, run_dir)


def read_record(run_dir: str, step: int) -> Optional[StateRecord]:
    """The state record of checkpoint ``step``, or None when the run has none (written before records).

    Raises:
      DamagedCheckpointError: the record file exists but is not a record (torn or edited).
    """
    path = record_path(run_dir, step)
    if not os.path.exists(path):
        if _event_says_recorded(run_dir, step):
            raise DamagedCheckpointError(
                f"checkpoint {step}: its state record {path} is missing, while the run's checkpoint event of step "
                f"{step} (events.jsonl) says one was written at the save: the checkpoint cannot be verified and is "
                f"not used (never evidence against a device); put the record back from a copy of the run, or "
                f"restore the previous checkpoint, or run 'replay certify --run {run_dir}'", step=step)
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        try:
            adapter(StateRecordFile).validate_python(data, strict=True)
        except pydantic.ValidationError as e:
            raise ValueError(f"not a state record: {problem(e, StateRecordFile, prefix='record')}") from None
        if int(data["step"]) != int(step):
            raise ValueError(f"the state record of step {data['step']}, not {step}")
    except (ValueError, OSError) as e:
        raise DamagedCheckpointError(
            f"checkpoint {step}: its state record {path} is unreadable ({e}); the checkpoint cannot be trusted: "
            f"restore the previous checkpoint, or run 'replay certify --run {run_dir}'", step=step) from None
    return StateRecord(data)


def _event_says_recorded(run_dir: str, step: int) -> bool:
    """Whether ``events.jsonl`` holds a checkpoint event of ``step`` with its state fingerprints (``state``):
    the save wrote a record beside the checkpoint, so a missing record is a loss, not an old run's. False
    when the events cannot be read (their own readers report that)."""
    from replay.run import protocol as proto

    if not os.path.exists(os.path.join(run_dir, proto.EVENTS_NAME)):
        return False
    try:
        events = proto.read_events(run_dir)
    except (OSError, ValueError):
        return False
    return any(e.get("event") == "checkpoint" and e.get("step") == step and isinstance(e.get("state"), Mapping)
               for e in events)


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
        disputes = record.disputes() or record.data.get("disagree") or [{"leaf": "?", "shard": "?", "devices": []}]
        odd, suspects = record.odd_devices(), record.suspect_devices()
        raise PoisonedCheckpointError(
            f"checkpoint {step} is poisoned: at its save {dispute_text(disputes[0])} (an SDC in the update or in "
            f"memory; {len(disputes)} shard(s) in all, "
            + (f"odd devices {odd}" if odd == suspects else f"suspect devices {suspects}") + "); do not resume "
            "from it: " + _next_steps(run_dir, step), step=step, devices=odd, suspects=suspects)
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


def _as_record(state: Any, step: int) -> StateRecord:
    return state if isinstance(state, StateRecord) else record_state(state, None, step)


def compare_with_record(record: StateRecord, state: Any) -> list[dict[str, Any]]:
    """Leaves of ``state`` (e.g. a replayed state, or its :class:`StateRecord`) whose fingerprint differs
    from the record's, each ``{"leaf", "want", "got", "replicas_matching_replay"}`` (the recorded copies of
    its shards that the replayed value matches, by device), in path order; empty when the state reproduces
    the record."""
    got = _as_record(state, record.data["step"])
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


def match_replicas(record: StateRecord, state: Any) -> dict[tuple[str, str], list[int]]:
    """For each disputed shard of ``record`` (:meth:`StateRecord.disputes`), the devices whose recorded
    copy equals the same shard of ``state`` (a state replayed on good devices, or its record; on a mesh of the run's
    shape: shards are matched by their index), ``{(leaf, shard): [device, ...]}``; a shard ``state`` does
    not hold as one block is left out. ``replay certify`` uses it to say which copy of a dispute without
    a majority is the wrong one."""
    disputes = record.disputes()
    if not disputes:
        return {}
    got = _as_record(state, record.data["step"])
    out: dict[tuple[str, str], list[int]] = {}
    for x in disputes:
        now = {sh["index"]: sh["fp"] for sh in got.data["leaves"].get(x["leaf"], {}).get("shards", [])}
        if x["shard"] not in now:
            continue
        reps = next(sh["replicas"] for sh in record.data["leaves"][x["leaf"]]["shards"] if sh["index"] == x["shard"])
        out[(x["leaf"], x["shard"])] = sorted(int(d) for d, v in reps.items() if v == now[x["shard"]])
    return out
