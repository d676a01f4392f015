"""Training and replay as several processes: jax.distributed on localhost, gloo collectives.

One module fixture runs, in as few processes as the checks allow (each start compiles the step):

  A. 1 process x 8 devices (``--num-processes 1``: gloo, as several processes reduce) trains the run R1.
  B. 2 processes x 4 devices train the run R2 (same config, mesh and device order); process 1 is killed
     once a few steps are logged: process 0 must stop with exit code 4 and one clear error.
  C. The same 2 processes restart: R2 resumes from its last checkpoint and finishes; then, still as
     2 processes, ``replay drill`` on R1 (a 1 x 8 run replayed by 2 x 4: range replay and canary across
     the processes) and ``replay scan`` of R2.
  D. 1 process x 8 devices: ``replay drill`` on R2 (a 2 x 4 run replayed by 1 x 8).

Every process has a timeout; a failure kills them all. Tiny model, 8 steps.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from replay.run import protocol as proto
from replay.run import runlog
from replay.verify import compare as cmp

STEPS = 8
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fleet_worker.py")
TIMEOUT_S = 420
MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "head_dim": 8, "n_experts": 2, "top_k": 1, "d_ff": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CACHE = {}


def _env(devices: int) -> dict:
    # JAX's persistent compilation cache: a process of the same shape loads what an earlier one compiled
    # (the same program, the same bits) instead of compiling it again
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([os.path.dirname(WORKER), os.environ.get("PYTHONPATH", "")]),
                JAX_COMPILATION_CACHE_DIR=CACHE["dir"], JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _flags(port: int, n: int, i: int) -> list:
    return ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]


class Procs:
    """Started processes, killed on any failure."""

    def __init__(self):
        self.all = []

    def start(self, argv, env, **kw):
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.all.append(p)
        return p

    def wait(self, p, timeout=TIMEOUT_S):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"a process of the multi-process test ran past {timeout} s: {p.args}")
        return p.returncode, out, err

    def kill(self):
        for p in self.all:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _worker(procs, out, commands, devices):
    argv = [sys.executable, WORKER, str(out)]
    for cmd in commands:
        argv += ["--", *cmd]
    return procs.start(argv, _env(devices))


def _results(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from replay.reference.testing import write_tiny_run

    root = tmp_path_factory.mktemp("fleet")
    CACHE["dir"] = str(root / "jax-cache")
    cfg = write_tiny_run(str(root / "cfg"), seq_len=16, global_batch=8, checkpoint_every=2, model=MODEL,
                         mesh={"data": 4, "expert": 2})
    r1, r2 = str(root / "r1"), str(root / "r2")
    train = ["train", "--config", cfg, "--steps", str(STEPS)]
    procs = Procs()
    out = {"root": root, "r1": r1, "r2": r2, "cfg": cfg}
    try:
        # A: 1 x 8, gloo
        p = _worker(procs, root / "a.json", [[*train, "--run", r1, *_flags(free_port(), 1, 0)]], 8)
        code, _, err = procs.wait(p)
        assert code == 0, err[-3000:]
        # B: 2 x 4, process 1 killed once 3 steps are logged (each process its own watched command)
        port = free_port()
        cmd = [sys.executable, "-m", "replay.reference.train", "--run", r2, "--config", cfg, "--steps", str(STEPS),
               "--heartbeat-timeout", "4"]
        ps = [procs.start([*cmd, *_flags(port, 2, i)], _env(4)) for i in range(2)]
        log = os.path.join(r2, "fingerprints.jsonl")
        t0 = time.monotonic()
        while time.monotonic() - t0 < TIMEOUT_S:
            if os.path.exists(log) and sum(1 for _ in open(log)) >= 3 or ps[0].poll() is not None:
                break
            time.sleep(0.05)
        ps[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code, _, err = procs.wait(ps[0])
        out["kill"] = {"code": code, "stderr": err, "seconds": time.monotonic() - killed,
                       "logged_before": len(runlog.load_run(r2).fingerprints)}
        procs.wait(ps[1])
        # C: the same 2 processes restart, finish, then replay R1 (drill) and scan R2
        port = free_port()
        ps = [_worker(procs, root / f"c{i}.json", [
            [*train, "--run", r2, *_flags(port, 2, i)],
            ["replay", "drill", "--run", r1, "--step", "5", "--device", "5", "--no-progress", "--json",
             str(root / "drill_2x4.json")],
            ["replay", "scan", "--run", r2],
            ["replay", "certify", "--run", r2, "--to", "4", "--no-progress", "--json", str(root / "certify_2x4.json")],
        ], 4) for i in range(2)]
        for p in ps:
            procs.wait(p)
        out["c"] = [_results(root / f"c{i}.json") for i in range(2)]
        # D: 1 x 8 replays R2 (a drill of a process-1 device)
        p = _worker(procs, root / "d.json", [["replay", "drill", "--run", r2, "--step", "3", "--device", "2049",
                                              "--no-canary", "--no-progress", "--json", str(root / "drill_1x8.json")]],
                    8)
        procs.wait(p)
        out["d"] = _results(root / "d.json")
    finally:
        procs.kill()
    return out


def _positional(run):
    return [cmp.positional(fp, cmp.coords_of(fp)) for _, fp in sorted(run.fingerprints.items())]


def test_a_killed_process_stops_the_other_with_a_clear_error(fleet):
    kill = fleet["kill"]
    assert kill["code"] == 4, kill["stderr"][-3000:]
    last = kill["stderr"].strip().splitlines()[-1]
    assert last.startswith("error: process 1 stopped sending heartbeats") or "coordinator" in last, last
    assert "heartbeat timeout 4 s" in last
    assert "Restart all 2 processes of the run with the same commands" in last and "resume from checkpoint" in last
    assert "Check failure stack trace" not in kill["stderr"]  # the abort's C++ trace is not passed on
    assert 0 < kill["logged_before"] < STEPS


def test_two_processes_resumed_after_the_kill_equal_one_process_bit_for_bit(fleet):
    r1, r2 = runlog.load_run(fleet["r1"]), runlog.load_run(fleet["r2"])
    assert fleet["c"][0][0]["code"] == 0 and fleet["c"][1][0]["code"] == 0, fleet["c"][0][0]["stderr"][-2000:]
    assert sorted(r2.fingerprints) == sorted(r1.fingerprints) == list(range(STEPS)) and not r2.malformed
    # Same mesh shape and device order, ids 0..7 against 0..3, 2048..2051 (JAX numbers process p's CPU
    # devices from p * 2048): every field of every step bit for bit, devices by mesh position.
    assert _positional(r2) == _positional(r1)
    raw = [e["event"] for e in proto.read_events(fleet["r2"])]  # every event, written once, by process 0
    assert [e for e in raw if e in ("start", "restore", "end")] == ["start", "restore", "end"]
    assert r2.env["backend"]["collectives"] == r1.env["backend"]["collectives"] == "gloo"
    assert [p["devices"] for p in r2.env["processes"]] == [[0, 1, 2, 3], [2048, 2049, 2050, 2051]]
    assert r2.env["devices"]["2049"] == {"process": 1, "local": 1, "host": r2.env["processes"][1]["host"], "kind": "cpu"}
    # each process wrote its own devices' entries; events once
    names = sorted(os.listdir(fleet["r2"]))
    assert "fingerprints.p00001.jsonl" in names and "signals.p00001.jsonl" in names


def test_a_one_by_eight_run_replayed_by_two_by_four_convicts_and_names_the_process(fleet):
    drill0, drill1 = fleet["c"][0][1], fleet["c"][1][1]
    assert drill0["code"] == drill1["code"] == 0, drill0["stderr"][-3000:] + drill0["stdout"][-2000:]
    rep = json.loads((fleet["root"] / "drill_2x4.json").read_text())["drills"][0]
    assert rep["caught"] and rep["range"]["convicted_devices"] == [5] and rep["range"]["first_divergent_step"] == 5
    named = rep["range"]["convicted"][0]  # a device of the run: its process and host as the run recorded them
    assert (named["id"], named["process"], named["local_device"]) == (5, 0, 5)
    assert named["mesh"] == {"data": 2, "expert": 1} and "device 5 (host" in named["label"]
    assert [p["processes"] for p in rep["range"]["placements"]] == [[0, 1], [0, 1]]
    odd = rep["canary"]["odd"][0]  # the replay's own device that stood in at the run device's position
    assert (odd["id"], odd["process"], odd["local_device"]) == (2049, 1, 1)
    assert "caught" in drill0["stdout"] and drill1["stdout"] == ""  # one report, from process 0
    scan0 = fleet["c"][0][2]
    assert scan0["code"] == 0 and "CLEAN" in scan0["stdout"]


def test_two_processes_certify_the_chain_of_a_two_process_run(fleet):
    """The state records of a run trained as 2 processes (each device's fingerprints gathered across them)
    restore and certify as 2 processes: one placement spans both (issue 28)."""
    cert0, cert1 = fleet["c"][0][3], fleet["c"][1][3]
    assert cert0["code"] == 0 and cert1["code"] == 0, cert0["stderr"][-2000:]
    rep = json.loads((fleet["root"] / "certify_2x4.json").read_text())
    assert [(v["checkpoint"], v["verdict"]) for v in rep["chain"]] == [(0, "trusted"), (2, "certified"), (4, "certified")]
    assert rep["placements"] == [[0, 1, 2, 3, 2048, 2049, 2050, 2051]] and cert1["stdout"] == ""


def test_a_two_by_four_run_replayed_by_one_by_eight_convicts_the_device_of_process_1(fleet):
    d = fleet["d"][0]
    assert d["code"] == 0, d["stderr"][-3000:]
    assert "collectives: gloo in one process" in d["stderr"]
    rep = json.loads((fleet["root"] / "drill_1x8.json").read_text())["drills"][0]
    assert rep["caught"] and rep["range"]["convicted_devices"] == [2049]
    named = rep["range"]["convicted"][0]
    assert (named["process"], named["local_device"], named["mesh"]) == (1, 1, {"data": 2, "expert": 1})
    assert "device 2049 (host" in d["stdout"] and "process 1, local device 1, mesh data=2,expert=1" in d["stdout"]
