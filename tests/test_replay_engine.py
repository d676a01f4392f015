"""Range replay, drills, canary and inspect on the reference trainer with 8 CPU devices.

The run under test is described in ``test_replay_support`` (trained once per test session).
"""

import dataclasses
import json
import os
import random
import shutil

import jax
import pytest
from test_replay_support import STEPS

from replay.run.canary import batch_sha256
from replay.verify import canary
from replay.verify import compare
from replay import drill
from replay.verify import engine
from replay.screen import forensics
from replay.run import runlog
from replay.run.protocol import FaultSpec
from replay.run.codes import Verdict
from replay.verify.verdict import Cause, Evidence


@pytest.fixture(scope="module")
def session(replay_session):
    return replay_session


def test_run_directory_as_written(session):
    run = session.run
    assert run.logged_steps == (0, STEPS)
    assert run.checkpoints == [0, 4, 8, STEPS]
    assert [e["step"] for e in run.events_of("restore")] == [4]
    assert [e["step"] for e in run.events_of("phase_change")] == [6]
    assert run.skip_windows() == [(8, 8)]
    assert session.setup.shape == (2, 2) and session.setup.run_device_ids == (0, 1, 2, 3)


def test_unmodified_range_acquitted_bit_for_bit_across_kill_and_resume(session):
    rep = engine.replay_range(session, 3, 10, device_spec="all")
    assert rep.verdict is Verdict.ACQUITTED and rep.decision.cause is Cause.REPRODUCED
    assert rep.checkpoint == 0 and rep.checkpoints == [0, 4, 8]
    assert [r.assignment for r in rep.replays] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    exact, other = rep.replays
    assert {d.evidence for d in exact.diffs} == {Evidence.BIT_EXACT}
    assert {d.evidence for d in other.diffs} == {Evidence.PER_SHARD}
    for r in rep.replays:  # steps 0..9, each equal to the log in every field
        assert [d.step for d in r.diffs] == list(range(10)) and all(d.ok for d in r.diffs)
        for fp in r.fingerprints:
            logged = session.run.fingerprints[fp.step]
            pairing = compare.pair_devices(compare.coords_of(logged), compare.coords_of(fp))
            assert fp.loss_bits == logged.loss_bits and fp.batch_hash == logged.batch_hash
            assert fp.leaves == logged.leaves
            assert all(fp.devices[pairing[d]] == logged.devices[d] for d in logged.devices)
    out = rep.to_dict()
    assert out["verdict"] == "acquitted" and out["exit_code"] == 0 and out["first_divergent_step"] is None
    assert out["skip_windows"] == [[8, 8]] and out["phase_changes"][0]["step"] == 6
    assert out["timing"]["steps_replayed"] == 20


def test_one_device_set_of_run_shape_rotated(session):
    rep = engine.replay_range(session, 5, 6, device_spec="0-3")
    assert rep.verdict is Verdict.ACQUITTED
    assert [r.assignment for r in rep.replays] == [(0, 1, 2, 3), (1, 2, 3, 0)]
    assert rep.decision.independent_replays == 2


def test_thirty_drills_all_convicted(session):
    """Range replay's verdict on 30 local-gradient flips drawn at random (the campaign, benchmarks/campaign.py,
    draws every site, bit and magnitude grid at scale; this keeps the replay path honest in the suite)."""
    rng = random.Random(1234)
    bits_seen = set()
    for i in range(30):
        # Every tenth drill pins the lowest mantissa bit; the rest draw every field at random.
        f = drill.random_fault(session, rng, bit=0 if i % 10 == 0 else None)
        bits_seen.add(f.bit)
        res = drill.run_drill(session, f, canary=(i % 15 == 0))
        d = res.range_report.decision
        assert res.caught, (f, d.explanation)
        assert d.verdict is Verdict.CONVICTED and d.devices == (f.device_id,) and d.step == f.step
        assert f.leaf in d.leaves
        if res.canary_report is not None:
            assert res.canary_report.decision.odd_devices == (f.device_id,)
    assert 0 in bits_seen and len(bits_seen) > 10


