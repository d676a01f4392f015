"""The loader's input figures: the buffer's level at the ask and its minimum over the step, the
wait and where it went, recorded exactly on a loader whose store is held by the test
(``loader.slow_store``), and the attribution arithmetic from a table."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

import loader
from loader import testing as lt
from loader.data_loader import WAIT_STAGES, wait_stages
from loader.slow_store import SlowShardSet, overlap


@pytest.mark.parametrize("t_ask, t_got, want", [
    # stamps: start 0, index ends 1, read ends 5, decode ends 6, rows end 7; transfer 7..8
    (0.0, 8.0, {"index": 1.0, "read": 4.0, "decode": 1.0, "rows": 1.0, "transfer": 1.0}),
    (2.0, 4.0, {"read": 2.0}),                    # asked mid-read, got it mid-read (a threaded hand-off)
    (4.5, 9.0, {"read": 0.5, "decode": 1.0, "rows": 1.0, "transfer": 1.0, "other": 1.0}),
    (-2.0, 1.0, {"index": 1.0, "other": 2.0}),    # asked before the step began: queued behind another
    (3.0, 3.0, {}),                               # no wait
])
def test_a_wait_is_split_by_the_stages_it_overlaps(t_ask, t_got, want):
    got = wait_stages(t_ask, t_got, np.array([0.0, 1.0, 5.0, 6.0, 7.0]), (7.0, 8.0))
    assert got == want and set(got) <= set(WAIT_STAGES)
    assert sum(got.values()) == pytest.approx(max(0.0, t_got - t_ask))


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=7, max_size=7),
       st.floats(-10, 110, allow_nan=False), st.floats(0, 50, allow_nan=False))
def test_a_wait_is_split_without_loss_or_excess(points, t_ask, wait):
    """Any stage stamps (ordered), any transfer after them, any wait: the parts are >= 0, named, and
    add up to the wait; a part is never longer than its stage."""
    p = sorted(points)
    stamps, transfer = np.array(p[:5]), (p[5], p[6])
    got = wait_stages(t_ask, t_ask + wait, stamps, transfer)
    assert set(got) <= set(WAIT_STAGES) and all(v > 0 for v in got.values())
    assert sum(got.values()) == pytest.approx(wait, abs=1e-9)
    spans = dict(zip(WAIT_STAGES[:4], np.diff(stamps))) | {"transfer": p[6] - p[5]}
    assert all(got[k] <= spans[k] + 1e-12 for k in got if k != "other")


def test_overlap_counts_each_instant_once():
    assert overlap(0.0, 10.0, [(1.0, 3.0), (2.0, 4.0), (9.0, 12.0)]) == 4.0
    assert overlap(5.0, 6.0, [(0, 1.0, 2.0)]) == 0.0


@pytest.fixture
def gated(tmp_path):
    """A loader (prefetch 2, one read thread) whose k-th read waits until ``release[k]`` is set."""
    lt.write_synthetic_dataset(str(tmp_path / "ds"), {"a": 10, "b": 23}, 16, shards_per_source=2, vocab_size=1000)
    data = loader.build(lt.synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=16), str(tmp_path / "ds"),
                        global_batch=8, prefetch=2, read_mode="records")
    data.batch_at(7)  # readers opened, the transfer's fast path checked: step 0 below is warm
    release = [threading.Event() for _ in range(8)]
    store = data.source.shards = SlowShardSet.wrap(data.source.shards, gate=lambda k: release[k].wait(10))
    yield data, store, release
    for e in release:
        e.set()


def _release_later(store, release, k, after_s):
    """Lets read ``k`` go ``after_s`` seconds after it started waiting (on a timer thread)."""
    def go():
        for _ in range(4000):
            if store.calls > k:
                break
            time.sleep(0.002)
        time.sleep(after_s)
        release[k].set()
    threading.Thread(target=go, daemon=True).start()


def _level(data, want):
    for _ in range(2000):  # the prefetch thread finishes its calls on its own time
        if data.metrics()["prefetch_occupancy"] == want:
            return
        time.sleep(0.005)
    raise AssertionError(f"the buffer never held {want}")


def test_levels_and_waits_are_recorded_exactly_on_a_held_store(gated):
    data, store, release = gated
    it = data.iterate(0)
    _release_later(store, release, 0, 0.2)
    next(it)  # step 0: nothing ready, the read held 0.2 s
    m = data.metrics()
    assert (m["occupancy_at_ask"], m["occupancy_min"]) == (0, 0)
    stages, wait = m["wait_stages_s"], m["wait_s_last_step"]
    assert sum(stages.values()) == pytest.approx(wait, abs=1e-9)
    call, h0, h1 = store.injected[0]
    assert call == 0 and h1 - h0 >= 0.2
    # the read stage holds the whole held span (which began as the trainer asked, to the
    # prefetch's start-up), and is the largest
    assert max(stages, key=stages.get) == "read" and stages["read"] >= (h1 - h0) - 0.01
    release[1].set()
    release[2].set()
    _level(data, 2)  # steps 1 and 2 ready: the buffer full
    next(it)
    m = data.metrics()
    assert (m["occupancy_at_ask"], m["occupancy_min"], m["wait_stages_s"]) == (2, 0, {})  # empty after step 0
    _level(data, 1)  # step 2 ready; step 3 held
    next(it)
    m = data.metrics()
    assert (m["occupancy_at_ask"], m["occupancy_min"], m["wait_stages_s"]) == (1, 1, {})
    for _ in range(4000):  # step 3's read has begun (its index arithmetic done) and is held
        if store.calls > 3:
            break
        time.sleep(0.002)
    _release_later(store, release, 3, 0.1)
    next(it)  # step 3: drained again
    m = data.metrics()
    assert (m["occupancy_at_ask"], m["occupancy_min"]) == (0, 0) and max(m["wait_stages_s"], key=m["wait_stages_s"].get) == "read"
    assert m["wait_stages_s"]["read"] >= 0.1 - 0.01  # held 0.1 s from (about) the ask
    for e in release:
        e.set()
    it.close()
    assert [c for c, *_ in store.injected] == list(range(store.calls))


def test_batch_at_has_no_buffer_and_waits_for_all_of_its_step(gated):
    data, store, release = gated
    for e in release:
        e.set()
    data.batch_at(5)
    m = data.metrics()
    assert (m["occupancy_at_ask"], m["occupancy_min"]) == (0, 0)
    assert set(m["wait_stages_s"]) >= {"index", "read", "decode", "rows", "transfer"}
    assert sum(m["wait_stages_s"].values()) == pytest.approx(m["wait_s_last_step"], abs=1e-9)
