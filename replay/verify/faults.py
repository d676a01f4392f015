"""The fault model as data, and one campaign drill: plant a fault where hardware fails, count what happened.

A :class:`Fault` is ``(site, stage, bit or scale, element, persistence)`` on one device (issue 27):

    site          replay.run.protocol.FAULT_SITES: inside the expert FFN matmuls (forward, activation and
                  weight gradient), inside attention (QK^T, softmax output, PV), the router logits, the
                  received buffer of an all-to-all (transit, forward and backward), the host batch
    stage         forward | backward | transit | data | update  (SITE_STAGE: follows from the site)
    bit or scale  a bit of the element (BIT_CLASSES: low/mid/high mantissa, exponent, sign), or the element
                  times a factor (SCALES: 1 + 1e-6, 1 + 1e-3, 1 + 1e-1, x2), or set to a value (NaN, Inf)
    element       a flat index into the device's buffer at that site (``trainer.activation_shapes``)
    persistence   once (one step) | every (every step from `start`) | intermittent (1 step in k from `start`)

Every fault is planted through the trainer's traced fault input, so the program is the one replay
compiles: a drill restores a checkpoint once (cached), trains the short segment with the fault on the
run's own mesh, and judges it. :func:`run_fault_drill` counts each drill as one of

    masked             no fingerprint of any device changed (sends, receives, local gradients, reduced
                       gradient, loss, norm, batch) AND the state after the segment is bit-identical to
                       the clean run's (shown, element by element, not assumed)
    right_alone        convicted: the faulty device alone (a transit fault: the link sender -> receiver
                       alone; a host-batch fault: the data, no device), at the fault's first step
    right_plus_others  convicted: the right device or link, and others with it
    wrong              convicted: someone else (or the right one at another step)
    missed             not masked, and no conviction (acquitted or ambiguous)

and separately whether each detection layer saw it: screening (``replay scan`` on the drilled logs),
the canary (a persistent fault in the chip's arithmetic fires in the canary program too) and range
replay (any divergence). Pure data and bookkeeping at the top; :func:`run_fault_drill` needs a
``replay.verify.engine.Session`` (and through it, the run's trainer: never imported here).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from replay.run.protocol import FAULT_SITES, TRANSIT_SITES, FaultSpec

# site -> stage (a later site, e.g. issue 28's optimizer update, is one more entry here)
SITE_STAGE = {
    "local_gradient": "backward", "expert_forward": "forward", "expert_backward": "backward",
    "attention": "forward",
    "ffn_up": "forward", "ffn_down": "forward", "ffn_up_grad_input": "backward", "ffn_up_grad_weight": "backward",
    "ffn_down_grad_input": "backward", "ffn_down_grad_weight": "backward",
    "attn_scores": "forward", "attn_probs": "forward", "attn_pv": "forward", "router_logits": "forward",
    "transit_dispatch": "transit", "transit_combine": "transit", "transit_dispatch_grad": "transit",
    "transit_combine_grad": "transit", "host_batch": "data", "optimizer_update": "update",
}
CAMPAIGN_SITES = tuple(s for s in SITE_STAGE if s not in ("local_gradient", "expert_forward", "expert_backward",
                                                          "attention"))
"""The campaign's sites: none of them is a buffer the checker fingerprints next. ``optimizer_update``
(one device's copy of a leaf of the updated state: a parameter or an Adam moment) has its own judge: its
step's gradients are right, so range replay of it is the wrong test; the state record of the next
checkpoint save (every replica of every leaf fingerprinted) and ``replay certify``'s verdict on that
checkpoint are the right one (:func:`run_state_drill`)."""
JUDGE = {"optimizer_update": "certify"}
"""Sites judged by something other than range replay (the rest: ``range``)."""

BIT_CLASSES = {"low_mantissa": (0, 8), "mid_mantissa": (8, 16), "high_mantissa": (16, 23), "exponent": (23, 31),
               "sign": (31, 32)}
"""float32 bit classes: ``name -> [lo, hi)`` bit positions (0 = the lowest mantissa bit)."""
SCALES = {"scale_1e-6": 1 + 1e-6, "scale_1e-3": 1 + 1e-3, "scale_1e-1": 1 + 1e-1, "scale_x2": 2.0}
"""Relative-error classes: ``name -> factor`` the element is multiplied by."""
VALUES = {"nan": float("nan"), "inf": float("inf")}
MAGNITUDES = tuple(BIT_CLASSES) + tuple(SCALES)
"""The campaign matrix's columns."""
PERSISTENCES = ("once", "every", "intermittent")
OUTCOMES = ("masked", "right_alone", "right_plus_others", "wrong", "missed")


class FaultModelError(ValueError):
    """A fault names an unknown site, class or persistence, or a site the trainer cannot plant."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planted fault (module docstring).

    Attributes:
      site: a :data:`replay.run.protocol.FAULT_SITES` name; stage follows (:attr:`stage`).
      device: ``jax.Device.id`` of the faulty device (a transit fault: the receiver).
      start: the first global step it fires at.
      element: flat index into the device's buffer at ``site``.
      layer: the MoE layer (sites that take one), else None.
      leaf: a leaf path (``local_gradient``, ``expert_backward``), else ``""``.
      bit: the bit flipped (mode ``flip``); magnitude: its class (:data:`MAGNITUDES`, ``"nan"``, ``"inf"``).
      mode, value: ``replay.run.protocol.FaultSpec.mode`` / ``value`` (flip: value unused).
      persistence: ``once``, ``every`` (each step from ``start``), ``intermittent`` (one step in ``k``).
      k: the intermittent period, >= 2.
    """

    site: str
    device: int
    start: int
    element: int
    layer: Optional[int] = None
    leaf: str = ""
    bit: int = 0
    magnitude: str = "low_mantissa"
    mode: str = "flip"
    value: float = 0.0
    persistence: str = "once"
    k: int = 2

    def __post_init__(self):
        if self.site not in FAULT_SITES:
            raise FaultModelError(f"site {self.site!r}: must be one of {', '.join(FAULT_SITES)}")
        if self.persistence not in PERSISTENCES:
            raise FaultModelError(f"persistence {self.persistence!r}: must be one of {', '.join(PERSISTENCES)}")
        if self.persistence == "intermittent" and self.k < 2:
            raise FaultModelError(f"an intermittent fault fires one step in k >= 2, got k={self.k}")

    @property
    def stage(self) -> str:
        return SITE_STAGE.get(self.site, "forward")

    def steps(self, stop: int) -> list[int]:
        """The steps it fires at, before ``stop``."""
        if self.persistence == "once":
            return [self.start] if self.start < stop else []
        every = 1 if self.persistence == "every" else self.k
        return list(range(self.start, stop, every))

    def specs(self, stop: int) -> list[FaultSpec]:
        """The trainer's :class:`FaultSpec` per firing step before ``stop`` (a list, one per step)."""
        return [FaultSpec(step=s, device_id=self.device, leaf=self.leaf, element=self.element, bit=self.bit,
                          where=self.site, layer=self.layer, mode=self.mode, value=self.value)
                for s in self.steps(stop)]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stage"] = self.stage
        d["value"] = d["value"] if math.isfinite(d["value"]) else repr(d["value"])
        return d


def magnitude_fields(magnitude: str, rng: random.Random, bits: int = 32) -> dict[str, Any]:
    """``{"bit", "mode", "value"}`` of a magnitude class: a bit drawn from the class's range (16-bit
    dtypes: the classes scaled to their width), a scale's factor, or a set value (``nan``, ``inf``).

    Raises:
      FaultModelError: an unknown class.
    """
    if magnitude in BIT_CLASSES:
        lo, hi = BIT_CLASSES[magnitude]
        if bits != 32:  # bfloat16: 7 mantissa bits, 8 exponent bits, sign 15
            lo, hi = {"low_mantissa": (0, 3), "mid_mantissa": (3, 5), "high_mantissa": (5, 7),
                      "exponent": (7, 15), "sign": (15, 16)}[magnitude]
        return {"bit": rng.randrange(lo, hi), "mode": "flip", "value": 0.0}
    if magnitude in SCALES:
        return {"bit": 0, "mode": "scale", "value": float(SCALES[magnitude])}
    if magnitude in VALUES:
        return {"bit": 0, "mode": "set", "value": VALUES[magnitude]}
    raise FaultModelError(f"magnitude {magnitude!r}: must be one of {', '.join(MAGNITUDES + tuple(VALUES))}")


def draw_fault(session: Any, rng: random.Random, site: str, magnitude: str, persistence: str, *,
               start: Optional[int] = None, device: Optional[int] = None, k: int = 2) -> Fault:
    """A fault at ``site`` with every other field drawn from ``rng``: a step with a checkpoint at or
    before it (default: a checkpoint step, so the drill replays one step), a device of the run's mesh, a
    layer, an element drawn uniformly from the whole buffer (padding, masked and dropped slots
    included: what they mask is counted, and shown), and the bit, factor or value of ``magnitude``.

    Raises:
      FaultModelError: the trainer cannot plant ``site`` (no ``activation_shapes``), or a scale or set
        at the int32 host batch.
    """
    trainer, setup = session.setup.trainer, session.setup
    shapes = getattr(trainer, "activation_shapes", None)
    if shapes is None:
        raise FaultModelError(f"site {site}: the run's trainer ({type(trainer).__name__}) names no buffers inside "
                              "its computation (activation_shapes)")
    if site == "host_batch" and magnitude not in BIT_CLASSES:
        raise FaultModelError("host_batch: the batch is int32 tokens; only bit classes apply")
    if site == "optimizer_update":
        return _draw_state_fault(session, rng, magnitude, persistence, start=start, device=device, k=k)
    ids = list(setup.run_device_ids)
    device = rng.choice(ids) if device is None else device
    if start is None:
        first, stop = session.run.logged_steps
        start = rng.choice([c for c in session.run.checkpoints if first <= c < stop - 1])
    batch = session.numpy_batch(start)
    rows, seq_len = (int(n) for n in batch["inputs"].shape)
    shape = shapes(dict(zip(setup.axis_names, setup.shape)), rows, seq_len)
    if site not in shape:
        raise FaultModelError(f"site {site}: the trainer plants no fault there on this run (buffers: {sorted(shape)})")
    n_layers = int(getattr(getattr(trainer, "model", None), "n_layers", 1) or 1)
    layer = None if site == "host_batch" else rng.randrange(n_layers)
    element = rng.randrange(int(np.prod(shape[site])))
    bits = 32 if site in ("attn_scores", "router_logits", "host_batch") else \
        8 * np.dtype(trainer.leaf_dtypes[0]).itemsize
    return Fault(site=site, device=device, start=start, element=element, layer=layer,
                 magnitude=magnitude, persistence=persistence, k=k, **magnitude_fields(magnitude, rng, bits))


def _draw_state_fault(session: Any, rng: random.Random, magnitude: str, persistence: str, *,
                      start: Optional[int], device: Optional[int], k: int) -> Fault:
    """An ``optimizer_update`` fault (:func:`draw_fault`): a floating leaf of the train state (parameters,
    Adam moments, the router bias), an element of the device's local copy of it, a step of a checkpoint
    segment that ends at a save (the fault fires after that step's update)."""
    import jax

    trainer, setup = session.setup.trainer, session.setup
    if not hasattr(trainer, "state_leaf_paths"):
        raise FaultModelError(f"site optimizer_update: the run's trainer ({type(trainer).__name__}) names no leaves "
                              "of its train state (state_leaf_paths)")
    device = rng.choice(list(setup.run_device_ids)) if device is None else device
    if start is None:
        first, stop = session.run.logged_steps
        saves = [c for c in session.run.checkpoints if first < c <= stop]
        b = rng.choice(saves)
        start = rng.randrange(max(c for c in session.run.checkpoints if c < b), b)
    dtypes = [np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(trainer._abstract_state_shapes())]
    sizes = trainer.local_state_sizes(session.mesh(session.home_assignment()))
    leaves = [i for i, d in enumerate(dtypes) if d.kind == "f"]
    i = rng.choice(leaves)
    return Fault(site="optimizer_update", device=device, start=start, element=rng.randrange(sizes[i]),
                 leaf=trainer.state_leaf_paths[i], magnitude=magnitude, persistence=persistence, k=k,
                 **magnitude_fields(magnitude, rng, 8 * dtypes[i].itemsize))


def expected_culprit(session: Any, fault: Fault) -> dict[str, Any]:
    """What a right verdict names: ``{"kind": "device", "devices": (d,)}``, ``{"kind": "link", "links":
    ((sender, receiver),)}`` (transit: the sender is the device whose part of the received buffer holds
    the element) or ``{"kind": "data"}`` (host batch: the batch differs, no device)."""
    if fault.site == "host_batch":
        return {"kind": "data"}
    if fault.site in TRANSIT_SITES:
        setup = session.setup
        coords = {int(d): dict(c) for d, c in (session.run.mesh.get("device_coords") or {}).items()}
        batch = session.numpy_batch(fault.start)
        rows, seq_len = (int(n) for n in batch["inputs"].shape)
        spec = fault.specs(fault.start + 1)[0]
        link = setup.trainer.link_of(dict(zip(setup.axis_names, setup.shape)), rows, seq_len, spec, coords)
        return {"kind": "link", "links": (link,)}
    return {"kind": "device", "devices": (fault.device,)}


def classify(decision: Any, expected: Mapping[str, Any], step: int) -> str:
    """``right_alone`` / ``right_plus_others`` / ``wrong`` / ``missed`` of a range replay's decision
    against :func:`expected_culprit` (a verdict at another step is wrong)."""
    from replay.run.codes import Verdict
    from replay.verify.verdict import Cause

    if expected["kind"] == "data":
        if decision.cause is Cause.DATA_ORDER:
            return "right_alone" if decision.step == step else "wrong"
        return "wrong" if decision.verdict is Verdict.CONVICTED else "missed"
    if decision.verdict is not Verdict.CONVICTED:
        return "missed"
    if decision.step != step:
        return "wrong"
    named = tuple(decision.links) if expected["kind"] == "link" else tuple(decision.devices)
    want = tuple(expected["links"] if expected["kind"] == "link" else expected["devices"])
    if named == want:
        return "right_alone"
    return "right_plus_others" if set(want) <= set(named) else "wrong"


def states_identical(a: Any, b: Any) -> bool:
    """Whether two train states are bit-identical, every leaf, element by element, in every device's copy
    (a replicated leaf is compared on each device that holds it: one device's copy can differ, the copy
    ``jax.device_get`` reads need not)."""
    import jax

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        sx = {(s.device.id, str(s.index)): s for s in getattr(x, "addressable_shards", [])}
        sy = {(s.device.id, str(s.index)): s for s in getattr(y, "addressable_shards", [])}
        if not sx or sx.keys() != sy.keys():
            pairs = [(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))]
        else:
            pairs = [(np.asarray(sx[k].data), np.asarray(sy[k].data)) for k in sorted(sx)]
        if any(p.tobytes() != q.tobytes() for p, q in pairs):
            return False
    return True


