"""Loader: datasets by URL (staged through Beam FileSystems), read modes, the host fast path.

URL datasets use the test-registered ``memfs://`` Beam file system (``dataprep.testing``),
the same code path as ``gs://`` minus the network.
"""

import hashlib
import os
import shutil

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loader
from contract import codec
from contract.manifest import MANIFEST_NAME
from dataprep.testing import MEMFS_FILES
from loader import arrays as ar
from loader import shards as sh
from loader import storage
from loader import testing as lt

from loader_storage_support import SEQ, VOCAB, mix


def batches(data, steps=range(6)):
    return [{k: np.asarray(v) for k, v in data.batch_at(s).items()} for s in steps]


def shard_urls(files):
    return sorted(u for u, rel in files.items() if rel != MANIFEST_NAME)


# ------------------------------------------------------------------ URL datasets


def test_url_dataset_staged_and_identical_to_local(local_ds, remote, tmp_path):
    url, files = remote
    cache = str(tmp_path / "cache")
    want = batches(loader.build(mix(), local_ds, global_batch=8))
    data = loader.build(mix(), url, global_batch=8, cache_dir=cache)
    got = batches(data)
    for w, g in zip(want, got):
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)
    # the cache folder is a complete, byte-identical dataset folder
    (folder,) = os.listdir(cache)
    assert folder == data.manifest_sha256[:16]
    for u, rel in files.items():
        with open(os.path.join(cache, folder, *rel.split("/")), "rb") as f:
            assert f.read() == MEMFS_FILES[u], rel
    assert not [f for _, _, fs in os.walk(cache) for f in fs if ".part-" in f]
    # the same manifest fingerprint as the local dataset: state saved on one resumes the other
    assert data.manifest_sha256 == loader.build(mix(), local_ds, global_batch=8).manifest_sha256


def test_url_dataset_second_build_reuses_the_cache(remote, tmp_path, monkeypatch):
    url, _ = remote
    cache = str(tmp_path / "cache")
    first = batches(loader.build(mix(), url, global_batch=8, cache_dir=cache), range(3))

    def no_copy(*a, **k):
        raise AssertionError("a cached shard was copied again")

    monkeypatch.setattr(storage, "_copy", no_copy)
    again = batches(loader.build(mix(), url, global_batch=8, cache_dir=cache, verify_sha256=True), range(3))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_url_dataset_cache_dir_from_environment(remote, tmp_path, monkeypatch):
    url, _ = remote
    monkeypatch.setenv(storage.DEFAULT_CACHE_ENV, str(tmp_path / "envcache"))
    data = loader.build(mix(), url, global_batch=8)
    assert data.source.shards.dataset.startswith(str(tmp_path / "envcache"))


def test_url_dataset_missing_shard_named_before_any_copy(remote, tmp_path):
    url, files = remote
    victim = shard_urls(files)[-1]
    del MEMFS_FILES[victim]
    cache = tmp_path / "cache"
    with pytest.raises(loader.DatasetError, match=rf"^shard {victim}: missing \(manifest lists \d+ records\)"):
        loader.build(mix(), url, global_batch=8, cache_dir=str(cache))
    assert not [f for _, _, fs in os.walk(cache) for f in fs]  # nothing copied


def test_url_dataset_truncated_shard_named_before_any_copy(remote, tmp_path):
    url, files = remote
    victim = shard_urls(files)[0]
    size = len(MEMFS_FILES[victim])
    MEMFS_FILES[victim] = MEMFS_FILES[victim][:-7]
    cache = tmp_path / "cache"
    with pytest.raises(loader.DatasetError,
                       match=rf"^shard {victim}: {size - 7} bytes, manifest says {size} \(truncated or altered\)$"):
        loader.build(mix(), url, global_batch=8, cache_dir=str(cache))
    assert not [f for _, _, fs in os.walk(cache) for f in fs]


