"""Statistics of packed rows for ``replay triage``'s data check: pure NumPy (no JAX, no I/O).

A batch is a pure function of the step, so the rows of a loss spike's onset can be read again
and set against a baseline of rows from earlier in the run. Each row gets a few numbers that bad
data moves (glossary; ``T`` tokens in the row, not counting padding)::

    unk_rate             tokens equal to the tokenizer's unknown id / T
    repeat_rate          1 - distinct n-grams / n-grams (n = 4) over the row: text has a few
                         repeated phrases, a row of one token repeated has rate ~1
    mean_segment_length  T / segments: a packing change (documents cut short, or run together)
    byte_fallback        tokens that are SentencePiece byte pieces (<0x00>..<0xFF>) / T: random
                         bytes that decode, or text in a script the vocabulary lacks
    surprisal            mean of -ln p(token) under the baseline rows' unigram distribution
                         (add-one smoothing), nats: text from another distribution

A row is an *outlier* when one of its content numbers (all but the mean segment length, which
packing makes heavy-tailed: one 1024-token document or thirty short ones) lies above Tukey's
upper far-out fence of the baseline rows of the same source (Tukey 1977: ``Q1 - k * IQR`` and ``Q3 + k *
IQR`` with ``k = 3``; the IQR floored per feature, so that a baseline with no spread, e.g. no
unknown token at all, does not make every tiny departure an outlier). Fences rather than z-scores:
these rates are bounded and skewed (code repeats more 4-grams than prose), and a row of garbage sits
far beyond the fences of either. The data check then counts outliers per shard and per source,
compares each source's mean segment length, and names the documents.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

FEATURES = ("unk_rate", "repeat_rate", "mean_segment_length", "byte_fallback", "surprisal")
ROW_FEATURES = ("unk_rate", "repeat_rate", "byte_fallback", "surprisal")  # judged per row (module docstring)
NGRAM = 4
FENCE = 3.0  # Tukey's "far out"
# per feature, the smallest IQR used (in the feature's units): departures below k times these are never outliers
FLOORS = {"unk_rate": 0.01, "repeat_rate": 0.05, "mean_segment_length": 8.0, "byte_fallback": 0.02,
          "surprisal": 0.25}


def repeat_rate(tokens: np.ndarray, n: int = NGRAM) -> float:
    """``1 - distinct n-grams / n-grams`` of ``tokens`` (int ``[T]``); 0.0 when ``T < n``."""
    t = np.asarray(tokens, np.int64)
    if t.size < n:
        return 0.0
    grams = np.lib.stride_tricks.sliding_window_view(t, n)
    distinct = np.unique(grams, axis=0).shape[0]
    return 1.0 - distinct / grams.shape[0]


def unigram_counts(rows: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """float64 ``[vocab_size]``: token counts of ``rows`` plus one (add-one smoothing: every id of the
    vocabulary counts at least 1)."""
    counts = np.ones(int(vocab_size), np.float64)
    for r in rows:
        t = np.asarray(r, np.int64)
        t = t[(t >= 0) & (t < vocab_size)]
        counts += np.bincount(t, minlength=vocab_size)[:vocab_size]
    return counts


def surprisal(tokens: np.ndarray, counts: np.ndarray, leave_out: bool = False) -> float:
    """Mean ``-ln p(token)`` of ``tokens`` under the unigram ``counts`` (:func:`unigram_counts`), nats;
    ``leave_out``: the row's own tokens are taken out of the counts first (a baseline row judged
    against a model it is part of would look more typical than a new row). NaN for an empty row."""
    t = np.asarray(tokens, np.int64)
    t = t[(t >= 0) & (t < counts.size)]
    if not t.size:
        return float("nan")
    c = counts
    if leave_out:
        c = counts - np.bincount(t, minlength=counts.size)[:counts.size]
    return float(-np.mean(np.log(c[t] / c.sum())))


def row_features(tokens: np.ndarray, segment_lengths: np.ndarray, *, unk_id: Optional[int] = None,
                 byte_pieces: Optional[np.ndarray] = None, counts: Optional[np.ndarray] = None,
                 leave_out: bool = False) -> dict[str, float]:
    """The numbers of the module docstring for one row.

    Args:
      tokens: int ``[T]`` (no padding); segment_lengths: int ``[S]``.
      unk_id: the tokenizer's unknown id (None or negative: ``unk_rate`` is NaN).
      byte_pieces: bool ``[V]``, which ids are byte pieces (None: ``byte_fallback`` is NaN).
      counts: the baseline's :func:`unigram_counts` (None: ``surprisal`` is NaN); leave_out: the
        row is one of the baseline's (:func:`surprisal`).

    Returns:
      ``{feature: float}`` for every name of :data:`FEATURES` (NaN: not available).
    """
    t = np.asarray(tokens, np.int64)
    n = max(int(t.size), 1)
    segs = max(len(segment_lengths), 1)
    out = {"repeat_rate": repeat_rate(t), "mean_segment_length": float(t.size) / segs}
    out["unk_rate"] = float(np.count_nonzero(t == unk_id)) / n if unk_id is not None and unk_id >= 0 else np.nan
    if byte_pieces is not None:
        ok = (t >= 0) & (t < byte_pieces.size)
        out["byte_fallback"] = float(np.count_nonzero(byte_pieces[t[ok]])) / n
    else:
        out["byte_fallback"] = np.nan
    out["surprisal"] = surprisal(t, counts, leave_out) if counts is not None else np.nan
    return out


def feature_matrix(rows: Sequence[Mapping[str, float]]) -> np.ndarray:
    """float64 ``[rows, len(FEATURES)]`` of :func:`row_features` results."""
    return np.asarray([[r[f] for f in FEATURES] for r in rows], np.float64).reshape(len(rows), len(FEATURES))


@dataclasses.dataclass(frozen=True)
class Baseline:
    """Per feature (``FEATURES`` order; NaN: not available) the baseline rows' median, quartiles and
    the spread used (``max(IQR, floor)``), from ``rows`` rows."""

    median: np.ndarray
    q1: np.ndarray
    q3: np.ndarray
    spread: np.ndarray
    rows: int

    def fences(self, k: float = FENCE) -> tuple[np.ndarray, np.ndarray]:
        return self.q1 - k * self.spread, self.q3 + k * self.spread

    def to_dict(self) -> dict[str, dict[str, float]]:
        lo, hi = self.fences()
        return {f: {"median": _r(m), "q1": _r(a), "q3": _r(b), "fences": [_r(x), _r(y)]}
                for f, m, a, b, x, y in zip(FEATURES, self.median, self.q1, self.q3, lo, hi)}


def _r(v: float):
    return None if not np.isfinite(v) else round(float(v), 6)


def baseline(base: np.ndarray) -> Baseline:
    """The centre and spread of baseline rows ``base`` (``[n, F]``): median, quartiles and
    ``max(IQR, floor)`` per feature (:data:`FLOORS`)."""
    b = np.asarray(base, np.float64).reshape(-1, len(FEATURES))
    out = {k: np.full(len(FEATURES), np.nan) for k in ("median", "q1", "q3", "spread")}
    for j, f in enumerate(FEATURES):
        col = b[:, j][np.isfinite(b[:, j])]
        if not col.size:
            continue
        q1, med, q3 = np.percentile(col, [25, 50, 75])
        out["median"][j], out["q1"][j], out["q3"][j] = med, q1, q3
        out["spread"][j] = max(q3 - q1, FLOORS[f])
    return Baseline(rows=int(b.shape[0]), **out)


def scores(rows: np.ndarray, base: Baseline, k: float = FENCE) -> np.ndarray:
    """float64 ``[m, F]``: how far each row lies beyond the baseline's fences, in units of the spread
    (0 inside the fences, negative below, NaN where not available)."""
    x = np.asarray(rows, np.float64).reshape(-1, len(FEATURES))
    lo, hi = base.fences(k)
    with np.errstate(invalid="ignore"):
        out = np.where(x > hi, (x - hi) / base.spread, np.where(x < lo, (x - lo) / base.spread, 0.0))
    return np.where(np.isfinite(x) & np.isfinite(base.spread), out, np.nan)


def outliers(score: np.ndarray, features: Sequence[str] = ROW_FEATURES) -> np.ndarray:
    """bool ``[m]``: rows beyond the *upper* fence on one of ``features`` (NaN scores never count). Bad
    data raises these numbers (more unknown tokens, repeats, byte pieces, surprise); a row below the
    lower fence is unusually clean text (a table of constants in code), not a fault."""
    sc = np.asarray(score, np.float64).reshape(-1, len(FEATURES))
    cols = [FEATURES.index(f) for f in features]
    return (np.nan_to_num(sc[:, cols], nan=0.0) > 0).any(axis=1)
