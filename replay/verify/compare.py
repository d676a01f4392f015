"""Comparing logged and replayed step fingerprints. Pure: no JAX, no I/O.

Three comparison modes (:class:`replay.verify.verdict.Evidence`), strongest first:

* **bit-exact**: the replay ran on the run's mesh shape with the same devices in the same
  order. Every field compares bit for bit: batch hash, loss and gradient-norm bits, the
  reduced fingerprint (and NaN/Inf counts) of every leaf, and each device's contribution.
* **per-shard**: other devices, same mesh shape. A device's contribution is compared with
  the logged contribution of the device that sat at the same mesh position
  (``StepFingerprints.device_coords``), bit for bit; the batch hash, loss, norm and reduced
  leaves still compare bit for bit (same program), but a difference only there is not
  pinned on a device.
* **tolerance**: loss and gradient norm compare as float32 within a relative tolerance
  ``|a - b| <= rtol * max(|a|, |b|)``; NaN equals only NaN. Weaker evidence: it can acquit
  but never convict.

NaN and Inf rules (as Megatron's rerun state machine makes explicit): fingerprints are of bit
patterns, so NaN payloads compare exactly; the per-leaf NaN and Inf counts are compared like
the fingerprints.

A step's outcome is a :class:`StepDiff`; :func:`first_divergence` turns a replay's diffs into
the :class:`replay.verify.verdict.Divergence` that :func:`replay.verify.verdict.decide` consumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from typing import Any, Mapping, Optional, Sequence

from replay.run.protocol import StepFingerprints
from replay.verify.localize import Localization, localize, receive_differences, send_differences
from replay.verify.verdict import Divergence, DivergenceKind, Evidence


class PairingError(ValueError):
    """Logged and replayed devices cannot be matched by mesh position (different mesh shapes)."""


Position = tuple  # a mesh position: ((axis name, index), ...) sorted by axis name


def position_key(coords: Any) -> Position:
    """The canonical mesh position of ``{axis name: index}`` (or of an index tuple)."""
    if isinstance(coords, Mapping):
        return tuple(sorted((str(a), int(i)) for a, i in coords.items()))
    return tuple((str(n), int(i)) for n, i in enumerate(coords))


def position_label(pos: Position) -> str:
    """``"data=0,model=1"``."""
    return ",".join(f"{a}={i}" for a, i in pos)


def coords_of(fp: StepFingerprints) -> dict[int, Position]:
    """``device id -> mesh position`` of a step (empty when the trainer did not record them)."""
    raw = getattr(fp, "device_coords", None) or {}
    return {int(k): position_key(v) for k, v in raw.items()}


def pair_devices(logged: Mapping[int, Position], replayed: Mapping[int, Position]) -> dict[int, int]:
    """Matches logged device ids to replay device ids by mesh position.

    Args:
      logged, replayed: ``device id -> mesh position`` (:func:`position_key`).

    Returns:
      ``{logged id: replay id}`` for every logged device.

    Raises:
      PairingError: the two sets of mesh positions differ (the message lists both).
    """
    by_pos = {c: d for d, c in replayed.items()}
    lpos = sorted(logged.values())
    if lpos != sorted(by_pos):
        raise PairingError(
            f"mesh positions differ: the run used {lpos}, the replay {sorted(by_pos)}; replay on the run's mesh shape"
        )
    return {d: by_pos[c] for d, c in logged.items()}


def evidence_for(pairing: Mapping[int, int], tolerance: Optional[float]) -> Evidence:
    """Bit-exact when every device sits where it sat in the run; per-shard otherwise; tolerance when asked."""
    if tolerance is not None:
        return Evidence.TOLERANCE
    return Evidence.BIT_EXACT if all(a == b for a, b in pairing.items()) else Evidence.PER_SHARD


def f32(bits: int) -> float:
    """The float32 whose bit pattern is ``bits`` (an unsigned 32-bit int)."""
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def close(a_bits: int, b_bits: int, rtol: float) -> bool:
    """float32 ``a`` and ``b`` (given as bits) agree within ``rtol`` (module formula); NaN equals only NaN."""
    if a_bits == b_bits:
        return True
    a, b = f32(a_bits), f32(b_bits)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b))


@dataclasses.dataclass(frozen=True)
class StepDiff:
    """How one replayed step compares with the log.

    Attributes:
      step: global step.
      batch_match, loss_match, grad_norm_match: bit-for-bit (or, in tolerance mode, the
        loss and norm within tolerance).
      leaves: leaf paths whose reduced fingerprint or NaN/Inf counts differ (sorted).
      devices: ``{logged device id: sorted leaf paths}`` whose contribution differs.
      num_devices: devices compared.
      evidence: the comparison mode.
      loss: ``(logged, replayed)`` float32 values, for reports.
      grad_norm: ``(logged, replayed)`` float32 values.
      sends: ``{logged device id: send sites}`` whose all-to-all send fingerprint differs (expert
        parallelism; ``replay.verify.localize.send_differences``).
      localization: where the step's error first appeared, when the log has send fingerprints
        (``replay.verify.localize.localize``); its producers, not every differing device, are the
        step's suspects. None for a run without sends (each device's contribution is its own).
    """

    step: int
    batch_match: bool
    loss_match: bool
    grad_norm_match: bool
    leaves: tuple[str, ...]
    devices: Mapping[int, tuple[str, ...]]
    num_devices: int
    evidence: Evidence
    loss: tuple[float, float]
    grad_norm: tuple[float, float]
    sends: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    localization: Optional[Localization] = None

    @property
    def ok(self) -> bool:
        return self.kind is None

    @property
    def suspects(self) -> tuple[int, ...]:
        """The logged devices a divergence at this step points at: the producers of the first
        divergent buffer when localized, else every device whose contribution differs."""
        if self.localization is not None:
            return self.localization.producers
        return tuple(sorted(self.devices))

    @property
    def kind(self) -> Optional[DivergenceKind]:
        """What differs, most telling first (None: the step was reproduced)."""
        if not self.batch_match:
            return DivergenceKind.DATA
        if self.evidence is Evidence.TOLERANCE:
            return None if self.loss_match and self.grad_norm_match else DivergenceKind.TOLERANCE
        if self.localization is not None and self.localization.links:
            return DivergenceKind.LINK
        if self.devices or self.sends:
            return DivergenceKind.ALL_DEVICES if len(self.suspects) >= self.num_devices else DivergenceKind.DEVICE
        if self.leaves or not self.loss_match or not self.grad_norm_match:
            return DivergenceKind.GLOBAL
        return None

    def divergence(self) -> Optional[Divergence]:
        kind = self.kind
        if kind is None:
            return None
        leaves = set(self.leaves)
        for ls in self.devices.values():
            leaves.update(ls)
        loc = self.localization
        return Divergence(self.step, kind, self.suspects, tuple(sorted(leaves)),
                          site=None if loc is None else loc.site, reached=() if loc is None else loc.reached,
                          site_label=None if loc is None else loc.label(),
                          links=() if loc is None else loc.links)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "ok": self.ok,
            "kind": None if self.kind is None else self.kind.value,
            "batch_match": self.batch_match,
            "loss_match": self.loss_match,
            "grad_norm_match": self.grad_norm_match,
            "leaves": list(self.leaves),
            "devices": {str(d): list(ls) for d, ls in sorted(self.devices.items())},
            **({"sends": {str(d): list(ss) for d, ss in sorted(self.sends.items())}} if self.sends else {}),
            **({"localization": self.localization.to_dict()} if self.localization is not None else {}),
            "evidence": self.evidence.value,
            "loss": {"logged": _jsonable(self.loss[0]), "replayed": _jsonable(self.loss[1])},
            "grad_norm": {"logged": _jsonable(self.grad_norm[0]), "replayed": _jsonable(self.grad_norm[1])},
        }


def _jsonable(x: float) -> Any:
    return x if math.isfinite(x) else repr(x)


def _leaf_differs(a: Mapping[str, int], b: Optional[Mapping[str, int]]) -> bool:
    if b is None:
        return True
    return any(int(a.get(k, 0)) != int(b.get(k, 0)) for k in set(a) | set(b))


def compare_step(
    logged: StepFingerprints,
    replayed: StepFingerprints,
    pairing: Mapping[int, int],
    tolerance: Optional[float] = None,
) -> StepDiff:
    """Compares one step's logged and replayed fingerprints.

    Args:
      logged, replayed: the same step's fingerprints.
      pairing: ``{logged device id: replay device id}`` (:func:`pair_devices`).
      tolerance: relative tolerance for the tolerance mode; None for bit-for-bit.

    Raises:
      ValueError: the steps differ, or ``tolerance`` is not in ``(0, 1)``.
    """
    if logged.step != replayed.step:
        raise ValueError(f"comparing logged step {logged.step} with replayed step {replayed.step}")
    if tolerance is not None and not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    evidence = evidence_for(pairing, tolerance)
    if evidence is Evidence.TOLERANCE:
        loss_ok = close(logged.loss_bits, replayed.loss_bits, tolerance)
        norm_ok = close(logged.grad_norm_bits, replayed.grad_norm_bits, tolerance)
    else:
        loss_ok = logged.loss_bits == replayed.loss_bits
        norm_ok = logged.grad_norm_bits == replayed.grad_norm_bits
    leaves = tuple(
        sorted(p for p in set(logged.leaves) | set(replayed.leaves)
               if _leaf_differs(logged.leaves.get(p, {}), replayed.leaves.get(p)))
    )
    devices: dict[int, tuple[str, ...]] = {}
    if evidence is not Evidence.TOLERANCE:
        for ldev, rdev in pairing.items():
            la = logged.devices.get(ldev, {})
            ra = replayed.devices.get(rdev, {})
            bad = tuple(sorted(p for p in set(la) | set(ra) if la.get(p) != ra.get(p)))
            if bad:
                devices[ldev] = bad
    sends = send_differences(logged, replayed, pairing) if evidence is not Evidence.TOLERANCE else {}
    receives = receive_differences(logged, replayed, pairing) if evidence is not Evidence.TOLERANCE else {}
    loc = localize(logged, sends, devices, receives) if logged.send_sites and evidence is not Evidence.TOLERANCE \
        else None
    return StepDiff(
        step=logged.step,
        batch_match=logged.batch_hash == replayed.batch_hash,
        loss_match=loss_ok,
        grad_norm_match=norm_ok,
        leaves=() if evidence is Evidence.TOLERANCE else leaves,
        devices=devices,
        num_devices=len(pairing),
        evidence=evidence,
        loss=(f32(logged.loss_bits), f32(replayed.loss_bits)),
        grad_norm=(f32(logged.grad_norm_bits), f32(replayed.grad_norm_bits)),
        sends=sends,
        localization=loc,
    )


def first_divergence(diffs: Sequence[StepDiff]) -> Optional[Divergence]:
    """The first non-reproduced step of ``diffs`` (in step order), or None."""
    for d in sorted(diffs, key=lambda d: d.step):
        div = d.divergence()
        if div is not None:
            return div
    return None


def positional(fp: StepFingerprints, coords: Mapping[int, Position]) -> dict[str, Any]:
    """A step's fingerprints with device ids replaced by mesh positions: what two replays on
    different devices must agree on."""
    return {
        "step": fp.step,
        "loss_bits": int(fp.loss_bits),
        "grad_norm_bits": int(fp.grad_norm_bits),
        "batch_hash": fp.batch_hash,
        "leaves": {p: {k: int(v) for k, v in sorted(fp.leaves[p].items())} for p in sorted(fp.leaves)},
        "devices": {
            position_label(coords[d]): {p: int(v) for p, v in sorted(fp.devices[d].items())}
            for d in sorted(fp.devices, key=lambda d: coords[d])
        },
        **({"sends": {position_label(coords[d]): [int(v) for v in fp.sends[d]]
                      for d in sorted(fp.sends, key=lambda d: coords[d])}, "send_sites": list(fp.send_sites)}
           if fp.send_sites else {}),
        **({"recvs": {position_label(coords[d]): [[int(v) for v in parts] for parts in fp.recvs[d]]
                      for d in sorted(fp.recvs, key=lambda d: coords[d])}} if fp.recvs else {}),
    }


def signature(fps: Sequence[StepFingerprints], coords: Mapping[int, Position]) -> str:
    """sha256 of the positional form of a replay's steps: equal iff the replays agree bit for bit."""
    h = hashlib.sha256()
    for fp in sorted(fps, key=lambda f: f.step):
        h.update(json.dumps(positional(fp, coords), sort_keys=True).encode())
    return h.hexdigest()