def test_url_dataset_altered_shard_refused_and_nothing_left(remote, tmp_path):
    url, files = remote
    victim = shard_urls(files)[1]
    data = bytearray(MEMFS_FILES[victim])
    data[len(data) // 2] ^= 0x01  # same size, one bit
    MEMFS_FILES[victim] = bytes(data)
    cache = tmp_path / "cache"
    with pytest.raises(loader.DatasetError, match=rf"^shard {victim}: sha256 [0-9a-f]{{64}} != manifest [0-9a-f]{{64}} "
                                                  r"\(altered\)$"):
        loader.build(mix(), url, global_batch=8, cache_dir=str(cache))
    left = [os.path.relpath(os.path.join(r, f), cache) for r, _, fs in os.walk(cache) for f in fs]
    assert not [f for f in left if ".part-" in f]  # no half-copied file
    rel = files[victim]
    assert not [f for f in left if f.endswith(os.sep + rel.replace("/", os.sep)) or f.endswith(MANIFEST_NAME)]


def test_url_dataset_stale_cached_copy_recopied_with_verify(remote, tmp_path):
    url, files = remote
    cache = str(tmp_path / "cache")
    data = loader.build(mix(), url, global_batch=8, cache_dir=cache)
    want = batches(data, range(4))
    rel = files[shard_urls(files)[0]]
    path = os.path.join(data.source.shards.dataset, *rel.split("/"))
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(blob))
    again = loader.build(mix(), url, global_batch=8, cache_dir=cache, verify_sha256=True)
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == hashlib.sha256(MEMFS_FILES[shard_urls(files)[0]]).hexdigest()
    for a, b in zip(want, batches(again, range(4))):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_url_dataset_refused_when_the_cache_has_no_room(remote, tmp_path, monkeypatch):
    url, files = remote
    total = sum(len(MEMFS_FILES[u]) for u in shard_urls(files))
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, total - 1))
    cache = tmp_path / "cache"
    with pytest.raises(loader.DatasetError) as e:
        loader.build(mix(), url, global_batch=8, cache_dir=str(cache))
    msg = str(e.value)
    assert msg.startswith(f"staging {url}: {len(shard_urls(files))} shard(s), ") and "GiB free" in msg
    assert "gcsfuse" in msg
    assert not [f for _, _, fs in os.walk(cache) for f in fs]


def test_url_dataset_without_manifest(tmp_path):
    with pytest.raises(loader.DatasetError, match=r"^memfs://bucket/nothing/manifest.json: no manifest"):
        loader.build(mix(), "memfs://bucket/nothing", global_batch=8, cache_dir=str(tmp_path))


def test_url_with_unknown_scheme_is_a_dataset_error(tmp_path):
    with pytest.raises(loader.DatasetError, match=r"^nosuchfs://b/ds/manifest.json: cannot read"):
        loader.build(mix(), "nosuchfs://b/ds", global_batch=8, cache_dir=str(tmp_path))


def test_is_url():
    assert storage.is_url("gs://b/x") and storage.is_url("s3://b") and storage.is_url("memfs://x")
    assert not storage.is_url("/data/x") and not storage.is_url("data/gs://x") and not storage.is_url("file:///x")


# ------------------------------------------------------------------ read modes


@pytest.mark.parametrize("mode", ["records", "batched"])
def test_read_modes_give_identical_batches(local_ds, mode):
    ref = batches(loader.build(mix(), local_ds, global_batch=8, read_mode="batched"), range(12))
    data = loader.build(mix(), local_ds, global_batch=8, read_mode=mode)
    assert data.source.shards.read_mode == mode
    for a, b in zip(ref, batches(data, range(12))):
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    it = data.iterate(3)  # and through the prefetch threads
    for step in range(3, 6):
        s, batch = next(it)
        assert s == step
        np.testing.assert_array_equal(np.asarray(batch["inputs"]), ref[step]["inputs"])
    it.close()


