"""schemas/run_config.schema.json and schemas/run_log/*.schema.json: current with the declarations
(replay.reference.run.RunConfig, replay.run.protocol's records (events, env.json, inputs.json),
replay.run.statefp.StateRecordFile), and a
JSON Schema validator agrees with ours on real files: the demo run config, and every line a training run
wrote."""

import dataclasses
import glob
import json
import math
import pathlib

import jsonschema
import pytest
import yaml

from replay import schema
from replay.reference import run as ref_run
from replay.run import protocol as proto

REPO = pathlib.Path(__file__).resolve().parents[1]


def _schema(name):
    return json.loads((REPO / "schemas" / name).read_text())


def test_the_schema_files_are_current():
    assert schema.stale(str(REPO / "schemas")) == [], "regenerate them: python -m replay.schema"


def test_the_demo_run_config_validates_and_what_the_schema_rejects_we_reject():
    raw = yaml.safe_load((REPO / "configs" / "runs" / "demo.yaml").read_text())
    jsonschema.validate(raw, _schema("run_config.schema.json"))
    cfg = ref_run.run_config_from_dict(raw, str(REPO / "configs" / "runs"))
    jsonschema.validate(cfg.to_dict(), _schema("run_config.schema.json"))  # what the run directory keeps
    for edit, message in [
        (lambda r: r.update(checkpoint_evry=3), "unknown keys ['checkpoint_evry'] (did you mean 'checkpoint_every'"),
        (lambda r: r.update(global_batch=0), "global_batch: must be an int >= 1, got 0"),
        (lambda r: r["mesh"].update(data=0), "mesh.data: must be an int >= 1 or -1, got 0"),
        (lambda r: r["model"].update(head_dim=7), "model.head_dim: must be an even int >= 2, got 7"),
        (lambda r: r["model"].update(d_modle=3), "model: unknown keys ['d_modle'] (did you mean 'd_model'"),
        (lambda r: r.update(optimizer={"b2": 1.5}), "optimizer.b2: must be in [0, 1), got 1.5"),
        (lambda r: r.update(canary_action="halt"), "canary_action: must be one of ['warn', 'stop'], got 'halt'"),
        (lambda r: r.update(screening={"cusum_h": "high"}), "screening.cusum_h: must be a number, got 'high'"),
        (lambda r: r.update(loader={"workers": -1}), "loader.workers: must be an int >= 0, got -1"),
        (lambda r: r.update(skip_windows=[[1, 2, 3]]), "skip_windows[0]: must be [start, end], got [1, 2, 3]"),
        (lambda r: r.update(trainer="pkg.mod:make"), "trainer: this is the reference trainer's run config"),
        (lambda r: r.update(mtbf_s=-1), "mtbf_s: must be a number of seconds > 0"),
        (lambda r: r.pop("dataset"), "missing keys ['dataset']"),
    ]:
        bad = yaml.safe_load((REPO / "configs" / "runs" / "demo.yaml").read_text())
        edit(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, _schema("run_config.schema.json"))
        with pytest.raises(ref_run.RunConfigError) as e:
            ref_run.run_config_from_dict(bad, "/x")
        assert message in str(e.value)


def _records():
    sites = proto.send_sites_in_program_order(2)
    signals = proto.StepSignals(
        step=3, loss=float("nan"), grad_norm=1.5,
        replicas=(proto.ReplicaNorm(0, (0,), 0.5, 0.25), proto.ReplicaNorm(1, (10,), 0.5, None)),
        devices={0: {"norm_sq": 0.5, "nonfinite": {"['embed']": 2}}, 10: {"norm_sq": math.inf, "nonfinite": {}}},
        router=(proto.RouterLayerStats(1.2, (0.5, 0.5), 0.0, 3.5, 0.1, 0.01),),
        expert_load=(proto.ExpertLoad.from_counts({0: 3, 10: 5}),), step_time_s=0.1, loader_wait_s=None,
        loader_occupancy=2, t=1.7e9, tokens=64)
    fp = proto.StepFingerprints(
        step=3, loss_bits=2143289344, grad_norm_bits=1069547520, batch_hash="ab" * 16,
        leaves={"['embed']": {"fp": 1, "nan": 2, "inf": 0}}, devices={0: {"['embed']": 7}, 10: {"['embed']": 9}},
        router={"loss": math.nan, "expert_share": [0.5, math.inf]}, device_coords={0: {"data": 0}, 10: {"data": 1}},
        send_sites=sites,
        sends={0: tuple(range(len(sites))), 10: tuple(range(len(sites)))}, signals=signals)
    canary = proto.CanaryRecord(step=4, device=10, signature="c" * 64, status="ok", golden="matched",
                                canary="c0", seconds=0.5)
    return fp, signals, canary


