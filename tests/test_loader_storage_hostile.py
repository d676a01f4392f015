"""Hostile use of datasets by URL, staging and the read path: each test pins a fault found by
breaking ``loader.storage`` / ``loader.dataset`` on purpose (shard paths that leave the
dataset folder, caches that are not folders, killed copies, glob characters in URLs, tokens
that do not fit int32, stacked mounts), with the exact error or value now expected."""

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import time

import numpy as np
import pytest

import loader
from contract import codec
from contract.manifest import MANIFEST_NAME
from dataprep.testing import MEMFS_FILES
from loader import arrays as ar
from loader import dataset as dset
from loader import shards as sh
from loader import storage

from loader_storage_support import mix, upload

SHARD_A0 = "a/data-00000-of-00003.array_record"


def files_under(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


def edit_remote_manifest(url: str, edit) -> None:
    man = json.loads(MEMFS_FILES[f"{url}/{MANIFEST_NAME}"])
    edit(man)
    MEMFS_FILES[f"{url}/{MANIFEST_NAME}"] = json.dumps(man).encode()


def first_batches(data, steps=3):
    return [np.asarray(data.batch_at(s)["inputs"]) for s in range(steps)]


# ------------------------------------------------------------------ shard paths


@pytest.mark.parametrize("bad, why", [
    ("../outside/x.array_record", "is not a plain relative path (empty, '.' or '..' part)"),
    ("/abs/x.array_record", "is absolute"),
    ("a//data-00000-of-00003.array_record", "is not a plain relative path (empty, '.' or '..' part)"),
    ("./a/data-00000-of-00003.array_record", "is not a plain relative path (empty, '.' or '..' part)"),
])
def test_local_shard_path_leaving_the_dataset_folder_refused(local_ds, tmp_path, bad, why):
    """A manifest naming ``../x`` or ``/x`` used to make the loader open files outside the
    dataset folder (any file of the right size that opens as ArrayRecord was served)."""
    ds = str(tmp_path / "ds")
    shutil.copytree(local_ds, ds)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(os.path.join(ds, SHARD_A0), outside / "x.array_record")
    path = os.path.join(ds, MANIFEST_NAME)
    man = json.load(open(path))
    man["sources"]["a"]["shards"][0]["path"] = bad.replace("/abs", str(outside)) if bad.startswith("/abs") else bad
    json.dump(man, open(path, "w"))
    shown = man["sources"]["a"]["shards"][0]["path"]
    with pytest.raises(loader.DatasetError, match="^" + re.escape(f"{path}: shard path {shown!r} {why}\n" + _restore(ds))
                       + "$"):
        loader.build(mix(), ds, global_batch=8)


def _restore(ds):
    return (f"next: restore manifest.json from the copy the dataset was written to, or rebuild the dataset: python -m "
            f"dataprep.pack --config <the mixture config of 'synthetic' version 1> --output {ds} --overwrite")


def test_url_shard_path_with_dotdot_never_written_outside_the_cache(remote, tmp_path):
    """An object literally named ``<dataset>/../../evil`` (legal on object stores) listed as a
    shard used to be staged to ``<cache>/<sha>/../../evil``: outside the cache folder."""
    url, files = remote
    MEMFS_FILES[f"{url}/../../evil.array_record"] = MEMFS_FILES.pop(f"{url}/{SHARD_A0}")
    edit_remote_manifest(url, lambda m: m["sources"]["a"]["shards"][0].update(path="../../evil.array_record"))
    cache = tmp_path / "c" / "cache"
    with pytest.raises(loader.DatasetError, match=rf"^{url}/manifest.json: shard path '\.\./\.\./evil.array_record' "
                                                  r"is not a plain relative path"):
        loader.build(mix(), url, global_batch=8, cache_dir=str(cache))
    assert files_under(tmp_path) == []


def test_stage_itself_refuses_a_shard_path_leaving_the_cache(remote, tmp_path):
    url, _ = remote
    manifest, sha, raw = dset._load_manifest(url)  # noqa: SLF001
    a = manifest.sources["a"]
    bad = dataclasses.replace(a.shards[0], path="../../evil.array_record")
    sources = {**manifest.sources, "a": dataclasses.replace(a, shards=(bad, *a.shards[1:]))}
    manifest = dataclasses.replace(manifest, sources=sources)
    with pytest.raises(storage.StagingError, match=rf"^{url}/manifest.json: shard path '\.\./\.\./evil.array_record' "
                                                   r"is not a plain relative path \(empty, '\.' or '\.\.' part\)$"):
        storage.stage(url, manifest, raw, sha, ["a"], str(tmp_path / "c" / "cache"))
    assert files_under(tmp_path) == []


def test_shard_listed_twice_refused(local_ds, tmp_path):
    """The same shard listed twice (ledger made to agree) used to be read twice: its rows
    doubled in the mixture."""
    ds = str(tmp_path / "ds")
    shutil.copytree(local_ds, ds)
    path = os.path.join(ds, MANIFEST_NAME)
    man = json.load(open(path))
    b = man["sources"]["b"]
    b["shards"][1] = dict(b["shards"][0])
    docs, toks = sum(s["documents"] for s in b["shards"]), sum(s["tokens"] for s in b["shards"])
    b["ledger"].update(read=docs + sum(b["ledger"]["rejected"].values()), packed=docs, tokens_in=toks,
                       tokens_packed=toks)
    json.dump(man, open(path, "w"))
    with pytest.raises(loader.DatasetError, match=rf"^{path}: shard path 'b/data-00000-of-00003.array_record' is "
                                                  r"listed twice \(sources 'b' and 'b'\)\n" + re.escape(_restore(ds)) + "$"):
        loader.build(mix(), ds, global_batch=8)


# ------------------------------------------------------------------ the cache folder


def test_cache_dir_that_is_a_file_is_a_dataset_error(remote, tmp_path):
    url, _ = remote
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    with pytest.raises(loader.DatasetError, match=rf"^staging {url}: cannot use the cache folder {cache}/[0-9a-f]{{16}}: "
                                                  r"Not a directory$"):
        loader.build(mix(), url, global_batch=8, cache_dir=str(cache))
    assert cache.read_text() == "not a folder"


def test_cache_source_folder_that_is_a_file_is_a_dataset_error(remote, tmp_path):
    url, _ = remote
    cache = str(tmp_path / "cache")
    local = loader.build(mix(), url, global_batch=8, cache_dir=cache).source.shards.dataset
    shutil.rmtree(os.path.join(local, "a"))
    open(os.path.join(local, "a"), "w").close()
    with pytest.raises(loader.DatasetError, match=rf"^shard {url}/a/data-0000[0-2]-of-00003.array_record: copy to "
                                                  rf"{local}/a/data-0000[0-2]-of-00003.array_record failed: "
                                                  r"FileExistsError: "):
        loader.build(mix(), url, global_batch=8, cache_dir=cache)


def test_cached_manifest_that_is_a_folder_is_a_dataset_error_and_leaves_nothing(remote, tmp_path):
    """It used to escape as a bare IsADirectoryError and leave ``manifest.json.part-*`` behind."""
    url, _ = remote
    cache = str(tmp_path / "cache")
    local = loader.build(mix(), url, global_batch=8, cache_dir=cache).source.shards.dataset
    target = os.path.join(local, MANIFEST_NAME)
    os.remove(target)
    os.mkdir(target)
    with pytest.raises(loader.DatasetError, match=rf"^staging {url}: cannot write {target}: Is a directory$"):
        loader.build(mix(), url, global_batch=8, cache_dir=cache)
    assert not [f for f in files_under(cache) if ".part-" in f]


def test_stale_part_files_of_killed_copies_removed_fresh_ones_kept(remote, tmp_path):
    """A copy killed outright (preemption: no ``finally``) leaves ``<shard>.part-*``; each
    retry used to add more, until the cache had no room. Staging now removes the stale ones."""
    url, files = remote
    cache = str(tmp_path / "cache")
    local = loader.build(mix(), url, global_batch=8, cache_dir=cache).source.shards.dataset
    shard = os.path.join(local, *SHARD_A0.split("/"))
    os.remove(shard)
    stale, fresh = f"{shard}.part-1-deadbeef", f"{shard}.part-2-0badf00d"
    for p in (stale, fresh):
        with open(p, "wb") as f:
            f.write(b"\0" * 1000)
    old = time.time() - storage.STALE_PART_S - 60
    os.utime(stale, (old, old))
    loader.build(mix(), url, global_batch=8, cache_dir=cache)
    assert not os.path.exists(stale)
    assert os.path.exists(fresh)  # may be a live copy of another process
    with open(shard, "rb") as f:
        assert f.read() == MEMFS_FILES[f"{url}/{SHARD_A0}"]


def test_copy_of_a_grown_source_stops_at_the_excess(remote, tmp_path, monkeypatch):
    """A shard replaced by a larger object after the listing used to be copied to its end
    (filling the disk the free-space check had counted for the manifest's size)."""
    url, _ = remote
    src = f"{url}/{SHARD_A0}"
    want = len(MEMFS_FILES[src])
    MEMFS_FILES[src] = MEMFS_FILES[src] + b"\0" * (want * 10)
    monkeypatch.setattr(storage, "COPY_CHUNK", 1000)
    reads = []
    real_open = storage._filesystems().open  # noqa: SLF001

    class Counting(io.BytesIO):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

    class FS:
        @staticmethod
        def open(path, compression_type=None):
            return Counting(real_open(path, compression_type=compression_type).read())

    monkeypatch.setattr(storage, "_filesystems", lambda: FS)
    dest = str(tmp_path / "x.array_record")
    got = (want // 1000 + 1) * 1000
    with pytest.raises(storage.StagingError, match=rf"^shard {src}: copied {got} bytes, manifest says {want} "
                                                   r"\(changed while copying\?\)$"):
        storage._copy(src, dest, want, "0" * 64)  # noqa: SLF001
    assert len(reads) == want // 1000 + 1
    assert files_under(tmp_path) == []


# ------------------------------------------------------------------ URLs


def test_url_with_glob_characters_is_staged(local_ds, tmp_path):
    """``[``, ``*`` and ``?`` in the URL were taken as a glob by the listing: every shard was
    then reported missing."""
    url = "memfs://bucket/hostile/run[1]*?/ds"
    upload(local_ds, url)
    try:
        data = loader.build(mix(), url, global_batch=8, cache_dir=str(tmp_path / "cache"))
        want = first_batches(loader.build(mix(), local_ds, global_batch=8))
        for a, b in zip(want, first_batches(data)):
            np.testing.assert_array_equal(a, b)
    finally:
        for k in [k for k in MEMFS_FILES if k.startswith(url + "/")]:
            del MEMFS_FILES[k]


def test_file_url_is_the_local_folder(local_ds):
    """``file:///data/ds`` is not a URL to stage (``storage.is_url``), but it was then opened as
    the relative folder ``file:`` and reported as having no manifest."""
    data = loader.build(mix(), "file://" + local_ds, global_batch=8)
    assert data.source.shards.dataset == local_ds
    want = first_batches(loader.build(mix(), local_ds, global_batch=8))
    for a, b in zip(want, first_batches(data)):
        np.testing.assert_array_equal(a, b)
    manifest, sha = dset.read_manifest("file://" + local_ds)
    with open(os.path.join(local_ds, MANIFEST_NAME), "rb") as f:
        assert sha == hashlib.sha256(f.read()).hexdigest()


# ------------------------------------------------------------------ read path


@pytest.mark.parametrize("six", [False, True])
def test_vocab_check_sees_four_byte_tokens_above_int32(six):
    """A uint32 token >= 2**31 turns negative in the int32 arrays and used to pass the
    ``vocab_size`` check: served as -1 and -2**31."""
    L = 4
    rec = codec.encode_row([np.array([1, 2**32 - 1, 2**31], np.uint32)], ["d"], [0], L, "uint32")
    with pytest.raises(loader.DatasetError, match=r"^record 0: token 4294967295 >= vocab_size 1000$"):
        ar.pack_records([rec], L, 4, 0, np.int32, vocab_size=1000, six=six)
    ok = codec.encode_row([np.array([1, 999], np.uint32)], ["d"], [0], L, "uint32")
    packed, tokens = ar.pack_records([ok], L, 4, 0, np.int32, vocab_size=1000, six=six)
    assert tokens == 2
    np.testing.assert_array_equal(packed["inputs"] if six else packed[:, 0], [[1, 999, 0, 0]])


def test_filesystem_type_last_mount_wins_and_octal_escapes(monkeypatch):
    """Of two mounts on one point the later hides the earlier; and ``/proc/self/mounts``
    escapes tab (``\\011``) and backslash (``\\134``), not only space (``\\040``)."""
    mounts = ("/dev/sda1 / ext4 rw 0 0\n"
              "tmpfs /mnt/x tmpfs rw 0 0\n"
              "bucket /mnt/x fuse.gcsfuse rw 0 0\n"
              "bucket /mnt/a\\134b fuse.gcsfuse rw 0 0\n"
              "bucket /mnt/t\\011ab fuse.gcsfuse rw 0 0\n"
              "bucket /mnt/s\\040p nfs4 rw 0 0\n")
    monkeypatch.setattr(sh, "open", lambda p, *a, **k: io.StringIO(mounts), raising=False)
    monkeypatch.setattr(sh.os.path, "realpath", lambda p: p)
    got = {p: sh.filesystem_type(p) for p in ("/mnt/x/ds", "/mnt/a\\b/ds", "/mnt/t\tab/ds", "/mnt/s p/ds", "/data")}
    assert got == {"/mnt/x/ds": "fuse.gcsfuse", "/mnt/a\\b/ds": "fuse.gcsfuse", "/mnt/t\tab/ds": "fuse.gcsfuse",
                   "/mnt/s p/ds": "nfs4", "/data": "ext4"}
    assert sh.resolve_read_mode("auto", "/mnt/x/ds") == "batched"
