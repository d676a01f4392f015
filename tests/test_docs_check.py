"""scripts/check_docs.py: which commands of a Markdown file run, with which expectations.

The check itself (every README and docs command run after the demo) is run by .ci/run;
these tests pin how a page is read, on hand-made pages.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_docs", REPO / "scripts" / "check_docs.py")
check_docs = importlib.util.module_from_spec(_spec)
sys.modules["check_docs"] = check_docs
_spec.loader.exec_module(check_docs)

PAGE = """\
# A page

```bash
# a comment line is dropped
export XLA_FLAGS=--xla_force_host_platform_device_count=8
python -m dataprep.pack --config a.yaml \\
    --output build/x   # trailing comment kept for bash
```

<!-- check: skip 2: .ci/run runs the tests itself -->
```bash
bash scripts/demo.sh
pytest -q tests
```

<!-- check: exit 3; timeout 900 -->
```bash
replay drill --run build/demo/run
```

<!-- check: skip: needs a Google Cloud project -->
```bash
python -m dataprep.pack --runner DataflowRunner
```

```python
import loader
print(loader)
```

```text
not a command
```
"""


def _commands(tmp_path, text):
    (tmp_path / "page.md").write_text(text)
    return check_docs.commands_of(tmp_path / "page.md", root=tmp_path)


def test_commands_lines_and_directives(tmp_path):
    cmds = _commands(tmp_path, PAGE)
    got = [(c.line, c.lang, c.text, c.expect_exit, c.timeout_s, c.skip) for c in cmds]
    assert got == [
        (5, "bash", "export XLA_FLAGS=--xla_force_host_platform_device_count=8", 0, 600, None),
        (6, "bash", "python -m dataprep.pack --config a.yaml --output build/x   # trailing comment kept for bash",
         0, 600, None),
        (12, "bash", "bash scripts/demo.sh", 0, 600, None),
        (13, "bash", "pytest -q tests", 0, 600, ".ci/run runs the tests itself"),
        (18, "bash", "replay drill --run build/demo/run", 3, 900, None),
        (23, "bash", "python -m dataprep.pack --runner DataflowRunner", 0, 600, "needs a Google Cloud project"),
        (27, "python", "import loader\nprint(loader)", 0, 600, None),
    ]


def test_bad_directive_named_with_file_and_line(tmp_path):
    with pytest.raises(check_docs.DocsCheckError, match=r"page.md:1: unknown check directive 'skipp: x'"):
        _commands(tmp_path, "<!-- check: skipp: x -->\n```bash\nls\n```\n")


def test_unclosed_fence(tmp_path):
    with pytest.raises(check_docs.DocsCheckError, match=r"page.md:1: a ``` fence is never closed"):
        _commands(tmp_path, "```bash\nls\n")


def test_run_command_export_exit_code_and_timeout(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    export = check_docs.Command("p.md", 1, "bash", "export GREETING=hello-$HOME")
    assert check_docs.run_command(export, env, root=tmp_path)[0] == 0
    assert env["GREETING"] == f"hello-{tmp_path}"
    echo = check_docs.Command("p.md", 2, "bash", 'echo "$GREETING"; exit 3')
    code, _, out = check_docs.run_command(echo, env, root=tmp_path)
    assert (code, out) == (3, f"hello-{tmp_path}\n")
    slow = check_docs.Command("p.md", 3, "bash", "sleep 5", timeout_s=1)
    code, _, out = check_docs.run_command(slow, env, root=tmp_path)
    assert code == 124 and "timed out after 1 s" in out


def test_placeholder_fails_the_check(tmp_path, monkeypatch, capsys):
    (tmp_path / "README.md").write_text("```bash\npython -m dataprep.pack --config configs/<name>.yaml\n```\n")
    (tmp_path / "docs").mkdir()
    monkeypatch.setattr(check_docs, "REPO", tmp_path)
    assert check_docs.main([]) == 1
    out = capsys.readouterr().out
    assert "holds a placeholder '<name>'" in out
    assert "docs check: 1 failed of 1 commands" in out


def test_continue_runs_a_python_block_with_the_ones_before_it(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```python\na = 1\n```\n\ntext\n\n<!-- check: continue -->\n```python\nb = a + 1\n```\n\n"
                    "<!-- check: continue -->\n```python\nassert b == 2\n```\n\n```python\nc = 3\n```\n")
    got = [c.text for c in check_docs.commands_of(page, tmp_path)]
    assert got == ["a = 1", "a = 1\n\nb = a + 1", "a = 1\n\nb = a + 1\n\nassert b == 2", "c = 3"]
    first = tmp_path / "q.md"
    first.write_text("<!-- check: continue -->\n```python\nx = 1\n```\n")
    with pytest.raises(check_docs.DocsCheckError, match=r"q.md:2: 'continue' but no python block before it"):
        check_docs.commands_of(first, tmp_path)


def test_docs_commands_skipped_as_the_readmes_are_word_for_word_the_readmes():
    import shlex

    def words(text):
        return tuple(shlex.split(text, comments=True))  # trailing comments aside

    readme = {words(c.text) for c in check_docs.commands_of(REPO / "README.md", REPO) if c.lang == "bash"}
    skipped = [c for c in check_docs.commands_of(REPO / "docs" / "dataprep.md", REPO)
               if c.skip and c.skip.startswith("word for word the README's")]
    assert len(skipped) == 2
    for c in skipped:
        assert words(c.text) in readme, c.text


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_docs_links_resolve_inside_the_repository():
    """Every relative link of README.md and docs/*.md names a file of the repository (and a heading of it),
    and no page sends a user outside the clone (`../shared/DESIGN.md` is not in a fresh clone)."""
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert REPO / "docs" / "design.md" in pages
    checked = 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "DESIGN.md" not in text, f"{page.name} cites DESIGN.md, which a clone does not have: docs/design.md"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.is_file() and REPO in path.parents, f"{page.name}: link {target} names no file of the clone"
            if anchor and path.suffix == ".md":
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)}
                assert anchor in headings, f"{page.name}: link {target}: no such heading in {path.name}"
            checked += 1
    assert checked >= 20


def _snippet_on_a_synthetic_dataset(text: str, tmp_path: pathlib.Path) -> str:
    """``text`` with the demo's mixture and dataset paths pointed at a synthetic dataset (1,024 tokens a row)."""
    import yaml

    from loader import testing as lt

    dataset = tmp_path / "dataset"
    mix = lt.synthetic_mixture({"docs": 0.3, "code": 0.7}, seq_len=1024)
    lt.write_synthetic_dataset(str(dataset), {"docs": 300, "code": 700}, seq_len=1024, mixture=mix)
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(mix.to_dict()))
    (tmp_path / "build/demo").mkdir(parents=True)
    return (text.replace('"configs/mixtures/demo.yaml"', repr(str(tmp_path / "mix.yaml")))
            .replace('"build/demo/dataset"', repr(str(dataset)))
            .replace('"build/demo/', repr(str(tmp_path / "build/demo"))[:-1] + "/"))


@pytest.mark.parametrize("page", ["README.md", "docs/loader.md"])
def test_the_loaders_looking_at_a_batch_snippets_run(tmp_path, page):
    """The README's loader snippet and docs/loader.md's "Looking at a batch" (with the blocks it
    continues) as written, on a synthetic dataset in place of the demo's: they print the values
    (the form the issue tripped on, batch["inputs"][0, :20], raises ShardingTypeError)."""
    import os
    import subprocess

    blocks = [c for c in check_docs.commands_of(REPO / page, REPO) if c.lang == "python" and "np.asarray(" in c.text]
    assert blocks  # the first; a later block that continues it holds it too
    script = _snippet_on_a_synthetic_dataset(blocks[0].text, tmp_path)
    script += ("\ntry:\n    batch['inputs'][0, :20]\nexcept Exception as e:\n    print('indexing:', type(e).__name__)\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "indexing: ShardingTypeError"
    printed = [ln for ln in lines if ln.startswith("[")]
    assert len(printed) >= 2 and printed[0] == printed[1]  # np.asarray and the process's own shard agree
