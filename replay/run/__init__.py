"""The run-log contract: what a trainer writes and replay reads.

What any trainer (the reference one or a user's) imports to leave a run that ``replay`` can read: the
run directory's schema and readers (``protocol``, ``runlog``), its writer (``writer``: the public
``RunWriter`` and the per-process ``RunDir``), the step's kit (``probe``: per-device fingerprints and
signals, drill faults), gradient fingerprints (``fingerprint``), state records of checkpoints
(``statefp``), the environment record (``env``), the canary computation (``canary``), what replay
rebuilds a run from and the run's trainer factory (``setup``), verdicts and exit codes (``codes``),
attempts and lineage (``lineage``), what the run trained with (``inputs``), skip windows and rewinds
(``skip``) and the run's ``train.png`` (``train_plot``).

Nothing here imports another room of ``replay`` but the runtime room below it (``replay.runtime``:
many processes, device specs and the quarantine, progress, quiet restores); ``distributed`` here is
that room's module under its old name.
"""
