"""XLA:CPU's thread count in env.json and the range replay's explanation of an unlocalized difference
by it (a 2-process x 2-device run replayed by 1 process x 8 devices: every device's router gradient
differed, docs/trainer.md "Bit identity")."""

import os

import pytest

from replay.run import env as envmod
from replay.verify.engine import cpu_threads_hint


def _rec(threads, platform="cpu", local=2, procs=2):
    backend = {"platform": platform, "local_device_count": local, "process_count": procs}
    if threads is not None:
        backend["cpu_threads"] = threads
    return {"backend": backend}


def test_cpu_threads_is_the_larger_of_cpus_and_local_devices():
    cpus = len(os.sched_getaffinity(0))
    assert envmod.cpu_threads(1) == cpus
    assert envmod.cpu_threads(cpus + 6) == cpus + 6


def test_record_environment_records_cpu_threads_on_cpu():
    import jax

    rec = envmod.record_environment()
    assert rec["backend"]["platform"] == "cpu"
    assert rec["backend"]["cpu_threads"] == max(len(os.sched_getaffinity(0)), jax.local_device_count())


def test_a_different_thread_count_is_a_note_not_drift():
    diffs = envmod.compare_environment(_rec(2), _rec(8, local=8, procs=1))
    assert "note: backend.cpu_threads: recorded 2, current 8" in diffs
    # a record from before the field says nothing
    assert not [d for d in envmod.compare_environment(_rec(None), _rec(8)) if "cpu_threads" in d]


def test_hint_names_both_counts_and_the_flags_to_replay_with():
    hint = cpu_threads_hint(_rec(2), _rec(8, local=8, procs=1))
    assert hint == (
        "on CPU the run's processes ran XLA with 2 intra-op threads and this replay with 8 (the larger of a "
        "process's CPUs and its local devices), and XLA:CPU splits the sum of a long matrix product over its "
        "threads, so every device's bits can differ without a fault: replay with the run's threads "
        "(XLA_FLAGS=--xla_force_host_platform_device_count=2 in each of 2 process(es), on CPUs as many as the "
        "run's) to compare bit for bit")


@pytest.mark.parametrize("recorded,current", [
    (_rec(4), _rec(4, local=8, procs=1)),   # the same count
    (_rec(None), _rec(8)),                  # a run from before the field
    (_rec(2, platform="gpu"), _rec(8)),     # not CPU
    (_rec(2), _rec(8, platform="tpu")),
])
def test_no_hint_where_the_threads_cannot_explain_it(recorded, current):
    assert cpu_threads_hint(recorded, current) is None