def test_thirty_clean_replays_no_conviction(session):
    rng = random.Random(99)
    specs = ["all", "good", "0-3", "4-7", "process:0"]
    session.run.quarantine = frozenset({1})
    try:
        for _ in range(30):
            start = rng.randrange(0, STEPS)
            stop = min(STEPS, start + rng.randrange(1, 3))
            spec = rng.choice(specs)
            rep = engine.replay_range(session, start, stop, device_spec=spec)
            assert rep.verdict is Verdict.ACQUITTED, rep.decision.explanation
            if spec == "good":
                assert all(1 not in r.assignment for r in rep.replays)
    finally:
        session.run.quarantine = frozenset()


def state_before(session, step, assignment=(0, 1, 2, 3)):
    ckpt = session.run.checkpoint_for(step)
    _, _, kept = session.run_steps(assignment, ckpt, step, keep_state_at=step - 1) if step > ckpt else (0, 0, {})
    return kept.get(step - 1) if step > ckpt else session.restore(ckpt, assignment)


def test_swapped_rows_in_log_is_a_data_difference(session):
    step = 6
    state = state_before(session, step)
    batch = session.numpy_batch(step, (0, 1, 2, 3))
    swapped = {k: v.copy() for k, v in batch.items()}
    for v in swapped.values():
        v[[1, 6]] = v[[6, 1]]  # two rows of one batch, held by different devices
    sharding = session.setup.trainer.batch_sharding(session.mesh((0, 1, 2, 3)))
    swapped = {k: jax.device_put(v, sharding) for k, v in swapped.items()}
    _, fp = session.setup.trainer.train_step(state, swapped, step)
    log = dict(session.run.fingerprints)
    log[step] = fp
    rep = engine.replay_range(session, step, step + 1, device_spec="all", log=log)
    assert rep.verdict is Verdict.ACQUITTED and rep.decision.cause is Cause.DATA_ORDER
    assert rep.decision.step == step and rep.decision.devices == ()
    assert "data or order difference" in rep.decision.explanation
    assert rep.to_dict()["replays"][0]["steps"][-1]["kind"] == "data"


def test_flaky_replay_device_is_ambiguous(session):
    """A replay device that computes one wrong bit (a fault in the replay, not the log): replays disagree."""
    fault = FaultSpec(step=5, device_id=6, leaf=session.setup.trainer.leaf_paths[0], element=3, bit=2)
    first = engine.replay_range(session, 5, 6, device_spec="all")
    orig = session.replay_segment

    def flaky(assignment, *a, **kw):
        if 6 in assignment:
            kw["fault"] = fault
        return orig(assignment, *a, **kw)

    session.replay_segment = flaky
    try:
        rep = engine.replay_range(session, 5, 6, device_spec="all")
    finally:
        del session.replay_segment
    assert first.verdict is Verdict.ACQUITTED
    assert rep.verdict is Verdict.AMBIGUOUS and rep.decision.cause is Cause.REPLAYS_DISAGREE
    assert rep.disagreement["step"] == 5 and rep.disagreement["devices_b"] == [6]


