"""``dataprep.pack --dry-run``: the Dataflow job built and checked without a cloud (dataprep/dryrun.py).

Runs where apache-beam[gcp] (Beam's Dataflow client) and ``build`` are installed
(``pip install -e ".[dataflow]"``), and skips with that reason otherwise; the message a user
gets without them is tested where they are absent.
"""

import importlib.util
import json
import pathlib
import re
import tarfile

import pytest
import yaml

from dataprep import pack, testing

REPO = pathlib.Path(__file__).resolve().parents[1]


def _have_gcp() -> bool:
    try:
        from apache_beam.runners.dataflow.internal import apiclient  # noqa: F401
    except ImportError:
        return False
    return importlib.util.find_spec("build") is not None


needs_gcp = pytest.mark.skipif(not _have_gcp(), reason='apache-beam[gcp] and build not installed: '
                                                       'pip install -e ".[dataflow]" to run the Dataflow dry run')

DATAFLOW = ["--runner", "DataflowRunner", "--project", "my-project", "--region", "us-central1",
            "--temp_location", "gs://my-bucket/tmp", "--setup_file", str(REPO / "pyproject.toml")]
STAGES = ["Pack/ListFiles", "Pack/ReadAndTokenize", "Pack/BucketMarkers", "Pack/GroupByTextHash",
          "Pack/FindDuplicates", "Pack/WithMarkers", "Pack/GroupByBucket", "Pack/PackAndWrite", "Pack/StageRejected",
          "Pack/GroupRejected", "Pack/WriteDeadLetters", "Pack/AllStats", "Pack/KeyStats", "Pack/CollectStats",
          "Pack/WriteStats"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The same small mixture twice: inputs and tokenizer on this machine's disk, and on memfs://
    (a non-local Beam file system registered by dataprep.testing, standing in for gs://)."""
    d = tmp_path_factory.mktemp("dry")
    sha = testing.train_small_tokenizer(str(d / "tok.model"))
    paths = testing.write_pydoc_jsonl(d / "in", files=2, limit_chars=20_000)
    raw = {"name": "dry", "version": 1, "seq_len": 256, "shards_per_source": 2,
           "tokenizer": {"path": str(d / "tok.model"), "sha256": sha},
           "sources": [{"name": "docs", "paths": [str(d / "in/*.jsonl")], "format": "jsonl"}]}
    (d / "local.yaml").write_text(yaml.safe_dump(raw))
    for p in paths:
        testing.MEMFS_FILES[f"memfs://bucket/in/{p.name}"] = p.read_bytes()
    testing.MEMFS_FILES["memfs://bucket/tok.model"] = (d / "tok.model").read_bytes()
    raw["tokenizer"]["path"] = "memfs://bucket/tok.model"
    raw["sources"][0]["paths"] = ["memfs://bucket/in/*.jsonl"]
    (d / "remote.yaml").write_text(yaml.safe_dump(raw))
    yield d
    for k in [k for k in testing.MEMFS_FILES if k.startswith("memfs://bucket/")]:
        del testing.MEMFS_FILES[k]


@needs_gcp
def test_the_job_is_built_and_checked_without_a_cloud(configs, tmp_path, capsys):
    folder = tmp_path / "dry"
    args = ["--config", str(configs / "remote.yaml"), "--output", "gs://my-bucket/ds", *DATAFLOW, "--dry-run",
            "--dry-run-dir", str(folder)]
    report = pack.dry_run(args)
    assert report.problems == ()
    assert list(report.stages) == STAGES and report.dofns == 15
    staged = {name: size for name, size, _ in report.staged}
    assert {"pipeline.pb", "workflow.tar.gz", "submission_environment_dependencies.txt"} <= set(staged)
    with tarfile.open(folder / "staging/workflow.tar.gz") as tar:  # the sdist the workers install
        names = tar.getnames()
    assert "moe_data_toolkit-0.1.0/dataprep/pipeline.py" in names and "moe_data_toolkit-0.1.0/pyproject.toml" in names
    job = json.loads((folder / "dataflow_job.json").read_text())
    assert job["type"] == "JOB_TYPE_BATCH"
    pool = job["environment"]["workerPools"][0]
    assert pool["workerHarnessContainerImage"].endswith("beam_python3.11_sdk:2.77.0")
    assert {p["name"] for p in pool["packages"]} == set(staged) - {"pipeline.pb"}
    assert not pathlib.Path("gs:").exists()  # nothing written for the output
    # the command: exit 0, the report on stdout, the checks named
    assert pack.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run: the Dataflow job was built and checked; nothing was submitted")
    assert re.search(r"^checked: 15 DoFns unpickled and \d+ coders loaded from the job's proto; every "
                     r"GroupByKey's key coder is deterministic$", out, re.M)
    assert re.search(r'^workers \(docs/dataprep.md, "Sizing"\): 1 n1-standard-4 worker for a 24 h run: ', out, re.M)
    assert "problems" not in out


@needs_gcp
def test_paths_the_workers_cannot_read_are_problems(configs, tmp_path, capsys):
    args = ["--config", str(configs / "local.yaml"), "--output", "gs://my-bucket/ds", *DATAFLOW, "--dry-run",
            "--dry-run-dir", str(tmp_path / "dry")]
    assert pack.main(args) == 2
    out = capsys.readouterr().out
    fix = "a local path; Dataflow workers cannot read this machine's disk; put it on gs:// and name that"
    assert out.endswith(
        "problems (the job as built would fail on Dataflow):\n"
        f"  sources[0].paths[0] {configs}/in/*.jsonl: {fix}\n"
        f"  tokenizer.path {configs}/tok.model: {fix}\n")


@needs_gcp
def test_dry_run_option_mistakes_exit_2_before_any_cloud_call(configs, tmp_path, capsys):
    base = ["--config", str(configs / "remote.yaml"), "--output", "gs://my-bucket/ds", "--dry-run"]
    assert pack.main(base) == 2  # no runner: the local one
    assert capsys.readouterr().err == (
        "error: --dry-run builds a Dataflow job: pass --runner DataflowRunner and its options (--project, "
        "--region, --temp_location gs://..., --setup_file ./pyproject.toml)\n")
    bad = [a.replace("gs://my-bucket/tmp", "gs://BUCKET/tmp") for a in DATAFLOW]
    assert pack.main(base + bad) == 2  # Beam would look for a default bucket (a cloud call): refused here
    assert capsys.readouterr().err.startswith("error: Beam options: Invalid GCS bucket (gs://BUCKET/tmp), given for "
                                              "the option: temp_location.")


@pytest.mark.skipif(_have_gcp(), reason="apache-beam[gcp] is installed: the dry run itself is tested")
def test_without_the_dataflow_extra_the_dry_run_names_it(configs, tmp_path, capsys):
    args = ["--config", str(configs / "remote.yaml"), "--output", "gs://my-bucket/ds", *DATAFLOW, "--dry-run"]
    assert pack.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dry-run builds a Dataflow job with Beam's DataflowRunner, which needs "
                          "apache-beam[gcp] (")
    assert err.endswith("); install it with: pip install -e \".[dataflow]\"\n")
