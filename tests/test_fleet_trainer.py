"""A user's own trainer through every ``replay`` command: examples/own_trainer/own_trainer.py (a dense
decoder in plain JAX and optax, written apart from the reference trainer, the example a user copies) logs
its run through the public writer and names its factory in its run config; range replay, canary, scan,
inspect and drills work on its run. Also: the factory's and the run config's errors, and what the trainer
adds for replay (the lines docs/trainer.md shows)."""

import json
import os
import re
import sys

import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "own_trainer")
sys.path.insert(0, EXAMPLE)  # as a user's PYTHONPATH: the run's factory is own_trainer:make_setup

import own_trainer as dt  # noqa: E402
from replay import cli  # noqa: E402
from replay.run import runlog  # noqa: E402
from replay.run import setup as setup_mod  # noqa: E402
from replay.run.codes import ExitCode  # noqa: E402
from replay.verify import engine  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    from contract.config import load_mixture
    from loader import testing as lt

    root = tmp_path_factory.mktemp("dense")
    mix = lt.synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=16)
    (root / "mixture.yaml").write_text(yaml.safe_dump(mix.to_dict()))
    lt.write_synthetic_dataset(str(root / "dataset"), {"a": 40, "b": 30}, seq_len=16, vocab_size=64,
                               mixture=load_mixture(str(root / "mixture.yaml")))
    cfg = {"name": "dense", "mixture": str(root / "mixture.yaml"), "dataset": str(root / "dataset"),
           "global_batch": 8, "vocab_size": 64, "data": 4, "checkpoint_every": 4, "seed": 1}
    run = str(root / "run")
    losses = dt.train(run, dt.Config(**cfg), 6)
    losses.update(dt.train(run, dt.Config(**cfg), STEPS))  # resumed from checkpoint 4... 8: the writer drops and re-logs
    return run, cfg, losses


@pytest.fixture
def cached_factory(monkeypatch):
    """The run's factory, through its import by name, made once per test module (its trainer keeps its
    compiled programs across the commands)."""
    made = {}
    real = dt.make_setup

    def make_setup(run):
        if run.run_dir not in made:
            made[run.run_dir] = real(run)
        return made[run.run_dir]

    monkeypatch.setattr(dt, "make_setup", make_setup)
    yield made


def test_the_run_directory_written_by_the_public_writer(dense_run):
    run_dir, cfg, losses = dense_run
    run = runlog.load_run(run_dir)
    assert run.config["trainer"] == "own_trainer:make_setup" and run.config["vocab_size"] == 64
    assert json.load(open(os.path.join(run_dir, "inputs.json")))["mixture"]["copy"] == "mixture.yaml"
    assert run.logged_steps == (0, STEPS) and not run.malformed and sorted(losses) == list(range(STEPS))
    assert run.checkpoints == [0, 4, 6, 8, STEPS]
    assert [e["event"] for e in run.events_of("start", "restore", "end")] == ["start", "end", "restore", "end"]
    assert run.env["mesh"]["shape"] == [4] and run.env["devices"]["3"]["local"] == 3
    from replay.run.protocol import read_signals

    sig = read_signals(run_dir)
    assert sorted(sig) == list(range(STEPS)) and len(sig[5].replicas) == 4 and sig[5].step_time_s > 0
    # the per-replica dots reconcile with the reduced gradient's norm
    assert sum(r.dot for r in sig[5].replicas) == pytest.approx(sig[5].grad_norm ** 2, rel=1e-4)