def test_records_round_trip_through_their_lines_and_their_schemas():
    fp, signals, canary = _records()
    for rec, name in ((fp, "fingerprints"), (signals, "signals"), (canary, "canary")):
        line = rec.to_json()
        jsonschema.validate(json.loads(line), _schema(f"run_log/{name}.schema.json"))
        back = type(rec).from_json(line)
        assert back.to_json() == line
    back = proto.StepFingerprints.from_json(fp.to_json())
    assert back.signals is None and dataclasses.replace(back, router=fp.router) == fp  # signals never written
    assert '"10": {"[\'embed\']": 9}' in fp.to_json() and '"recvs"' not in fp.to_json()  # omitted when empty
    assert '"router": {"expert_share": [0.5, Infinity], "loss": NaN}' in fp.to_json()  # free-form, as json writes it
    assert '"loss": NaN' in signals.to_json() and '"compile_s"' not in signals.to_json()


def test_a_damaged_line_is_refused_by_both_with_its_key():
    fp, signals, _ = _records()
    raw = json.loads(signals.to_json())
    raw["replicas"][1]["norm_sq"] = "big"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, _schema("run_log/signals.schema.json"))
    with pytest.raises(ValueError, match=r"^could not convert string to float: 'big'$"):
        proto.StepSignals.from_dict(raw)
    raw = json.loads(fp.to_json())
    raw["sends"]["0"] = [1, "x"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, _schema("run_log/fingerprints.schema.json"))
    with pytest.raises(ValueError, match=r"^invalid literal for int\(\) with base 10: 'x'$"):
        proto.StepFingerprints.from_dict(raw)
    del raw["batch_hash"]
    with pytest.raises(ValueError, match=r"^missing field 'batch_hash'$"):
        proto.StepFingerprints.from_dict(raw)


def test_every_file_of_a_training_run_validates(run_dir):
    from replay.run.statefp import RECORDS_DIR

    counts = {}
    for name, schema_name in ((proto.FINGERPRINTS_NAME, "fingerprints"), (proto.SIGNALS_NAME, "signals"),
                              (proto.CANARY_NAME, "canary"), (proto.EVENTS_NAME, "event")):
        path = pathlib.Path(run_dir) / name
        if not path.exists():
            continue
        lines = proto.read_raw_lines(str(path)) if name != proto.EVENTS_NAME else proto.read_events(run_dir)
        for line in lines:
            jsonschema.validate(line, _schema(f"run_log/{schema_name}.schema.json"))
        counts[schema_name] = len(lines)
    records = sorted(glob.glob(str(pathlib.Path(run_dir) / RECORDS_DIR / "*.json")))
    for path in records:
        jsonschema.validate(json.loads(pathlib.Path(path).read_text()), _schema("run_log/checkpoint_record.schema.json"))
    assert counts["fingerprints"] >= 12 and counts["signals"] >= 12 and counts["event"] >= 4 and records, counts
    events = proto.read_events(run_dir)
    bad = dict(events[-1], step="late")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _schema("run_log/event.schema.json"))