def fingerprints_identical(a: Any, b: Any) -> bool:
    """Every bit-compared field of two steps' fingerprints, sends and receives included."""
    return a.bits_equal(b) and dict(a.sends) == dict(b.sends) and dict(a.recvs) == dict(b.recvs)


@dataclasses.dataclass
class DrillContext:
    """What many drills on one run share: the run's clean logs and the clean state after each segment
    (computed once), the screening baseline, the canary's batch and weights."""

    session: Any
    clean_states: dict = dataclasses.field(default_factory=dict)
    clean_scans: dict = dataclasses.field(default_factory=dict)
    canary: Optional[tuple] = None
    signals: Optional[dict] = None  # the run's signals.jsonl, read once
    scan: Optional[Callable[..., Any]] = None  # the screening judge (replay.screen.scan.scan_run), given by the
    #                                            caller: verify/ does not import screen/

    def run_signals(self) -> dict[int, Any]:
        from replay.run.protocol import read_signals

        if self.signals is None:
            self.signals = read_signals(self.session.run.run_dir)
        return self.signals

    def clean_state(self, checkpoint: int, stop: int) -> Any:
        key = (checkpoint, stop)
        if key not in self.clean_states:
            home = self.session.home_assignment()
            _, _, kept = self.session.run_steps(home, checkpoint, stop, keep_state_at=stop - 1)
            self.clean_states[key] = kept[stop - 1]
        return self.clean_states[key]


