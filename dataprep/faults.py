"""Test-only failure injection: make one bundle's first attempt raise, once.

Set ``DATAPREP_INJECT_FAULT=<point>@<marker folder>`` in the environment of ``dataprep.pack``
(worker processes inherit it). The pack then builds :class:`FaultyPackSources` in place of
``dataprep.pipeline.PackSources`` (:func:`pack_sources`): the same pipeline, whose reading and
packing DoFns are subclasses that can fail. The first time a worker reaches ``<point>`` it
creates ``<marker folder>/<point>.fired`` atomically (``O_CREAT | O_EXCL``) and raises
:class:`InjectedFault`; every later attempt finds the marker and carries on, so a runner
that retries the bundle completes the run. Points:

* ``pack``: in the packing step, after the bucket's shard file has been written to its
  final name (so the retry must overwrite it byte for byte).
* ``tokenize.finish_bundle``: in the tokenizer's ``finish_bundle``, after half of the
  bundle's buffered outputs have been emitted (so the runner must discard them).

Unset (the normal case) the pipeline runs its own DoFns: ``pipeline.py`` knows nothing of faults.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from dataprep import pipeline

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

    Raises:
      InjectedFault: ``point`` is the configured one and its marker did not exist yet.
      ValueError: the spec is not ``<point>@<folder>`` with a known point.
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


class FailingReadAndTokenize(pipeline.ReadAndTokenize):
    """``ReadAndTokenize`` whose ``finish_bundle`` may fail after half of its buffered outputs."""

    def setup(self):
        super().setup()
        self._fault = current_spec()

    def _emit(self, outputs: list) -> Iterable[Any]:
        half = len(outputs) // 2
        yield from super()._emit(outputs[:half])
        if outputs:
            maybe_fail("tokenize.finish_bundle", f"after {half} of {len(outputs)} outputs", self._fault)
        yield from super()._emit(outputs[half:])


class FailingPackAndWriteShard(pipeline.PackAndWriteShard):
    """``PackAndWriteShard`` that may fail once the bucket's shard is written to its final name."""

    def _pack(self, source: str, bucket: int, group, dropped: set[str]) -> dict[str, Any]:
        info = super()._pack(source, bucket, group, dropped)
        maybe_fail("pack", info["path"])
        return info


class FaultyPackSources(pipeline.PackSources):
    """``PackSources`` with the DoFns above."""

    read_and_tokenize = FailingReadAndTokenize
    pack_and_write = FailingPackAndWriteShard


def pack_sources() -> type[pipeline.PackSources]:
    """The transform ``dataprep.pack`` builds: :class:`FaultyPackSources` when :data:`ENV` is set in
    this process, else ``pipeline.PackSources``."""
    return FaultyPackSources if current_spec() else pipeline.PackSources
