"""Many processes, one run: ``jax.distributed`` start-up, cross-process bookkeeping, and the guard that
stops every process of a run when one dies.

A pod-scale run is a multi-controller JAX program: N processes, each with its local devices, started
together. The training command and every ``replay`` command take JAX's own three settings
(``jax.distributed.initialize``'s arguments) as flags::

    --coordinator-address HOST:PORT   process 0's address and a free port (JAX: coordinator_address)
    --num-processes N                 how many processes (JAX: num_processes)
    --process-id I                    this process, 0 <= I < N (JAX: process_id)

and, like ``jax.distributed.initialize()`` without arguments, the environment JAX's cluster
auto-detection reads: ``JAX_COORDINATOR_ADDRESS`` (and ``JAX_COORDINATOR_PORT``,
``JAX_LOCAL_DEVICE_IDS``), a Slurm job step of several tasks (``SLURM_JOB_ID``, ``SLURM_NTASKS``,
``SLURM_PROCID``, ...), Open MPI's ``mpirun`` (``OMPI_MCA_orte_hnp_uri``, ``OMPI_COMM_WORLD_SIZE``,
``OMPI_COMM_WORLD_RANK``), multi-host Cloud TPU (``TPU_WORKER_HOSTNAMES``, ``TPU_WORKER_ID``) and a
Kubernetes indexed job (``JOB_COMPLETION_INDEX``): flags that are not given are then filled in by JAX
(:func:`cluster_in_environment` says which cluster it saw). Without any of them a command runs as
one process, as before.

On CPU the cross-process collectives are gloo's (``jax_cpu_collectives_implementation = "gloo"``).
Gloo sums an all-reduce in another order than XLA's in-process collectives, so the collectives
decide a step's bits like NCCL's algorithm does on GPUs: ``env.json`` records them
(``backend.collectives``, :func:`collectives`), and a one-process ``replay`` of a run that reduced
with gloo starts a one-process ``jax.distributed`` with gloo too (:func:`match_collectives`).

Cross-process bookkeeping uses ``jax.experimental.multihost_utils`` (``process_allgather``), never
files: :func:`gather_json` exchanges small JSON results, :func:`process_hosts` the host names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
from typing import Any, Mapping, Optional, Sequence

DEFAULT_HEARTBEAT_TIMEOUT_S = 10
EXIT_PEER_LOST = 4  # a process of the run died: this one stopped too (restart them all)
_SUPERVISED_ENV = "REPLAY_SUPERVISED_WORKER"
FATAL_MARK = "JAX distributed service detected fatal errors"


class DistributedConfigError(ValueError):
    """The process flags or the cluster environment are inconsistent (names the value and what to do)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedArgs:
    """How this process joins its run (``jax.distributed.initialize``'s arguments).

    Attributes:
      coordinator_address: ``HOST:PORT`` of process 0's coordination service, or None (JAX's
        auto-detection, or ``JAX_COORDINATOR_ADDRESS``).
      num_processes: processes of the run, >= 1, or None (auto-detected).
      process_id: this process, in ``[0, num_processes)``, or None (auto-detected).
      cluster: the cluster environment JAX will read the missing values from (``"slurm"``, ...), or None.
      heartbeat_timeout_s: seconds without a heartbeat after which the coordination service declares
        a process dead and every other process stops (JAX's ``heartbeat_timeout_seconds``), >= 1.
    """

    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    cluster: Optional[str] = None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise DistributedConfigError(f"--num-processes: must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise DistributedConfigError(f"--process-id: must be >= 0, got {self.process_id}")
        if (self.num_processes is not None and self.process_id is not None
                and self.process_id >= self.num_processes):
            raise DistributedConfigError(
                f"--process-id {self.process_id}: must be < --num-processes {self.num_processes} (0-based)")
        if self.coordinator_address is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", self.coordinator_address):
            raise DistributedConfigError(
                f"--coordinator-address: expected HOST:PORT (process 0's address and a free port, e.g. "
                f"127.0.0.1:1234), got {self.coordinator_address!r}")
        if self.heartbeat_timeout_s < 1:
            raise DistributedConfigError(f"--heartbeat-timeout: must be >= 1 s, got {self.heartbeat_timeout_s}")

    @property
    def flags(self) -> list[str]:
        """The command-line flags that give these settings (for messages and restarts)."""
        out = []
        if self.coordinator_address is not None:
            out += ["--coordinator-address", self.coordinator_address]
        if self.num_processes is not None:
            out += ["--num-processes", str(self.num_processes)]
        if self.process_id is not None:
            out += ["--process-id", str(self.process_id)]
        return out


def add_arguments(parser: Any) -> None:
    """Adds the process flags (JAX's names) to an ``argparse`` parser, in a group of their own."""
    g = parser.add_argument_group(
        "processes (jax.distributed; default: one process, or what JAX's cluster auto-detection finds: "
        "JAX_COORDINATOR_ADDRESS, Slurm, Open MPI, multi-host Cloud TPU, Kubernetes)")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="process 0's address and a free port, the same for every process")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes of the run")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0 .. N-1")
    g.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="S",
                   help=f"seconds without a heartbeat before the others stop (default {DEFAULT_HEARTBEAT_TIMEOUT_S})")


