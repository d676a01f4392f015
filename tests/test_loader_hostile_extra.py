"""Hostile use of the loader, as a training fleet would meet it: each test pins a fault found
by breaking the loader on purpose (wrong paths, corrupted manifests and shards, records that
lie about their layout, odd argument types, huge steps, tampered states, leaked threads),
with the exact error or value now expected."""

import gc
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import loader
from contract import codec
from loader import index as ix
from loader import arrays as ar
from loader import dataset as dset
from loader import testing as lt
from loader.prefetch import _THREADS

SEQ = 16
VOCAB = 1000
SHARD_B1 = "b/data-00001-of-00003.array_record"  # records 8..15 of source b


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile") / "synthetic")
    lt.write_synthetic_dataset(path, {"a": 10, "b": 23, "c": 2}, SEQ, shards_per_source=3, vocab_size=VOCAB)
    return path


def mix(**kw):
    return lt.synthetic_mixture(kw.pop("weights", {"a": 0.3, "b": 0.6, "c": 0.1}), seq_len=SEQ, **kw)


def copy_ds(ds, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    shutil.copytree(ds, dst)
    return dst


def edit_manifest(d, edit):
    path = pathlib.Path(d, "manifest.json")
    man = json.loads(path.read_text())
    edit(man)
    path.write_text(json.dumps(man))


# ------------------------------------------------------------------ dataset folder and manifest


def test_dataset_path_is_a_file(ds):
    """Was a bare NotADirectoryError."""
    with pytest.raises(loader.DatasetError, match=r"manifest.json/manifest.json: cannot read the manifest \(Not a directory\)"):
        loader.build(mix(), os.path.join(ds, "manifest.json"), global_batch=8)


@pytest.mark.parametrize("edit, message", [
    # Was a bare TypeError from the ledger arithmetic (then "malformed manifest (TypeError: ...)").
    (lambda m: m["sources"]["a"]["ledger"].update(rejected={"too_long": "1"}),
     r"manifest.sources.a.ledger.rejected.too_long: expected an integer, got '1'"),
    (lambda m: m.update(token_dtype="float32"), r"token_dtype 'float32', expected one of \['uint16', 'uint32'\]"),
    # Was a bare ValueError from int() in build.
    (lambda m: m["tokenizer"].update(pad_id="x"), r"tokenizer.pad_id must be an integer, got 'x'"),
    # Was accepted: padding would wrap around in a uint16 array.
    (lambda m: m["tokenizer"].update(pad_id=70000), r"tokenizer.pad_id 70000 does not fit token_dtype uint16"),
    (lambda m: m["tokenizer"].update(vocab_size=1000.0), r"tokenizer.vocab_size must be an integer, got 1000.0"),
])
def test_manifest_fields_of_wrong_type_are_dataset_errors(ds, tmp_path, edit, message):
    d = copy_ds(ds, tmp_path)
    edit_manifest(d, edit)
    with pytest.raises(loader.DatasetError, match=message):
        loader.build(mix(), d, global_batch=8)


@pytest.mark.parametrize("text, message", [
    ("", "manifest is not valid JSON"),
    ('{"manifest_version": 1, "sources"', "manifest is not valid JSON"),
    ("null", "missing field 'manifest_version'"),
    ('{"manifest_version": 2}', "manifest_version 2, this reader knows 1"),
    (b"\xff\xfe", "can't decode byte 0xff"),
])
def test_manifest_truncated_or_not_json(ds, tmp_path, text, message):
    d = copy_ds(ds, tmp_path)
    p = pathlib.Path(d, "manifest.json")
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(loader.DatasetError, match=message):
        loader.build(mix(), d, global_batch=8)


# ------------------------------------------------------------------ corrupted shards


def _data_byte_positions(shard_bytes):
    """Offsets of the shard's non-zero bytes (chunks, index, footer; not block padding)."""
    return np.flatnonzero(np.frombuffer(shard_bytes, np.uint8))


def test_every_bit_flip_is_named_never_silent(ds, tmp_path):
    """Flip one bit at a time (every 5th non-zero byte of a shard, then all the shard's
    records are read): each flip is refused at build naming the shard, refused at read
    naming the shard and the record, or leaves every record's bytes unchanged. Never
    different data. A corrupted footer used to escape open-and-check as a bare RuntimeError
    (raised by ``reader.close()``) without the shard's name."""
    d = copy_ds(ds, tmp_path)
    path = os.path.join(d, SHARD_B1)
    orig = pathlib.Path(path).read_bytes()
    _, _, shards = dset.open_dataset(d, mix())
    src, rec = np.full(8, 1), np.arange(8, 16)
    good = shards.read(src, rec)
    outcome = {"build": 0, "read": 0, "unchanged": 0}
    for off in _data_byte_positions(orig)[::5].tolist():
        bad = bytearray(orig)
        bad[off] ^= 0x01
        pathlib.Path(path).write_bytes(bytes(bad))
        try:
            _, _, s2 = dset.open_dataset(d, mix())
        except loader.DatasetError as e:
            assert f"shard {path}: " in str(e)
            outcome["build"] += 1
            continue
        try:
            got = s2.read(src, rec)
        except loader.DatasetError as e:
            assert str(e).startswith(f"reading {path}: record(s) in shard ")
            assert "(source record " in str(e)
            outcome["read"] += 1
            continue
        assert got == good, f"silent change at byte {off}"
        outcome["unchanged"] += 1
    pathlib.Path(path).write_bytes(orig)
    assert outcome["build"] > 0 and outcome["read"] > 0
    assert sum(outcome.values()) == len(_data_byte_positions(orig)[::5])


def test_bit_flips_caught_at_build_with_verify_sha256(ds, tmp_path):
    d = copy_ds(ds, tmp_path)
    path = os.path.join(d, SHARD_B1)
    orig = pathlib.Path(path).read_bytes()
    for off in (20, 100, 1244, len(orig) // 2 + 24, len(orig) - 1):
        bad = bytearray(orig)
        bad[off] ^= 0x01
        pathlib.Path(path).write_bytes(bytes(bad))
        with pytest.raises(loader.DatasetError, match=rf"shard {path}: sha256 [0-9a-f]{{64}} != manifest .* \(altered\)"):
            loader.build(mix(), d, global_batch=8, verify_sha256=True)


def test_corrupt_chunk_named_with_record_in_the_trainer_thread(ds, tmp_path):
    d = copy_ds(ds, tmp_path)
    path = os.path.join(d, SHARD_B1)
    bad = bytearray(pathlib.Path(path).read_bytes())
    bad[64] ^= 0x01  # header of the chunk holding record 0 of the shard (source record 8)
    pathlib.Path(path).write_bytes(bytes(bad))
    data = loader.build(mix(), d, global_batch=8)  # no sha256: caught on first read
    steps = [s for s in range(12) if any(r.shard == SHARD_B1 and r.record_in_shard == 0 for r in data.rows_at(s))]
    it = data.iterate(steps[0])
    with pytest.raises(loader.DatasetError, match=rf"reading {path}: record\(s\) in shard 0 \(source record 8\) unreadable"):
        next(it)
    it.close()


def _rewrite_record(d, rel, index, fn):
    """Replaces record ``index`` of shard ``rel`` by ``fn(bytes)``; fixes the manifest's bytes and sha256
    so that only the record itself is wrong."""
    path = os.path.join(d, rel)
    r = ArrayRecordReader(path)
    records = list(r.read(list(range(r.num_records()))))
    r.close()
    records[index] = fn(records[index])
    os.remove(path)
    w = ArrayRecordWriter(path, "group_size:1")
    for x in records:
        w.write(x)
    w.close()

    def fix(man):
        for s in man["sources"][rel.split("/")[0]]["shards"]:
            if s["path"] == rel:
                s["bytes"] = os.path.getsize(path)
                s["sha256"] = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    edit_manifest(d, fix)


def _reencode(seq_len=SEQ, dtype="uint16", token=None):
    def fn(data):
        row = codec.decode_row(data)
        segs = [s.astype(np.int64) for s in row.segments()]
        if token is not None:
            segs[0][3] = token
        return codec.encode_row(segs, row.doc_keys, row.chunk_indices, seq_len, dtype)
    return fn


@pytest.mark.parametrize("fn, message", [
    (lambda b: b"garbage", "record of 7 bytes is shorter than the 20-byte header"),
    (lambda b: b"XXXX" + b[4:], "bad magic b'XXXX', expected b'MOEP'"),
    (lambda b: b[:-3], "record is 73 bytes, layout says 76"),
    # Was a bare ValueError "row 7 has seq_len 32" naming neither shard nor record.
    (_reencode(seq_len=32), "record has seq_len 32, the dataset's is 16"),
    # Was SILENT: a 4-byte token 70000 was narrowed to 4464 in the uint16 host array.
    (_reencode(dtype="uint32", token=70000), "record has 4-byte tokens, expected 2"),
    # Was SILENT: a token outside the vocabulary reaches the embedding lookup.
    (_reencode(token=999 + 5000), "token 5999 >= vocab_size 1000"),
])
def test_bad_record_named_with_shard_and_record(ds, tmp_path, fn, message):
    d = copy_ds(ds, tmp_path)
    _rewrite_record(d, SHARD_B1, 2, fn)
    data = loader.build(mix(), d, global_batch=8, verify_sha256=True)  # the shard itself is intact
    name = f"b record 10 (shard {os.path.join(d, SHARD_B1)} record 2): "
    steps = [s for s in range(12) if any(r.shard == SHARD_B1 and r.record_in_shard == 2 for r in data.rows_at(s))]
    assert steps
    for s in steps[:2]:
        with pytest.raises(loader.DatasetError) as e:
            data.batch_at(s)
        assert str(e.value).startswith(name + message)
    clean = [s for s in range(12) if s not in steps]
    data.batch_at(clean[0])  # other steps still load


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=4), min_size=0, max_size=6),
    L=st.integers(1, 40), narrow=st.booleans(), pad=st.sampled_from([0, 3]), seed=st.integers(0, 2**16),
    ids=st.integers(0, 2),
)
def test_pack_records_equals_decode_then_pack(rows, L, narrow, pad, seed, ids):
    """The fast path (bytes -> packed array) is bit-identical to ``decode_all`` + ``pack_inputs``,
    for rows of format version 1 and 2 (document ids) mixed in one step."""
    rng = np.random.default_rng(seed)
    recs = []
    for r, lens in enumerate(rows):
        lens = [x for x in lens]
        while sum(lens) > L:
            lens.pop()
        segs = [rng.integers(1, 60000, x) for x in lens]
        doc_ids = [f"https://x/{r}/{i}" * ((i + r + ids) % 3) for i in range(len(segs))] if ids else None
        recs.append(codec.encode_row(segs, [f"doc{i}" * (i % 3) for i in range(len(segs))], [0] * len(segs), L,
                                     "uint16", doc_ids=doc_ids))
    dt = np.uint16 if narrow else np.int32
    packed, tokens = ar.pack_records(recs, L, 2, pad, dt, vocab_size=60000)
    idx = np.int16 if narrow else np.int32
    inputs, seg, pos = lt.pack_inputs(ar.decode_all(recs), L, pad, dt, idx)
    assert packed.dtype == dt and packed.shape == (len(recs), 3, L)
    np.testing.assert_array_equal(packed[:, 0], inputs)
    np.testing.assert_array_equal(packed[:, 1], seg.view(dt))
    np.testing.assert_array_equal(packed[:, 2], pos.view(dt))
    assert tokens == sum(int(codec.decode_row(r).num_tokens) for r in recs)
    six, tokens6 = ar.pack_records(recs, L, 2, pad, vocab_size=60000, six=True)
    ref = lt.derive_batch(*lt.pack_inputs(ar.decode_all(recs), L, pad))
    assert tokens6 == tokens and set(six) == set(loader.BATCH_KEYS)
    for k in loader.BATCH_KEYS:
        assert six[k].dtype == np.int32 and six[k].shape == (len(recs), L)
        np.testing.assert_array_equal(six[k], ref[k], err_msg=k)
    for k, v in ar.derive_packed(packed).items():
        np.testing.assert_array_equal(v, ref[k], err_msg=k)


