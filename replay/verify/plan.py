"""The plan of a range replay: checkpoint segments, the order they replay in, and which placements may run
at the same time. Pure: no JAX, no I/O.

Glossary::

    segment     steps [c, e) from a checkpoint c to the next checkpoint e (or the range's stop): the
                unit of replay. Each segment restores its own checkpoint, so segments are independent:
                any order, any device set, concurrently.
    placement   one assignment of replay devices to the run's mesh positions (``devices.independent_assignments``)
    onset       the first suspect step: ``--onset STEP``, or ``replay scan``'s (suspects.json), with the
                range [lo, hi] it could lie in (lo = hi when certain)
    round       segments replayed together, on every placement, before the verdict is taken again
    lane        placements that cannot run at the same time (they share a device, or they span several
                processes that overlap): a lane's tasks run one after the other, lanes concurrently

Targeted replay (an onset in the range, not ``--exhaustive``)::

    round 1: the segments that overlap [lo, hi]           a conviction here ends the replay, unless
                                                           it is at a segment's first step: then the
                                                           segment before it replays first (walk back,
                                                           replay.verify.engine.walk_back), since a
                                                           persistent fault may have begun earlier
    round 2: every other segment of the range             (an acquittal needs every step, each
                                                           once per placement)

Cost counted in steps replayed until a verdict: with the onset known to one step and a conviction,
at most the onset's segment per placement (``checkpoint_every`` steps, less when the divergence
ends it early), whatever the range's length.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence


@dataclasses.dataclass(frozen=True, order=True)
class Segment:
    """Steps ``[start, stop)``, replayed from the run's checkpoint ``start``."""

    start: int
    stop: int

    def __post_init__(self):
        if self.stop <= self.start:
            raise ValueError(f"a segment needs stop > start, got {self.start}:{self.stop}")

    @property
    def steps(self) -> int:
        return self.stop - self.start

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether it holds a step of the inclusive range ``[lo, hi]``."""
        return self.start <= hi and lo < self.stop


def segments(first_checkpoint: int, stop: int, checkpoints: Sequence[int]) -> list[Segment]:
    """The checkpoint segments of a replay of ``[first_checkpoint, stop)``: one per checkpoint in that span.

    Raises:
      ValueError: ``stop <= first_checkpoint``.
    """
    if stop <= first_checkpoint:
        raise ValueError(f"nothing to replay: stop {stop} <= checkpoint {first_checkpoint}")
    bounds = [first_checkpoint, *sorted({c for c in checkpoints if first_checkpoint < c < stop}), stop]
    return [Segment(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class Onset:
    """Where a replay should look first.

    Attributes:
      step: the estimated first suspect step.
      lo, hi: the inclusive range it could lie in (``lo <= step <= hi``; equal when certain).
      source: where it came from (``"--onset"``, ``"suspects.json: norm_drift of device 3"``).
      devices: the suspect devices, when the source names them.
    """

    step: int
    lo: int
    hi: int
    source: str
    devices: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.lo <= self.step <= self.hi:
            raise ValueError(f"onset {self.step} outside its range [{self.lo}, {self.hi}]")

    @property
    def uncertain(self) -> bool:
        return self.hi > self.lo

    @classmethod
    def at(cls, step: int, source: str = "--onset") -> "Onset":
        """A known onset (``--onset STEP``).

        Raises:
          ValueError: ``step`` < 0.
        """
        if step < 0:
            raise ValueError(f"--onset: must be a step >= 0, got {step}")
        return cls(step, step, step, source)

    def to_dict(self) -> dict:
        return {"step": self.step, "range": [self.lo, self.hi], "uncertain": self.uncertain, "source": self.source,
                "devices": list(self.devices)}


def rounds(segs: Sequence[Segment], onset: Optional[Onset], exhaustive: bool = False) -> list[list[int]]:
    """The order segments replay in, as rounds of segment indices (module docstring).

    One round of every segment when there is no onset, when it lies outside the segments, or when
    ``exhaustive``; else the segments overlapping the onset's range first, then the rest.
    """
    every = list(range(len(segs)))
    if onset is None or exhaustive:
        return [every]
    first = [i for i, s in enumerate(segs) if s.overlaps(onset.lo, onset.hi)]
    if not first:
        return [every]
    rest = [i for i in every if i not in first]
    return [first, rest] if rest else [first]


def lanes(assignments: Sequence[Sequence[int]], process_of: Mapping[int, int]) -> list[list[int]]:
    """Groups placements (indices into ``assignments``) into lanes: two placements share a lane when they
    share a device, or when both span several processes and share one (cross-process collectives of
    one process are kept in one thread). Lanes are in the order of their first placement.

    Args:
      assignments: each placement's device ids.
      process_of: device id -> its process index.
    """
    n = len(assignments)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    devs = [set(a) for a in assignments]
    procs = [{process_of.get(d, 0) for d in a} for a in assignments]
    for i in range(n):
        for j in range(i + 1, n):
            shared = devs[i] & devs[j] or (len(procs[i]) > 1 and len(procs[j]) > 1 and procs[i] & procs[j])
            if shared:
                parent[find(j)] = find(i)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])
