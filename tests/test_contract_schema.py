"""schemas/*.schema.json: current with the declarations (contract.config.MixtureFile,
contract.manifest.Manifest), and a JSON Schema validator agrees with ours on real files."""

import glob
import json
import pathlib

import jsonschema
import pytest
import yaml

from contract import schema
from contract.config import ConfigError, _StrictLoader, mixture_from_dict
from contract.manifest import Manifest, ManifestError

REPO = pathlib.Path(__file__).resolve().parents[1]


def _schema(name):
    return json.loads((REPO / "schemas" / name).read_text())


def test_the_schema_files_are_current():
    assert schema.stale(str(REPO / "schemas")) == [], "regenerate them: python -m contract.schema"


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "configs/mixtures/*.yaml"))))
def test_the_repositorys_mixture_configs_validate(path):
    raw = yaml.load(open(path, encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    jsonschema.validate(raw, _schema("mixture.schema.json"))
    mixture_from_dict(raw, base_dir="/x")


@pytest.mark.parametrize("edit", [
    lambda r: r.update(wieght=1),
    lambda r: r["sources"][0].update(format="csv"),
    lambda r: r.update(seq_len=0),
    lambda r: r["tokenizer"].update(sha256="XYZ"),
    lambda r: r["sources"][0].update(weight=-1),
    lambda r: r.pop("sources"),
    lambda r: r.update(shards_per_source="many"),
    lambda r: r.update(name="-x"),
    lambda r: r["sources"][0].update(name="a b"),
    lambda r: r.update(phases=[{"from_step": -1, "weights": {"docs": 1}}]),
])
def test_what_the_schema_rejects_we_reject(edit):
    raw = yaml.safe_load((REPO / "configs/mixtures/demo.yaml").read_text())
    edit(raw)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, _schema("mixture.schema.json"))
    with pytest.raises(ConfigError):
        mixture_from_dict(raw, base_dir="/x")


def test_a_written_manifest_validates_and_a_damaged_one_does_not(tmp_path):
    from loader import synthetic

    manifest = synthetic.write_synthetic_dataset(str(tmp_path / "ds"), {"a": 3, "b": 2}, seq_len=16)
    raw = json.loads(manifest.to_json())
    jsonschema.validate(raw, _schema("manifest.schema.json"))
    assert Manifest.from_dict(raw) == manifest
    del raw["sources"]["a"]["ledger"]["tokens_in"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, _schema("manifest.schema.json"))
    with pytest.raises(ManifestError, match=r"manifest.sources.a.ledger: missing field 'tokens_in'"):
        Manifest.from_dict(raw)
