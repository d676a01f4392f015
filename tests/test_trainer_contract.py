"""docs/trainer.md, "The contract", checked against the code: every method of the trainer protocol, field
of ``RunSetup`` and ``StepFingerprints``, method of ``RunWriter``, function of ``replay.run.probe`` and
``replay.runtime.distributed``, and run-directory name has its line there. A new one without a line fails
here: write its line (arguments, returns, errors, when replay calls it)."""

import dataclasses
import inspect
import pathlib
import re

import pytest

from replay.run import probe, protocol, setup, writer
from replay.runtime import distributed

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "trainer.md"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    contract = text[text.index("\n## The contract\n"):]
    contract = contract[: contract.index("\n## ", 1)]
    start = contract.index(f"\n### {title}")
    end = contract.find("\n### ", start + 1)
    return contract[start:] if end < 0 else contract[start:end]


def _functions(obj) -> list[str]:
    return [n for n, v in vars(obj).items() if inspect.isfunction(v) and not n.startswith("_")
            and getattr(v, "__module__", None) in (getattr(obj, "__name__", None), getattr(obj, "__module__", None))]


def _rows(section: str) -> str:
    """The first cells of the section's table rows."""
    return "\n".join(line.split("|")[1] for line in section.splitlines() if line.startswith("| "))


def _missing(names, cells: str) -> list[str]:
    return [n for n in names if not re.search(rf"`{re.escape(n)}[`(]", cells)]


@pytest.mark.parametrize("title,names", [
    ("The trainer", _functions(protocol.Trainer)),
    ("`RunSetup`", [f.name for f in dataclasses.fields(setup.RunSetup)]),
    ("The writer", ["RunWriter"] + _functions(writer.RunWriter)),
    ("The step's kit", _functions(probe)),
    ("The multi-process helpers", _functions(distributed)),
    ("The run directory", [v for n, v in vars(protocol).items() if n.endswith(("_NAME", "_DIR"))]),
])
def test_every_name_of_the_code_has_its_line_in_the_contract(title, names):
    assert names, title  # the code lists something to check
    cells = _rows(_section(title))
    if title == "The run directory":  # folders are written with their slash or a <step>
        cells = cells.replace("/<step>/", "`").replace("/`", "`")
    assert _missing(names, cells) == [], f"docs/trainer.md, 'The contract', {title}: add a line for each"


def test_step_fingerprints_fields_have_their_line():
    text = _section("The trainer")
    table = text[text.index("`StepFingerprints` (`replay.run.protocol`"):]
    assert _missing([f.name for f in dataclasses.fields(protocol.StepFingerprints)], _rows(table)) == []


def test_the_check_fails_on_a_name_without_its_line():
    assert _missing(["init_state", "no_such_method"], _rows(_section("The trainer"))) == ["no_such_method"]
