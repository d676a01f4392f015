"""The multi-process helpers moved to :mod:`replay.runtime.distributed`; this name stays the same module
for trainers written against it (docs/trainer.md, "The multi-process helpers")."""

import sys

from replay.runtime import distributed as _distributed

sys.modules[__name__] = _distributed
