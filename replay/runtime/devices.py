"""Device specs: which devices a replay or canary runs on. Pure: no JAX, no I/O but the quarantine file.

A *device spec* names a set of devices by ``jax.Device.id``::

    all                 every device of this process group
    good                all but the devices held suspect: quarantined (the run's quarantine.txt, or
                        --quarantine FILE) or named by `replay scan` (the run's suspects.json)
    suspect             only the devices held suspect
    0,3,5-7             explicit ids and inclusive ranges
    process:1           every device of process 1 (also process:0,2 and process:0-1)

Parts may be joined with ``+`` (union), e.g. ``process:0+12``. The result keeps the order of
the available device list (so the same spec always gives the same mesh), never the order of
the spec.

A *mesh assignment* is the list of device ids placed, in row-major order, on the run's mesh
shape. Two assignments are *independent* when no mesh position gets the same device in both:
then every device shard of the original run is recomputed by two different devices.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Iterable, Mapping, Optional, Sequence

QUARANTINE_NAME = "quarantine.txt"


class DeviceSpecError(ValueError):
    """A device spec is malformed, names unknown devices, or leaves too few devices."""


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """A device as an operator finds it.

    Attributes:
      id: the global device id (``jax.Device.id``: unique across the processes of a run; on CPU,
        process p's devices are numbered from ``p * 2048``).
      process_index: the process that drives it.
      kind: the device kind (e.g. ``cpu``, ``TPU v5``).
      host: the host name of its process (empty when not recorded).
      local_index: its index among its process's devices (``jax.local_devices()`` order), or None.
    """

    id: int
    process_index: int = 0
    kind: str = ""
    host: str = ""
    local_index: Optional[int] = None

    def label(self, coords: Optional[Mapping[str, int]] = None) -> str:
        """``"device 2049 (host h1, process 1, local device 1, mesh data=1,expert=0)"``: how an operator
        finds the chip (``coords``: its mesh coordinates, when it had a mesh position)."""
        parts = [f"host {self.host}" if self.host else None, f"process {self.process_index}",
                 None if self.local_index is None else f"local device {self.local_index}",
                 None if not coords else "mesh " + ",".join(f"{a}={int(i)}" for a, i in coords.items())]
        return f"device {self.id} ({', '.join(p for p in parts if p)})"

    def to_dict(self, coords: Optional[Mapping[str, int]] = None) -> dict:
        """The report form: ``id``, ``host``, ``process``, ``local_device``, ``mesh`` (coordinates), ``label``."""
        return {"id": self.id, "host": self.host, "process": self.process_index, "local_device": self.local_index,
                "mesh": dict(coords or {}), "label": self.label(coords)}


def device_table(env: Mapping) -> dict[int, DeviceInfo]:
    """Per global device id, the :class:`DeviceInfo` of an environment record (``env.json``: its
    ``devices`` table, ``replay.run.env.record_environment``). A record written before the table
    existed (one process) gives the mesh's devices with the record's host name, process 0 and the
    id as the local index (one process numbers its devices 0, 1, ...). Pure."""
    table = env.get("devices") if isinstance(env, Mapping) else None
    out: dict[int, DeviceInfo] = {}
    if isinstance(table, Mapping) and table:
        for k, v in table.items():
            try:
                out[int(k)] = DeviceInfo(int(k), int(v.get("process", 0)), str(v.get("kind", "")),
                                         str(v.get("host", "")), None if v.get("local") is None else int(v["local"]))
            except (TypeError, ValueError, AttributeError):
                continue
        return out
    mesh = env.get("mesh") if isinstance(env, Mapping) else None
    backend = env.get("backend") if isinstance(env, Mapping) and isinstance(env.get("backend"), Mapping) else {}
    ids = (mesh or {}).get("device_ids") or [] if isinstance(mesh, Mapping) else []
    for i in ids:
        try:
            out[int(i)] = DeviceInfo(int(i), 0, str(backend.get("device_kind", "")), str(env.get("hostname", "")),
                                     int(i) if int(backend.get("process_count", 1) or 1) == 1 else None)
        except (TypeError, ValueError):
            continue
    return out


def describe(device: int, table: Mapping[int, DeviceInfo]) -> DeviceInfo:
    """The :class:`DeviceInfo` of ``device`` from ``table`` (a bare id's when the table lacks it)."""
    return table.get(int(device)) or DeviceInfo(int(device))


def name_devices(ids: Iterable[int], table: Mapping[int, DeviceInfo],
                 coords: Optional[Mapping[int, Mapping[str, int]]] = None) -> list[dict]:
    """The report form (:meth:`DeviceInfo.to_dict`) of each device of ``ids``, with its mesh coordinates."""
    coords = coords or {}
    return [describe(d, table).to_dict(coords.get(int(d))) for d in ids]


def placement_record(index: int, assignment: Sequence[int], table: Mapping[int, DeviceInfo]) -> dict:
    """A placement of a report: its ``index``, its devices (``assignment``, row-major on the run's mesh)
    and the processes and hosts they are on (from ``table``)."""
    infos = [table.get(d) or DeviceInfo(d) for d in assignment]
    return {"index": index, "devices": list(assignment), "processes": sorted({i.process_index for i in infos}),
            "hosts": sorted({i.host for i in infos if i.host})}


def read_quarantine(path: str) -> frozenset[int]:
    """Reads a quarantine file: device ids, one a line; ``#`` starts a comment; blank lines skipped.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      DeviceSpecError: a line is not a non-negative integer (names the line number).
    """
    ids = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not re.fullmatch(r"[0-9]+", text):  # str.isdigit() accepts '²', which int() rejects
                raise DeviceSpecError(f"{path}:{n}: expected a device id (integer >= 0), got {text!r}")
            ids.add(int(text))
    return frozenset(ids)


_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
MAX_RANGE = 1 << 16
NAMES = ("all", "good", "suspect")  # the named sets of a device spec (and process:N)
_NAMES_HELP = "(names: all, good, suspect, process:N; device ids like 0,3,5-7; parts join with '+')"


def _bad_part(part: str, text: str, what: str) -> DeviceSpecError:
    """The error for a part that is not an id or range: a misspelt name gets the names and the nearest."""
    if what == "device id" and re.search(r"[^0-9\s,-]", part):
        head, sep, tail = part.partition(":")
        if part in NAMES:  # a name inside a comma list: names join with '+'
            return DeviceSpecError(f"device spec: {part!r} is a name, not a device id; names and ids join "
                                   f"with '+': {text.replace(',', '+')!r}")
        close = difflib.get_close_matches(head, [*NAMES, "process"], n=1, cutoff=0.6)
        guess = ""
        if close:
            guess = close[0] if close[0] != "process" else f"process:{tail if sep and tail else 'N'}"
            guess = f"did you mean {guess!r}? "
        return DeviceSpecError(f"device spec: unknown name {part!r}; {guess}{_NAMES_HELP}")
    return DeviceSpecError(f"device spec: bad {what} {part!r}; expected an integer or an inclusive range like 5-7")


def _parse_ids(text: str, what: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = _RANGE.match(part)
        if not m:
            raise _bad_part(part, text, what)
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise DeviceSpecError(f"device spec: range {part!r} is empty ({hi} < {lo})")
        if hi - lo >= MAX_RANGE:  # never materialize a billion ids for a typo
            raise DeviceSpecError(f"device spec: range {part!r} names {hi - lo + 1} {what}s; at most {MAX_RANGE}")
        out.extend(range(lo, hi + 1))
    return out


def parse_spec(spec: str) -> list[tuple[str, tuple[int, ...]]]:
    """Parses a device spec (grammar in the module docstring) without a device list, so that a typo is
    reported before any work starts.

    Returns:
      One ``(kind, ids)`` per ``+`` part: ``("all" | "good" | "suspect", ())``, ``("process",
      process indices)`` or ``("ids", device ids)``, in the order of the spec.

    Raises:
      DeviceSpecError: an empty spec; a part that is neither a name nor ids (a misspelt name lists
        the names and suggests the nearest, e.g. ``goood`` -> ``good``); an empty or huge range.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceSpecError("device spec: empty; use all, good, suspect, ids like 0,3,5-7, or process:N")
    parts: list[tuple[str, tuple[int, ...]]] = []
    for part in spec.split("+"):
        part = part.strip().lower()
        if part in NAMES:
            parts.append((part, ()))
        elif part.startswith("process:"):
            parts.append(("process", tuple(_parse_ids(part[len("process:"):], "process index"))))
        else:
            parts.append(("ids", tuple(_parse_ids(part, "device id"))))
    return parts


def select_devices(
    spec: str,
    devices: Sequence[DeviceInfo],
    quarantine: Iterable[int] = (),
    minimum: int = 1,
) -> list[DeviceInfo]:
    """Resolves a device spec against the available devices.

    Args:
      spec: the spec (grammar in the module docstring).
      devices: the available devices, in the order meshes are built from (``jax.devices()``).
      quarantine: device ids held suspect (quarantined, or named by ``replay scan``).
      minimum: the fewest devices the caller can use (the run's mesh size); >= 1.

    Returns:
      The chosen devices, in the order of ``devices``.

    Raises:
      DeviceSpecError: an empty or malformed spec (:func:`parse_spec`); an id or process that does
        not exist (the message lists those that do); or fewer than ``minimum`` devices chosen.
    """
    parts = parse_spec(spec)
    by_id = {d.id: d for d in devices}
    processes = sorted({d.process_index for d in devices})
    quarantined = frozenset(quarantine)
    chosen: set[int] = set()
    for kind, wanted in parts:
        if kind == "all":
            chosen.update(by_id)
        elif kind == "good":
            chosen.update(i for i in by_id if i not in quarantined)
        elif kind == "suspect":
            if not quarantined:
                raise DeviceSpecError(
                    "device spec: 'suspect' but no device is held suspect (no quarantine.txt in the run "
                    "directory, no --quarantine FILE, and no suspect device in suspects.json: run "
                    "'replay scan' first)"
                )
            chosen.update(i for i in by_id if i in quarantined)
        elif kind == "process":
            unknown = sorted(set(wanted) - set(processes))
            if unknown:
                raise DeviceSpecError(
                    f"device spec: no process {unknown}; processes are {processes}"
                )
            chosen.update(d.id for d in devices if d.process_index in wanted)
        else:
            unknown = sorted(set(wanted) - set(by_id))
            if unknown:
                raise DeviceSpecError(
                    f"device spec: no device with id {unknown}; device ids are {sorted(by_id)}"
                )
            chosen.update(wanted)
    out = [d for d in devices if d.id in chosen]
    if len(out) < minimum:
        if len(devices) < minimum:
            hint = (f"this process sees only {len(devices)} device(s) in all: on CPU, set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={minimum} (or more) before starting")
        else:
            hint = "choose more devices (e.g. 'all') or quarantine fewer"
        raise DeviceSpecError(
            f"device spec {spec!r} leaves {len(out)} device(s) {[d.id for d in out]}, but the run's mesh "
            f"needs {minimum}; {hint}"
        )
    return out


def independent_assignments(ids: Sequence[int], mesh_size: int, count: int = 2) -> list[list[int]]:
    """Places ``count`` replays of a ``mesh_size``-device mesh on the devices ``ids``.

    Assignment ``i`` puts device ``ids[(j + i * shift) % L]`` at mesh position ``j`` (row-major),
    with ``L = len(ids)`` and ``shift = mesh_size`` when that is not a multiple of ``L``, else 1.
    With ``L >= count * mesh_size`` the assignments are disjoint device sets; with fewer devices
    they share devices, but consecutive assignments still never give a mesh position the same
    device (for ``L >= 2``), so each device shard is recomputed on a different device.

    Args:
      ids: the chosen device ids, in mesh order.
      mesh_size: devices in the run's mesh, >= 1.
      count: replays wanted, >= 1.

    Returns:
      ``count`` lists of ``mesh_size`` device ids.

    Raises:
      DeviceSpecError: fewer than ``mesh_size`` ids.
      ValueError: ``mesh_size`` or ``count`` < 1.
    """
    if mesh_size < 1 or count < 1:
        raise ValueError(f"mesh_size and count must be >= 1, got {mesh_size} and {count}")
    n = len(ids)
    if n < mesh_size:
        raise DeviceSpecError(f"{n} device(s) {list(ids)} are too few for a mesh of {mesh_size}")
    shift = mesh_size if mesh_size % n else 1
    return [[ids[(j + i * shift) % n] for j in range(mesh_size)] for i in range(count)]
