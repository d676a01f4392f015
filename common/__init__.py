"""What the parts share that is no contract between them: terminal progress, durations, file locks
and figure set-up.

Used by ``dataprep`` and ``replay`` alike, so that neither imports the other only for these
(``replay`` used to import ``dataprep.progress`` for :func:`common.progress.duration`). Imports
neither Beam nor JAX, nor any other part of the toolkit; Rich and matplotlib are imported where
they are used, not on import::

    progress   durations and rates as people read them, the Rich bar, lines that go quiet on a
               broken stream
    locks      exclusive ``flock`` locks on a folder or a lock file
    figures    matplotlib on the Agg backend, PNGs written through a temporary name
"""
