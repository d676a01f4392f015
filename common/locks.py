"""Exclusive locks between processes on one machine: ``flock`` on a folder, or on a lock file.

One implementation for the two places that need one: ``dataprep.pack`` holds its ``--output``
folder for the whole run (the lock is on the folder itself, so the dataset holds no lock file),
and ``replay.run.canary`` holds a lock file beside the golden table while it updates it. The
kernel releases a lock when its process ends, also when it is killed: no stale lock is left.

Why not the ``filelock`` package: it locks a lock file it opens for writing, which a folder
cannot be, and the folder lock is the one that keeps a dataset free of stray files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator


def acquire(path: str, *, wait: bool = True) -> int:
    """Takes an exclusive ``flock`` on ``path``: a folder, or a file (created, mode 0644, if missing).

    Args:
      path: what to lock.
      wait: block until the lock is free (True), or fail at once (False).

    Returns:
      the open file descriptor that holds the lock: :func:`release` it, or let the process end.

    Raises:
      BlockingIOError: ``wait`` is False and another process holds the lock.
      OSError: ``path`` cannot be opened, or its file system has no ``flock`` (some network file
        systems: ``ENOLCK``, ``EOPNOTSUPP``); the caller chooses whether to run unlocked.
    """
    fd = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    """Releases the lock that :func:`acquire` took and closes its descriptor."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(path: str) -> Iterator[int]:
    """The lock of :func:`acquire` (waiting for it) for the duration of a ``with`` block.

    Raises:
      OSError: as :func:`acquire`.
    """
    fd = acquire(path)
    try:
        yield fd
    finally:
        release(fd)