def disagreement(
    a: Sequence[StepFingerprints], b: Sequence[StepFingerprints],
    coords_a: Mapping[int, Position], coords_b: Mapping[int, Position],
) -> Optional[dict[str, Any]]:
    """Where two replays first disagree: ``{"step", "positions", "devices_a", "devices_b", "suspects"}``
    or None.

    ``positions`` are the mesh positions whose contributions differ; ``devices_a``/``devices_b``
    the replay devices at those positions (one of each pair computed wrongly); ``suspects`` the
    devices found on both sides (with rotated placements a faulty replay device shows up at two
    positions, once in each replay).
    """
    bmap = {f.step: f for f in b}
    inv_a = {position_label(c): d for d, c in coords_a.items()}
    inv_b = {position_label(c): d for d, c in coords_b.items()}
    for fa in sorted(a, key=lambda f: f.step):
        fb = bmap.get(fa.step)
        if fb is None:
            continue
        pa, pb = positional(fa, coords_a), positional(fb, coords_b)
        if pa == pb:
            continue
        pos = sorted(k for k in set(pa["devices"]) | set(pb["devices"])
                     if pa["devices"].get(k) != pb["devices"].get(k)
                     or pa.get("sends", {}).get(k) != pb.get("sends", {}).get(k))
        devices_a = [inv_a.get(k) for k in pos]
        devices_b = [inv_b.get(k) for k in pos]
        return {
            "step": fa.step,
            "positions": pos,
            "devices_a": devices_a,
            "devices_b": devices_b,
            # A device on both sides (at different positions) is the likeliest culprit.
            "suspects": sorted(set(devices_a) & set(devices_b) - {None}),
        }
    return None