# ------------------------------------------------------------------ arguments


def test_numpy_integers_accepted_bool_and_float_refused(ds):
    """``global_batch=np.int64(8)`` (a size computed with numpy) was refused; the batch is the int one's."""
    a = loader.build(mix(), ds, global_batch=np.int64(8), seed=np.int32(0), prefetch=np.int64(1))
    b = loader.build(mix(), ds, global_batch=8)
    assert type(a.global_batch) is int and a.global_batch == 8
    np.testing.assert_array_equal(np.asarray(a.batch_at(3)["inputs"]), np.asarray(b.batch_at(3)["inputs"]))
    for bad in (8.0, True, "8", np.float64(8)):
        with pytest.raises(loader.LoaderConfigError, match="global_batch must be an integer >= 1"):
            loader.build(mix(), ds, global_batch=bad)


def test_duplicate_mesh_axes_refused(ds):
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "ctx"))
    # Was jax's DuplicateSpecError from inside NamedSharding.
    with pytest.raises(loader.LoaderConfigError, match=r"must name distinct mesh axes"):
        loader.build(mix(), ds, global_batch=8, mesh=mesh, data_axes=("data", "ctx"), context_axis="ctx")
    # Was "global_batch 8 must be a multiple of the data axes ('data', 'data') size 64".
    with pytest.raises(loader.LoaderConfigError, match=r"must name distinct mesh axes"):
        loader.build(mix(), ds, global_batch=8, data_axes=("data", "data"))
    with pytest.raises(loader.LoaderConfigError, match="context_axis must be a mesh axis name"):
        loader.build(mix(), ds, global_batch=8, context_axis=1)


