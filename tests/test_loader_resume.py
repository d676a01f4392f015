"""Checkpoint and resume: exact streams, fingerprints, skip windows, Grain and Orbax integration."""

import json

import grain
import numpy as np
import pytest

import loader
from loader import testing as lt

SEQ = 8
VOCAB = 1000
B = 8
PHASE_STEP = 6


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("resume") / "ds")
    lt.write_synthetic_dataset(path, {"a": 6, "b": 9}, SEQ, shards_per_source=2, vocab_size=VOCAB)
    return path


def mix(weights=None, phase=None):
    phases = [(PHASE_STEP, phase or {"a": 0.8, "b": 0.2})]
    return lt.synthetic_mixture(weights or {"a": 0.25, "b": 0.75}, seq_len=SEQ, phases=phases)


def stream(data, n, start=None):
    it = data.iterate(start)
    out = []
    for _ in range(n):
        step, batch = next(it)
        out.append((step, np.asarray(batch["inputs"]).tolist()))
    it.close()
    return out


N = 14


@pytest.fixture(scope="module")
def reference(ds):
    return stream(loader.build(mix(), ds, global_batch=B), N)


def epoch_end_step(data):
    """A step at whose start source 'b' has completed whole epochs."""
    for s in range(1, N):
        if data.schedule.source_counts(s * B)[1] % 9 == 0:
            return s
    raise AssertionError("no epoch end in range")


@pytest.mark.parametrize("where", ["zero", "mid_epoch", "epoch_end", "after_phase"])
def test_resume_is_exact(ds, reference, where):
    first = loader.build(mix(), ds, global_batch=B)
    k = {"zero": 0, "mid_epoch": 3, "epoch_end": epoch_end_step(first), "after_phase": PHASE_STEP + 1}[where]
    head = stream(first, k) if k else []
    saved = json.loads(json.dumps(first.state().to_dict()))
    assert saved["next_step"] == k
    resumed = loader.build(mix(), ds, global_batch=B, state=saved)
    tail = stream(resumed, N - k)
    assert head + tail == reference


def test_resume_twice_in_a_row(ds, reference):
    a = loader.build(mix(), ds, global_batch=B)
    part1 = stream(a, 4)
    b = loader.build(mix(), ds, global_batch=B, state=a.state())
    part2 = stream(b, 5)
    c = loader.build(mix(), ds, global_batch=B, state=b.state().to_dict())
    part3 = stream(c, N - 9)
    assert part1 + part2 + part3 == reference


def test_restore_then_save_gives_same_state(ds):
    a = loader.build(mix(), ds, global_batch=B)
    stream(a, 5)
    s1 = a.state()
    fresh = loader.build(mix(), ds, global_batch=B, workers=1)
    fresh.restore(s1)
    assert fresh.state() == s1
    assert fresh.state().to_json() == s1.to_json()


def test_worker_processes_give_same_stream(ds, reference):
    """Grain worker processes read; the output does not depend on the number of workers."""
    a = loader.build(mix(), ds, global_batch=B)
    stream(a, 3)
    w = loader.build(mix(), ds, global_batch=B, workers=2, prefetch=3, state=a.state())
    assert stream(w, 5) == reference[3:8]


def test_read_threads_give_same_stream(ds, reference):
    t = loader.build(mix(), ds, global_batch=B, read_threads=3, prefetch=1)
    assert stream(t, 6, start=2) == reference[2:8]


def test_grain_checkpoint_roundtrip(ds):
    data = loader.build(mix(), ds, global_batch=B)
    grain.experimental.assert_equal_output_after_checkpoint(data.grain_dataset(0, 5).to_iter_dataset())


def test_batch_at_is_pure(ds, reference):
    data = loader.build(mix(), ds, global_batch=B)
    for step in (9, 2, 9, 0):
        assert np.asarray(data.batch_at(step)["inputs"]).tolist() == reference[step][1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": 1}, "seed 0 -> 1"),
        ({"global_batch": 16}, "global batch 8 -> 16"),
        ({"mixture": lt.synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=SEQ,
                                          phases=[(PHASE_STEP, {"a": 0.8, "b": 0.2})])},
         "mixture phases/weights"),
        ({"mixture": lt.synthetic_mixture({"a": 0.25, "b": 0.75}, seq_len=SEQ)}, "mixture phases/weights"),
        ({"skip_windows": [(2, 3)]}, "starts before the saved next step 5"),
    ],
)
def test_resume_refused_naming_what_changed(ds, kwargs, message):
    a = loader.build(mix(), ds, global_batch=B)
    stream(a, 5)
    args = {"mixture": mix(), "dataset": ds, "global_batch": B}
    args.update(kwargs)
    with pytest.raises(loader.ResumeError, match=message):
        loader.build(**args, state=a.state())