def test_every_command_works_on_the_second_trainers_run(dense_run, cached_factory, capsys, tmp_path):
    run_dir = dense_run[0]
    assert cli.main(["--run", run_dir, "--steps", "5:7", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["verdict"] == "acquitted" and rep["evidence"] == "per-shard" and rep["segments"][0]["start"] == 4
    assert cli.main(["canary", "--run", run_dir, "--repeats", "1", "--no-progress", "--devices", "0-3"]) == 0
    assert cli.main(["scan", "--run", run_dir]) == ExitCode.CLEAN
    assert cli.main(["inspect", "--run", run_dir, "--steps", "3"]) == 0
    # two rotated placements on devices 0-3, whose canary programs the canary above compiled
    assert cli.main(["drill", "--run", run_dir, "--step", "6", "--device", "2", "--devices", "0-3", "--no-progress",
                     "--json", str(tmp_path / "d.json")]) == 0
    drill = json.loads((tmp_path / "d.json").read_text())["drills"][0]
    assert drill["caught"] and drill["range"]["convicted_devices"] == [2] and drill["canary"]["odd_devices"] == [2]
    out = capsys.readouterr().out
    assert "convicted device 2 (host" in out and "process 0, local device 2, mesh data=2" in out
    assert list(cached_factory) == [run_dir]  # every command rebuilt the run through its factory


def test_a_screening_drill_retrains_the_second_trainer_through_the_protocol(dense_run, cached_factory, tmp_path):
    # no retrain hook in its set-up: replay retrains with train_step and the public writer
    assert cli.main(["drill", "--run", dense_run[0], "--scenario", "flip", "--step", "5", "--device", "1", "--bit", "30",
                     "--no-progress", "--to-disk", str(tmp_path / "d"), "--json", str(tmp_path / "s.json")]) == 0
    rep = json.loads((tmp_path / "s.json").read_text())["drills"][0]
    assert rep["caught"] and rep["named"]["devices"] == [1] and rep["named"]["first_step"] == 5


def _with_trainer(src, dst, value):
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, "run_config.yaml")
    raw = yaml.safe_load(open(path))
    if value is None:  # no trainer: key
        del raw["trainer"]
    elif value[0] in "+-=":  # the run config itself: a key added, removed, or given a wrong value
        raw = {**raw, "bogus": 1} if value[0] == "+" else {k: v for k, v in raw.items() if k != value[1:]} \
            if value[0] == "-" else {**raw, value[1:]: "one"}
    else:
        raw["trainer"] = value
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return dst


@pytest.mark.parametrize("value,message", [
    ("no_such_package.replay_setup:make_setup",
     "trainer: no_such_package.replay_setup:make_setup: module 'no_such_package.replay_setup' is not importable"),
    ("own_trainer:no_such_function", "module 'own_trainer' ("),
    ("own_trainer.make_setup", "is not a factory name; expected 'package.module:function'"),
    ("own_trainer:FACTORY", "'FACTORY' is a str, not a function"),
    ("fleet_bad_factory:wrong_type", "returned a builtins.dict, not a replay.run.setup.RunSetup"),
    ("fleet_bad_factory:no_protocol", "whose trainer (object) lacks ['init_state', 'restore', 'train_step']"),
    ("fleet_bad_factory:raises", "raised KeyError: 'model_size'"),
    ("fleet_bad_factory:imports_missing", "it imports 'not_installed_anywhere', which is not installed"),
    ("fleet_bad_factory:wrong_field", "returned a RunSetup whose global_batch is '8' (str): an int >= 1"),
    (None, "names no trainer: factory, so replay rebuilt the run as the reference trainer's"),
    ("+bogus", "run_config.yaml: unknown key bogus: Config takes name, mixture, dataset"),
    ("-global_batch", "run_config.yaml: missing key global_batch (Config has no default for it)"),
    ("=seed", "run_config.yaml: seed: expected int, got 'one' (str)"),
])
def test_a_factory_that_cannot_be_used_is_named_with_what_to_do(dense_run, tmp_path, monkeypatch, capsys, value,
                                                                 message):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "fleet_bad_factory.py").write_text(
        "from replay.run.setup import RunSetup\n"
        "def wrong_type(run):\n    return {'trainer': None}\n"
        "def no_protocol(run):\n"
        "    return RunSetup(trainer=object(), axis_names=('data',), shape=(4,), run_device_ids=(0, 1, 2, 3),\n"
        "                    make_loader=lambda mesh: None, seed=0, global_batch=8)\n"
        "def raises(run):\n    return run.config['model_size']\n"
        "def imports_missing(run):\n    return None\n"
        "def wrong_field(run):\n"
        "    import dataclasses, own_trainer\n"
        "    return dataclasses.replace(own_trainer.make_setup(run), global_batch='8')\n")
    (tmp_path / "mods" / "fleet_bad_factory2.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    if value is not None and value.endswith("imports_missing"):
        value = "fleet_bad_factory2:anything"
    run = _with_trainer(dense_run[0], str(tmp_path / "run"), value)
    with pytest.raises(runlog.RunDirError) as e:  # a TrainerFactoryError, or the factory's own RunDirError
        engine.Session(runlog.load_run(run))
    assert message in str(e.value)
    assert cli.main(["--run", run, "--steps", "5:6", "--no-progress"]) == ExitCode.RUN_ERROR
    err = capsys.readouterr().err
    assert "run directory or data error" in err and message in err.replace("\n", "")
    if "not importable" in message:
        assert "add its folder to PYTHONPATH" in err
    assert os.path.join(run, "run_config.yaml") in err.replace("\n", "")  # the file, with the key


def test_the_lines_a_trainer_adds_for_replay_are_few_and_docs_show_them():
    src = open(os.path.join(EXAMPLE, "own_trainer.py"), encoding="utf-8").read()
    marked = [line.strip() for line in src.splitlines() if "# replay" in line]
    assert 20 <= len(marked) <= 40, marked  # the goal: at most 40 lines exist only for replay
    docs = open(os.path.join(HERE, "..", "docs", "trainer.md"), encoding="utf-8").read()
    block = re.search(r"### The lines to add\n.*?```python\n(.*?)```", docs, re.S).group(1)
    pasted = [line.split("#")[0].strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
    code = {line.split("#")[0].strip() for line in src.splitlines()}
    assert pasted and all(line in code for line in pasted), [line for line in pasted if line not in code]
    imports = [line for line in src.splitlines() if re.match(r"\s*(from|import) ", line)]
    assert not [line for line in imports if "replay.reference" in line]  # written apart from the reference trainer
    readme = open(os.path.join(EXAMPLE, "README.md"), encoding="utf-8").read()
    assert f"{len(src.splitlines())} lines" in readme and f"{len(marked)} of them" in readme  # the counts it states
    assert f"({len(marked)} of its {len(src.splitlines())} lines)" in " ".join(docs.split())  # docs/trainer.md's


def test_the_run_config_is_refused_with_its_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: x\nmixture: m.yaml\ndataset: d\nglobal_batch: 8\nvocab_size: 64\nlearning_rate: 1e-3\n")
    with pytest.raises(setup_mod.RunConfigError, match=rf"^{re.escape(str(path))}: learning_rate: expected float, "
                                                       r"got '1e-3' \(str\)"):
        dt.load_config(str(path))  # YAML 1.1 reads 1e-3 as a string: said, not trained with
    path.write_text("name: x\nmixture: m.yaml\ndataset: d\nglobal_batch: 8\nvocab_size: 64\nlr: 0.001\nd_model: 33\n")
    with pytest.raises(setup_mod.RunConfigError, match=r"run.yaml: unknown key lr: Config takes name, mixture"):
        dt.load_config(str(path))
    path.write_text("name: x\nmixture: m.yaml\ndataset: d\nglobal_batch: 8\nvocab_size: 64\nd_model: 33\n")
    with pytest.raises(setup_mod.RunConfigError, match=r"run.yaml: d_model must divide by n_heads"):
        dt.load_config(str(path))
    path.write_text("name: x\nmixture: m.yaml\ndataset: d\nglobal_batch: 8\nvocab_size: 64\ntrainer: any:thing\n")
    cfg = dt.load_config(str(path))  # trainer: is replay's key, left out; paths against the file's folder
    assert (cfg.mixture, cfg.dataset, cfg.d_model) == (str(tmp_path / "m.yaml"), str(tmp_path / "d"), 32)


def test_the_writer_refuses_another_config_in_the_same_directory(dense_run):
    from replay.run.writer import RunConfigMismatchError

    run_dir, cfg, _ = dense_run
    with pytest.raises(RunConfigMismatchError, match=r"started with another config \(differs in \['seed'\]\)"):
        dt.train(run_dir, dt.Config(**{**cfg, "seed": 2}), STEPS)
    assert sys.modules["own_trainer"] is dt


def test_certify_walks_the_chain_of_a_users_trainer(dense_run, cached_factory, capsys, tmp_path):
    """The public writer's state records (RunWriter.record_checkpoint, the checkpoint event): every
    checkpoint of the dense trainer's run is certified by replaying its segments (issue 28)."""
    run_dir, _, _ = dense_run
    out = tmp_path / "certify.json"
    assert cli.main(["certify", "--run", run_dir, "--no-progress", "--json", str(out)]) == ExitCode.ACQUITTED
    rep = json.loads(out.read_text())
    assert [v["verdict"] for v in rep["chain"]] == ["trusted"] + ["certified"] * (len(rep["chain"]) - 1)
    assert rep["certified"] == STEPS and rep["steps_replayed"] == STEPS