@pytest.mark.parametrize("mode", ["records", "batched"])
def test_read_located_keeps_the_given_order(local_ds, mode):
    """Records mode reads in the given order, batched mode in (source, shard) groups put back in
    order: either way record ``i`` of the answer is the ``i``-th asked for, repeats included."""
    from array_record.python.array_record_module import ArrayRecordReader

    shards = loader.build(mix(), local_ds, global_batch=8, read_mode=mode).source.shards
    rng = np.random.default_rng(7)
    source = rng.integers(0, len(shards.shards), 30)
    record = np.array([rng.integers(0, int(shards.offsets[k][-1])) for k in source.tolist()])
    record[5], source[5] = record[2], source[2]  # a repeat
    shard, in_shard = shards.locate(source, record)
    got = shards.read_located(source, record, shard, in_shard)
    want = []
    for k, s, i in zip(source.tolist(), shard.tolist(), in_shard.tolist()):
        r = ArrayRecordReader(shards.path(k, s))
        want.append(r.read([i])[0])
        r.close()
    assert got == want and len(set(zip(source.tolist(), shard.tolist()))) > 2


def test_read_mode_auto_follows_the_file_system(local_ds, monkeypatch):
    assert loader.build(mix(), local_ds, global_batch=8).source.shards.read_mode in ("records", "batched")
    for fstype, want in (("ext4", "records"), ("tmpfs", "records"), ("overlay", "records"), (None, "records"),
                         ("fuse.gcsfuse", "batched"), ("fuse", "batched"), ("nfs4", "batched"), ("lustre", "batched")):
        monkeypatch.setattr(sh, "filesystem_type", lambda p, t=fstype: t)
        assert sh.resolve_read_mode("auto", local_ds) == want, fstype
        assert loader.build(mix(), local_ds, global_batch=8).source.shards.read_mode == want
    assert sh.resolve_read_mode("records", "/x") == "records"


def test_filesystem_type_of_a_real_path(tmp_path):
    if not os.path.exists("/proc/self/mounts"):
        pytest.skip("no /proc/self/mounts on this system")
    assert sh.filesystem_type(str(tmp_path))  # some mount holds every path ("/" at least)


def test_unknown_read_mode_refused_before_any_work(tmp_path):
    with pytest.raises(loader.LoaderConfigError, match=r"read_mode must be one of \('auto', 'records', 'batched'\)"):
        loader.build(mix(), str(tmp_path / "does-not-exist"), global_batch=8, read_mode="mmap")


def test_damaged_record_named_in_both_read_modes(tmp_path):
    """A record whose bytes are damaged is named (shard and record) whichever way it is read."""
    path = str(tmp_path / "ds")
    lt.write_synthetic_dataset(path, {"a": 12}, SEQ, shards_per_source=1, vocab_size=VOCAB)
    m = lt.synthetic_mixture({"a": 1.0}, seq_len=SEQ)
    for mode in ("records", "batched"):
        data = loader.build(m, path, global_batch=8, read_mode=mode)
        refs = data.rows_at(0)
        bad = refs[0]
        # replace the record with garbage of the same length through the ShardSet's own readers
        orig = data.source.shards.read_located

        def damaged(source, record, shard, in_shard, _orig=orig, _bad=bad):
            out = _orig(source, record, shard, in_shard)
            return [b"JUNK" + d[4:] if int(r) == _bad.record else d for d, r in zip(out, record)]

        data.source.shards.read_located = damaged
        with pytest.raises(loader.DatasetError, match=rf"^a record {bad.record} \(shard .*{bad.shard} record "
                                                      rf"{bad.record_in_shard}\): "):
            data.batch_at(0)


