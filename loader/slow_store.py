"""A slow store: the shard set with latency injected into its reads, for stall drills.

The loader's input figures (``DataLoader.metrics()``: the buffer's level at the ask, its
minimum over the step, the wait and where it went) are only as good as their attribution
on a store that really stalls. :class:`SlowShardSet` is the real :class:`loader.shards.ShardSet`
(same bytes, same errors) whose reads first wait, as an object store or a network file
system does:

- ``latency_s`` per read request, one request per shard a step's read touches (what a
  batched read of an object store issues), waited one after the other;
- ``bursts``: extra seconds at chosen read calls (a storage hiccup);
- ``gate``: a function called with the call's index before it reads, which may block
  (a test holds a read until it lets it go).

Every wait it injects is recorded (:attr:`SlowShardSet.injected`: the call's index and its
``time.perf_counter()`` start and end), so a test or benchmark compares the loader's
attribution with the truth. Reads on threads of this process only (the injected state is
not carried into Grain worker processes).

Usage::

    data = loader.build(...)
    data.source.shards = SlowShardSet.wrap(data.source.shards, latency_s=0.02, bursts={40: 0.5})

May import: ``loader.shards``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from loader.shards import ShardSet


class SlowShardSet(ShardSet):
    """A :class:`loader.shards.ShardSet` whose every :meth:`read_located` call waits first.

    Args (besides the shard set's own):
      latency_s: seconds per shard touched by the call (>= 0).
      bursts: ``{call index: extra seconds}`` (calls counted from 0 in the order they start).
      gate: ``gate(call index)``, called before the read; its blocking counts as injected.

    Attributes:
      injected: ``[(call index, t_start, t_end), ...]``, ``time.perf_counter()`` seconds of
        each call's injected wait, in the order the calls started.
      calls: read calls started so far.

    Raises:
      ValueError: a negative ``latency_s`` or burst.
    """

    def __init__(self, *args, latency_s: float = 0.0, bursts: Mapping[int, float] | None = None,
                 gate: Callable[[int], object] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        bursts = dict(bursts or {})
        if latency_s < 0 or any(v < 0 for v in bursts.values()):
            raise ValueError(f"latency_s and bursts must be >= 0, got {latency_s!r} and {bursts!r}")
        self.latency_s, self.bursts, self.gate = float(latency_s), bursts, gate
        self.injected: list[tuple[int, float, float]] = []
        self.calls = 0
        self._count = threading.Lock()

    @classmethod
    def wrap(cls, shards: ShardSet, **slow) -> SlowShardSet:
        """The same shards (paths, offsets, read mode, repair line), slowed by ``slow`` (the
        keyword arguments of the class)."""
        state = shards.__getstate__()
        return cls(state["dataset"], state["shards"], state["offsets"], state["read_mode"], state["repair"], **slow)

    def read_located(self, source: np.ndarray, record: np.ndarray, shard: np.ndarray,
                     in_shard: np.ndarray) -> list[bytes]:
        with self._count:
            call = self.calls
            self.calls += 1
        touched = len({(int(k), int(s)) for k, s in zip(np.asarray(source).tolist(), np.asarray(shard).tolist())})
        t0 = time.perf_counter()
        if self.gate is not None:
            self.gate(call)
        for _ in range(touched):
            if self.latency_s:
                time.sleep(self.latency_s)
        if self.bursts.get(call):
            time.sleep(self.bursts[call])
        t1 = time.perf_counter()
        with self._count:
            self.injected.append((call, t0, t1))
        return super().read_located(source, record, shard, in_shard)


def overlap(a: float, b: float, spans) -> float:
    """Seconds of ``[a, b]`` covered by ``spans`` (``(t_start, t_end)`` pairs, or the
    ``(call, t_start, t_end)`` of :attr:`SlowShardSet.injected`), counting each instant once."""
    cut = sorted((max(s[-2], a), min(s[-1], b)) for s in spans if s[-1] > a and s[-2] < b)
    total, end = 0.0, a
    for lo, hi in cut:
        lo = max(lo, end)
        if hi > lo:
            total += hi - lo
            end = hi
    return total
