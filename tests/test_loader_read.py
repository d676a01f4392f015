"""Loader reading: open-and-check faults, batch contents, targets, sharding, epochs, hosts, real data."""

import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import unicodedata

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import loader
from contract import codec
from loader import index as ix
from loader import testing as lt
from loader.testing import pack_inputs
from loader.source import StepSource, unpack

SEQ = 16
VOCAB = 1000


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds") / "synthetic")
    lt.write_synthetic_dataset(path, {"a": 10, "b": 23, "c": 2}, SEQ, shards_per_source=3, vocab_size=VOCAB)
    return path


def mix(**kw):
    return lt.synthetic_mixture(kw.pop("weights", {"a": 0.3, "b": 0.6, "c": 0.1}), seq_len=SEQ, **kw)


def expected_dense(ref, sources=("a", "b", "c")):
    si = sorted(sources).index(ref.source)
    segs, keys, chunks = lt.synthetic_row(ref.source, si, ref.record, seq_len=SEQ, vocab_size=VOCAB, seed=0)
    row = codec.decode_row(codec.encode_row(segs, keys, chunks, SEQ, "uint16"))
    return codec.dense_row(row)


def test_batch_matches_stored_rows_exactly(ds):
    data = loader.build(mix(), ds, global_batch=8)
    for step in (0, 3, 17):
        batch = data.batch_at(step)
        assert set(batch) == set(loader.BATCH_KEYS)
        for v in batch.values():
            assert v.shape == (8, SEQ) and v.dtype == np.int32
            assert v.sharding == data.sharding
        refs = data.rows_at(step)
        inputs = np.asarray(batch["inputs"])
        seg = np.asarray(batch["inputs_segmentation"])
        pos = np.asarray(batch["inputs_position"])
        for i, ref in enumerate(refs):
            tok, s, p = expected_dense(ref)
            np.testing.assert_array_equal(inputs[i], tok)
            np.testing.assert_array_equal(seg[i], s)
            np.testing.assert_array_equal(pos[i], p)
            assert lt.row_origin(inputs[i], ["a", "b", "c"], VOCAB) == (ref.source, ref.record)
        stored = data.read_rows(step)
        assert [r.doc_keys for r in stored] == [
            tuple(lt.synthetic_row(r.source, sorted("abc").index(r.source), r.record, seq_len=SEQ,
                                   vocab_size=VOCAB, seed=0)[1]) for r in refs
        ]


def test_targets_never_cross_a_document():
    """A row packed from two documents: every (input, target) pair comes from one document."""
    doc1, doc2 = [11, 12, 13, 14], [21, 22, 23]
    row = codec.decode_row(codec.encode_row([doc1, doc2], ["s/x:1", "s/x:2"], [0, 0], 10, "uint16"))
    b = lt.dense_batch([row], 10)
    assert b["inputs"][0].tolist() == [11, 12, 13, 14, 21, 22, 23, 0, 0, 0]
    assert b["targets"][0].tolist() == [12, 13, 14, 0, 22, 23, 0, 0, 0, 0]
    assert b["inputs_segmentation"][0].tolist() == [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]
    assert b["targets_segmentation"][0].tolist() == [1, 1, 1, 0, 2, 2, 0, 0, 0, 0]
    assert b["inputs_position"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 0, 0]
    assert b["targets_position"][0].tolist() == [0, 1, 2, 0, 0, 1, 0, 0, 0, 0]
    doc_of = {t: 1 for t in doc1} | {t: 2 for t in doc2}
    for x, y, ts in zip(b["inputs"][0], b["targets"][0], b["targets_segmentation"][0]):
        if ts:
            assert doc_of[int(x)] == doc_of[int(y)] == ts


def test_targets_on_real_batch(ds):
    data = loader.build(mix(), ds, global_batch=8)
    b = {k: np.asarray(v) for k, v in data.batch_at(5).items()}
    valid = b["targets_segmentation"] != 0
    assert np.all(b["targets"][:, :-1][valid[:, :-1]] == b["inputs"][:, 1:][valid[:, :-1]])
    assert np.all(b["inputs_segmentation"][:, 1:][valid[:, :-1]] == b["targets_segmentation"][:, :-1][valid[:, :-1]])
    assert np.all(b["targets"][~valid] == 0) and not valid[:, -1].any()
    assert np.all(b["targets_segmentation"][b["inputs_segmentation"] == 0] == 0)


