"""How many epochs of each source a planned run sees: arithmetic on the mixture, no I/O.

A small source at a high weight repeats: with weights ``w_k`` (normalized per phase) and a
global batch of ``B`` rows, source ``k`` gives ``B * w_k`` rows a step, so a run of ``S``
steps draws

    rows_k = sum over phases p of  B * (steps of the run in phase p) * w_{p,k}

rows of it, and sees ``epochs_k = rows_k / records_k`` epochs of its ``records_k`` packed
rows. Within a phase the loader's interleave keeps every prefix within one row of
``weight x rows`` (``loader.index``, Tijdeman's bound), so ``rows_k`` here is within one
row a phase of what the loader draws; the loader itself counts exactly
(``loader.DataLoader.epochs``). A plan in tokens is ``S = ceil(tokens / (B * seq_len))``
steps: rows are full, so they count tokens to within the padding fraction.

Repeating data costs little up to about 4 epochs and helps less and less beyond
(N. Muennighoff et al., "Scaling Data-Constrained Language Models", NeurIPS 2023: up to 4
epochs were about as good as unique data; the value of more repeats decays quickly after);
:data:`DEFAULT_MAX_EPOCHS` is that threshold for the warning.

Used by ``dataprep.pack`` (``--train-steps``/``--train-tokens`` with ``--global-batch``)
after packing, and by the loader (``loader.build(..., planned_steps=...)``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

DEFAULT_MAX_EPOCHS = 4.0


class PlanError(ValueError):
    """A planned run's steps, tokens or global batch is out of range; the message names it."""


@dataclasses.dataclass(frozen=True)
class SourceEpochs:
    """One source over a planned run.

    Attributes:
      source: its name.
      records: packed rows it has (one epoch).
      rows: rows the run draws from it (float at pack time, within a row a phase; exact
        from the loader).
      epochs: ``rows / records`` (0 for a source the run never draws from).
      steps_per_epoch: steps an epoch lasts at its highest weight in the run (None when the
        run never draws from it).
    """

    source: str
    records: int
    rows: float
    epochs: float
    steps_per_epoch: Optional[float]


def steps_for_tokens(tokens: int, global_batch: int, seq_len: int) -> int:
    """``ceil(tokens / (global_batch * seq_len))``: the steps of a run of ``tokens`` training tokens.

    Raises:
      PlanError: a value below 1.
    """
    for name, value in (("--train-tokens", tokens), ("--global-batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}: must be an integer >= 1, got {value!r}")
    return -(-tokens // (global_batch * seq_len))


def phase_rows(phase_starts: Sequence[int], steps: int, global_batch: int) -> list[int]:
    """Rows of each phase within steps ``[0, steps)`` (phases start at ``phase_starts``, the first at 0)."""
    ends = [*phase_starts[1:], None]
    return [max(0, min(steps, steps if e is None else e) - s) * global_batch for s, e in zip(phase_starts, ends)]


def source_epochs(
    phases: Sequence[tuple[int, Mapping[str, float]]],
    records: Mapping[str, int],
    steps: int,
    global_batch: int,
) -> list[SourceEpochs]:
    """Epochs of each source over steps ``[0, steps)`` (module docstring).

    Args:
      phases: ``(from_step, weights by source)`` of each phase, the first at step 0
        (``MixtureConfig.phases``); weights are normalized per phase.
      records: packed rows of each source, in the order reported.
      steps: planned training steps, >= 1.
      global_batch: rows per step, >= 1.

    Raises:
      PlanError: ``steps`` or ``global_batch`` below 1, or no phase.
    """
    for name, value in (("--train-steps", steps), ("--global-batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}: must be an integer >= 1, got {value!r}")
    if not phases:
        raise PlanError("the mixture has no phase")
    rows_in = phase_rows([p for p, _ in phases], steps, global_batch)
    out = []
    for name, n in records.items():
        rows, top = 0.0, 0.0
        for (_, weights), r in zip(phases, rows_in):
            total = sum(weights.values())
            share = weights.get(name, 0.0) / total if total else 0.0
            rows += r * share
            if r:
                top = max(top, share)
        per_epoch = n / (global_batch * top) if top and n else None
        out.append(SourceEpochs(name, n, rows, rows / n if n else 0.0, per_epoch))
    return out


def describe(items: Sequence[SourceEpochs], steps: int, global_batch: int,
             max_epochs: float = DEFAULT_MAX_EPOCHS) -> tuple[list[str], list[str]]:
    """The lines that say how often each source repeats, and the warnings above ``max_epochs``.

    Returns:
      ``(lines, warnings)``: one line per source (``web: 1,234 rows, 0.81 epochs in 10,000
      steps of 256 rows (an epoch every 12,340 steps)``), and one warning per source over
      ``max_epochs`` saying what to change.
    """
    lines, warnings = [], []
    for e in items:
        every = (f" (an epoch every {e.steps_per_epoch:,.1f} steps at its highest weight)"
                 if e.steps_per_epoch is not None else " (never drawn)")
        lines.append(f"{e.source}: {e.records:,} rows, {e.epochs:,.2f} epochs in {steps:,} steps of "
                     f"{global_batch:,} rows{every}")
        if e.epochs > max_epochs:
            warnings.append(
                f"source {e.source!r} repeats {e.epochs:,.1f} times in the planned {steps:,} steps (an epoch every "
                f"{e.steps_per_epoch:,.1f} steps), over {max_epochs:g} epochs, beyond which repeated data helps "
                "less and less (Muennighoff et al. 2023); lower its weight, add documents to it, or plan fewer steps"
            )
    return lines, warnings


def epoch_lengths(phases: Sequence[tuple[int, Mapping[str, float]]], records: Mapping[str, int]) -> list[str]:
    """Without a plan: for each source, the training rows one epoch of it lasts at its first
    weight above 0 (``books: 120 rows, one epoch every 400 rows of training from step 0``)."""
    out = []
    for name, n in records.items():
        for start, weights in phases:
            total = sum(weights.values())
            share = weights.get(name, 0.0) / total if total else 0.0
            if share > 0:
                out.append(f"{name}: {n:,} rows, one epoch every {math.ceil(n / share):,} rows of training "
                           f"(weight {share:.3g} from step {start:,})")
                break
        else:
            out.append(f"{name}: {n:,} rows, weight 0 in every phase")
    return out
