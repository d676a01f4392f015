"""The mixture config schema and validation (contract/config.py)."""

import pytest
import yaml

from contract.config import ConfigError, SourceFormat, load_mixture, mixture_from_dict


def _raw():
    return {
        "name": "mix",
        "version": 2,
        "seq_len": 64,
        "seed": 3,
        "shards_per_source": 2,
        "tokenizer": {"path": "tok.model", "sha256": "a" * 64},
        "sources": [
            {"name": "web", "paths": ["data/web/*.jsonl"], "format": "jsonl", "weight": 2},
            {
                "name": "books",
                "paths": ["gs://bucket/books/*.txt"],
                "format": "text",
                "text_split": "blank_lines",
                "weight": 1,
            },
        ],
        "phases": [{"from_step": 100, "weights": {"web": 1}}],
    }


def test_valid_config_resolves_paths_and_phases(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(_raw()))
    c = load_mixture(str(tmp_path / "m.yaml"))
    assert c.tokenizer.path == str(tmp_path / "tok.model")
    assert c.sources[0].paths == (str(tmp_path / "data/web/*.jsonl"),) and c.sources[0].root == str(
        tmp_path / "data/web"
    )
    assert c.sources[1].paths == ("gs://bucket/books/*.txt",) and c.sources[1].root == "gs://bucket/books"
    assert c.sources[1].format is SourceFormat.TEXT
    assert [(p.from_step, dict(p.weights)) for p in c.phases] == [
        (0, {"web": 2.0, "books": 1.0}),
        (100, {"web": 1.0, "books": 0.0}),
    ]
    assert c.sha256() == mixture_from_dict(_raw(), base_dir=str(tmp_path)).sha256()
    assert c.seq_len == 64 and mixture_from_dict({**_raw(), "seq_len": 8192}).seq_len == 8192


def _set(path, value):
    def f(raw):
        node = raw
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return f


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_set(["colour"], 1), "config: unknown key(s) ['colour']"),
        (_set(["sources", 0, "colour"], 1), "sources[0]: unknown key(s) ['colour']"),
        (_set(["sources", 1, "name"], "web"), "sources[1].name: duplicate source name 'web'"),
        (_set(["sources", 0, "weight"], -0.5), "sources[0].weight: must be >= 0, got -0.5"),
        (lambda r: [s.update(weight=0) for s in r["sources"]], "all weights are zero"),
        (_set(["seq_len"], 0), "seq_len: must be >= 1, got 0"),
        (_set(["seq_len"], "8k"), "seq_len: must be an integer"),
        (_set(["sources", 0, "format"], "csv"), "sources[0].format: must be one of"),
        (
            _set(["sources", 0, "text_split"], "blank_lines"),
            "sources[0].text_split: only applies to format 'text'",
        ),
        (_set(["tokenizer", "sha256"], "XYZ"), "tokenizer.sha256: must be 64 lowercase hex digits"),
        (_set(["phases", 0, "from_step"], -5), "phases[0].from_step: must be >= 1, got -5"),
        (
            _set(["phases", 0, "from_step"], 0),
            "phases[0]: a phase at step 0 must repeat the sources' weights",
        ),
        (_set(["phases", 0, "weights"], {"nope": 1}), "phases[0].weights: unknown source(s) ['nope']"),
        (_set(["sources", 0, "weight"], float("nan")), "must be finite"),
        (_set(["sources"], []), "sources: must be a non-empty list"),
        (_set(["shards_per_source"], 0), "shards_per_source: must be >= 1, got 0"),
        (_set(["shards_per_source"], 100_000), "shards_per_source: must be <= 99999, got 100000"),
        (_set(["target_shard_tokens"], 63), "target_shard_tokens: must be >= seq_len (64), got 63; a shard holds whole rows"),
        (_set(["target_shard_tokens"], "2**28"), "target_shard_tokens: must be an integer, got '2**28'"),
        (_set(["max_rejected_fraction"], 1.5),
         "max_rejected_fraction: must be a number in [0, 1] (1 accepts any loss), got 1.5"),
        (_set(["max_rejected_fraction"], True),
         "max_rejected_fraction: must be a number in [0, 1] (1 accepts any loss), got True"),
        (_set(["max_rejected_fraction"], float("nan")),
         "max_rejected_fraction: must be a number in [0, 1] (1 accepts any loss), got nan"),
        # a typo gets "did you mean" (as run config typos do), an unknown name with nothing near gets none
        (_set(["wieght"], 1), "config: unknown key(s) ['wieght']; allowed keys are"),  # nothing near: no guess
        (_set(["max_segment_per_row"], 8),
         "config: unknown key(s) ['max_segment_per_row'] (did you mean 'max_segments_per_row' for "
         "'max_segment_per_row'?); allowed keys are"),
        (_set(["sources", 0, "wieght"], 1),
         "sources[0]: unknown key(s) ['wieght'] (did you mean 'weight' for 'wieght'?); allowed keys are"),
        (_set(["tokenizer", "sha265"], "a" * 64),
         "tokenizer: unknown key(s) ['sha265'] (did you mean 'sha256' for 'sha265'?)"),
        (_set(["phases", 0, "weights"], {"wbe": 1}),
         "phases[0].weights: unknown source(s) ['wbe'] (did you mean 'web' for 'wbe'?); sources are ['books', 'web']"),
        (_set(["sources", 0, "format"], "jsonl.gzip"),
         "sources[0].format: must be one of ['jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet', 'text'], got 'jsonl.gzip' "
         "(did you mean 'jsonl.gz' for 'jsonl.gzip'?)"),
        (_set(["dedup"], "exakt"), "dedup: must be one of ['off', 'report', 'exact'], got 'exakt' "
                                   "(did you mean 'exact' for 'exakt'?)"),
    ],
)
def test_each_mistake_names_its_field(mutate, message):
    raw = _raw()
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        mixture_from_dict(raw, base_dir="/x")
    assert message in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_mixture(str(tmp_path / "none.yaml"))
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_mixture(str(tmp_path / "bad.yaml"))


