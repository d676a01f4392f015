"""The environment record of a run (``<run>/env.json``) and its comparison with another.

A replay is only a fair retrial when it runs the same software, flags and mesh as the
training run, or when the differences are known. :func:`record_environment` captures what
decides the bits a step computes; :func:`compare_environment` lists the differences in
words, for the replay report.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any, Mapping, Optional

# Environment variables that change what XLA compiles or how JAX behaves.
RELEVANT_ENV_VARS = (
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "JAX_ENABLE_X64",
    "JAX_DEFAULT_MATMUL_PRECISION",
    "JAX_DEFAULT_PRNG_IMPL",
    "JAX_THREEFRY_PARTITIONABLE",
    "LIBTPU_INIT_ARGS",
    "TPU_MEGACORE",
    "NVIDIA_TF32_OVERRIDE",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "CUDA_VISIBLE_DEVICES",
    "TF_CPP_MIN_LOG_LEVEL",
)

# jax.config flags that change numerics or random streams.
RELEVANT_JAX_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_enable_custom_prng",
    "jax_softmax_custom_jvp",
)

# Keys whose difference does not change computed bits (reported as notes, not mismatches).
_INFORMATIONAL = ("hostname", "python_executable", "env.TF_CPP_MIN_LOG_LEVEL", "env.XLA_PYTHON_CLIENT_PREALLOCATE",
                  # not drift: equal bits for many counts (4 and 8 above); range replay explains an
                  # unlocalized difference by it (replay.verify.engine.cpu_threads_hint)
                  "backend.cpu_threads")


# Variables holding whitespace-separated flags: compared as sets of flags, not as strings.
_FLAG_LISTS = ("env.XLA_FLAGS", "env.LIBTPU_INIT_ARGS")


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is recorded as None
        return None


def record_environment(mesh: Any = None) -> dict[str, Any]:
    """Returns a JSON-serializable record of what decides a step's bits.

    Args:
      mesh: the run's ``jax.sharding.Mesh`` (``None``: no mesh fields).

    Returns:
      dict with ``versions`` (python, jax, jaxlib, numpy, optax, orbax-checkpoint, grain,
      ml_dtypes, and ``fingerprint``: replay.run.fingerprint.FINGERPRINT_VERSION), ``env``
      (:data:`RELEVANT_ENV_VARS` that are set), ``jax_config``
      (:data:`RELEVANT_JAX_FLAGS`), ``backend`` (platform, device kind, device count, local
      device count, process index and count, platform version, ``collectives``: what reduces
      across devices, ``replay.runtime.distributed.collectives``), ``mesh`` (axis names, shape, device
      ids in mesh order, per device id its coordinates), ``hostname`` (this process's), ``processes``
      (per process index: its host name and device ids) and ``devices`` (per global device id:
      ``process``, ``local`` (its index among its process's devices), ``host``, ``kind``): what a
      report names a device by (``replay.runtime.devices.device_table``). With several processes the first
      call is a collective (the host names are gathered): every process calls it.
    """
    import jax
    import numpy as np

    from replay.runtime import distributed
    from replay.run.fingerprint import FINGERPRINT_VERSION

    devices = jax.devices()
    hosts = distributed.process_hosts()
    try:  # jax.extend is a lazy submodule in JAX 0.11 (absent from `jax`'s attributes until imported)
        import jax.extend.backend as jax_backend

        backend = jax_backend.get_backend()
    except ImportError:
        backend = None
    rec: dict[str, Any] = {
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": _version("jaxlib"),
            "numpy": np.__version__,
            "optax": _version("optax"),
            "orbax-checkpoint": _version("orbax-checkpoint"),
            "grain": _version("grain"),
            "ml_dtypes": _version("ml_dtypes"),
            "fingerprint": FINGERPRINT_VERSION,  # replay refuses logs of another formula
        },
        "env": {k: os.environ[k] for k in RELEVANT_ENV_VARS if k in os.environ},
        "jax_config": {},
        "backend": {
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "platform_version": getattr(backend, "platform_version", None),
            "collectives": distributed.collectives(),
        },
        "hostname": platform.node(),
        "python_executable": sys.executable,
    }
    if devices[0].platform == "cpu":
        rec["backend"]["cpu_threads"] = cpu_threads(jax.local_device_count())
    rec["devices"], rec["processes"] = device_records(devices, hosts)
    for flag in RELEVANT_JAX_FLAGS:
        try:
            value = getattr(jax.config, flag)
        except AttributeError:
            continue
        rec["jax_config"][flag] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    if mesh is not None:
        ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
        coords = {}
        for pos in np.ndindex(ids.shape):
            coords[str(int(ids[pos]))] = {name: int(i) for name, i in zip(mesh.axis_names, pos)}
        rec["mesh"] = {
            "axis_names": list(mesh.axis_names),
            "shape": [int(n) for n in ids.shape],
            "device_ids": [int(i) for i in ids.reshape(-1)],
            "device_coords": coords,
        }
    return rec


def cpu_threads(local_device_count: int) -> int:
    """The intra-op thread count XLA:CPU sizes a process's matrix products by: the larger of the
    CPUs this process may run on (``os.sched_getaffinity``) and its local device count.

    Measured on jaxlib 0.10.2 (docs/trainer.md, "Bit identity"): the bits of a float32
    ``[2048, 128]^T @ [2048, 8]`` product (the router's weight gradient of the demo model) are the same
    for 4 and 8 local devices on 2 CPUs and for 4 devices on 1 CPU, and differ with 1 or 2 devices on
    2 CPUs and with 1 device on 1 CPU: Eigen splits a long contraction's sum over the threads it has.
    So a run of 2 processes x 2 devices and its replay by 1 process x 8 devices compute different
    bits on every device without any fault. Recorded as ``backend.cpu_threads`` in env.json (CPU only).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(int(cpus), int(local_device_count))


def device_records(devices: Any, hosts: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``({device id: {"process", "local", "host", "kind"}}, [{"index", "host", "devices"}])`` of the
    global devices (``jax.devices()``) and the processes' host names (by process index). ``local`` is
    the device's index among its process's devices in id order (``jax.local_devices()``'s order)."""
    by_proc: dict[int, list[int]] = {}
    for d in sorted(devices, key=lambda d: d.id):
        by_proc.setdefault(int(d.process_index), []).append(int(d.id))
    table = {}
    for d in devices:
        p = int(d.process_index)
        table[str(int(d.id))] = {"process": p, "local": by_proc[p].index(int(d.id)),
                                 "host": hosts[p] if p < len(hosts) else "", "kind": d.device_kind}
    procs = [{"index": p, "host": hosts[p] if p < len(hosts) else "", "devices": ids}
             for p, ids in sorted(by_proc.items())]
    return table, procs


# Keys that never decide a step's bits: the processes and where they ran (a 2 x 4 run replayed by
# 1 x 8 devices computes the same program; the mesh shape and order, compared, are what count).
PLACEMENT_KEYS = ("backend.process_index", "backend.process_count", "backend.device_count",
                  "backend.local_device_count", "devices", "processes")


def _flatten(rec: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in rec.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and key not in ("device_coords", "devices"):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


# Flags that say how many devices a process has, not what they compute: a run of 2 processes x 4 CPU
# devices is replayed by one process of 8 (the mesh shape and device order are compared apart).
PLACEMENT_FLAGS = ("--xla_force_host_platform_device_count",)


def _flags(value: str) -> list[str]:
    return sorted(f for f in value.split() if f.split("=")[0] not in PLACEMENT_FLAGS)


def compare_environment(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Lists the differences between two environment records, one string each.

    Args:
      recorded: the training run's record (``env.json``).
      current: this process's record (:func:`record_environment`).

    Returns:
      e.g. ``["versions.jax: recorded 0.10.2, current 0.10.1", "env.XLA_FLAGS: recorded
      '--x', current unset"]``, sorted by key; empty when nothing that decides the bits
      differs. Differences in host name, Python executable and logging-only variables are
      prefixed ``"note: "``.
    """
    a, b = _flatten(recorded), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in ("mesh.device_coords", "step_log_check"):
            continue  # implied by mesh.device_ids and mesh.shape; how the writer sealed its logs, no bits
        va = a.get(key, "<unset>")
        vb = b.get(key, "<unset>")
        if key in ("backend.collectives", "backend.cpu_threads") and "<unset>" in (va, vb):
            continue  # a record from before the field: its collectives are not known
        if key in _FLAG_LISTS and isinstance(va, str) and isinstance(vb, str) and _flags(va) == _flags(vb):
            continue  # the same flags in another order (or spacing) compile the same program
        if va != vb:
            prefix = "note: " if key in _INFORMATIONAL or key.split(".")[0] in ("devices", "processes") \
                or key in PLACEMENT_KEYS else ""
            out.append(f"{prefix}{key}: recorded {va!r}, current {vb!r}")
    return out


def replay_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The differences of :func:`compare_environment` that decide bits when a run is replayed on other
    devices: the mesh's device ids and the process index are left out (replaying on other devices is
    the point; the mesh shape and axis names still count), and informational notes are dropped."""
    return [d for d in compare_environment(recorded, current) if not d.startswith("note: ")
            and not d.startswith("mesh.device_ids") and not d.startswith("backend.process_index")]


# Flags the reference trainer pins so that a rerun computes the same bits (docs/trainer.md).
# CPU needs none (XLA:CPU is deterministic for a fixed program and device order); these are
# read only by the GPU compiler and accepted, unused, elsewhere.
DETERMINISM_XLA_FLAGS = (
    "--xla_gpu_deterministic_ops=true",  # deterministic scatter/reductions; fails on ops without a deterministic kernel
)


def pin_determinism_flags(environ=None) -> list[str]:
    """Appends :data:`DETERMINISM_XLA_FLAGS` missing from ``XLA_FLAGS``; returns those added.

    Call before JAX initializes its backend (before the first computation); the flags then
    appear in :func:`record_environment`'s ``env.XLA_FLAGS``.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "")
    present = {f.split("=")[0] for f in current.split()}
    added = [f for f in DETERMINISM_XLA_FLAGS if f.split("=")[0] not in present]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