def test_differing_elements_from_next_checkpoint(session, tmp_path):
    """A run whose device 2 flipped a bit at step 7, checkpointed at 8: the replay convicts device 2
    and, restoring the run's checkpoint 8, counts the parameters that differ from the replay's."""
    from replay.reference import checkpoint as ckpt

    run_dir = str(tmp_path / "faulty")
    shutil.copytree(session.run.run_dir, run_dir)
    leaf = session.setup.trainer.leaf_paths[-1]
    f = FaultSpec(step=7, device_id=2, leaf=leaf, element=1, bit=30)
    home = (0, 1, 2, 3)
    fps, _, kept = session.run_steps(home, 4, 8, fault=f, keep_state_at=7)
    _, loader_state = session.setup.trainer.restore(session.run.run_dir, 8, session.mesh(home))
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "8"))
    m = ckpt.manager(os.path.join(run_dir, "checkpoints"))
    ckpt.save(m, 8, kept[7], loader_state)
    m.wait_until_finished()
    m.close()
    from replay.run import statefp  # the faulty run recorded the state it saved (else: a damaged checkpoint)

    statefp.write_record(run_dir, statefp.record_state(kept[7], loader_state, 8))
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "fingerprints.jsonl"))]
    lines[7] = json.loads(fps[-1].to_json())  # the line the faulty run logged (sealed)
    with open(os.path.join(run_dir, "fingerprints.jsonl"), "w") as out:
        out.writelines(json.dumps(x) + "\n" for x in lines)
    faulty = engine.Session(runlog.load_run(run_dir), dataclasses.replace(session.setup))
    rep = engine.replay_range(faulty, 7, 8, device_spec="all")
    assert rep.verdict is Verdict.CONVICTED and rep.decision.devices == (2,) and rep.decision.step == 7
    assert rep.differing_elements and rep.differing_elements.get(f"['params']{leaf}", 0) >= 1
    assert rep.to_dict()["differing_elements"] == rep.differing_elements


def test_canary_golden_created_then_matched_and_odd_device_named(session, tmp_path):
    golden = str(tmp_path / "golden.json")
    first = canary.run_canary(session, device_spec="all", repeats=2, golden_path=golden)
    assert first.decision.verdict is Verdict.ACQUITTED and first.decision.golden_status == "created"
    # the setup's canary_rows/canary_seq_len (the run config's canary.rows, .seq_len): 1 row, whole
    assert first.spec.step == 1 and first.spec.weights == "init:7" and first.spec.rows == 1
    assert first.spec.seq_len is None and first.spec.name == "step1-rows1-init7"
    table = json.load(open(golden))
    assert list(table) == [first.env_key] and table[first.env_key]["signature"] == first.decision.reference
    second = canary.run_canary(session, device_spec="all", repeats=2, golden_path=golden)
    assert second.decision.golden_status == "matched" and second.decision.verdict is Verdict.ACQUITTED
    fault = FaultSpec(step=0, device_id=5, leaf=session.setup.trainer.leaf_paths[1], element=0, bit=0)
    bad = canary.run_canary(session, device_spec="all", repeats=1, golden_path=golden, fault=fault)
    assert bad.decision.verdict is Verdict.CONVICTED and bad.decision.odd_devices == (5,)
    assert bad.to_dict()["devices"][5]["status"] == "differs_from_golden"
    table[first.env_key]["signature"] = "0" * 64
    json.dump(table, open(golden, "w"))
    changed = canary.run_canary(session, device_spec="0,1", repeats=1, golden_path=golden)
    assert changed.decision.verdict is Verdict.AMBIGUOUS and changed.decision.golden_status == "mismatch-all"


def test_canary_batch_is_a_packed_prefix_of_the_step_batch(session, tmp_path):
    """rows and seq_len cut the step's batch (every key alike); whole rows are the uncut canary."""
    host = session.numpy_batch(1, session.home_assignment())
    row_len = host["inputs"].shape[1]
    golden = str(tmp_path / "golden.json")
    cut = canary.run_canary(session, device_spec="0", repeats=1, rows=2, seq_len=6, golden_path=golden)
    assert cut.spec.rows == 2 and cut.spec.seq_len == 6 and cut.spec.name == "step1-rows2-init7-seq6"
    assert cut.spec.batch_sha256 == batch_sha256({k: v[:2, :6] for k, v in host.items()})
    whole = canary.run_canary(session, device_spec="0", repeats=1, rows=2, seq_len=row_len, golden_path=None)
    assert whole.spec.seq_len is None and whole.spec.batch_sha256 == batch_sha256(
        {k: v[:2] for k, v in host.items()})
    with pytest.raises(ValueError, match=rf"canary seq_len must be in \[2, {row_len}\] \(the row length\), got 1"):
        canary.run_canary(session, device_spec="0", repeats=1, seq_len=1, golden_path=None)


