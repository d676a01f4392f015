"""scripts/demo.py: the stages it runs and its closing tables (exact text)."""

import importlib.util
import json
import pathlib
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["demo_script"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_stages_are_the_commands_a_user_types():
    demo = _demo()
    got = [(s.name, s.argv) for s in demo.stages("build/demo", "PY", "REPLAY", 30, 10)]
    assert got == [
        ("dataprep", ("PY", "-m", "dataprep.demo", "--out", "build/demo")),
        ("train", ("PY", "-m", "replay.reference.train", "--run", "build/demo/run", "--config",
                   "configs/runs/demo.yaml", "--steps", "30")),
        ("replay", ("REPLAY", "--run", "build/demo/run", "--steps", "20:30", "--devices", "good",
                    "--json", "build/demo/replay.json", "--plot", "build/demo/replay.png")),
        ("canary", ("REPLAY", "canary", "--run", "build/demo/run", "--devices", "all")),
        ("scan", ("REPLAY", "scan", "--run", "build/demo/run", "--json", "build/demo/scan.json",
                  "--plot", "build/demo/scan.png")),
        ("goodput", ("REPLAY", "goodput", "--run", "build/demo/run", "--json", "build/demo/goodput.json",
                     "--plot", "build/demo/goodput.png")),
    ]


def test_the_closing_table_gives_the_goodput_headline(tmp_path):
    demo = _demo()
    stage = [s for s in demo.stages("build/demo", "PY", "REPLAY", 30, 10) if s.name == "goodput"][0]
    assert demo.stage_summary(stage, tmp_path) == stage.what  # no report yet
    (tmp_path / "goodput.json").write_text(json.dumps({
        "wall_s": 134.0, "goodput": 0.712, "token_goodput": 1.0,
        "mfu": {"status": "ok", "median": 0.031, "illustrative": True}}))
    text = demo.closing_tables(tmp_path, [("goodput", demo.stage_summary(stage, tmp_path), 3.0)], [], width=220)
    assert "goodput 71.2% of 134.0 s; 100.0% of the tokens trained are in the lineage; MFU 3.10% (illustrative on " \
           "CPU); effective 2.21% (MFU x goodput)" in " ".join(text.replace("│", " ").split())


def test_default_training_and_replay_cross_the_mixture_phase_change():
    """30 steps, replaying 20:30: the phase change of configs/mixtures/demo.yaml lies inside both."""
    mixture = yaml.safe_load((REPO / "configs" / "mixtures" / "demo.yaml").read_text())
    changes = [p["from_step"] for p in mixture["phases"] if p["from_step"] > 0]
    assert changes and all(20 < c < 30 for c in changes)
    run = yaml.safe_load((REPO / "configs" / "runs" / "demo.yaml").read_text())
    assert run["canary_every"] == 10 and run["checkpoint_every"] == 10  # a checkpoint at step 20 starts the replay


def test_closing_tables_list_stages_total_and_outputs(tmp_path):
    demo = _demo()
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "manifest.json").write_bytes(b"x" * 1500)
    (tmp_path / "replay.json").write_bytes(b"{}")
    outputs = [demo.Output("dataset/manifest.json", "the manifest"), demo.Output("replay.json", "the report"),
               demo.Output("scan.png", "never written here")]
    text = demo.closing_tables(tmp_path, [("dataprep", "pack", 61.0), ("train", "train 30 steps", 9.5)],
                               outputs, width=100)
    lines = [line.rstrip() for line in text.splitlines()]
    assert "demo: stages" in lines[0]
    rows = [" ".join(line.replace("│", " ").split()) for line in lines]
    assert "dataprep pack 1 min 01 s" in rows
    assert "train train 30 steps 9.5 s" in rows
    assert "total 1 min 10 s" in rows
    assert "dataset/manifest.json 1.5 KB the manifest" in rows
    assert "replay.json 2 B the report" in rows
    assert not any("scan.png" in r for r in rows)  # missing outputs are left out


def test_bad_step_count_is_refused_before_any_work(monkeypatch, capsys):
    demo = _demo()
    monkeypatch.setenv("DEMO_STEPS", "5")
    assert demo.main() == 2
    assert "DEMO_STEPS must be an integer above 10" in capsys.readouterr().err


def test_readme_commands_skipped_as_the_demos_own_are_the_demos_stages():
    """The README's replay and canary commands are not rerun by scripts/check_docs.py because the
    demo ran them just before: that holds only while they are the demo's commands, word for word."""
    import shlex

    spec = importlib.util.spec_from_file_location("check_docs", REPO / "scripts" / "check_docs.py")
    check = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = check
    spec.loader.exec_module(check)
    demo = _demo()
    stages = {s.name: list(s.argv) for s in demo.stages("build/demo", "python", "replay", 30, 10)}
    readme = [c for c in check.commands_of(REPO / "README.md") if c.skip and "the demo's own" in c.skip]
    assert [shlex.split(c.text, comments=True) for c in readme] == [stages["replay"], stages["canary"],
                                                                     stages["goodput"]]
    walk = [c for c in check.commands_of(REPO / "docs" / "replay.md")
            if "## Triage of a loss spike" in (REPO / "docs" / "replay.md").read_text().split("\n")[c.line - 1]
            or c.text.startswith("replay triage")]
    readme_triage = [c for c in check.commands_of(REPO / "README.md") if c.text.startswith("replay triage")]
    # the walk-through starts from the README's triage command, on the demo's run, and runs it
    assert walk[0].text == readme_triage[0].text and walk[0].skip is None
