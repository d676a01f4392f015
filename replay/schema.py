"""The JSON Schema files of a training run, kept in the repository's ``schemas/`` folder.

``schemas/run_config.schema.json`` is the reference trainer's ``run_config.yaml``
(:class:`replay.reference.run.RunConfig` and its sections); ``schemas/run_log/`` holds one file per
record of the run directory (``replay.run.protocol``): a line of ``fingerprints.jsonl``,
``signals.jsonl``, ``canary.jsonl`` and ``events.jsonl``, a checkpoint's state record
(``checkpoint_records/<step>.json``, ``replay.run.statefp``), the environment record ``env.json`` and
the record of what the run trained with, ``inputs.json``. Each comes from the one declaration that
also validates (pydantic), like the dataset's files of ``contract.schema``. A user's trainer or another
tool can check what it writes against them. Regenerate them after a change of a declaration
(``tests/test_run_schema.py`` fails until they are current)::

    python -m replay.schema            # writes schemas/run_config.schema.json, schemas/run_log/*.schema.json
    python -m replay.schema --check    # exit 1 when a file is stale
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

from contract import schema as contract_schema
from contract.validation import json_schema


def _run_config() -> dict[str, Any]:
    from replay.reference.run import RunConfig

    return json_schema(RunConfig, "run_config.yaml",
                       "The run config of the reference trainer (replay/reference/run.py; docs/trainer.md, \"Run "
                       "config\"). Relative paths are relative to the file's folder.")


def _record(name: str, title: str) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        from replay.run import protocol, statefp

        cls = getattr(protocol, name, None) or getattr(statefp, name)
        return json_schema(cls, title, (cls.__doc__ or "").strip().split("\n\n")[0])

    return make


SCHEMAS: dict[str, Callable[[], dict]] = {
    "run_config.schema.json": _run_config,
    "run_log/fingerprints.schema.json": _record("StepFingerprints", "a line of fingerprints.jsonl"),
    "run_log/signals.schema.json": _record("StepSignals", "a line of signals.jsonl"),
    "run_log/canary.schema.json": _record("CanaryRecord", "a line of canary.jsonl"),
    "run_log/event.schema.json": _record("Event", "a line of events.jsonl"),
    "run_log/checkpoint_record.schema.json": _record("StateRecordFile", "checkpoint_records/<step>.json"),
    "run_log/env.schema.json": _record("EnvRecord", "env.json"),
    "run_log/inputs.schema.json": _record("InputsRecord", "inputs.json"),
}


def stale(folder: str = contract_schema.FOLDER) -> list[str]:
    """The files of :data:`SCHEMAS` under ``folder`` that are missing or differ from their declaration."""
    return contract_schema.stale(folder, SCHEMAS)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return contract_schema.main(argv, SCHEMAS, prog="python -m replay.schema", description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