def test_resume_refused_on_other_dataset(ds, tmp_path):
    other = str(tmp_path / "other")
    lt.write_synthetic_dataset(other, {"a": 6, "b": 9}, SEQ, shards_per_source=2, vocab_size=VOCAB, seed=7)
    a = loader.build(mix(), ds, global_batch=B)
    with pytest.raises(loader.ResumeError, match="manifest sha256"):
        loader.build(mix(), other, global_batch=B, state=a.state())


def test_tampered_state_refused(ds):
    a = loader.build(mix(), ds, global_batch=B)
    d = a.state().to_dict()
    d["schedule"]["seed"] = 5
    with pytest.raises(loader.ResumeError, match="fingerprint"):
        loader.LoaderState.from_dict(d)


def test_skip_window_added_on_resume(ds, reference):
    """Loss spike: resume at step 5 skipping the data of steps 5..7; logged as an event."""
    a = loader.build(mix(), ds, global_batch=B)
    stream(a, 5)
    b = loader.build(mix(), ds, global_batch=B, skip_windows=[(5, 7)], state=a.state())
    assert b.events == [{"event": "skip_window", "step": 5, "start": 5, "end": 7}]
    got = stream(b, 4)
    assert [s for s, _ in got] == [5, 6, 7, 8]
    assert [x for _, x in got] == [x for _, x in reference[8:12]]
    # the new state carries the window; resuming it again without the window is refused
    with pytest.raises(loader.ResumeError, match="skip windows"):
        loader.build(mix(), ds, global_batch=B, state=b.state())
    c = loader.build(mix(), ds, global_batch=B, skip_windows=[(5, 7)], state=b.state())
    assert [x for _, x in stream(c, 2)] == [x for _, x in reference[12:14]]


def test_metrics(ds):
    data = loader.build(mix(), ds, global_batch=B, prefetch=3)
    it = data.iterate(0)
    tokens = 0
    for _ in range(4):
        _, batch = next(it)
        tokens += int((np.asarray(batch["inputs_segmentation"]) > 0).sum())
    m = data.metrics()
    it.close()
    assert m["rows_served"] == 4 * B and m["tokens_served"] == tokens and m["next_step"] == 4
    assert 0 <= m["prefetch_occupancy"] <= 3 and m["wait_s_last_step"] >= 0
    refs = [r for s in range(4) for r in data.rows_at(s)]
    for name, rec in (("a", 6), ("b", 9)):
        n = sum(r.source == name for r in refs)
        assert m["per_source"][name]["rows"] == n
        assert m["per_source"][name]["epochs"] == pytest.approx(n / rec)


def test_orbax_checkpoint_manager(ds, tmp_path, reference):
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    data = loader.build(mix(), ds, global_batch=B)
    stream(data, 3)
    params = {"w": jnp.arange(4.0)}
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        mngr.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                              loader=loader.LoaderSave(data.state())))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        restored = mngr.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore(params),
                                                           loader=loader.LoaderRestore()))
    assert restored.loader == data.state()
    resumed = loader.build(mix(), ds, global_batch=B, state=restored.loader)
    assert stream(resumed, 3) == reference[3:6]


def test_resume_under_a_different_device_count(ds, reference):
    """Saved on an 8-device mesh, resumed on a 4-device and a 2x2 (data, context) mesh: same batches."""
    import jax
    from jax.sharding import Mesh

    a = loader.build(mix(), ds, global_batch=B)
    stream(a, 4)
    four = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    b = loader.build(mix(), ds, global_batch=B, mesh=four, state=a.state())
    assert stream(b, 3) == reference[4:7]
    grid = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
    c = loader.build(mix(), ds, global_batch=B, mesh=grid, context_axis="context", state=b.state())
    assert stream(c, 3) == reference[7:10]


def test_weights_normalized_and_reported(ds):
    data = loader.build(lt.synthetic_mixture({"a": 2, "b": 6}, seq_len=SEQ), ds, global_batch=B)
    assert data.normalized_weights() == [{"a": 0.25, "b": 0.75}]
    counts = data.schedule.source_counts(40 * B)
    assert counts.tolist() == [80, 240]
