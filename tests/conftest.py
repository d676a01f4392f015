"""Shared test set-up: 8 CPU devices for JAX, and the location of ../shared."""

import os

# Must happen before jax is imported anywhere in the test session.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 CPU devices for the mesh tests, kept beside any other XLA flag the environment sets
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (CI=true) explores the same examples on every run, so a red build is reproducible; locally
# hypothesis keeps drawing new ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Session-scoped fixtures of the replay tests (one trained run shared by their modules).
pytest_plugins = ["test_replay_support", "loader_storage_support"]

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    """The read-only ../shared folder (corpora, tokenizer); skips the test where it is absent."""
    if not (SHARED / "corpora").is_dir():
        pytest.skip(f"needs ../shared beside the checkout (looked for {SHARED}); absent in a fresh clone")
    return SHARED


@pytest.fixture(autouse=True)
def _restore_xla_flags():
    """Puts ``XLA_FLAGS`` back after each test: the training command, called in-process, pins the
    determinism flags into ``os.environ`` (replay.run.env.pin_determinism_flags), which would leak into
    the run a later test records and make its replays refuse an environment drift that depends
    on the order the tests ran in (as under ``pytest -n 2``)."""
    before = os.environ.get("XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = before
