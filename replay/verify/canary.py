"""``replay canary``: the canary of :mod:`replay.run.canary` run on chosen devices, each several times.

The canary's identity, its fingerprints signature, its golden table and its decision live in
:mod:`replay.run.canary` (the training loop's periodic canary uses them too); this module
rebuilds the canary batch through a replay session, runs it on every chosen device and repeat,
and reports.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from replay.runtime import devices as dv
from replay.runtime import distributed
from replay.run.canary import (
    GOLDEN_DEFAULT,
    CanaryDecision,
    CanarySpec,
    DeviceResult,
    batch_sha256,
    decide_canary,
    environment_key,
    fingerprints_signature,
    read_golden,
    update_golden,
)
from replay.run.protocol import FaultSpec


@dataclasses.dataclass
class CanaryReport:
    spec: CanarySpec
    env_key: str
    devices: list[DeviceResult]
    decision: CanaryDecision
    golden_path: Optional[str]
    repeats: int
    table: dict = dataclasses.field(default_factory=dict)  # device id -> replay.runtime.devices.DeviceInfo

    @property
    def exit_code(self) -> int:
        return int(self.decision.verdict.exit_code)

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "kind": "canary",
            "canary": self.spec.to_dict(),
            "environment_key": self.env_key,
            "golden": {"status": d.golden_status, "path": self.golden_path, "signature": d.reference},
            "repeats": self.repeats,
            "devices": [
                {"id": r.id, "signature": r.signatures[0], "signatures": list(r.signatures),
                 "repeats_agree": r.repeats_agree, "status": d.statuses[r.id],
                 "label": dv.describe(r.id, self.table).label()}
                for r in self.devices
            ],
            "verdict": d.verdict.value,
            "exit_code": self.exit_code,
            "odd_devices": list(d.odd_devices),
            "odd": dv.name_devices(d.odd_devices, self.table),
            "explanation": d.explanation,
        }


def run_canary(
    session: Any,
    *,
    device_spec: str = "all",
    repeats: int = 2,
    checkpoint: Optional[int] = None,
    step: Optional[int] = None,
    rows: Optional[int] = None,
    seq_len: Optional[int] = None,
    golden_path: Optional[str] = "default",
    reset_golden: bool = False,
    fault: Optional[FaultSpec] = None,
    advance=lambda n=1: None,
    progress=None,
) -> CanaryReport:
    """Runs the canary on each chosen device ``repeats`` times and judges it (module docstring).

    Args:
      session: a ``replay.verify.engine.Session``.
      device_spec: see ``replay.runtime.devices`` (any number of devices >= 1).
      repeats: runs per device, >= 1.
      checkpoint: weights from this checkpoint step; None: the trainer's init from the run
        config's ``canary.seed``.
      step, rows, seq_len: the canary batch: the first ``rows`` rows of the global batch of
        ``step``, each cut to its first ``seq_len`` slots (a valid packed prefix: segment ids and
        positions are cut with the tokens). Defaults: the run config's ``canary.step``,
        ``canary.rows`` and ``canary.seq_len`` (``Setup.canary_*``; the whole global batch and
        whole rows where the setup gives none). ``seq_len`` >= 2, at most the row length.
      golden_path: golden table file; "default": ``<run>/canary/golden.json``; None: in memory only.
      reset_golden: ignore and overwrite this environment's golden value.
      fault: a drill: flips a bit in ``fault.device_id``'s gradient.
      advance: called with 1 after each canary run (one device, one repeat).
      progress: a ``total -> advance`` factory (``replay.runtime.progress.StepProgress.advance``), called
        once with the number of runs (devices x repeats) when they are known; replaces ``advance``.

    Raises:
      replay.runtime.devices.DeviceSpecError; replay.run.runlog.RunDirError (no such checkpoint); ValueError.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    run, setup = session.run, session.setup
    step = setup.canary_step if step is None else step
    if rows is None:
        rows = min(setup.canary_rows or setup.global_batch, setup.global_batch)
    if not 1 <= rows <= setup.global_batch:
        raise ValueError(f"canary rows must be in [1, {setup.global_batch}], got {rows}")
    seq_len = setup.canary_seq_len if seq_len is None else seq_len
    if step < 0:
        raise ValueError(f"canary step must be >= 0, got {step}")
    chosen = session.chosen_devices(device_spec, 1)
    path = os.path.join(run.run_dir, GOLDEN_DEFAULT) if golden_path == "default" else golden_path
    if not reset_golden:
        read_golden(path)  # a corrupt golden file is reported before any device work
    host = session.numpy_batch(step)
    row_len = int(next(iter(host.values())).shape[1])
    if seq_len is not None and not 2 <= seq_len <= row_len:
        raise ValueError(f"canary seq_len must be in [2, {row_len}] (the row length), got {seq_len}")
    if seq_len == row_len:
        seq_len = None  # whole rows: the same canary as without a cut
    batch = {k: v[:rows, :seq_len] for k, v in host.items()}
    if checkpoint is not None:
        if checkpoint not in run.checkpoints:
            from replay.run.runlog import MissingCheckpointError

            raise MissingCheckpointError(f"no checkpoint {checkpoint}; checkpoints: {run.checkpoints or 'none'}")
        state = session.restore(checkpoint, "local")  # on one device of this process: copied to each device
        weights = f"checkpoint:{checkpoint}"
    else:
        state = session.init_state("local", setup.canary_seed)
        weights = f"init:{setup.canary_seed}"
    spec = CanarySpec(step=step, rows=rows, weights=weights, batch_sha256=batch_sha256(batch), seq_len=seq_len)
    env_key = environment_key(spec, run.env)
    mine = [d for d in chosen if session.is_local(d.id)]  # each process runs its own devices
    if progress is not None:
        advance = progress(len(mine) * repeats)
    # Read before any device work, written after (by process 0): every process decides from the same value.
    golden = None if reset_golden else (read_golden(path).get(env_key) or {}).get("signature")
    local = []
    for d in mine:
        dev = session.jax_devices[d.id]
        sigs, fps = [], {}
        for _ in range(repeats):
            fps = setup.trainer.single_device_fingerprints(state, batch, dev, fault)
            sigs.append(fingerprints_signature(fps))
            advance(1)
        local.append([d.id, sigs, {k: int(v) for k, v in fps.items()}])
    by_id = {}
    for part in (distributed.gather_json(local) if session.process_count > 1 else [local]):
        for i, sigs, fps in part:
            by_id[int(i)] = DeviceResult(int(i), tuple(sigs), dict(fps))
    results = [by_id[d.id] for d in chosen]
    decision = decide_canary(results, golden)
    if (path is not None and decision.golden_status == "created" and fault is None
            and session.process_index == 0):
        try:
            update_golden(path, env_key, {"signature": decision.reference, "canary": spec.to_dict(),
                                           "created_from": f"majority of {len(results)} device(s)"}, reset_golden)
        except OSError as e:  # e.g. a read-only run directory: the verdict stands, the golden value is not kept
            decision = dataclasses.replace(
                decision, golden_status="created-not-saved",
                explanation=f"{decision.explanation} (the golden value could not be saved to {path}: "
                            f"{e.strerror or e}; pass --golden FILE)")
    return CanaryReport(spec, env_key, results, decision, path, repeats, session.device_table())
