"""Localization through the all-to-alls: which device computed wrong, when its error spread.

Under expert parallelism a wrong number computed on device ``d`` reaches, in the same step, every
device that exchanged tokens with ``d``: an error in ``d``'s expert output goes back to every device
that sent it tokens, and from there into their attention and router gradients and, through the
backward all-to-alls, into the other experts' weight gradients. "The device whose gradient
fingerprint differs" is then the whole expert group. What still names ``d`` is the data flow
(DESIGN.md, "Expert parallelism and localization"): within a step devices exchange values only at
the all-to-alls, so the first buffer, in program order, that differs between the log and a replay
was produced by the device that computed wrong, from inputs that were still right.

The trainer logs, per step and device, the fingerprint of what the device *sent* at each send site
(``replay.run.protocol.StepFingerprints.sends``; sites in program order, ``send_site``)::

    forward   layer 0: dispatch, combine;  layer 1: dispatch, combine;  ...
    backward  layer L-1: combine (transposed), dispatch (transposed);  ...;  layer 0: ...
    then      each device's finished local gradient (StepFingerprints.devices)

:func:`localize` walks that order and stops at the first site where some device's send differs
from the replay's (devices matched by mesh position): those devices are the *producers*, the
culprits; every other device that differs at the step is *reached* (it differs only through what
it received). When no send differs, the producers are the devices whose local gradient differs: an
error the device's own backward pass made in a gradient that no all-to-all carries (an expert
weight's gradient, or a flip after all communication). At the first divergent site the producers
are one device for one fault: each device's sends there depend only on what it received at the
sites before, which matched. Two producers at one site mean two faults, or software that is not
deterministic; the verdict then names both, never one of them.

Transit: each device also fingerprints each part of what it *received* at each site
(``StepFingerprints.recvs``). At a site, sends come before receives: when every send there matches the
replay but a part some device received does not, the buffer was sent right and received wrong, and
the localization names the *link*, sender -> receiver (:attr:`Localization.links`), and neither chip
alone. So a localization is one of three findings (:attr:`Localization.finding`):

* ``"link"``: sent right, received wrong: the link between the two devices (or either end's network
  hardware) corrupted it;
* ``"sent"``: received right (every receive before matched) but sent wrong: the sending device
  computed wrong;
* ``"local_gradient"``: nothing exchanged differs: the device's own gradient, which no all-to-all
  carries.

A log without receive fingerprints (older runs) names a transit fault as the receiver, at its next
send. Pure: no JAX, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from replay.run.protocol import StepFingerprints, parse_send_site

LOCAL_GRADIENT = "local_gradient"


@dataclasses.dataclass(frozen=True)
class Localization:
    """Where one step's error first appeared.

    Attributes:
      site: the first divergent send site (``"layer1.combine.forward"``) or ``"local_gradient"``.
      producers: logged device ids whose buffer differs at ``site`` (sorted): who computed wrong.
      reached: every logged device with a differing send or local gradient at the step (sorted).
      leaves: at a ``local_gradient`` site, the producers' differing leaves (sorted); else empty.
    """

    site: str
    producers: tuple[int, ...]
    reached: tuple[int, ...]
    leaves: tuple[str, ...] = ()
    links: tuple[tuple[int, int], ...] = ()

    @property
    def finding(self) -> str:
        """``"link"`` (sent right, received wrong), ``"sent"`` (a device sent wrong from what it received
        right) or ``"local_gradient"`` (module docstring)."""
        if self.links:
            return "link"
        return LOCAL_GRADIENT if self.site == LOCAL_GRADIENT else "sent"

    @property
    def parts(self) -> Optional[tuple[int, str, str]]:
        """``(layer, collective, direction)`` of a send site, None for the local gradient."""
        return None if self.site == LOCAL_GRADIENT else parse_send_site(self.site)

    @property
    def layer(self) -> Optional[int]:
        """The send site's layer, or the layer of the differing leaves when they share one."""
        if self.parts is not None:
            return self.parts[0]
        layers = {_leaf_layer(p) for p in self.leaves}
        return layers.pop() if len(layers) == 1 else None

    def label(self) -> str:
        """For humans: ``"the combine all-to-all of layer 1 (forward pass)"``; a link's says so."""
        if self.links:
            pairs = ", ".join(f"{a} -> {b}" for a, b in self.links)
            layer, collective, direction = self.parts
            return (f"the link {pairs} at the {collective} all-to-all of layer {layer} ({direction} pass): "
                    "sent right, received wrong")
        if self.parts is None:
            what = f" ({', '.join(self.leaves[:3])}{' ...' if len(self.leaves) > 3 else ''})" if self.leaves else ""
            return f"the local gradient{what}, which no all-to-all carries"
        layer, collective, direction = self.parts
        return f"the {collective} all-to-all of layer {layer} ({direction} pass)"

    def to_dict(self) -> dict[str, Any]:
        return {**describe_site(self.site, self.leaves), "producers": list(self.producers),
                "reached": list(self.reached), "leaves": list(self.leaves), "finding": self.finding,
                "links": [list(x) for x in self.links], **({"label": self.label()} if self.links else {})}


