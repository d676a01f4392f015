"""Verdicts and exit codes: the decision of a range replay, as one small pure function.

After the Megatron-LM rerun state machine (``megatron/core/rerun_state_machine.py``), kept
small: explicit enums for the outcome, named exit codes a caller acts on, and the decision
in one function (:func:`decide`) over comparison outcomes, with no I/O and no JAX.

The rules (issue 5, "Verdicts")::

    replays disagree with each other                   -> AMBIGUOUS  (flaky hardware in the replay set)
    all replays reproduce the log                      -> ACQUITTED  (a suspicion's cause: data or software)
    the rebuilt batch differs from the logged batch    -> ACQUITTED  (cause: data/order difference)
    >= 2 independent replays agree, and differ from the
      log at one step on some (not all) device shards  -> CONVICTED  (those devices of the original run)
    anything else (one replay only, every shard
      differs, only a tolerance comparison, ...)       -> AMBIGUOUS

Exit codes (``replay`` command): see :class:`replay.run.codes.ExitCode`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence

from replay.run.codes import ExitCode, Verdict

LINK_EXIT_CODE = ExitCode.LINK_CONVICTED


class Cause(str, enum.Enum):
    """Why the verdict is what it is."""

    REPRODUCED = "reproduced"  # replays reproduce the log: the cause of a spike is data or software
    DATA_ORDER = "data_order"  # the rebuilt batch's hash differs from the logged one
    DEVICE_FAULT = "device_fault"  # some device shards' contributions differ from the log
    LINK_FAULT = "link_fault"  # sent right, received wrong: the link sender -> receiver, neither chip alone
    REPLAYS_DISAGREE = "replays_disagree"  # replays differ from each other
    TOO_FEW_REPLAYS = "too_few_independent_replays"
    UNLOCALIZED = "unlocalized"  # a difference not attributable to some device shards
    TOLERANCE_ONLY = "tolerance_only"  # only a tolerance comparison was possible; it failed
    STATE_POISONED = "state_poisoned"  # the step's input state was corrupted in an update (the next checkpoint's
    #                                    replicas disagree): its differences are not the step's arithmetic
    LOG_CONFLICT = "log_conflict"  # the log holds two different lines for the step: which one the run computed
    #                                is unknown, so no device is convicted on it


class Evidence(str, enum.Enum):
    """How strong the comparison behind a verdict is, strongest first."""

    BIT_EXACT = "bit-exact"  # same mesh shape and device order as the run: every field bit for bit
    PER_SHARD = "per-shard"  # other devices, same mesh shape: device contributions bit for bit by mesh position
    TOLERANCE = "tolerance"  # loss and gradient norm within a relative tolerance: weaker evidence


class DivergenceKind(str, enum.Enum):
    """What differs at a step, most telling first."""

    DATA = "data"  # batch hash
    DEVICE = "device"  # some, not all, device contributions
    ALL_DEVICES = "all_devices"  # every device contribution
    GLOBAL = "global"  # only the reduced values (loss, norm, reduced leaves)
    LINK = "link"  # a buffer sent right and received wrong at an all-to-all (replay.verify.localize)
    TOLERANCE = "tolerance"  # loss or norm outside the tolerance


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step at which a replay differs from the log.

    Attributes:
      step: global step.
      kind: what differs.
      devices: device ids of the original run the divergence points at (sorted): whose
        contributions differ or, when the log has all-to-all send fingerprints, the producers of
        the first divergent buffer in program order (``replay.verify.localize``).
      leaves: leaf paths whose fingerprints differ (reduced or on any device; sorted).
      site: the first divergent send site (``"layer1.combine.forward"``) or ``"local_gradient"``;
        None when the log has no send fingerprints.
      reached: every device that differs at the step (the producers' error spread to them).
      site_label: ``site`` for humans (``"the combine all-to-all of layer 1 (forward pass)"``).
    """

    step: int
    kind: DivergenceKind
    devices: tuple[int, ...] = ()
    leaves: tuple[str, ...] = ()
    site: Optional[str] = None
    reached: tuple[int, ...] = ()
    site_label: Optional[str] = None
    links: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class ReplayOutcome:
    """One replay's result, as :func:`decide` sees it.

    Attributes:
      assignment: device ids placed on the run's mesh positions (row-major).
      evidence: the comparison's strength.
      divergence: the first divergence from the log, or None when the log was reproduced.
      signature: digest of everything the replay computed, keyed by mesh position (equal
        signatures mean the replays agree bit for bit).
    """

    assignment: tuple[int, ...]
    evidence: Evidence
    divergence: Optional[Divergence]
    signature: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """The verdict and what it rests on.

    Attributes:
      verdict, cause, evidence: see the enums.
      step: the first divergent step (None when reproduced).
      devices: convicted device ids of the original run (empty unless CONVICTED).
      leaves: differing leaf paths at ``step``.
      independent_replays: how many replays ran on pairwise independent device assignments.
      explanation: one sentence for humans, with what to do next.
      site: where the error first appeared at ``step`` (``Divergence.site``), or None.
      reached: the devices that differ at ``step`` (``Divergence.reached``).
      links: a link conviction's ``(sender, receiver)`` pairs (``Cause.LINK_FAULT``; ``devices`` is then
        empty: neither chip is convicted alone).
    """

    verdict: Verdict
    cause: Cause
    evidence: Evidence
    step: Optional[int]
    devices: tuple[int, ...]
    leaves: tuple[str, ...]
    independent_replays: int
    explanation: str
    site: Optional[str] = None
    reached: tuple[int, ...] = ()
    links: tuple[tuple[int, int], ...] = ()


