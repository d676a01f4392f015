"""Shard counts from input sizes, and the bucket budget refused before any work (dataprep.sizing)."""

import pathlib

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.config import ConfigError, SourceFormat, mixture_from_dict
from dataprep import pack, preflight, sizing, testing


def _config(**extra):
    raw = {
        "name": "t",
        "version": 1,
        "seq_len": 8,
        "tokenizer": {"path": "/t/tok.model"},
        "sources": [
            {"name": "web", "paths": ["/d/web/*.jsonl.gz"], "format": "jsonl.gz", "weight": 1.0},
            {"name": "code", "paths": ["/d/code/*.jsonl"], "format": "jsonl", "weight": 1.0},
        ],
    }
    raw.update(extra)
    return mixture_from_dict(raw)


def test_worked_example_from_the_docstring():
    plans = sizing.plan_shards(_config(), {"web": [400_000_000] * 3, "code": [10]})
    assert plans["web"] == sizing.ShardPlan(1_200_000_000, 2_400_000_000, 9, auto=True)
    assert plans["web"].tokens_per_shard == 266_666_667
    assert plans["code"] == sizing.ShardPlan(10, 5, 1, auto=True)
    with pytest.raises(ConfigError) as e:
        sizing.plan_shards(_config(shards_per_source=2), {"web": [400_000_000] * 3, "code": [10]})
    assert str(e.value) == (
        "shards_per_source: sources[0] 'web': 1,200,000,000 bytes of jsonl.gz at the estimate of 2 tokens a byte "
        "is about 2,400,000,000 tokens, 1,200,000,000 a shard in 2 shards, over the bucket budget of "
        "1,073,741,824 (--max-shard-tokens); set shards_per_source to at least 3, or remove it so that "
        "target_shard_tokens picks the count"
    )
    assert sizing.plan_shards(_config(shards_per_source=3), {"web": [400_000_000] * 3, "code": [10]})["web"].num_shards == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**10), min_size=1, max_size=20), st.integers(8, 2**31), st.randoms())
