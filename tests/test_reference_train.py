"""The training command: run directory, determinism, kill-and-restart, events, config errors."""

import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from replay.run import protocol as proto
from replay.reference import checkpoint as ckpt
from replay.reference import hooks, loop
from replay.reference.drills import DrillHooks
from replay.reference import run as runm
from replay.reference.testing import write_tiny_run
from replay.reference.train import main as train_main

STEPS = 30
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    path = write_tiny_run(str(folder), checkpoint_every=10, skip_windows=[[3, 4]])
    cfg = runm.load_run_config(path)
    trainer, mesh, _ = runm.make_trainer(cfg)
    run_a = folder / "run_a"
    summary = loop.train(str(run_a), cfg, STEPS, trainer=trainer, mesh=mesh,
                         output=loop.Output(log=lambda s: None))
    return folder, path, cfg, trainer, mesh, run_a, summary


def _lines(run_dir):
    return (pathlib.Path(run_dir) / proto.FINGERPRINTS_NAME).read_text().splitlines()


def test_two_runs_of_30_steps_have_bit_identical_fingerprints(tiny):
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    run_b = folder / "run_b"
    loop.train(str(run_b), cfg, STEPS, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    a, b = _lines(run_a), _lines(run_b)
    assert len(a) == STEPS
    assert [json.loads(x)["step"] for x in a] == list(range(STEPS))
    assert a == b  # byte-identical lines: every leaf, every device, loss, norm, batch hash
    fps = proto.read_fingerprints(str(run_a))
    assert len({fp.batch_hash for fp in fps.values()}) == STEPS  # a different batch each step


def test_run_directory_layout_and_events(tiny):
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    assert sorted(os.listdir(run_a)) == ["checkpoint_records", "checkpoints", "env.json", "events.jsonl", "fingerprints.jsonl", "inputs.json",
                                         "mixture.yaml", "run_config.yaml", "signals.jsonl",
                                         "train.png"]  # canary_every 0: no canary.jsonl
    assert ckpt.all_steps(str(run_a / "checkpoints")) == [0, 10, 20, 30]
    env = json.loads((run_a / "env.json").read_text())
    assert env["mesh"]["shape"] == [4, 2] and env["backend"]["device_count"] == 8
    events = proto.read_events(str(run_a))
    kinds = [(e["event"], e["step"]) for e in events]
    assert kinds[0] == ("start", 0) and kinds[-1] == ("end", STEPS)
    assert ("skipped_window", 3) in kinds
    # phase 1 starts at data step 10 = training step 8 (steps 3..4 skipped two data steps)
    assert ("phase_change", 8) in kinds
    assert [s for e, s in kinds if e == "checkpoint"] == [0, 10, 20, 30]
    assert {e["attempt"] for e in events} == {1} and all(isinstance(e["t"], float) for e in events)
    saved = yaml.safe_load((run_a / "run_config.yaml").read_text())
    assert saved == cfg.to_dict()
    # the run keeps what it trained with: its mixture (a copy, paths absolute) and the manifest's hash
    from contract.config import load_mixture

    inputs = json.loads((run_a / "inputs.json").read_text())
    assert inputs["mixture"]["sha256"] == load_mixture(cfg.mixture).sha256() == \
        load_mixture(str(run_a / "mixture.yaml")).sha256()
    assert inputs["dataset"]["manifest_sha256"] == hashlib.sha256(
        (pathlib.Path(cfg.dataset) / "manifest.json").read_bytes()).hexdigest()


def test_loss_goes_down_on_synthetic_data(tiny):
    losses = tiny[-1]["losses"]
    first = np.mean([losses[s] for s in range(5)])
    last = np.mean([losses[s] for s in range(STEPS - 5, STEPS)])
    assert last < first - 0.1, (first, last)


def test_checkpoint_holds_loader_state_and_restores(tiny):
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    state, loader_state = trainer.restore(str(run_a), 20, mesh)
    assert loader_state["next_step"] == 20
    fps = proto.read_fingerprints(str(run_a))
    data = runm.build_loader(cfg, mesh, state=loader_state)
    _, fp = trainer.train_step(state, data.batch_at(20), 20)
    assert fp.bits_equal(fps[20])


def test_canary_batch_is_the_batch_of_its_step(tiny):
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    from replay.run import fingerprint as fpm

    batch = runm.canary_batch(cfg, mesh)
    assert fpm.fingerprint_hex(fpm.fingerprint_np(batch["inputs"])) == proto.read_fingerprints(str(run_a))[0].batch_hash


def test_sigkill_at_a_random_step_then_restart_matches_uninterrupted(tiny):
    """A training subprocess (loader with a Grain worker process) is SIGKILLed mid-run, then resumed."""
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    raw = yaml.safe_load(pathlib.Path(path).read_text())
    raw["loader"]["workers"] = 1
    cfg_path = folder / "run_workers.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    run_k = folder / "run_killed"
    kill_at = int(np.random.default_rng(int(time.time())).integers(6, 26))
    cmd = [sys.executable, "-m", "replay.reference.train", "--run", str(run_k), "--config", str(cfg_path),
           "--steps", str(STEPS)]
    env = dict(os.environ)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    fp_file = run_k / proto.FINGERPRINTS_NAME
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if fp_file.exists() and fp_file.read_text().count("\n") >= kill_at:
            os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its Grain worker
            break
        time.sleep(0.002)
    out = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL, f"process ended before the kill (rc {proc.returncode}):\n{out}"
    killed_lines = len(_lines(run_k))
    assert killed_lines < STEPS
    # restart: a new train() call on the same run directory (in this process, reusing the
    # compiled step; the subprocess above is the one killed)
    cfg_w = runm.load_run_config(str(cfg_path))
    loop.train(str(run_k), cfg_w, STEPS, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    assert _lines(run_k) == _lines(run_a)  # the uninterrupted run's history, byte for byte
    # the screening signals too: one line per step, none twice (timings differ, so not byte for byte)
    sig_steps = [json.loads(x)["step"] for x in (run_k / proto.SIGNALS_NAME).read_text().splitlines()]
    assert sig_steps == list(range(STEPS))
    restores = [e for e in proto.read_events(str(run_k)) if e["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] in (0, 10, 20)
    assert restores[0]["step"] <= killed_lines


def test_cli_reports_config_errors_before_any_work(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "mixture": "m.yaml", "dataset": "d", "global_batch": 8,
                                   "mesh": {"data": 4, "expert": 2}, "checkpoint_evry": 3}))
    assert train_main(["--run", str(tmp_path / "run"), "--config", str(bad), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "unknown keys ['checkpoint_evry']" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change,match",
    [
        ({"global_batch": 0}, r"global_batch: must be an int >= 1, got 0"),
        ({"mesh": {"data": 8}}, r"mesh: needs axis 'expert'"),
        ({"mesh": {"data": 0, "expert": 2}}, r"mesh.data: must be an int >= 1 or -1, got 0"),
        ({"skip_windows": [[5, 2]]}, r"skip_windows\[0\]: end 2 < start 5"),
        ({"model": {"top_k": 9}}, r"model.top_k: must be an int in \[1, n_experts=4\], got 9"),
        ({"optimizer": {"b2": 1.5}}, r"optimizer.b2: must be in \[0, 1\), got 1.5"),
        ({"canary": {"stp": 1}}, r"canary: unknown keys \['stp'\]"),
        ({"canary": {"rows": 9}}, r"canary.rows: must be <= global_batch 8, got 9"),
        ({"canary_every": -1}, r"canary_every: must be an int >= 0, got -1"),
        ({"canary_action": "halt"}, r"canary_action: must be one of \['warn', 'stop'\], got 'halt'"),
        ({"router_health": {"max_share_ratio": 0}}, r"router_health.max_share_ratio: must be >= 1, got 0"),
        ({"screening": {"cusum_h": -1}}, r"screening.cusum_h: must be > 0, got -1"),
        ({"model": {"router_bias_rate": -0.1}}, r"model.router_bias_rate: must be >= 0, got -0.1"),
    ],
)
def test_run_config_errors_name_the_field(change, match):
    raw = {"name": "x", "mixture": "m.yaml", "dataset": "d", "global_batch": 8, "mesh": {"data": 4, "expert": 2},
           "model": {"n_experts": 4}}
    raw.update(change)
    with pytest.raises(runm.RunConfigError, match=match):
        runm.run_config_from_dict(raw, "/tmp")


def test_mesh_smaller_than_the_device_count_takes_the_lowest_ids(tiny):
    import dataclasses

    import jax

    cfg = dataclasses.replace(tiny[2], mesh=(("data", 2), ("expert", 2)))
    _, mesh, _ = runm.make_trainer(cfg)
    assert [d.id for d in mesh.devices.flat] == [0, 1, 2, 3] and mesh.shape == {"data": 2, "expert": 2}

    assert [d.id for d in runm.run_devices({"data": 2, "expert": 2})] == [0, 1, 2, 3]
    assert [d.id for d in runm.run_devices({"data": -1, "expert": 2})] == [d.id for d in jax.devices()]
    with pytest.raises(runm.RunConfigError, match=r"mesh: \{'data': 8, 'expert': 2\} needs 16 devices, 8 available"):
        runm.run_devices({"data": 8, "expert": 2})


def test_run_directory_refuses_another_config(tiny, tmp_path):
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    import dataclasses

    other = dataclasses.replace(cfg, seed=1)
    with pytest.raises(runm.RunConfigError, match=r"started with another config \(differs in \['seed'\]\)"):
        loop.train(str(run_a), other, STEPS, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))


DEMO_CONFIG = REPO / "configs" / "runs" / "demo.yaml"


@pytest.mark.skipif(os.environ.get("MOE_DEMO_TRAIN") != "1",
                    reason="minutes on CPU: set MOE_DEMO_TRAIN=1 to train the demo (docs/trainer.md has its figures)")
def test_demo_trains_and_loss_goes_down(tmp_path):
    """On the real packed demo data (build/demo/dataset), when it has been built."""
    cfg = runm.load_run_config(str(DEMO_CONFIG))
    if not os.path.exists(os.path.join(cfg.dataset, "manifest.json")):
        pytest.skip(f"demo dataset not built at {cfg.dataset} (see docs/trainer.md)")
    summary = loop.train(str(tmp_path / "demo"), cfg, 20, output=loop.Output(log=lambda s: None))
    losses = summary["losses"]
    assert np.mean([losses[s] for s in range(15, 20)]) < np.mean([losses[s] for s in range(5)]) - 0.5


def test_restart_may_append_a_skip_window(tiny, tmp_path):
    """The one config change a restart accepts: a data window to skip from now on."""
    import dataclasses
    import shutil

    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    run_c = tmp_path / "run_c"
    shutil.copytree(run_a, run_c)
    grown = dataclasses.replace(cfg, skip_windows=cfg.skip_windows + ((40, 44),))
    loop.train(str(run_c), grown, STEPS, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    events = proto.read_events(str(run_c))
    restore = [e for e in events if e["event"] == "restore"][-1]
    assert restore["step"] == STEPS and restore["skip_windows_changed"] == [[3, 4], [40, 44]]
    assert any(e["event"] == "skip_window_added" and (e["start"], e["end"]) == (40, 44) for e in events)
    assert yaml.safe_load((run_c / "run_config.yaml").read_text())["skip_windows"] == [[3, 4], [40, 44]]
    assert _lines(run_c) == _lines(run_a)


def test_every_step_logs_its_screening_signals(tiny):
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    sig = proto.read_signals(str(run_a))
    fps = proto.read_fingerprints(str(run_a))
    assert sorted(sig) == list(range(STEPS))
    for s, x in sig.items():
        assert np.float32(x.loss).view(np.uint32) == fps[s].loss_bits
        assert np.float32(x.grad_norm).view(np.uint32) == fps[s].grad_norm_bits
        assert x.step_time_s > 0 and x.loader_wait_s >= 0 and isinstance(x.loader_occupancy, int)
        # the input side: the level at the ask, the step's minimum, where a wait went (stages add up to it)
        assert isinstance(x.loader_occupancy_min, int) and x.loader_occupancy_min <= x.loader_occupancy
        assert set(x.loader_wait_stages) <= {"index", "read", "decode", "rows", "transfer", "other"}
        assert (x.loader_wait_stages == {}) == (x.loader_occupancy > 0)
        if x.loader_wait_stages:
            assert sum(x.loader_wait_stages.values()) == pytest.approx(x.loader_wait_s, abs=1e-5)
        assert sorted(x.devices) == list(range(8)) and len(x.replicas) == 8 and len(x.router) == 2
        assert sum(r.dot for r in x.replicas) == pytest.approx(x.grad_norm ** 2, rel=1e-4)
        assert all(sum(layer.expert_share) == pytest.approx(1.0) for layer in x.router)
    # the first step: the buffer starts empty, so its minimum is 0 (at the ask itself the prefetch thread,
    # started by that first ask, may already have placed the batch: its level then is 0 or 1)
    assert sig[0].loader_occupancy_min == 0 and sig[0].loader_occupancy in (0, 1)


def _canary_run(tiny, tmp_path, name, steps, **over):
    import dataclasses

    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    cfg = dataclasses.replace(cfg, canary_every=4, **over)
    return cfg, trainer, mesh, tmp_path / name


def test_periodic_canary_runs_every_n_steps_and_names_a_mismatching_device(tiny, tmp_path):
    cfg, trainer, mesh, run_dir = _canary_run(tiny, tmp_path, "canary", 10)
    fault = proto.FaultSpec(step=5, device_id=3, leaf="['layers'][0]['wq']", element=7, bit=0)
    with pytest.warns(hooks.CanaryMismatchWarning, match=r"canary before step 8: device\(s\) \[3\]"):
        summary = loop.train(str(run_dir), cfg, 10, trainer=trainer, mesh=mesh,
                             output=loop.Output(log=lambda s: None), drill=DrillHooks(canary_fault=fault))
    recs = proto.read_canary(str(run_dir))
    assert [(r.step, r.device) for r in recs] == [(s, d) for s in (0, 4, 8) for d in range(8)]
    assert {r.golden for r in recs if r.step == 0} == {"created"} and {r.golden for r in recs if r.step == 4} == {"matched"}
    assert [(r.step, r.device) for r in recs if r.status != "ok"] == [(8, 3)]
    assert {r.status for r in recs if r.step == 8 and r.device == 3} == {"differs_from_golden"}
    assert len({r.signature for r in recs if r.status == "ok"}) == 1  # bit-identical across devices and time
    events = [e for e in proto.read_events(str(run_dir)) if e["event"] == "canary_mismatch"]
    assert [(e["step"], e["devices"], e["verdict"]) for e in events] == [(8, [3], "convicted")]
    assert summary["stopped"] is None and len(summary["canary_seconds"]) == 3
    assert sorted(proto.read_fingerprints(str(run_dir))) == list(range(10))  # training went on (warn)
    golden = json.loads((run_dir / "canary" / "golden.json").read_text())
    assert len(golden) == 1 and next(iter(golden.values()))["canary"]["program"] == "mesh:data4xexpert2"


def test_canary_action_stop_stops_at_the_mismatch_with_a_checkpoint(tiny, tmp_path):
    cfg, trainer, mesh, run_dir = _canary_run(tiny, tmp_path, "stop", 10, canary_action="stop")
    fault = proto.FaultSpec(step=3, device_id=6, leaf="['embed']", element=0, bit=0)
    with pytest.warns(hooks.CanaryMismatchWarning):
        summary = loop.train(str(run_dir), cfg, 10, trainer=trainer, mesh=mesh,
                             output=loop.Output(log=lambda s: None), drill=DrillHooks(canary_fault=fault))
    assert summary["stopped"]["step"] == 4 and sorted(summary["losses"]) == [0, 1, 2, 3]
    kinds = [(e["event"], e["step"]) for e in proto.read_events(str(run_dir))]
    assert ("stopped", 4) in kinds and ("checkpoint", 4) in kinds and kinds[-1] == ("end", 4)
    assert ckpt.all_steps(str(run_dir / "checkpoints")) == [0, 4]


KILL_DURING_SAVE = """
import os, sys, time
from orbax.checkpoint._src.path import atomicity
original = atomicity.AtomicRenameTemporaryPath.finalize
async def slow_commit(self, *a, **k):
    if os.path.basename(str(self.get_final())) == "4":  # checkpoint 4: hold its commit back
        open(sys.argv[1], "w").write("saving")
        time.sleep(300)
    return await original(self, *a, **k)
atomicity.AtomicRenameTemporaryPath.finalize = slow_commit
from replay.reference.train import main
sys.exit(main(sys.argv[2:]))
"""


def test_checkpoint_event_only_after_the_async_save_commits(tiny, tmp_path):
    """Killed while Orbax's asynchronous save of checkpoint 4 is still committing (its commit is held
    back): the run went on training, but no `checkpoint` event names 4; resumed, it restores 0."""
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    raw = yaml.safe_load(pathlib.Path(path).read_text())
    raw["checkpoint_every"] = 4
    cfg_path = folder / "run_every4.yaml"  # beside the dataset (relative paths)
    cfg_path.write_text(yaml.safe_dump(raw))
    run_dir, mark = tmp_path / "run", tmp_path / "saving"
    script = tmp_path / "kill_during_save.py"
    script.write_text(KILL_DURING_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), str(mark), "--run", str(run_dir), "--config", str(cfg_path),
                             "--steps", "8"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    fp_file = run_dir / proto.FINGERPRINTS_NAME
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        # the save of 4 is in flight and training has moved past it
        if mark.exists() and fp_file.exists() and fp_file.read_text().count("\n") >= 6:
            break
        time.sleep(0.01)
    events_then = proto.read_events(str(run_dir))
    os.killpg(proc.pid, signal.SIGKILL)
    out = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL, out
    assert [e["step"] for e in events_then if e["event"] == "checkpoint"] == [0]
    assert [e["step"] for e in proto.read_events(str(run_dir)) if e["event"] == "checkpoint"] == [0]
    assert not ckpt.is_committed(str(run_dir / "checkpoints"), 4) and ckpt.is_committed(str(run_dir / "checkpoints"), 0)
    cfg4 = runm.load_run_config(str(cfg_path))
    loop.train(str(run_dir), cfg4, 8, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    events = proto.read_events(str(run_dir))
    assert [e["step"] for e in events if e["event"] == "restore"] == [0]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [0, 4, 8]
    assert all(ckpt.is_committed(str(run_dir / "checkpoints"), s) for s in (0, 4, 8))


def test_every_run_config_field_is_documented_and_the_demo_config_comments_each():
    """docs/trainer.md's "Run config" table names every field; configs/runs/demo.yaml comments each line."""
    import dataclasses

    from replay.reference.model import ModelConfig
    from replay.reference.trainer import OptimizerConfig
    from replay.screen.screening import RouterHealth

    doc = (REPO / "docs" / "trainer.md").read_text()
    table = doc[doc.index("## Run config"):doc.index("## Determinism")]
    fields = set(runm._KEYS) - {"loader", "model", "optimizer", "canary", "router_health", "screening"}
    fields.add("screening.*")
    fields |= {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
    fields |= {f"optimizer.{f.name}" for f in dataclasses.fields(OptimizerConfig)}
    fields |= {f"router_health.{f.name}" for f in dataclasses.fields(RouterHealth)}
    fields |= {"loader.workers", "loader.prefetch", "canary.step", "canary.seed", "canary.rows", "canary.seq_len"}
    missing = []
    for f in sorted(fields):
        head, _, leaf = f.rpartition(".")
        if f"`{f}`" not in table and not (head and f"`{leaf}`" in table and f"`{head}." in table):
            missing.append(f)
    assert missing == [], missing
    for n, line in enumerate(DEMO_CONFIG.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"configs/runs/demo.yaml:{n} has no comment: {line!r}"


def test_resume_refuses_a_run_logged_with_another_fingerprint_version(tiny, tmp_path):
    """One fingerprints.jsonl, one formula: a run started by another release is not trained on."""
    import shutil

    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    run_v = tmp_path / "run_v"
    shutil.copytree(run_a, run_v)
    env = json.loads((run_v / proto.ENV_NAME).read_text())
    env["versions"]["fingerprint"] = 1
    (run_v / proto.ENV_NAME).write_text(json.dumps(env))
    before = _lines(run_v)
    with pytest.raises(runm.RunConfigError, match=r"cannot resume .*run_v: its fingerprints.jsonl holds fingerprints "
                                                  r"of formula version 1 .* this code computes version 2"):
        loop.train(str(run_v), cfg, STEPS + 5, trainer=trainer, mesh=mesh, output=loop.Output(log=lambda s: None))
    assert _lines(run_v) == before  # nothing written


PROGRESS_LINE = (r"train: step {step} of {a}:{b} \({pct}\), [0-9.]+ (k )?steps/s, [0-9.,]+ (k )?tokens/s, "
                 r"step [0-9.]+ s, loss [0-9]+\.[0-9]{{4}}, dropped [01]\.[0-9]{{4}}")


def test_progress_lines_and_train_png_cover_a_resumed_run(tiny, tmp_path, monkeypatch):
    """Not on a terminal, with REPLAY_PROGRESS_EVERY=0: a line per step (step, range, rates, step time,
    loss, dropped fraction, ETA), then the closing line; train.png is rewritten by each invocation
    and covers the steps of the earlier one too."""
    import io
    import re

    import matplotlib.image

    from replay.run.train_plot import training_series

    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    monkeypatch.setenv("REPLAY_PROGRESS_EVERY", "0")
    run_dir = tmp_path / "run"
    first, second = io.StringIO(), io.StringIO()
    s1 = loop.train(str(run_dir), cfg, 3, trainer=trainer, mesh=mesh,
                    output=loop.Output(log=lambda s: None, progress=first))
    assert s1["plot"] == str(run_dir / "train.png") and training_series(str(run_dir))["steps"] == [0, 1, 2]
    s2 = loop.train(str(run_dir), cfg, 5, trainer=trainer, mesh=mesh,
                    output=loop.Output(log=lambda s: None, progress=second))
    lines = first.getvalue().splitlines()
    # said before the first step, so that no wait is silent (the cache's words only with JAX_COMPILATION_CACHE_DIR)
    assert lines[0] == f"train: new run in {run_dir}: initializing the parameters (seed {cfg.seed}) and saving checkpoint 0"
    assert re.fullmatch(r"train: step 0 of 0:3: compiling the train step( \(or loading from JAX's compilation cache\))?: "
                        r"the first step takes longer, the steps after it run at speed", lines[1]), lines[1]
    lines = lines[2:]
    assert len(lines) == 4
    assert re.fullmatch(r"train: step 0 of 0:3 \(33%\), step [0-9.]+ s \(compiling included\), loss [0-9]+\.[0-9]{4}, "
                        r"dropped [01]\.[0-9]{4}", lines[0]), lines[0]
    assert re.fullmatch(PROGRESS_LINE.format(step=1, a=0, b=3, pct="67%") + r", ETA [0-9.]+ s", lines[1]), lines[1]
    assert re.fullmatch(PROGRESS_LINE.format(step=2, a=0, b=3, pct="100%"), lines[2]), lines[2]
    assert re.fullmatch(r"train: steps 0:3 done in [0-9.]+ s \([0-9.]+ (k )?steps/s, [0-9.,]+ (k )?tokens/s\)",
                        lines[3]), lines[3]
    lines = second.getvalue().splitlines()
    assert lines[0] == f"train: resuming {run_dir} from checkpoint 3"
    lines = lines[2:]
    assert [x.split(",")[0] for x in lines] == ["train: step 3 of 3:5 (50%)", "train: step 4 of 3:5 (100%)",
                                                lines[2].split(",")[0]]
    assert lines[2].startswith("train: steps 3:5 done in ")
    assert f"loss {s2['losses'][4]:.4f}" in lines[1]
    series = training_series(str(run_dir))
    assert series["steps"] == [0, 1, 2, 3, 4]  # the whole run, both invocations
    logged = proto.read_signals(str(run_dir))
    assert series["loss"] == [logged[s].loss for s in range(5)]
    assert series["dropped"] == [[logged[s].router[i].dropped_fraction for s in range(5)] for i in range(2)]
    image = matplotlib.image.imread(str(run_dir / "train.png"))
    assert image.shape == (1100, 1000, 4)


def test_full_disk_error_says_what_to_do(tiny, tmp_path, monkeypatch, capsys):
    import errno

    from replay.reference import train as train_cli

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write deep in Orbax raises it: no filename

    monkeypatch.setattr(train_cli, "train", full)
    run_dir = tmp_path / "run"
    assert train_main(["--run", str(run_dir), "--config", tiny[1], "--steps", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"error: No space left on device (writing the run directory {run_dir}). Free space there, or point --run "
        f"at a folder on another disk (copy the run there first to keep its steps), then run the same command "
        f"again: python -m replay.reference.train --run {run_dir} --config {tiny[1]} --steps 3 resumes from the "
        f"last complete checkpoint\n")

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(run_dir))

    monkeypatch.setattr(train_cli, "train", denied)
    assert train_main(["--run", str(run_dir), "--config", tiny[1], "--steps", "3"]) == 2
    assert capsys.readouterr().err == f"error: {run_dir}: Permission denied\n"


def test_rerun_of_a_finished_run_prints_no_library_noise(tiny, tmp_path):
    """The command on a run already at its last step: one line and the picture's path, no absl/Orbax
    'Given directory is read only' warnings (the read-only managers' notes)."""
    import shutil

    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    run_dir = tmp_path / "finished"
    shutil.copytree(run_a, run_dir)
    logs = {p.name: p.read_bytes() for p in run_dir.glob("*.jsonl")}
    proc = subprocess.run([sys.executable, "-m", "replay.reference.train", "--run", str(run_dir), "--config", path,
                           "--steps", str(STEPS)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # nothing to do writes nothing to the run's log: no attempt, so goodput does not count the idle time since
    assert {p.name: p.read_bytes() for p in run_dir.glob("*.jsonl")} == logs
    assert proc.stdout == (f"nothing to do: run already at step {STEPS} (--steps is the step to stop at: "
                           f"--steps {STEPS + 10} trains 10 more)\n"
                           f"loss, gradient norm and router drops per step: {run_dir / 'train.png'}\n")
    assert "read only" not in proc.stderr and "absl" not in proc.stderr
    assert proc.stderr == f"train: run config {cfg.name}: starting JAX, building the mesh and the model\n"  # ours only


def test_config_typos_get_the_nearest_key_and_a_missing_dataset_says_where_its_path_came_from(tmp_path, capsys):
    base = {"name": "x", "mixture": "m.yaml", "dataset": "d", "global_batch": 8, "mesh": {"data": 4, "expert": 2}}
    with pytest.raises(runm.RunConfigError, match=re.escape(
            "unknown keys ['checkpoint_evry'] (did you mean 'checkpoint_every' for 'checkpoint_evry'?)")):
        runm.run_config_from_dict({**base, "checkpoint_evry": 3})
    with pytest.raises(ValueError, match=re.escape("model: unknown keys ['d_modle'] (did you mean 'd_model' for 'd_modle'?)")):
        runm.run_config_from_dict({**base, "model": {"d_modle": 3}})
    copied = tmp_path / "copy.yaml"
    copied.write_text((REPO / "configs" / "runs" / "demo.yaml").read_text())
    assert train_main(["--run", str(tmp_path / "run"), "--config", str(copied), "--steps", "2"]) == 2
    said, _, err = capsys.readouterr().err.partition("\nerror: ")
    assert said == "train: run config demo: starting JAX, building the mesh and the model"  # what it was doing
    err = "error: " + err
    assert err.startswith(f"error: {os.path.normpath(str(tmp_path / '../../build/demo/dataset'))}/manifest.json: no manifest")
    assert f"(the run config {copied}'s 'dataset:' is resolved against that file's folder: in a copied config" in err


def test_persistent_compilation_cache_gives_the_same_bits(tiny, tmp_path):
    """JAX_COMPILATION_CACHE_DIR (the demo and the README set it): a run whose programs are loaded
    from the cache logs the same fingerprints, byte for byte, as one that compiled them, and as
    the run trained in-process without a cache."""
    folder, path, cfg, trainer, mesh, run_a, _ = tiny
    cache = tmp_path / "jax-cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    logs = []
    for name in ("cold", "warm"):
        proc = subprocess.run([sys.executable, "-m", "replay.reference.train", "--run", str(tmp_path / name),
                               "--config", path, "--steps", str(STEPS)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        logs.append((tmp_path / name / "fingerprints.jsonl").read_bytes())
        if name == "cold":
            cached = sorted(p.name for p in cache.iterdir())
            assert any(n.startswith("jit_") for n in cached), cached  # the train step was written
        else:  # nothing new compiled: every program came from the cache
            assert sorted(p.name for p in cache.iterdir()) == cached
    assert logs[0] == logs[1] == (run_a / "fingerprints.jsonl").read_bytes()
