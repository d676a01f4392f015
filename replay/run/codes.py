"""Exit codes of the ``replay`` command and the verdict vocabulary every room shares.

A verdict is what a range replay (``replay.verify.verdict.decide``), ``replay canary`` and the
training loop's periodic canary (``replay.run.canary.decide_canary``) conclude; the run log
records its value (``canary_mismatch`` events carry ``verdict``). Each verdict maps to the exit
code the ``replay`` command ends with.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes of the ``replay`` command."""

    ACQUITTED = 0  # the log was reproduced (or the difference is in the data): no device to blame
    INTERNAL = 1  # an unexpected error (a bug): traceback printed
    USAGE = 2  # bad command line: unknown option, malformed --steps / --devices, too few devices
    CONVICTED = 3  # a device of the original run is convicted of silent data corruption
    AMBIGUOUS = 4  # no verdict either way: replays disagree, or the evidence is too weak
    RUN_ERROR = 5  # the run directory or its data is unusable: missing, no checkpoint, range not logged
    ENV_DRIFT = 6  # the environment differs from the run's and a bit-exact claim was asked for
    DRILL_NOT_CAUGHT = 7  # a drill's injected fault was not convicted (range) or not named (canary)
    SUSPECTS = 8  # replay scan: the logs name suspects (devices, replicas, router layers, the loader, the run)
    CLEAN = 0  # replay scan: every available check is clear (an alias of ACQUITTED: exit code 0)
    OPTIMIZATION_EVENT = 0  # replay triage: no check found a cause: rewind and skip (an alias: exit code 0)
    TRIAGE_HARDWARE = 10  # replay triage: a device is convicted or suspect (silent data corruption)
    TRIAGE_RESTART = 11  # replay triage: a restore repeated or skipped data (a restart or data-order fault)
    TRIAGE_DATA = 12  # replay triage: bad data at the onset (shards and documents named)
    TRIAGE_ROUTER = 13  # replay triage: router instability (layers named)
    DAMAGED_CHECKPOINT = 20  # a restored checkpoint does not match its own state record (its files changed): no verdict
    POISONED_CHECKPOINT = 21  # replay certify / a restore: a checkpoint's state is poisoned (replicas disagreed, or
    #                           replay on good devices does not reach it): rewind to the certified one named
    NON_FINITE = 22  # the training command: non_finite: stop (a NaN/Inf loss, gradient or state) before a checkpoint held it
    LINK_CONVICTED = 23  # a range replay convicted a link (sent right, received wrong), neither chip alone


class Verdict(enum.Enum):
    """The outcome of a replay; ``exit_code`` is what the ``replay`` command exits with."""

    CONVICTED = "convicted"
    ACQUITTED = "acquitted"
    AMBIGUOUS = "ambiguous"

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode[self.name]