@pytest.mark.parametrize("step", [1.5, True, "3", None, np.float64(2.0)])
def test_non_integer_steps_refused(ds, step):
    """``batch_at(1.5)`` and ``batch_at(True)`` silently served step 1."""
    data = loader.build(mix(), ds, global_batch=8)
    with pytest.raises(loader.ScheduleError, match="step must be an integer"):
        data.batch_at(step)
    with pytest.raises(loader.ScheduleError, match="step must be an integer"):
        data.rows_at(step)
    if step is not None:  # iterate(None) means "from the state's next step"
        with pytest.raises(loader.ScheduleError, match="step must be an integer"):
            next(data.iterate(step))
    assert data.state().next_step == 0


def test_huge_steps(ds):
    """Steps past 2**62 / B raised a bare OverflowError; ``iterate`` from there hung forever
    (the reading stage ended and the trainer waited on an empty queue)."""
    data = loader.build(mix(), ds, global_batch=8)
    last = (1 << 62) // 8 - 1
    ref = data.rows_at(10**12)[0]
    assert (ref.global_row, ref.source, ref.epoch, ref.index_in_epoch) == (8 * 10**12, "b", 208695652173, 21)
    assert np.asarray(data.batch_at(10**12)["inputs"]).shape == (8, SEQ)
    msg = "past the last step this schedule can address"
    for bad in (last + 1, 2**63, 2**70):
        with pytest.raises(loader.ScheduleError, match=msg):
            data.batch_at(bad)
        with pytest.raises(loader.ScheduleError, match=msg):
            next(data.iterate(bad))
    assert [s for s, _ in data.iterate(last - 1)] == [last - 1, last]  # ends; no hang
    assert data.state().next_step == last + 1


