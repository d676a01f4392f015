"""``dataprep.pack --dry-run``: build the Dataflow job for a config and check it, without a cloud.

    python -m dataprep.pack --config configs/mixtures/shared.yaml --output gs://BUCKET/datasets/shared-v1 \
        --runner DataflowRunner --project PROJECT --region us-central1 \
        --temp_location gs://BUCKET/tmp --setup_file ./pyproject.toml --dry-run [--dry-run-venv]

What Beam offers, read in ``apache_beam/runners/dataflow/`` (2.77), and what is used:

* ``--dry_run`` (``TestOptions``): ``DataflowRunner.run_pipeline`` translates the pipeline
  to its portable proto (every DoFn pickled), builds the worker environment (which runs the
  ``--setup_file`` staging: ``python -m build --no-isolation --sdist``) and the
  ``apiclient.Job``, then returns before it makes a Dataflow client. Used.
* The job description (the request Dataflow would get: worker pools, container image,
  packages, options) is made by ``DataflowApplicationClient.create_job_description``, which
  stages every file first; it stages to a local folder when the staging location is not
  ``gs://`` (``apiclient.stage_file``). Used with ``--no_auth`` and a local staging folder,
  so nothing leaves the machine; the description is written as ``dataflow_job.json``.
* ``--dataflow_job_file`` and ``--template_location`` write the same description, but only
  inside ``create_job``, after uploading the staged files to ``gs://`` and (for the job
  file) on the way to submitting: they need credentials, so they are not used.

Then the checks Beam does not make: every ParDo's DoFn in the job's pipeline proto
unpickles again (what a worker does first); every GroupByKey's key coder is deterministic;
every path the workers open (inputs, tokenizer, output, temp location) is on storage they
can reach, not this machine's disk; the staged sdist holds the packages the DoFns import;
and with ``--dry-run-venv``, the sdist installs with pip into a fresh virtual environment
(as on a worker) and the DoFns unpickle there. It reports what would be staged and how many
workers docs/dataprep.md's "Sizing" suggests (``dataprep.sizing.worker_plan``).

Exit status: 0 the job is built and every check passed; 2 a config or option mistake, or a
check failed (each problem named).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from typing import Optional

from contract.config import ConfigError, MixtureConfig

# The modules the job's DoFns import on a worker: the staged sdist must hold them.
WORKER_PACKAGES = ("common", "contract", "dataprep")
DEFAULT_FOLDER = "build/dataflow-dry-run"


@dataclasses.dataclass(frozen=True)
class DryRunReport:
    """What the dry run built and found.

    Attributes:
      lines: the report, one line each (printed by ``dataprep.pack``).
      problems: the checks that failed (empty when the job would run).
      staged: ``(name, bytes, sha256)`` of each file Dataflow would stage.
      stages: the pipeline's transforms, in the job's order.
      dofns: ParDo DoFns unpickled from the job's proto.
      job_file: the job description written (``dataflow_job.json``).
    """

    lines: tuple[str, ...]
    problems: tuple[str, ...]
    staged: tuple[tuple[str, int, str], ...]
    stages: tuple[str, ...]
    dofns: int
    job_file: str


def require_gcp() -> None:
    """Raises :class:`ConfigError` naming the extra to install when Beam's Dataflow client is missing."""
    try:
        from apache_beam.runners.dataflow.internal import apiclient  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"--dry-run builds a Dataflow job with Beam's DataflowRunner, which needs apache-beam[gcp] ({e}); "
            "install it with: pip install -e \".[dataflow]\""
        ) from None