def _scan_findings(scan_run: Callable[..., Any], session: Any, log: Mapping[int, Any],
                   signals: Mapping[int, Any]) -> tuple[set, list]:
    """``(findings, device suspects)`` of ``scan_run`` (``replay scan``'s) over the run with ``log`` and
    ``signals`` in place of its own (``(kind, subject, check, first_step)`` per finding)."""
    run = dataclasses.replace(session.run, fingerprints=dict(log))
    rep = scan_run(run, screening_logs=(dict(signals), None))
    found = {(s.kind, s.subject, e.check, e.first_step) for s in rep.suspects for e in s.evidence}
    return found, rep.suspect_devices


def run_fault_drill(ctx: DrillContext, fault: Fault, *, segment: int = 1, canary: bool = True,
                    screening: bool = True, replays: int = 2) -> dict[str, Any]:
    """One campaign drill (module docstring) on ``ctx.session``'s run.

    The segment ``[c, fault.start + segment)`` from the checkpoint ``c`` at or before the fault's first
    step is trained with the fault on the run's own mesh (a persistent fault fires at each of its steps
    in it); a range replay of ``[fault.start, fault.start + segment)`` on ``replays`` independent
    placements judges it against that log, and a right verdict names the first step whose fingerprints
    the fault changed (``first_changed_step``: a persistent fault may change nothing at its first step).

    Returns:
      ``{"fault", "outcome" (OUTCOMES), "shown_identical" (masked: the state compared bit for bit),
      "detected": {"screening", "canary", "range"}, "verdict", "cause", "devices", "links", "site",
      "finding", "expected", "step", "steps_trained"}``; ``canary`` is None where no canary can see the
      fault (a one-step fault is over before the next canary; transit and data faults never enter the
      canary's program).
    """
    from replay.verify.engine import replay_range
    from replay.verify.verdict import Cause

    if JUDGE.get(fault.site) == "certify":
        return run_state_drill(ctx, fault)
    session = ctx.session
    run = session.run
    ckpt = run.checkpoint_for(fault.start)
    stop = min(fault.start + segment, run.logged_steps[1])
    home = session.home_assignment()
    specs = fault.specs(stop)
    fps, _, kept = session.run_steps(home, ckpt, stop, fault=specs, keep_state_at=stop - 1)
    log = dict(run.fingerprints)
    for fp in fps:
        log[fp.step] = fp
    same_fp = all(fingerprints_identical(fp, run.fingerprints[fp.step]) for fp in fps)
    expected = expected_culprit(session, fault)
    out: dict[str, Any] = {"fault": fault.to_dict(), "expected": {k: [list(x) if isinstance(x, tuple) else x
                                                                       for x in v] if isinstance(v, tuple) else v
                                                                   for k, v in expected.items()},
                           "steps_trained": len(fps), "shown_identical": None}
    if same_fp:
        identical = states_identical(kept[stop - 1], ctx.clean_state(ckpt, stop))
        out.update(outcome="masked" if identical else "missed", shown_identical=identical,
                   detected={"screening": False, "canary": None, "range": False}, verdict="acquitted",
                   cause="reproduced", devices=[], links=[], site=None, finding=None, step=None)
        if not identical:
            out["note"] = "every fingerprint matched but the state differs: a fault the fingerprints cannot see"
        return out
    # The first step whose fingerprints the fault changed (a persistent fault may hide at its first steps:
    # a masked slot at one step's batch is a used one at the next): a right verdict names that step.
    first_bad = next(fp.step for fp in fps if not fingerprints_identical(fp, run.fingerprints[fp.step]))
    rep = replay_range(session, fault.start, stop, device_spec="all", log=log, replays=replays,
                       allow_env_drift=True, full_comparison=False, onset=None)
    d = rep.decision
    detected: dict[str, Any] = {"range": d.cause is not Cause.REPRODUCED, "screening": None, "canary": None}
    if screening and ctx.scan is None:
        raise ValueError("run_fault_drill(screening=True) needs DrillContext(scan=replay.screen.scan.scan_run)")
    if screening:
        signals = ctx.run_signals()
        sig = {s: v for s, v in signals.items() if s < ckpt}
        sig.update({fp.step: fp.signals for fp in fps if fp.signals is not None})
        if stop not in ctx.clean_scans:
            clean = {s: v for s, v in signals.items() if s < stop}
            ctx.clean_scans[stop] = _scan_findings(ctx.scan, session, run.fingerprints, clean)[0]
        found, _ = _scan_findings(ctx.scan, session, log, sig)
        detected["screening"] = bool({f for f in found if f[3] >= fault.start} - ctx.clean_scans[stop])
    if canary and fault.persistence != "once" and fault.stage in ("forward", "backward"):
        detected["canary"] = canary_sees(ctx, fault)
    loc = next((x.localization for r in rep.replays for x in r.diffs
                if x.step == d.step and x.localization is not None), None)
    out.update(outcome=classify(d, expected, first_bad), detected=detected, verdict=d.verdict.value,
               cause=d.cause.value, devices=list(d.devices), links=[list(x) for x in d.links], site=d.site,
               finding=None if loc is None else loc.finding, step=d.step, first_changed_step=first_bad)
    return out


