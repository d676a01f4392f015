"""Bit-rot drills: single-byte flips in a checkpoint's files, and what each one does to a restore.

Each drill flips one byte (XOR with a non-zero mask) in one file of a copy of a committed checkpoint,
restores the copy through the run's trainer and sorts the outcome:

* ``raised``: Orbax / TensorStore refused the files (a checksum, a header, a decoder);
* ``caught``: the restore succeeded and the state record (``replay.run.statefp``) caught the change:
  a damaged checkpoint, named by leaf and shard;
* ``no_effect``: the restore succeeded and the restored state is *shown* bit-identical to the intact
  checkpoint's (every leaf's bytes compared, and the loader state), so there was nothing to catch
  (bytes no read visits: padding, an unused index entry, a file of another item);
* ``missed``: the restored state differs from the intact one and nothing said so (the defect the
  record exists to prevent; expected 0).

A range replay of the damaged copy (:func:`replay_verdict`) must never convict a device.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from typing import Any, Callable, Optional

import numpy as np

OUTCOMES = ("raised", "caught", "no_effect", "missed")


@dataclasses.dataclass(frozen=True)
class Flip:
    """One drill: byte ``offset`` of ``file`` (relative to the checkpoint folder) XOR ``mask``."""

    file: str
    offset: int
    mask: int


def checkpoint_files(ckpt_dir: str) -> list[tuple[str, int]]:
    """``(path relative to ckpt_dir, size)`` of every non-empty file of a checkpoint folder, sorted."""
    out = []
    for root, _, names in os.walk(ckpt_dir):
        for n in names:
            p = os.path.join(root, n)
            size = os.path.getsize(p)
            if size:
                out.append((os.path.relpath(p, ckpt_dir), size))
    return sorted(out)


def plan_flips(ckpt_dir: str, n: int, seed: int) -> list[Flip]:
    """``n`` flips over the checkpoint's files, each byte of the folder equally likely (so the big
    data files get most), masks from the grid ``1 << b`` (b = 0..7) and ``0xFF``; seeded."""
    files = checkpoint_files(ckpt_dir)
    total = sum(s for _, s in files)
    rng = random.Random(seed)
    masks = [1 << b for b in range(8)] + [0xFF]
    out = []
    for _ in range(n):
        k = rng.randrange(total)
        for name, size in files:
            if k < size:
                out.append(Flip(name, k, rng.choice(masks)))
                break
            k -= size
    return out


def apply_flip(ckpt_dir: str, flip: Flip) -> None:
    path = os.path.join(ckpt_dir, flip.file)
    with open(path, "r+b") as f:
        f.seek(flip.offset)
        b = f.read(1)
        f.seek(flip.offset)
        f.write(bytes([b[0] ^ flip.mask]))


def _bits(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def states_identical(a: Any, b: Any) -> bool:
    """Whether two restored states hold the same bytes in every leaf (NaN payloads included)."""
    import jax

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).shape == np.asarray(y).shape and np.array_equal(_bits(x), _bits(y)) for x, y in zip(la, lb))


def classify(run_dir: str, step: int, restore: Callable[[str, int], tuple[Any, Any]], intact: tuple[Any, Any]
             ) -> tuple[str, str]:
    """``(outcome, detail)`` of restoring checkpoint ``step`` of ``run_dir`` (already damaged) through
    ``restore(run_dir, step) -> (state, loader_state)``, against the ``intact`` restore."""
    from replay.run import statefp

    try:
        state, loader_state = restore(run_dir, step)
    except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many kinds
        return "raised", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    try:
        statefp.verify_restored(run_dir, step, state, loader_state)
    except statefp.DamagedCheckpointError as e:
        return "caught", f"leaf {e.leaf} shard {e.shard}"
    if states_identical(state, intact[0]) and dict(loader_state or {}) == dict(intact[1] or {}):
        return "no_effect", "restored state bit-identical to the intact checkpoint's"
    return "missed", "restored state differs and the record did not catch it"


def copy_run(src: str, dst: str) -> str:
    """A copy of a run directory for drills (superseded history left out)."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("superseded"))
    return dst


def run_drills(run_dir: str, step: int, flips: list[Flip], restore: Callable[[str, int], tuple[Any, Any]],
               scratch: str, judge: Optional[Callable[[str], str]] = None,
               progress: Callable[[int], None] = lambda n=1: None) -> dict[str, Any]:
    """Runs each flip on a fresh copy of the checkpoint in ``scratch`` (a copy of ``run_dir``).

    Args:
      judge: ``judge(copy_dir) -> verdict`` (e.g. a range replay's verdict value or exit kind), called
        on every damaged copy: ``"convicted"`` counts as a device convicted.

    Returns:
      ``{"counts": {outcome: n}, "device_convicted": n, "drills": [{file, offset, mask, outcome, detail, verdict}]}``.
    """
    work = copy_run(run_dir, os.path.join(scratch, "run"))
    ckpt = os.path.join(work, "checkpoints", str(step))
    pristine = os.path.join(scratch, "pristine")
    if os.path.exists(pristine):
        shutil.rmtree(pristine)
    shutil.copytree(ckpt, pristine)
    intact = restore(work, step)
    counts = {k: 0 for k in OUTCOMES}
    convicted, rows = 0, []
    for flip in flips:
        apply_flip(ckpt, flip)
        outcome, detail = classify(work, step, restore, intact)
        verdict = judge(work) if judge is not None else None
        convicted += verdict == "convicted"
        counts[outcome] += 1
        rows.append({**dataclasses.asdict(flip), "outcome": outcome, "detail": detail, "verdict": verdict})
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        progress(1)
    return {"counts": counts, "device_convicted": convicted, "drills": rows}