def test_auto_shard_count_depends_on_the_listed_sizes_only(sizes, target, rnd):
    """Same sizes in any order give the same count; the count keeps shards at or under the target."""
    cfg = _config(target_shard_tokens=target)
    shuffled = list(sizes)
    rnd.shuffle(shuffled)
    budget = 2**62
    try:
        a = sizing.plan_shards(cfg, {"web": sizes, "code": [1]}, budget)["web"]
    except ConfigError as e:  # more than 99999 shards: refused, naming the target to set
        assert "set target_shard_tokens to at least" in str(e)
        return
    b = sizing.plan_shards(cfg, {"web": shuffled, "code": [1]}, budget)["web"]
    assert a == b and a.auto
    est = sizing.estimated_tokens(sum(sizes), SourceFormat.JSONL_GZ)
    assert a.num_shards == max(1, -(-est // target))
    assert a.tokens_per_shard <= target or a.num_shards == 1 and est <= target


def test_budget_and_shard_limit_messages_name_the_number_to_set():
    with pytest.raises(ConfigError) as e:
        sizing.plan_shards(_config(target_shard_tokens=2**31), {"web": [1], "code": [1]})
    assert str(e.value) == (
        "target_shard_tokens: 2,147,483,648 is over the bucket budget of 1,073,741,824 tokens a shard "
        "(--max-shard-tokens); set target_shard_tokens to at most 1073741824, or raise --max-shard-tokens "
        "if the packing workers have the memory"
    )
    with pytest.raises(ConfigError) as e:
        sizing.plan_shards(_config(target_shard_tokens=8), {"web": [10**6], "code": [1]})
    assert str(e.value) == (
        "sources[0] 'web': 1,000,000 bytes of jsonl.gz at the estimate of 2 tokens a byte is about 2,000,000 "
        "tokens, 250,000 shards of target_shard_tokens 8, over the 99999 a source may have; set "
        "target_shard_tokens to at least 21, or split the source in two"
    )
    # A budget below seq_len cannot hold one row (was: "set target_shard_tokens to at most 4", impossible).
    seq_len = _config().seq_len
    with pytest.raises(ConfigError) as e:
        sizing.plan_shards(_config(), {"web": [1], "code": [1]}, seq_len - 1)
    assert str(e.value) == (
        f"--max-shard-tokens: must be >= seq_len ({seq_len}), got {seq_len - 1}; a shard holds whole rows of "
        "seq_len tokens"
    )
    assert sizing.plan_shards(_config(target_shard_tokens=seq_len), {"web": [1], "code": [1]}, seq_len)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("sizing")
    sha = testing.train_small_tokenizer(str(d / "tok.model"))
    testing.write_pydoc_jsonl(d / "in", 3, 120_000)
    raw = {
        "name": "t", "version": 1, "seq_len": 64, "target_shard_tokens": 10_000,
        "tokenizer": {"path": "tok.model", "sha256": sha},
        "sources": [{"name": "docs", "paths": ["in/*.jsonl"], "format": "jsonl"}],
    }
    (d / "mix.yaml").write_text(yaml.safe_dump(raw))
    return d, raw


def test_auto_shards_pack_and_are_recorded(corpus, tmp_path):
    d, raw = corpus
    listed = sum(p.stat().st_size for p in (d / "in").glob("*.jsonl"))
    expected = -(-sizing.estimated_tokens(listed, SourceFormat.JSONL) // 10_000)
    m = pack.run(["--config", str(d / "mix.yaml"), "--output", str(tmp_path / "ds"), "--no-report"],
                 print_summary=False).manifest
    shards = m.sources["docs"].shards
    assert len(shards) == expected > 3
    assert [s.path for s in shards] == [f"docs/data-{i:05d}-of-{expected:05d}.array_record" for i in range(expected)]
    assert m.config["shards_per_source"] is None and m.config["target_shard_tokens"] == 10_000
    assert m.problems() == [] and sum(s.tokens for s in shards) == m.sources["docs"].ledger.tokens_in


def test_bucket_over_the_budget_is_refused_before_any_work(corpus, tmp_path, capsys):
    d, raw = corpus
    cfg = tmp_path / "one.yaml"
    cfg.write_text(yaml.safe_dump({**raw, "shards_per_source": 1, "tokenizer": {"path": str(d / "tok.model")},
                                   "sources": [{**raw["sources"][0], "paths": [str(d / "in/*.jsonl")]}]}))
    out = tmp_path / "ds"
    assert pack.main(["--config", str(cfg), "--output", str(out), "--max-shard-tokens", "20000"]) == pack.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cfg}: shards_per_source: sources[0] 'docs': ")
    assert "a shard in 1 shards, over the bucket budget of 20,000 (--max-shard-tokens); set shards_per_source " \
           "to at least " in err
    assert not out.exists()  # nothing was started
    pre = preflight.preflight(mixture_from_dict({**raw, "tokenizer": {"path": str(d / "tok.model")},
                                                 "sources": [{**raw["sources"][0], "paths": [str(d / "in/*.jsonl")]}]}))
    assert sum(pre.sizes["docs"]) == sum(p.stat().st_size for p in pathlib.Path(d / "in").glob("*.jsonl"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-shard-tokens", "0"], "error: --max-shard-tokens: must be >= seq_len (64), got 0; a shard holds "
                                      "whole rows of seq_len tokens\n"),
        (["--progress-every", "0"], "error: --progress-every: must be > 0 seconds, got 0.0\n"),
    ],
)
def test_bad_pack_options_exit_2_with_a_message(corpus, tmp_path, args, message, capsys):
    d, _ = corpus
    assert pack.main(["--config", str(d / "mix.yaml"), "--output", str(tmp_path / "ds"), *args]) == 2
    assert capsys.readouterr().err == message


def test_worker_plan_of_the_sizing_section():
    """The 15T-token example of docs/dataprep.md, from the estimate made before a run (2.4x high)."""
    plan = sizing.ShardPlan(input_bytes=18 * 10**12, estimated_tokens=36 * 10**12, num_shards=67_056, auto=True)
    w = sizing.worker_plan({"web": plan})
    assert (w.workers, w.vcpus, w.machine) == (37, 4, "n1-standard")  # ceil(3,456 / 24 / 4)
    assert w.vcpu_hours == 36e12 / 4.34e6 * 1.5 / 3600
    assert w.gb_per_vcpu == (536_864_711 * 2.1 + 0.25e9) / 1e9
    assert w.describe() == (
        "37 n1-standard-4 workers for a 24 h run: 3,456 vCPU-hours for about 36,000,000,000,000 tokens (estimated "
        "high on purpose) at 4.34 M tokens a CPU second x 1.5 for Dataflow's own work; the packing step needs about "
        "1.38 GB a vCPU (largest shard x 2.1 bytes a token + 0.25 GB a Python process)")
    huge = sizing.worker_plan({"web": sizing.ShardPlan(1, 3 * 10**9, 1, auto=False)})
    assert huge.machine is None and huge.describe() == (
        "the largest shard needs about 6.55 GB a vCPU in the packing step, more than any n1 machine has (6.5 GB): "
        "set a smaller target_shard_tokens")
    assert sizing.worker_plan({"a": sizing.ShardPlan(10, 5, 1, True)}).workers == 1
