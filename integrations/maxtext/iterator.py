"""MaxText's data iterator, fed by ``loader.build``: global batches on MaxText's mesh, state in its checkpoint.

MaxText's training loop calls ``next(iterator)`` for each step's batch, a dict of global ``jax.Array``
with MaxText's names (the loader's six keys are MaxText's: ``inputs``, ``targets``,
``inputs_segmentation``, ``targets_segmentation``, ``inputs_position``, ``targets_position``, int32
``[global_batch, seq_len]``). Its checkpointing saves a non-Grain iterator of a ``dataset_type=grain``
run by calling ``get_state()`` (bytes) and writing their text to ``checkpoints/<step>/iter/``, and on
restore calls ``set_state(bytes)`` (``integrations.maxtext.internals``). The state here is the loader
state's JSON (next step plus the fingerprint of the order's inputs: a few hundred bytes), so a
restore continues at exactly the next step, whatever the prefetch depth or host count, and the batch
stays a pure function of the step.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional


def input_data_axes(config: Any, mesh: Any) -> tuple[str, ...]:
    """The mesh axes MaxText shards the batch dimension over (its ``get_input_data_sharding``), e.g.
    ``("data", "expert")`` for ``ici_data_parallelism=2 ici_expert_parallelism=2``."""
    from integrations.maxtext import internals

    spec = internals.get("maxtext.utils.sharding", "get_input_data_sharding")(config, mesh).spec
    first = spec[0] if len(spec) else None
    if first is None:
        return ()
    return tuple(first) if isinstance(first, (tuple, list)) else (first,)


def build_loader(config: Any, mesh: Any, *, mixture: str, dataset: str, seed: int, state: Optional[dict] = None,
                 planned_steps: Optional[int] = None, global_batch: Optional[int] = None) -> Any:
    """``loader.build`` for a MaxText config: global batch ``global_batch`` rows (default MaxText's
    ``global_batch_size_to_train_on``, which it derives from ``per_device_batch_size`` and the process's
    device count: replay passes the run's recorded one) of ``config.max_target_length`` tokens, split
    over MaxText's input data axes on ``mesh``.

    Raises:
      ValueError: the dataset's row length is not MaxText's ``max_target_length`` (names both).
      Everything ``loader.build`` raises (dataset, mixture, resume errors, each named).
    """
    import loader

    data = loader.build(mixture=mixture, dataset=dataset, global_batch=int(global_batch or config.global_batch_size_to_train_on),
                        mesh=mesh, seed=seed, data_axes=input_data_axes(config, mesh), state=state,
                        planned_steps=planned_steps)
    if int(data.seq_len) != int(config.max_target_length):
        raise ValueError(f"dataset {dataset} packs rows of {data.seq_len} tokens but MaxText's max_target_length is "
                         f"{config.max_target_length}: pass max_target_length={data.seq_len}, or pack the dataset with "
                         f"seq_len {config.max_target_length}")
    return data


class LoaderIterator:
    """The iterator MaxText's loop pulls batches from (``create_data_iterator``'s train iterator).

    Args:
      data: a ``loader.DataLoader`` built on MaxText's mesh (:func:`build_loader`).

    State (``get_state``/``set_state``): UTF-8 bytes of ``json.dumps(data.state().to_dict())``.
    """

    def __init__(self, data: Any):
        self.data = data
        self._it: Optional[Iterator] = None
        self.step: Optional[int] = None  # the step of the last batch returned

    def __iter__(self) -> "LoaderIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self.data.iterate()
        self.step, batch = next(self._it)
        return batch

    def _reset(self) -> None:
        if self._it is not None:
            self._it.close()
        self._it = None

    def get_state(self) -> bytes:
        """The loader state (its next step: the step after the last batch returned), JSON as bytes."""
        return json.dumps(self.data.state().to_dict(), sort_keys=True).encode()

    def set_state(self, state: bytes | str | dict) -> None:
        """Continues from a state of :meth:`get_state` (the next ``next()`` returns its next step's batch).

        Raises:
          loader.state.ResumeError: the state does not fit this loader (names what changed).
        """
        if isinstance(state, (bytes, bytearray)):
            state = state.decode()
        if isinstance(state, str):
            state = json.loads(state)
        self._reset()
        self.data = self.data.restore(state)

    def close(self) -> None:
        self._reset()
