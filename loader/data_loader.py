"""The loader a JAX trainer calls: ``loader.build(...)`` -> :class:`DataLoader`.

Legend: ``B`` global batch (rows), ``L`` seq_len (tokens per row).

``DataLoader.batch_at(step)`` returns six int32 ``[B, L]`` global ``jax.Array`` s with a
``NamedSharding`` on the trainer's mesh: batch over ``data_axes``, sequence over
``context_axis``. Each process reads only the rows its own devices hold (from the sharding's
``addressable_devices_indices_map``), and builds the global arrays with
``jax.make_array_from_callback``. Resume is an argument (``iterate(start_step)``); the state
is the next step plus a fingerprint (``loader.state``).

The path of a step, each module entered once (``tests/test_loader_imports.py`` checks it)::

    DataLoader.batch_at(step)
      loader.source   StepSource.six(step): this process's rows of the step
        loader.index    step -> global rows -> (source, epoch, record)
        loader.shards   -> (shard, record in shard) -> record bytes
        loader.arrays   record bytes -> host arrays
      loader.device   Placement.to_global: host arrays -> global jax.Arrays

``iterate`` runs the same path ``prefetch`` steps ahead on a thread (``loader.prefetch``).

May import: every loader module below it (``index``, ``shards``, ``dataset``, ``arrays``,
``source``, ``device``, ``prefetch``, ``state``); not ``checkpoint`` or ``testing``.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from contract import codec, plan
from contract.config import MixtureConfig, load_mixture
from loader import index as ix
from loader import state as st
from loader.arrays import BATCH_KEYS
from loader.dataset import TOKEN_WIDTHS, open_dataset
from loader.device import Placement
from loader.prefetch import Prefetch
from loader.shards import READ_MODES
from loader.source import RowRef, StepSource

log = logging.getLogger("loader")


class LoaderConfigError(ValueError):
    """A ``loader.build`` argument is out of range; the message names it and the allowed values."""


def _default_mesh():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.asarray(jax.devices()), ("data",))


WAIT_STAGES = ("index", "read", "decode", "rows", "transfer", "other")
"""Where a step's wait for its batch can go (:func:`wait_stages`): the index arithmetic,
the storage reads, decoding and checking the records, building the rows' arrays, the
transfer to the devices (the global arrays), and the rest (the step's work not yet begun:
its thread busy with an earlier step, or the GIL, or a Grain worker's hand-off)."""


def wait_stages(t_ask: float, t_got: float, stamps: np.ndarray | None,
                transfer: tuple[float, float]) -> dict[str, float]:
    """Where the wait ``[t_ask, t_got]`` for a step's batch went: seconds per stage.

    Each stage of the step (``loader.source.STAGE_BOUNDS``: ``stamps``, float64 ``[5]``, the
    step's start and the end of its index, read, decode and rows stages; ``transfer``, the
    start and end of building its global arrays), all ``time.perf_counter()`` seconds, is
    charged its overlap with the wait; ``"other"`` is what no stage covers. The values add
    up to ``t_got - t_ask`` (to rounding). Stages that were not waited on are left out, so a
    step that did not wait gives ``{}``.
    """
    wait = t_got - t_ask
    if wait <= 0:
        return {}
    bounds = [] if stamps is None else [float(x) for x in stamps]
    spans = list(zip(WAIT_STAGES[:4], bounds, bounds[1:])) + [("transfer", *transfer)]
    out = {}
    for name, a, b in spans:
        o = min(b, t_got) - max(a, t_ask)
        if o > 0:
            out[name] = o
    rest = wait - sum(out.values())
    if rest > 0:
        out["other"] = rest
    return out


class DataLoader:
    """Deterministic, checkpointable loader; build it with :func:`build`.

    Attributes:
      schedule: the :class:`loader.index.Schedule` (pure index functions).
      manifest: the dataset's ``contract.manifest.Manifest``.
      manifest_sha256: sha256 of ``manifest.json``.
      sharding: the ``NamedSharding`` of every batch array.
      events: schedule events to log (e.g. skip windows added on restore), dicts.
    """

    def __init__(self, *, mixture: MixtureConfig, dataset: str, global_batch: int, mesh, seed: int,
                 data_axes: Sequence[str], context_axis: str | None, skip_windows, verify_sha256: bool,
                 prefetch: int, workers: int, read_threads: int = 1, read_mode: str = "auto",
                 cache_dir: str | None = None):
        import jax

        self.mixture = mixture
        self.dataset = dataset
        self.prefetch = prefetch
        self.workers = workers
        self.read_threads = read_threads
        # Argument checks first (no I/O), then open and check the dataset.
        skip_windows = ix.check_skip_windows(skip_windows)
        self.mesh = mesh if mesh is not None else _default_mesh()
        axes = set(self.mesh.axis_names)
        named = (*data_axes, *([context_axis] if context_axis else []))
        if len(set(named)) != len(named):
            raise LoaderConfigError(
                f"data axes {tuple(data_axes)} and context axis {context_axis!r} must name distinct mesh axes"
            )
        for a in named:
            if a not in axes:
                raise LoaderConfigError(f"mesh axis {a!r} not in the mesh's axes {sorted(axes)}")
        data_size = int(np.prod([self.mesh.shape[a] for a in data_axes]))
        if global_batch % data_size:
            raise LoaderConfigError(
                f"global_batch {global_batch} must be a multiple of the data axes {tuple(data_axes)} size {data_size}"
            )
        if context_axis and mixture.seq_len % self.mesh.shape[context_axis]:
            raise LoaderConfigError(
                f"seq_len {mixture.seq_len} must be a multiple of the context axis {context_axis!r} "
                f"size {self.mesh.shape[context_axis]}"
            )
        self.manifest, self.manifest_sha256, shards = open_dataset(dataset, mixture, verify_sha256, read_mode,
                                                                   cache_dir)
        self.seq_len = self.manifest.seq_len
        records = {n: e.records for n, e in self.manifest.sources.items()}
        self.schedule = ix.Schedule.from_mixture(mixture, records, global_batch, seed, skip_windows)
        for p, w in zip(mixture.phases, self.schedule.normalized_weights()):
            log.info("phase from step %d: weights %s normalized to %s", p.from_step, dict(p.weights), w)
        for w in self.schedule.skip_windows:
            log.info("data skip window: training steps %d..%d train on the data of steps %d..", w.start, w.end,
                     self.schedule.data_step(w.start))
        self.context_axis = context_axis
        self.global_shape = (global_batch, self.seq_len)
        self._place = Placement(self.mesh, data_axes, context_axis, self.global_shape)
        self.sharding = self._place.sharding
        self.local_rows = self._place.local_rows
        pad_id = int(self.manifest.tokenizer.get("pad_id", 0) or 0)
        vocab = self.manifest.tokenizer.get("vocab_size")
        self.source = StepSource(self.schedule, shards, self.local_rows, self.seq_len, max(pad_id, 0),
                                 self.manifest.token_dtype if self.manifest.token_dtype == "uint16" else np.int32,
                                 token_width=TOKEN_WIDTHS[self.manifest.token_dtype],
                                 vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None)
        self.process_index = jax.process_index()
        self.events: list[dict] = []
        self._next_step = 0
        self._lock = threading.Lock()
        self._m = {"rows_served": 0, "tokens_served": 0, "wait_s_last_step": 0.0, "occupancy_at_ask": None,
                   "occupancy_min": None, "wait_stages_s": {}}
        self._prefetch: Prefetch | None = None  # of the open iterator, for metrics()

    # Where the targets keys are derived (host or devices) and the transfer's fast path:
    # loader.device.Placement's; here so a test can choose the path.
    @property
    def _host_derive(self) -> bool:
        return self._place.host_derive

    @_host_derive.setter
    def _host_derive(self, value: bool) -> None:
        self._place.host_derive = value

    @property
    def _fast_put(self):
        return self._place.fast_put

    @_fast_put.setter
    def _fast_put(self, value) -> None:
        self._place.fast_put = value

    # ---------------------------------------------------------------- pure lookups
    def normalized_weights(self) -> list[dict[str, float]]:
        """Per phase, each source's realized share of rows (the weights normalized to sum to 1)."""
        return self.schedule.normalized_weights()

    @property
    def global_batch(self) -> int:
        """``B``, rows per step."""
        return self.schedule.global_batch

    def epochs(self, steps: int) -> list[plan.SourceEpochs]:
        """How many epochs of each source training steps ``[0, steps)`` see, counted exactly.

        Rows per source come from the schedule's interleave (``Schedule.source_counts``) over
        the data steps those training steps train on (skip windows followed), divided by the
        source's records; ``steps_per_epoch`` is at the source's highest realized weight in
        the run (``contract.plan``, which ``dataprep.pack`` uses with the config's weights).

        Raises:
          contract.plan.PlanError: ``steps`` < 1.
        """
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise plan.PlanError(f"planned_steps: must be an integer >= 1, got {steps!r}")
        steps = int(steps)
        sched, B = self.schedule, self.global_batch
        # Training steps [a, b) with no skip window starting inside train on data steps
        # [data_step(a), data_step(a) + b - a).
        cuts = sorted({0, steps, *(w.start for w in sched.skip_windows if 0 < w.start < steps)})
        counts = np.zeros(len(sched.sources), np.int64)
        for a, b in zip(cuts, cuts[1:]):
            d = sched.data_step(a)
            counts += sched.source_counts((d + b - a) * B) - sched.source_counts(d * B)
        starts = [p.from_step for p in sched.phases]
        reached = [i for i, s in enumerate(starts) if s < sched.data_step(steps - 1) + 1]
        shares = sched.normalized_weights()
        out = []
        for k, (name, n) in enumerate(zip(sched.sources, sched.records)):
            top = max((shares[i][name] for i in reached), default=0.0)
            out.append(plan.SourceEpochs(name, int(n), float(counts[k]), float(counts[k]) / n if n else 0.0,
                                         n / (B * top) if top and n else None))
        return out

    def rows_at(self, step: int) -> list[RowRef]:
        """Where every row of ``step`` comes from: ``B`` :class:`RowRef` s, no I/O."""
        return self.source.refs(step)

    def read_rows(self, step: int) -> list[codec.PackedRow]:
        """The ``B`` stored rows of ``step`` (tokens and provenance), in batch order."""
        return self.source.read_rows(step)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of ``step`` as numpy: the six keys, int32 ``[n_local, L]``
        (rows in increasing global-batch position, :attr:`local_rows`)."""
        host = self.source.six(step)
        return {k: host[k] for k in BATCH_KEYS}

    # ---------------------------------------------------------------- global arrays
    def to_global(self, host: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Global ``jax.Array`` s (int32 ``[B, L]``, :attr:`sharding`) from host-local arrays.

        ``host`` holds the six keys (int32 ``[n, L]``, rows in :attr:`local_rows` order), or
        ``packed`` (tokens, ids and positions, ``[n, 3, L]``); then, without a context axis
        on accelerators, the ``targets*`` keys are derived on the devices by one jitted
        function (compiled once, device-local: no collectives); with a context axis or on
        CPU devices, on the host (same bits). See ``loader.device.Placement``.
        """
        return self._place.to_global(host)

    def _account(self, step: int, host: Mapping[str, np.ndarray], wait: tuple[float, float],
                 transfer: tuple[float, float], ready_at_ask: int, ready_min: int) -> None:
        """Counts the step served and records its input figures (:meth:`metrics`): the wait
        ``(t_ask, t_got)`` and where it went (:func:`wait_stages`), the buffer's levels."""
        # a batch ready at the ask is handed over in microseconds: no stall to split
        stages = wait_stages(wait[0], wait[1], host.get("stamps"), transfer) if ready_at_ask == 0 else {}
        with self._lock:
            self._next_step = step + 1
            self._m["rows_served"] += self.global_batch
            self._m["tokens_served"] += int(host["tokens"])
            self._m["wait_s_last_step"] = wait[1] - wait[0]
            self._m["occupancy_at_ask"] = ready_at_ask
            self._m["occupancy_min"] = ready_min
            self._m["wait_stages_s"] = stages

    def batch_at(self, step: int) -> dict[str, Any]:
        """The global batch of training ``step`` (pure function of the step); see the module docstring.

        Also sets :meth:`state`'s next step to ``step + 1``.

        Raises:
          loader.index.ScheduleError: ``step`` is not an integer, is negative or is past the
            addressable range.
          loader.shards.DatasetError: a shard cannot be read or a record does not decode.
        """
        t0 = time.perf_counter()
        host, batch, transfer = self._read_and_place(step)
        # no buffer: the caller waits for all of it (levels 0)
        self._account(int(host["step"]), host, (t0, transfer[1]), transfer, 0, 0)
        return batch

    def _read_step(self, step: int) -> dict[str, np.ndarray]:
        """Host arrays of ``step`` in this process: the six keys when the targets are derived
        on the host (one pass), else ``packed`` for the devices to derive them.

        (On CPU the six keys are views of a block from ``loader.arrays.AlignedPool``, which
        the devices alias; the pool hands it out again only once nothing refers to it.)
        """
        return self.source.six(step) if self._host_derive else self.source(step)

    def _read_and_place(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, Any], tuple[float, float]]:
        """``(host arrays, global batch, (start, end) of the transfer in perf_counter seconds))``."""
        host = self._read_step(step)
        t0 = time.perf_counter()
        batch = self.to_global(host)
        return host, batch, (t0, time.perf_counter())

    def _place_next(self, hosts: Iterator[dict[str, np.ndarray]]
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any], tuple[float, float]]:
        host = next(hosts)  # StopIteration ends the prefetch
        t0 = time.perf_counter()
        batch = self.to_global(host)
        return host, batch, (t0, time.perf_counter())

    def _prefetch_stages(self, steps: range, depth: int) -> Prefetch:
        """The prefetch of ``steps``: ``(host arrays, global batch)`` in step order, ``depth`` ahead."""
        if self.workers > 0:  # reading in Grain worker processes; a thread places each step
            import grain
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's worker pool reads absl flags; a library must not parse argv
                flags.FLAGS.mark_as_parsed()
            # Workers send ``packed`` (tokens, ids, positions: a quarter of the six keys' bytes
            # through shared memory); the targets keys are derived after (Placement.to_global).
            ds = grain.MapDataset.range(steps.start, steps.stop).map(self.source).to_iter_dataset()
            hosts = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                                     per_worker_buffer_size=depth)))
            return Prefetch(lambda _: self._place_next(hosts), steps, depth, name="loader-arrays", then_close=[hosts])
        if self.read_threads > 1:  # whole steps read on read_threads threads; a thread places each step
            reads = Prefetch(self._read_step, steps, depth, threads=self.read_threads, name="loader-read")
            return Prefetch(lambda _: self._place_next(reads), steps, depth, name="loader-arrays", then_close=[reads])
        # One thread reads, parses and places each step: record reads hold the GIL, so a
        # second thread passing work along would only wait for it.
        return Prefetch(self._read_and_place, steps, depth, name="loader-prefetch")

    def _take(self, step: int, batches: Prefetch, level: list[int]) -> dict[str, Any]:
        """The next batch of the prefetch, which must be ``step``'s; accounted for.

        ``level[0]``: the buffer's level after the previous take, replaced by the level after
        this one. Between a take and the next ask the level only rises (nothing is taken), so
        the step's minimum is the lower of ``level[0]`` and the level at the ask."""
        host, batch, transfer = next(batches)  # StopIteration cannot come before the steps end
        if int(host["step"]) != step:  # pragma: no cover - an ordering bug, fail loudly
            raise RuntimeError(f"prefetch produced step {int(host['step'])}, expected {step}")
        took = batches.last_take
        self._account(step, host, (took.t_ask, took.t_got), transfer, took.ready_at_ask,
                      min(level[0], took.ready_at_ask))
        level[0] = took.ready_after
        return batch

    def iterate(self, start_step: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: :meth:`state`'s next step) on, forever.

        Background threads (``loader.prefetch``) prepare up to ``prefetch`` steps ahead; the
        trainer's thread only dequeues. By default one thread reads, parses and places each
        step (reads of ``read_mode="records"`` hold the GIL, so a second thread passing work
        along would only wait for it: measured 0.55 against 0.83 to 0.99 in
        ``benchmarks/load.py``). With ``read_threads > 1`` (whole steps read concurrently)
        or ``workers > 0`` (Grain worker processes), the reading is a stage of its own,
        ``prefetch`` steps deep, and a second thread builds the global arrays. The output
        does not depend on any of these settings. The iterator ends after the last
        addressable step; closing it (or dropping it) stops its threads.

        Raises:
          loader.index.ScheduleError: ``start_step`` is not an integer, negative, or past the
            addressable range (here, before any thread starts).
          loader.shards.DatasetError: at the step whose shard cannot be read or whose record
            does not decode (the steps before it are served first).
        """
        # a bad step, or one past the addressable range, fails here, not in a thread
        steps = self.schedule.steps_from(self._next_step if start_step is None else start_step)
        batches = self._prefetch_stages(steps, max(1, self.prefetch))
        self._prefetch = batches
        level = [0]  # the buffer's level after the last take; it starts empty
        try:
            for step in steps:
                # no local keeps the batch: once the trainer drops it, its buffers are free
                yield step, self._take(step, batches, level)
        finally:
            if self._prefetch is batches:
                self._prefetch = None
            batches.close()  # stops the threads (and Grain's workers) and waits for them

    def grain_dataset(self, start_step: int = 0, stop_step: int = 2**62):
        """A ``grain.MapDataset`` of host batches for steps ``[start_step, stop_step)``.

        Element ``i`` is this process's rows of step ``start_step + i`` as
        ``loader.source.StepSource`` gives them (``packed``, ``[n, 3, L]`` tokens, segment
        ids and positions, with ``step``, ``tokens`` and ``source``; :meth:`to_global` takes
        it); checkpointable with Grain's own iterator state and
        ``grain.checkpoint.CheckpointHandler``.
        """
        import grain

        return grain.MapDataset.range(start_step, stop_step).map(self.source.unstamped)

    # ---------------------------------------------------------------- state
    def state(self) -> st.LoaderState:
        """The state to checkpoint: next step plus the fingerprint of the order's inputs."""
        sched = self.schedule.to_dict()
        return st.LoaderState(
            next_step=self._next_step,
            fingerprint=st.schedule_fingerprint(self.manifest_sha256, sched),
            manifest_sha256=self.manifest_sha256,
            schedule=sched,
        )

    def restore(self, state: st.LoaderState | Mapping[str, Any]) -> DataLoader:
        """Continues from a saved state (``iterate()`` then starts at its next step).

        Raises:
          loader.state.ResumeError: the state's manifest, mixture phases, seed, global batch
            or records differ from this loader's (each change named), or skip windows were
            changed other than by appending windows that start at or after its next step.
        """
        # A LoaderState object is checked like a dict (types, version, fingerprint).
        state = st.LoaderState.from_dict(state.to_dict() if isinstance(state, st.LoaderState) else state)
        added = st.compare(state, self.manifest_sha256, self.schedule.to_dict())
        for w in added:
            event = {"event": "skip_window", "step": state.next_step, "start": w["start"], "end": w["end"]}
            log.warning("data skip window added on restore: steps %d..%d", w["start"], w["end"])
            self.events.append(event)
        self._next_step = state.next_step
        return self

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, Any]:
        """Figures to log each step.

        Returns:
          ``prefetch_occupancy`` (host batches ready in the buffer now), ``prefetch_depth``,
          ``wait_s_last_step`` (seconds the last step waited for data), and of the last
          step: ``occupancy_at_ask`` (batches ready when the trainer asked for it; 0 from
          :meth:`batch_at`, which has no buffer; None before any step), ``occupancy_min``
          (the lowest level from the previous take to this one: 0 when it waited, and at
          the first step of :meth:`iterate`, whose buffer starts empty), ``wait_stages_s``
          (where its wait went, seconds per stage of :data:`WAIT_STAGES`, :func:`wait_stages`;
          ``{}`` when its batch was ready at the ask: the microseconds of that hand-off are
          in ``wait_s_last_step`` only); ``rows_served`` and
          ``tokens_served`` (non-padding tokens read by this process), ``next_step``, and
          ``per_source`` ``{name: {"rows": global rows drawn so far, "epochs": rows / records}}``
          over the rows of steps ``[0, next_step)`` of this schedule.
        """
        pre = self._prefetch
        d = self.schedule.data_step(self._next_step) if self._next_step > 0 else 0
        counts = self.schedule.source_counts(d * self.global_batch)
        per_source = {
            n: {"rows": int(c), "epochs": (float(c) / r if r else 0.0)}
            for n, c, r in zip(self.schedule.sources, counts, self.schedule.records)
        }
        return {
            "prefetch_occupancy": pre.ready() if pre is not None else 0,
            "prefetch_depth": self.prefetch,
            "wait_s_last_step": self._m["wait_s_last_step"],
            "occupancy_at_ask": self._m["occupancy_at_ask"],
            "occupancy_min": self._m["occupancy_min"],
            "wait_stages_s": dict(self._m["wait_stages_s"]),
            "rows_served": self._m["rows_served"],
            "tokens_served": self._m["tokens_served"],
            "next_step": self._next_step,
            "per_source": per_source,
        }


