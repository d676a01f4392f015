"""Runs every command of the README and of ``docs/*.md`` as written, in order, after the demo.

    bash scripts/demo.sh && .venv/bin/python scripts/check_docs.py        # what .ci/run does
    .venv/bin/python scripts/check_docs.py --list                          # show what would run
    .venv/bin/python scripts/check_docs.py --only docs/loader.md --json out.json

What runs: every fenced ```` ```bash ```` block (one logical command a line, ``\\`` continuations
joined, comment-only lines dropped; ``export NAME=value`` lines set the environment of the
commands after them) and every ```` ```python ```` block (run as one script), from the repository
root, with ``.venv/bin`` first on ``PATH`` and ``XLA_FLAGS`` giving 8 CPU devices. Files run in
this order: ``README.md``, then ``docs/*.md`` sorted, then ``examples/*/README.md`` sorted. A command that exits other than 0 (or the
code its block names) fails the check.

A block that cannot run here says why, in an HTML comment on the line just before its fence,
which a reader of the rendered page does not see::

    <!-- check: skip: needs a Google Cloud project -->         the whole block
    <!-- check: skip 2,3: .ci/run runs the tests itself -->     commands 2 and 3 of the block
    <!-- check: exit 3 -->                                     every command must exit 3
    <!-- check: timeout 900 -->                                seconds a command may take (default 600)
    <!-- check: continue -->                                   a python block that goes on from the one before
                                                               it in the file: run as one script with it

Skipped commands are listed with their reason; nothing is skipped silently. A command that
holds a ``<placeholder>`` is a failure unless its block is skipped: every command must run as
written. Exit code: 0 all ran as expected, 1 a command failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*check:\s*(.*?)\s*-->\s*$")
PLACEHOLDER = re.compile(r"<[A-Za-z_][\w .-]*>")
EXPORT = re.compile(r"^export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
DEFAULT_TIMEOUT_S = 600
LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}


class DocsCheckError(ValueError):
    """A directive in a Markdown file is malformed (file and line in the message)."""


@dataclasses.dataclass
class Command:
    """One thing to run: a bash command line or a whole python block."""

    path: str               # Markdown file, relative to the repository root
    line: int               # 1-based line of the command in that file
    lang: str               # "bash" or "python"
    text: str               # the command (bash) or the script (python)
    expect_exit: int = 0
    timeout_s: int = DEFAULT_TIMEOUT_S
    skip: Optional[str] = None   # reason, when not run


def _parse_directive(text: str, where: str) -> dict:
    """``skip[ N,M]: reason`` | ``exit N`` | ``timeout S`` | ``continue``, several joined by ``;``."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        m = re.fullmatch(r"skip(?:\s+([\d,\s]+))?\s*:\s*(.+)", part)
        if m:
            nums = {int(n) for n in re.findall(r"\d+", m.group(1) or "")}
            out["skip"] = (nums or None, m.group(2))
            continue
        m = re.fullmatch(r"exit\s+(\d+)", part)
        if m:
            out["exit"] = int(m.group(1))
            continue
        if part == "continue":
            out["continue"] = True
            continue
        m = re.fullmatch(r"timeout\s+(\d+)", part)
        if m:
            out["timeout"] = int(m.group(1))
            continue
        raise DocsCheckError(f"{where}: unknown check directive {part!r}; expected 'skip[ N,M]: reason', "
                             f"'exit N', 'timeout S' or 'continue' (see scripts/check_docs.py)")
    return out


def _bash_commands(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Joins ``\\`` continuations and drops blank and comment-only lines: [(line, command)]."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for lineno, raw in lines:
        s = raw.rstrip()
        if not buf:
            if not s.strip() or s.lstrip().startswith("#"):
                continue
            start = lineno
        if s.endswith("\\"):
            buf.append(s[:-1])
            continue
        buf.append(s)
        out.append((start, " ".join(p.strip() for p in buf)))
        buf = []
    if buf:
        out.append((start, " ".join(p.strip() for p in buf)))
    return out


def commands_of(path: pathlib.Path, root: pathlib.Path = REPO) -> list[Command]:
    """Every command of one Markdown file, in order, with its directives applied.

    Raises:
      DocsCheckError: a malformed ``<!-- check: ... -->`` directive, or an unclosed fence.
    """
    rel = str(path.relative_to(root))
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Command] = []
    last_python = None  # the text of this file's previous python block, as run (continuations included)
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang = LANGS.get(m.group(1).lower())
        fence = i + 1  # 1-based line of the opening fence
        prev = lines[i - 1] if i > 0 else ""
        d = DIRECTIVE.match(prev)
        directive = _parse_directive(d.group(1), f"{rel}:{i}") if d else {}
        body: list[tuple[int, str]] = []
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            body.append((j + 1, lines[j]))
            j += 1
        if j == len(lines):
            raise DocsCheckError(f"{rel}:{i + 1}: a ``` fence is never closed")
        i = j + 1
        if lang is None:
            continue
        if lang == "python":
            text = "\n".join(t for _, t in body)
            if directive.get("continue"):
                if last_python is None:
                    raise DocsCheckError(f"{rel}:{fence}: 'continue' but no python block before it in this file")
                text = last_python + "\n\n" + text
            last_python = text
            cmds = [(body[0][0] if body else i, text)]
        else:
            cmds = _bash_commands(body)
        skip_nums, skip_reason = directive.get("skip", (None, None))
        for k, (lineno, text) in enumerate(cmds, start=1):
            c = Command(rel, lineno, lang, text, directive.get("exit", 0), directive.get("timeout", DEFAULT_TIMEOUT_S))
            if skip_reason and (skip_nums is None or k in skip_nums):
                c.skip = skip_reason
            out.append(c)
    return out