def cluster_in_environment(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The multi-process cluster environment JAX's auto-detection would use, or None.

    Pure: reads only ``environ``. A job of one task (``SLURM_NTASKS=1``, ``OMPI_COMM_WORLD_SIZE=1``,
    one TPU worker host) is not a cluster: the command runs as one plain process.
    """
    env = os.environ if environ is None else environ

    def count(name: str) -> int:
        try:
            return int(env.get(name, "1") or "1")
        except ValueError:
            return 1

    if "SLURM_JOB_ID" in env and count("SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "open-mpi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "cloud-tpu"
    if env.get("JOB_COMPLETION_INDEX") is not None and env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if env.get("JAX_COORDINATOR_ADDRESS"):  # the address alone: the process count and id come from the flags
        return "JAX_COORDINATOR_ADDRESS"
    return None


def from_args(args: Any, environ: Optional[Mapping[str, str]] = None) -> Optional[DistributedArgs]:
    """The process settings of a command: its flags, else the cluster environment; None for one plain process.

    Raises:
      DistributedConfigError: inconsistent flags (``--process-id`` without ``--num-processes`` and no
        cluster to fill it in, ids out of range, a malformed address).
    """
    addr, n, pid = (getattr(args, k, None) for k in ("coordinator_address", "num_processes", "process_id"))
    hb = getattr(args, "heartbeat_timeout", None) or DEFAULT_HEARTBEAT_TIMEOUT_S
    cluster = cluster_in_environment(environ)
    if addr is None and n is None and pid is None and cluster is None:
        return None
    given = DistributedArgs(coordinator_address=addr, num_processes=n, process_id=pid, cluster=cluster,
                            heartbeat_timeout_s=hb)
    if cluster is None or cluster == "JAX_COORDINATOR_ADDRESS":
        lacking = [f for f, v in (("--num-processes", n), ("--process-id", pid)) if v is None]
        if cluster is None and addr is None:
            lacking.insert(0, "--coordinator-address")
        if lacking:
            raise DistributedConfigError(
                f"several processes need {', '.join(lacking)} too (no cluster environment to read them from: "
                f"Slurm, Open MPI, multi-host Cloud TPU, Kubernetes); give every process the same "
                f"--coordinator-address HOST:PORT and --num-processes N, and its own --process-id 0..N-1")
    return given


def collectives() -> Optional[str]:
    """The collectives that reduce across devices in this process, as they decide a step's bits: on CPU
    ``"gloo"`` or ``"mpi"`` (``jax.distributed`` initialized with that implementation) or
    ``"in-process"`` (XLA's own); None on accelerators (their collectives are the platform's)."""
    import jax
    from jax._src import distributed

    if jax.devices()[0].platform != "cpu":
        return None
    if distributed.global_state.client is None:
        return "in-process"
    return str(jax.config.jax_cpu_collectives_implementation or "in-process")


def is_initialized() -> bool:
    """Whether ``jax.distributed`` is initialized in this process."""
    from jax._src import distributed

    return distributed.global_state.client is not None


_HOSTS: list[str] = []


def initialize(dargs: DistributedArgs) -> None:
    """``jax.distributed.initialize`` with ``dargs`` (gloo collectives on CPU), before any computation;
    then gathers every process's host name (:func:`process_hosts`).

    Raises:
      DistributedConfigError: JAX refused the settings (the message names them).
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=dargs.coordinator_address, num_processes=dargs.num_processes,
                                   process_id=dargs.process_id, heartbeat_timeout_seconds=dargs.heartbeat_timeout_s)
    except (ValueError, TypeError, RuntimeError) as e:
        raise DistributedConfigError(f"jax.distributed.initialize({' '.join(dargs.flags) or dargs.cluster}): {e}") from None
    process_hosts()


def match_collectives(recorded: Mapping[str, Any]) -> bool:
    """Makes a one-process command reduce as the run recorded in ``env.json`` (``backend.collectives``):
    for a run that reduced with gloo, starts a one-process ``jax.distributed`` on a free localhost port
    with gloo, before JAX's backend starts. Returns whether it did. A command that is already
    distributed, or whose backend has started, is left alone (a mismatch is then reported as drift)."""
    backend = recorded.get("backend") if isinstance(recorded, Mapping) else None
    want = backend.get("collectives") if isinstance(backend, Mapping) else None
    if want != "gloo" or _client_exists() or ("jax" in sys.modules and _backend_started()):
        return False
    initialize(DistributedArgs(coordinator_address=f"127.0.0.1:{free_port()}", num_processes=1, process_id=0))
    return True


