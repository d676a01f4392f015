"""All index arithmetic of the loader: step -> global rows -> (phase, source, epoch, record, shard).

No JAX and no I/O here: every function is pure, so it can be tested from tables and with
hypothesis, and ``batch_at(10**7)`` costs what ``batch_at(10)`` costs.

Glossary (Levanter style; ``B`` is the global batch in rows)::

    step s            the trainer's global step, 0-based. Skip windows do not change it.
    data step d       the step of the *unskipped* schedule whose rows step s trains on:
                      d = s + sum(B_w - A_w + 1 for each skip window [A_w, B_w] with A_w <= s)
    global row g      a row of the unskipped run: step d holds g in [d*B, (d+1)*B).
    phase p           rows g in [S_p*B, S_{p+1}*B) are drawn with the weights of phase p,
                      which starts at data step S_p (``from_step`` of the mixture config).
    local row r       g - S_p*B, the row's position inside its phase.
    quota a_k, D      phase weights as exact integers: w_k = a_k / D, D = sum_k a_k.
    draw count c      how many rows source k gave before this one, over the whole run
                      (phases carry each source's count over: no row repeated or skipped).
    epoch e, index i  (e, i) = divmod(c, N_k), N_k the source's records.
    record            index_shuffle(i, N_k - 1, seed=derive_seed(seed, source, e)): the
                      record of the source, counted across its shards in manifest order.
    shard, record in shard
                      from the manifest's per-shard record counts (cumulative offsets).
    host rows         the rows of a global batch held by one host's devices.

Interleave. Inside a phase, row r goes to the source chosen by Tijdeman's rule for the
chairman assignment problem (R. Tijdeman, "The chairman assignment problem", Discrete
Mathematics 32 (1980) 323-330): with K sources of weight w_k and n_k(t) the rows source k
received among the first t rows, at row t (1-based) choose, among the sources with
``w_k*t - n_k(t-1) >= 1/(2K-2)``, the one with the smallest deadline
``(n_k(t-1) + 1 - 1/(2K-2)) / w_k`` (ties: lowest source index). Tijdeman proves
``|n_k(t) - w_k*t| <= 1 - 1/(2K-2) < 1`` for every k and t: every prefix of a phase is within
+-1 row of weight x rows. With rational weights ``a_k / D`` the deviations at ``t = D`` are
integers below 1 in size, hence 0, so the sequence repeats with period ``D``; we compute one
period once (O(D log K) at build) and then row r is O(1): ``q, s = divmod(r, D)``,
``n_k(r) = q*a_k + n_k(s)``.

Weights are made exact from their decimal form (``Fraction(repr(w))``, so 0.3 is 3/10) and
normalized; if the exact period would exceed :data:`MAX_PERIOD` rows the weights are rounded
to quotas of ``MAX_PERIOD`` by largest remainders (every positive weight keeps a quota >= 1)
and the realized weights are reported by :meth:`Schedule.normalized_weights`.

May import: no loader module (``contract.hashing``, numpy, Grain's ``index_shuffle``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import operator
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np

from contract.hashing import derive_seed

try:  # Grain's Feistel-style permutation (C++), the same one ``ShuffleMapDataset`` uses.
    from grain.experimental import index_shuffle as _index_shuffle
except ImportError:  # pragma: no cover - grain is a dependency; kept for a clear message
    _index_shuffle = None

MAX_PERIOD = 1 << 20
# Global rows stay below this (int64 arithmetic everywhere, with headroom for q * a_k + carries).
MAX_GLOBAL_ROW = 1 << 62
SHUFFLE_ROUNDS = 4


class ScheduleError(ValueError):
    """A schedule input (weights, phases, skip windows, batch, step) is out of range."""


# --------------------------------------------------------------------------- weights


def exact_weights(weights: Sequence[float]) -> tuple[Fraction, ...]:
    """Returns ``weights`` normalized to exact fractions summing to 1.

    Each weight is read from its shortest decimal form (``Fraction(repr(w))``), so config
    values such as 0.3 and 0.7 become 3/10 and 7/10 exactly.

    Raises:
      ScheduleError: a weight is negative or not finite, or all weights are zero.
    """
    fr = []
    for k, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ScheduleError(f"weight[{k}] must be finite and >= 0, got {w}")
        fr.append(Fraction(repr(float(w))))
    total = sum(fr)
    if total == 0:
        raise ScheduleError(f"all weights are zero: {list(weights)}; at least one must be > 0")
    return tuple(f / total for f in fr)


def weight_resolution_warnings(phases: Sequence[tuple[int, Mapping[str, float]]],
                               realized: Sequence[Mapping[str, float]], max_period: int = MAX_PERIOD) -> list[str]:
    """Warnings for configured weights below the mixture table's resolution ``1 / max_period``: such a
    weight is realized as a quota of 1 row in ``max_period`` (:func:`quotas`), far above what was asked.

    Args:
      phases: per phase, ``(from_step, {source: configured weight})``.
      realized: per phase, ``{source: realized weight}`` (``Schedule.normalized_weights()``).

    Returns:
      one sentence per (phase, source) whose normalized configured weight is > 0 and below
      ``1 / max_period``, with the realized weight and the factor between them.
    """
    out = []
    for (start, weights), got in zip(phases, realized):
        total = sum(w for w in weights.values() if w > 0)
        for name, w in weights.items():
            want = w / total if total else 0.0
            if 0 < want < 1 / max_period:
                r = got.get(name, 0.0)
                out.append(f"source {name!r} from step {start}: weight {w:g} ({want:.3g} of the mixture) is below the "
                           f"mixture table's resolution 1/{max_period:,} ({1 / max_period:.3g}): it is realized as "
                           f"{r:.3g}, {r / want:,.0f}x higher; raise it to at least {1 / max_period:.3g} of the "
                           "mixture, or set it to 0")
    return out


def quotas(weights: Sequence[float], max_period: int = MAX_PERIOD) -> tuple[tuple[int, ...], int]:
    """Returns integer quotas ``(a_1..a_K)`` and period ``D = sum(a)`` with ``a_k / D`` the weights.

    Exact when the normalized weights' common denominator is at most ``max_period``;
    otherwise rounded to ``D = max_period`` by largest remainders, keeping ``a_k >= 1`` for
    every positive weight (the realized weights are then ``a_k / D``).

    Raises:
      ScheduleError: as :func:`exact_weights`, or more positive weights than ``max_period``.
    """
    fr = exact_weights(weights)
    den = functools.reduce(math.lcm, (f.denominator for f in fr), 1)
    if den <= max_period:
        a = tuple(int(f * den) for f in fr)
        return a, den
    positive = [k for k, f in enumerate(fr) if f > 0]
    if len(positive) > max_period:
        raise ScheduleError(f"{len(positive)} positive weights exceed the period limit {max_period}")
    ideal = [f * max_period for f in fr]
    a = [max(1, math.floor(x)) if fr[k] > 0 else 0 for k, x in enumerate(ideal)]
    diff = max_period - sum(a)
    if diff >= 0:  # hand the missing units to the largest remainders
        order = sorted(positive, key=lambda k: (-(ideal[k] - a[k]), k))
        for k in order[:diff]:
            a[k] += 1
    else:  # take the excess from the smallest remainders, never below 1
        order = sorted((k for k in positive if a[k] > 1), key=lambda k: (ideal[k] - a[k], k))
        i = 0
        while diff < 0:
            k = order[i % len(order)]
            if a[k] > 1:
                a[k] -= 1
                diff += 1
            i += 1
    return tuple(a), max_period


@functools.lru_cache(maxsize=64)
def interleave_period(a: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One period of the interleave of quotas ``a`` (Tijdeman's rule, module docstring).

    Args:
      a: non-negative integer quotas, at least one positive; ``D = sum(a)``.

    Returns:
      ``(source, draw)``, int32 and int64 ``[D]``: the source of local row ``s`` and how
      many rows that source had in ``[0, s)`` (its draw count within the period).

    Raises:
      ScheduleError: no positive quota.
      RuntimeError: the +-1 bound was violated (cannot happen if Tijdeman's theorem holds;
        checked on every build so a bug here fails loudly).
    """
    D = sum(a)
    if D <= 0:
        raise ScheduleError(f"quotas {a} have no positive entry")
    src = np.empty(D, np.int32)
    draw = np.empty(D, np.int64)
    positive = [k for k, q in enumerate(a) if q > 0]
    if len(positive) == 1:
        src[:] = positive[0]
        draw[:] = np.arange(D)
        return src, draw
    m = 2 * len(positive) - 2
    lcm = functools.reduce(math.lcm, (a[k] for k in positive), 1)
    n = [0] * len(a)
    # release(k): first 1-based row t with m*(a_k*t - n_k*D) >= D.
    pending = [(-(-D // (m * a[k])), k) for k in positive]
    heapq.heapify(pending)
    ready: list[tuple[int, int]] = []  # (deadline * m * lcm, k)
    for t in range(1, D + 1):
        while pending and pending[0][0] <= t:
            _, k = heapq.heappop(pending)
            heapq.heappush(ready, ((m * n[k] + m - 1) * (lcm // a[k]), k))
        if not ready:
            raise RuntimeError(f"interleave of quotas {a}: no eligible source at row {t}")
        _, k = heapq.heappop(ready)
        src[t - 1] = k
        draw[t - 1] = n[k]
        n[k] += 1
        heapq.heappush(pending, (-(-D * (m * n[k] + 1) // (m * a[k])), k))
    if n != list(a):
        raise RuntimeError(f"interleave of quotas {a} ended with counts {n}")
    # The bound, checked exactly in integers: |n_k(t)*D - a_k*t| < D.
    t = np.arange(1, D + 1, dtype=np.int64)
    for k in positive:
        nk = np.cumsum(src == k)
        if np.abs(nk * D - a[k] * t).max() >= D:
            raise RuntimeError(f"interleave of quotas {a} leaves the +-1 bound for source {k}")
    return src, draw


def period_counts(a: tuple[int, ...], s: int) -> np.ndarray:
    """Rows per source among local rows ``[0, s)`` of one period, int64 ``[K]``."""
    src, _ = interleave_period(a)
    return np.bincount(src[:s], minlength=len(a)).astype(np.int64)


def interleave_counts(a: tuple[int, ...], rows: int) -> np.ndarray:
    """Rows per source among the first ``rows`` rows of a phase with quotas ``a``; int64 ``[K]``.

    ``n_k(rows) = q*a_k + n_k(s)`` with ``q, s = divmod(rows, D)``: O(D) at worst, O(1) in ``rows``.
    """
    if rows < 0:
        raise ScheduleError(f"rows must be >= 0, got {rows}")
    D = sum(a)
    q, s = divmod(rows, D)
    return q * np.asarray(a, np.int64) + period_counts(a, s)


# --------------------------------------------------------------------------- skip windows


@dataclasses.dataclass(frozen=True, order=True)
class SkipWindow:
    """Training steps ``start..end`` (inclusive) whose data is skipped.

    From step ``start`` on, training step ``s`` trains on the batch the unskipped schedule
    had at ``s + (end - start + 1)``; steps before ``start`` are unchanged. Windows are in
    training-step coordinates of the schedule they were added to, each starting after the
    previous one's start.
    """

    start: int
    end: int

    def __post_init__(self):
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ScheduleError(f"skip window {name} must be an integer, got {v!r}")
        if self.start < 0 or self.end < self.start:
            raise ScheduleError(f"skip window [{self.start}, {self.end}]: need 0 <= start <= end")

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def check_skip_windows(windows: Sequence[SkipWindow | Sequence[int]]) -> tuple[SkipWindow, ...]:
    """Returns the windows as :class:`SkipWindow` s, checked to have strictly increasing starts.

    Raises:
      ScheduleError: a malformed window or starts that do not increase.
    """
    if isinstance(windows, (str, bytes, Mapping)):
        raise ScheduleError(f"skip windows must be a sequence of (start, end) pairs, got {windows!r}")
    out = []
    for w in windows:
        if isinstance(w, SkipWindow):
            out.append(w)
            continue
        try:
            if isinstance(w, (str, bytes, Mapping)):
                raise TypeError
            a, b = w
        except (TypeError, ValueError):
            raise ScheduleError(f"skip window must be a (start, end) pair of integers, got {w!r}") from None
        out.append(SkipWindow(_as_int(a, "skip window start"), _as_int(b, "skip window end")))
    out = tuple(out)
    for prev, cur in itertools.pairwise(out):
        if cur.start <= prev.start:
            raise ScheduleError(
                f"skip windows must have increasing starts: [{cur.start}, {cur.end}] after [{prev.start}, {prev.end}]"
            )
    return out


def _as_int(value, what: str) -> int:
    """``value`` as a Python int: ints and numpy integers only (no bool, float or str).

    Raises:
      ScheduleError: naming ``what``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ScheduleError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ScheduleError(f"{what} must be an integer, got {value!r}") from None


def check_step(step) -> int:
    """Returns ``step`` as a Python int >= 0.

    Raises:
      ScheduleError: not an integer (bool, float and str are refused, never truncated) or < 0.
    """
    step = _as_int(step, "step")
    if step < 0:
        raise ScheduleError(f"step must be >= 0, got {step}")
    return step


def data_step(step: int, windows: Sequence[SkipWindow]) -> int:
    """Returns the unskipped data step that training step ``step`` trains on (glossary).

    Raises:
      ScheduleError: ``step`` < 0.
    """
    step = check_step(step)
    return step + sum(w.length for w in windows if w.start <= step)


# --------------------------------------------------------------------------- records and shards


def shuffled_record(index_in_epoch: int, num_records: int, seed: int, source: str, epoch: int) -> int:
    """Returns the record at position ``index_in_epoch`` of ``source``'s epoch ``epoch``.

    A permutation of ``[0, num_records)`` per ``(seed, source, epoch)``, from Grain's
    ``index_shuffle`` (4 rounds) with seed ``derive_seed(seed, source, epoch)`` (for
    ``num_records == 2**B + 1``, even ``B >= 16``, where Grain's function is not a
    permutation, the same cipher on a wider block: see :func:`_shuffle_block_bits`).

    Raises:
      ScheduleError: ``index_in_epoch`` not in ``[0, num_records)``.
    """
    if not 0 <= index_in_epoch < num_records:
        raise ScheduleError(f"index_in_epoch {index_in_epoch} not in [0, {num_records})")
    if num_records == 1:
        return 0
    return int(shuffled_records(np.asarray([index_in_epoch]), num_records, seed, source, epoch)[0])


@functools.lru_cache(maxsize=4096)
def _epoch_seed(seed: int, source: str, epoch: int) -> int:
    return derive_seed(seed, source, epoch)


# ---- Grain's index_shuffle, whole permutations at once (numpy), for small sources.
#
# Grain's ``index_shuffle(i, max_index, seed, rounds)`` (grain/_src/python/experimental/
# index_shuffle/index_shuffle.cc) encrypts ``i`` with a Simon-style Feistel cipher on
# ``B = max(16, ceil(log2(max_index)) rounded up to even)`` bits, round keys from
# ``std::seed_seq{seed}.generate(rounds)``, and cycle-walks (re-encrypts) until the value is
# ``<= max_index``. One call costs microseconds (a few encryptions, the key schedule, the
# Python call), once per row. For a source with ``B <= SHUFFLE_TABLE_BITS`` we instead
# encrypt all ``2**B`` values once per (source, epoch) with numpy and cycle-walk by table
# lookup: the same permutation, checked against Grain's function in the tests; a row is
# then one array lookup. Larger sources keep the per-row call.
SHUFFLE_TABLE_BITS = 18


def _seed_seq_generate(seed: int, n: int) -> list[int]:
    """``std::seed_seq{seed}.generate(out, out + n)`` (C++ [rand.util.seedseq]), 32-bit words."""
    mask = 0xFFFFFFFF
    v, s = [seed & mask], 1
    b = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def tf(x):
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * tf(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n])) & mask
        r2 = (r1 + (s if k == 0 else (k % n + v[k - 1] if k <= s else k % n))) & mask
        b[(k + p) % n] = (b[(k + p) % n] + r1) & mask
        b[(k + q) % n] = (b[(k + q) % n] + r2) & mask
        b[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * tf((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & mask)) & mask
        r4 = (r3 - k % n) & mask
        b[(k + p) % n] ^= r3
        b[(k + q) % n] ^= r4
        b[k % n] = r4
    return b


def _shuffle_block_bits(max_index: int) -> tuple[int, bool]:
    """Grain's block size for ``max_index``, and whether Grain's own function can be used.

    Grain's block (``ceil(log2(max_index))``, even, >= 16) cannot hold ``max_index`` itself
    when ``max_index == 2**B`` for an even ``B >= 16``: the index ``2**B`` is truncated to 0,
    so the "permutation" of a source of ``2**B + 1`` records serves one record twice per
    epoch and never serves another. For those sizes the same cipher runs on a block two
    bits wider (a true permutation; cycle walking as in Grain).
    """
    bits = math.ceil(math.log2(max_index))  # in double precision, as the C++ does
    bits = max(bits + bits % 2, 16)
    if max_index >> bits:
        return bits + 2, False
    return bits, True


def _simon_walk(idx: np.ndarray, max_index: int, bits: int, keys: Sequence[int]) -> np.ndarray:
    """Encrypt-and-cycle-walk of each index (vectorized over ``idx``), int64."""
    out = _simon_encrypt(np.asarray(idx, np.uint64), bits, keys)
    todo = np.flatnonzero(out > max_index)
    while todo.size:
        out[todo] = _simon_encrypt(out[todo], bits, keys)
        todo = todo[out[todo] > max_index]
    return out.astype(np.int64)


def _simon_encrypt(values: np.ndarray, bits: int, keys: Sequence[int]) -> np.ndarray:
    """Grain's ``simon_encrypt<bits/2>`` of every value (uint64 ``[n]``)."""
    w = bits // 2
    mask = np.uint64((1 << w) - 1)
    sh = [np.uint64(x) for x in range(65)]

    def rotl(x, r):
        return ((x << sh[r]) | (x >> sh[w - r])) & mask

    def f(x):
        return (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2)

    left = (values >> sh[w]) & mask
    right = values & mask
    for i in range(0, len(keys), 2):
        left ^= f(right)
        left ^= np.uint64(keys[i]) & mask
        right ^= f(left)
        right ^= np.uint64(keys[i + 1]) & mask
    return (left << sh[w]) | right


def shuffle_table(max_index: int, seed: int, rounds: int = SHUFFLE_ROUNDS) -> np.ndarray:
    """``[index_shuffle(i, max_index, seed, rounds) for i in range(max_index + 1)]`` as int64,
    computed for the whole block at once (module notes above). Read-only.

    Raises:
      ScheduleError: the block is wider than :data:`SHUFFLE_TABLE_BITS` (use the per-row call).
    """
    if max_index == 0:
        return np.zeros(1, np.int64)
    bits, _ = _shuffle_block_bits(max_index)
    if bits > SHUFFLE_TABLE_BITS:
        raise ScheduleError(f"shuffle block of {bits} bits is too wide for a table")
    enc = _simon_encrypt(np.arange(1 << bits, dtype=np.uint64), bits, _seed_seq_generate(seed, rounds))
    enc = enc.astype(np.int64)
    out = enc[: max_index + 1].copy()
    todo = np.flatnonzero(out > max_index)
    while todo.size:  # cycle walking: the cycle through i comes back to values <= max_index
        out[todo] = enc[out[todo]]
        todo = todo[out[todo] > max_index]
    out.flags.writeable = False
    return out


# Tables kept: built on the second request for a (source size, epoch seed), so a training
# run (every step asks for the current epochs) gets them from its second step on, while
# random access (replay of scattered steps) does not pay 1-3 ms a table for a few rows.
# Least recently used first out, beyond SHUFFLE_TABLE_CACHE_BYTES.
SHUFFLE_TABLE_CACHE_BYTES = 256 << 20
_TABLE_LOCK = threading.Lock()
_TABLES: collections.OrderedDict = collections.OrderedDict()
_TABLES_SEEN: collections.OrderedDict = collections.OrderedDict()
_TABLE_BYTES = [0]


def _cached_table(max_index: int, epoch_seed: int) -> np.ndarray | None:
    """The shuffle table of ``(max_index, epoch_seed)`` if kept or asked for before, else None."""
    key = (max_index, epoch_seed)
    with _TABLE_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
        if key not in _TABLES_SEEN:
            _TABLES_SEEN[key] = None
            if len(_TABLES_SEEN) > 4096:
                _TABLES_SEEN.popitem(last=False)
            return None
    table = shuffle_table(max_index, epoch_seed)  # outside the lock; a duplicate build is harmless
    with _TABLE_LOCK:
        if key not in _TABLES:
            _TABLES[key] = table
            _TABLE_BYTES[0] += table.nbytes
            while _TABLE_BYTES[0] > SHUFFLE_TABLE_CACHE_BYTES and len(_TABLES) > 1:
                _, old = _TABLES.popitem(last=False)
                _TABLE_BYTES[0] -= old.nbytes
    return table


def shuffled_records(index_in_epoch: np.ndarray, num_records: int, seed: int, source: str,
                     epoch: int) -> np.ndarray:
    """:func:`shuffled_record` of many indices of one (source, epoch), int64 ``[n]``."""
    idx = np.asarray(index_in_epoch, np.int64)
    if num_records == 1:
        return np.zeros(idx.shape, np.int64)
    es = _epoch_seed(seed, source, epoch)
    bits, grain_ok = _shuffle_block_bits(num_records - 1)
    if bits <= SHUFFLE_TABLE_BITS:
        table = _cached_table(num_records - 1, es)
        if table is not None:
            return table[idx]
    if not grain_ok:
        return _simon_walk(idx, num_records - 1, bits, _seed_seq_generate(es, SHUFFLE_ROUNDS))
    return np.fromiter((_index_shuffle(int(i), num_records - 1, es, SHUFFLE_ROUNDS) for i in idx.tolist()),
                       np.int64, count=idx.size)


def shard_offsets(records_per_shard: Sequence[int]) -> np.ndarray:
    """Cumulative record offsets ``[0, r_0, r_0 + r_1, ...]``, int64 ``[num_shards + 1]``."""
    return np.concatenate([[0], np.cumsum(np.asarray(records_per_shard, np.int64))])


def record_to_shard(record: int | np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maps source-level record indices to ``(shard, record_in_shard)`` (empty shards skipped).

    Raises:
      ScheduleError: a record outside ``[0, offsets[-1])``.
    """
    rec = np.asarray(record, np.int64)
    if rec.size and (rec.min() < 0 or rec.max() >= offsets[-1]):
        raise ScheduleError(f"record out of range [0, {int(offsets[-1])}): {rec.min()}..{rec.max()}")
    shard = np.searchsorted(offsets, rec, side="right") - 1
    return shard, rec - offsets[shard]


# --------------------------------------------------------------------------- hosts


def host_rows(global_batch: int, num_hosts: int, host: int) -> range:
    """The rows ``[host*b, (host+1)*b)`` of a global batch held by ``host``, ``b = B / hosts``.

    The usual data-parallel layout: the batch dimension split into equal contiguous
    blocks, host-major (what ``jax.sharding`` gives for a mesh whose data axis is ordered by
    process).

    Raises:
      ScheduleError: ``num_hosts`` does not divide ``global_batch`` or ``host`` is out of range.
    """
    if num_hosts < 1 or global_batch % num_hosts:
        raise ScheduleError(f"global batch {global_batch} must be a multiple of the host count {num_hosts}")
    if not 0 <= host < num_hosts:
        raise ScheduleError(f"host {host} not in [0, {num_hosts})")
    b = global_batch // num_hosts
    return range(host * b, (host + 1) * b)


# --------------------------------------------------------------------------- the schedule


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    """Phase weights from data step ``from_step``; ``weights`` in the schedule's source order."""

    from_step: int
    weights: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class RowLocations:
    """Where global rows come from; every field an int64 ``[n]`` array (``source`` indexes
    ``Schedule.sources``)."""

    global_row: np.ndarray
    phase: np.ndarray
    source: np.ndarray
    draw: np.ndarray
    epoch: np.ndarray
    index_in_epoch: np.ndarray
    record: np.ndarray


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The mixture schedule: what the global order is a pure function of.

    Attributes:
      sources: source names, in a fixed order (the mixture config's).
      records: records of each source (> 0 for a source that any phase draws from).
      phases: :class:`PhaseSpec` s; the first starts at step 0, then increasing ``from_step``.
      global_batch: rows per step ``B`` (> 0).
      seed: the shuffle seed.
      skip_windows: :class:`SkipWindow` s, increasing starts.
      max_period: interleave period limit (see :func:`quotas`).

    Raises:
      ScheduleError: in construction, naming the bad value and the allowed range.
    """

    sources: tuple[str, ...]
    records: tuple[int, ...]
    phases: tuple[PhaseSpec, ...]
    global_batch: int
    seed: int = 0
    skip_windows: tuple[SkipWindow, ...] = ()
    max_period: int = MAX_PERIOD

    def __post_init__(self):
        K = len(self.sources)
        if K == 0 or len(set(self.sources)) != K:
            raise ScheduleError(f"sources must be non-empty and unique, got {self.sources}")
        if len(self.records) != K:
            raise ScheduleError(f"records has {len(self.records)} entries for {K} sources")
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ScheduleError(f"global_batch must be an integer >= 1, got {self.global_batch!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ScheduleError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not self.phases or self.phases[0].from_step != 0:
            raise ScheduleError("the first phase must start at step 0")
        for prev, cur in itertools.pairwise(self.phases):
            if cur.from_step <= prev.from_step:
                raise ScheduleError(f"phase from_step must increase: {cur.from_step} after {prev.from_step}")
        for p in self.phases:
            if p.from_step * self.global_batch >= MAX_GLOBAL_ROW:
                raise ScheduleError(
                    f"phase from_step {p.from_step} x global batch {self.global_batch} is past the last "
                    f"addressable global row (2**62)"
                )
            if len(p.weights) != K:
                raise ScheduleError(f"phase at step {p.from_step} has {len(p.weights)} weights for {K} sources")
            exact_weights(p.weights)
            for k, w in enumerate(p.weights):
                if w > 0 and self.records[k] < 1:
                    raise ScheduleError(
                        f"source {self.sources[k]!r} has weight {w} from step {p.from_step} but no records"
                    )
        object.__setattr__(self, "skip_windows", check_skip_windows(self.skip_windows))

    @classmethod
    def from_mixture(
        cls, mixture, records: Mapping[str, int], global_batch: int, seed: int,
        skip_windows: Sequence[SkipWindow | Sequence[int]] = (),
    ) -> Schedule:
        """Builds the schedule of a ``contract.config.MixtureConfig`` over ``records`` per source."""
        names = tuple(mixture.source_names)
        missing = [n for n in names if n not in records]
        if missing:
            raise ScheduleError(f"sources {missing} of the mixture are not in the dataset {sorted(records)}")
        phases = tuple(PhaseSpec(p.from_step, tuple(float(p.weights[n]) for n in names)) for p in mixture.phases)
        return cls(names, tuple(int(records[n]) for n in names), phases, global_batch, seed,
                   check_skip_windows(skip_windows))

    # -- derived, cached
    @functools.cached_property
    def _quotas(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        return tuple(quotas(p.weights, self.max_period) for p in self.phases)

    @functools.cached_property
    def phase_row_starts(self) -> np.ndarray:
        """First global row of each phase, int64 ``[P]``."""
        return np.asarray([p.from_step * self.global_batch for p in self.phases], np.int64)

    @functools.cached_property
    def _carries(self) -> np.ndarray:
        """Draw counts of each source at the start of each phase, int64 ``[P, K]``."""
        K = len(self.sources)
        out = np.zeros((len(self.phases), K), np.int64)
        for p in range(1, len(self.phases)):
            rows = int(self.phase_row_starts[p] - self.phase_row_starts[p - 1])
            out[p] = out[p - 1] + interleave_counts(self._quotas[p - 1][0], rows)
        return out

    def normalized_weights(self) -> list[dict[str, float]]:
        """Per phase, the realized weight of each source (``a_k / D``), for reporting."""
        out = []
        for a, D in self._quotas:
            out.append({n: a[k] / D for k, n in enumerate(self.sources)})
        return out

    # -- the pure functions
    def data_step(self, step: int) -> int:
        """See :func:`data_step`."""
        return data_step(step, self.skip_windows)

    def step_rows(self, step: int) -> np.ndarray:
        """Global rows of training ``step``: ``[d*B, (d+1)*B)`` with ``d = data_step(step)``, int64 ``[B]``.

        Raises:
          ScheduleError: ``step`` is not an integer or is negative (:func:`check_step`), or
            its rows would reach ``2**62``.
        """
        d = self.data_step(step)
        if (d + 1) * self.global_batch > MAX_GLOBAL_ROW:
            raise ScheduleError(
                f"step {step} (data step {d}) is past the last step this schedule can address: "
                f"global rows must stay below 2**62, i.e. data step < {MAX_GLOBAL_ROW // self.global_batch}"
            )
        return np.arange(d * self.global_batch, (d + 1) * self.global_batch, dtype=np.int64)

    @functools.cached_property
    def stop_step(self) -> int:
        """One past the last training step whose rows the schedule can address (data step
        below ``MAX_GLOBAL_ROW // B``; ``data_step`` is increasing, so a bisection)."""
        limit = MAX_GLOBAL_ROW // self.global_batch
        lo, hi = 0, limit  # data_step(lo) < limit <= data_step(hi), as data_step(s) >= s
        if self.data_step(0) >= limit:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.data_step(mid) < limit else (lo, mid)
        return hi

    def steps_from(self, step: int) -> range:
        """The training steps from ``step`` to the last one the schedule can address:
        ``range(step, stop_step)``.

        Raises:
          ScheduleError: as :meth:`step_rows` for ``step``.
        """
        self.step_rows(step)
        return range(check_step(step), self.stop_step)

    def step_locations(self, step: int, positions: Sequence[int] | np.ndarray | None = None) -> RowLocations:
        """:meth:`locate` of the rows of training ``step``: all ``B`` of :meth:`step_rows`, or
        those at ``positions`` (int ``[n]`` in ``[0, B)``, e.g. a host's rows).

        Raises:
          ScheduleError: as :meth:`step_rows` (a step that is not an integer, negative, or
            past the addressable range).
        """
        rows = self.step_rows(step)
        if positions is not None:
            rows = rows[np.asarray(positions, np.int64)]
        return self.locate(rows)

    def locate(self, global_rows: Sequence[int] | np.ndarray) -> RowLocations:
        """Maps global rows to (phase, source, draw count, epoch, index in epoch, record).

        Args:
          global_rows: int ``[n]``, each >= 0.

        Returns:
          :class:`RowLocations` of int64 ``[n]`` arrays.

        Raises:
          ScheduleError: a negative row.
        """
        g = np.asarray(global_rows, np.int64).reshape(-1)
        if g.size and g.min() < 0:
            raise ScheduleError(f"global rows must be >= 0, got {g.min()}")
        phase = np.searchsorted(self.phase_row_starts, g, side="right") - 1
        if g.size and phase[0] == phase[-1] and (len(self.phases) == 1 or (phase == phase[0]).all()):
            groups = [(int(phase[0]), slice(None))]  # all in one phase: every step's rows but one a phase
        else:
            groups = [(int(p), phase == p) for p in np.unique(phase)]
        source = np.empty_like(g)
        draw = np.empty_like(g)
        for p, sel in groups:
            a, D = self._quotas[p]
            src_tab, draw_tab = interleave_period(a)
            q, s = np.divmod(g[sel] - self.phase_row_starts[p], D)
            k = src_tab[s].astype(np.int64)
            source[sel] = k
            draw[sel] = self._carries[p][k] + q * np.asarray(a, np.int64)[k] + draw_tab[s]
        n = np.asarray(self.records, np.int64)[source]
        epoch, index = np.divmod(draw, n)
        record = np.empty_like(g)
        # one group per (source, epoch): usually one or two per source in a step
        for k in np.unique(source).tolist() if g.size else ():
            sel = np.flatnonzero(source == k)
            e = epoch[sel]
            one = bool(e[0] == e[-1]) and bool((e == e[0]).all())
            for ep in [int(e[0])] if one else np.unique(e).tolist():
                at = sel if one else sel[e == ep]
                record[at] = shuffled_records(index[at], self.records[k], self.seed, self.sources[k], ep)
        return RowLocations(g, phase.astype(np.int64), source, draw, epoch, index, record)

    def source_counts(self, rows: int) -> np.ndarray:
        """Rows drawn from each source among global rows ``[0, rows)``, int64 ``[K]`` (O(1) in rows)."""
        if rows < 0:
            raise ScheduleError(f"rows must be >= 0, got {rows}")
        p = int(np.searchsorted(self.phase_row_starts, rows, side="right") - 1)
        local = rows - int(self.phase_row_starts[p])
        return self._carries[p] + interleave_counts(self._quotas[p][0], local)

    def to_dict(self) -> dict:
        """Canonical plain-value form (weights as exact fractions ``"n/d"``)."""
        return {
            "sources": list(self.sources),
            "records": list(self.records),
            "phases": [
                {"from_step": p.from_step, "weights": [str(f) for f in exact_weights(p.weights)]}
                for p in self.phases
            ],
            "global_batch": self.global_batch,
            "seed": self.seed,
            "skip_windows": [[w.start, w.end] for w in self.skip_windows],
            "max_period": self.max_period,
        }


def fingerprint(parts: Mapping) -> str:
    """sha256 hex of the canonical JSON of ``parts`` (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


__all__ = [
    "MAX_PERIOD",
    "weight_resolution_warnings",
    "PhaseSpec",
    "RowLocations",
    "Schedule",
    "ScheduleError",
    "SkipWindow",
    "check_skip_windows",
    "check_step",
    "data_step",
    "exact_weights",
    "fingerprint",
    "host_rows",
    "interleave_counts",
    "interleave_period",
    "quotas",
    "record_to_shard",
    "shard_offsets",
    "shuffle_table",
    "shuffled_record",
    "shuffled_records",
]