def build(
    mixture: str | MixtureConfig,
    dataset: str,
    global_batch: int,
    mesh=None,
    seed: int = 0,
    data_axes: Sequence[str] = ("data",),
    context_axis: str | None = None,
    skip_windows: Sequence[ix.SkipWindow | Sequence[int]] = (),
    verify_sha256: bool = False,
    prefetch: int = 2,
    workers: int = 0,
    state: st.LoaderState | Mapping[str, Any] | None = None,
    read_threads: int = 1,
    read_mode: str = "auto",
    cache_dir: str | None = None,
    planned_steps: int | None = None,
    max_epochs: float = plan.DEFAULT_MAX_EPOCHS,
) -> DataLoader:
    """Opens, checks and returns the loader.

    Args:
      mixture: a mixture config YAML path or a ``contract.config.MixtureConfig``.
      dataset: the packed dataset folder (with ``manifest.json``), or its URL (``gs://...``,
        any scheme Beam's ``FileSystems`` reads): then checked remotely and staged into
        ``cache_dir`` before the first step (``loader.storage``).
      global_batch: ``B``, rows per step, a multiple of the data axes' size.
      mesh: the trainer's ``jax.sharding.Mesh``; ``None``: 1-D over all devices, axis ``"data"``.
      seed: the shuffle seed (epochs reshuffled per ``(seed, source, epoch)``).
      data_axes: mesh axes the batch dimension is split over.
      context_axis: mesh axis the sequence dimension is split over, or ``None``.
      skip_windows: ``[(A, B), ...]`` inclusive training-step windows whose data is skipped.
      verify_sha256: hash every shard at build (reads every byte).
      prefetch: host batches prepared ahead (>= 0; 0 behaves as 1).
      workers: Grain worker processes for reading (0: read on a thread of this process).
      state: a saved :class:`loader.state.LoaderState` (or its dict) to resume from.
      read_threads: with ``workers == 0``, threads that read steps concurrently (>= 1).
      read_mode: ``"records"`` (seek and read per record: least CPU on local disk),
        ``"batched"`` (one pooled read per shard and step, the GIL released: for network
        file systems such as a gcsfuse mount) or ``"auto"`` (batched on network and FUSE
        file systems, else records; ``loader.shards.resolve_read_mode``). Same bytes either way.
      cache_dir: local folder for staged URL datasets (default
        ``$LOADER_CACHE_DIR`` or ``~/.cache/moe-data-toolkit/datasets``).
      planned_steps: the steps the run will train; when given, how many epochs of each
        source they see is logged (INFO), and a source over ``max_epochs`` gets a WARNING
        (:meth:`DataLoader.epochs`, ``contract.plan``).
      max_epochs: the warning threshold (default 4: ``contract.plan.DEFAULT_MAX_EPOCHS``).

    Raises:
      contract.config.ConfigError: the mixture config is invalid.
      loader.shards.DatasetError: the dataset is missing, malformed, or a shard is missing,
        truncated or altered (named), or it disagrees with the mixture config.
      loader.index.ScheduleError, LoaderConfigError: an argument out of range (named), or
        an unknown ``read_mode``.
      loader.state.ResumeError: ``state`` does not fit (names what changed).
    """
    ints = {}
    for name, value, lo in (("global_batch", global_batch, 1), ("seed", seed, 0), ("prefetch", prefetch, 0),
                            ("workers", workers, 0), ("read_threads", read_threads, 1)):
        # ints and numpy integers (a batch size computed with numpy is fine); never bool or float
        try:
            if isinstance(value, (bool, np.bool_)):
                raise TypeError
            ints[name] = operator.index(value)
        except TypeError:
            ints[name] = None
        if ints[name] is None or ints[name] < lo:
            raise LoaderConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
    global_batch, seed, prefetch, workers, read_threads = (
        ints[k] for k in ("global_batch", "seed", "prefetch", "workers", "read_threads"))
    if isinstance(data_axes, str):
        data_axes = (data_axes,)
    if context_axis is not None and not isinstance(context_axis, str):
        raise LoaderConfigError(f"context_axis must be a mesh axis name or None, got {context_axis!r}")
    if read_mode not in READ_MODES:
        raise LoaderConfigError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    cfg = mixture if isinstance(mixture, MixtureConfig) else load_mixture(str(mixture))
    data = DataLoader(mixture=cfg, dataset=str(dataset), global_batch=global_batch, mesh=mesh, seed=seed,
                      data_axes=tuple(data_axes), context_axis=context_axis, skip_windows=skip_windows,
                      verify_sha256=verify_sha256, prefetch=prefetch, workers=workers,
                      read_threads=read_threads, read_mode=read_mode, cache_dir=cache_dir)
    if state is not None:
        data.restore(state)
    if planned_steps is not None:
        if not max_epochs > 0:
            raise LoaderConfigError(f"max_epochs must be > 0, got {max_epochs!r}")
        try:
            lines, warnings = plan.describe(data.epochs(planned_steps), int(planned_steps), data.global_batch,
                                            max_epochs)
        except plan.PlanError as e:
            raise LoaderConfigError(str(e)) from None
        for line in lines:
            log.info("epochs: %s", line)
        for warning in warnings:
            log.warning("%s", warning)
    return data