def doc_files(root: pathlib.Path = REPO) -> list[pathlib.Path]:
    """``README.md`` first, then ``docs/*.md`` sorted by name, then each example's ``examples/*/README.md``."""
    return [root / "README.md"] + sorted((root / "docs").glob("*.md")) + sorted((root / "examples").glob("*/README.md"))


def base_env(root: pathlib.Path = REPO) -> dict[str, str]:
    """The environment a reader has after the README's set-up: the venv first on PATH, 8 CPU devices."""
    env = dict(os.environ)
    venv_bin = root / ".venv" / "bin"
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(root / ".venv")
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("MPLBACKEND", "Agg")
    env.pop("PYTHONPATH", None)
    return env


def run_command(c: Command, env: dict[str, str], root: pathlib.Path = REPO) -> tuple[int, float, str]:
    """Runs one command; returns (exit code, seconds, last 4,000 characters of its output).

    ``export NAME=value`` lines change ``env`` in place (value expanded by bash) and exit 0.
    A timeout is reported as exit code 124.
    """
    t0 = time.monotonic()
    if c.lang == "bash":
        m = EXPORT.match(c.text)
        if m:
            value = subprocess.run(["bash", "-c", f"printf %s {m.group(2)}"], env=env, cwd=root,
                                   capture_output=True, text=True).stdout
            env[m.group(1)] = value
            return 0, 0.0, ""
        argv = ["bash", "-o", "pipefail", "-c", c.text]
    else:
        argv = [str(root / ".venv" / "bin" / "python"), "-c", c.text]
    try:
        p = subprocess.run(argv, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=c.timeout_s)
        code, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        code, out = 124, (e.stdout or b"") + f"\n[timed out after {c.timeout_s} s]".encode()
    text = out.decode("utf-8", "replace")
    return code, time.monotonic() - t0, text[-4000:]


def _one_line(text: str, width: int = 90) -> str:
    s = " ".join(text.split())
    return s if len(s) <= width else s[: width - 3] + "..."


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/check_docs.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="FILE", help="check only this Markdown file (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the commands and what would be skipped; run nothing")
    ap.add_argument("--json", metavar="OUT", help="write one record per command here")
    args = ap.parse_args(argv)
    files = doc_files(REPO)
    if args.only:
        wanted = {str((REPO / f).resolve()) for f in args.only}
        files = [f for f in files if str(f.resolve()) in wanted]
        if not files:
            print(f"error: none of {args.only} is README.md, docs/*.md or examples/*/README.md", file=sys.stderr)
            return 2
    try:
        cmds = [c for f in files for c in commands_of(f, REPO)]
    except DocsCheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = base_env(REPO)
    records, failed = [], 0
    for n, c in enumerate(cmds, start=1):
        where = f"{c.path}:{c.line}"
        if c.skip is None and c.lang == "bash" and PLACEHOLDER.search(c.text):
            status, code, secs, tail = "failed", None, 0.0, (
                f"holds a placeholder {PLACEHOLDER.search(c.text).group(0)!r}: write the command as it runs "
                "after the demo, or mark its block '<!-- check: skip: reason -->'")
        elif c.skip is not None or args.list:
            status, code, secs, tail = ("skipped" if c.skip else "listed"), None, 0.0, c.skip or ""
        else:
            print(f"[{n}/{len(cmds)}] {where}  $ {_one_line(c.text)}", flush=True)
            code, secs, tail = run_command(c, env, REPO)
            status = "ok" if code == c.expect_exit else "failed"
        if status == "failed":
            failed += 1
            print(f"FAILED {where}: exit {code} (expected {c.expect_exit})\n  $ {c.text}\n{tail}", flush=True)
        elif status in ("skipped", "listed"):
            print(f"{status:8s} {where}  $ {_one_line(c.text)}" + (f"   ({c.skip})" if c.skip else ""), flush=True)
        else:
            print(f"ok       {where}  exit {code}, {secs:.1f} s", flush=True)
        records.append({"file": c.path, "line": c.line, "lang": c.lang, "command": c.text, "status": status,
                        "exit": code, "expected_exit": c.expect_exit, "seconds": round(secs, 2),
                        "skip_reason": c.skip})
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "skipped", "listed")}
    print("docs check: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + f" of {len(records)} commands")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"counts": counts, "commands": records}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
