"""The ground room: the trainer's kit and the run directory.

What any trainer (the reference one or a user's) needs to leave a run that ``replay`` can read:
the run directory's schema and readers (``protocol``, ``runlog``), its writer (``writer``), the
environment record (``env``), gradient fingerprints (``fingerprint``), the canary computation
(``canary``), device specs and the quarantine (``devices``), what replay rebuilds a run from
(``setup``), verdicts and exit codes (``codes``) and step-loop progress (``progress``). Nothing
here imports another room of ``replay``.
"""