def test_context_axis_mesh_gives_same_batch(ds):
    devs = np.asarray(jax.devices()[:8]).reshape(4, 2)
    mesh = Mesh(devs, ("data", "context"))
    a = loader.build(mix(), ds, global_batch=8, mesh=mesh, context_axis="context")
    b = loader.build(mix(), ds, global_batch=8)
    ba, bb = a.batch_at(7), b.batch_at(7)
    host = lt.dense_batch(a.read_rows(7), SEQ)  # numpy reference of the device-side derivation
    for k in loader.BATCH_KEYS:
        np.testing.assert_array_equal(np.asarray(ba[k]), host[k])
        np.testing.assert_array_equal(np.asarray(ba[k]), np.asarray(bb[k]))
        shard_shapes = {s.data.shape for s in ba[k].addressable_shards}
        assert shard_shapes == {(2, SEQ // 2)}


def test_epoch_boundaries_one_compilation(tmp_path):
    """10 rows, global batch 4, 3 epochs: every batch (4, seq_len), one compilation."""
    path = str(tmp_path / "ten")
    lt.write_synthetic_dataset(path, {"only": 10}, SEQ, shards_per_source=2, vocab_size=VOCAB)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    data = loader.build(lt.synthetic_mixture({"only": 1.0}, seq_len=SEQ), path, global_batch=4, mesh=mesh)
    traces = []

    @jax.jit
    def step_fn(batch):
        traces.append(1)
        return (batch["inputs"] * (batch["targets_segmentation"] > 0)).sum()

    seen = []
    it = data.iterate(0)
    for _ in range(8):  # 32 rows > 3 epochs of 10
        _, batch = next(it)
        assert batch["inputs"].shape == (4, SEQ)
        step_fn(batch).block_until_ready()
        seen += [lt.row_origin(r, ["only"], VOCAB)[1] for r in np.asarray(batch["inputs"])]
    it.close()
    assert len(traces) == 1
    for e in range(3):
        assert sorted(seen[10 * e: 10 * (e + 1)]) == list(range(10))
    assert seen[:10] != seen[10:20]  # reshuffled per epoch


@pytest.mark.parametrize("hosts", [1, 2, 3, 4])
def test_simulated_hosts_disjoint_and_complete(ds, hosts):
    """Fewer shards (3) than some host counts; each host reads only its rows."""
    B = 12
    data = loader.build(mix(), ds, global_batch=B, mesh=Mesh(np.asarray(jax.devices()[:4]), ("data",)))
    host_sources = [
        StepSource(data.schedule, data.source.shards, np.asarray(ix.host_rows(B, hosts, h)), SEQ)
        for h in range(hosts)
    ]
    for step in range(4):
        full = data.host_batch(step)
        parts = [h(step) for h in host_sources]
        assert all(p["packed"].shape == (B // hosts, 3, SEQ) for p in parts)
        np.testing.assert_array_equal(np.concatenate([unpack(p)[0] for p in parts]), full["inputs"])


def copy_ds(ds, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(ds, dst)
    return dst


def test_fault_missing_manifest(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(loader.DatasetError, match="no manifest"):
        loader.build(mix(), str(tmp_path / "empty"), global_batch=8)


def test_fault_truncated_shard_named(ds, tmp_path):
    d = copy_ds(ds, tmp_path)
    shard = os.path.join(d, "b", "data-00001-of-00003.array_record")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    with pytest.raises(loader.DatasetError, match="b/data-00001-of-00003.array_record.*truncated"):
        loader.build(mix(), d, global_batch=8)


def test_fault_missing_shard_named(ds, tmp_path):
    d = copy_ds(ds, tmp_path)
    os.remove(os.path.join(d, "a", "data-00002-of-00003.array_record"))
    with pytest.raises(loader.DatasetError, match="a/data-00002-of-00003.array_record: missing"):
        loader.build(mix(), d, global_batch=8)


def test_fault_altered_shard_caught_by_sha256(ds, tmp_path):
    d = copy_ds(ds, tmp_path)
    shard = os.path.join(d, "a", "data-00000-of-00003.array_record")
    data = bytearray(pathlib.Path(shard).read_bytes())
    data[40] ^= 0xFF
    pathlib.Path(shard).write_bytes(bytes(data))
    with pytest.raises(loader.DatasetError, match="a/data-00000-of-00003.array_record: sha256"):
        loader.build(mix(), d, global_batch=8, verify_sha256=True)


def test_fault_record_count_mismatch(ds, tmp_path):
    d = copy_ds(ds, tmp_path)
    man = json.loads(pathlib.Path(d, "manifest.json").read_text())
    sh = man["sources"]["c"]["shards"][0]
    other = os.path.join(d, "b", "data-00000-of-00003.array_record")
    shutil.copy(other, os.path.join(d, sh["path"]))
    sh["bytes"] = os.path.getsize(other)
    pathlib.Path(d, "manifest.json").write_text(json.dumps(man))
    with pytest.raises(loader.DatasetError, match="c/data-00000-of-00003.array_record: 8 records, manifest says 1"):
        loader.build(mix(), d, global_batch=8)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(record_format_version=3), "record format version 3, this loader reads 1 and 2"),
        (lambda m: m.pop("sources"), "missing field 'sources'"),
        (lambda m: m["sources"]["a"]["ledger"].update(read=99), "does not reconcile"),
    ],
)
def test_fault_manifest_disagrees(ds, tmp_path, edit, message):
    d = copy_ds(ds, tmp_path)
    man = json.loads(pathlib.Path(d, "manifest.json").read_text())
    edit(man)
    pathlib.Path(d, "manifest.json").write_text(json.dumps(man))
    with pytest.raises(loader.DatasetError, match=message):
        loader.build(mix(), d, global_batch=8)


def test_fault_seq_len_disagrees(ds):
    with pytest.raises(loader.DatasetError, match="seq_len 16 != mixture seq_len 32"):
        loader.build(lt.synthetic_mixture({"a": 1.0}, seq_len=32), ds, global_batch=8)


def test_fault_tokenizer_file_differs(ds, tmp_path):
    """An unpinned mixture whose tokenizer file exists must name the model the dataset was packed with."""
    model = tmp_path / "tok" / "tokenizer.model"
    model.parent.mkdir()
    model.write_bytes(b"another model")
    other = lt.synthetic_mixture({"a": 1.0}, seq_len=SEQ, root=str(tmp_path / "tok"))
    with pytest.raises(loader.DatasetError, match="tokenizer.*has sha256"):
        loader.build(other, ds, global_batch=8)


def test_fault_tokenizer_pin(ds):
    with pytest.raises(loader.DatasetError, match="tokenizer sha256"):
        loader.build(mix(tokenizer_sha256="0" * 64), ds, global_batch=8)
    ok = mix(tokenizer_sha256=lt.synthetic_tokenizer_sha256(VOCAB))
    loader.build(ok, ds, global_batch=8)


def test_bad_arguments(ds):
    with pytest.raises(loader.LoaderConfigError, match="multiple of the data axes"):
        loader.build(mix(), ds, global_batch=6)
    with pytest.raises(loader.LoaderConfigError, match="'model' not in the mesh"):
        loader.build(mix(), ds, global_batch=8, data_axes=("model",))
    with pytest.raises(loader.LoaderConfigError, match="prefetch"):
        loader.build(mix(), ds, global_batch=8, prefetch=-1)
    with pytest.raises(loader.DatasetError, match=r"sources \['zzz'\]"):
        loader.build(lt.synthetic_mixture({"a": 1, "zzz": 1}, seq_len=SEQ), ds, global_batch=8)


def _norm(text):
    return " ".join(unicodedata.normalize("NFKC", text).split())


def _source_documents(shared):
    """Document key -> text, read independently of dataprep (whole text files, JSONL lines)."""
    # "utf-8-sig": a byte order mark is not text of the document (dataprep drops it too)
    docs = {"books/botchan.txt:0": (shared / "corpora" / "books" / "botchan.txt").read_bytes().decode("utf-8-sig")}
    for f in sorted((shared / "corpora" / "web").glob("*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8-sig") as lines:
            for n, line in enumerate(lines, start=1):
                docs[f"web/{f.name}:{n}"] = json.loads(line)["text"]
    return docs


def test_real_corpora(shared_dir, tmp_path):
    """Shards packed from ../shared/corpora (by dataprep) load, and decoding a batch gives back
    text of the source documents."""
    if importlib.util.find_spec("dataprep") is None:
        pytest.skip("the dataprep package is not importable; cannot pack ../shared/corpora")
    import sentencepiece as spm
    import yaml

    from dataprep import pack

    tok = shared_dir / "tokenizers" / "en_unigram_1000.model"
    cfg = {
        "name": "shared", "version": 1, "seq_len": 256, "seed": 0, "shards_per_source": 2,
        "tokenizer": {"path": str(tok), "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()},
        "sources": [
            {"name": "books", "paths": [str(shared_dir / "corpora/books/*.txt")], "format": "text",
             "weight": 0.5},
            {"name": "web", "paths": [str(shared_dir / "corpora/web/*.jsonl.gz")], "format": "jsonl.gz",
             "weight": 0.5},
        ],
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(cfg))
    pack.run(["--config", str(tmp_path / "m.yaml"), "--output", str(tmp_path / "ds"), "--quiet"])
    data = loader.build(str(tmp_path / "m.yaml"), str(tmp_path / "ds"), global_batch=8, verify_sha256=True)
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    docs = _source_documents(shared_dir)
    batch = data.batch_at(3)
    inputs, seg = np.asarray(batch["inputs"]), np.asarray(batch["inputs_segmentation"])
    rows = data.read_rows(3)
    checked = set()
    for i, row in enumerate(rows):
        for j, (key, chunk) in enumerate(zip(row.doc_keys, row.chunk_indices)):
            tokens = inputs[i][seg[i] == j + 1].tolist()
            doc_ids = sp.encode(docs[key]) + [sp.eos_id()]  # the config's add_eos default
            start = int(chunk) * data.seq_len
            assert tokens == doc_ids[start: start + len(tokens)], key
            # and the decoded text is text of the document: its longest run without an
            # unknown piece, less a possibly cut first and last word
            run = max(sp.decode(tokens).split("⁇"), key=len).split()[1:-1]
            if len(run) >= 2:
                assert " ".join(run) in _norm(docs[key])
            checked.add(key.split("/")[0])
    assert checked == {"books", "web"}


row_st = st.integers(1, 24).flatmap(
    lambda L: st.tuples(
        st.just(L),
        st.lists(st.lists(st.integers(1, 60000), min_size=1, max_size=L), max_size=5).filter(
            lambda segs: sum(map(len, segs)) <= L),
    )
)


@settings(max_examples=150, deadline=None)
@given(st.lists(row_st.map(lambda t: t[1]), min_size=1, max_size=6), st.integers(24, 30), st.booleans())
def test_pack_inputs_matches_codec(segments_per_row, L, narrow):
    """Vectorized tokens/segment ids/positions equal contract.codec's per-row reference."""
    rows = [
        codec.decode_row(codec.encode_row(segs, [f"s/x:{i}" for i in range(len(segs))], [0] * len(segs), L, "uint16"))
        for segs in segments_per_row
    ]
    dtypes = ("uint16", "int16") if narrow else ("int32", "int32")
    inputs, seg, pos = pack_inputs(rows, L, 0, *dtypes)
    for i, row in enumerate(rows):
        tok, s, p = codec.dense_row(row)
        assert inputs[i].tolist() == tok.tolist()
        assert seg[i].tolist() == s.tolist()
        assert pos[i].tolist() == p.tolist()
    # positions derived from the ids alone agree with the host's running sums
    given_pos = lt.derive_batch(*(x.astype(np.int32) for x in (inputs, seg, pos)))
    from_ids = lt.derive_batch(inputs.astype(np.int32), seg.astype(np.int32))
    for k in loader.BATCH_KEYS:
        np.testing.assert_array_equal(given_pos[k], from_ids[k])


def test_device_derivation_has_no_collectives():
    """The targets program launched from the prefetch thread must not communicate."""
    from loader.device import make_derive

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "expert"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert"), None))
    packed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert"), None, None))
    hlo = make_derive(sharding, packed).lower(jax.ShapeDtypeStruct((16, 3, 32), np.uint16)).compile().as_text()
    for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        assert op not in hlo


def test_shard_lost_mid_run_raises_in_the_trainer_thread(ds, tmp_path):
    """A fault after build surfaces from iterate() as a DatasetError naming the shard (no hang)."""
    d = copy_ds(ds, tmp_path)
    data = loader.build(mix(), d, global_batch=8)
    for name in ("a", "b", "c"):
        for k in range(3):
            os.remove(os.path.join(d, name, f"data-{k:05d}-of-00003.array_record"))
    it = data.iterate(0)
    with pytest.raises(loader.DatasetError, match=r"data-0000\d-of-00003.array_record"):
        next(it)
    it.close()