def _client_exists() -> bool:
    if "jax" not in sys.modules:
        return False
    return is_initialized()


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # noqa: BLE001 - a JAX without this private API: assume started
        return True


def free_port() -> int:
    """A TCP port free on localhost now (for a one-host coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_index() -> int:
    import jax

    return int(jax.process_index())


def process_count() -> int:
    import jax

    return int(jax.process_count())


def process_hosts() -> list[str]:
    """Every process's host name, by process index (gathered once, at start-up, from all processes)."""
    if _HOSTS:
        return list(_HOSTS)
    import jax

    if jax.process_count() == 1:
        _HOSTS[:] = [platform.node()]
    else:
        _HOSTS[:] = [str(h) for h in gather_json(platform.node())]
    return list(_HOSTS)


def gather_json(obj: Any) -> list[Any]:
    """Every process's ``obj`` (JSON-serializable), by process index; a collective: every process of the
    run must call it at the same point of its program. One process: ``[obj]`` (no JAX work).

    Two ``process_allgather`` rounds: the byte lengths, then the bytes padded to the longest.
    """
    import jax

    if jax.process_count() == 1:
        return [json.loads(json.dumps(obj))]
    import numpy as np
    from jax.experimental import multihost_utils as mh

    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    sizes = np.asarray(mh.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(mh.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(rows[p, :int(sizes[p])].tobytes().decode()) for p in range(len(sizes))]


def sync(name: str) -> None:
    """A barrier of every process (``multihost_utils.sync_global_devices``); nothing with one process."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils as mh

        mh.sync_global_devices(name)


# ----------------------------------------------------------------------------- the guard


def supervised() -> bool:
    """Whether this process is the worker that :func:`supervise` started."""
    return os.environ.get(_SUPERVISED_ENV) == "1"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the worker: be killed when the supervisor dies (Linux ``PR_SET_PDEATHSIG``), so that killing a
    process of the run (its supervisor) kills its JAX work too."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - not Linux: the worker outlives a killed supervisor
        pass


def lost_peers(stderr_tail: str) -> str:
    """What the coordination service said about the processes it lost, from the worker's last lines:
    ``"process 1 stopped sending heartbeats"``, ``"the coordinator (process 0) closed the connection"``
    or ``"another process died"``."""
    m = re.search(r"following tasks are unhealthy \(stopped sending heartbeats\):\s*([\d\s,]+)", stderr_tail)
    if m:
        ids = [int(x) for x in re.findall(r"\d+", m.group(1))]
        return f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))} stopped sending heartbeats"
    if "Socket closed" in stderr_tail or "Connection reset" in stderr_tail or "UNAVAILABLE" in stderr_tail:
        return "the coordinator (process 0) is gone: its connection closed"
    return "another process of the run died"


def supervise(argv: Sequence[str], *, what_next: Any, heartbeat_timeout_s: int) -> int:
    """Runs ``argv`` (this command, as the run's worker) in a child process and waits for it.

    JAX's coordination service stops every process of a run when one dies (no heartbeat for
    ``heartbeat_timeout_s``, or the coordinator's connection closed): the worker aborts from a C++
    thread with a stack trace. The supervisor passes the worker's output through, and when the
    worker ends that way it prints one clear error (which process was lost, and ``what_next()``: how
    to restart) and exits :data:`EXIT_PEER_LOST`. SIGINT and SIGTERM are forwarded to the worker; a
    killed supervisor takes its worker with it (``PR_SET_PDEATHSIG`` on Linux).

    Returns:
      the worker's exit code, or :data:`EXIT_PEER_LOST`.
    """
    env = dict(os.environ, **{_SUPERVISED_ENV: "1", "PYTHONUNBUFFERED": "1"})
    child = subprocess.Popen(list(argv), env=env, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    tail: list[str] = []

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    fatal = False
    in_trace = False
    try:
        for raw in iter(child.stderr.readline, b""):
            line = raw.decode("utf-8", "replace")
            tail = (tail + [line])[-60:]
            if FATAL_MARK in line:
                fatal = True
            if fatal and (in_trace or line.startswith("*** Check failure stack trace") or line.lstrip().startswith("@ ")):
                in_trace = True  # the abort's C++ stack trace: noise once the cause is known
                continue
            sys.stderr.write(line)
            sys.stderr.flush()
        code = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if fatal or code == -signal.SIGABRT and any(FATAL_MARK in x for x in tail):
        sys.stderr.write(f"error: {lost_peers(''.join(tail))}; the JAX distributed service (heartbeat timeout "
                         f"{heartbeat_timeout_s} s) stopped this process too. {what_next()}\n")
        sys.stderr.flush()
        return EXIT_PEER_LOST
    return code if code >= 0 else 128 - code