def describe_site(site: Optional[str], leaves: tuple[str, ...] = ()) -> Optional[dict[str, Any]]:
    """``{"site", "layer", "collective", "direction", "label"}`` of a site name (None for None);
    ``leaves``: the differing leaves, which give a local-gradient site its layer."""
    if site is None:
        return None
    loc = Localization(site=site, producers=(), reached=(), leaves=tuple(leaves) if site == LOCAL_GRADIENT else ())
    parts = loc.parts
    return {"site": site, "layer": loc.layer, "collective": None if parts is None else parts[1],
            "direction": None if parts is None else parts[2], "label": loc.label()}


def _leaf_layer(path: str) -> Optional[int]:
    head = "['layers']["
    if path.startswith(head) and "]" in path[len(head):]:
        num = path[len(head):].split("]", 1)[0]
        return int(num) if num.isdigit() else None
    return None


def send_differences(logged: StepFingerprints, replayed: StepFingerprints,
                     pairing: Mapping[int, int]) -> dict[int, tuple[str, ...]]:
    """Per logged device, the send sites (in program order) where its fingerprint differs from that
    of the replay device at its mesh position; only devices with a difference. Empty when either
    side logged no sends, or when their send sites differ (not comparable)."""
    sites = tuple(logged.send_sites)
    if not sites or sites != tuple(replayed.send_sites):
        return {}
    out = {}
    for ldev, rdev in pairing.items():
        a, b = logged.sends.get(ldev), replayed.sends.get(rdev)
        if a is None or b is None or len(a) != len(sites) or len(b) != len(sites):
            bad = sites  # a device whose sends are missing on one side differs everywhere
        else:
            bad = tuple(s for s, x, y in zip(sites, a, b) if int(x) != int(y))
        if bad:
            out[ldev] = bad
    return out


def receive_differences(logged: StepFingerprints, replayed: StepFingerprints,
                        pairing: Mapping[int, int]) -> dict[int, dict[str, tuple[int, ...]]]:
    """Per logged device, per send site, the parts (the sending device's index on the expert axis) of
    what it received that differ from the replay device's at its mesh position; only devices with a
    difference. Empty when either side logged no receives or their sites differ."""
    sites = tuple(logged.send_sites)
    if not logged.recvs or not replayed.recvs or sites != tuple(replayed.send_sites):
        return {}
    out: dict[int, dict[str, tuple[int, ...]]] = {}
    for ldev, rdev in pairing.items():
        a, b = logged.recvs.get(ldev), replayed.recvs.get(rdev)
        if a is None or b is None or len(a) != len(sites) or len(b) != len(sites):
            continue  # no receive record on one side: nothing to say about links (sends still judge)
        bad = {s: tuple(i for i, (x, y) in enumerate(zip(pa, pb)) if int(x) != int(y))
               for s, pa, pb in zip(sites, a, b) if tuple(pa) != tuple(pb)}
        if bad:
            out[ldev] = bad
    return out


def sender_of(logged: StepFingerprints, receiver: int, part: int, axis: str = "expert") -> Optional[int]:
    """The logged device that sent part ``part`` of what ``receiver`` received: the device at the
    receiver's mesh position with ``axis`` = ``part`` (``device_coords``), or None when not logged."""
    coords = logged.device_coords
    mine = coords.get(receiver)
    if not mine or axis not in mine:
        return None
    want = {**dict(mine), axis: int(part)}
    for dev, c in coords.items():
        if dict(c) == want:
            return int(dev)
    return None


def localize(logged: StepFingerprints, sends: Mapping[int, tuple[str, ...]],
             gradients: Mapping[int, tuple[str, ...]],
             receives: Optional[Mapping[int, Mapping[str, tuple[int, ...]]]] = None) -> Optional[Localization]:
    """The first divergent buffer of one step, in program order (module docstring).

    Args:
      logged: the step as logged (its ``send_sites`` give the program order).
      sends: :func:`send_differences` of the step.
      gradients: per logged device, its local-gradient leaves that differ
        (``replay.verify.compare.StepDiff.devices``).
      receives: :func:`receive_differences` of the step (None or empty: no link can be named).

    Returns:
      the :class:`Localization`, or None when neither a send, a receive nor a local gradient differs.
    """
    receives = receives or {}
    reached = tuple(sorted(set(sends) | set(gradients) | set(receives)))
    for site in logged.send_sites:
        producers = tuple(sorted(d for d, bad in sends.items() if site in bad))
        if producers:
            return Localization(site=site, producers=producers, reached=reached)
        links = sorted({(sender_of(logged, r, p), r) for r, per in receives.items() for p in per.get(site, ())},
                       key=lambda x: (x[0] is None, x))
        if links:
            if any(a is None for a, _ in links):  # no mesh positions logged: the receivers, as before
                return Localization(site=site, producers=tuple(sorted({b for _, b in links})), reached=reached)
            return Localization(site=site, producers=(), reached=reached, links=tuple(links))
    if gradients:
        leaves = tuple(sorted({p for ls in gradients.values() for p in ls}))
        return Localization(site=LOCAL_GRADIENT, producers=tuple(sorted(gradients)), reached=reached, leaves=leaves)
    return None