def count_independent(assignments: Sequence[Sequence[int]]) -> int:
    """The size of a greedy set of pairwise independent assignments (no mesh position shares a device)."""
    kept: list[Sequence[int]] = []
    for a in assignments:
        if all(all(x != y for x, y in zip(a, b)) for b in kept):
            kept.append(a)
    return len(kept)


def decide(outcomes: Sequence[ReplayOutcome], num_devices: int, *, suspected: Sequence[int] = ()) -> Decision:
    """Returns the verdict over the replays of one step range.

    Args:
      outcomes: one per replay (repeats included), in the order they ran; >= 1.
      num_devices: devices in the run's mesh (a divergence on all of them is not one device's fault).
      suspected: devices of the run held suspect before the replay (quarantined, or named by
        ``replay scan``). Only an acquittal's explanation uses them: with none, there is nothing
        for the data or the software to have caused, and the explanation does not say it did.

    Raises:
      ValueError: ``outcomes`` is empty.
    """
    if not outcomes:
        raise ValueError("decide needs at least one replay outcome")
    evidence = max((o.evidence for o in outcomes), key=list(Evidence).index)  # weakest one counts
    independent = count_independent([o.assignment for o in outcomes])

    def make(verdict, cause, explanation, div: Optional[Divergence] = None, devices=()):
        return Decision(
            verdict=verdict, cause=cause, evidence=evidence,
            step=None if div is None else div.step, devices=tuple(devices),
            leaves=() if div is None else div.leaves, independent_replays=independent,
            explanation=explanation, site=None if div is None else div.site,
            reached=() if div is None else div.reached,
            links=() if div is None or cause is not Cause.LINK_FAULT else div.links,
        )

    if len({o.signature for o in outcomes}) > 1:
        return make(
            Verdict.AMBIGUOUS, Cause.REPLAYS_DISAGREE,
            "the replays disagree with each other: suspect flaky hardware in the replay set; "
            "rerun with --repeats or on other devices",
            outcomes[0].divergence,
        )
    div = outcomes[0].divergence
    if div is None:
        weak = " (within tolerance only: weaker evidence)" if evidence is Evidence.TOLERANCE else ""
        if not suspected:
            return make(Verdict.ACQUITTED, Cause.REPRODUCED,
                        f"the replay reproduces the log{weak}: no device "
                        + ("is shown to have computed" if weak else "computed") + " wrong numbers in these steps")
        return make(
            Verdict.ACQUITTED, Cause.REPRODUCED,
            f"the replay reproduces the log{weak}: the devices are acquitted, suspect device(s) "
            f"{sorted(suspected)} included; what made them suspect is in the data or the software, not in "
            "these steps' computations: run 'replay inspect' on the steps of interest",
        )
    if div.kind is DivergenceKind.DATA:
        return make(
            Verdict.ACQUITTED, Cause.DATA_ORDER,
            f"step {div.step}: the rebuilt batch differs from the logged one (batch hash): a data or order "
            "difference, not a device fault; run 'replay inspect' on this step",
            div,
        )
    if evidence is Evidence.TOLERANCE or div.kind is DivergenceKind.TOLERANCE:
        return make(
            Verdict.AMBIGUOUS, Cause.TOLERANCE_ONLY,
            f"step {div.step}: loss or gradient norm outside the tolerance; a tolerance comparison cannot "
            "name a device: replay on the run's mesh shape for a bit-exact comparison",
            div,
        )
    if div.kind is DivergenceKind.LINK:
        pairs = ", ".join(f"{a} -> {b}" for a, b in div.links)
        if independent >= 2:
            return make(
                Verdict.CONVICTED, Cause.LINK_FAULT,
                f"step {div.step}: {independent} independent replays agree with each other and not with the "
                f"log: at {div.site_label or div.site} every device sent what the replays sent, and the "
                f"link(s) {pairs} delivered something else: the link (sender -> receiver) is convicted, "
                "neither chip alone; check the interconnect between them (exit code "
                f"{int(LINK_EXIT_CODE)})",
                div)
        return make(
            Verdict.AMBIGUOUS, Cause.TOO_FEW_REPLAYS,
            f"step {div.step}: the link(s) {pairs} delivered something other than what was sent, but only "
            f"{independent} independent replay(s) ran; a conviction needs two: choose more good devices",
            div)
    if div.kind is DivergenceKind.DEVICE and 0 < len(div.devices) < num_devices:
        if independent >= 2:
            where = ""
            if div.site is not None:
                spread = [d for d in div.reached if d not in div.devices]
                where = (f"; the error first appeared in what device(s) {list(div.devices)} computed at "
                         f"{div.site_label or div.site}"
                         + (f", and reached device(s) {spread} only through what they received" if spread else ""))
            return make(
                Verdict.CONVICTED, Cause.DEVICE_FAULT,
                f"step {div.step}: {independent} independent replays agree with each other and not with the "
                f"log on device(s) {list(div.devices)}{where}: convicted of silent data corruption",
                div, div.devices,
            )
        return make(
            Verdict.AMBIGUOUS, Cause.TOO_FEW_REPLAYS,
            f"step {div.step}: device(s) {list(div.devices)} differ from the log, but only {independent} "
            "independent replay(s) ran; a conviction needs two: choose more good devices",
            div,
        )
    what = {
        DivergenceKind.ALL_DEVICES: "every device shard differs",
        DivergenceKind.GLOBAL: "only reduced values differ",
    }.get(div.kind, "the difference is not localized")
    return make(
        Verdict.AMBIGUOUS, Cause.UNLOCALIZED,
        f"step {div.step}: {what}; no single device is to blame: suspect the software, the environment "
        "or the checkpoint",
        div,
    )


