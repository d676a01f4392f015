"""One process of the multi-process tests (tests/test_fleet_multiprocess.py): runs commands in order, in
one Python process, as a user's job would (the training command, then ``replay`` commands), so that the
test starts few processes.

    python tests/fleet_worker.py OUT.json -- COMMAND ARGS [-- COMMAND ARGS ...]

COMMAND is ``train`` (``python -m replay.reference.train``'s ``main``) or ``replay`` (``replay.cli.main``).
Each command's exit code and output go to OUT.json, and the worker stops at the first non-zero code.
The first command's process flags (``--coordinator-address`` ...) start ``jax.distributed``; the
later commands find it started.
"""

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv):
    out_path, rest = argv[0], argv[1:]
    commands, current = [], None
    for tok in rest:
        if tok == "--":
            current = []
            commands.append(current)
        else:
            current.append(tok)
    results = []
    for cmd in commands:
        name, args = cmd[0], cmd[1:]
        if name == "train":
            from replay.reference import train as entry

            run = entry.main
        else:
            from replay import cli

            run = cli.main
        buf_out, buf_err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
            code = run(args)
        results.append({"command": cmd, "code": code, "stdout": buf_out.getvalue(), "stderr": buf_err.getvalue()})
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
