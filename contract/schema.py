"""The JSON Schema files of the dataset contract, kept in the repository's ``schemas/`` folder.

``schemas/mixture.schema.json`` is the mixture config file a user writes
(:class:`contract.config.MixtureFile`); ``schemas/manifest.schema.json`` is a dataset's
``manifest.json`` (:class:`contract.manifest.Manifest`). Both come from the one declaration that
also validates: pydantic's JSON Schema of those classes. An editor or another tool can validate
against them (a YAML language server: ``# yaml-language-server: $schema=<path>`` at the top of a
mixture file). Regenerate them after a change of the schema (``tests/test_contract_schema.py``
fails until they are current)::

    python -m contract.schema            # writes schemas/*.schema.json
    python -m contract.schema --check    # exit 1 when a file is stale
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Mapping, Optional, Sequence

from contract.config import mixture_json_schema
from contract.manifest import manifest_json_schema

SCHEMAS: dict[str, Callable[[], dict]] = {
    "mixture.schema.json": mixture_json_schema,
    "manifest.schema.json": manifest_json_schema,
}
FOLDER = "schemas"


def render(name: str, schemas: Mapping[str, Callable[[], dict]] = SCHEMAS) -> str:
    """The text of the schema file ``name`` of ``schemas``: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(schemas[name](), indent=2, sort_keys=True, ensure_ascii=True) + "\n"


def stale(folder: str = FOLDER, schemas: Mapping[str, Callable[[], dict]] = SCHEMAS) -> list[str]:
    """The schema files of ``schemas`` under ``folder`` that are missing or differ from :func:`render`."""
    out = []
    for name in schemas:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != render(name, schemas):
            out.append(path)
    return out


def main(argv: Optional[Sequence[str]] = None, schemas: Mapping[str, Callable[[], dict]] = SCHEMAS,
         prog: str = "python -m contract.schema", description: Optional[str] = None) -> int:
    """Writes (or, with ``--check``, checks) the files of ``schemas``; the command of this module and of
    ``replay.schema`` (the run's files)."""
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0])
    ap.add_argument("--out", default=FOLDER, help="the folder of the schema files (default: schemas)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is missing or stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale(args.out, schemas)
        for path in bad:
            print(f"{path}: stale; regenerate with: {prog} --out {args.out}", file=sys.stderr)
        return 1 if bad else 0
    for name in schemas:
        path = os.path.join(args.out, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(name, schemas))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