def prepare_options(options) -> None:
    """Sets Beam's ``--dry_run`` and checks ``--temp_location``/``--staging_location`` with Beam's
    own validator, before Beam validates the options itself.

    Beam's check of those options calls Google Cloud Storage (a soft-delete policy lookup, and
    creating a default bucket when both are invalid); with ``--dry_run`` set it skips the
    first, and an invalid location is refused here instead of reaching the second.

    Raises:
      ConfigError: neither location is a valid ``gs://bucket/path`` (Beam's message).
    """
    from apache_beam.options.pipeline_options import GoogleCloudOptions, TestOptions
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator

    options.view_as(TestOptions).dry_run = "true"
    gco = options.view_as(GoogleCloudOptions)
    validator = PipelineOptionsValidator(options, "DataflowRunner")
    temp, staging = validator.validate_gcs_path(gco, "temp_location"), validator.validate_gcs_path(gco, "staging_location")
    if temp and (staging or gco.staging_location is None):
        raise ConfigError(f"Beam options: {temp[0]}" + ("" if gco.staging_location is None else f"; {staging[0]}"))


def unreachable_paths(config: MixtureConfig, output: str, temp_location: Optional[str]) -> list[str]:
    """The paths a Dataflow worker would open that lie on this machine's disk (one problem each)."""
    from dataprep import fsutil

    fix = "Dataflow workers cannot read this machine's disk; put it on gs:// and name that"
    out = []
    for i, source in enumerate(config.sources):
        for j, pattern in enumerate(source.paths):
            if fsutil.is_local(pattern):
                out.append(f"sources[{i}].paths[{j}] {pattern}: a local path; {fix}")
    if fsutil.is_local(config.tokenizer.path):
        out.append(f"tokenizer.path {config.tokenizer.path}: a local path; {fix}")
    if fsutil.is_local(output):
        out.append(f"--output {output}: a local path; the workers write the shards: give a gs:// folder")
    if temp_location and fsutil.is_local(temp_location):
        out.append(f"--temp_location {temp_location}: a local path; give a gs:// folder")
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_proto(proto) -> tuple[list[str], int, int, list[str]]:
    """Walks a job's pipeline proto: ``(stage names, DoFns unpickled, coders loaded, problems)``.

    Every ParDo's pickled DoFn is loaded again with Beam's pickler (a worker's first step);
    every coder is built from the proto (pickled ones unpickled); every GroupByKey's key
    coder must be deterministic (Dataflow groups by the key's encoded bytes). The stages are
    the children of the pipeline's top composite (``Pack/ReadAndTokenize``, ...), in order.
    """
    from apache_beam.internal import pickler
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2
    from apache_beam.runners import pipeline_context

    context = pipeline_context.PipelineContext(proto.components)
    stages, problems, dofns, coders = [], [], 0, 0
    for cid in sorted(proto.components.coders):
        try:
            context.coders.get_by_id(cid)
            coders += 1
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"coder {cid} does not load: {type(e).__name__}: {e}")
    pardo, gbk = common_urns.primitives.PAR_DO.urn, common_urns.primitives.GROUP_BY_KEY.urn
    todo = list(proto.root_transform_ids)
    while todo:
        t = proto.components.transforms[todo.pop(0)]
        todo[:0] = list(t.subtransforms)
        if t.unique_name.count("/") == 1:
            stages.append(t.unique_name)
        if t.spec.urn == pardo:
            payload = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload)
            if payload.do_fn.urn == "beam:dofn:pickled_python_info:v1":
                try:
                    pickler.loads(payload.do_fn.payload)
                    dofns += 1
                except Exception as e:  # noqa: BLE001 - any failure to load is the finding
                    problems.append(f"stage {t.unique_name}: its DoFn does not unpickle: {type(e).__name__}: {e}")
        elif t.spec.urn == gbk:
            coder = context.coders.get_by_id(proto.components.pcollections[next(iter(t.inputs.values()))].coder_id)
            key = coder.key_coder() if hasattr(coder, "key_coder") else None
            if key is None or not key.is_deterministic():
                problems.append(f"stage {t.unique_name}: its key coder {key} is not deterministic")
    return stages, dofns, coders, problems


def sdist_packages(path: str) -> list[str]:
    """The top-level packages in an sdist (``<name>-<version>/<package>/__init__.py``)."""
    with tarfile.open(path) as tar:
        names = tar.getnames()
    return sorted({n.split("/")[1] for n in names if n.count("/") == 2 and n.endswith("/__init__.py")})


