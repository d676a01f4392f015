"""Shared fixtures of the replay tests: one short reference-trainer run, trained once per test session.

The run (``replay.reference.run.train``, the library function behind ``python -m
replay.reference.train``) uses a 2x2 mesh of devices 0-3, so that devices 4-7 form a second,
disjoint good set. It has a mixture phase change at step 6, a skipped data window at step 8,
and was killed after step 5 (checkpoint 6 never committed, a torn last line in
fingerprints.jsonl) and resumed from checkpoint 4.

Registered as a plugin by ``tests/conftest.py`` (``pytest_plugins``) so that the session-scoped
fixtures exist once for every replay test module; heavy imports happen inside the fixtures.
"""

import dataclasses
import os
import shutil

import pytest

STEPS = 12
CHECKPOINT_EVERY = 4
MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "head_dim": 8, "n_experts": 2, "top_k": 1, "d_ff": 16}


def write_run_inputs(root, *, tokenizer=None, vocab_size=64):
    """A synthetic dataset with two sources and a phase change at step 6, plus its mixture YAML."""
    import yaml

    from loader.testing import synthetic_mixture, write_synthetic_dataset

    mix = synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=16, phases=[(6, {"a": 0.25, "b": 0.75})])
    raw = mix.to_dict()
    if tokenizer is not None:  # a real model: pinned, so the manifest records its sha256
        import hashlib

        raw["tokenizer"] = {"path": tokenizer, "sha256": hashlib.sha256(open(tokenizer, "rb").read()).hexdigest()}
    mix_path = os.path.join(root, "mixture.yaml")
    with open(mix_path, "w") as f:
        yaml.safe_dump(raw, f)
    from contract.config import load_mixture

    mix = load_mixture(mix_path)
    write_synthetic_dataset(os.path.join(root, "dataset"), {"a": 40, "b": 30}, seq_len=16, vocab_size=vocab_size,
                            mixture=mix)
    return mix_path


def run_config(root, mix_path, **over):
    from replay.reference import run as ref_run

    raw = {"name": "t", "mixture": mix_path, "dataset": os.path.join(root, "dataset"), "global_batch": 8,
           "seed": 3, "mesh": {"data": 2, "expert": 2}, "model": MODEL, "checkpoint_every": CHECKPOINT_EVERY,
           "skip_windows": [[8, 8]], "optimizer": {"warmup_steps": 2}, "canary": {"step": 1, "seed": 7}}
    raw.update(over)
    return ref_run.run_config_from_dict(raw, root)


@pytest.fixture(scope="session")
def replay_made(tmp_path_factory):
    """(run_dir, trainer): the killed-and-resumed run of the module docstring."""
    import jax

    from replay.reference import loop

    root = str(tmp_path_factory.mktemp("replay_run"))
    mix_path = write_run_inputs(root)
    cfg = run_config(root, mix_path)
    from loader.dataset import read_manifest
    from replay.reference.trainer import ReferenceTrainer, make_mesh

    manifest, _ = read_manifest(cfg.dataset)
    trainer = ReferenceTrainer(cfg.model_config(int(manifest.tokenizer["vocab_size"])), cfg.optimizer)
    mesh = make_mesh(dict(cfg.mesh), jax.devices()[:4])
    run_dir = os.path.join(root, "run")
    def quiet(_):
        return None

    loop.train(run_dir, cfg, 6, trainer=trainer, mesh=mesh, output=loop.Output(log=quiet))
    # The kill: checkpoint 6 was never committed and the last fingerprint line is torn.
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "6"))
    with open(os.path.join(run_dir, "fingerprints.jsonl"), "a") as f:
        f.write('{"batch_hash": "12ab", "devi')
    loop.train(run_dir, cfg, STEPS, trainer=trainer, mesh=mesh, output=loop.Output(log=quiet))
    return run_dir, trainer


@pytest.fixture(scope="session")
def replay_session(replay_made):
    """A ``replay.verify.engine.Session`` on the run, reusing the training's trainer (and compiled steps)."""
    from replay.verify import engine
    from replay.run import runlog

    run_dir, trainer = replay_made
    run = runlog.load_run(run_dir)
    setup = engine.default_setup(run)
    # Reuse the training's trainer: same mesh, so its compiled step is reused (a test-time saving only).
    return engine.Session(run, dataclasses.replace(setup, trainer=trainer))


@pytest.fixture
def run_dir(replay_session, monkeypatch):
    """The shared run's directory, with ``engine.default_setup`` handing out the session's set-up
    (its compiled trainer), so CLI calls in tests do not recompile."""
    from replay.verify import engine

    setup = replay_session.setup
    monkeypatch.setattr(engine, "default_setup", lambda run: dataclasses.replace(setup))
    return replay_session.run.run_dir


@pytest.fixture
def run_copy(run_dir, tmp_path):
    """A private copy of the shared run directory, for tests that damage or extend it."""
    dst = str(tmp_path / "run")
    shutil.copytree(run_dir, dst)
    return dst


@pytest.fixture(scope="session")
def triage_drills(tmp_path_factory):
    """``replay.triage_drill.Drills``: the triage drills' dataset, mesh and trainers, compiled once per
    test process (tests/test_replay_triage.py and test_replay_goodput.py train their short runs with it)."""
    from replay import triage_drill

    return triage_drill.Drills(str(tmp_path_factory.mktemp("triage_drills")))


def as_saved_before_records(run_dir, steps=None):
    """Makes ``run_dir`` read as a run written before checkpoint state records, for the checkpoints ``steps``
    (default: all): their ``checkpoint_records/<step>.json`` removed and the ``state`` of their checkpoint events
    dropped (an old run has neither; a record missing beside an event that says one was written is a loss, which
    ``statefp.read_record`` refuses)."""
    import json

    from replay.run import protocol as proto
    from replay.run import statefp

    folder = os.path.join(run_dir, statefp.RECORDS_DIR)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    chosen = {int(n.split(".")[0]) for n in names} if steps is None else set(steps)
    for s in chosen:
        if os.path.exists(statefp.record_path(run_dir, s)):
            os.remove(statefp.record_path(run_dir, s))
    if steps is None and os.path.isdir(folder):
        shutil.rmtree(folder)
    path = os.path.join(run_dir, proto.EVENTS_NAME)
    lines = []
    for line in open(path, encoding="utf-8").read().splitlines():
        e = json.loads(line)
        if e.get("event") == "checkpoint" and (steps is None or e.get("step") in chosen):
            e.pop("state", None)
        lines.append(json.dumps(e, sort_keys=True))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
