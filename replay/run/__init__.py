"""The ground room: the trainer's kit and the run directory.

What any trainer (the reference one or a user's) needs to leave a run that ``replay`` can read:
the run directory's schema and readers (``protocol``, ``runlog``), its writer (``writer``: the
public ``RunWriter`` and the per-process ``RunDir``), the step's kit (``probe``: per-device
fingerprints and signals, drill faults), the environment record (``env``), gradient fingerprints
(``fingerprint``), the canary computation (``canary``), device specs, names and the quarantine
(``devices``), what replay rebuilds a run from and the run's trainer factory (``setup``), verdicts and exit codes (``codes``), attempts and lineage (``lineage``), what the run
trained with (``inputs``), skip windows and rewinds (``skip``) and the run's ``train.png``
(``train_plot``). Nothing here imports another room of
``replay`` but the runtime room below it (``replay.runtime``: many processes); ``distributed`` here is
that room's module under its old name.
"""
