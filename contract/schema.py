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
from typing import Callable, Optional, Sequence

from contract.config import mixture_json_schema
from contract.manifest import manifest_json_schema

SCHEMAS: dict[str, Callable[[], dict]] = {
    "mixture.schema.json": mixture_json_schema,
    "manifest.schema.json": manifest_json_schema,
}
FOLDER = "schemas"


def render(name: str) -> str:
    """The text of the schema file ``name``: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(SCHEMAS[name](), indent=2, sort_keys=True, ensure_ascii=True) + "\n"


def stale(folder: str = FOLDER) -> list[str]:
    """The schema files under ``folder`` that are missing or differ from :func:`render`."""
    out = []
    for name in SCHEMAS:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != render(name):
            out.append(path)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m contract.schema", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=FOLDER, help="the folder of the schema files (default: schemas)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is missing or stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        for path in bad:
            print(f"{path}: stale; regenerate with: python -m contract.schema --out {args.out}", file=sys.stderr)
        return 1 if bad else 0
    os.makedirs(args.out, exist_ok=True)
    for name in SCHEMAS:
        path = os.path.join(args.out, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(name))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
