"""What a run trained with: its mixture config (a copy) and its dataset (the manifest's sha256).

A run's batches are a pure function of (manifest, mixture schedule, seed, global batch, step)
(DESIGN.md), and the run config names the mixture and the dataset by path only. Edit the mixture
after training (a phase weight, say) and a rebuilt batch is another batch: ``replay inspect`` would
list other documents than those trained on. So the training loop keeps, at its first start::

    <run>/mixture.yaml   the mixture config as it trained (MixtureConfig.to_dict(): paths absolute)
    <run>/inputs.json    {"version": 1,
                          "mixture": {"path": the config's mixture path, "sha256": MixtureConfig.sha256(),
                                      "copy": "mixture.yaml"},
                          "dataset": {"path": ..., "manifest_sha256": sha256 of manifest.json's bytes},
                          "schedule": the loader's Schedule.to_dict() without skip windows}

and every command that rebuilds batches (:func:`resolve` then :func:`check_rebuilt`) *uses* the
copy of the mixture, saying so when the file at the path has changed, and *refuses* a dataset
whose manifest is not the one the run trained with (a dataset cannot be copied; its manifest
names every shard's sha256). A run directory written before this record existed has no copy:
then the rebuilt loader is checked against the loader state saved in the run's first checkpoint
(same manifest hash and schedule, every difference named), and refused if it differs.

I/O here is small files only; no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional, Sequence

from replay.run.protocol import CHECKPOINTS_DIR, INPUTS_NAME, MIXTURE_COPY_NAME

INPUTS_VERSION = 1
SCHEDULE_KEYS = ("sources", "records", "phases", "global_batch", "seed", "max_period")


class InputsChangedError(ValueError):
    """The dataset (or, for an old run directory, the mixture) is not what the run trained with."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Which mixture config a command uses for a run.

    Attributes:
      mixture: the path to load (the run's copy when the run kept one).
      source: ``"run copy"`` or ``"path"`` (an old run directory: checked against its checkpoint).
      notes: what to tell the user (empty when the copy and the file agree).
    """

    mixture: str
    source: str
    notes: tuple[str, ...] = ()


def _schedule_core(schedule: Mapping[str, Any]) -> dict[str, Any]:
    return {k: schedule.get(k) for k in SCHEDULE_KEYS}


def record_inputs(run_dir: str, mixture: Any, mixture_path: str, dataset: str, manifest_sha256: str,
                  schedule: Mapping[str, Any]) -> bool:
    """Writes ``mixture.yaml`` and ``inputs.json`` (module docstring) unless ``inputs.json`` exists;
    returns whether it wrote them. Both go through a temporary name (a kill leaves none or both
    whole; ``inputs.json`` is written last, as the marker).

    Args:
      mixture: the ``contract.config.MixtureConfig`` the loader was built from.
      mixture_path: the run config's ``mixture`` path; dataset: its ``dataset``.
      manifest_sha256, schedule: the loader's (``DataLoader.manifest_sha256``, ``schedule.to_dict()``).
    """
    import yaml

    path = os.path.join(run_dir, INPUTS_NAME)
    if os.path.exists(path):
        return False
    copy = os.path.join(run_dir, MIXTURE_COPY_NAME)
    tmp = copy + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("# The mixture config this run trained with (written by the training loop at its first start;\n"
                "# replay commands use this copy: replay.run.inputs). Paths are absolute.\n")
        yaml.safe_dump(mixture.to_dict(), f, sort_keys=False)
    os.replace(tmp, copy)
    rec = {"version": INPUTS_VERSION,
           "mixture": {"path": mixture_path, "sha256": mixture.sha256(), "copy": MIXTURE_COPY_NAME},
           "dataset": {"path": dataset, "manifest_sha256": manifest_sha256},
           "schedule": _schedule_core(schedule)}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return True


def read_inputs(run_dir: str) -> Optional[dict[str, Any]]:
    """``inputs.json`` of the run, or None (a run directory written before it existed).

    Raises:
      InputsChangedError: the file exists but is not a valid record (``protocol.InputsRecord``,
        ``schemas/run_log/inputs.schema.json``): names the file, the key path and what to do.
    """
    from replay.run.protocol import InputsRecord, record_problem

    path = os.path.join(run_dir, INPUTS_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        why = repr(e)
    else:
        why = record_problem(rec, InputsRecord)
    if why is not None:
        raise InputsChangedError(f"{path}: not a record of the run's inputs ({why}): the training loop writes it at "
                                 "the run's first start (schemas/run_log/inputs.schema.json); restore it from a copy of "
                                 "the run directory, or move it aside to check the rebuilt batches against the run's "
                                 "first checkpoint instead") from None
    return rec


def mixture_sha256(path: str) -> Optional[str]:
    """``MixtureConfig.sha256()`` of the mixture config at ``path``, or None when it is missing or invalid."""
    from contract.config import ConfigError, load_mixture

    try:
        return load_mixture(path).sha256()
    except (ConfigError, OSError, ValueError):
        return None


def resolve(run_dir: str, config: Mapping[str, Any]) -> Resolved:
    """The mixture a command should rebuild the run's batches with (module docstring).

    Args:
      run_dir: the run directory; config: its run config (``mixture``: the path it trained with).

    Returns:
      The :class:`Resolved` mixture; the copy's path is absolute (a run config's relative paths are
      resolved against the run directory, which a relative ``run_dir`` would count twice).

    Raises:
      InputsChangedError: ``inputs.json`` is malformed, or names a copy that is missing.
    """
    rec = read_inputs(run_dir)
    given = str(config.get("mixture", ""))
    if rec is None:
        return Resolved(given, "path", ())
    copy = os.path.abspath(os.path.join(run_dir, rec["mixture"].get("copy") or MIXTURE_COPY_NAME))
    if not os.path.isfile(copy):
        raise InputsChangedError(f"{copy}: the run's copy of its mixture config is missing (named by "
                                 f"{os.path.join(run_dir, INPUTS_NAME)})")
    notes = []
    original = rec["mixture"].get("path") or given
    now = mixture_sha256(original) if original else None
    copy_now = mixture_sha256(copy)
    what = ("the config it trained with" if copy_now == rec["mixture"]["sha256"] else
            f"which was itself edited since (sha256 {(copy_now or 'unreadable')[:12]} now, "
            f"{rec['mixture']['sha256'][:12]} when the run trained): the rebuilt batches are checked against the run's")
    if now is None:
        notes.append(f"mixture: {original} is missing or invalid now; using the run's copy {copy}, {what}")
    elif now != rec["mixture"]["sha256"]:
        notes.append(f"mixture: {original} changed since the run trained with it (sha256 {rec['mixture']['sha256'][:12]}"
                     f" then, {now[:12]} now); using the run's copy {copy}, {what}")
    return Resolved(copy, "run copy", tuple(notes))


def _first_checkpoint_loader_state(run_dir: str, checkpoints: Sequence[int]) -> Optional[dict[str, Any]]:
    """The loader state saved in the run's first checkpoint (the reference trainer's Orbax layout
    ``checkpoints/<step>/loader/metadata``), or None."""
    for c in sorted(checkpoints):
        path = os.path.join(run_dir, CHECKPOINTS_DIR, str(c), "loader", "metadata")
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
            if isinstance(state, dict) and "schedule" in state and "manifest_sha256" in state:
                return state
        except (OSError, ValueError):
            continue
    return None


def check_rebuilt(run_dir: str, manifest_sha256: str, schedule: Mapping[str, Any], dataset: str,
                  checkpoints: Sequence[int] = ()) -> str:
    """Refuses a rebuilt loader whose dataset or schedule is not the run's (module docstring).

    Args:
      manifest_sha256, schedule: the rebuilt loader's (``DataLoader.manifest_sha256``, ``schedule.to_dict()``).
      dataset: the dataset path (for the message); checkpoints: the run's checkpoint steps (old runs).

    Returns:
      what was checked against: ``"inputs.json"``, ``"checkpoint <step>"`` or ``"nothing"`` (an old
      run whose checkpoints hold no loader state this module can read).

    Raises:
      InputsChangedError: the manifest's sha256 or the schedule differs (each difference named).
    """
    rec = read_inputs(run_dir)
    where = os.path.join(run_dir, INPUTS_NAME)
    if rec is not None:
        want_manifest, want_schedule = rec["dataset"]["manifest_sha256"], rec.get("schedule")
    else:
        state = _first_checkpoint_loader_state(run_dir, checkpoints)
        if state is None:
            return "nothing"
        where = f"the loader state of {os.path.join(run_dir, CHECKPOINTS_DIR)}/{min(checkpoints)}"
        want_manifest, want_schedule = state["manifest_sha256"], state["schedule"]
    problems = []
    if want_manifest != manifest_sha256:
        problems.append(f"the dataset at {dataset} is not the one the run trained with: its manifest.json has sha256 "
                        f"{manifest_sha256[:16]}..., the run trained on {want_manifest[:16]}... (recorded in {where}); "
                        "restore that dataset, or point the run config's 'dataset' at it")
    if want_schedule is not None:
        old, new = _schedule_core(want_schedule), _schedule_core(schedule)
        changed = [f"{k} {old[k]} -> {new[k]}" for k in SCHEDULE_KEYS if old[k] != new[k]]
        if changed:
            problems.append("the mixture schedule differs from the one the run trained with ("
                            + "; ".join(changed) + f"; recorded in {where})"
                            + ("" if rec is not None else ": this run directory predates the run's own copy of its "
                               "mixture, so restore the mixture config it trained with"))
    if problems:
        raise InputsChangedError("; ".join(problems))
    return "inputs.json" if rec is not None else f"checkpoint {min(checkpoints)}"
