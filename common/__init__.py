"""What the parts share that is no contract between them: terminal progress, durations and file locks.

Used by ``dataprep`` and ``replay`` alike, so that neither imports the other only for these
(``replay`` used to import ``dataprep.progress`` for :func:`common.progress.duration`). Imports
neither Beam nor JAX, nor any other part of the toolkit; Rich is imported where it is used::

    progress   durations and rates as people read them, the Rich bar, lines that go quiet on a
               broken stream
    locks      exclusive ``flock`` locks on a folder or a lock file
"""
