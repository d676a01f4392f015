"""The test kit of the loader: the slower reference forms the tests compare the loader against.

The loader's one implementation (``loader.arrays.pack_records``, ``loader.device.derive``) is
checked against :func:`pack_inputs` (tokens, segment ids and positions of ``PackedRow`` s, row
by row), :func:`derive_batch` (the six trainer arrays from them) and :func:`dense_batch` (both).
The loader never runs them, and no command imports this module.

For the tests' convenience it also hands on the synthetic dataset's names
(:mod:`loader.synthetic`: ``write_synthetic_dataset``, ``synthetic_mixture``, ...), so that a
test imports one module: ``from loader import testing as lt``.

May import: ``contract`` and ``loader.synthetic`` (the references stand apart from what they check).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from contract import codec
from loader.synthetic import (  # noqa: F401  (handed on to the tests)
    SYNTHETIC_RELPATH,
    row_origin,
    synthetic_mixture,
    synthetic_row,
    synthetic_tokenizer_sha256,
    write_synthetic_dataset,
)


# --------------------------------------------------------------------------- reference forms


def pack_inputs(
    rows: Sequence[codec.PackedRow], seq_len: int, pad_id: int = 0,
    token_dtype: np.dtype | str = np.int32, index_dtype: np.dtype | str = np.int32,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, segment ids and positions of packed rows; the other keys derive from them.

    Legend: ``n`` rows, ``L = seq_len``.

    Returns:
      ``(inputs, inputs_segmentation, inputs_position)``, ``[n, L]``: tokens
      (``pad_id`` on padding), 1-based segment ids and positions restarting at 0 in each
      segment (both 0 on padding). Ids and positions are running sums of marks: +1 at each
      segment start and ``-S`` after the last token for ids; +1 per token, minus the
      previous segment's length at each start and minus the last position after the last
      token for positions.
      ``token_dtype`` and ``index_dtype`` (int32 by default) may be narrower when the values
      fit (uint16 tokens; int16 ids and positions for ``seq_len <= 2**15``): fewer bytes to
      move to the devices.

    Raises:
      ValueError: a row's seq_len differs from ``seq_len``.
    """
    n = len(rows)
    for i, row in enumerate(rows):
        if row.seq_len != seq_len:
            raise ValueError(f"row {i} has seq_len {row.seq_len}, expected {seq_len}")
    inputs = np.full((n, seq_len), pad_id, token_dtype)
    for i, row in enumerate(rows):
        inputs[i, : row.num_tokens] = row.tokens
    seg_marks = np.zeros((n, seq_len), np.int32)
    if n == 0:
        return inputs, seg_marks.astype(index_dtype), seg_marks.astype(index_dtype)
    # Marks for every row at once: T tokens and S segments per row.
    T = np.fromiter((r.num_tokens for r in rows), np.int64, n)
    S = np.fromiter((r.num_segments for r in rows), np.int64, n)
    pos_marks = (np.arange(seq_len)[None, :] < T[:, None]).astype(np.int32)
    pos_marks[:, 0] = 0
    if S.sum() == 0:
        return inputs, seg_marks.astype(index_dtype), seg_marks.astype(index_dtype)
    lengths = np.concatenate([r.segment_lengths for r in rows]).astype(np.int64)
    seg_row = np.repeat(np.arange(n), S)
    starts = np.cumsum(lengths) - lengths - np.repeat(np.cumsum(T) - T, S)  # start slot in its row
    first = np.zeros(lengths.size, bool)
    first[(np.cumsum(S) - S)[S > 0]] = True
    seg_marks[seg_row, starts] = 1
    later = np.nonzero(~first)[0]
    pos_marks[seg_row[later], starts[later]] = 1 - lengths[later - 1]
    tail = np.nonzero((S > 0) & (T < seq_len))[0]  # rows with padding after their last segment
    seg_marks[tail, T[tail]] = -S[tail]
    pos_marks[tail, T[tail]] = -(lengths[np.cumsum(S)[tail] - 1] - 1)
    # Running sums in int32 (numpy's int16 cumsum is several times slower), then narrowed.
    seg = np.cumsum(seg_marks, axis=1, dtype=np.int32)
    pos = np.cumsum(pos_marks, axis=1, dtype=np.int32)
    return inputs, seg.astype(index_dtype, copy=False), pos.astype(index_dtype, copy=False)


def derive_batch(inputs: np.ndarray, inputs_segmentation: np.ndarray,
                 inputs_position: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The six trainer arrays from tokens and segment ids: the numpy reference (the loader
    builds them with ``loader.arrays.pack_records(six=True)`` on the host, or with the jitted
    ``loader.device.derive`` on the mesh; tests check both against this, bit for bit).

    Args:
      inputs: int32 ``[n, L]`` tokens.
      inputs_segmentation: int32 ``[n, L]`` 1-based segment ids, 0 on padding.
      inputs_position: int32 ``[n, L]`` positions, or ``None`` to derive them from the ids.

    Returns:
      dict of int32 ``[n, L]`` arrays (MaxText names): ``inputs``, ``inputs_segmentation``,
      ``inputs_position`` (restarting at 0 per segment, 0 on padding), ``targets`` (the next
      token when it is in the same segment, else 0), ``targets_segmentation`` (the segment
      id where the target is valid; 0 at each segment's last token and on padding),
      ``targets_position`` (``inputs_position`` where the target is valid, else 0). So no
      (input, target) pair crosses a document boundary.
    """
    seg = inputs_segmentation
    n, L = seg.shape
    if inputs_position is None:
        idx = np.arange(L, dtype=np.int32)
        start = np.ones((n, L), bool)
        start[:, 1:] = seg[:, 1:] != seg[:, :-1]
        first = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
        pos = np.where(seg != 0, idx - first, 0).astype(np.int32)
    else:
        pos = inputs_position
    valid = np.zeros((n, L), bool)
    valid[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
    targets = np.zeros((n, L), np.int32)
    targets[:, :-1] = inputs[:, 1:]
    return {
        "inputs": inputs,
        "targets": np.where(valid, targets, 0).astype(np.int32),
        "inputs_segmentation": seg,
        "targets_segmentation": np.where(valid, seg, 0).astype(np.int32),
        "inputs_position": pos,
        "targets_position": np.where(valid, pos, 0).astype(np.int32),
    }


def dense_batch(rows: Sequence[codec.PackedRow], seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The six int32 ``[n, seq_len]`` trainer arrays of packed rows (see :func:`derive_batch`).

    Raises:
      ValueError: a row's seq_len differs from ``seq_len``.
    """
    return derive_batch(*pack_inputs(rows, seq_len, pad_id))