def run_state_drill(ctx: DrillContext, fault: Fault) -> dict[str, Any]:
    """One ``optimizer_update`` drill, judged as the product judges a state fault (not by range replay).

    The segment from the checkpoint ``c`` before the fault to the next save ``b`` is trained with the fault
    on the run's mesh (it corrupts one element of the device's copy of ``fault.leaf`` after the update of
    each step it fires at); the state about to be saved at ``b`` gets its state record
    (``replay.run.statefp.record_state``: every replica of every leaf, as the save computes it), and
    ``replay certify``'s verdict on checkpoint ``b`` (``replay.verify.certify.judge_checkpoint``: the segment
    replayed on another placement, compared with the drilled log and the record) is the verdict. Counted:
    ``masked`` (no fingerprint of any step changed and the state at ``b`` is bit-identical to the clean
    run's, shown), ``right_alone`` (checkpoint ``b`` poisoned, the device alone named), ``right_plus_others``,
    ``wrong`` (others named), ``missed`` (certified, or poisoned with no device named).

    Returns:
      the row of :func:`run_fault_drill`, with ``judge: "certify"``, ``checkpoint`` (``b``), ``leaves`` (the
      leaves the verdict names) and ``leaf_named`` (the fault's leaf among them); ``detected``:
      ``state_record`` (the record's replicas disagree), ``certify`` (poisoned) and ``range`` (a logged
      step's fingerprints changed: the corrupted copy was used by a later step of the segment).
    """
    from replay.runtime import devices as dv
    from replay.run import statefp
    from replay.verify.certify import judge_checkpoint

    session = ctx.session
    run = session.run
    c = run.checkpoint_for(fault.start)
    later = [x for x in run.checkpoints if x > fault.start]
    if not later or later[0] > run.logged_steps[1]:
        raise FaultModelError(f"optimizer_update at step {fault.start}: no checkpoint save after it in the run")
    b = later[0]
    home = session.home_assignment()
    fps, _, kept = session.run_steps(home, c, b, fault=fault.specs(b), keep_state_at=b - 1)
    log = dict(run.fingerprints)
    for fp in fps:
        log[fp.step] = fp
    same_fp = all(fingerprints_identical(fp, run.fingerprints[fp.step]) for fp in fps)
    state = kept[b - 1]
    out: dict[str, Any] = {"fault": fault.to_dict(), "judge": "certify", "checkpoint": b,
                           "expected": {"kind": "device", "devices": [fault.device]}, "steps_trained": len(fps),
                           "shown_identical": None}
    identical = states_identical(state, ctx.clean_state(c, b))
    record = statefp.record_state(state, None, b)
    if same_fp and identical:
        out.update(outcome="masked", shown_identical=True, verdict="certified", cause="reproduced", devices=[],
                   links=[], leaves=[], leaf_named=False, site=None, finding=None, step=None,
                   detected={"screening": None, "canary": None, "range": False, "state_record": False,
                             "certify": False})
        return out
    ids = [d.id for d in session.device_infos()]
    placement = dv.independent_assignments(ids, session.setup.mesh_size, 2)[-1]  # good devices, another placement
    v = judge_checkpoint(session, c, b, record, log=log, assignment=placement)
    named = tuple(v.devices)
    if v.verdict != "poisoned" or not named:
        outcome = "missed"
    elif named == (fault.device,):
        outcome = "right_alone"
    else:
        outcome = "right_plus_others" if fault.device in named else "wrong"
    out.update(outcome=outcome, verdict=v.verdict, cause=v.reason, devices=list(named), links=[],
               leaves=list(v.leaves), leaf_named=fault.leaf in v.leaves, site=None, finding=None, step=b,
               state_identical=identical,
               detected={"screening": None, "canary": None, "range": not same_fp,
                         "state_record": not record.replicas_agree, "certify": v.verdict == "poisoned"})
    return out


