"""``beam``: the command the design names for a pipeline, ``beam run FILE [options]``.

Apache Beam's Python SDK ships no ``beam`` command (its pipelines are ``python FILE`` programs: the
examples in ``apache_beam/examples/`` end with ``if __name__ == '__main__': run()``). This one runs a
pipeline file as ``python FILE [options]`` would, so that the design's line runs as written::

    beam run dataprep/pack.py --config configs/mixtures/demo.yaml --output build/demo/dataset
    beam run dataprep/pack.py --config ... --output gs://BUCKET/datasets/web-v1 \\
        --runner DataflowRunner --project PROJECT --region us-central1 --temp_location gs://BUCKET/tmp \\
        --setup_file ./pyproject.toml --dry-run        # then without --dry-run

Every option after ``FILE`` goes to the file unchanged (``sys.argv[1:]``), where Beam reads its own
pipeline options: ``PipelineOptions(argv)`` parses them with ``argparse`` (``parse_known_args``, no
abbreviations) over the options of every registered ``PipelineOptions`` subclass (``--runner``,
``--project``, ``--region``, ``--temp_location``, ``--setup_file``, ``--direct_num_workers``, ...;
``--flag=value`` and ``--flag value`` alike), and drops what it does not know with a warning
(``dataprep/pack.py`` refuses those instead, and takes ``--dry-run`` itself).

Before running anything, ``FILE`` is read (not executed) and refused when it defines no pipeline: it
must import ``apache_beam`` and have an ``if __name__ == "__main__":`` block that runs it. Then it
runs as ``__main__`` (``runpy.run_path``), with its own folder first on ``sys.path`` as Python puts
it, so ``save_main_session`` and a file's own path set-up behave as under ``python FILE``.

Exit status: the file's own (``sys.exit`` in its main block; 0 when it returns), 2 usage or a file
that is missing or defines no pipeline.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from typing import Optional, Sequence

EXIT_USAGE = 2
USAGE = """\
usage: beam run FILE [options]

Runs the Apache Beam pipeline file FILE as `python FILE [options]` would; every option after FILE is
the file's, Beam's pipeline options included (read by the pipeline's PipelineOptions), e.g.
  beam run dataprep/pack.py --config configs/mixtures/demo.yaml --output build/demo/dataset
  beam run dataprep/pack.py --config CONFIG --output gs://BUCKET/ds --runner DataflowRunner \\
      --project PROJECT --region REGION --temp_location gs://BUCKET/tmp --setup_file ./pyproject.toml --dry-run
`beam run FILE --help` shows the file's own options.
"""


class NotAPipelineError(ValueError):
    """The file is missing, not Python, or defines no Beam pipeline; the message names it and why."""


def check_pipeline_file(path: str) -> None:
    """Refuses ``path`` unless it is a Python file that imports ``apache_beam`` and has an
    ``if __name__ == "__main__":`` block (read with ``ast``, never executed).

    Raises:
      NotAPipelineError: the file is missing, not valid Python, imports nothing of ``apache_beam``, or
        has no main block (the message names the file and what a pipeline file has).
    """
    if not os.path.isfile(path):
        raise NotAPipelineError(f"{path}: no such file (give the path of a pipeline's .py file, e.g. "
                                f"dataprep/pack.py)")
    if not path.endswith(".py"):
        raise NotAPipelineError(f"{path}: not a Python file (.py); give the path of a pipeline's .py file, e.g. "
                                f"dataprep/pack.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise NotAPipelineError(f"{path}: not a Python file ({type(e).__name__}: {e})") from None
    imports_beam = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "apache_beam" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "apache_beam")
        for n in ast.walk(tree))
    main_block = any(isinstance(n, ast.If) and _is_main_test(n.test) for n in tree.body)
    why = [w for w, ok in (("it imports nothing of apache_beam", imports_beam),
                           ('it has no `if __name__ == "__main__":` block that runs the pipeline', main_block)) if not ok]
    if why:
        raise NotAPipelineError(
            f"{path} defines no Beam pipeline: {' and '.join(why)}. A pipeline file builds a beam.Pipeline from "
            f"PipelineOptions(argv) and ends with `if __name__ == \"__main__\": run()` (as "
            f"apache_beam/examples/wordcount.py does); this project's is dataprep/pack.py")


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def run_file(path: str, args: Sequence[str]) -> int:
    """Runs the pipeline file ``path`` as ``__main__`` with ``args`` as its ``sys.argv[1:]``; returns its
    exit status (``SystemExit``'s code, 0 when it returns). ``sys.argv`` and ``sys.path[0]`` are restored.

    Raises:
      NotAPipelineError: :func:`check_pipeline_file` refused it (nothing was run).
    """
    check_pipeline_file(path)
    saved_argv, saved_path0 = list(sys.argv), (sys.path[0] if sys.path else None)
    sys.argv = [path, *args]
    folder = os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = folder  # as `python FILE` puts it (the file may replace it, as dataprep/pack.py does)
    else:
        sys.path.insert(0, folder)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``beam`` console script: ``beam run FILE [options]``; usage (exit 2) for anything else,
    usage on stdout and exit 0 for ``beam --help`` / ``beam run --help``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]) or args[:2] in (["run", "-h"], ["run", "--help"]):
        print(USAGE, end="")
        return 0
    if len(args) < 2 or args[0] != "run" or args[1].startswith("-"):
        what = ("no command" if not args else "no FILE after 'run'" if args[0] == "run"
                else f"unknown command {args[0]!r}")
        print(f"{USAGE}\nbeam: error: {what}; the one command is `beam run FILE [options]`", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_file(args[1], args[2:])
    except NotAPipelineError as e:
        print(f"beam: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