def test_iterator_ends_cleanly_after_skip_windows(ds):
    data = loader.build(mix(), ds, global_batch=8, skip_windows=[(5, 10**15)])
    last = (1 << 62) // 8 - 1 - (10**15 - 5 + 1)
    assert data.schedule.data_step(last) == (1 << 62) // 8 - 1
    assert [s for s, _ in data.iterate(last - 1)] == [last - 1, last]


@pytest.mark.parametrize("windows, message", [
    ([(1.5, 3)], r"skip window start must be an integer, got 1.5"),  # was truncated to (1, 3)
    ([(1, "3")], r"skip window end must be an integer, got '3'"),
    ([(1, 2, 3)], r"skip window must be a \(start, end\) pair of integers, got \(1, 2, 3\)"),
    ([5], r"skip window must be a \(start, end\) pair of integers, got 5"),
    ([{"start": 1, "end": 2}], r"pair of integers, got \{'start': 1, 'end': 2\}"),
    ("12", r"skip windows must be a sequence of \(start, end\) pairs"),
    ([(10, 5)], r"skip window \[10, 5\]: need 0 <= start <= end"),
    ([(20, 30), (5, 10)], r"increasing starts"),
])
def test_malformed_skip_windows(ds, windows, message):
    with pytest.raises(loader.ScheduleError, match=message):
        loader.build(mix(), ds, global_batch=8, skip_windows=windows)


