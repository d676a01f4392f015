"""Duplicated data (issue 30): the manifest's signs (contract.duplicates), loader.build warning or
refusing by its choice on a real dataset whose shards are copies with a consistent manifest, and the
warning for a mixture weight below the mixture table's resolution."""

import logging
import os

import pytest

import loader
from contract import duplicates as dup
from contract.manifest import Manifest
from loader import index as ix
from loader.shards import DatasetError
from loader.testing import synthetic_mixture, write_synthetic_dataset
from replay.triage_drill import duplicate_shards


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """A real 2-source dataset, and a copy whose source b has shards 1 and 2 replaced by copies of
    shard 0 (the manifest agrees: the loader's shard checks accept it)."""
    d = tmp_path_factory.mktemp("dup")
    mix = synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=16, shards_per_source=4)
    clean = str(d / "clean")
    write_synthetic_dataset(clean, {"a": 40, "b": 40}, seq_len=16, shards_per_source=4, mixture=mix)
    return mix, clean, duplicate_shards(clean, str(d / "copied"), "b", 2)


def test_the_manifest_names_shards_that_share_a_sha256_and_the_repeated_share(copied):
    mix, clean, copies = copied
    assert dup.find(Manifest.from_json(open(os.path.join(clean, "manifest.json")).read())) == []
    found = dup.find(Manifest.from_json(open(os.path.join(copies, "manifest.json")).read()))
    assert [f.kind for f in found] == ["shared_sha256", "repeated_share"]
    assert found[0].shards == tuple(f"b/data-0000{i}-of-00004.array_record" for i in range(3))
    assert found[1].sources == ("b",) and found[1].fraction == 0.5  # 2 copies of a 10-record shard: 20 of 40
    assert "next" not in found[1].message and "repack" in found[1].message
    with pytest.raises(ValueError, match=r"max_fraction: must be in \[0, 1\]"):
        dup.find(Manifest.from_json(open(os.path.join(copies, "manifest.json")).read()), 2.0)


def test_the_loader_warns_or_refuses_by_its_choice(copied, caplog):
    mix, clean, copies = copied
    with caplog.at_level(logging.WARNING, logger="loader"):
        loader.build(mix, copies, global_batch=8)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "3 shards have the same sha256" in warned[0] and "50.0% of its data repeats data packed before it" in warned[1]
    with pytest.raises(DatasetError, match=r"duplicated data \(duplicates: refuse\)") as e:
        loader.build(mix, copies, global_batch=8, duplicates="refuse")
    assert "b/data-00002-of-00004.array_record" in str(e.value) and "next:" in str(e.value)
    loader.build(mix, clean, global_batch=8, duplicates="refuse")  # a clean dataset passes
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loader"):
        loader.build(mix, copies, global_batch=8, duplicates="off")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    with pytest.raises(loader.LoaderConfigError, match=r"duplicates: must be one of"):
        loader.build(mix, copies, global_batch=8, duplicates="ignore")


def test_a_weight_below_the_mixture_tables_resolution_is_warned(copied, caplog):
    phases = [(0, {"a": 1.0, "b": 1e-9})]
    (line,) = ix.weight_resolution_warnings(phases, [{"a": 1 - 2 ** -20, "b": 2 ** -20}])
    assert line.startswith("source 'b' from step 0: weight 1e-09") and "954x higher" in line
    assert ix.weight_resolution_warnings([(0, {"a": 1.0, "b": 1e-6})], [{"a": 0.999999, "b": 1e-6}]) == []
    mix, clean, _ = copied
    raw = mix.to_dict()
    raw["sources"][1]["weight"] = 1e-9
    raw.pop("phases", None)
    path = os.path.join(os.path.dirname(clean), "tiny.yaml")
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    with caplog.at_level(logging.WARNING, logger="loader"):
        loader.build(path, clean, global_batch=8)
    assert any("below the mixture table's resolution" in r.getMessage() for r in caplog.records)
