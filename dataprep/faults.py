"""Test-only failure injection: make one bundle's first attempt raise, once.

Set ``DATAPREP_INJECT_FAULT=<point>@<marker folder>`` in the environment of the pipeline
(worker processes inherit it). The first time a worker reaches ``<point>`` it creates
``<marker folder>/<point>.fired`` atomically (``O_CREAT | O_EXCL``) and raises
:class:`InjectedFault`; every later attempt finds the marker and carries on, so a runner
that retries the bundle completes the run. Points:

* ``pack``: in the packing step, after the bucket's shard file has been written to its
  final name (so the retry must overwrite it byte for byte).
* ``tokenize.finish_bundle``: in the tokenizer's ``finish_bundle``, after half of the
  bundle's buffered outputs have been emitted (so the runner must discard them).

Unset (the normal case) it costs one dictionary lookup per call.
"""

from __future__ import annotations

import os

ENV = "DATAPREP_INJECT_FAULT"
POINTS = ("pack", "tokenize.finish_bundle")


class InjectedFault(RuntimeError):
    """Raised by :func:`maybe_fail` on a bundle's first attempt."""


def current_spec() -> str:
    """The fault spec of this process ('' when none); read it once per DoFn in ``setup()``."""
    return os.environ.get(ENV, "")


def maybe_fail(point: str, detail: str = "", spec: str | None = None) -> None:
    """Raises :class:`InjectedFault` the first time ``point`` is reached, if configured.

    ``spec`` defaults to the environment variable; DoFns pass the value read in ``setup()``.
    """
    spec = current_spec() if spec is None else spec
    if not spec:
        return
    want, _, marker_dir = spec.partition("@")
    if want != point:
        return
    if want not in POINTS or not marker_dir:
        raise ValueError(f"{ENV}={spec!r}: expected <point>@<folder> with point in {POINTS}")
    marker = os.path.join(marker_dir, f"{point}.fired")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, detail.encode("utf-8", "replace"))
    os.close(fd)
    raise InjectedFault(f"injected failure at {point} ({detail}); a retry of this bundle will succeed")