def test_inspect_lists_documents_of_each_row(session):
    from loader.testing import SYNTHETIC_RELPATH, row_origin

    data = session.loader(session.home_assignment())
    rep = forensics.inspect_steps(data, 5, 7)
    out = rep.to_dict()
    assert len(out["rows"]) == 16
    for r in out["rows"]:
        packed = data.read_rows(r["step"])[r["position"]]
        source, record = row_origin(packed.tokens, ["a", "b"], 64)
        assert (r["source"], r["record"]) == (source, record)
        assert [d["key"] for d in r["documents"]] == list(packed.doc_keys)
        assert all(d["key"].startswith(f"{source}/{SYNTHETIC_RELPATH}:") for d in r["documents"])
        spans = [d["span"] for d in r["documents"]]
        assert spans[0][0] == 0 and spans[-1][1] == r["tokens"] == 16 - r["padding"]
    assert sum(s["rows"] for s in out["sources"].values()) == 16
    assert sum(len(v) for v in out["shards"].values()) == len({(r["shard"], r["record_in_shard"]) for r in out["rows"]})
    # The lookup loader (one device, any machine) gives the same rows as the run's mesh.
    assert forensics.inspect_steps(session.lookup_loader(), 5, 7).to_dict() == out
    with pytest.raises(forensics.TokenizerUnavailableError, match="is not there"):
        forensics.inspect_steps(data, 5, 6, text=True, tokenizer_path="/nonexistent/tok.model")


def test_inspect_text_decodes_with_the_dataset_tokenizer(shared_dir, tmp_path):
    """--text: each document's tokens decoded by the dataset's SentencePiece model (a real one from ../shared)."""
    import sentencepiece as spm
    from test_replay_support import write_run_inputs

    import loader

    model = str(shared_dir / "tokenizers" / "en_unigram_1000.model")
    write_run_inputs(str(tmp_path), tokenizer=model, vocab_size=1000)
    data = loader.build(mixture=str(tmp_path / "mixture.yaml"), dataset=str(tmp_path / "dataset"), global_batch=8)
    assert data.mixture.tokenizer.path == model
    rep = forensics.inspect_steps(data, 2, 3, text=True, tokenizer_path=model)
    sp = spm.SentencePieceProcessor(model_file=model)
    rows = data.read_rows(2)
    assert len(rep.rows) == 8
    for r, packed in zip(rep.rows, rows):
        for d, seg in zip(r["documents"], packed.segments()):
            assert d["text"] == sp.decode([int(t) for t in seg]) and d["tokens"] == len(seg)


def test_replay_must_follow_skip_windows(session):
    """A replay whose loader ignored the run's skip window would rebuild other batches from step 8 on:
    the comparison sees it as a data difference at exactly that step (so following windows matters)."""
    from replay.reference import run as ref_run

    cfg = ref_run.run_config_from_dict(session.run.config, session.run.run_dir)
    blind = dataclasses.replace(cfg, skip_windows=())
    setup = dataclasses.replace(session.setup, make_loader=lambda mesh: ref_run.build_loader(blind, mesh))
    wrong = engine.Session(session.run, setup)
    rep = engine.replay_range(wrong, 6, 10, device_spec="all")
    assert rep.verdict is Verdict.ACQUITTED and rep.decision.cause is Cause.DATA_ORDER
    assert rep.decision.step == 8
    right = engine.replay_range(session, 6, 10, device_spec="all")
    assert right.decision.cause is Cause.REPRODUCED


def test_log_without_device_coords_pairs_by_the_env_record(session):
    """Logs of a trainer that records no device_coords are paired through env.json's mesh record."""
    log = {s: dataclasses.replace(fp, device_coords={}) for s, fp in session.run.fingerprints.items()}
    rep = engine.replay_range(session, 9, 10, device_spec="all", log=log)
    assert rep.verdict is Verdict.ACQUITTED
    assert {d.evidence for d in rep.replays[1].diffs} == {Evidence.PER_SHARD}


