"""The base install is what dataprep's pipeline imports: a Dataflow worker installing the
``--setup_file`` sdist gets no JAX (pyproject.toml, docs/dataprep.md "Dataflow dry run")."""

import ast
import pathlib
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN_ONLY = {"jax", "jaxlib", "grain", "orbax", "optax"}


def _requirement_names(reqs):
    import re

    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def _imported_top_levels(folder: pathlib.Path) -> dict[str, set[str]]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(REPO))] = names
    return out


def test_base_dependencies_leave_jax_to_the_train_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = _requirement_names(project["dependencies"])
    train = _requirement_names(project["optional-dependencies"]["train"])
    assert not base & {"jax", "jaxlib", "grain", "orbax-checkpoint", "optax"}
    assert train == {"jax", "jaxlib", "grain", "orbax-checkpoint", "optax"}
    assert "moe-data-toolkit[train]" in project["optional-dependencies"]["test"]


def test_dataprep_and_contract_import_nothing_of_the_train_extra():
    """Neither the pipeline, nor the contract, nor the neutral room they use (``common``) imports JAX,
    Grain, Orbax, optax, the loader or replay (a worker would fail to unpickle a DoFn that did)."""
    found = {}
    for folder in ("dataprep", "contract", "common"):
        for path, names in _imported_top_levels(REPO / folder).items():
            bad = names & (TRAIN_ONLY | {"loader", "replay"})
            if bad:
                found[path] = sorted(bad)
    assert found == {}


def test_the_console_scripts_and_python_dash_m_replay():
    """``replay`` and ``beam`` name callables; ``python -m replay`` is the ``replay`` command."""
    import importlib
    import subprocess
    import sys

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"replay", "beam"} <= set(scripts)
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
    p = subprocess.run([sys.executable, "-m", "replay", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage: replay"), p.stderr[-2000:]