def test_events_are_validated_on_read_a_trainers_own_kinds_kept(replay_made, tmp_path):
    """Each line of events.jsonl is checked against the declared Event when read (load_run, read_events):
    a trainer's own kind and fields are an event; a line that is JSON but no event is refused naming
    the file, the line, the key path and what to do; a torn line (no JSON) is skipped as before."""
    import shutil

    from replay.run.runlog import RunDirError, load_run

    run = tmp_path / "run"
    shutil.copytree(replay_made[0], run, ignore=shutil.ignore_patterns("checkpoints"))
    path = run / "events.jsonl"
    lines = path.read_text().splitlines()
    own = json.dumps({"event": "my_eval", "step": 3, "score": [1, {"x": None}], "attempt": 1, "t": 1.7e9})
    path.write_text("\n".join(lines[:1] + [own, '{"event": "torn', *lines[1:]]) + "\n")
    assert [e["event"] for e in proto.read_events(str(run))][:2] == ["start", "my_eval"]
    assert any(e["event"] == "my_eval" and e["score"] == [1, {"x": None}] for e in load_run(str(run)).all_events)
    for bad, said in [({"event": "checkpoint", "step": "3"}, "step: Input should be a valid integer, got '3'"),
                      ({"event": "checkpoint", "step": True}, "step: Input should be a valid integer, got True"),
                      ({"step": 3}, "missing field 'event'"),
                      ({"event": "restore", "step": 2, "checkpoint": 1.5},
                       "checkpoint: Input should be a valid integer, got 1.5"),
                      ({"event": "end", "step": 4, "t": "late"}, "t: Input should be a valid number, got 'late'"),
                      ([3], "must be a JSON object, got list")]:
        path.write_text("\n".join(lines[:1] + [json.dumps(bad), *lines[1:]]) + "\n")
        want = f"{path}:2: not an event: {said}; a line of events.jsonl is a JSON object with 'event'"
        with pytest.raises(RunDirError) as e:
            load_run(str(run))
        assert str(e.value).startswith(want) and str(e.value).endswith("correct that line or delete it"), str(e.value)
        with pytest.raises(ValueError) as e:
            proto.read_events(str(run))
        assert str(e.value).startswith(want), str(e.value)
    path.write_text("\n".join(lines + [json.dumps({"event": "end", "step": "4"})]) + "\n")  # a whole last line
    with pytest.raises(RunDirError, match=":" + str(len(lines) + 1) + ": not an event: step"):
        load_run(str(run))


def test_env_and_inputs_records_have_schemas_and_inputs_json_is_validated_on_read(replay_made, tmp_path):
    """env.json and inputs.json of a training run validate against their published schemas and their
    declarations; a damaged inputs.json is refused on read with its key path and what to do."""
    import shutil

    from replay.run import inputs as run_inputs

    run = pathlib.Path(replay_made[0])
    for name, cls in (("env", proto.EnvRecord), ("inputs", proto.InputsRecord)):
        rec = json.loads((run / f"{name}.json").read_text())
        jsonschema.validate(rec, _schema(f"run_log/{name}.schema.json"))
        assert proto.record_problem(rec, cls) is None
    env = json.loads((run / "env.json").read_text())
    env["backend"]["process_count"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(env, _schema("run_log/env.schema.json"))
    assert proto.record_problem(env, proto.EnvRecord) == (
        "backend.process_count: Input should be a valid integer, got '2'")
    assert proto.record_problem({"mesh": {"shape": [2]}, "mine": 1}, proto.EnvRecord) is None  # less, and more
    copy = tmp_path / "run"
    copy.mkdir()
    shutil.copy(run / "inputs.json", copy / "inputs.json")
    good = json.loads((run / "inputs.json").read_text())
    assert run_inputs.read_inputs(str(copy)) == good
    for edit, said in [(lambda r: r["mixture"].pop("sha256"), "missing field 'mixture.sha256'"),
                       (lambda r: r["dataset"].update(manifest_sha256=7),
                        "dataset.manifest_sha256: Input should be a valid string, got 7"),
                       (lambda r: r.update(schedule=[1]), "schedule: Input should be a valid dictionary, got [1]")]:
        bad = json.loads(json.dumps(good))
        edit(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, _schema("run_log/inputs.schema.json"))
        (copy / "inputs.json").write_text(json.dumps(bad))
        with pytest.raises(run_inputs.InputsChangedError) as e:
            run_inputs.read_inputs(str(copy))
        assert str(e.value).startswith(f"{copy / 'inputs.json'}: not a record of the run's inputs ({said}): ")
        assert "restore it from a copy of the run directory" in str(e.value)


def test_a_state_record_that_is_not_one_is_a_damaged_checkpoint(tmp_path):
    from replay.run.statefp import DamagedCheckpointError, read_record, record_path

    path = pathlib.Path(record_path(str(tmp_path), 4))
    path.parent.mkdir()
    path.write_text(json.dumps({"step": 4, "leaves": {"['w']": {"fp": 5}}}))
    with pytest.raises(DamagedCheckpointError, match=r"unreadable \(not a state record: record.leaves\.\['w'\]\.fp: "):
        read_record(str(tmp_path), 4)
    path.write_text(json.dumps({"step": 3, "leaves": {}}))
    with pytest.raises(DamagedCheckpointError, match=r"unreadable \(the state record of step 3, not 4\)"):
        read_record(str(tmp_path), 4)
    path.write_text(json.dumps({"step": 4, "leaves": {"['w']": {"fp": "00ff", "nan": 0, "inf": 0}}, "finite": True}))
    assert read_record(str(tmp_path), 4).leaf_fps() == {"['w']": "00ff"}