def test_persistently_faulty_replay_device_is_named_as_suspect(session):
    """A replay device that is wrong wherever it sits: the rotated placements disagree at two mesh
    positions, and the one device on both sides of the disagreement is the suspect."""
    fault = FaultSpec(step=5, device_id=2, leaf=session.setup.trainer.leaf_paths[2], element=7, bit=0)
    orig = session.replay_segment

    def bad_chip(assignment, *a, **kw):
        kw["fault"] = fault
        return orig(assignment, *a, **kw)

    session.replay_segment = bad_chip
    try:
        rep = engine.replay_range(session, 5, 6, device_spec="0-3")
    finally:
        del session.replay_segment
    assert [r.assignment for r in rep.replays] == [(0, 1, 2, 3), (1, 2, 3, 0)]
    assert rep.verdict is Verdict.AMBIGUOUS and rep.decision.cause is Cause.REPLAYS_DISAGREE
    assert rep.disagreement["suspects"] == [2]
    assert rep.disagreement["devices_a"] == [1, 2] and rep.disagreement["devices_b"] == [2, 3]
    from rich.console import Console

    from replay import report

    console = Console(record=True, width=200)
    report.render_range(rep.to_dict(), console)
    text = console.export_text()
    assert "suspect device(s) (on both sides): device 2 (host " in text and "AMBIGUOUS (exit code 4)" in text
    assert rep.disagreement["suspects_named"][0]["local_device"] == 2


def test_repeats_rerun_each_placement(session):
    rep = engine.replay_range(session, 9, 10, device_spec="all", repeats=2)
    assert [(r.repeat, r.assignment) for r in rep.replays] == [
        (0, (0, 1, 2, 3)), (0, (4, 5, 6, 7)), (1, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert len({r.outcome().signature for r in rep.replays}) == 1
    assert rep.verdict is Verdict.ACQUITTED and rep.decision.independent_replays == 2
    with pytest.raises(ValueError, match="repeats and replays must be >= 1"):
        engine.replay_range(session, 9, 10, repeats=0)


def test_default_setup_errors_name_the_problem(session):
    run = runlog.load_run(session.run.run_dir)
    run.config = {**run.config, "dataset": "/nonexistent/dataset"}
    with pytest.raises(runlog.RunDirError, match="cannot rebuild the run: .*/nonexistent/dataset"):
        engine.default_setup(run)
    run = runlog.load_run(session.run.run_dir)
    run.env = {k: v for k, v in run.env.items() if k != "mesh"}
    with pytest.raises(runlog.RunDirError, match="no mesh recorded"):
        engine.default_setup(run)


def test_drill_as_a_short_training_run_on_disk(session, tmp_path):
    leaf = session.setup.trainer.leaf_paths[1]
    # The top mantissa bit: a lowest-bit flip can be absorbed by the optimizer's rounding (the
    # fingerprints still convict, but the state after the step may be bit-identical).
    f = FaultSpec(step=6, device_id=3, leaf=leaf, element=5, bit=22)
    res = drill.run_drill(session, f, canary=False, to_disk=str(tmp_path / "drill"))
    assert res.caught
    rep = res.range_report
    assert rep.run_dir == str(tmp_path / "drill") and rep.checkpoint == 4
    assert rep.decision.devices == (3,) and rep.decision.step == 6
    # The written run's checkpoint 7 holds the faulty state: the flipped bit changed that parameter.
    assert rep.differing_elements.get(f"['params']{leaf}", 0) >= 1
    run = runlog.load_run(str(tmp_path / "drill"))
    assert run.checkpoints == [4, 7] and run.logged_steps == (0, 7)
    assert run.events_of("drill")[0]["device_id"] == 3
