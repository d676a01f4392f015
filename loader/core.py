"""The loader a JAX trainer calls: ``loader.build(...)`` -> :class:`DataLoader`.

Legend: ``B`` global batch (rows), ``L`` seq_len (tokens per row).

``DataLoader.batch_at(step)`` returns six int32 ``[B, L]`` global ``jax.Array`` s with a
``NamedSharding`` on the trainer's mesh: batch over ``data_axes``, sequence over
``context_axis``. Each process reads only the rows its own devices hold (from the sharding's
``addressable_devices_indices_map``), and builds the global arrays with
``jax.make_array_from_callback``. Resume is an argument (``iterate(start_step)``); the state
is the next step plus a fingerprint (``loader.state``).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import operator
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from contract import codec
from contract.config import MixtureConfig, load_mixture
from loader import index as ix
from loader import reader as rd
from loader import state as st
from loader.source import Fetched, RowRef, StepSource

log = logging.getLogger("loader")
_THREADS: list[tuple[threading.Thread, threading.Event]] = []  # live prefetch threads
_FAST_PUT_CHECKED = False  # DataLoader._put's fast path was checked against jax.device_put


def _stop_all() -> None:
    """At interpreter exit, stop prefetch threads of iterators never closed."""
    for thread, ev in _THREADS[:]:  # a copy: finishing iterators remove themselves
        ev.set()
        thread.join(timeout=5)


atexit.register(_stop_all)


class _StageEnd(Exception):
    """The stage's source is exhausted."""


