"""Cost of the run log's schema layer per step: the writer against json.dumps of the same line alone.

    python benchmarks/runlog.py            # a demo-size and a large record, 300 steps each (seconds)
    python benchmarks/runlog.py --quick    # 60 steps each

Every step the training loop appends one line of ``fingerprints.jsonl`` and one of ``signals.jsonl``
(``replay.run.writer.RunDir.append_fingerprints`` / ``append_signals``): pydantic serializes each
record (``replay.run.protocol.Record.to_json``) and the line is appended and flushed. The reference,
timed in the same loop, interleaved step by step (so machine load affects both alike), is the floor
of any writer of those lines: ``json.dumps`` of the already-plain dicts, appended the same way. Two
record sizes: the demo's (21 parameter leaves, 8 devices, 2 MoE layers) and a large one (200 leaves,
16 devices of one process, 16 layers of 64 experts, 150 kB a fingerprint line).

Also the read side: ``StepFingerprints.from_dict`` + ``StepSignals.from_dict`` (pydantic's validation)
against ``json.loads`` alone of the same lines.

And reading a whole run directory (``--read-steps``, default 100,000 steps; ``--quick``: 20,000):
``replay.run.runlog.load_run`` of a synthetic run of that many small fingerprint lines and a ``checkpoint``
event (with its state fields) every 100 steps, timed with each event validated on read
(``protocol.event_problem``, what load_run does) against the same load with that check switched off
(what it did before), interleaved, median of 3 each: ``load_run_over_unchecked``; and the check alone
over the run's event lines against ``json.loads`` of them (``check_over_json_loads``), whose time over
the whole load is ``check_share_of_load_run``.

Prints ONE JSON object: per case the median microseconds per step of ``writer`` and ``json_only``, their
ratio ``writer_over_json``, the same for reading (``read_over_json``), the line bytes, the run-directory
read, and the load average when it ran (figures measured under load are not idle figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from replay.run import protocol as proto  # noqa: E402
from replay.run.writer import RunDir  # noqa: E402


def records(step: int, leaves: int, devices: int, layers: int, experts: int):
    """A step's fingerprints and signals of the given size, every field filled (values vary by step)."""
    paths = [f"['layers'][{i % max(layers, 1)}]['w{i}']" for i in range(leaves)]
    sites = proto.send_sites_in_program_order(layers)
    sig = proto.StepSignals(
        step=step, loss=2.5 + step * 1e-3, grad_norm=1.25,
        replicas=tuple(proto.ReplicaNorm(d, (d,), 0.5 + d, 0.25) for d in range(devices)),
        devices={d: {"norm_sq": 0.5 + d, "nonfinite": {}} for d in range(devices)},
        router=tuple(proto.RouterLayerStats(1.2, (1.0 / experts,) * experts, 0.0, 3.5, 0.1, 0.01) for _ in range(layers)),
        expert_load=tuple(proto.ExpertLoad.from_counts({d: 100 + d for d in range(devices)},
                                                       {d: 2.0 for d in range(devices)}) for _ in range(layers)),
        step_time_s=0.12, loader_wait_s=0.001, loader_occupancy=2, loader_occupancy_min=1,
        loader_wait_stages={"read": 0.0005}, t=1.7e9 + step, compile_s=0.0, canary_s=0.0, checkpoint_s=0.0,
        tokens=65536)
    fp = proto.StepFingerprints(
        step=step, loss_bits=1065353216 + step, grad_norm_bits=1065353217, batch_hash=f"{step:032x}",
        leaves={p: {"fp": 123456789 + i + step, "nan": 0, "inf": 0} for i, p in enumerate(paths)},
        devices={d: {p: 987654321 + d + i + step for i, p in enumerate(paths)} for d in range(devices)},
        router={"entropy": 1.1, "loss": 2.5}, device_coords={d: {"data": d // 2, "expert": d % 2} for d in range(devices)},
        send_sites=sites, sends={d: tuple(1000 + d + j for j in range(len(sites))) for d in range(devices)},
        recvs={d: tuple((5 + j, 6 + j) for j in range(len(sites))) for d in range(devices)}, signals=sig)
    return fp, sig


def measure(label: str, steps: int, **size) -> dict:
    recs = [records(s, **size) for s in range(steps)]
    plain = [(fp.to_dict(), sig.to_dict()) for fp, sig in recs]  # the reference's input: lines already plain
    writer_t, json_t, read_t, loads_t = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(os.path.join(tmp, "run"))
        ref_fp, ref_sig = os.path.join(tmp, "ref_fp.jsonl"), os.path.join(tmp, "ref_sig.jsonl")
        for (fp, sig), (dfp, dsig) in zip(recs, plain):
            t0 = time.perf_counter()
            rd.append_fingerprints(fp)
            rd.append_signals(sig)
            t1 = time.perf_counter()
            proto.append_line(ref_fp, json.dumps(dfp, sort_keys=True))
            proto.append_line(ref_sig, json.dumps(dsig, sort_keys=True))
            t2 = time.perf_counter()
            writer_t.append(t1 - t0)
            json_t.append(t2 - t1)
        with open(rd.file(proto.FINGERPRINTS_NAME)) as f:
            fp_lines = f.read().splitlines()
        with open(rd.file(proto.SIGNALS_NAME)) as f:
            sig_lines = f.read().splitlines()
        with open(ref_fp) as f:
            same = f.read().splitlines() == fp_lines
    for a, b in zip(fp_lines, sig_lines):
        t0 = time.perf_counter()
        proto.StepFingerprints.from_dict(json.loads(a))
        proto.StepSignals.from_dict(json.loads(b))
        t1 = time.perf_counter()
        json.loads(a), json.loads(b)
        t2 = time.perf_counter()
        read_t.append(t1 - t0)
        loads_t.append(t2 - t1)
    w, j = statistics.median(writer_t), statistics.median(json_t)
    r, lo = statistics.median(read_t), statistics.median(loads_t)
    return {"case": label, **size, "steps": steps, "fingerprint_line_bytes": len(fp_lines[0]),
            "signals_line_bytes": len(sig_lines[0]), "writer_us": round(w * 1e6, 1), "json_only_us": round(j * 1e6, 1),
            "writer_over_json": round(w / j, 3), "read_us": round(r * 1e6, 1), "json_loads_us": round(lo * 1e6, 1),
            "read_over_json": round(r / lo, 3), "lines_equal_json_dumps": same}


def write_run(path: str, steps: int, every: int = 100) -> int:
    """A synthetic run directory of ``steps`` fingerprint lines (4 leaves, 2 devices) and a start, a
    ``checkpoint`` event every ``every`` steps (with the state fields a checkpoint event carries) and an
    end. Returns the number of events."""
    import yaml

    from replay.run import runlog

    os.makedirs(path)
    with open(os.path.join(path, runlog.RUN_CONFIG), "w") as f:
        yaml.safe_dump({"seed": 1, "global_batch": 8}, f)
    with open(os.path.join(path, runlog.ENV_JSON), "w") as f:
        json.dump({"mesh": {"axis_names": ["data"], "shape": [2], "device_ids": [0, 1]}}, f)
    fp, _ = records(0, leaves=4, devices=2, layers=1, experts=2)
    line = fp.to_dict()
    line.pop("signals", None)
    t0 = 1.7e9
    events = [{"event": "start", "step": 0, "attempt": 1, "t": t0, "time": "2023-11-14T22:13:20+00:00",
               "launched_at": t0 - 5, "steps": steps}]
    leaves = {f"['w{i}']": f"{i:016x}" for i in range(4)}
    for s in range(every, steps + 1, every):
        events.append({"event": "checkpoint", "step": s, "attempt": 1, "t": t0 + s * 0.1 + 0.05,
                       "time": "2023-11-14T22:13:21+00:00", "save_start_t": t0 + s * 0.1,
                       "commit_t": t0 + s * 0.1 + 0.04,
                       "state": {"fingerprint": "ab" * 8, "leaves": leaves, "loader_sha256": "cd" * 32,
                                 "finite": True, "nonfinite": {}, "replicas_agree": True, "fingerprint_s": 0.01,
                                 "record": f"checkpoint_records/{s}.json"}})
    events.append({"event": "end", "step": steps, "attempt": 1, "t": t0 + steps * 0.1 + 1})
    with open(os.path.join(path, proto.EVENTS_NAME), "w") as f:
        f.writelines(json.dumps(e, sort_keys=True) + "\n" for e in events)
    with open(os.path.join(path, proto.FINGERPRINTS_NAME), "w") as f:
        for s in range(steps):
            line["step"], line["batch_hash"] = s, f"{s:032x}"
            f.write(json.dumps(line, sort_keys=True) + "\n")
    return len(events)


def measure_read(steps: int, repeats: int = 3) -> dict:
    """load_run of a synthetic run (:func:`write_run`) with the events checked on read and unchecked
    (after one untimed load; the order alternates), median of ``repeats``; and the check alone over the
    parsed event lines against ``json.loads`` of them, best of 20 (short: the machine's load moves it less)."""
    from replay.run import runlog

    checked = runlog._check_event
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        n_events = write_run(run, steps)
        with open(os.path.join(run, proto.EVENTS_NAME)) as f:
            event_lines = f.read().splitlines()
        runlog.load_run(run)  # imports, pydantic's validators built: not the check's cost
        for i in range(repeats):
            for mode in (("checked", "unchecked") if i % 2 == 0 else ("unchecked", "checked")):
                runlog._check_event = checked if mode == "checked" else (lambda d: None)
                try:
                    t0 = time.perf_counter()
                    got = runlog.load_run(run)
                    times[mode].append(time.perf_counter() - t0)
                finally:
                    runlog._check_event = checked
                assert len(got.fingerprints) == steps and len(got.all_events) == n_events
        size = os.path.getsize(os.path.join(run, proto.FINGERPRINTS_NAME))
    parsed = [json.loads(x) for x in event_lines]
    check_t, loads_t = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        for d in parsed:
            checked(d)
        t1 = time.perf_counter()
        for x in event_lines:
            json.loads(x)
        t2 = time.perf_counter()
        check_t.append(t1 - t0)
        loads_t.append(t2 - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    check, loads = min(check_t), min(loads_t)
    return {"case": "load_run", "steps": steps, "events": n_events, "fingerprints_mb": round(size / 2**20, 1),
            "load_run_s": round(med["checked"], 3), "load_run_unchecked_s": round(med["unchecked"], 3),
            "load_run_over_unchecked": round(med["checked"] / med["unchecked"], 4),
            "check_events_ms": round(check * 1e3, 2), "events_json_loads_ms": round(loads * 1e3, 2),
            "check_over_json_loads": round(check / loads, 2),
            "check_us_per_event": round(check / n_events * 1e6, 2),
            # the check's own time over the whole load: steadier than the ratio of two loads, which the
            # machine's load moves by more than the check costs
            "check_share_of_load_run": round(check / med["checked"], 5)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 steps a case, a run directory of 20,000 steps")
    ap.add_argument("--read-steps", type=int, default=None, help="steps of the run directory read (100,000)")
    args = ap.parse_args(argv)
    steps = 60 if args.quick else 300
    load = os.getloadavg()
    out = {"benchmark": "runlog", "load_average_1_5_15": [round(x, 2) for x in load], "cases": [
        measure("demo", steps, leaves=21, devices=8, layers=2, experts=4),
        measure("large", max(steps // 3, 20), leaves=200, devices=16, layers=16, experts=64),
        measure_read(args.read_steps or (20_000 if args.quick else 100_000)),
    ]}
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