# ------------------------------------------------------------------ states


@pytest.fixture(scope="module")
def saved(ds):
    data = loader.build(mix(), ds, global_batch=8)
    data.batch_at(10)
    return data.state()


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(next_step="11"), r"next_step must be an integer, got '11'"),
    (lambda s: s.update(next_step=11.7), r"next_step must be an integer, got 11.7"),  # was truncated to 11
    (lambda s: s.update(next_step=True), r"next_step must be an integer, got True"),
    (lambda s: s.update(version="1"), r"version must be an integer"),
    (lambda s: s.update(fingerprint=None), r"fingerprint must be a string"),
    (lambda s: s.update(schedule=[]), r"schedule must be a mapping"),
    (lambda s: s.update(next_step=-1), r"next_step must be >= 0, got -1"),
    (lambda s: s.update(version=0), r"version 0, this loader reads 1"),
])
def test_tampered_state_dicts(ds, saved, edit, message):
    raw = saved.to_dict()
    edit(raw)
    with pytest.raises(loader.ResumeError, match=message):
        loader.build(mix(), ds, global_batch=8, state=raw)


def test_state_object_is_checked_like_a_dict(ds, saved):
    """A ``LoaderState`` object skipped the fingerprint and type checks."""
    import dataclasses

    forged = dataclasses.replace(saved, fingerprint="0" * 64)
    with pytest.raises(loader.ResumeError, match="fingerprint 0{64} does not match its fields"):
        loader.build(mix(), ds, global_batch=8, state=forged)
    junk = loader.LoaderState(next_step="x", fingerprint=1, manifest_sha256=None, schedule=None)
    with pytest.raises(loader.ResumeError, match="next_step must be an integer"):  # was AttributeError
        loader.build(mix(), ds, global_batch=8, state=junk)
    assert loader.build(mix(), ds, global_batch=8, state=saved).state() == saved


def test_state_from_another_dataset_names_it(ds, saved, tmp_path):
    other = str(tmp_path / "other")
    lt.write_synthetic_dataset(other, {"a": 10, "b": 23, "c": 2}, SEQ, shards_per_source=2, vocab_size=VOCAB)
    with pytest.raises(loader.ResumeError, match=r"manifest sha256 .* \(a different dataset\)"):
        loader.build(mix(), other, global_batch=8, state=saved)