def test_shard_fields_default_and_round_trip():
    raw = _raw()
    del raw["shards_per_source"]
    c = mixture_from_dict(raw, base_dir="/x")
    assert (c.shards_per_source, c.target_shard_tokens, c.max_rejected_fraction) == (None, 2**28, 0.5)
    d = c.to_dict()
    assert (d["shards_per_source"], d["target_shard_tokens"], d["max_rejected_fraction"]) == (None, 2**28, 0.5)
    # The normalized form (what manifest.json holds) reads back to the same config.
    assert mixture_from_dict(d).sha256() == c.sha256()
    c2 = mixture_from_dict({**_raw(), "target_shard_tokens": 4096, "max_rejected_fraction": 0}, base_dir="/x")
    assert (c2.shards_per_source, c2.target_shard_tokens, c2.max_rejected_fraction) == (2, 4096, 0.0)
    assert mixture_from_dict(c2.to_dict()).to_dict() == c2.to_dict()


def test_dedup_modes_and_the_sha_of_configs_without_it(tmp_path):
    from contract.config import DedupMode

    base = mixture_from_dict(_raw(), base_dir="/x")
    assert base.dedup is DedupMode.REPORT and "dedup" not in base.to_dict()  # sha256 as before the key existed
    assert mixture_from_dict({**_raw(), "dedup": "report"}, base_dir="/x").sha256() == base.sha256()
    exact = mixture_from_dict({**_raw(), "dedup": "exact"}, base_dir="/x")
    assert exact.dedup is DedupMode.EXACT and exact.to_dict()["dedup"] == "exact"
    assert mixture_from_dict(exact.to_dict()).sha256() == exact.sha256() != base.sha256()
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(_raw()).replace("name: mix", "name: mix\ndedup: off"))
    assert load_mixture(str(tmp_path / "m.yaml")).dedup is DedupMode.OFF  # YAML reads a bare off as false