class _Stage:
    """Runs ``make_iter()`` on a daemon thread into a bounded queue; iterate it to consume.

    ``close()`` stops the thread and closes the iterator it was draining (on that thread),
    so chained stages shut down from the last one. An exception in the thread is re-raised
    by the consumer.
    """

    def __init__(self, make_iter, depth: int, name: str):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(make_iter,), name=name, daemon=True)
        self.thread.start()
        _THREADS.append((self.thread, self.stop))

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make_iter) -> None:
        source = None
        try:
            source = make_iter()
            for item in source:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))  # the consumer must not wait for an item that never comes
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._put(("error", e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:  # noqa: BLE001 - shutting down; the consumer has its answer
                    log.warning("closing %s: %r", self.thread.name, e)

    def get(self):
        kind, item = self.queue.get()
        if kind == "error":
            raise item
        if kind == "end":
            self.queue.put(("end", None))  # stays ended for any later get()
            raise _StageEnd
        return item

    def __iter__(self):
        try:
            while True:
                try:
                    item = self.get()
                except _StageEnd:
                    return
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        try:
            _THREADS.remove((self.thread, self.stop))
        except ValueError:
            pass


class LoaderConfigError(ValueError):
    """A ``loader.build`` argument is out of range; the message names it and the allowed values."""


def _default_mesh():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.asarray(jax.devices()), ("data",))


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
        from jax.sharding import NamedSharding, PartitionSpec

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
        self.manifest, self.manifest_sha256, shards = rd.open_dataset(dataset, mixture, verify_sha256, read_mode,
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
        self.sharding = NamedSharding(self.mesh, PartitionSpec(tuple(data_axes), context_axis))
        self.global_shape = (global_batch, self.seq_len)
        index_map = self.sharding.addressable_devices_indices_map(self.global_shape)
        row_slices = {(s[0].start or 0, s[0].stop if s[0].stop is not None else global_batch)
                      for s in index_map.values()}
        local = sorted({r for a, b in row_slices for r in range(a, b)})
        self.local_rows = np.asarray(local, np.int64)
        self._pos = {r: i for i, r in enumerate(local)}
        self._index_cache: dict = {}
        self._derive = None
        # Where the targets keys are derived: on the devices (one jitted, collective-free
        # function; narrow [B, 3, L] transfer: accelerators), or on the host, in the same
        # pass as the parse: with a context axis (whole rows are only there), and on CPU
        # devices, where the six arrays are built in one 64-byte-aligned block that XLA's
        # CPU client aliases instead of copying (measured ahead at 1,024 to 8,192 tokens a
        # row: benchmarks/load.py; the jitted derive costs CPU on the same cores).
        self._host_derive = context_axis is not None or all(d.platform == "cpu" for d in self.mesh.devices.flat)
        self._single_host = self.sharding.is_fully_addressable and len(local) == global_batch
        self._fast_put = None  # see _put
        pad_id = int(self.manifest.tokenizer.get("pad_id", 0) or 0)
        vocab = self.manifest.tokenizer.get("vocab_size")
        self.source = StepSource(self.schedule, shards, self.local_rows, self.seq_len, max(pad_id, 0),
                                 self.manifest.token_dtype if self.manifest.token_dtype == "uint16" else np.int32,
                                 token_width=rd.TOKEN_WIDTHS[self.manifest.token_dtype],
                                 vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None)
        self.process_index = jax.process_index()
        self.events: list[dict] = []
        self._next_step = 0
        self._lock = threading.Lock()
        self._m = {"rows_served": 0, "tokens_served": 0, "wait_s_last_step": 0.0}
        self._queue: queue.Queue | None = None

    # ---------------------------------------------------------------- pure lookups
    def normalized_weights(self) -> list[dict[str, float]]:
        """Per phase, each source's realized share of rows (the weights normalized to sum to 1)."""
        return self.schedule.normalized_weights()

    @property
    def global_batch(self) -> int:
        return self.schedule.global_batch

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
        return {k: host[k] for k in rd.BATCH_KEYS}

    # ---------------------------------------------------------------- global arrays
    def to_global(self, host: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Global ``jax.Array`` s (int32 ``[B, L]``, :attr:`sharding`) from host-local arrays.

        ``host`` holds the six keys, or ``packed`` (tokens, ids and positions, ``[n, 3, L]``);
        then, without a context axis, the ``targets*`` keys are derived on the devices by one
        jitted function (``loader.device``, compiled once, device-local: no collectives);
        with a context axis (the host holds whole rows) they are derived on the host, in the
        same pass as the parse (``StepSource.six``; same bits).
        """
        import jax

        def slice_for(arr):
            def cb(index):
                rows, cols = index
                return arr[self._local_index(rows), cols]
            return cb

        if "targets" not in host and self._host_derive:
            # Sequence split over devices: the one-slot shift of the targets would cross
            # shards (a collective, unsafe to launch from the prefetch thread next to the
            # trainer's programs). Hosts hold whole rows, so derive the targets here.
            host = rd.derive_packed(host["packed"])
        if "targets" in host:  # already the six keys
            if self._single_host:  # every row is local: the six arrays straight onto the devices
                return dict(zip(rd.BATCH_KEYS, self._put([host[k] for k in rd.BATCH_KEYS])))
            return {k: jax.make_array_from_callback(self.global_shape, self.sharding, slice_for(host[k]))
                    for k in rd.BATCH_KEYS}
        packed = host["packed"]

        def packed_cb(index):
            rows, _, cols = index
            return packed[self._local_index(rows), :, cols]

        if self._derive is None:
            from jax.sharding import NamedSharding, PartitionSpec

            from loader.device import make_derive

            spec = self.sharding.spec
            self._packed_sharding = NamedSharding(self.mesh, PartitionSpec(spec[0], None, None))
            self._derive = make_derive(self.sharding, self._packed_sharding)
        b, L = self.global_shape
        return self._derive(jax.make_array_from_callback((b, 3, L), self._packed_sharding, packed_cb))

    def _put(self, arrays: Sequence[np.ndarray]) -> list:
        """``jax.device_put(arrays, self.sharding)`` for int32 ``[B, L]`` host arrays when every row
        is local.

        Uses JAX's per-array transfer (``xla_client.batched_device_put``, what
        ``device_put`` calls for each array) with the device slices computed once: half the
        cost of ``device_put`` on a many-device host. The first use in the process checks it
        against ``jax.device_put`` (values and sharding); on any difference or error this
        loader uses ``jax.device_put`` instead.
        """
        import jax

        fast = self._fast_put
        if fast is None:  # first call: set up and check the fast path
            fast = False
            try:
                from jax._src import core as jcore
                from jax._src.lib import xla_client as xc

                devices = list(self.sharding._addressable_device_assignment)  # noqa: SLF001
                imap = self.sharding.addressable_devices_indices_map(self.global_shape)
                slices = [imap[d] for d in devices]
                aval = jcore.ShapedArray(self.global_shape, np.dtype(np.int32))

                def fast(xs):
                    return [xc.batched_device_put(aval, self.sharding, [x[i] for i in slices], devices, True)
                            for x in xs]

                global _FAST_PUT_CHECKED
                if not _FAST_PUT_CHECKED:  # once per process: the JAX installed does what we expect
                    got, want = fast(arrays), jax.device_put(list(arrays), self.sharding)
                    same = all(g.sharding == w.sharding and g.shape == w.shape and g.dtype == w.dtype
                               and np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))
                    if not same:
                        raise RuntimeError("batched_device_put differs from jax.device_put")
                    _FAST_PUT_CHECKED = True
            except Exception as e:  # noqa: BLE001 - private API moved: the public one works
                log.info("fast device transfer unavailable (%r); using jax.device_put", e)
                fast = False
            self._fast_put = fast
        if fast is False or any(a.dtype != np.int32 or a.shape != self.global_shape for a in arrays):
            return jax.device_put(list(arrays), self.sharding)
        return fast(arrays)

    def _local_index(self, rows: slice):
        """Host-array index of a device's global row slice: a slice (a view) when contiguous."""
        key = (rows.start, rows.stop)
        hit = self._index_cache.get(key)
        if hit is None:
            start = rows.start or 0
            stop = rows.stop if rows.stop is not None else self.global_shape[0]
            pos = [self._pos[r] for r in range(start, stop)]
            contiguous = pos and pos == list(range(pos[0], pos[0] + len(pos)))
            hit = slice(pos[0], pos[-1] + 1) if contiguous else np.asarray(pos, np.int64)
            self._index_cache[key] = hit
        return hit

    def _account(self, step: int, host: Mapping[str, np.ndarray], wait_s: float) -> None:
        with self._lock:
            self._next_step = step + 1
            self._m["rows_served"] += self.global_batch
            self._m["tokens_served"] += int(host["tokens"])
            self._m["wait_s_last_step"] = wait_s

    def batch_at(self, step: int) -> dict[str, Any]:
        """The global batch of training ``step`` (pure function of the step); see the module docstring.

        Also sets :meth:`state`'s next step to ``step + 1``.

        Raises:
          loader.index.ScheduleError: ``step`` < 0.
          loader.reader.DatasetError: a shard cannot be read or a record does not decode.
        """
        step = ix.check_step(step)
        t0 = time.perf_counter()
        host = self._read_step(step)
        self._account(step, host, time.perf_counter() - t0)
        return self.to_global(host)

    def _host_iter(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
        if self.workers > 0:
            import grain
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's worker pool reads absl flags; a library must not parse argv
                flags.FLAGS.mark_as_parsed()

            ds = self.grain_dataset(start_step, self._stop_step()).to_iter_dataset()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                             per_worker_buffer_size=max(1, self.prefetch)))
            return iter(ds)
        if self.read_threads <= 1:  # records only: iterate's thread parses them (_assemble)
            return (self.source.fetch(s) for s in range(start_step, self._stop_step()))
        return self._threaded_iter(start_step)

    def _assemble(self, item) -> dict[str, np.ndarray]:
        """Host arrays of an item of :meth:`_host_iter`: already arrays, or fetched records."""
        if isinstance(item, Fetched):
            return self.source.assemble(item, six=self._host_derive)
        return item

    def _read_step(self, step: int) -> dict[str, np.ndarray]:
        """Host arrays of ``step`` in this process: the six keys when the targets are derived
        on the host anyway (one pass), else ``packed`` for the devices to derive them.

        (On CPU the six keys are views of a block from ``loader.reader.AlignedPool``, which
        the devices alias; the pool hands it out again only once nothing refers to it.)
        """
        return self.source.six(step) if self._host_derive else self.source(step)

    def _stop_step(self) -> int:
        """One past the last training step whose rows the schedule can address (data step
        below ``MAX_GLOBAL_ROW // B``; ``data_step`` is increasing, so a bisection)."""
        limit = ix.MAX_GLOBAL_ROW // self.global_batch
        lo, hi = 0, limit  # data_step(lo) < limit <= data_step(hi), as data_step(s) >= s
        if self.schedule.data_step(0) >= limit:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.schedule.data_step(mid) < limit else (lo, mid)
        return hi

    def _threaded_iter(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
        """Steps read concurrently by ``read_threads`` threads, yielded in step order."""
        pool = concurrent.futures.ThreadPoolExecutor(self.read_threads, thread_name_prefix="loader-read")
        pending: collections.deque = collections.deque()
        nxt, stop = start_step, self._stop_step()
        try:
            while True:
                while len(pending) < self.read_threads and nxt < stop:
                    pending.append(pool.submit(self._read_step, nxt))
                    nxt += 1
                if not pending:
                    return
                yield pending.popleft().result()
        finally:
            # Wait for the reads in flight (at most read_threads steps): no thread outlives the iterator.
            pool.shutdown(wait=True, cancel_futures=True)

    def iterate(self, start_step: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yields ``(step, batch)`` from ``start_step`` (default: :meth:`state`'s next step) on, forever.

        Background threads prepare up to ``prefetch`` steps ahead; the trainer's thread only
        dequeues. By default one thread reads, parses and places each step (reads of
        ``read_mode="records"`` hold the GIL, so a second thread passing work along would
        only wait for it: measured 0.55 against 0.83 to 0.99 in ``benchmarks/load.py``).
        With ``read_threads > 1`` (whole steps read concurrently) or ``workers > 0`` (Grain
        worker processes), the reading is a stage of its own, ``prefetch`` steps deep, and a
        second thread builds the global arrays. The output does not depend on any of these
        settings.
        """
        start = self._next_step if start_step is None else ix.check_step(start_step)
        self.schedule.step_rows(start)  # a step past the addressable range fails here, not in a thread
        depth = max(1, self.prefetch)
        if self.workers > 0 or self.read_threads > 1:  # reading is a stage of its own
            hosts = _Stage(lambda: self._host_iter(start), depth, "loader-read")
        else:
            hosts = None
        items = (lambda: hosts) if hosts is not None else (lambda: self._host_iter(start))
        batches = _Stage(lambda: ((h, self.to_global(h)) for h in map(self._assemble, items())), depth,
                         "loader-arrays")
        stages = [s for s in (batches, hosts) if s is not None]  # closed last first
        self._queue = batches.queue
        try:
            step = start
            while True:
                t0 = time.perf_counter()
                try:
                    host, batch = batches.get()
                except _StageEnd:  # the last addressable step was served
                    return
                wait = time.perf_counter() - t0
                if int(host["step"]) != step:  # pragma: no cover - an ordering bug, fail loudly
                    raise RuntimeError(f"prefetch produced step {int(host['step'])}, expected {step}")
                self._account(step, host, wait)
                yield step, batch
                step += 1
        finally:
            self._queue = None
            for stage in stages:  # stop the stages and wait for their threads
                stage.close()
                stage.thread.join(timeout=30)

    def grain_dataset(self, start_step: int = 0, stop_step: int = 2**62):
        """A ``grain.MapDataset`` of host batches for steps ``[start_step, stop_step)``.

        Element ``i`` is :meth:`host_batch` of step ``start_step + i``; checkpointable with
        Grain's own iterator state and ``grain.checkpoint.CheckpointHandler``.
        """
        import grain

        return grain.MapDataset.range(start_step, stop_step).map(self.source)

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
          ``prefetch_occupancy`` (host batches ready in the buffer), ``prefetch_depth``,
          ``wait_s_last_step`` (seconds the last step waited for data), ``rows_served`` and
          ``tokens_served`` (non-padding tokens read by this process), ``next_step``, and
          ``per_source`` ``{name: {"rows": global rows drawn so far, "epochs": rows / records}}``
          over the rows of steps ``[0, next_step)`` of this schedule.
        """
        q = self._queue
        d = self.schedule.data_step(self._next_step) if self._next_step > 0 else 0
        counts = self.schedule.source_counts(d * self.global_batch)
        per_source = {
            n: {"rows": int(c), "epochs": (float(c) / r if r else 0.0)}
            for n, c, r in zip(self.schedule.sources, counts, self.schedule.records)
        }
        return {
            "prefetch_occupancy": q.qsize() if q is not None else 0,
            "prefetch_depth": self.prefetch,
            "wait_s_last_step": self._m["wait_s_last_step"],
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
        file systems, else records; ``loader.reader.resolve_read_mode``). Same bytes either way.
      cache_dir: local folder for staged URL datasets (default
        ``$LOADER_CACHE_DIR`` or ``~/.cache/moe-data-toolkit/datasets``).

    Raises:
      contract.config.ConfigError: the mixture config is invalid.
      loader.reader.DatasetError: the dataset is missing, malformed, or a shard is missing,
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
    if read_mode not in rd.READ_MODES:
        raise LoaderConfigError(f"read_mode must be one of {rd.READ_MODES}, got {read_mode!r}")
    cfg = mixture if isinstance(mixture, MixtureConfig) else load_mixture(str(mixture))
    data = DataLoader(mixture=cfg, dataset=str(dataset), global_batch=global_batch, mesh=mesh, seed=seed,
                      data_axes=tuple(data_axes), context_axis=context_axis, skip_windows=skip_windows,
                      verify_sha256=verify_sha256, prefetch=prefetch, workers=workers,
                      read_threads=read_threads, read_mode=read_mode, cache_dir=cache_dir)
    if state is not None:
        data.restore(state)
    return data