# ------------------------------------------------------------------ threads


def _loader_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("loader-"))


def test_no_thread_left_after_close_drop_or_exhaustion(ds):
    data = loader.build(mix(), ds, global_batch=8, prefetch=0, read_threads=2)
    for _ in range(3):
        it = data.iterate(0)
        assert [next(it)[0] for _ in range(3)] == [0, 1, 2]
        it.close()
    assert _loader_threads() == [] and _THREADS == []
    it = data.iterate(5)
    next(it)
    del it  # dropped without close
    gc.collect()
    assert _loader_threads() == [] and _THREADS == []
    a, b = data.iterate(0), data.iterate(7)  # two iterators at once are independent
    assert [next(a)[0], next(b)[0], next(a)[0], next(b)[0]] == [0, 7, 1, 8]
    a.close()
    b.close()
    assert _loader_threads() == [] and _THREADS == []


def test_interpreter_exit_with_open_iterator(ds):
    """A script that leaves an iterator open (prefetch queues full) still exits, with status 0."""
    code = textwrap.dedent(f"""
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        import loader
        from loader import testing as lt
        data = loader.build(lt.synthetic_mixture({{"a": 1.0}}, seq_len={SEQ}), {ds!r}, global_batch=8, prefetch=4)
        it = data.iterate(0)
        next(it)
        print("served", data.state().next_step)
    """)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "served 1"


def test_phase_past_the_addressable_range_refused(ds):
    """A phase starting at 2**62 raised a bare OverflowError from numpy at build."""
    m = lt.synthetic_mixture({"a": 1, "b": 1, "c": 0}, seq_len=SEQ, phases=[(2**62, {"a": 0, "b": 0, "c": 1})])
    with pytest.raises(loader.ScheduleError, match=r"phase from_step 4611686018427387904 x global batch 8 is past"):
        loader.build(m, ds, global_batch=8)
    m = lt.synthetic_mixture({"a": 1, "b": 1, "c": 0}, seq_len=SEQ, phases=[(10**17, {"a": 0, "b": 0, "c": 1})])
    data = loader.build(m, ds, global_batch=8)
    assert [r.source for r in data.rows_at(10**17)] == ["c"] * 8
    assert data.rows_at(10**17 - 1)[0].source in ("a", "b")


def test_device_and_host_derivation_paths_agree(ds):
    """On CPU devices the loader derives the targets on the host and transfers the six arrays
    (``_host_derive``, ``_put``); accelerators take the jitted device path. Both, and the
    plain ``jax.device_put`` fallback, give the same bits as the numpy reference."""
    paths = {}
    for name, host_derive, fast_put in (("host", True, None), ("host-plain-put", True, False),
                                        ("device", False, None)):
        data = loader.build(mix(), ds, global_batch=8)
        data._host_derive, data._fast_put = host_derive, fast_put
        batch = data.batch_at(5)
        assert all(v.sharding == data.sharding and v.dtype == np.int32 for v in batch.values())
        paths[name] = {k: np.asarray(v) for k, v in batch.items()}
        it = data.iterate(5)
        _, again = next(it)
        it.close()
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(again[k]), paths[name][k])
    ref = lt.dense_batch(loader.build(mix(), ds, global_batch=8).read_rows(5), SEQ)
    for name, got in paths.items():
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{name} {k}")


def test_served_batches_never_change_later(ds):
    """Batches kept by the trainer stay as served while the loader runs on: host buffers
    are never recycled (on CPU, ``device_put`` may alias an aligned host buffer, so reusing
    one would rewrite an earlier batch in place)."""
    data = loader.build(mix(), ds, global_batch=8, prefetch=2)
    it = data.iterate(0)
    kept = [next(it)[1] for _ in range(12)]  # jax arrays, not copies
    it.close()
    ref = loader.build(mix(), ds, global_batch=8)
    for step, batch in enumerate(kept):
        want = ref.host_batch(step)
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(batch[k]), want[k], err_msg=f"step {step} {k}")


