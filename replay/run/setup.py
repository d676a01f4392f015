"""What replay needs to rebuild a run: its trainer, mesh and loader (:class:`RunSetup`).

A trainer, the reference one or a user's, hands replay one :class:`RunSetup`; every ``replay``
command rebuilds batches and steps through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np


@dataclasses.dataclass
class RunSetup:
    """How to rebuild a run's trainer, mesh and loader (read from its run config once).

    Attributes:
      trainer: an object implementing ``replay.run.protocol.Trainer``.
      axis_names: the run's mesh axes; shape: their sizes.
      run_device_ids: device ids of the run's mesh, row-major.
      make_loader: ``mesh -> loader`` (``loader.build(...)`` with the run's mixture, dataset,
        global batch, seed, data axes and skip windows).
      seed: the run's seed.
      global_batch: rows per step.
      mixture, dataset: the mixture config path and the packed dataset folder.
      canary_step, canary_seed: the canary batch's step and the seed of the canary weights.
      canary_rows, canary_seq_len: the default canary batch of ``replay canary``: its first
        ``canary_rows`` rows (None: the whole global batch), each cut to its first
        ``canary_seq_len`` slots (None: whole rows), the run config's ``canary.rows`` and
        ``canary.seq_len``.
    """

    trainer: Any
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    run_device_ids: tuple[int, ...]
    make_loader: Callable[[Any], Any]
    seed: int
    global_batch: int
    mixture: Any = None
    dataset: Optional[str] = None
    canary_step: int = 0
    canary_seed: int = 0
    canary_rows: Optional[int] = None
    canary_seq_len: Optional[int] = None

    @property
    def mesh_size(self) -> int:
        return int(np.prod(self.shape))
