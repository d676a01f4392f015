"""Drills: inject a simulated silent data corruption and check that replay and canary catch it.

A drill (issue 5, point 8) proves, on the user's own setup, that the triage works::

    fault  = (step s, device d, leaf, element, bit)      chosen, or drawn from a seeded RNG
    log'   = the run's log, with steps s.. recomputed from the checkpoint before s on the
             run's own mesh with the fault injected (the trainer flips the bit in d's local
             gradient before the data-parallel reduction): what the run would have logged
             had device d computed one wrong bit at step s
    range replay of [s, s+1) on good devices against log'  ->  must CONVICT device d at step s
    canary on every device with the fault on device d       ->  must name device d

With ``to_disk`` the drill is a short training run instead: the run directory is copied up to
the checkpoint before ``s``, steps ``c .. s+1`` are trained with the fault on the run's mesh and
written as a run directory (fingerprints, a checkpoint after the faulty step, a ``drill`` event),
and range replay reads that directory like any run: it convicts the device and, restoring the
checkpoint written after the faulty step, counts the parameters the flipped bit changed.

The fault is a traced input of the trainer's compiled step, so drills never recompile; the
session caches restored checkpoints, so many drills cost a few steps each.

Screening drills (``replay drill --scenario drift|flip|canary``, :func:`run_scenario`) check layers
1 and 2 of the screening instead: the run is retrained from a checkpoint with a fault, written as
a run directory, and ``replay scan`` of that directory alone must name the faulty device, and only
it, from the fault's first step::

    drift    DriftSpec(device, start, magnitude): the device's local gradient scaled by 1 + magnitude
             (or offset by magnitude * rms) at every step from start: too small to spike the loss
    flip     FaultSpec at `start` and at random later steps: bit 30 (the exponent's top bit) of one
             element of the device's local gradient: intermittent
    canary   the device's canary gradient has a bit flipped at every periodic canary from `start`
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any, Optional, Sequence

import numpy as np

from replay.run.protocol import FaultSpec
from replay.run.codes import Verdict


class DrillError(ValueError):
    """A chosen fault is impossible for this run (step without checkpoint, unknown device or leaf)."""


@dataclasses.dataclass
class DrillReport:
    """One drill's outcome.

    Attributes:
      fault: what was planted.
      range_report: the range replay's report; canary_report: the canary's, or None.
      convicted_ok: the replay convicted the faulty device alone, at the fault's step.
      canary_ok: the canary named the device (None: not run; a fault inside one step's
        computation is transient, so no canary runs for it).
      site_ok: the verdict's first divergent buffer is :func:`expected_site` (None when the run logs
        no all-to-all sends, e.g. gather dispatch: every device's contribution is its own).
    """

    fault: FaultSpec
    range_report: Any
    canary_report: Any
    convicted_ok: bool
    canary_ok: Optional[bool]
    site_ok: Optional[bool] = None

    @property
    def caught(self) -> bool:
        return self.convicted_ok and self.canary_ok is not False

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "drill",
            "fault": dataclasses.asdict(self.fault),
            "caught": self.caught,
            "device": next(iter(self.range_report.convicted), None) if self.convicted_ok else None,
            "range_convicted_right_device_and_step": self.convicted_ok,
            "first_divergent_site": getattr(self.range_report.decision, "site", None),
            "expected_site": expected_site(self.fault) if self.site_ok is not None else None,
            "site_as_planted": self.site_ok,
            "canary_named_device": self.canary_ok,
            "range": self.range_report.to_dict(),
            "canary": None if self.canary_report is None else self.canary_report.to_dict(),
        }


def _replayable_steps(run: Any) -> list[int]:
    """Logged steps ``s`` whose newest checkpoint ``c <= s`` exists and whose steps ``c .. s`` are all
    logged (a drill replays them), computed from the log itself: a sparse or damaged log must not
    make this walk every integer up to its last step."""
    import bisect

    logged = sorted(run.fingerprints)
    ckpts = sorted(run.checkpoints)
    out = []
    for s in logged:
        i = bisect.bisect_right(ckpts, s)
        if not i:
            continue
        c = ckpts[i - 1]
        if bisect.bisect_right(logged, s) - bisect.bisect_left(logged, c) == s - c + 1:
            out.append(s)
    return out


def _local_leaf_sizes(session: Any) -> list[int]:
    """Per leaf, the elements of one device's local gradient on the run's mesh (an expert leaf's
    shard under expert parallelism); the whole leaf for a trainer that does not say."""
    trainer, setup = session.setup.trainer, session.setup
    sizes = getattr(trainer, "local_leaf_sizes", None)
    return list(sizes(dict(zip(setup.axis_names, setup.shape)))) if sizes else list(trainer.leaf_sizes)


def _activation_element(session: Any, rng: random.Random, where: str, step: int, device: int, layer: int) -> int:
    """A random element of the buffer an ``expert_forward`` or ``attention`` fault hits on ``device``
    (``trainer.activation_shapes``). An attention element is drawn among the device's tokens that
    are not padding: a padding token's activation reaches neither the loss nor any other token, so
    a flip there changes nothing a replay could see (or need to)."""
    trainer, setup = session.setup.trainer, session.setup
    shapes = getattr(trainer, "activation_shapes", None)
    if shapes is None:
        raise DrillError(f"--where {where}: the run's trainer ({type(trainer).__name__}) plants no faults inside its "
                         "computation (it has no activation_shapes); use --where local_gradient")
    batch = session.numpy_batch(step, session.home_assignment())
    rows, seq_len = (int(n) for n in batch["inputs"].shape)
    every = shapes(dict(zip(setup.axis_names, setup.shape)), rows, seq_len)
    if where not in every:
        raise DrillError(f"--where {where}: the run's trainer plants no fault there on this run (a transit site needs "
                         f"model.dispatch all_to_all); sites: {', '.join(sorted(every))}")
    shape = every[where]
    if where != "attention":  # any element (what a padding or masked slot hides is the drill's finding)
        return rng.randrange(int(np.prod(shape)))
    b, S, D = shape
    r = list(setup.run_device_ids).index(device)
    seg = np.asarray(batch["inputs_segmentation"])[r * b:(r + 1) * b]
    valid = np.argwhere(seg != 0)
    if not len(valid):
        raise DrillError(f"step {step}: device {device}'s rows hold only padding; choose another --step or --device")
    row, pos = valid[rng.randrange(len(valid))]
    return int((row * S + pos) * D + rng.randrange(D))


def random_fault(session: Any, rng: random.Random, step: Optional[int] = None, device: Optional[int] = None,
                 leaf: Optional[str] = None, element: Optional[int] = None, bit: Optional[int] = None, *,
                 where: str = "local_gradient", layer: Optional[int] = None, mode: str = "flip",
                 value: Optional[float] = None) -> FaultSpec:
    """A fault with every unchosen field drawn from ``rng``: a logged step with a checkpoint at or
    before it, a device of the run's mesh, the buffer ``where`` names (``FAULT_SITES``: a parameter
    leaf's local gradient, an expert leaf's gradient in the backward pass, or a layer's expert output
    or attention output in the forward pass, or one of the sites inside the computation, in transit or on
    the host: ``replay.run.protocol.INNER_SITES``), an element of it and a bit of its dtype (bit 0 = the
    lowest mantissa bit included). ``mode``/``value``: a flip (default), or the element scaled by or set
    to ``value`` (NaN and Inf included; ``FaultSpec.mode``).

    Raises:
      DrillError: a chosen field is out of range (named, with the allowed range), or the trainer
        cannot plant a fault ``where``.
    """
    from replay.run.protocol import FAULT_SITES, LAYER_SITES

    if where not in FAULT_SITES:
        raise DrillError(f"--where {where!r}: must be one of {', '.join(FAULT_SITES)}")
    if mode != "flip" and (value is None or where == "host_batch"):
        raise DrillError(f"--mode {mode}: needs --value (a factor or a value; nan and inf included), and a float "
                         "buffer (not host_batch)")
    run, trainer = session.run, session.setup.trainer
    first, stop = run.logged_steps
    # Logged steps with a checkpoint at or before them (from the log itself: a sparse or damaged
    # log must not make this walk every integer up to its last step).
    steps = _replayable_steps(run)
    if not steps:
        raise DrillError(f"no logged step of {first}:{stop} has a checkpoint at or before it")
    if step is None:
        step = rng.choice(steps)
    elif step not in steps:
        raise DrillError(f"--step {step}: must be a logged step with a checkpoint at or before it, "
                         f"in [{steps[0]}, {steps[-1]}]")
    ids = list(session.setup.run_device_ids)
    if device is None:
        device = rng.choice(ids)
    elif device not in ids:
        raise DrillError(f"--device {device}: not a device of the run's mesh {ids}")
    if where in LAYER_SITES or where == "host_batch":
        if leaf:
            raise DrillError(f"--leaf: a {where} fault hits an activation, not a leaf; choose --layer")
        n_layers = int(getattr(getattr(trainer, "model", None), "n_layers", 0) or 0)
        if not n_layers:
            raise DrillError(f"--where {where}: the trainer does not say its layer count (model.n_layers)")
        if where == "host_batch":
            if layer is not None:
                raise DrillError("--layer: a host_batch fault hits the device's rows of the batch, not a layer")
        elif layer is None:
            layer = rng.randrange(n_layers)
        elif not 0 <= layer < n_layers:
            raise DrillError(f"--layer {layer}: must be in [0, {n_layers})")
        if element is None:
            element = _activation_element(session, rng, where, step, device, layer)
        site_bits = getattr(trainer, "site_bits", None)
        nbits = site_bits(where) if site_bits else 8 * np.dtype(trainer.leaf_dtypes[0]).itemsize
        what = f"the {where} buffer of layer {layer}"
    else:
        if layer is not None:
            raise DrillError(f"--layer: a {where} fault's layer is its leaf's; choose --leaf")
        paths = list(trainer.leaf_paths)
        allowed = paths
        if where == "expert_backward":
            allowed = [p for p in paths if p.endswith("['w_in']") or p.endswith("['w_out']")]
            if not allowed:
                raise DrillError("--where expert_backward: the model has no expert weights (['w_in'], ['w_out'])")
        if leaf is None:
            leaf = rng.choice(allowed)
        elif leaf not in allowed:
            raise DrillError(f"--leaf {leaf!r}: not {'an expert' if where == 'expert_backward' else 'a parameter'} "
                             f"leaf; leaves: {allowed}")
        i = paths.index(leaf)
        size = _local_leaf_sizes(session)[i]
        if element is None:
            element = rng.randrange(size)
        elif not 0 <= element < size:
            raise DrillError(f"--element {element}: must be in [0, {size}) for {leaf} (the device's local shard)")
        nbits = 8 * trainer.leaf_dtypes[i].itemsize
        what = leaf
    if bit is None:
        bit = rng.randrange(nbits)
    elif not 0 <= bit < nbits:
        raise DrillError(f"--bit {bit}: must be in [0, {nbits}) for {what}")
    return FaultSpec(step=step, device_id=device, leaf=leaf or "", element=element, bit=bit, where=where, layer=layer,
                     mode=mode, value=0.0 if value is None else float(value))


def expected_site(fault: FaultSpec) -> Optional[str]:
    """Where the verdict must say a drill's error first appeared, on a run that logs its all-to-all
    sends: what the device sends at the layer's combine (``expert_forward``) or dispatch
    (``attention``: its tokens' next exchange) in the forward pass, or its local gradient (an
    expert weight's gradient and a finished gradient are carried by no all-to-all)."""
    from replay.run.protocol import send_site

    if fault.where in ("expert_forward", "ffn_up", "ffn_down", "transit_combine"):
        return send_site(fault.layer, "combine", "forward")
    if fault.where in ("attention", "attn_scores", "attn_probs", "attn_pv", "transit_dispatch"):
        return send_site(fault.layer, "dispatch", "forward")
    if fault.where in ("ffn_up_grad_input", "ffn_down_grad_input", "transit_dispatch_grad"):
        return send_site(fault.layer, "dispatch", "backward")
    if fault.where == "transit_combine_grad":
        return send_site(fault.layer, "combine", "backward")
    if fault.where in ("router_logits", "host_batch"):
        return None  # the router's error shows where routing or a gate first changed a buffer; the batch's in its hash
    return "local_gradient"


def on_home(session: Any, fault: FaultSpec) -> FaultSpec:
    """``fault`` moved to the replay job's device at the faulty run device's mesh position on the home
    placement (``Session.home_assignment``): the same fault when the job has the run's devices; on a
    job of another shape (a 2 x 4 run replayed by 1 x 8 devices) the device that stands in for it."""
    ids = list(session.setup.run_device_ids)
    home = session.home_assignment()
    if fault.device_id in home or fault.device_id not in ids:
        return fault
    return dataclasses.replace(fault, device_id=home[ids.index(fault.device_id)])


def drilled_log(session: Any, fault: FaultSpec, extra_steps: int = 0) -> dict[int, Any]:
    """The run's log with steps ``fault.step .. fault.step + extra_steps`` recomputed with the fault
    injected, from the checkpoint before it, on the run's own mesh shape (the home placement; every
    process of it computes them, the others receive them), relabelled with the run's device ids."""
    from replay.runtime import distributed
    from replay.run.protocol import StepFingerprints

    run = session.run
    ckpt = run.checkpoint_for(fault.step)
    stop = min(fault.step + 1 + extra_steps, run.logged_steps[1])
    home = session.home_assignment()
    fps = None
    if session.participates(home):
        fps, _, _ = session.run_steps(home, ckpt, stop, fault=on_home(session, fault))
    if session.process_count > 1:
        parts = distributed.gather_json(None if fps is None else [fp.to_dict() for fp in fps])
        fps = [StepFingerprints.from_dict(x) for x in next(p for p in parts if p is not None)]
    ids = list(session.setup.run_device_ids)
    to_run = {h: r for h, r in zip(home, ids)} if ids else {}
    log = dict(run.fingerprints)
    for fp in fps:
        if fp.step >= fault.step:
            log[fp.step] = relabel(fp, to_run)
    return log


def relabel(fp: Any, mapping: dict[int, int]) -> Any:
    """``fp`` with its device ids renamed by ``mapping`` (ids it lacks stay): what the run would have
    logged for the same mesh positions."""
    if not mapping or all(mapping.get(d, d) == d for d in fp.devices):
        return fp
    extra = {"sends": {mapping.get(d, d): v for d, v in fp.sends.items()}} if getattr(fp, "sends", None) else {}
    if getattr(fp, "recvs", None):
        extra["recvs"] = {mapping.get(d, d): v for d, v in fp.recvs.items()}
    return dataclasses.replace(fp, devices={mapping.get(d, d): v for d, v in fp.devices.items()},
                               device_coords={mapping.get(d, d): c for d, c in fp.device_coords.items()}, **extra)


def write_drilled_run(session: Any, fault: FaultSpec, out_dir: str) -> str:
    """Trains a short faulty run into ``out_dir`` (module docstring) and returns ``out_dir``.

    The new directory holds the run's config, env record and events, its checkpoint ``c`` at or
    before ``fault.step``, the fingerprints of steps ``< c`` from the run and of ``c .. fault.step``
    as trained with the fault, a checkpoint ``fault.step + 1`` (the state after the faulty step),
    and a ``drill`` event.

    Raises:
      FileExistsError: ``out_dir`` exists.
    """
    from replay.run.protocol import CHECKPOINTS_DIR
    from replay.run.runlog import ENV_JSON, EVENTS, FINGERPRINTS, RUN_CONFIG

    run = session.run
    c = run.checkpoint_for(fault.step)
    os.makedirs(out_dir)
    for name in (RUN_CONFIG, ENV_JSON, EVENTS):
        if os.path.exists(os.path.join(run.run_dir, name)):
            shutil.copy(os.path.join(run.run_dir, name), out_dir)
    shutil.copytree(os.path.join(run.run_dir, CHECKPOINTS_DIR, str(c)), os.path.join(out_dir, CHECKPOINTS_DIR, str(c)))
    from replay.run import statefp

    if os.path.exists(statefp.record_path(run.run_dir, c)):  # its state record travels with it
        os.makedirs(os.path.join(out_dir, statefp.RECORDS_DIR), exist_ok=True)
        shutil.copy(statefp.record_path(run.run_dir, c), statefp.record_path(out_dir, c))
    home = session.home_assignment()
    fps, _, kept = session.run_steps(home, c, fault.step + 1, fault=fault, keep_state_at=fault.step)
    with open(os.path.join(out_dir, FINGERPRINTS), "w", encoding="utf-8") as f:
        for step in sorted(s for s in run.fingerprints if s < c):
            f.write(run.fingerprints[step].to_json() + "\n")
        for fp in fps:
            f.write(fp.to_json() + "\n")
    trainer = session.setup.trainer
    if callable(getattr(trainer, "save", None)):  # optional: the state after the step, for differing_elements
        _, loader_state = trainer.restore(run.run_dir, c, session.mesh(home))
        after = {**dict(loader_state), "next_step": fault.step + 1}
        record = statefp.record_state(kept[fault.step], after, fault.step + 1)  # the drill's own save, recorded
        trainer.save(out_dir, fault.step + 1, kept[fault.step], after)
        if session.process_index == 0:
            statefp.write_record(out_dir, record)
    with open(os.path.join(out_dir, EVENTS), "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "drill", "step": fault.step, **dataclasses.asdict(fault)}, sort_keys=True) + "\n")
    return out_dir


def run_drill(session: Any, fault: FaultSpec, *, device_spec: str = "all", replays: int = 2,
              canary: bool = True, canary_repeats: int = 1, to_disk: Optional[str] = None) -> DrillReport:
    """Runs one drill (module docstring) and says whether replay and canary caught it.

    Args:
      to_disk: write the faulty short run to this new folder and replay it from there (else the
        drilled log stays in memory).
    """
    from replay.verify.canary import run_canary
    from replay.verify.engine import Session, replay_range
    from replay.run.runlog import load_run

    if to_disk is not None:
        target = Session(load_run(write_drilled_run(session, fault, to_disk)), session.setup)
        rep = replay_range(target, fault.step, fault.step + 1, device_spec=device_spec, replays=replays,
                           allow_env_drift=True)
    else:
        log = drilled_log(session, fault)
        rep = replay_range(session, fault.step, fault.step + 1, device_spec=device_spec, log=log,
                           replays=replays, allow_env_drift=True, full_comparison=False)
    from replay.run.protocol import TRANSIT_SITES
    from replay.verify.verdict import Cause

    if fault.where in TRANSIT_SITES:  # a link, sender -> receiver, and neither chip alone
        setup = session.setup
        rows, seq_len = (int(n) for n in session.numpy_batch(fault.step)["inputs"].shape)
        coords = {int(d): dict(c) for d, c in (session.run.mesh.get("device_coords") or {}).items()}
        link = setup.trainer.link_of(dict(zip(setup.axis_names, setup.shape)), rows, seq_len, fault, coords)
        ok = rep.decision.cause is Cause.LINK_FAULT and tuple(rep.decision.links) == (link,) \
            and rep.decision.step == fault.step
    elif fault.where == "host_batch":  # the data, not a device
        ok = rep.decision.cause is Cause.DATA_ORDER and rep.decision.step == fault.step
    else:
        ok = (rep.verdict is Verdict.CONVICTED and rep.decision.devices == (fault.device_id,)
              and rep.decision.step == fault.step)
    site_ok = None
    site = getattr(rep.decision, "site", None)
    if site is not None and expected_site(fault) is not None:
        site_ok = site == expected_site(fault)
        if site_ok and fault.where in ("local_gradient", "expert_backward"):
            site_ok = _site_leaves(rep) == (fault.leaf,)
    can, can_ok = None, None
    if canary and fault.where == "local_gradient":
        # The faulty device (or, on a job of another shape, the one at its mesh position) must be among
        # the canary's devices, whatever the spec chose for replay.
        chip = on_home(session, fault)
        can = run_canary(session, device_spec=f"{device_spec}+{chip.device_id}", repeats=canary_repeats,
                         golden_path=None, fault=dataclasses.replace(chip, step=0))
        can_ok = can.decision.verdict is Verdict.CONVICTED and can.decision.odd_devices == (chip.device_id,)
    return DrillReport(fault, rep, can, ok, can_ok, site_ok)


def _site_leaves(rep: Any) -> tuple[str, ...]:
    """The differing leaves of the verdict's localized step (a local-gradient site's)."""
    loc = [d.localization for r in rep.replays for d in r.diffs
           if d.step == rep.decision.step and d.localization is not None]
    return loc[0].leaves if loc else ()


# ----------------------------------------------------------------------------- screening drills

SCENARIOS = ("drift", "flip", "canary", "expert_drift")
EXPECTED_CHECK = {"drift": ("norm_drift",), "flip": ("norm_spike", "nonfinite"), "canary": ("canary",),
                  "expert_drift": ("expert_drift",)}
DRIFT_TOLERANCE = 5  # steps: a drift's onset is an estimate (the CUSUM's last reset before its alarm)


@dataclasses.dataclass
class ScenarioReport:
    """A screening drill (``replay drill --scenario``): a short training run with an injected fault,
    and whether ``replay scan`` of it named the faulty device (and only it) at the right first step.

    Attributes:
      scenario: ``drift``, ``flip`` or ``canary``.
      device: the faulty device; first_step: the first step the fault can show at (the drift's
        start, the first flip, the first canary at or after the canary fault's step).
      faults: what was injected (as dicts).
      run_dir: the drilled run directory.
      scan: the scan report (dict).
      named: the top device suspect's ``(device, first step, checks)`` or None.
      tolerance: steps the named first step may differ from ``first_step`` (0 but for drift).
    """

    scenario: str
    device: int
    first_step: int
    faults: list[dict[str, Any]]
    run_dir: str
    scan: dict[str, Any]
    named: Optional[dict[str, Any]]
    tolerance: int

    resolution: tuple = ()  # the device sets the scan may name besides the device alone (scan_resolution)

    @property
    def caught(self) -> bool:
        return judge_scan(self.scan, self.scenario, self.device, self.first_step, self.tolerance,
                          resolution=self.resolution)

    @property
    def alone(self) -> bool:
        """The scan named the device alone by the scenario's check (not only as one of a pair or group)."""
        return named_alone(self.scan, self.device, EXPECTED_CHECK[self.scenario])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "scenario_drill", "scenario": self.scenario, "device": self.device,
                "first_step": self.first_step, "faults": self.faults, "run_dir": self.run_dir,
                "caught": self.caught, "named_alone": self.alone, "named": self.named, "tolerance": self.tolerance,
                "scan_suspects": self.scan.get("suspects"), "scan_checks": self.scan.get("checks")}


def top_device_suspect(scan: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The highest-ranked device or replica suspect of a scan report (dict), or None."""
    for s in scan.get("suspects", []):
        if s["kind"] in ("device", "replica"):
            return {"devices": s["devices"], "first_step": s["first_step"],
                    "checks": [e["check"] for e in s["evidence"]]}
    return None


def judge_scan(scan: dict[str, Any], scenario: str, device: int, first_step: int, tolerance: int = 0, *,
               resolution: Sequence[Sequence[int]] = ()) -> bool:
    """True when the scan names ``device`` and no healthy device beyond what its checks can resolve: every
    device or replica suspect includes ``device`` and lies within ``[device]`` and the sets of ``resolution``,
    and one of them whose devices are ``[device]`` or a set of ``resolution``
    has evidence of the scenario's kind (drift: ``norm_drift``; flip: ``norm_spike`` or ``nonfinite``;
    canary: ``canary``; expert_drift: ``expert_drift``) whose first step is within ``tolerance`` of
    ``first_step`` or, for a drift, whose onset is marked uncertain with a range that holds ``first_step``.

    ``resolution``: the finest device sets the check can name besides the device alone (the twins of an
    expert device on two data replicas, which ``expert_drift`` names as a pair; the expert group of a norm
    check under expert parallelism, :func:`scan_resolution`). Without it, an ``expert_drift`` replica suspect
    of two devices holding ``device`` counts as the pair."""
    suspects = [s for s in scan.get("suspects", []) if s["kind"] in ("device", "replica")]
    sets = [[device]] + [sorted(int(d) for d in r) for r in resolution if device in r]
    allowed = {d for r in sets for d in r}
    legacy = not resolution and scenario == "expert_drift"  # a pair of twins, from the scan alone
    if not suspects or any(device not in s["devices"] or not (legacy and len(s["devices"]) <= 2
                                                               or set(s["devices"]) <= allowed) for s in suspects):
        return False  # no suspect, or one that names a healthy device (alone, or beyond what the check resolves)

    def right(e) -> bool:
        if abs(e["first_step"] - first_step) <= tolerance:
            return True
        lo_hi = e.get("onset_range")
        return scenario in ("drift", "expert_drift") and bool(e.get("onset_uncertain")) and lo_hi is not None \
            and lo_hi[0] <= first_step <= lo_hi[1]

    def named(s) -> bool:
        return s["devices"] in sets or (not resolution and scenario == "expert_drift" and len(s["devices"]) == 2)

    return any(named(s) and any(e["check"] in EXPECTED_CHECK[scenario] and right(e) for e in s["evidence"])
               for s in suspects)


def named_alone(scan: dict[str, Any], device: int, checks: Sequence[str]) -> bool:
    """Whether a suspect of the scan is ``device`` alone with evidence of one of ``checks``."""
    return any(s["kind"] == "device" and s["devices"] == [device] and any(e["check"] in checks for e in s["evidence"])
               for s in scan.get("suspects", []))


def scan_resolution(session: Any, device: int) -> list[list[int]]:
    """The finest device sets ``replay scan`` can name for ``device`` besides itself (:func:`judge_scan`):
    under expert parallelism, its twins with it when it has exactly one (``expert_drift``), and its expert
    group (the norm checks)."""
    from replay.screen.scan import expert_groups, expert_twins

    coords = {int(d): dict(c) for d, c in (session.run.mesh.get("device_coords") or {}).items()}
    if not any("expert" in c for c in coords.values()):
        return []
    devs = sorted(coords)
    out = []
    twins = expert_twins(devs, coords).get(device, [])
    if len(twins) == 1:
        out.append(sorted([device, *twins]))
    group = list(expert_groups(devs, coords).get(device, ()))
    if len(group) > 1:
        out.append(group)
    return out


def scenario_faults(scenario: str, *, device: int, start: int, stop: int, magnitude: float = 0.2,
                    kind: str = "scale", flips: int = 3, bit: Optional[int] = None, leaf: Optional[str] = None,
                    leaf_paths: Sequence[str] = (), leaf_sizes: Sequence[int] = (),
                    rng: Optional[random.Random] = None) -> tuple[Any, Any, int]:
    """``(train faults, canary fault, first step)`` of a scenario between ``start`` and ``stop``.

    drift: a :class:`DriftSpec` on ``device`` from ``start`` on. flip: ``flips`` bit flips of bit
    ``bit`` (None, the default: each flip's bit drawn from the whole float32 range 0-31, not the
    exponent's top bit that makes an element 2^128 larger) on ``device`` at ``start`` and at random
    later steps, each in a random element of ``leaf`` (random when None). canary: the canary gradient
    of ``device`` has a bit flipped from ``start``. expert_drift: the device's experts' output
    x(1 + ``magnitude``) at every step from ``start`` (``DriftSpec`` kind ``expert_output``).

    Raises:
      DrillError: an unknown scenario, or ``stop - start`` too short for it.
    """
    from replay.run.protocol import DriftSpec

    rng = rng or random.Random(0)
    if scenario not in SCENARIOS:
        raise DrillError(f"--scenario {scenario!r}: must be one of {', '.join(SCENARIOS)} (or none: the replay drill)")
    if stop <= start:
        raise DrillError(f"the drill needs steps after its start {start}; the run trains to {stop}")
    if scenario == "drift":
        return DriftSpec(device_id=device, start=start, magnitude=magnitude, kind=kind), None, start
    if scenario == "expert_drift":  # the device's experts' output x(1 + magnitude), inside the forward pass
        return DriftSpec(device_id=device, start=start, magnitude=magnitude, kind="expert_output"), None, start
    paths = list(leaf_paths)
    if scenario == "flip":
        later = sorted(rng.sample(range(start + 1, stop), min(flips - 1, stop - start - 1)))
        out = []
        for s in [start, *later]:
            lf = leaf if leaf is not None else rng.choice(paths)
            out.append(FaultSpec(step=s, device_id=device, leaf=lf, element=rng.randrange(leaf_sizes[paths.index(lf)]),
                                 bit=rng.randrange(32) if bit is None else bit))
        return out, None, start
    lf = leaf if leaf is not None else rng.choice(paths)
    return None, FaultSpec(step=start, device_id=device, leaf=lf, element=rng.randrange(leaf_sizes[paths.index(lf)]),
                           bit=0), start


def run_scenario(session: Any, scenario: str, out_dir: str, *, rng: random.Random, device: Optional[int] = None,
                 start: Optional[int] = None, magnitude: float = 0.2, kind: str = "scale", flips: int = 3,
                 bit: Optional[int] = None, canary_every: Optional[int] = None, log=None) -> ScenarioReport:
    """A screening drill on a reference-trainer run: copies the run into ``out_dir`` up to its
    checkpoint ``c`` (the logs before ``c`` are the history the scan's baselines need), trains
    ``c .. end`` again with the scenario's fault (``scenario_faults``), scans the drilled run and
    judges it (:func:`judge_scan`).

    Args:
      session: a ``replay.verify.engine.Session`` of a reference-trainer run.
      out_dir: a new folder for the drilled run.
      device: the faulty device (default: random among the run's).
      start: the fault's first step (default: random after the middle checkpoint, leaving at
        least a quarter of the run after it).
      magnitude, kind: a drift's relative error and kind (``replay.run.protocol.DriftSpec``).
      flips, bit: the flip scenario's number of flips and bit.
      canary_every: the drilled run's canary period (default: the run's, or 5 if it has none;
        the canary scenario needs one).

    Raises:
      DrillError: the run is too short, or ``device``/``start`` are out of range.
      FileExistsError: ``out_dir`` exists and is not empty.
    """
    from replay.runtime import distributed
    from replay.run import protocol as proto
    from replay.run.runlog import ENV_JSON, EVENTS, RUN_CONFIG, load_run
    from replay.screen.scan import scan_run

    run, setup = session.run, session.setup
    first, end = run.logged_steps
    ids = list(setup.run_device_ids)
    device = rng.choice(ids) if device is None else device
    if device not in ids:
        raise DrillError(f"--device {device}: not a device of the run's mesh {ids}")
    ckpts = [c for c in run.checkpoints if first < c < end] or [c for c in run.checkpoints if c < end]
    if not ckpts:
        raise DrillError(f"the run has no checkpoint before its last step {end - 1} to restart from")
    c = ckpts[len(ckpts) // 2] if start is None else max([x for x in run.checkpoints if x <= start] or [-1])
    if c < 0:
        raise DrillError(f"--step {start}: no checkpoint at or before it; checkpoints {run.checkpoints}")
    if start is None:
        latest = max(c, end - max(4, (end - first) // 4))
        start = rng.randrange(c, latest) if latest > c else c
    if not c <= start < end:
        raise DrillError(f"--step {start}: must be in [{c}, {end}) (after checkpoint {c}, before the run's end)")
    period = canary_every if canary_every is not None else (setup.canary_every or 5)
    period = period if scenario == "canary" or setup.canary_every else 0
    trainer = setup.trainer
    faults, canary_fault, first_step = scenario_faults(
        scenario, device=device, start=start, stop=end, magnitude=magnitude, kind=kind, flips=flips, bit=bit,
        leaf_paths=trainer.leaf_paths, leaf_sizes=_local_leaf_sizes(session), rng=rng)
    if scenario == "canary":
        first_step = -(-start // period) * period
        if first_step >= end:
            raise DrillError(f"no canary runs between step {start} and the run's end {end} (canary_every {period})")
    home = session.home_assignment()
    if session.process_count > 1 and not all(session.participates([d for d in home if
                                                                   session.jax_devices[d].process_index == p])
                                              for p in range(session.process_count)):
        raise DrillError("a screening drill retrains the run on its own mesh shape, which must span every process "
                         "of the replay here: run it as one process (without the process flags)")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    as_dicts = [dataclasses.asdict(f) | {"type": type(f).__name__}
                for f in ([] if faults is None else faults if isinstance(faults, list) else [faults])]
    if canary_fault is not None:
        as_dicts.append(dataclasses.asdict(canary_fault) | {"type": "canary FaultSpec"})
    if session.process_index == 0:  # process 0 copies the run up to checkpoint c; the others wait for it
        os.makedirs(out_dir, exist_ok=True)
        logs = [path for name in (proto.FINGERPRINTS_NAME, proto.SIGNALS_NAME, proto.CANARY_NAME)
                for _, path in proto.log_files(run.run_dir, name)]
        for path in [os.path.join(run.run_dir, n) for n in (RUN_CONFIG, ENV_JSON, EVENTS)] + logs:
            if os.path.exists(path):
                shutil.copy(path, out_dir)
        shutil.copytree(os.path.join(run.run_dir, proto.CHECKPOINTS_DIR, str(c)),
                        os.path.join(out_dir, proto.CHECKPOINTS_DIR, str(c)))
        from replay.run import statefp

        record = statefp.record_path(run.run_dir, c)
        if os.path.exists(record):  # the checkpoint's state record goes with it: the restore checks it
            os.makedirs(os.path.dirname(statefp.record_path(out_dir, c)), exist_ok=True)
            shutil.copy(record, statefp.record_path(out_dir, c))
        with open(os.path.join(out_dir, EVENTS), "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "drill", "step": start, "scenario": scenario, "device": device,
                                "faults": as_dicts}, sort_keys=True) + "\n")
    distributed.sync("replay-drill-copied")
    mesh = session.mesh(home)
    if setup.retrain is not None:  # the trainer's own training loop
        setup.retrain(out_dir, end, trainer=trainer, mesh=mesh, faults=faults, canary_fault=canary_fault,
                      canary_every=period, log=log)
    else:
        retrain_through_protocol(session, out_dir, c, end, faults=faults, canary_fault=canary_fault,
                                 canary_every=period)
    distributed.sync("replay-drill-retrained")
    scan = scan_run(load_run(out_dir)).to_dict()
    return ScenarioReport(scenario=scenario, device=device, first_step=first_step, faults=as_dicts,
                          run_dir=out_dir, scan=scan, named=top_device_suspect(scan),
                          tolerance=DRIFT_TOLERANCE if scenario in ("drift", "expert_drift") else 0,
                          resolution=tuple(tuple(r) for r in scan_resolution(session, device)))


def retrain_through_protocol(session: Any, out_dir: str, checkpoint: int, stop: int, *, faults: Any = None,
                             canary_fault: Optional[FaultSpec] = None, canary_every: int = 0) -> None:
    """Retrains the run copied into ``out_dir`` from ``checkpoint`` to ``stop`` through the trainer protocol
    alone (any trainer): the run's checkpoint restored, its batches rebuilt, ``train_step`` with the
    drill's ``faults``, each step's fingerprints and signals written through ``replay.run.writer``; every
    ``canary_every`` steps the canary (the run's canary batch and weights, ``single_device_fingerprints``
    on each device of the run's mesh, ``canary_fault`` from its step on), one record per device."""
    from replay.run import canary as cn
    from replay.runtime import distributed
    from replay.run.protocol import CanaryRecord

    setup, trainer = session.setup, session.setup.trainer
    home = session.home_assignment()
    rd = session.run_dir_writer(out_dir, home)
    for name in ("fingerprints.jsonl", "signals.jsonl", "canary.jsonl"):
        rd.truncate_log(name, checkpoint)
    rd.event("restore", checkpoint, checkpoint=checkpoint, drill=True)
    state = session.restore(checkpoint, home)
    canary = None
    if canary_every:
        batch = session.canary_batch()
        canary = (session.init_state(home, setup.canary_seed), batch, cn.batch_sha256(batch))
    for step, batch in session.batches(checkpoint, stop, home):
        if canary is not None and step % canary_every == 0:
            hit = canary_fault if canary_fault is not None and step >= canary_fault.step else None
            mine = {d: cn.fingerprints_signature(trainer.single_device_fingerprints(canary[0], canary[1],
                                                                                    session.jax_devices[d], hit))
                    for d in home if session.is_local(d)}
            every = {int(d): sig for part in distributed.gather_json({str(k): v for k, v in mine.items()})
                     for d, sig in part.items()}
            results = [cn.DeviceResult(d, (every[d],), {}) for d in home]
            decision = cn.decide_canary(results, None)
            for r in results:
                rd.append_canary(CanaryRecord(step=step, device=r.id, signature=r.signatures[0],
                                              status=decision.statuses[r.id], golden=decision.golden_status,
                                              canary=f"drill:{canary[2][:12]}", seconds=0.0))
            if decision.odd_devices:
                rd.event("canary_mismatch", step, devices=list(decision.odd_devices), verdict=decision.verdict.value)
        state, fp = trainer.train_step(state, batch, step, faults)
        rd.append_fingerprints(fp)
        if fp.signals is not None:
            rd.append_signals(fp.signals)
    rd.event("end", stop)