_VENV_CHECK = """
import sys
from apache_beam.internal import pickler
from apache_beam.portability.api import beam_runner_api_pb2
proto = beam_runner_api_pb2.Pipeline.FromString(open(sys.argv[1], "rb").read())
n = 0
for t in proto.components.transforms.values():
    if t.spec.urn == "beam:transform:pardo:v1":
        p = beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload)
        if p.do_fn.urn == "beam:dofn:pickled_python_info:v1":
            pickler.loads(p.do_fn.payload)
            n += 1
import dataprep, contract
print(n, dataprep.__file__)
"""


def venv_install(sdist: str, pipeline_pb: str, folder: str, timeout: float = 1200) -> tuple[list[str], list[str]]:
    """Installs ``sdist`` with pip into a fresh venv under ``folder`` and unpickles the DoFns there.

    Returns:
      ``(lines, problems)``: the install's time and size, and what failed.
    """
    folder, sdist, pipeline_pb = os.path.abspath(folder), os.path.abspath(sdist), os.path.abspath(pipeline_pb)
    venv = os.path.join(folder, "venv")
    t0 = time.time()
    steps = [[sys.executable, "-m", "venv", "--clear", venv],
             [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", sdist]]
    for cmd in steps:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if run.returncode:
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            return [], [f"the staged sdist does not install in a fresh venv ({' '.join(cmd[-3:])}): " + " | ".join(tail)]
    installed = time.time() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(venv) for f in fs
               if not os.path.islink(os.path.join(d, f)))
    run = subprocess.run([os.path.join(venv, "bin", "python"), "-c", _VENV_CHECK, pipeline_pb],
                         capture_output=True, text=True, timeout=timeout, cwd=folder)
    if run.returncode:
        tail = run.stderr.strip().splitlines()[-3:]
        return [], ["in the fresh venv, the job's DoFns do not unpickle: " + " | ".join(tail)]
    n, where = run.stdout.split()[:2]
    return [f"fresh venv: pip installed the staged sdist in {installed:.0f} s ({size / 1e6:,.0f} MB with its "
            f"dependencies, as a worker would); {n} DoFns unpickled there, dataprep from {where}"], []


def run_dry(config: MixtureConfig, pre, output: str, options, folder: str, venv: bool) -> DryRunReport:
    """Builds the Dataflow job of ``config`` (translation, staging, job description) and checks it.

    Args:
      config: the validated mixture config; ``pre``: its ``dataprep.preflight.Preflight``.
      output: the ``--output`` the job would write.
      options: the Beam ``PipelineOptions`` (``--runner DataflowRunner`` and its options).
      folder: where the staged files and ``dataflow_job.json`` go (created).
      venv: also install the staged sdist into a fresh venv (``--dry-run-venv``).

    Raises:
      ConfigError: apache-beam[gcp] is missing, or the runner is not Dataflow.
    """
    import apache_beam as beam
    from apache_beam.options.pipeline_options import GoogleCloudOptions, SetupOptions, StandardOptions

    from dataprep import pipeline, preflight, sizing

    require_gcp()
    from apache_beam.runners.dataflow.internal import apiclient

    runner = options.view_as(StandardOptions).runner
    if str(runner).rsplit(".", 1)[-1] != "DataflowRunner":
        raise ConfigError(f"--dry-run builds a Dataflow job: pass --runner DataflowRunner (got {runner!r})")
    gco = options.view_as(GoogleCloudOptions)
    lines = [f"options: DataflowRunner, project {gco.project}, region {gco.region}, temp_location "
             f"{gco.temp_location}, setup_file {options.view_as(SetupOptions).setup_file}: parsed and "
             "validated by Beam"]
    shards = {n: preflight.num_shards(config, pre, n) for n in config.source_names}
    lines.append(f"config: {config.path}: {len(config.sources)} sources, {sum(map(len, pre.files.values())):,} files, "
                 f"{pre.input_bytes / 1e6:,.1f} MB listed, tokenizer sha256 {pre.tokenizer_sha256[:16]}... checked; "
                 "shards " + ", ".join(f"{n} {k}" for n, k in shards.items()))
    problems = unreachable_paths(config, output, gco.temp_location)
    prepare_options(options)
    p = beam.Pipeline(options=options)
    vocab = int(pre.tokenizer_info["vocab_size"])
    from contract.codec import token_dtype_for_vocab

    _ = p | "Pack" >> pipeline.PackSources(config, pre.files, pre.tokenizer_sha256, token_dtype_for_vocab(vocab).name,
                                           output, num_shards=shards, sizes=pre.sizes)
    t0 = time.time()
    result = p.run()  # translation and the --setup_file sdist; returns before any Dataflow client
    job = result.job
    staging = os.path.join(folder, "staging")
    shutil.rmtree(staging, ignore_errors=True)  # a former dry run's files
    os.makedirs(staging)
    gco = job.options.view_as(GoogleCloudOptions)
    gco.no_auth = True
    gco.staging_location = staging
    apiclient.DataflowApplicationClient(job.options, staging).create_job_description(job)
    job_file = os.path.join(folder, "dataflow_job.json")
    with open(job_file, "w", encoding="utf-8") as f:
        f.write(job.json())
    built = time.time() - t0
    stages, dofns, coders, found = check_proto(job.proto_pipeline)
    problems += found
    staged = tuple((name, os.path.getsize(os.path.join(staging, name)), _sha256(os.path.join(staging, name)))
                   for name in sorted(os.listdir(staging)))
    image = json.loads(job.json())["environment"]["workerPools"][0].get("workerHarnessContainerImage", "?")
    lines.append(f"job: translated in {built:.1f} s; {len(stages)} stages: {', '.join(stages)}")
    lines.append(f"checked: {dofns} DoFns unpickled and {coders} coders loaded from the job's proto"
                 + ("; every GroupByKey's key coder is deterministic" if not found else ""))
    lines.append(f"job description (what would be submitted, container {image}): {job_file}")
    lines.append(f"would be staged ({staging}):")
    for name, size, sha in staged:
        what = ""
        if name == "workflow.tar.gz":
            have = sdist_packages(os.path.join(staging, name))
            missing = [m for m in WORKER_PACKAGES if m not in have]
            what = f"  the sdist of --setup_file: packages {', '.join(have)}"
            if missing:
                problems.append(f"the staged sdist lacks {missing}, which the DoFns import on the workers")
        lines.append(f"  {name}: {size:,} bytes, sha256 {sha[:16]}...{what}")
    if "workflow.tar.gz" not in {s[0] for s in staged}:
        problems.append("no sdist is staged: pass --setup_file ./pyproject.toml, or the workers cannot import dataprep")
    if venv and "workflow.tar.gz" in {s[0] for s in staged}:
        more, bad = venv_install(os.path.join(staging, "workflow.tar.gz"), os.path.join(staging, "pipeline.pb"),
                                 folder)
        lines += more
        problems += bad
    lines.append("workers (docs/dataprep.md, \"Sizing\"): " + sizing.worker_plan(pre.shards).describe())
    return DryRunReport(tuple(lines), tuple(problems), staged, tuple(stages), dofns, job_file)


def main_lines(report: DryRunReport) -> str:
    """The text ``dataprep.pack --dry-run`` prints: the report, then the problems (if any)."""
    head = ("dry run: the Dataflow job was built and checked; nothing was submitted and nothing left this "
            "machine (Beam's DataflowRunner with --dry_run, then its job description staged to a local folder)")
    text = "\n".join([head, *report.lines])
    if report.problems:
        text += "\nproblems (the job as built would fail on Dataflow):\n  " + "\n  ".join(report.problems)
    return text + "\n"