def canary_sees(ctx: DrillContext, fault: Fault) -> bool:
    """Whether the run's canary (its batch and weights, every device at once) names the fault's device
    alone when the fault fires inside the canary's computation (the element index is clipped into the
    canary's buffer, whose shape differs from the step's)."""
    session = ctx.session
    trainer = session.setup.trainer
    if ctx.canary is None:
        home = session.home_assignment()
        ctx.canary = (session.init_state(home, session.setup.canary_seed)["params"], session.canary_batch())
    params, batch = ctx.canary
    spec = fault.specs(fault.start + 1)[0]
    fps = trainer.canary_fingerprints(params, batch, spec)
    sigs = {d: tuple(sorted(v.items())) for d, v in fps.items()}
    counts: dict[Any, int] = {}
    for v in sigs.values():
        counts[v] = counts.get(v, 0) + 1
    majority = max(counts, key=counts.get)
    odd = sorted(d for d, v in sigs.items() if v != majority)
    return odd == [fault.device]


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The campaign's figures over drill rows (:func:`run_fault_drill`): per site x magnitude the outcome
    counts and each detection layer's, and the totals the goals are judged on."""
    cells: dict[str, dict[str, dict[str, int]]] = {}
    for r in rows:
        f = r["fault"]
        c = cells.setdefault(f["site"], {}).setdefault(f["magnitude"], {
            **{o: 0 for o in OUTCOMES}, "drills": 0, "screening": 0, "canary": 0, "canary_tried": 0, "range": 0})
        c["drills"] += 1
        c[r["outcome"]] += 1
        det = r.get("detected") or {}
        c["screening"] += bool(det.get("screening"))
        c["range"] += bool(det.get("range"))
        if det.get("canary") is not None:
            c["canary_tried"] += 1
            c["canary"] += bool(det["canary"])
    unmasked = [r for r in rows if r["outcome"] != "masked"]
    transit = [r for r in unmasked if r["fault"]["site"] in TRANSIT_SITES]
    masked = [r for r in rows if r["outcome"] == "masked"]
    return {
        "drills": len(rows), "masked": len(masked), "unmasked": len(unmasked),
        "outcomes": {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES},
        "unmasked_right_alone_fraction": (sum(r["outcome"] == "right_alone" for r in unmasked) / len(unmasked)
                                          if unmasked else None),
        "masked_shown_identical": all(r.get("shown_identical") is True for r in masked),
        "transit_link_named_fraction": (sum(r["outcome"] == "right_alone" for r in transit) / len(transit)
                                        if transit else None),
        "matrix": cells,
    }