def test_shardset_pickles_its_read_mode(local_ds):
    import pickle

    shards = loader.build(mix(), local_ds, global_batch=8, read_mode="batched").source.shards
    copy = pickle.loads(pickle.dumps(shards))
    assert copy.read_mode == "batched" and copy.dataset == shards.dataset
    with pytest.raises(ValueError, match="read_mode must be 'records' or 'batched'"):
        sh.ShardSet("x", [], [], read_mode="auto")


# ------------------------------------------------------------------ host fast path


def test_aligned_empty():
    for shape, dtype in (((6, 3, 5), np.int32), ((7,), np.uint16), ((0, 4), np.int32)):
        a = ar.aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % 64 == 0


def test_six_arrays_are_one_aligned_block(local_ds):
    data = loader.build(mix(), local_ds, global_batch=8)
    host = data.source.six(0)
    for k in loader.BATCH_KEYS:
        assert host[k].ctypes.data % 64 == 0, k  # row blocks of every device start aligned


def _encode(rows, L, dtype, rng):
    recs = []
    for lens in rows:
        lens = list(lens)
        while sum(lens) > L:
            lens.pop()
        hi = 2**31 - 1 if dtype == "uint32" else 60000
        segs = [rng.integers(1, hi, x, dtype=np.int64) for x in lens]
        recs.append(codec.encode_row(segs, [f"k{i}" for i in range(len(segs))], [0] * len(segs), L, dtype))
    return recs


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=4), min_size=0, max_size=6),
    widths=st.lists(st.sampled_from(["uint16", "uint32"]), min_size=6, max_size=6),
    L=st.integers(1, 40), pad=st.sampled_from([0, 1, 65535, 70000]), seed=st.integers(0, 2**16),
)
def test_pack_records_any_width_and_padding(rows, widths, L, pad, seed):
    """The six-array fast path equals decode + dense arrays for uint16, uint32 and mixed-width
    records (``token_width=None``) and for any pad id, including one wider than uint16."""
    rng = np.random.default_rng(seed)
    recs = []
    for i, lens in enumerate(rows):
        recs += _encode([lens], L, widths[i], rng)
    ref = lt.derive_batch(*lt.pack_inputs(ar.decode_all(recs), L, pad))
    six, tokens = ar.pack_records(recs, L, None, pad, six=True)
    assert tokens == sum(codec.decode_row(r).num_tokens for r in recs)
    for k in loader.BATCH_KEYS:
        np.testing.assert_array_equal(six[k], ref[k], err_msg=k)
    packed, _ = ar.pack_records(recs, L, None, pad, np.int32)
    np.testing.assert_array_equal(packed[:, 0], ref["inputs"])
    np.testing.assert_array_equal(packed[:, 1], ref["inputs_segmentation"])
    np.testing.assert_array_equal(packed[:, 2], ref["inputs_position"])
    if all(w == "uint32" for w in widths[: len(rows)]):
        six4, _ = ar.pack_records(recs, L, 4, pad, six=True)
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(six4[k], ref[k], err_msg=k)


