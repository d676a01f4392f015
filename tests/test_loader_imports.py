"""The loader's modules form a one-way chain, and a step goes down it, each module entered once.

See the chain, each module's loader imports and the path of a step::

    .venv/bin/python tests/test_loader_imports.py

:data:`CHAIN` lists the modules from the bottom up. A module may import only modules listed
before it, never one above it: every import statement of every loader module is read (at
module level and inside functions alike), and every module is imported. Then one
``batch_at`` (and one step of ``iterate``, on its prefetch thread) is traced call by call
(``sys.setprofile``): the calls between loader modules must go down the chain, entering
each module once, in the order of :data:`STEP_PATH`.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys
import threading


ROOT = pathlib.Path(__file__).resolve().parents[1]

# From the bottom up: each module may import only those before it.
CHAIN = (
    "index",        # step -> global rows -> (phase, source, epoch, record); pure
    "storage",      # datasets behind a URL, staged locally
    "shards",       # (source, record) -> (shard, record in shard) -> record bytes
    "slow_store",   # the shard set with injected read latency (stall drills)
    "dataset",      # open and check: manifest, mixture, shards
    "arrays",       # record bytes -> host arrays (the one implementation)
    "source",       # step -> this process's host arrays
    "device",       # host arrays -> global jax.Arrays on the mesh
    "prefetch",     # steps computed ahead on threads
    "state",        # LoaderState
    "data_loader",  # build, DataLoader
    "checkpoint",   # Orbax handler
    "synthetic",    # synthetic datasets (drills, benchmarks, tests)
    "testing",      # reference forms for tests
)

# The calls between modules when following one step from DataLoader.batch_at: (caller, callee).
STEP_PATH = (
    ("data_loader", "source"),   # StepSource.six / StepSource.__call__
    ("source", "index"),         # Schedule.step_locations: step -> rows -> records of sources
    ("source", "shards"),        # ShardSet.locate_and_read: -> shards, records in them -> bytes
    ("source", "arrays"),        # pack_records: bytes -> host arrays
    ("data_loader", "device"),   # Placement.to_global: -> global jax.Arrays
)


def loader_imports(name: str) -> set[str]:
    """Loader modules imported anywhere in ``loader/<name>.py`` (``import loader.x``,
    ``from loader import x``, ``from loader.x import y``)."""
    tree = ast.parse((ROOT / "loader" / f"{name}.py").read_text(), filename=f"loader/{name}.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("loader.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"loader/{name}.py: relative import at line {node.lineno}")
            if node.module == "loader":
                out |= {a.name for a in node.names}
            elif node.module and node.module.startswith("loader."):
                out.add(node.module.split(".")[1])
    return out - {name}


def import_graph() -> dict[str, set[str]]:
    return {m: loader_imports(m) for m in CHAIN}


def test_chain_names_every_loader_module():
    files = {p.stem for p in (ROOT / "loader").glob("*.py")} - {"__init__"}
    assert set(CHAIN) == files, f"place new modules in CHAIN: {sorted(files - set(CHAIN))}"
    for m in CHAIN:
        importlib.import_module(f"loader.{m}")


def test_no_module_imports_one_above_it():
    level = {m: i for i, m in enumerate(CHAIN)}
    upward = {m: sorted(d for d in deps if level[d] > level[m]) for m, deps in import_graph().items()}
    assert {m: d for m, d in upward.items() if d} == {}


def test_no_command_imports_the_test_kit():
    """``loader.testing`` (the reference forms) is for tests: no module of the toolkit, its scripts
    or benchmarks imports it; the synthetic dataset they use is ``loader.synthetic``."""
    found = []
    for folder in ("common", "contract", "dataprep", "loader", "replay", "scripts", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "loader" / "testing.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
                         if isinstance(node, ast.ImportFrom) else [])
                if "loader.testing" in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _module(frame) -> str | None:
    """The loader module of the nearest loader frame at or above ``frame``."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("loader."):
            return name.removeprefix("loader.")
        frame = frame.f_back
    return None


def trace_calls(run) -> dict[int, list[tuple[str, str]]]:
    """Runs ``run()``; per thread, the calls from one loader module into another, in order."""
    calls: dict[int, list[tuple[str, str]]] = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if callee.startswith("loader."):
            caller = _module(frame.f_back)
            callee = callee.removeprefix("loader.")
            if caller is not None and caller != callee:
                calls.setdefault(threading.get_ident(), []).append((caller, callee))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls


def _loader(tmp):
    import loader
    from loader import testing as lt

    lt.write_synthetic_dataset(f"{tmp}/ds", {"a": 10, "b": 23}, 16, shards_per_source=2, vocab_size=1000)
    data = loader.build(lt.synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=16), f"{tmp}/ds", global_batch=8)
    data.batch_at(0)  # readers opened, caches and the fast transfer set up
    return data


def step_paths(tmp) -> dict[str, list[tuple[str, str]]]:
    """The module calls of ``batch_at(3)`` on the host-derive (CPU) and device-derive paths,
    and of one step of ``iterate`` (its consumer, and its prefetch thread)."""
    data = _loader(tmp)
    paths = {}
    for name, host_derive in (("batch_at", True), ("batch_at, targets derived on the devices", False)):
        data._host_derive = host_derive
        data.batch_at(3)  # compiles the device derive once, outside the trace
        (paths[name],) = trace_calls(lambda: data.batch_at(3)).values()
    data._host_derive = True
    it = data.iterate(3)
    first = trace_calls(lambda: next(it))  # starts the prefetch thread
    later = trace_calls(lambda: next(it))
    it.close()
    me = threading.get_ident()
    paths["iterate, first step (trainer thread)"] = first.pop(me)
    paths["iterate, next step (trainer thread)"] = later.pop(me, [])
    (paths["iterate (prefetch thread)"],) = first.values()  # its steps, each the same path
    return paths


def test_a_step_goes_down_the_chain_each_module_once(tmp_path):
    paths = step_paths(tmp_path)
    level = {m: i for i, m in enumerate(CHAIN)}
    for name in ("batch_at", "batch_at, targets derived on the devices"):
        assert paths[name] == list(STEP_PATH), name
        assert all(level[callee] < level[caller] for caller, callee in paths[name])
        callees = [callee for _, callee in paths[name]]
        assert len(callees) == len(set(callees)), name
    # iterate: the trainer's thread asks the schedule for the steps once, then only talks to
    # the prefetch; the prefetch thread calls back into the loader (its function of a step),
    # and from there each step takes the same path.
    assert paths["iterate, first step (trainer thread)"] == [("data_loader", "index"), ("data_loader", "prefetch"),
                                                             ("data_loader", "prefetch")]
    assert paths["iterate, next step (trainer thread)"] == [("data_loader", "prefetch")]
    steps = paths["iterate (prefetch thread)"]
    assert steps[0] == ("prefetch", "data_loader")
    one = len(STEP_PATH) + 1
    assert len(steps) % one == 0 and steps == [("prefetch", "data_loader"), *STEP_PATH] * (len(steps) // one)


def main() -> int:
    import tempfile

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    graph = import_graph()
    print("loader modules, bottom up, with the loader modules each imports:")
    for m in CHAIN:
        print(f"  {m:<12} <- {', '.join(d for d in CHAIN if d in graph[m]) or '(none)'}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = step_paths(tmp)
    for name, calls in paths.items():
        if name == "iterate (prefetch thread)":
            calls = calls[: len(STEP_PATH) + 1]  # one step of those it prefetched
        print(f"\n{name}:")
        for caller, callee in calls:
            print(f"  {caller:<12} -> {callee}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
