"""The runtime room: what a command runs on, apart from what it writes.

Many processes (``distributed``: ``jax.distributed`` start-up, cross-process bookkeeping, the guard
that stops every process of a run when one dies), device specs and the quarantine (``devices``),
step-loop progress (``progress``) and quiet restore failures (``quiet``). The ground of ``replay``:
nothing here imports another room of ``replay`` (only ``common``); the run-log contract
(``replay.run``), the trainers and the commands stand on it.
"""
