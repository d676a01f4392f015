"""``replay certify``: walk a run's checkpoint chain and certify the newest clean checkpoint.

Because a checkpoint segment replays bit for bit, checkpoint ``c_k`` plus the batches of steps
``c_k .. c_{k+1}-1`` on good devices must reach exactly the state that checkpoint ``c_{k+1}``'s
state record (``replay.run.statefp``) says was saved. From a checkpoint taken as trusted (the first,
or ``--from STEP``)::

    for each segment k (independent placements at the same time, lanes on threads):
        state  = restore c_k on placement P (checked against its record)
        replay steps c_k .. c_{k+1}-1 on P, each step compared with the log (as range replay)
        record = the replayed state's fingerprints; compare leaf by leaf with c_{k+1}'s record
        restore c_{k+1} itself and check its files against its record
    a segment whose start checkpoint is damaged replays from the previous segment's replayed state
    walk the chain in order: the verdict of each checkpoint (first failure and why)

Verdicts (:data:`VERDICTS`) of each checkpoint after the trusted one:

* ``certified``: the replay reproduced its record exactly, its replicas agreed at the save, its state
  is finite and its files restore to its record;
* ``poisoned``: its replicas disagreed at the save (the record names the devices), or the replay of
  the segment does not reach its record: a logged step differs (the step's fingerprints name the
  step and devices, as range replay does) or the state differs with every step right (an SDC in the
  update or in memory: the recorded copies that differ from the replayed value are named);
* ``damaged``: the replay reaches its record, but its files restore to another state (or do not
  restore): bit rot, never a device;
* ``not_certifiable``: no record (a run from before records), a state that is not finite, a missing
  checkpoint item, or no replay reached it (its segment's start was damaged with nothing to chain from);
* ``not_checked``: after the first poisoned checkpoint (its descendants inherit the poison).

The report names the newest certified checkpoint: the rewind target ("rewind to pre-corruption
ckpt"). Exit codes: 0 every checkpoint of the chain certified, ``POISONED_CHECKPOINT`` (21) a poisoned
one found, ``DAMAGED_CHECKPOINT`` (20) a damaged one and none poisoned, ``AMBIGUOUS`` (4) one not
certifiable and none poisoned or damaged.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from replay.run import statefp
from replay.run.codes import ExitCode
from replay.run.runlog import RunDirError
from replay.verify.engine import (CheckpointCorruptError, EnvDriftError, Session, _locked, check_mesh_shape,
                                  environment_differences, run_lanes)

VERDICTS = ("trusted", "certified", "poisoned", "damaged", "not_certifiable", "not_checked")


@dataclasses.dataclass
class CheckpointVerdict:
    """One checkpoint of the chain: ``verdict`` (:data:`VERDICTS`), ``reason`` (a sentence), and what
    named it: ``step`` and ``devices`` (a poisoned checkpoint's faulty step and devices, when known),
    ``leaves`` (leaves that differ), ``segment`` (``[c_k, c_{k+1}]`` replayed to reach it), ``placement``."""

    checkpoint: int
    verdict: str
    reason: str
    step: Optional[int] = None
    devices: tuple[int, ...] = ()
    leaves: tuple[str, ...] = ()
    segment: Optional[tuple[int, int]] = None
    placement: Optional[int] = None
    steps_replayed: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["devices"], d["leaves"] = list(self.devices), list(self.leaves)
        d["segment"] = list(self.segment) if self.segment else None
        return d


@dataclasses.dataclass
class CertifyReport:
    run_dir: str
    trusted: int
    chain: list[CheckpointVerdict]
    placements: list[list[int]]
    steps_replayed: int
    wall_seconds: float
    concurrent: bool

    @property
    def certified(self) -> Optional[int]:
        """The newest checkpoint of the unbroken run of certified ones from the trusted one (or the
        trusted one itself when the next is not certified): the rewind target."""
        best = self.trusted
        for v in self.chain[1:]:
            if v.verdict == "certified":
                best = v.checkpoint
            elif v.verdict in ("poisoned", "not_checked", "not_certifiable"):
                break
        return best

    @property
    def first_failure(self) -> Optional[CheckpointVerdict]:
        return next((v for v in self.chain if v.verdict not in ("trusted", "certified")), None)

    @property
    def exit_code(self) -> int:
        kinds = {v.verdict for v in self.chain}
        if "poisoned" in kinds:
            return int(ExitCode.POISONED_CHECKPOINT)
        if "damaged" in kinds:
            return int(ExitCode.DAMAGED_CHECKPOINT)
        if "not_certifiable" in kinds:
            return int(ExitCode.AMBIGUOUS)
        return int(ExitCode.ACQUITTED)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_failure
        return {"run_dir": self.run_dir, "trusted": self.trusted, "certified": self.certified,
                "first_failure": first.to_dict() if first else None, "chain": [v.to_dict() for v in self.chain],
                "placements": self.placements, "steps_replayed": self.steps_replayed,
                "wall_seconds": round(self.wall_seconds, 4), "concurrent": self.concurrent,
                "exit_code": self.exit_code}


@dataclasses.dataclass
class _Segment:
    """One task's outcome (segment ``a -> b``)."""

    a: int
    b: int
    placement: int
    status: str  # "done", "deferred" (its start is damaged), or "failed_start"
    start_problem: str = ""
    step_diff: Optional[Any] = None  # the first logged step that differs
    differing: list = dataclasses.field(default_factory=list)  # leaves of b's record the replay does not reach
    file_problem: str = ""  # b's files do not restore to its record
    steps: int = 0
    seconds: float = 0.0
    end_state: Any = None  # kept when b's files are damaged, for the next segment to chain from
    replica_match: dict = dataclasses.field(default_factory=dict)  # (leaf, shard) -> copies equal to the replay
    files_match_replay: Optional[bool] = None  # b's files against the replay, when both differ from b's record


def _restore_problem(session: Session, checkpoint: int, assignment) -> tuple[Any, str]:
    """``(state, "")`` or ``(None, why)``: checkpoint restored and checked against its record (a
    poisoned record is judged by the walk, so it is restored anyway)."""
    try:
        return session.restore(checkpoint, assignment, allow_poisoned=True), ""
    except statefp.DamagedCheckpointError as e:
        return None, str(e)
    except CheckpointCorruptError as e:
        return None, str(e)


_DISK = object()  # read b's state record from the run directory


def _read_record(session: Session, b: int) -> Optional[statefp.StateRecord]:
    try:
        return statefp.read_record(session.run.run_dir, b)
    except statefp.DamagedCheckpointError:
        return None  # the verdict reads it again and says it is damaged


def _segment(session: Session, a: int, b: int, index: int, assignment, advance, start_state=None, *,
             record: Any = _DISK, log: Optional[Mapping[int, Any]] = None, check_files: bool = True) -> _Segment:
    """Replays ``a -> b`` on ``assignment`` and compares the state it reaches with ``b``'s record (``record``:
    one in memory instead of the run directory's; ``log``: the fingerprints to compare the steps with,
    default the run's; ``check_files``: restore ``b`` itself and check its files)."""
    t0 = time.perf_counter()
    run = session.run
    record = _read_record(session, b) if record is _DISK else record
    if start_state is None:
        start_state, problem = _restore_problem(session, a, assignment)
        if start_state is None:
            return _Segment(a, b, index, "deferred", start_problem=problem)
    fps, diffs, kept = session.replay_segment(assignment, a, b, log=run.fingerprints if log is None else log,
                                              advance=advance, keep_state_at=b - 1, start_state=start_state)
    advance(b - a - len(fps))
    out = _Segment(a, b, index, "done", steps=len(fps))
    bad = next((d for d in diffs if not d.ok), None)
    if bad is not None:
        out.step_diff = bad
    else:
        replayed = statefp.record_state(kept[b - 1], None, b)
        if record is not None:  # a damaged record is judged from the record itself (_verdict)
            out.differing = statefp.compare_with_record(record, replayed)
            out.replica_match = statefp.match_replicas(record, replayed)
        if check_files:
            _, out.file_problem = _restore_problem(session, b, assignment)
        if out.file_problem and out.differing:  # the record or the files: which one is damaged?
            files = session.restore_files(b, assignment)
            out.files_match_replay = files is not None and \
                statefp.record_state(files, None, b).leaf_fps() == replayed.leaf_fps()
        if out.file_problem and (not out.differing or out.files_match_replay):
            out.end_state = kept[b - 1]
    out.seconds = time.perf_counter() - t0
    return out


def _verdict(session: Session, seg: Optional[_Segment], b: int, record: Any = _DISK) -> CheckpointVerdict:
    """The verdict of checkpoint ``b`` from its record (``record``: one in memory) and its segment's outcome."""
    run_dir = session.run.run_dir
    if record is _DISK:
        try:
            record = statefp.read_record(run_dir, b)
        except statefp.DamagedCheckpointError as e:
            return CheckpointVerdict(b, "damaged", str(e))
    if record is None:
        return CheckpointVerdict(b, "not_certifiable", f"checkpoint {b} has no state record (a run written before "
                                                       f"checkpoint fingerprints): it cannot be verified")
    span = (seg.a, seg.b) if seg else None
    where = dict(segment=span, placement=seg.placement if seg else None, steps_replayed=seg.steps if seg else 0,
                 seconds=round(seg.seconds, 4) if seg else 0.0)
    if not record.replicas_agree:
        named, unresolved, how = _name_odd_copies(record, seg)
        first = (record.disputes() or record.data["disagree"])[0]
        says = (f"an SDC in the update or in memory on device(s) {named}{how}" if named else
                "an SDC in the update or in memory")
        if unresolved:
            says += (f"; which of device(s) {unresolved} holds the wrong copy is not known (no majority of copies, "
                     "and the replay did not tell)")
        return CheckpointVerdict(
            b, "poisoned", f"at its save {statefp.dispute_text(first)} ({says}, at or before step {b - 1})",
            step=None, devices=tuple(named),
            leaves=tuple(sorted({x["leaf"] for x in record.data["disagree"]})), **where)
    if seg is None or seg.status != "done":
        why = seg.start_problem if seg else "no segment reached it"
        return CheckpointVerdict(b, "not_certifiable", f"no replay reached checkpoint {b}: the segment's start is "
                                                       f"unusable ({why})", **where)
    if seg.step_diff is not None:
        d = seg.step_diff
        devs = tuple(sorted(d.suspects)) if d.suspects else tuple(sorted(d.devices))
        kind = getattr(d.kind, "value", d.kind)  # the enum's value ("device"), not its repr
        return CheckpointVerdict(
            b, "poisoned", f"replaying {seg.a}:{seg.b} on good devices differs from the log at step {d.step} "
                           f"({kind}; device(s) {list(devs)}): the run's state after that step was wrong; for a "
                           f"verdict on the devices run 'replay --run {run_dir} --steps {d.step}:{d.step + 1}'",
            step=d.step, devices=devs, leaves=tuple(d.leaves), **where)
    if seg.differing and seg.file_problem:  # the files do not match the record either: damaged, not poisoned
        names = [x["leaf"] for x in seg.differing]
        if seg.files_match_replay:
            why = (f"its state record does not match its files in {len(names)} leaf/leaves ({names[:3]}), and "
                   f"replaying {seg.a}:{seg.b} on good devices reproduces the files in every leaf: the record was "
                   "damaged (or edited) after the save, not the state")
        else:
            why = (f"its files do not match its state record ({seg.file_problem}), and the replay of {seg.a}:{seg.b} "
                   "reaches neither: the checkpoint is damaged; whether its state was also poisoned cannot be told "
                   "from it")
        return CheckpointVerdict(b, "damaged", why, leaves=tuple(names), **where)
    if seg.differing:
        names = [x["leaf"] for x in seg.differing]
        return CheckpointVerdict(
            b, "poisoned", f"every step of {seg.a}:{seg.b} replays as logged, but the state it reaches differs from "
                           f"checkpoint {b}'s record in {len(names)} leaf/leaves ({names[:3]}): the state was "
                           "corrupted in the update or in memory, after the gradients were fingerprinted",
            leaves=tuple(names), **where)
    if not record.finite:
        return CheckpointVerdict(b, "not_certifiable", f"its state holds NaN/Inf ({dict(list(record.data['nonfinite'].items())[:3])}): "
                                                       "reproduced, but no rewind target", **where)
    if seg.file_problem:
        return CheckpointVerdict(b, "damaged", f"the replay reaches its record, but its files do not: "
                                               f"{seg.file_problem}", **where)
    return CheckpointVerdict(b, "certified", f"replaying {seg.a}:{seg.b} reproduces its state record in every leaf",
                             **where)


def _name_odd_copies(record: statefp.StateRecord, seg: Optional[_Segment]) -> tuple[list[int], list[int], str]:
    """``(named, unresolved, how)``: the devices holding a wrong copy of a poisoned checkpoint's state. A
    dispute with a strict majority names its odd copies; one without is settled by the replay of the
    segment when it can be: the copies the replayed state equals are right (the checkpoint followed the
    corruption with no step between), or else the devices whose step first differed from the log hold the
    wrong copy (the wrong copy was used by the step, and a copy never reaches another data replica's
    computation before the gradients are reduced). What nothing settles stays ``unresolved``: never a
    tie broken by device order, which would name a healthy chip."""
    named, unresolved, hows = set(record.odd_devices()), set(), set()
    diff_devs = set()
    if seg is not None and seg.step_diff is not None:
        d = seg.step_diff
        diff_devs = set(d.devices) | set(getattr(d, "reached", ()) or ()) | set(getattr(d, "suspects", ()) or ())
    for x in record.disputes():
        if x["majority"]:
            continue
        cands = set(x["devices"])
        match = set((seg.replica_match if seg is not None else {}).get((x["leaf"], x["shard"]), ()))
        if match and cands - match and match < cands:
            named |= cands - match
            hows.add("the replay reproduces the other copies")
        elif diff_devs and 0 < len(cands & diff_devs) < len(cands):
            named |= cands & diff_devs
            hows.add(f"its step {seg.step_diff.step} differed from the log, the other copies' did not")
        else:
            unresolved |= cands
    unresolved -= named
    how = f" ({'; '.join(sorted(hows))})" if hows else ""
    return sorted(named), sorted(unresolved), how


def judge_checkpoint(session: Session, a: int, b: int, record: statefp.StateRecord, *,
                     log: Mapping[int, Any], assignment: Sequence[int]) -> CheckpointVerdict:
    """The verdict ``replay certify`` gives checkpoint ``b`` when its state record is ``record`` (in memory:
    a drill's, ``replay.verify.faults``) and its steps logged ``log``: the segment ``a -> b`` replayed from
    checkpoint ``a`` on ``assignment`` (good devices), compared step by step with ``log`` and then with
    ``record``, exactly as the walk does; ``b``'s files are not checked (a drill writes none)."""
    seg = _segment(session, a, b, 0, tuple(assignment), lambda n=1: None, record=record, log=log, check_files=False)
    return _verdict(session, seg, b, record=record)


def certify(session: Session, *, start: Optional[int] = None, stop: Optional[int] = None, device_spec: str = "good",
            concurrent: bool = True, allow_env_drift: bool = False,
            progress: Optional[Callable[[int], Callable[[int], None]]] = None) -> CertifyReport:
    """Walks the run's checkpoint chain from ``start`` (default: its first checkpoint) to ``stop``
    (default: its newest) and judges each checkpoint (module docstring).

    Args:
      session: the opened run.
      start: the checkpoint taken as trusted (restored and checked against its record).
      stop: the last checkpoint to judge.
      device_spec: the devices to replay on (``replay.runtime.devices``); as many disjoint placements of the
        run's mesh as they hold run segments at the same time.
      concurrent: run placements on disjoint devices at the same time (False: one after the other).
      progress: ``total -> advance`` factory (total: the steps this process replays).

    Raises:
      RunDirError: no checkpoint at ``start``, fewer than two checkpoints to walk.
      replay.run.statefp.DamagedCheckpointError / PoisonedCheckpointError: the trusted checkpoint itself.
      EnvDriftError: the environment differs from the run's (``allow_env_drift``: certify anyway).
    """
    run = session.run
    check_mesh_shape(run, session.setup)
    chain = [c for c in run.checkpoints if (start is None or c >= start) and (stop is None or c <= stop)]
    if start is not None and start not in run.checkpoints:
        raise RunDirError(f"--from {start}: no checkpoint at that step (checkpoints: {run.checkpoints})")
    if len(chain) < 2:
        raise RunDirError(f"certify needs a trusted checkpoint and one after it; the chain from "
                          f"{start if start is not None else 'the first'} holds {chain} (checkpoints: {run.checkpoints})")
    logged = set(run.fingerprints)  # a malformed or damaged step's line is not in it: never compared
    reach = [chain[0]]  # each segment replays every step from the last kept checkpoint: stop at the first gap
    for c in chain[1:]:
        if not all(s in logged for s in range(reach[-1], c)):
            break
        reach.append(c)
    unreached = chain[len(reach):]  # past a step with no usable line: no replay reaches them (not_certifiable)
    if unreached:
        gap = next(s for s in range(reach[-1], unreached[0]) if s not in logged)
        no_line = (f"step {gap} has no usable line in fingerprints.jsonl ("
                   + (run.malformed[gap] if gap in run.malformed else "not logged") + ")")
        if len(reach) < 2:
            raise RunDirError(f"certify cannot replay from checkpoint {reach[0]} to {unreached[0]}: {no_line}; "
                              "certify from a checkpoint after it (--from)")
        unreached_why = f"no replay reached it: {no_line}; certify it with --from a checkpoint after step {gap}"
    chain = reach
    _, assignments, home = session.placements(device_spec)
    drift = environment_differences(run, session.mesh(home))
    if drift and not allow_env_drift:
        raise EnvDriftError(drift)
    trusted = chain[0]
    t0 = time.perf_counter()
    session.restore(trusted, home)  # the trusted checkpoint must itself match its record (raises otherwise)
    segs = list(zip(chain, chain[1:]))
    mine = session.my_lanes(assignments)
    # Segment k on placement k mod P: lanes take their placements' segments in order.
    task_of = {k: k % len(assignments) for k in range(len(segs))}
    my_steps = sum(b - a for k, (a, b) in enumerate(segs) if any(task_of[k] in lane for lane in mine))
    advance = _locked(progress(my_steps) if progress is not None else (lambda n=1: None))
    results: dict[int, _Segment] = {}

    def lane_work(lane):
        out = {}
        for k, (a, b) in enumerate(segs):
            if task_of[k] in lane:
                out[k] = _segment(session, a, b, task_of[k], assignments[task_of[k]], advance)
        return out

    results.update(run_lanes(mine, lane_work, concurrent, "certify-lane"))
    # Segments whose start checkpoint is damaged: from the previous segment's replayed state, in order.
    for k, (a, b) in enumerate(segs):
        seg = results.get(k)
        if seg is None or seg.status != "deferred":
            continue
        prev = results.get(k - 1)
        if prev is not None and prev.end_state is not None:
            results[k] = _segment(session, a, b, prev.placement, assignments[prev.placement], advance,
                                  start_state=prev.end_state)
            prev.end_state = None
    if session.process_count > 1:
        results = _gather(session, results, assignments)
    verdicts = [CheckpointVerdict(trusted, "trusted", f"taken as trusted ({'--from' if start is not None else 'the first checkpoint'}); "
                                                      "its files match its record")]
    poisoned = None
    for k, (_a, b) in enumerate(segs):
        if poisoned is not None:
            verdicts.append(CheckpointVerdict(b, "not_checked", f"after the poisoned checkpoint {poisoned}: its "
                                                                "descendants inherit its state"))
            continue
        v = _verdict(session, results.get(k), b)
        verdicts.append(v)
        if v.verdict == "poisoned":
            poisoned = b
    for c in unreached:
        verdicts.append(CheckpointVerdict(c, "not_checked", f"after the poisoned checkpoint {poisoned}: its descendants "
                                                            "inherit its state") if poisoned is not None
                        else CheckpointVerdict(c, "not_certifiable", unreached_why))
    for r in results.values():
        r.end_state = None
    steps = sum(r.steps for r in results.values())
    return CertifyReport(run_dir=run.run_dir, trusted=trusted, chain=verdicts, placements=[list(a) for a in assignments],
                         steps_replayed=steps, wall_seconds=time.perf_counter() - t0, concurrent=concurrent)


def _gather(session: Session, results: Mapping[int, _Segment], assignments: Sequence[Sequence[int]]
            ) -> dict[int, _Segment]:
    """Every process's segment outcomes (a collective): each reported by the lowest process of its
    placement; the step differences travel as the replayed step's judgement (kind, step, devices, leaves)."""
    from replay.runtime import distributed

    process_of = {i: d.process_index for i, d in session.jax_devices.items()}
    mine = []
    for k, r in results.items():
        if min(process_of[d] for d in assignments[r.placement]) == session.process_index:
            diff = None
            if r.step_diff is not None:
                d = r.step_diff
                diff = {"step": d.step, "kind": d.kind, "suspects": list(d.suspects), "devices": sorted(d.devices),
                        "leaves": list(d.leaves), "reached": sorted(getattr(d, "reached", ()) or ())}
            mine.append([k, r.a, r.b, r.placement, r.status, r.start_problem, diff, r.differing, r.file_problem,
                         r.steps, r.seconds, [[lf, sh, ds] for (lf, sh), ds in r.replica_match.items()],
                         r.files_match_replay])
    out: dict[int, _Segment] = {}
    for part in distributed.gather_json(mine):
        for k, a, b, p, status, sp, diff, differing, fprob, steps, secs, match, files in part:
            out[int(k)] = _Segment(a, b, p, status, sp, _Diff(**diff) if diff else None, differing, fprob, steps, secs,
                                   replica_match={(lf, sh): ds for lf, sh, ds in match}, files_match_replay=files)
    return out


@dataclasses.dataclass(frozen=True)
class _Diff:
    """A step difference as gathered from another process (the fields :func:`_verdict` reads)."""

    step: int
    kind: str
    suspects: tuple
    devices: tuple
    leaves: tuple
    reached: tuple = ()


# ----------------------------------------------------------------------------- the picture

COLORS = {"trusted": "#1f77b4", "certified": "#2ca02c", "poisoned": "#d62728", "damaged": "#ff7f0e",
          "not_certifiable": "#7f7f7f", "not_checked": "#c7c7c7"}


def plot_chain(report: Mapping[str, Any], path: str) -> str:
    """A PNG of the chain: checkpoints on a step axis, each a marker coloured by its verdict and labelled,
    the segments replayed drawn between them, the certified rewind target and a poisoned checkpoint's
    faulty step marked. Returns ``path``."""
    from common import figures

    plt = figures.pyplot()
    chain = report["chain"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(chain) + 2), 2.8))
    xs = [v["checkpoint"] for v in chain]
    ax.plot(xs, [0] * len(xs), color="#999999", lw=1, zorder=1)
    for v in chain:
        if v.get("segment"):
            a, b = v["segment"]
            ax.annotate("", xy=(b, 0.18), xytext=(a, 0.18),
                        arrowprops=dict(arrowstyle="->", color=COLORS[v["verdict"]], lw=1.2))
        ax.scatter([v["checkpoint"]], [0], s=220, color=COLORS[v["verdict"]], zorder=3, edgecolor="black")
        ax.text(v["checkpoint"], -0.22, v["verdict"].replace("_", " "), ha="center", va="top", fontsize=8,
                rotation=20)
        if v["verdict"] == "poisoned" and v.get("step") is not None:
            ax.axvline(v["step"], color=COLORS["poisoned"], ls=":", lw=1)
            ax.text(v["step"], 0.42, f"step {v['step']}\ndevices {v['devices']}", ha="center", fontsize=7,
                    color=COLORS["poisoned"])
        elif v["verdict"] == "poisoned" and v.get("devices"):
            ax.text(v["checkpoint"], 0.42, f"replicas differ:\ndevices {v['devices']}", ha="center", fontsize=7,
                    color=COLORS["poisoned"])
    if report.get("certified") is not None:
        ax.scatter([report["certified"]], [0], s=520, facecolor="none", edgecolor=COLORS["certified"], lw=2.5,
                   zorder=4, label=f"rewind target: checkpoint {report['certified']}")
        ax.legend(loc="upper left", fontsize=8, frameon=False, markerscale=0.4)
    ax.set_ylim(-0.8, 0.8)
    ax.set_yticks([])
    ax.set_xticks(xs)
    ax.set_xlabel("step (checkpoint)")
    pad = max(1, (max(xs) - min(xs)) * 0.06)
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"replay certify: {report['run_dir']} ({report['steps_replayed']} steps replayed)", fontsize=9)
    fig.tight_layout()
    return figures.save(fig, path, dpi=110)