def test_workers_with_prefetch_zero(ds):
    """``workers=1, prefetch=0`` (prefetch 0 behaves as 1): same batches as ``batch_at``, and
    no loader thread left after close."""
    data = loader.build(mix(), ds, global_batch=8, workers=1, prefetch=0)
    it = data.iterate(3)
    got = [next(it) for _ in range(3)]
    it.close()
    assert [s for s, _ in got] == [3, 4, 5]
    for s, batch in got:
        np.testing.assert_array_equal(np.asarray(batch["inputs"]), np.asarray(data.batch_at(s)["inputs"]))
    assert _loader_threads() == [] and _THREADS == []


def test_truncated_checkpoint_file_is_a_resume_error(ds, saved, tmp_path):
    """A loader_state.json cut short (a checkpoint written during a preemption) raised a
    bare JSONDecodeError from the Orbax handler."""
    text = saved.to_json()
    for bad in (text[: len(text) // 2], "", "\xff"):
        with pytest.raises(loader.ResumeError, match="loader state is not JSON"):
            loader.LoaderState.from_json(bad)
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "loader_state.json").write_text(text[:-5])
    with pytest.raises(loader.ResumeError, match="loader state is not JSON"):
        loader.LoaderCheckpointHandler().restore(path, args=loader.LoaderRestore())
    (path / "loader_state.json").write_text(text)
    assert loader.LoaderCheckpointHandler().restore(path, args=loader.LoaderRestore()) == saved


@pytest.mark.parametrize("n", [2, 3, 1000, 20000, 65536, 65538, 70001])
def test_shuffle_tables_equal_grain(n):
    """The numpy whole-epoch table is Grain's ``index_shuffle``, value for value."""
    from grain.experimental import index_shuffle

    for seed in (0, 7, 2**32 - 1):
        table = ix.shuffle_table(n - 1, seed)
        want = [index_shuffle(i, n - 1, seed, 4) for i in range(n)]
        assert table.tolist() == want


@pytest.mark.parametrize("n", [65537, 2**18 + 1])
def test_epoch_is_a_permutation_for_2_pow_b_plus_1_records(n):
    """Grain's index_shuffle is not a permutation of 2**B + 1 indices (even B >= 16): index
    2**B is truncated to 0 and shares its record. Such a source served one record twice
    per epoch and never served another."""
    from grain.experimental import index_shuffle

    es = ix._epoch_seed(0, "web", 0)
    assert index_shuffle(n - 1, n - 1, es, 4) == index_shuffle(0, n - 1, es, 4)  # Grain's flaw
    for _ in range(2):  # first request: per-row path; second: the cached table
        got = ix.shuffled_records(np.arange(n), n, 0, "web", 0)
        np.testing.assert_array_equal(np.sort(got), np.arange(n))
    assert ix.shuffled_record(n - 1, n, 0, "web", 0) == int(got[n - 1])


def test_fast_path_checks_the_id_bytes_of_version_2_rows():
    """A version-2 row (document ids) one id byte short is refused by the loader's fast path
    with the codec's own message, naming the record."""
    good = codec.encode_row([np.array([5, 6, 7])], ["s/a:1"], [0], 8, "uint16", doc_ids=["https://x.org/1"])
    packed, tokens = ar.pack_records([good], 8, 2)
    assert tokens == 3 and packed[0, 0, :4].tolist() == [5, 6, 7, 0]
    with pytest.raises(loader.DatasetError, match=f"^record 1: record is {len(good) - 1} bytes, layout says "
                                                  f"{len(good)}$"):
        ar.pack_records([good, good[:-1]], 8, 2)


# ------------------------------------------------------------------ what to do next


def _mix_file(tmp_path, d):
    """The synthetic mixture written to a file (as a user's config is), the one the dataset records."""
    import yaml

    from contract.config import load_mixture

    m = dset.read_manifest(d)[0]
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(m.config))
    cfg = load_mixture(str(path))
    assert cfg.sha256() == m.config_sha256
    return cfg