def test_full_rows_and_single_segment_rows_exact():
    """Rows filled to the last slot, one document each or many: exact arrays, worked by hand."""
    L = 6
    recs = [codec.encode_row([np.array([5, 6, 7, 8, 9, 10])], ["d0"], [0], L, "uint16"),
            codec.encode_row([np.array([1, 2]), np.array([3]), np.array([4, 5, 6])], ["x", "y", "z"], [0, 0, 0], L,
                             "uint16"),
            codec.encode_row([np.array([7, 8])], ["p"], [0], L, "uint16")]
    six, tokens = ar.pack_records(recs, L, 2, 0, six=True)
    assert tokens == 6 + 6 + 2
    np.testing.assert_array_equal(six["inputs"], [[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0]])
    np.testing.assert_array_equal(six["targets"], [[6, 7, 8, 9, 10, 0], [2, 0, 0, 5, 6, 0], [8, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(six["inputs_segmentation"], [[1] * 6, [1, 1, 2, 3, 3, 3], [1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(six["targets_segmentation"], [[1] * 5 + [0], [1, 0, 0, 3, 3, 0], [1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(six["inputs_position"], [[0, 1, 2, 3, 4, 5], [0, 1, 0, 0, 1, 2], [0, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(six["targets_position"], [[0, 1, 2, 3, 4, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]])


def test_runs_of_segments_and_padding_exact():
    """The worked example of ``loader.arrays._ids_and_positions`` (segments of 3 and 2 tokens in 7
    slots), a row with no segment and a full one, with a pad id that is not 0: every value by hand."""
    L, pad = 7, 9
    recs = [codec.encode_row([np.array([1, 2, 3]), np.array([4, 5])], ["a", "b"], [0, 0], L, "uint16"),
            codec.encode_row([], [], [], L, "uint16"),
            codec.encode_row([np.arange(10, 17)], ["c"], [0], L, "uint16")]
    six, tokens = ar.pack_records(recs, L, 2, pad, six=True)
    assert tokens == 5 + 0 + 7
    assert six["inputs"].tolist() == [[1, 2, 3, 4, 5, 9, 9], [9] * 7, list(range(10, 17))]
    assert six["targets"].tolist() == [[2, 3, 0, 5, 0, 0, 0], [0] * 7, list(range(11, 17)) + [0]]
    assert six["inputs_segmentation"].tolist() == [[1, 1, 1, 2, 2, 0, 0], [0] * 7, [1] * 7]
    assert six["targets_segmentation"].tolist() == [[1, 1, 0, 2, 0, 0, 0], [0] * 7, [1] * 6 + [0]]
    assert six["inputs_position"].tolist() == [[0, 1, 2, 0, 1, 0, 0], [0] * 7, list(range(7))]
    assert six["targets_position"].tolist() == [[0, 1, 0, 0, 0, 0, 0], [0] * 7, list(range(6)) + [0]]
    packed, _ = ar.pack_records(recs, L, 2, pad, np.uint16)
    for j, k in enumerate(("inputs", "inputs_segmentation", "inputs_position")):
        assert packed[:, j].tolist() == six[k].tolist()


def test_cpu_batches_use_the_host_path(local_ds):
    data = loader.build(mix(), local_ds, global_batch=8)
    assert all(d.platform == "cpu" for d in jax.devices()) and data._host_derive  # noqa: SLF001


def test_aligned_pool_reuses_only_unreferenced_blocks():
    pool = ar.AlignedPool(keep=2)
    a = pool.take((4, 16))
    first = a.ctypes.data
    b = pool.take((4, 16))
    assert b.ctypes.data != first  # a is alive
    del a
    c = pool.take((4, 16))
    assert c.ctypes.data == first  # reused once nothing refers to it
    view = c[1:2]
    del c
    assert pool.take((4, 16)).ctypes.data != first  # a view keeps it
    del view, b
    held = [pool.take((4, 16)) for _ in range(6)]
    del held
    pool.take((4, 16))
    assert len(pool._blocks) <= 3  # noqa: SLF001 - idle blocks beyond keep are dropped


def test_batches_held_by_the_trainer_stay_intact(local_ds):
    """The CPU devices alias the host block of a batch; later steps must never overwrite it."""
    data = loader.build(mix(), local_ds, global_batch=8)
    held = {s: data.batch_at(s) for s in range(3)}
    copies = {s: {k: np.asarray(v).copy() for k, v in b.items()} for s, b in held.items()}
    for s in range(3, 30):
        data.batch_at(s)
    it = data.iterate(0)
    kept = [next(it) for _ in range(4)]
    for _ in range(20):
        next(it)
    it.close()
    for s, b in held.items():
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(b[k]), copies[s][k], err_msg=f"step {s} {k}")
    for s, b in kept:
        for k in loader.BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(b[k]), copies[s][k] if s in copies else
                                          np.asarray(data.batch_at(s)[k]), err_msg=f"step {s} {k}")
