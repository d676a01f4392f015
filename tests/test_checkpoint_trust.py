"""State you can trust (issue 28): checkpoint fingerprints, damaged checkpoints named, the newest clean
checkpoint certified, non-finite state never saved silently.

The runs are the shared replay run (tests/test_replay_support.py: 2x2 mesh, checkpoints 0, 4, 8, 12) and
short runs of the same model, dataset and compiled trainer, one per drill.
"""

import dataclasses
import io
import json
import math
import os

import numpy as np
import pytest

from replay import cli
from replay.run import statefp
from replay.run.codes import ExitCode
from replay.run.runlog import load_run

from test_replay_support import STEPS, as_saved_before_records, run_config

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame: a value OCDBT keeps out of line (its frame has no checksum here)


def _quiet(_):
    return None


def _flip_byte(path, offset, mask=0x10):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _leaf_bytes(state):
    import jax

    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(state)]


def silent_flip(run_dir, step, restore):
    """Flips one byte of checkpoint ``step``'s data that Orbax restores *without an error* and with other
    values (the flip is left in place); returns ``(path, offset)``. The candidates are the values OCDBT
    keeps out of line (zstd frames), every 64th byte from the 8th: deterministic for a bit-identical run."""
    ckpt = os.path.join(run_dir, "checkpoints", str(step))
    intact = _leaf_bytes(restore(run_dir, step)[0])
    for root, _, names in sorted(os.walk(ckpt)):
        for n in sorted(names):
            path = os.path.join(root, n)
            with open(path, "rb") as f:
                if f.read(4) != ZSTD_MAGIC:
                    continue
            size = os.path.getsize(path)
            for off in range(8, size, max(1, size // 64)):
                _flip_byte(path, off)
                try:
                    got = _leaf_bytes(restore(run_dir, step)[0])
                except Exception:  # noqa: BLE001 - raised by Orbax: not a silent flip
                    got = intact
                if got != intact:
                    return path, off
                _flip_byte(path, off)
    raise AssertionError(f"no silent one-byte flip found in {ckpt}")


@pytest.fixture(scope="module")
def kit(replay_made):
    """The shared run's trainer (compiled), mesh and inputs, to train short runs of the same model."""
    import jax

    from replay.reference.trainer import make_mesh

    run_dir, trainer = replay_made
    root = os.path.dirname(run_dir)
    return dataclasses.make_dataclass("Kit", ["trainer", "mesh", "root", "mix"])(
        trainer, make_mesh({"data": 2, "expert": 2}, jax.devices()[:4]), root, os.path.join(root, "mixture.yaml"))


def train(kit, path, steps, *, faults=None, **over):
    from replay.reference import loop
    from replay.reference.drills import DrillHooks

    cfg = run_config(kit.root, kit.mix, **{"skip_windows": [], **over})
    out = loop.train(path, cfg, steps, trainer=kit.trainer, mesh=kit.mesh,
                     output=loop.Output(log=_quiet, plot=False, progress=io.StringIO()),
                     drill=DrillHooks(faults=faults))
    return cfg, out


def session(kit, run_dir):
    from replay.verify import engine

    run = load_run(run_dir)
    return engine.Session(run, dataclasses.replace(engine.default_setup(run), trainer=kit.trainer))


def restorer(kit):
    return lambda d, s: kit.trainer.restore(d, s, kit.mesh)


def events(run_dir, name=None):
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        out = [json.loads(line) for line in f]
    return [e for e in out if name is None or e["event"] == name]


@pytest.fixture
def use_kit(kit, monkeypatch):
    """CLI calls in-process build their set-up from the run config: hand them the compiled trainer."""
    from replay.verify import engine

    real = engine.default_setup
    monkeypatch.setattr(engine, "default_setup", lambda run: dataclasses.replace(real(run), trainer=kit.trainer))
    return kit


# ----------------------------------------------------------------------------- 1. the record at every save


def test_every_checkpoint_records_its_state_per_leaf_shard_and_replica(replay_made, kit):
    run_dir, trainer = replay_made
    ckpts = [e for e in load_run(run_dir).events if e["event"] == "checkpoint"]  # the lineage's (6 was killed)
    assert [e["step"] for e in ckpts] == [0, 4, 8, 12]
    for e in ckpts:
        st = e["state"]
        assert st["finite"] is True and st["replicas_agree"] is True and st["nonfinite"] == {}
        assert st["record"] == os.path.join("checkpoint_records", f"{e['step']}.json")
    rec = statefp.read_record(run_dir, 12)
    assert rec.leaf_fps() == ckpts[-1]["state"]["leaves"]
    # computed on the devices, equal to the NumPy twin of the restored (host) values, leaf by leaf
    state, loader = trainer.restore(run_dir, 12, kit.mesh)
    import jax

    from replay.run import fingerprint as fpm

    for p, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert rec.data["leaves"][jax.tree_util.keystr(p)]["fp"] == fpm.fingerprint_hex(fpm.fingerprint_np(np.asarray(x)))
    assert rec.data["loader"]["sha256"] == statefp.loader_sha256(loader)
    # a replicated leaf has a copy on each of the 4 devices, Orbax's from device 0; an expert leaf is split
    # over the expert axis (2 shards), each held by the 2 devices of its data replicas
    wq = rec.data["leaves"]["['params']['layers'][0]['wq']"]["shards"]
    assert [(s["index"], s["saved_by"], sorted(s["replicas"])) for s in wq] == [("[:, :, :]", 0, ["0", "1", "2", "3"])]
    w_in = rec.data["leaves"]["['opt_state'][1][0].mu['layers'][0]['w_in']"]["shards"]
    assert [(s["index"].split(",")[0], s["saved_by"], sorted(s["replicas"])) for s in w_in] == \
        [("[0:1", 0, ["0", "2"]), ("[1:2", 1, ["1", "3"])]
    assert statefp.verify_restored(run_dir, 12, state, loader).status == "verified"
    # restored on other devices, another mesh shape, or one device: the same record verifies it
    from replay.reference.trainer import make_mesh

    for axes, devs in (({"data": 2, "expert": 2}, jax.devices()[4:8]), ({"data": 4, "expert": 1}, jax.devices()[2:6]),
                       ({"data": 1, "expert": 1}, jax.devices()[7:8])):
        other, loader = trainer.restore(run_dir, 12, make_mesh(axes, devs))
        assert statefp.verify_restored(run_dir, 12, other, loader).status == "verified"


def test_state_fingerprints_of_any_sharding_add_up_to_the_numpy_twin():
    """Shard offsets from each leaf's PartitionSpec (one axis, two axes on one dimension, both dimensions,
    replicated, a scalar): every shard's fingerprint uses global indices, so the shards' saved copies add
    up to the NumPy fingerprint of the whole array; a copy changed on one device is named as the odd one."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from replay.run import fingerprint as fpm

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("x", "y"))
    rng = np.random.default_rng(20261204)
    specs = {"a": P("x"), "b": P(("x", "y")), "c": P("y", "x"), "d": P(), "e": P(None, "y")}
    host = {k: rng.standard_normal((8, 12)).astype(np.float32) for k in specs}
    host["s"] = np.float32(3.5)
    state = {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in host.items()}
    rec = statefp.record_state(state, {"next_step": 7}, 7)
    for k, v in host.items():
        assert rec.data["leaves"][f"['{k}']"]["fp"] == fpm.fingerprint_hex(fpm.fingerprint_np(np.atleast_1d(v)))
    assert [len(rec.data["leaves"][f"['{k}']"]["shards"]) for k in "abcdes"] == [2, 8, 8, 1, 4, 1]
    assert rec.replicas_agree and rec.finite
    # one device's copy of the replicated leaf changed: named, and the saved copy (device 0's) still agrees
    bad = [np.asarray(sh.data) if sh.device.id != 6 else np.asarray(sh.data) + 1 for sh in state["d"].addressable_shards]
    state["d"] = jax.make_array_from_single_device_arrays(
        (8, 12), state["d"].sharding, [jax.device_put(b, sh.device) for b, sh in zip(bad, state["d"].addressable_shards)])
    rec = statefp.record_state(state, None, 7)
    assert not rec.replicas_agree and rec.odd_devices() == [6]
    assert rec.data["disagree"] == [{"leaf": "['d']", "shard": "[:, :]", "devices": [6], "agree": [0, 1, 2, 3, 4, 5, 7],
                                     "majority": True, "groups": [[0, 1, 2, 3, 4, 5, 7], [6]], "saved_by": 0,
                                     "saved_is_odd": False}]
    assert rec.disputes() == rec.data["disagree"] and rec.suspect_devices() == [6]


def test_copies_without_a_majority_name_no_device():
    """Two copies that differ (an expert shard replicated over a data axis of 2) cannot say which is wrong:
    both are suspects, none is odd, whatever copy Orbax saved and whatever the device order; a strict
    majority names the others."""
    j = statefp.judge_copies
    for saved in (1, 3):
        x = j("w", "[1:2]", {1: "aa", 3: "bb"}, saved)
        assert (x["devices"], x["agree"], x["majority"], "saved_is_odd" in x) == ([1, 3], [], False, False)
    x = j("w", "[:]", {0: "aa", 1: "aa", 2: "bb", 3: "aa"}, 0)
    assert (x["devices"], x["agree"], x["majority"], x["saved_is_odd"]) == ([2], [0, 1, 3], True, False)
    x = j("w", "[:]", {0: "bb", 1: "aa", 2: "aa", 3: "aa"}, 0)
    assert (x["devices"], x["saved_is_odd"]) == ([0], True)  # the saved copy is the odd one
    for copies in ({0: "aa", 1: "aa", 2: "bb", 3: "bb"}, {0: "aa", 1: "aa", 2: "bb", 3: "cc"}):
        x = j("w", "[:]", copies, 0)  # 2 of 4 is no majority
        assert (x["devices"], x["majority"]) == ([0, 1, 2, 3], False)
    rec = statefp.StateRecord({"step": 8, "replicas_agree": False, "leaves": {"w": {"shards": [
        {"index": "[1:2]", "saved_by": 1, "replicas": {"1": "aa", "3": "bb"}},
        {"index": "[0:1]", "saved_by": 0, "replicas": {"0": "cc", "2": "cc"}}]}}, "disagree": []})
    assert (rec.odd_devices(), rec.suspect_devices()) == ([], [1, 3])
    assert "with no majority: one of device(s) [1, 3] holds a wrong copy" in statefp.dispute_text(rec.disputes()[0])


def test_a_conviction_after_a_poisoned_update_keeps_only_devices_holding_a_wrong_copy():
    from replay.run.codes import Verdict
    from replay.verify.verdict import Cause, Decision, Evidence, limit_to_poisoned_state

    d = Decision(Verdict.CONVICTED, Cause.DEVICE_FAULT, Evidence.PER_SHARD, 7, (0, 1), ("w",), 2, "step 7: ...")
    got = limit_to_poisoned_state(d, 8, [], [1, 3], "the copies disagree")
    assert (got.verdict, got.devices) == (Verdict.CONVICTED, (1,)) and "device(s) [0] hold no wrong copy" in got.explanation
    got = limit_to_poisoned_state(d, 8, [], [2, 3], "the copies disagree")
    assert (got.verdict, got.cause, got.devices) == (Verdict.AMBIGUOUS, Cause.STATE_POISONED, ())
    assert limit_to_poisoned_state(d, 8, [0, 1], [0, 1], "x") == d  # every convicted device holds a wrong copy
    assert limit_to_poisoned_state(d, 8, [], [], "x") == d
    link = dataclasses.replace(d, cause=Cause.LINK_FAULT, devices=())
    assert limit_to_poisoned_state(link, 8, [], [2], "x") == link


# ----------------------------------------------------------------------------- 2. a damaged checkpoint


def test_a_silently_restored_flip_is_a_damaged_checkpoint_never_a_conviction(run_copy, use_kit, capsys):
    kit = use_kit
    path, off = silent_flip(run_copy, 8, restorer(kit))
    state, loader = kit.trainer.restore(run_copy, 8, kit.mesh)  # Orbax restores it without a word
    with pytest.raises(statefp.DamagedCheckpointError) as e:
        statefp.verify_restored(run_copy, 8, state, loader)
    import jax

    from replay.reference.trainer import make_mesh

    other, _ = kit.trainer.restore(run_copy, 8, make_mesh({"data": 4, "expert": 1}, jax.devices()[4:8]))
    with pytest.raises(statefp.DamagedCheckpointError) as e_other:  # on another mesh shape: damaged all the same
        statefp.verify_restored(run_copy, 8, other, loader)
    assert e_other.value.leaf == e.value.leaf
    assert e.value.step == 8 and e.value.leaf in statefp.read_record(run_copy, 8).data["leaves"]
    assert e.value.shard is not None and f"leaf {e.value.leaf}, shard {e.value.shard}" in str(e.value)
    assert str(e.value).endswith(f"restore the previous checkpoint (4), or run 'replay certify --run {run_copy}' to "
                                 "find the newest checkpoint that is clean")
    capsys.readouterr()
    # range replay, canary and certify: the damaged-checkpoint code, never a device verdict
    assert cli.main(["--run", run_copy, "--steps", "8:10", "--no-progress"]) == ExitCode.DAMAGED_CHECKPOINT == 20
    err = capsys.readouterr().err
    assert "damaged checkpoint: checkpoint 8 is damaged: leaf" in err.replace("\n", " ") and "CONVICTED" not in err
    assert cli.main(["canary", "--run", run_copy, "--checkpoint", "8", "--devices", "0", "--repeats", "1",
                     "--no-progress"]) == ExitCode.DAMAGED_CHECKPOINT
    capsys.readouterr()
    out_json = os.path.join(run_copy, "..", "certify.json")
    assert cli.main(["certify", "--run", run_copy, "--from", "4", "--no-progress", "--json", out_json]) == \
        ExitCode.DAMAGED_CHECKPOINT
    rep = json.load(open(out_json))
    assert [(v["checkpoint"], v["verdict"]) for v in rep["chain"]] == [(4, "trusted"), (8, "damaged"), (12, "certified")]
    assert rep["certified"] == 12 and rep["first_failure"]["reason"].startswith("the replay reaches its record, but")
    # the trainer: rolling back onto the damaged copy stops with the damaged-checkpoint error
    from replay.reference import run as ref_run
    from replay.reference import loop

    cfg = ref_run.run_config_from_dict(load_run(run_copy).config, run_copy)
    with pytest.raises(statefp.DamagedCheckpointError, match="checkpoint 8 is damaged"):
        loop.train(run_copy, cfg, STEPS, trainer=kit.trainer, mesh=kit.mesh, launch=loop.Launch(rewind_to=8),
                   output=loop.Output(log=_quiet, plot=False, progress=io.StringIO()))


def test_the_training_command_maps_damaged_and_poisoned_checkpoints_to_their_codes(monkeypatch, tmp_path, capsys):
    from replay.reference import train as train_cmd

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setattr(train_cmd, "_config_and_steps", lambda args: (None, 3))
    for err, code in ((statefp.DamagedCheckpointError("checkpoint 4 is damaged: x", step=4), 20),
                      (statefp.PoisonedCheckpointError("checkpoint 4 is poisoned: y", step=4, devices=[1]), 21)):
        def boom(*a, err=err, **k):
            raise err

        monkeypatch.setattr(train_cmd, "train", boom)
        assert train_cmd.main(["--run", str(tmp_path / "r")]) == code
        assert capsys.readouterr().err.startswith(f"error: {'damaged' if code == 20 else 'poisoned'} checkpoint: ")


def test_an_old_run_without_records_restores_with_a_note(run_copy, use_kit, capsys):
    as_saved_before_records(run_copy)
    capsys.readouterr()
    assert cli.main(["--run", run_copy, "--steps", "9:10", "--no-progress"]) == ExitCode.ACQUITTED
    assert (f"note: checkpoint 8 of {run_copy} has no state record (a run written before checkpoint fingerprints): "
            "it cannot be verified") in capsys.readouterr().err
    assert cli.main(["certify", "--run", run_copy, "--from", "8", "--no-progress"]) == ExitCode.AMBIGUOUS
    assert "not_certifiable" in capsys.readouterr().out


def test_a_lost_record_of_a_run_that_records_is_a_damaged_checkpoint_not_an_old_run(run_copy, use_kit, capsys):
    """Checkpoint 8's record file removed while its checkpoint event says one was written (a partial copy of the
    run): not "a run written before records" (whose restore goes on unverified, and a silently damaged file would
    then convict devices), but a checkpoint that cannot be verified: the damaged-checkpoint code, no device."""
    os.remove(statefp.record_path(run_copy, 8))
    capsys.readouterr()
    assert cli.main(["--run", run_copy, "--steps", "9:10", "--no-progress"]) == ExitCode.DAMAGED_CHECKPOINT
    err = capsys.readouterr().err
    assert f"checkpoint 8: its state record {statefp.record_path(run_copy, 8)} is missing, while the run's " \
           "checkpoint event of step 8 (events.jsonl) says one was written at the save" in " ".join(err.split())
    assert statefp.read_record(run_copy, 4) is not None  # the others are read as before


def test_a_damaged_state_record_is_a_damaged_checkpoint_never_a_poisoned_one(run_copy, use_kit, capsys):
    """The record file damaged, the checkpoint's files intact: the restore says damaged, and certify, whose
    replay reaches the files but not the record, says damaged (the record), not poisoned, and goes on."""
    from replay.verify import certify

    path = statefp.record_path(run_copy, 12)
    data = json.load(open(path))
    fp = data["leaves"]["['params']['embed']"]["fp"]
    data["leaves"]["['params']['embed']"]["fp"] = ("1" if fp[0] == "0" else "0") + fp[1:]  # still valid JSON
    with open(path, "w") as f:
        json.dump(data, f, sort_keys=True)
    rep = certify.certify(session(use_kit, run_copy), start=8)
    assert [(v.checkpoint, v.verdict) for v in rep.chain] == [(8, "trusted"), (12, "damaged")]
    assert "the record was damaged (or edited) after the save, not the state" in rep.chain[1].reason
    assert rep.exit_code == ExitCode.DAMAGED_CHECKPOINT and not rep.chain[1].devices
    capsys.readouterr()
    assert cli.main(["canary", "--run", run_copy, "--checkpoint", "12", "--devices", "0", "--repeats", "1",
                     "--no-progress"]) == ExitCode.DAMAGED_CHECKPOINT


def test_the_trainer_resumes_a_run_without_records_with_a_note(kit, tmp_path):
    run_dir = str(tmp_path / "old")
    train(kit, run_dir, 4)
    as_saved_before_records(run_dir)  # a run written before checkpoint fingerprints
    from replay.reference import loop

    said = io.StringIO()
    cfg = run_config(kit.root, kit.mix, skip_windows=[])
    loop.train(run_dir, cfg, 6, trainer=kit.trainer, mesh=kit.mesh, output=loop.Output(log=_quiet, plot=False,
                                                                                       progress=said))
    assert f"checkpoint 4 of {run_dir} has no state record (a run written before checkpoint fingerprints): it " \
           "cannot be verified" in " ".join(said.getvalue().split())
    (restore,) = events(run_dir, "restore")
    assert restore["step"] == 4 and restore["state_check"] == "unverified"
    assert statefp.read_record(run_dir, 6).finite  # the checkpoints it saves from now on have records


def test_certify_on_one_placement_restores_each_checkpoint_once(replay_session, use_kit, monkeypatch):
    """docs/replay.md's cost of certify on one placement: k segments, k + 1 restores (the check of a
    segment's end is the next one's start; the trusted checkpoint's own check is its first segment's)."""
    from replay.verify import certify

    sess = session(use_kit, replay_session.run.run_dir)
    calls = []
    real = type(sess.setup.trainer).restore
    monkeypatch.setattr(type(sess.setup.trainer), "restore", lambda self, d, s, m: calls.append(s) or real(self, d, s, m))
    rep = certify.certify(sess, device_spec="0,1,2,3", allow_env_drift=True)
    assert [(v.checkpoint, v.verdict) for v in rep.chain] == [(0, "trusted"), (4, "certified"), (8, "certified"),
                                                              (12, "certified")]
    assert rep.placements == [[0, 1, 2, 3]] and rep.steps_replayed == 12 and calls == [0, 4, 8, 12]


# ----------------------------------------------------------------------------- 3. optimizer-state poison


POISON = [  # (device, state leaf, step): every device position of the 2x2 mesh, Orbax's saved copies included
    (0, "['params']['layers'][0]['wq']", 5),  # replicated on 4 devices, Orbax saves device 0's copy
    (1, "['params']['layers'][0]['w_in']", 6),  # expert shard [1:2]: 2 copies (devices 1, 3), Orbax saves 1's
    (3, "['opt_state'][1][0].mu['layers'][0]['w_in']", 7),  # the same shard's other copy, the step before the save
    (2, "['opt_state'][1][0].nu['embed']", 6),
]


@pytest.mark.parametrize("device,leaf,step", POISON)
def test_optimizer_poison_is_named_at_the_save_and_certify_names_the_checkpoint(kit, use_kit, tmp_path, device,
                                                                                 leaf, step, capsys):
    from replay.run.protocol import FaultSpec
    from replay.verify import certify, engine

    run_dir = str(tmp_path / "poison")
    # element 163: row 10 of the embedding (a token the batches use); a flip of a zero that stays a denormal
    # would be flushed to zero by XLA:CPU before the save (nothing left to find)
    fault = FaultSpec(step=step, device_id=device, leaf=leaf, element=163, bit=22, where="optimizer_update")
    train(kit, run_dir, 10, faults=fault)
    ev = events(run_dir, "state_replicas_disagree")[0]
    assert ev["step"] == 8 and ev["disagree"][0]["leaf"] == leaf and device in ev["suspects"]
    (dispute,) = [x for x in statefp.read_record(run_dir, 8).disputes() if x["leaf"] == leaf]
    if dispute["majority"]:  # 4 copies: the 3 that agree name the odd one, the saved copy included
        assert ev["devices"] == [device] == dispute["devices"]
    else:  # 2 copies: no majority; both are suspects at the save, neither is named (a tie names nobody)
        assert ev["devices"] == [] and len(dispute["devices"]) == 2 and device in dispute["devices"]
    assert events(run_dir, "checkpoint")[2]["state"]["replicas_agree"] is False
    sess = session(kit, run_dir)
    rep = certify.certify(sess)
    got = [(v.checkpoint, v.verdict) for v in rep.chain]
    assert got == [(0, "trusted"), (4, "certified"), (8, "poisoned"), (10, "not_checked")]
    # certify names the faulty device in every case: by the majority of copies, or by the replay
    assert rep.chain[2].devices == (device,) and rep.certified == 4 and rep.exit_code == ExitCode.POISONED_CHECKPOINT
    # no replay over any range convicts another device; one that starts at the poisoned checkpoint is refused
    r = engine.replay_range(sess, 4, 8, allow_env_drift=True)
    assert set(r.decision.devices) <= {device}
    assert r.decision.verdict.value == ("convicted" if step < 7 and "params" in leaf else "acquitted")
    with pytest.raises(statefp.PoisonedCheckpointError) as e:
        engine.replay_range(session(kit, run_dir), 8, 10, allow_env_drift=True)
    assert e.value.step == 8 and device in e.value.suspects and e.value.devices == ev["devices"]
    capsys.readouterr()
    png = str(tmp_path / "chain.png")
    assert cli.main(["certify", "--run", run_dir, "--no-progress", "--plot", png]) == 21
    assert os.path.getsize(png) > 0 and "certified: checkpoint 4" in capsys.readouterr().out


def test_a_chain_with_two_damaged_and_one_poisoned_checkpoint(kit, tmp_path):
    from replay.run.protocol import FaultSpec
    from replay.verify import certify

    run_dir = str(tmp_path / "chain")
    fault = FaultSpec(step=13, device_id=1, leaf="['params']['unembed']", element=5, bit=21, where="optimizer_update")
    train(kit, run_dir, 16, faults=fault)
    for c in (4, 8):
        silent_flip(run_dir, c, restorer(kit))
    rep = certify.certify(session(kit, run_dir))
    assert [(v.checkpoint, v.verdict) for v in rep.chain] == [
        (0, "trusted"), (4, "damaged"), (8, "damaged"), (12, "certified"), (16, "poisoned")]
    assert rep.certified == 12 and rep.chain[4].devices == (1,) and rep.exit_code == 21
    assert rep.steps_replayed == 15  # the poisoned segment stops at its first divergent step, 14
    png = certify.plot_chain(rep.to_dict(), str(tmp_path / "chain.png"))
    assert os.path.getsize(png) > 0


# ----------------------------------------------------------------------------- 4. non-finite state


def nan_fault(step):
    """A bit flip that makes one device's gradient element ~1e35 at ``step``: the global norm overflows,
    clipping turns the update into NaN, and every later loss is NaN (a NaN run without a new trainer)."""
    from replay.run.protocol import FaultSpec

    return FaultSpec(step=step, device_id=1, leaf="['unembed']", element=37, bit=30)


def test_non_finite_stop_is_the_default_and_saves_no_non_finite_checkpoint(kit, tmp_path):
    run_dir = str(tmp_path / "nan_stop")
    _, out = train(kit, run_dir, 10, faults=nan_fault(2))
    assert out["stopped"]["kind"] == "non_finite" and out["stopped"]["first_step"] == 2
    (nf,) = events(run_dir, "non_finite")
    assert nf["step"] == 2 and nf["action"] == "stop" and "gradient norm inf" in nf["what"]
    assert [(e["step"], e["state"]["finite"]) for e in events(run_dir, "checkpoint")] == [(0, True)]
    (stop,) = events(run_dir, "stopped")
    assert stop["reason"] == "non_finite" and stop["step"] == 3 and stop["checkpoint_refused"] == 3


def test_non_finite_skip_step_drops_the_update_and_replay_follows(kit, tmp_path):
    run_dir = str(tmp_path / "nan_skip")
    _, out = train(kit, run_dir, 8, non_finite="skip_step", faults=nan_fault(5))
    assert [(e["step"], e["action"]) for e in events(run_dir, "non_finite")] == [(5, "skip_step")]
    assert all(math.isfinite(out["losses"][s]) for s in range(8))
    assert all(e["state"]["finite"] for e in events(run_dir, "checkpoint"))
    # replaying the faulty run (the same fault) reproduces every step only if it drops step 5's update too
    sess = session(kit, run_dir)
    fps, diffs, _ = sess.replay_segment((0, 1, 2, 3), 4, 8, log=sess.run.fingerprints, fault=nan_fault(5))
    assert [d.step for d in diffs] == [4, 5, 6, 7] and all(d.ok for d in diffs)


def test_a_nan_run_warn_scan_onset_triage_advice_and_goodput(kit, tmp_path):
    """A NaN run: device 1's copy of the final norm's scale (about 1.0) gets its top exponent bit flipped
    after step 2's update; its step-3 forward overflows, the NaN reaches every device through the reduced
    gradient, and every loss from step 3 on is NaN (non_finite: warn goes on)."""
    from replay.run.protocol import FaultSpec
    from replay.screen import goodput, scan, triage

    run_dir = str(tmp_path / "nan_warn")
    fault = FaultSpec(step=2, device_id=1, leaf="['params']['final_norm']", element=0, bit=30, where="optimizer_update")
    train(kit, run_dir, 10, non_finite="warn", faults=fault)
    run = load_run(run_dir)
    assert [e["step"] for e in events(run_dir, "non_finite")] == list(range(3, 10))
    assert [math.isfinite(run.fingerprints[s].router["loss"]) for s in range(10)] == [True] * 3 + [False] * 7
    assert {e["step"]: e["state"]["finite"] for e in events(run_dir, "checkpoint")} == \
        {0: True, 4: False, 8: False, 10: False}
    rep = scan.scan_run(run, 0, 10)
    assert rep.onset["step"] == 3 and rep.onset["check"] == "nonfinite"  # its first non-finite step
    assert rep.onset["devices"] == [1]
    run_sus = [x for x in rep.suspects if x.kind == "run"]
    assert run_sus and run_sus[0].next["command"].endswith("--step 4")  # the run-wide divergence's first step
    tri = triage.triage_run(run, 9)
    assert tri.skip_plan is not None and tri.skip_plan["checkpoint"] == 0  # never 4 or 8: non-finite
    g = goodput.account(run).to_dict()
    assert (g["steps"]["non_finite"], g["steps"]["productive"]) == (7, 3)
    assert g["time_adds_up"] and g["reconcile"]["data_steps_add_up"]
    assert g["token_goodput"] == pytest.approx(0.3)
