"""MaxText fed by the loader and replayed by replay (integrations/maxtext/), on a tiny MoE on 4 CPU devices.

The model: MaxText's ``decoder_block=mixtral``, 4 experts, top-2, 2 layers, width 64, on a mesh of
``ici_data_parallelism=2 ici_expert_parallelism=2``, fed by a packed dataset (``loader.testing``'s real
ArrayRecord shards and manifest, rows of 128 tokens). One run's training process is killed with
SIGKILL in the middle of a step after checkpoint 4 was committed, then resumed to step 8; its log must
equal the uninterrupted run's, bit for bit.

Needs MaxText (``bash scripts/setup_maxtext.sh`` makes ``.venv-maxtext``; ``.ci/run`` runs this file
with it); skipped with the reason elsewhere.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from integrations.maxtext import internals

pytestmark = pytest.mark.skipif(not internals.available(),
                                reason="MaxText is not installed in this Python (bash scripts/setup_maxtext.sh makes "
                                       ".venv-maxtext, where .ci/run runs these tests)")

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = ["steps=8", "learning_rate_schedule_steps=8", "checkpoint_period=4"]


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               DECOUPLE_GCLOUD="TRUE", PYTHONPATH=str(REPO))
    return env


def _run(args, devices: int, cwd) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(devices), capture_output=True, text=True,
                       timeout=900)
    return p


def _launcher(root: pathlib.Path, name: str, *extra: str, steps: int = 8) -> list[str]:
    from integrations.maxtext.testing import TINY, base_yml

    return ["-m", "integrations.maxtext.train", base_yml(), f"run_name={name}", f"base_output_directory={root}", *TINY,
            f"steps={steps}", *STEPS[1:], "--dataset", str(root / "dataset"), "--mixture", str(root / "mixture.yaml"),
            *extra]


def _train(root: pathlib.Path, name: str, *extra: str) -> None:
    p = _run(_launcher(root, name, *extra), 4, root)
    assert p.returncode == 0, p.stderr[-3000:]


def _train_and_kill(root: pathlib.Path, name: str, after: str) -> list[str]:
    """Starts the launcher and sends it SIGKILL as soon as it prints the line starting with ``after``
    (the step's log line, written after the step's fingerprints); returns the lines it printed.

    The process is given ``steps=1000`` (how far to train is not part of the run's identity, and the
    learning-rate schedule is fixed by ``learning_rate_schedule_steps=8``), so that it is still training
    when the kill lands, however slowly this test reads its output."""
    with open(root / f"{name}.stderr", "w") as err:
        p = subprocess.Popen([sys.executable, *_launcher(root, name, steps=1000)], cwd=root, env=_env(4),
                             stdout=subprocess.PIPE, stderr=err, text=True)
        lines = []
        try:
            for line in p.stdout:
                lines.append(line)
                if line.startswith(after):
                    os.kill(p.pid, signal.SIGKILL)
                    break
        finally:
            p.stdout.close()
            code = p.wait(timeout=900)
    assert code == -signal.SIGKILL, f"exit {code}, not killed; stderr: {(root / f'{name}.stderr').read_text()[-3000:]}"
    return lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from integrations.maxtext.testing import write_dataset

    root = tmp_path_factory.mktemp("maxtext")
    write_dataset(str(root))
    _train(root, "whole")
    printed = _train_and_kill(root, "resumed", "step 5:")
    killed = (root / "resumed" / "fingerprints.jsonl").read_text()
    _train(root, "resumed")
    return root, (printed, killed)


def _lines(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines() if x.strip()]


def test_eight_steps_and_a_kill_and_resume_are_bit_identical(runs):
    root, (printed, killed) = runs
    whole, resumed = _lines(root / "whole" / "fingerprints.jsonl"), _lines(root / "resumed" / "fingerprints.jsonl")
    assert [d["step"] for d in whole] == list(range(8))
    # the killed attempt: it had logged steps 0..5 at least, and checkpoint 4 was committed before the kill
    trained = [json.loads(x)["step"] for x in killed.splitlines()[:6]]
    assert trained == list(range(6)) and any(x.startswith("step 5:") for x in printed)
    events = _lines(root / "resumed" / "events.jsonl")
    restores = [e for e in events if e["event"] == "restore"]
    assert len(restores) == 1 and events[-1]["event"] == "end"
    last_committed = max(e["step"] for e in events if e["event"] == "checkpoint" and e["attempt"] == 1)
    assert restores[0]["step"] == last_committed >= 4  # the newest checkpoint committed before the kill
    assert resumed == whole  # loss and gradient-norm bits, batch hash, every leaf of every device
    assert {0, 4, 8} <= {int(n) for n in os.listdir(root / "resumed" / "checkpoints") if n.isdigit()}
    state = json.loads(next((root / "whole" / "checkpoints" / "4" / "iter").glob("process_*.json")).read_text())
    assert state["next_step"] == 4  # the loader state inside MaxText's checkpoint
    env = json.loads((root / "whole" / "env.json").read_text())
    assert env["versions"]["jax"] == "0.11.2" and env["backend"]["platform_version"]
    first = whole[0]
    assert len(first["devices"]) == 4 and all(len(v) == len(first["leaves"]) for v in first["devices"].values())


def _replay(root, *args):
    return _run(["-c", "import sys; from replay.cli import main; sys.exit(main())", *args, "--run", str(root / "whole")],
                8, root)


def test_replay_acquits_a_clean_range_on_two_placements(runs):
    root, _ = runs
    p = _replay(root, "range", "--steps", "4:5", "--devices", "good", "--placements", "2", "--no-progress")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ACQUITTED (exit code 0): the replay reproduces the log" in p.stdout
    assert "on [0, 1, 2, 3]" in p.stdout and "on [4, 5, 6, 7]" in p.stdout  # two placements


def test_a_drill_is_convicted_on_its_device(runs):
    root, _ = runs
    p = _replay(root, "drill", "--devices", "0-3", "--seed", "31", "--step", "5", "--device", "2", "--no-canary")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "convicted device 2 " in p.stdout and "at step 5" in p.stdout and "1 of 1 drill(s) caught" in p.stdout


def test_inspect_lists_the_documents_of_a_maxtext_step(runs):
    root, _ = runs
    import loader

    p = _replay(root, "inspect", "--steps", "5:6", "--json", str(root / "inspect.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    listed = (root / "inspect.json").read_text()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    one = Mesh(np.asarray(jax.devices()[:1], dtype=object), ("data",))
    data = loader.build(mixture=str(root / "mixture.yaml"), dataset=str(root / "dataset"), global_batch=4, seed=0,
                        mesh=one)
    rows = data.read_rows(5)
    keys = sorted({k for r in rows for k in r.doc_keys})
    assert keys and all(k in listed for k in keys)


def test_scan_reads_a_maxtext_run(runs):
    root, _ = runs
    p = _replay(root, "scan")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_canary_runs_maxtext_on_each_device_alone(runs):
    root, _ = runs
    p = _replay(root, "canary", "--devices", "0-1", "--no-progress")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ACQUITTED (exit code 0): all 2 device(s) agree" in p.stdout
    assert (root / "whole" / "canary" / "golden.json").exists()



def test_a_two_process_run_trains_and_replays(tmp_path):
    """Two training processes under jax.distributed on localhost (gloo collectives), 2 CPU devices each and
    one mesh of 4 (data 2 x expert 2), train 2 steps into one run directory; a one-process replay of them
    (4 of 8 devices, with gloo as the run recorded) reproduces their log."""
    from integrations.maxtext.testing import write_dataset
    from replay.run import distributed

    write_dataset(str(tmp_path))
    port = distributed.free_port()
    procs, errs = [], []
    for i in range(2):
        errs.append(open(tmp_path / f"p{i}.stderr", "w"))
        procs.append(subprocess.Popen(
            [sys.executable, *_launcher(tmp_path, "two", "--coordinator-address", f"127.0.0.1:{port}",
                                        "--num-processes", "2", "--process-id", str(i), steps=2)],
            cwd=tmp_path, env=_env(2), stdout=subprocess.DEVNULL, stderr=errs[-1]))
    codes = [p.wait(timeout=900) for p in procs]
    for f in errs:
        f.close()
    assert codes == [0, 0], (tmp_path / "p0.stderr").read_text()[-3000:]
    run = tmp_path / "two"
    env = json.loads((run / "env.json").read_text())
    assert env["backend"]["process_count"] == 2 and env["backend"]["collectives"] == "gloo"
    assert sorted(os.listdir(run / "checkpoints" / "0" / "iter")) == ["commit_success.txt", "process_0-of-2.json",
                                                                      "process_1-of-2.json"]
    p = _run(["-c", "import sys; from replay.cli import main; sys.exit(main())", "range", "--steps", "0:2",
              "--devices", "good", "--placements", "1", "--no-progress", "--run", str(run)], 8, tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ACQUITTED (exit code 0): the replay reproduces the log" in p.stdout
