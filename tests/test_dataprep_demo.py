"""The demo (python -m dataprep.demo) on a small deterministic subset of the local stdlib."""

import json

from contract.manifest import Manifest
from dataprep import demo


def test_demo_prepares_trains_and_packs(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo.main(["--out", str(out), "--max-code-mb", "0.3", "--vocab-size", "1000"]) == 0
    printed = capsys.readouterr().out
    assert "deterministic subset" in printed and str(out / "dataset") in printed and "reconciled" in printed
    topics = [json.loads(line) for line in (out / "inputs/docs/topics.jsonl").read_text().splitlines()]
    assert len(topics) > 50 and all(t["text"] for t in topics)
    code = sorted(p.relative_to(out / "inputs/code").as_posix() for p in (out / "inputs/code").rglob("*.py"))
    assert code and not any(
        part in ("test", "tests", "idle_test", "site-packages") for c in code for part in c.split("/")[:-1]
    )
    m = Manifest.from_json((out / "dataset/manifest.json").read_text())
    assert m.problems() == [] and set(m.sources) == {"docs", "code"} and m.seq_len == 1024
    assert m.sources["code"].ledger.read == len(code) and m.sources["docs"].ledger.read == len(topics)
    assert m.tokenizer["sha256"] == (out / "tokenizer.model.sha256").read_text().split()[0]
    assert m.config["phases"][1]["from_step"] == 25 and len(m.sources["code"].shards) == 4
    assert "sha256:" in (out / "demo.pinned.yaml").read_text()