def limit_to_poisoned_state(decision: Decision, checkpoint: int, odd: Sequence[int], suspects: Sequence[int],
                            what: str) -> Decision:
    """A device conviction checked against a poisoned checkpoint after its step (pure).

    When checkpoint ``checkpoint``, the first after the divergent step, holds copies of replicated state
    that disagree (``replay.run.statefp``: ``odd`` named by a majority of copies, ``suspects`` those and
    every copy of a shard without one; ``what`` says which), the state the step started from was
    corrupted in an update, or in memory, before it: a device that computed with a wrong copy differs
    from the log, and so does every device that received what it sent. Only a suspect can be the culprit,
    so the conviction keeps the convicted devices that are suspects; with none left it becomes AMBIGUOUS,
    ``Cause.STATE_POISONED`` (``replay certify`` judges that checkpoint). Other decisions are returned as
    they are.
    """
    if decision.verdict is not Verdict.CONVICTED or decision.cause is not Cause.DEVICE_FAULT or not suspects:
        return decision
    convicted, allowed = set(decision.devices), set(suspects)
    keep = sorted(convicted & allowed)
    spread = sorted(convicted - allowed)
    if not spread:
        return decision
    note = (f"checkpoint {checkpoint}'s state record shows that at its save {what}: the state step "
            f"{decision.step} started from was corrupted in an update or in memory before it")
    if keep:
        return dataclasses.replace(
            decision, devices=tuple(keep),
            explanation=f"step {decision.step}: device(s) {sorted(convicted)} differ from the log, and {note}; "
                        f"device(s) {spread} hold no wrong copy and only computed with what the corrupted one "
                        f"sent them: device(s) {keep} convicted of silent data corruption; run 'replay certify' "
                        "for the newest clean checkpoint")
    return dataclasses.replace(
        decision, verdict=Verdict.AMBIGUOUS, cause=Cause.STATE_POISONED, devices=(),
        explanation=f"step {decision.step}: device(s) {sorted(convicted)} differ from the log, but {note}, and none "
                    f"of them holds a wrong copy (suspects {sorted(allowed)}): no device is convicted from these "
                    f"steps; run 'replay certify' to name the poisoned checkpoint and the newest clean one")


def limit_to_consistent_log(decision: Decision, conflicts: Sequence[int]) -> Decision:
    """A conviction at a step the log holds two different lines for (``RunLog.relogged_conflicts``: a step
    logged twice whose lines disagree) becomes AMBIGUOUS, cause ``LOG_CONFLICT``: the log contradicts
    itself there, so a difference from the line kept is not evidence against any device. Any other
    decision is returned unchanged."""
    if decision.verdict is not Verdict.CONVICTED or decision.step not in set(conflicts):
        return decision
    return dataclasses.replace(
        decision, verdict=Verdict.AMBIGUOUS, cause=Cause.LOG_CONFLICT, devices=(), links=(),
        explanation=(f"step {decision.step} is logged twice in fingerprints.jsonl with different values (a step "
                     f"trained again after a restart, or a damaged log): the replay differs from the line kept on "
                     f"device(s) {list(decision.devices)}, which is no evidence against them; replay a range "
                     f"without step {decision.step}, or compare the two lines of step {decision.step} in "
                     "fingerprints.jsonl"))