def test_dataset_errors_end_with_what_to_do_next(ds, tmp_path):
    # Was: each message stopped at the fault ("does not reconcile: ...", "manifest_version 99, ...",
    # "shard ...: missing ...", "... unreadable: ..."), with no next step.
    d = copy_ds(ds, tmp_path)
    cfg = _mix_file(tmp_path, d)
    pack = f"python -m dataprep.pack --config {cfg.path} --output {d} --overwrite"

    def build_error(mixture=cfg) -> str:
        with pytest.raises(loader.DatasetError) as e:
            loader.build(mixture, d, global_batch=8)
        return str(e.value)

    path = os.path.join(d, SHARD_B1)
    orig = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(orig[:-10])
    assert build_error() == (
        f"shard {path}: {len(orig) - 10} bytes, manifest says {len(orig)} (truncated or altered)\nnext: restore the "
        f"shard {SHARD_B1} from the copy the dataset was written to, or rebuild the dataset: {pack}")
    os.remove(path)
    assert build_error() == (
        f"shard {path}: missing (manifest lists 8 records)\nnext: restore the shard {SHARD_B1} from the copy the "
        f"dataset was written to, or rebuild the dataset: {pack}")
    bad = bytearray(orig)
    bad[64] ^= 0x01  # the chunk of record 0 of the shard (source record 8): caught on the first read
    pathlib.Path(path).write_bytes(bytes(bad))
    data = loader.build(cfg, d, global_batch=8)
    steps = [s for s in range(12) if any(r.shard == SHARD_B1 and r.record_in_shard == 0 for r in data.rows_at(s))]
    it = data.iterate(steps[0])
    with pytest.raises(loader.DatasetError) as e:
        next(it)
    it.close()
    head, _, tail = str(e.value).partition("\nnext: ")
    assert head.startswith(f"reading {path}: record(s) in shard 0 (source record 8) unreadable: ")
    assert tail == f"restore the shard from the copy the dataset was written to, or rebuild the dataset: {pack}"
    pathlib.Path(path).write_bytes(orig)
    man = pathlib.Path(d, "manifest.json")
    good = man.read_text()
    edit_manifest(d, lambda m: m["sources"]["a"]["shards"][0].update(padding=m["sources"]["a"]["shards"][0]["padding"] + 1))
    assert build_error() == (
        f"{man}: does not reconcile: shard a/data-00000-of-00003.array_record: tokens + padding != records * seq_len"
        f"\nnext: restore manifest.json from the copy the dataset was written to, or rebuild the dataset: {pack}")
    man.write_text(good)
    edit_manifest(d, lambda m: m.update(manifest_version=99))
    assert build_error() == (
        f"{man}: manifest_version 99, this reader knows 1\nnext: a newer toolkit wrote this dataset: upgrade this one "
        f"(moe-data-toolkit, which reads manifest_version 1) to read it")
    man.write_text(good)
    other = lt.synthetic_mixture({"a": 0.3, "b": 0.6, "c": 0.1}, seq_len=SEQ * 2)
    assert build_error(other) == (
        f"{man}: seq_len {SEQ} != mixture seq_len {SEQ * 2}\nnext: give the dataset packed from this mixture config, "
        f"or pack one: python -m dataprep.pack --config <this mixture config> --output <new dataset folder>")
    os.remove(man)
    assert build_error() == (
        f"{man}: no manifest; the dataset is missing or was not committed\nnext: check the path (a committed dataset "
        f"folder holds manifest.json), or build the dataset: python -m dataprep.pack --config {cfg.path} --output {d}")
