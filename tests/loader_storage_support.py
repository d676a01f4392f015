"""Shared fixtures of the URL-dataset tests (``tests/test_loader_storage*.py``), loaded as a
pytest plugin from ``conftest.py``: a small local dataset and its copy on the in-memory
``memfs://`` Beam file system (``dataprep.testing``)."""

import os

import pytest

from dataprep.testing import MEMFS_FILES
from loader import testing as lt

SEQ = 16
VOCAB = 1000
SOURCES = {"a": 10, "b": 23}


def mix():
    return lt.synthetic_mixture({"a": 0.3, "b": 0.7}, seq_len=SEQ)


def upload(local: str, url: str) -> dict[str, str]:
    """Copies every file of ``local`` to ``memfs://`` under ``url``; returns url -> relpath."""
    out = {}
    for root, _, files in os.walk(local):
        for f in files:
            full = os.path.join(root, f)
            rel = os.path.relpath(full, local).replace(os.sep, "/")
            with open(full, "rb") as fh:
                MEMFS_FILES[f"{url}/{rel}"] = fh.read()
            out[f"{url}/{rel}"] = rel
    return out


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds") / "synthetic")
    lt.write_synthetic_dataset(path, SOURCES, SEQ, shards_per_source=3, vocab_size=VOCAB)
    return path


@pytest.fixture
def remote(local_ds, request):
    """``(url, {url: relpath})`` of a fresh memfs copy of ``local_ds``, removed afterwards."""
    url = f"memfs://bucket/{request.module.__name__}/{request.node.name}"
    files = upload(local_ds, url)
    yield url, files
    for k in list(MEMFS_FILES):
        if k.startswith(url + "/"):
            del MEMFS_FILES[k]
