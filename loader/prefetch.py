"""Prefetch: a function of each item computed ahead on background threads, results in order.

The loader's one prefetch form (``DataLoader.iterate``), on ``concurrent.futures``: a
``ThreadPoolExecutor`` and a deque of at most ``depth`` futures, consumed from the head.
While the trainer works on one result, the next ``depth`` are being computed; an exception
raised computing an item is re-raised in the consumer at that item's place in the order.

Why not Grain's ``ThreadPrefetchIterDataset``: the loader's work per step is one call of a
function of the step, which a future expresses directly; Grain's iterator adds a
``MapDataset`` and its per-element statistics and state copies in front of the same
``queue.Queue``, and names its threads ``grain-...`` (``benchmarks/host_path.py`` measures
the hand-off of both: ``prefetch_us_per_item``).

May import: the standard library only (no other loader module).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

log = logging.getLogger("loader")
# The open Prefetch iterators, whose threads run (each removes itself on close).
_THREADS: list[Prefetch] = []
_END = object()  # what a call that raised StopIteration returns: the source is exhausted


class Take(NamedTuple):
    """What the consumer met when it took a result (:attr:`Prefetch.last_take`).

    Attributes:
      ready_at_ask: results ready at the head of the order when it asked (:meth:`Prefetch.ready`).
      t_ask, t_got: ``time.perf_counter()`` seconds when it asked and when it had the result:
        ``t_got - t_ask`` is its wait (0 when the result was ready, up to the microseconds of
        the hand-off).
      ready_after: results ready once it had the result (the buffer's level as the
        consumer's next step begins; until it asks again the level only rises).
    """

    ready_at_ask: int
    t_ask: float
    t_got: float
    ready_after: int


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    try:
        return fn(item)
    except StopIteration:  # raised through a future it would become a RuntimeError (PEP 479)
        return _END


class Prefetch(Iterator):
    """Iterates ``fn(x)`` for ``x`` in ``items``, in order, computing up to ``depth`` ahead.

    Args:
      fn: the function of one item, run on the pool's threads.
      items: the inputs, drawn in the consumer's thread as calls are submitted (keep them
        cheap: e.g. step numbers).
      depth: calls in flight at most (>= 1; at least ``threads``).
      threads: the pool's threads (1: the calls run one after another, in order, so ``fn``
        may draw from an iterator of its own).
      name: thread name prefix (threads are ``<name>_0``, ...).
      then_close: objects whose ``close()`` is called, in order, once the pool has stopped
        (e.g. an iterator that ``fn`` draws from); an error closing one is logged, not raised
        (the consumer already has its answer).

    A call that raises ``StopIteration`` ends the iteration at its place (an exhausted
    source). Each result taken sets :attr:`last_take` (a :class:`Take`: the results ready
    when the consumer asked, how long it waited, and the results ready after). :meth:`close` (also on exhaustion or an error, and at interpreter exit for an
    iterator never closed) cancels the calls not yet started, waits for those running (no
    thread outlives the iterator) and then closes ``then_close``. ``DataLoader.iterate``
    closes its prefetch when it is closed or dropped.

    Raises:
      ValueError: ``depth`` or ``threads`` < 1.
      Exception: whatever ``fn`` raised, from :meth:`__next__` at that item's place.
    """

    def __init__(self, fn: Callable[[Any], Any], items: Iterable, depth: int, threads: int = 1,
                 name: str = "loader-prefetch", then_close: Iterable = ()):
        if depth < 1 or threads < 1:
            raise ValueError(f"depth and threads must be >= 1, got depth {depth}, threads {threads}")
        self._fn, self._items = fn, iter(items)
        self._depth = max(depth, threads)
        self._then_close = list(then_close)
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self.last_take: Take | None = None  # of the latest __next__ that returned a result
        _THREADS.append(self)
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._depth:
            try:
                item = next(self._items)
            except StopIteration:
                return
            self._pending.append(self._pool.submit(_call, self._fn, item))

    def __next__(self) -> Any:
        if self._pool is None or not self._pending:
            self.close()
            raise StopIteration
        ready = self.ready()
        t_ask = time.perf_counter()
        head = self._pending.popleft()
        self._fill()  # the trainer's step overlaps the next ``depth`` calls
        try:
            out = head.result()
        except BaseException:
            self.close()
            raise
        t_got = time.perf_counter()
        if out is _END:
            self.close()
            raise StopIteration
        self.last_take = Take(ready, t_ask, t_got, self.ready())
        return out

    def ready(self) -> int:
        """Results computed and not yet taken, at the head of the order."""
        n = 0
        for f in list(self._pending):
            if not f.done():
                break
            n += 1
        return n

    def close(self) -> None:
        """Cancels calls not started, waits for the running ones, then closes ``then_close``. Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        try:
            _THREADS.remove(self)
        except ValueError:  # pragma: no cover - removed once, under the lock above
            pass
        then_close, self._then_close = self._then_close, []
        for c in then_close:
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - shutting down; the consumer has its answer
                log.warning("closing %r: %r", c, e)
        # Let go of what the calls used (e.g. Grain's iterator, in fn's closure), so that it is
        # freed now, not at interpreter teardown, when its own finalizers find modules gone.
        self._fn, self._items = None, iter(())


def _close_all() -> None:
    """At interpreter exit, closes the iterators never closed (e.g. one kept in a global),
    while the interpreter is whole: their threads stop, Grain's workers shut down cleanly."""
    for p in _THREADS[:]:  # a copy: closing removes each
        p.close()


atexit.register(_close_all)
