"""The ``replay`` command: a thin layer over ``replay.verify.engine``, ``replay.verify.canary``, ``replay.screen.forensics``
and ``replay.drill``. Every decision is made by those library functions; this module parses
arguments, prints, writes files and maps outcomes to exit codes (``replay.verify.verdict.ExitCode``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shlex
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

from replay.runtime import distributed
from replay.run.codes import ExitCode
from replay.run.protocol import FAULT_SITES

DEVICE_SPEC_HELP = """\
device spec (--devices):
  all          every device of this process group
  good         all but the devices held suspect: quarantined (the run's quarantine.txt, or
               --quarantine FILE) or named by 'replay scan' (the run's suspects.json)
  suspect      only the devices held suspect
  0,3,5-7      explicit device ids (jax.Device.id) and inclusive ranges
  process:1    every device of process 1 (process:0-1, process:0,2 also work)
  parts join with '+', e.g. process:0+12. A range replay needs at least as many devices as the
  run's mesh; with twice as many it replays on two disjoint sets, otherwise on two placements
  that put a different device on every mesh position.
"""

RANGE_EXIT_HELP = """\
verdicts and exit codes:
  0  acquitted   the replay on good devices reproduces the log (the cause of a loss spike is the
                 data or the software: run 'replay inspect' on those steps), or the rebuilt batch
                 differs from the logged one (a data or order difference, not a device fault)
  3  convicted   replays on >= 2 independent good device placements agree with each other and
                 not with the log, on some devices of the original run: those devices computed
                 wrong bits (silent data corruption) at the reported step and leaf
  23  link       convicted: at an all-to-all every device sent what the replays sent, and a device
                 received something else: the link sender -> receiver, neither chip alone
  4  ambiguous   replays disagree with each other (flaky hardware in the replay set: rerun with
                 --repeats or other devices), every device differs (software/environment), only a
                 tolerance comparison was possible, or too few independent replays
  2  usage error (bad option, malformed --steps/--devices, too few devices for the run's mesh)
  5  run directory or data error (unknown run, range not logged, no checkpoint, missing dataset)
  6  environment drift: the environment differs from the run's env.json and a bit-exact claim
     was asked for (pass --allow-env-drift, or --tolerance for a weaker comparison)
  20  damaged checkpoint: a restored checkpoint does not match its own state record (its files
      changed after the save): no verdict is given from it; replay from the previous checkpoint
  21  poisoned checkpoint: its replicated state disagreed at the save (an SDC in the update):
      not restored; 'replay certify' names the newest clean checkpoint
  1  internal error (a bug; traceback printed)
"""

# The top-level help: range's codes, then those only other commands give, before code 1.
_RANGE_HEAD, _INTERNAL_LINE = RANGE_EXIT_HELP.rsplit("\n  1  ", 1)
VERDICT_HELP = (
    _RANGE_HEAD.replace("verdicts and exit codes:",
                        "verdicts and exit codes (of every command; each command's --help lists its own):", 1)
    + "\n  7  drill not caught (replay or canary failed to name the injected device and step)"
    + "\n  8  suspects found ('replay scan': the logs name suspect devices, router layers, the loader or the run)"
    + "\n  10  triage: hardware (a device convicted or suspect); 0 is triage's optimization event (rewind, skip)"
    + "\n  11  triage: a restart or data-order fault (a restore repeated or skipped data)"
    + "\n  12  triage: data (shards and documents named)"
    + "\n  13  triage: router instability (layers named)"
    + "\n  22  the training command: stopped on a non-finite loss, gradient or state (non_finite: stop)"

    + "\n  1  " + _INTERNAL_LINE)

CANARY_EXIT_HELP = """\
verdicts and exit codes:
  0  acquitted   every chosen device and repeat gives the golden fingerprints (or, with no golden
                 value yet, agrees with the majority that makes it)
  3  convicted   a device disagrees with the golden value or with its own repeats: it is named
  4  ambiguous   every device agrees with the others but not with the golden value (an environment
                 or software change: --reset-golden), or no majority makes a golden value
  2  usage error (bad option, malformed --devices, --rows or --step out of range)
  5  run directory or data error (unknown run, no checkpoint N for --checkpoint N, corrupt golden file,
     missing dataset)
  20  damaged checkpoint: --checkpoint N does not match its own state record (no verdict from it)
  21  poisoned checkpoint: --checkpoint N's replicas disagreed at its save
  1  internal error (a bug; traceback printed)
"""

DRILL_EXIT_HELP = """\
exit codes:
  0  every drill caught: range replay convicted the injected device at the injected step and the
     canary named it (--scenario: 'replay scan' named the device and the first step)
  7  drill not caught (replay or canary failed to name the injected device and step)
  2  usage error (bad option, malformed --devices, a fault field out of range: --step, --device,
     --leaf, --element, --bit)
  5  run directory or data error (unknown run, no checkpoint, missing dataset)
  1  internal error (a bug; traceback printed)
"""

SCAN_EXIT_HELP = """\
exit codes:
  0  clean: every available check is clear (a check whose signal the run did not log says
     'not available', never 'clear'); with --follow: stopped with no suspect
  8  suspects found (devices, replicas, router layers, the loader or the run): suspects.json
     written in the run directory; replay the suggested range with --devices good
  2  usage error (bad option, malformed --steps)
  5  run directory or data error (unknown run, range not logged, malformed log)
"""

INSPECT_TEXT_HELP = """\
decoded text (--text) is the tokenizer's normalization, not the original bytes:
  SentencePiece normalizes text before encoding it, and decoding gives the normalized text. With
  the default nmt_nfkc: U+FE30 becomes '..', 'ﬁ' (U+FB01) becomes 'fi', full-width digits become
  ASCII, runs of whitespace (newlines too) collapse to one space; a character missing from the
  vocabulary (no byte fallback) shows as ' ⁇ '; a row boundary inside a multi-byte character
  decodes to U+FFFD on each side. For the exact tokens use --json OUT: every document carries its
  token_ids (docs/dataprep.md, "Decoded text is the normalized text").
"""

INSPECT_EXIT_HELP = """\
exit codes:
  0  the documents were listed
  2  usage error (bad option, malformed --steps, too many steps)
  5  run directory or data error (unknown run, missing dataset or shard, tokenizer unavailable for --text)
"""

TRIAGE_EXIT_HELP = """\
conclusions and exit codes (each conclusion its own code):
  0   optimization event: no check found a cause; rewind and skip the window (the exact
      'replay skip' command is printed)
  10  hardware: a device convicted by the range replay (--replay) or named by the canary or the
      replica checks
  11  restart or data-order fault: a restore repeated or skipped data (the exact restore check)
  12  data: outlier rows at the onset (shards and documents named)
  13  router instability (layers named)
  2   usage error (bad option, --step missing)
  5   run directory or data error (unknown run, step not logged, malformed log)
"""

SKIP_EXIT_HELP = """\
exit codes:
  0  recorded: the next 'python -m replay.reference.train --run DIR' resumes from the checkpoint with
     the window skipped
  2  usage error, or a window or checkpoint that does not fit the run (named, with what fits)
  5  run directory or data error
"""

GOODPUT_EXIT_HELP = """\
exit codes:
  0  the report was made (every part of the wall time accounted; parts the log cannot tell are
     reported as unknown)
  2  usage error (bad option, --peak-flops not a finite number > 0)
  5  run directory or data error (unknown run, malformed log, no attempt to account for)
"""

CERTIFY_EXIT_HELP = """\
verdicts and exit codes:
  0  every checkpoint of the chain certified: replaying each segment on good devices reproduces the
     next checkpoint's state record exactly, and its files restore to it
  21  poisoned checkpoint found: its replicas disagreed at the save, or the replay of its segment does
      not reach its record (the step and devices, or the leaves, are named); rewind to the certified one
  20  damaged checkpoint (and none poisoned): the replay reaches its record but its files do not
  4  a checkpoint is not certifiable (no state record: a run from before records; a non-finite state)
  2  usage error (bad option, --from not a checkpoint)
  5  run directory or data error (unknown run, fewer than two checkpoints)
  6  environment drift (pass --allow-env-drift)
"""

MAX_INSPECT_STEPS = 10_000

DRILL_NOT_CAUGHT = int(ExitCode.DRILL_NOT_CAUGHT)
TRIAGE_SCENARIOS = ("sdc", "restart", "data", "duplicate", "router", "router_scale", "nonfinite", "clean")


def _nonfinite_value(value: Optional[float]) -> Optional[str]:
    """A triage drill's ``--value``: ``"nan"``, ``"inf"`` or None (not given); a finite value is a usage
    error (the nonfinite scenario plants a NaN or an Inf)."""
    if value is None:
        return None
    if math.isnan(value):
        return "nan"
    if math.isinf(value) and value > 0:
        return "inf"
    raise _Usage(f"--value {value!r}: a triage drill's nonfinite scenario takes nan or inf")


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (``nan``, ``inf`` and ``0`` are usage errors, exit 2)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


RUN_HELP = ("the training run directory (run_config.yaml, env.json, fingerprints.jsonl, ...); default: "
            "$REPLAY_RUN, else the current folder if it is a run directory")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default exit code 2 is ExitCode.USAGE already; keep its text
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.USAGE), f"{self.prog}: error: {message}\n")


class _TopParser(_Parser):
    """The top-level parser: its help also lists the options of the default command (range)."""

    range_parser: Optional[argparse.ArgumentParser] = None

    def format_help(self) -> str:
        text = super().format_help()
        if self.range_parser is None:
            return text
        formatter = self._get_formatter()
        formatter.start_section("range options (the default command: 'replay --steps A:B' is 'replay range "
                                "--steps A:B')")
        formatter.add_arguments([a for a in self.range_parser._actions if not isinstance(a, argparse._HelpAction)])
        formatter.end_section()
        options = formatter.format_help()
        head, sep, tail = text.partition("\n" + DEVICE_SPEC_HELP.splitlines()[0])
        return head.rstrip("\n") + "\n\n" + options + sep + tail if sep else text + "\n" + options


# ----------------------------------------------------------------------------- the commands, declared
#
# Each subcommand is one Command of COMMAND_TABLE (at the end of this module, beside the handlers): its
# help line, description and epilog (its exit codes), the shared parent parsers its first options come
# from, its own options, and its handler. build_parser makes the parser from the table; main dispatches
# through it.

Arg = tuple[tuple[str, ...], dict[str, Any]]


def _arg(*flags: str, **kwargs: Any) -> Arg:
    """One option of a command: ``add_argument``'s flags and keywords."""
    return flags, kwargs


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``replay`` subcommand: ``replay <name> --help`` shows ``description``, then the options of its
    ``parents`` (shared parent parsers, made fresh for each command) and its own ``args``, then ``epilog``;
    ``help`` is its line in ``replay --help``; ``handler(args, console)`` returns its exit code."""

    name: str
    help: str
    description: str
    epilog: str
    handler: Callable[[Any, Any], int]
    parents: tuple[Callable[[], argparse.ArgumentParser], ...] = ()
    args: tuple[Arg, ...] = ()


def _parent(*args: Arg, processes: bool = False) -> argparse.ArgumentParser:
    """A parent parser (options several commands share) holding ``args``, and with ``processes`` the
    process flags of ``replay.run.distributed`` in their group."""
    p = argparse.ArgumentParser(add_help=False)
    for flags, kwargs in args:
        p.add_argument(*flags, **kwargs)
    if processes:
        distributed.add_arguments(p)
    return p


def _run_option(help: str = RUN_HELP) -> Callable[[], argparse.ArgumentParser]:
    """The parent of ``--run DIR``."""
    return lambda: _parent(_arg("--run", metavar="DIR", help=help))


def _processes() -> argparse.ArgumentParser:
    """The parent of the process flags (commands that can run as several processes)."""
    return _parent(processes=True)


def _device_work(devices: str) -> Callable[[], argparse.ArgumentParser]:
    """The parent of the commands that run steps on devices (range, canary, drill, certify): ``--run``,
    ``--devices`` (default ``devices``), ``--quarantine``, ``--json``, ``--no-progress`` and the
    process flags."""
    return lambda: _parent(
        _arg("--run", metavar="DIR", help=RUN_HELP),
        _arg("--devices", metavar="SPEC", default=devices, help=f"device spec (default {devices}); see below"),
        _arg("--quarantine", metavar="FILE", help="quarantined device ids, one a line (default: <run>/quarantine.txt)"),
        _arg("--json", metavar="OUT", help="write the full report as JSON here"),
        _arg("--no-progress", action="store_true",
             help="no progress bar or progress lines (the closing 'done in' line stays)"),
        processes=True)


def build_parser() -> argparse.ArgumentParser:
    """The ``replay`` parser: the top-level help, then one subparser per :data:`COMMAND_TABLE` entry."""
    fmt = argparse.RawDescriptionHelpFormatter
    names = ",".join(COMMANDS)
    parser = _TopParser(
        prog="replay",
        usage="replay [range] [--run DIR] --steps A:B [--devices SPEC] [range options]\n"
              "       replay {canary,certify,inspect,scan,triage,skip,goodput,drill} [--run DIR] [options]   "
              "(replay COMMAND --help)",
        description="Triage a training run: rerun step ranges and canary batches on chosen devices, diff\n"
                    "gradient fingerprints against the run's log and give a silent-data-corruption verdict;\n"
                    "list the documents of any batch.\n\n"
                    "  replay --run DIR --steps A:B --devices good     rerun steps A..B-1 and diff\n"
                    "  replay canary --run DIR --devices all           fixed canary batch on every device\n"
                    "  replay inspect --run DIR --steps A:B [--text]   which documents were in those batches\n"
                    "  replay scan --run DIR [--steps A:B]             screen the logs alone, rank suspects\n"
                    "  replay triage --run DIR --step S                walk a loss spike: events, replicas, data, router\n"
                    "  replay skip --run DIR --steps A:B --reason R    rewind before a spike and skip its data window\n"
                    "  replay goodput --run DIR                        where the run's time and tokens went\n"
                    "  replay drill --run DIR                          inject a fault, prove it is caught\n"
                    "  replay certify --run DIR [--from STEP]          walk the checkpoints, certify the newest clean\n\n"
                    "--run DIR may be left out: $REPLAY_RUN, else the current folder if it is a run directory.",
        epilog=DEVICE_SPEC_HELP + "\n" + VERDICT_HELP, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", title="commands", metavar="{" + names + "}", parser_class=_Parser)
    for c in COMMAND_TABLE:
        p = sub.add_parser(c.name, prog=f"replay {c.name}", help=c.help, description=c.description, epilog=c.epilog,
                           formatter_class=fmt, parents=[make() for make in c.parents])
        for flags, kwargs in c.args:
            p.add_argument(*flags, **kwargs)
        if c.name == "range":
            parser.range_parser = p
    return parser


def _cmd_certify(args, console) -> int:
    from replay.verify import certify, engine
    from replay import report

    run = _load(args.run, args.quarantine)
    _check_outputs(run.run_dir, json=args.json, plot=args.plot)
    session = engine.Session(run)
    rep = _with_progress(args, "certify", lambda factory: certify.certify(
        session, start=args.from_step, stop=args.to_step, device_spec=args.devices, concurrent=not args.sequential,
        allow_env_drift=args.allow_env_drift, progress=factory),
        first="restoring the trusted checkpoint and compiling the step: the first step takes longer")
    out = rep.to_dict()
    report.render_certify(out, console)
    if args.json and _primary():
        report.write_json(out, args.json)
    if args.plot and _primary():
        certify.plot_chain(out, args.plot)
        console.print(f"the checkpoint chain: {args.plot}")
    return rep.exit_code


def _progress(args, label, unit="step", breakdown=None, first=None):
    """A ``total -> advance`` factory (what ``replay_range`` and ``run_canary`` take) of counted
    ``replay.runtime.progress`` progress on stderr, and the list that :func:`_close` closes."""
    from replay.runtime.progress import StepProgress

    stack = []

    def factory(total):
        shown = StepProgress(label, 0, total, unit=unit, counted=True, enabled=not args.no_progress,
                             breakdown=breakdown, first=first)
        stack.append(shown)
        return shown.advance

    return factory, stack


def _close(stack, ok=True):
    """Closes the progress of :func:`_progress`: its closing line (``done in``), or where it stopped."""
    while stack:
        stack.pop().close(ok)


def _with_progress(args, label, work, unit="step", **shown):
    """``work(progress factory)`` with :func:`_progress` shown (``shown``: its ``breakdown`` and
    ``first``) and closed (where it stopped, on an error)."""
    factory, stack = _progress(args, label, unit=unit, **shown)
    try:
        out = work(factory)
    except BaseException:
        _close(stack, ok=False)
        raise
    _close(stack)
    return out


def _cmd_range(args, console) -> int:
    from replay.verify import engine
    from replay import report
    from replay.run.runlog import parse_steps

    start, stop = parse_steps(args.steps)
    for name in ("repeats", "placements"):
        if getattr(args, name) < 1:
            raise _Usage(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tolerance is not None and not 0 < args.tolerance < 1:
        raise _Usage(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if args.onset is not None and args.onset < 0:
        raise _Usage(f"--onset must be a step >= 0, got {args.onset}")
    run = _load(args.run, args.quarantine)
    _check_outputs(run.run_dir, json=args.json, plot=args.plot)
    run.check_range(start, stop)
    ckpt = run.checkpoint_for(start)
    session = engine.Session(run)
    n, times = stop - ckpt, f" x {args.repeats} repeats" if args.repeats > 1 else ""
    from replay.verify.plan import Onset

    onset = "auto" if args.onset is None else Onset.at(args.onset)
    rep = _with_progress(args, f"replay {start}:{stop}", lambda factory: engine.replay_range(
        session, start, stop, device_spec=args.devices, repeats=args.repeats, tolerance=args.tolerance,
        allow_env_drift=args.allow_env_drift, progress=factory, replays=args.placements, onset=onset,
        exhaustive=args.exhaustive, concurrent=not args.sequential),
        breakdown=f"{n} step{'s' if n > 1 else ''} from checkpoint {ckpt} x "
                  f"{args.placements} placement{'s' if args.placements > 1 else ''}{times}"
                  + (", the onset's segment first" if args.onset is not None else ""),
        first=f"restoring checkpoint {ckpt} and compiling the step: the first step takes longer")
    out = rep.to_dict()
    report.render_range(out, console)
    if args.json and _primary():
        report.write_json(out, args.json)
    if args.plot and _primary():
        report.plot_range(out, args.plot)
    return rep.exit_code


def _cmd_canary(args, console) -> int:
    from replay.verify import canary
    from replay.verify import engine
    from replay import report

    if args.repeats < 1:
        raise _Usage(f"--repeats must be >= 1, got {args.repeats}")
    if args.step is not None and args.step < 0:
        raise _Usage(f"--step must be >= 0, got {args.step}")
    run = _load(args.run, args.quarantine)
    _check_outputs(run.run_dir, json=args.json, golden=args.golden)
    session = engine.Session(run)
    if args.rows is not None and not 1 <= args.rows <= session.setup.global_batch:
        raise _Usage(f"--rows must be in [1, {session.setup.global_batch}] (the run's global batch), got {args.rows}")
    if args.seq_len is not None and args.seq_len < 2:
        raise _Usage(f"--seq-len must be >= 2, got {args.seq_len}")
    rep = _with_progress(args, "canary", lambda factory: canary.run_canary(
        session, device_spec=args.devices, repeats=args.repeats, checkpoint=args.checkpoint, step=args.step,
        rows=args.rows, seq_len=args.seq_len, golden_path=args.golden or "default", reset_golden=args.reset_golden,
        progress=factory), unit="run")
    out = rep.to_dict()
    report.render_canary(out, console)
    if args.json and _primary():
        report.write_json(out, args.json)
    return rep.exit_code


def _cmd_inspect(args, console) -> int:
    from replay.verify import engine
    from replay.screen import forensics
    from replay import report
    from replay.run.runlog import parse_steps

    start, stop = parse_steps(args.steps)
    run = _load(args.run)
    _check_outputs(run.run_dir, json=args.json)
    if stop - start > MAX_INSPECT_STEPS:
        raise _Usage(f"--steps {args.steps}: {stop - start} steps; inspect lists at most {MAX_INSPECT_STEPS} a call")
    session = engine.Session(run)
    data = session.lookup_loader()
    tok = getattr(getattr(getattr(data, "mixture", None), "tokenizer", None), "path", None)
    rep = forensics.inspect_steps(data, start, stop, text=args.text, tokenizer_path=tok,
                                  dataset=session.setup.dataset, token_ids=bool(args.json))
    out = rep.to_dict()
    report.render_inspect(out, console, max_rows=args.max_rows)
    if args.json and _primary():
        report.write_json(out, args.json)
    return int(ExitCode.ACQUITTED)


def _cmd_scan(args, console) -> int:
    from replay import report
    from replay.screen import scan
    from replay.run.runlog import parse_steps

    if args.on_suspect and not args.follow:
        raise _Usage("--on-suspect needs --follow (it runs at the first suspect of a live run)")
    if args.follow:
        return _scan_follow(args, console)
    start, stop = parse_steps(args.steps) if args.steps else (None, None)
    run = _load(args.run)
    _check_outputs(run.run_dir, json=args.json, plot=args.plot)
    rep = scan.scan_run(run, start, stop)
    out = rep.to_dict()
    report.render_scan(out, console)
    if not _primary():  # process 0 writes the run's files and the outputs
        return rep.exit_code
    try:
        where = scan.write_suspects(rep)
        console.print(f"suspects.json: {where}")
    except OSError as e:  # a read-only run directory: the report stands
        console.print(f"[yellow]note:[/] suspects.json not written ({e.strerror or e}); --devices suspect "
                      f"will not see these suspects")
    if args.json:
        report.write_json(out, args.json)
    if args.plot:
        report.plot_scan(rep, args.plot)
    return rep.exit_code


def _scan_follow(args, console) -> int:
    """``replay scan --follow``: watch the run as it grows (``replay.screen.scan.follow``)."""
    import json
    import subprocess
    import time

    from rich.markup import escape

    from replay import report
    from replay.screen import scan

    if args.steps or args.plot:
        raise _Usage("--follow scans the whole run as it grows: --steps and --plot do not apply")
    if not args.interval > 0 or (args.timeout is not None and not args.timeout > 0):
        raise _Usage(f"--interval and --timeout must be > 0, got {args.interval} and {args.timeout}")
    if os.path.exists(args.run):
        _check_outputs(args.run, json=args.json)
    started: list = []

    def on_new(sus, rep):
        nxt = sus.get("next") or {}
        console.print(f"[bold red]suspect[/] {escape(sus['subject'])} from step {sus['first_step']} "
                      f"({', '.join(sorted({e['check'] for e in sus['evidence']}))}): "
                      f"{escape(sus['evidence'][0]['detail'])}")
        console.print(f"next: {escape(nxt.get('command') or nxt.get('sentence') or '')}"
                      + (f"   ({escape(nxt['sentence'])})" if nxt.get("command") and nxt.get("sentence") else ""))

    def on_first(sus, rep):
        if not args.on_suspect:
            return
        payload = {"kind": "suspect", "run": args.run, "suspect": sus, "next": sus.get("next"),
                   "scanned_steps": rep["steps"], "time": time.time()}
        proc = subprocess.Popen(args.on_suspect, shell=True, stdin=subprocess.PIPE, text=True)
        try:
            proc.stdin.write(json.dumps(payload, sort_keys=True) + "\n")
            proc.stdin.close()
        except BrokenPipeError:  # the command did not read its stdin
            pass
        started.append(proc)
        console.print(f"--on-suspect: started {escape(args.on_suspect)} (pid {proc.pid}) with the suspect on stdin")

    def on_look(rep, steps):
        console.print(f"scan --follow: {steps} step(s) scored, {len(rep['suspects'])} suspect(s)")

    res = scan.follow(args.run, on_new=on_new, on_first=on_first, interval=args.interval, timeout=args.timeout,
                      on_look=on_look)
    for proc in started:
        try:
            rc = proc.wait(timeout=600)
            console.print(f"--on-suspect command exited {rc}")
        except subprocess.TimeoutExpired:
            console.print(f"--on-suspect command (pid {proc.pid}) still running after 600 s; left running")
    console.print(f"scan --follow: stopped ({'the run ended' if res['ended'] else 'timeout'}) after {res['steps']} "
                  f"step(s); {len(res['suspects'])} suspect(s)")
    if args.json and res["report"] is not None:
        report.write_json({**res["report"], "follow": {k: res[k] for k in ("looks", "steps", "ended")}}, args.json)
    return int(ExitCode.SUSPECTS if res["suspects"] else ExitCode.CLEAN)


def _cmd_triage(args, console) -> int:
    from replay import report
    from replay.screen import triage

    run = _load(args.run, args.quarantine)
    _check_outputs(run.run_dir, json=args.json, plot=args.plot)
    if args.window < 1:
        raise _Usage(f"--window must be >= 1, got {args.window}")
    rep = _with_progress(args, f"triage replay {args.step}", lambda factory: triage.triage_run(
        run, args.step, window=args.window, replay=args.replay, device_spec=args.devices, progress=factory))
    out = rep.to_dict()
    report.render_triage(out, console)
    if args.json:
        report.write_json(out, args.json)
    if args.plot:
        report.plot_triage(rep, args.plot)
        console.print(f"dashboard: {args.plot}")
    return rep.exit_code


def _cmd_skip(args, console) -> int:
    from rich.markup import escape

    from replay import report
    from replay.run import skip
    from replay.run.runlog import parse_steps

    start, stop = parse_steps(args.steps)
    run = _load(args.run)
    _check_outputs(run.run_dir, json=args.json)
    try:
        req = skip.plan(run, start, stop, args.reason, args.checkpoint)
    except skip.SkipError as e:
        raise _Usage(str(e)) from None
    events = skip.record(run, req)
    console.print(f"recorded in {escape(os.path.join(run.run_dir, 'events.jsonl'))}: skip the data of steps "
                  f"{req.start}..{req.stop - 1} (from step {req.start} on, step s trains on the data of s + "
                  f"{req.stop - req.start}) and rewind to checkpoint {req.checkpoint}; the {req.superseded_steps} "
                  f"step(s) {req.checkpoint}..{req.lineage_end - 1} become a superseded attempt (kept) when training "
                  "resumes")
    console.print("replay inspect and range replay follow the window now")
    console.print(f"next: {escape(shlex.join(['python', '-m', 'replay.reference.train', '--run', run.run_dir]))}")
    if args.json:
        report.write_json({"kind": "skip", "run": run.run_dir, **req.to_dict(), "events": events}, args.json)
    return int(ExitCode.ACQUITTED)


def _cmd_goodput(args, console) -> int:
    from replay import report
    from replay.screen import goodput

    run = _load(args.run)
    _check_outputs(run.run_dir, json=args.json, plot=args.plot)
    rep = goodput.account(run, peak_flops=args.peak_flops, mtbf_s=args.mtbf)
    out = rep.to_dict()
    report.render_goodput(out, console)
    if args.json:
        report.write_json(out, args.json)
    if args.plot:
        report.plot_goodput(rep, args.plot)
        console.print(f"waterfall and goodput over time: {args.plot}")
    return int(ExitCode.ACQUITTED)


def _cmd_drill(args, console) -> int:
    from replay.verify import engine

    if args.scenario in (*TRIAGE_SCENARIOS, "all"):
        return _triage_drills(args, console)
    args.count = 1 if args.count is None else args.count
    if args.count < 1:
        raise _Usage(f"--count must be >= 1, got {args.count}")
    if args.to_disk and os.path.exists(args.to_disk) and (not os.path.isdir(args.to_disk) or os.listdir(args.to_disk)):
        raise _Usage(f"--to-disk {args.to_disk}: must be a new or empty folder")
    if args.to_disk and not args.scenario and distributed.is_initialized() and distributed.process_count() > 1:
        raise _Usage("--to-disk (a drill written as a short training run) runs as one process: start it without the "
                     "process flags")
    run = _load(args.run, args.quarantine)
    _check_outputs(run.run_dir, json=args.json, to_disk=args.to_disk)
    session = engine.Session(run)
    rng = random.Random(args.seed)
    from replay.runtime.progress import step_progress

    with step_progress("drill" + (f" {args.scenario}" if args.scenario else ""), 0, args.count, unit="drill",
                       counted=True, enabled=not args.no_progress) as shown:
        if args.scenario:
            return _scenario_drills(args, console, session, rng, shown)
        return _flip_drills(args, console, session, rng, shown)


def _triage_drills(args, console) -> int:
    import tempfile

    from replay import report
    from replay import triage_drill

    count = 5 if args.count is None else args.count
    if count < 1:
        raise _Usage(f"--count must be >= 1, got {count}")
    if args.to_disk and os.path.exists(args.to_disk) and (not os.path.isdir(args.to_disk) or os.listdir(args.to_disk)):
        raise _Usage(f"--to-disk {args.to_disk}: must be a new or empty folder")
    root = args.to_disk or tempfile.mkdtemp(prefix="replay-triage-drill-")
    scenarios = TRIAGE_SCENARIOS if args.scenario == "all" else (args.scenario,)
    seeds = list(range(args.seed, args.seed + count))
    from replay.runtime.progress import step_progress

    nonfinite = _nonfinite_value(args.value)
    per = {name: len(triage_drill.GRIDS[name]) if args.grid and not (nonfinite and name == "nonfinite") else 1
           for name in scenarios}
    with step_progress(f"drill {args.scenario}", 0, count * sum(per.values()), unit="drill", counted=True,
                       enabled=not args.no_progress) as shown:
        grids = dict(triage_drill.GRIDS)
        if nonfinite:
            triage_drill.GRIDS["nonfinite"] = (nonfinite,)
        try:
            res = triage_drill.run_drills(scenarios, seeds, root, grid=args.grid, on_result=lambda r, n: (
                console.print(triage_drill.result_line(r)), shown.update(n)))
        finally:
            triage_drill.GRIDS.update(grids)
    report.render_triage_drills(res, console)
    if args.json:
        report.write_json(res, args.json)
    return int(ExitCode.ACQUITTED) if res["correct"] == res["total"] else DRILL_NOT_CAUGHT


def _flip_drills(args, console, session, rng, shown) -> int:
    from replay import drill
    from replay import report

    results = []
    for n in range(args.count):
        fault = drill.random_fault(session, rng, args.step, args.device, args.leaf, args.element, args.bit,
                                   where=args.where, layer=args.layer, mode=args.mode, value=args.value)
        to_disk = None if not args.to_disk else os.path.join(args.to_disk, f"drill-{n}")
        res = drill.run_drill(session, fault, device_spec=args.devices, canary=not args.no_canary, to_disk=to_disk)
        results.append(res)
        mark = "[green]caught[/]" if res.caught else "[red]NOT caught[/]"
        named = "; ".join(d["label"] for d in res.range_report.convicted) or list(res.range_report.decision.devices)
        odd = None if res.canary_report is None else (
            "; ".join(d["label"] for d in res.canary_report.to_dict()["odd"]) or "none")
        console.print(f"drill {fault}: {mark} (range: {res.range_report.verdict.value} {named} at step "
                      f"{res.range_report.decision.step}; canary: {odd}"
                      + (f"; first divergent buffer: {res.range_report.decision.site}"
                         f"{'' if res.site_ok else ' (NOT where planted)'}" if res.site_ok is not None else "") + ")"
                      + (f"; differing elements after the step: {res.range_report.differing_elements}"
                         if res.range_report.differing_elements else ""))
        shown.update(n + 1)
    caught = sum(r.caught for r in results)
    console.print(f"{caught} of {len(results)} drill(s) caught")
    if args.json and _primary():
        report.write_json({"kind": "drills", "caught": caught, "total": len(results),
                           "drills": [r.to_dict() for r in results]}, args.json)
    return int(ExitCode.ACQUITTED) if caught == len(results) else DRILL_NOT_CAUGHT


def _scenario_drills(args, console, session, rng, shown) -> int:
    import tempfile

    from replay import drill
    from replay import report

    if args.magnitude <= 0 or args.flips < 1:
        raise _Usage(f"--magnitude must be > 0 and --flips >= 1, got {args.magnitude} and {args.flips}")
    root = args.to_disk or distributed_first(lambda: tempfile.mkdtemp(prefix="replay-drill-"))
    results = []
    for n in range(args.count):
        out = os.path.join(root, f"{args.scenario}-{n}")
        res = drill.run_scenario(session, args.scenario, out, rng=rng, device=args.device, start=args.step,
                                 magnitude=args.magnitude, kind=args.kind, flips=args.flips, bit=args.bit)
        results.append(res)
        named = res.named
        mark = "[green]caught[/]" if res.caught else "[red]NOT caught[/]"
        console.print(f"drill {args.scenario} on device {res.device} from step {res.first_step}: {mark} (scan "
                      f"named {'nothing' if named is None else named['devices']} from step "
                      f"{None if named is None else named['first_step']}; run in {out})")
        shown.update(n + 1)
    caught = sum(r.caught for r in results)
    console.print(f"{caught} of {len(results)} {args.scenario} drill(s) caught")
    if not args.to_disk:  # a drilled run is a whole run directory: kept for a look, named for its removal
        console.print(f"the drilled run(s) are kept in {root} (a copy of the run, never the run itself): read them "
                      f"with replay scan / replay --run {os.path.join(root, args.scenario + '-0')}; rm -r {root} "
                      "when done, or pass --to-disk DIR to choose where they go")
    if args.json and _primary():
        report.write_json({"kind": "scenario_drills", "scenario": args.scenario, "caught": caught,
                           "total": len(results), "drills": [r.to_dict() for r in results]}, args.json)
    return int(ExitCode.ACQUITTED) if caught == len(results) else DRILL_NOT_CAUGHT


class _Usage(ValueError):
    pass


def distributed_first(make):
    """``make()`` on process 0, the same value on every process of a multi-process command."""
    if "jax" not in sys.modules or not distributed.is_initialized() or distributed.process_count() == 1:
        return make()
    return distributed.gather_json(make() if distributed.process_index() == 0 else None)[0]


def _primary() -> bool:
    """Whether this process writes the command's outputs and prints its report (process 0 of a
    multi-process replay; the only process otherwise)."""
    if "jax" not in sys.modules or not distributed.is_initialized():
        return True
    return distributed.process_index() == 0


def _load(run_dir: str, quarantine: Optional[str] = None):
    """``replay.run.runlog.load_run``, then its notes on stderr (e.g. the mixture it rebuilds batches
    with: the run's own copy when the file changed since), one line each."""
    from rich.markup import escape

    from replay.report import make_console
    from replay.run.runlog import load_run

    run = load_run(run_dir, quarantine)
    err = make_console(stderr=True)
    for note in run.notes:
        err.print(f"[yellow]note:[/] {escape(note)}")
    return run


def _check_outputs(run_dir: str, **paths: Optional[str]) -> None:
    """Refuses, before any device work, output paths that are folders or that would overwrite the
    run's own files (its config, env record, logs, quarantine file or checkpoints): replay reads a
    run directory and never writes into it, but for its documented outputs (canary/golden.json,
    and suspects.json from scan)."""
    from replay.runtime.devices import QUARANTINE_NAME
    from replay.run.runlog import CHECKPOINTS, ENV_JSON, EVENTS, FINGERPRINTS, RUN_CONFIG

    run = os.path.realpath(run_dir)
    from replay.run.protocol import CANARY_NAME, SIGNALS_NAME, SUSPECTS_NAME

    protected = {os.path.join(run, n) for n in (RUN_CONFIG, ENV_JSON, EVENTS, FINGERPRINTS, QUARANTINE_NAME,
                                                 SIGNALS_NAME, CANARY_NAME, SUSPECTS_NAME)}
    ckpts = os.path.join(run, CHECKPOINTS)
    for name, path in paths.items():
        if not path:
            continue
        flag = "--" + name.replace("_", "-")
        real = os.path.realpath(path)
        if real in protected or real == ckpts or real.startswith(ckpts + os.sep) or real == run:
            raise _Usage(f"{flag} {path}: would write into the run's own files; replay leaves the run directory "
                         f"read-only (choose another path)")
        if name != "to_disk" and os.path.isdir(path):
            raise _Usage(f"{flag} {path}: is a folder; give a file name")
        parent = os.path.dirname(os.path.abspath(path))
        while parent != os.path.dirname(parent) and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise _Usage(f"{flag} {path}: {parent} is not a folder")


def _pin_determinism_flags(run_dir: Optional[str]) -> list[str]:
    """Adds to ``XLA_FLAGS`` the determinism flags (``replay.run.env.DETERMINISM_XLA_FLAGS``) that the run
    recorded in its env.json and this process lacks (the training command pins them), so that a replay
    compiles as the run did and is not refused as drift; returns those added. Only while JAX's backend
    is not initialized (afterwards they would be recorded without taking effect); a run directory that
    cannot be read is left to ``load_run`` to report."""
    import json

    from replay.run.env import DETERMINISM_XLA_FLAGS

    if not run_dir:
        return []
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge

            if xla_bridge.backends_are_initialized():
                return []
        except Exception:  # noqa: BLE001 - a JAX without this private API: leave the flags alone
            return []
    try:
        with open(os.path.join(run_dir, "env.json"), encoding="utf-8") as f:
            recorded = str(((json.load(f) or {}).get("env") or {}).get("XLA_FLAGS") or "").split()
    except Exception:  # noqa: BLE001
        return []
    current = os.environ.get("XLA_FLAGS", "")
    present = {f.split("=")[0] for f in current.split()}
    added = [f for f in DETERMINISM_XLA_FLAGS if f in recorded and f.split("=")[0] not in present]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def _start_processes(args, err) -> None:
    """Joins the replay's processes (``--coordinator-address``/``--num-processes``/``--process-id``, or
    the cluster JAX detects: ``replay.runtime.distributed``) before JAX starts; as one process, reduces as
    the run recorded (a run that reduced with gloo replays under a one-process ``jax.distributed`` with
    gloo: the collectives decide a step's bits). Does nothing when JAX's backend has started (a test
    calling ``main`` in-process) or for commands without devices."""
    import json

    dargs = distributed.from_args(args)
    if dargs is not None:
        if not distributed.is_initialized():
            distributed.initialize(dargs)
        return
    if args.command not in ("range", "canary", "drill", "certify"):
        return
    try:
        with open(os.path.join(args.run, "env.json"), encoding="utf-8") as f:
            recorded = json.load(f)
    except Exception:  # noqa: BLE001 - load_run reports an unreadable run directory
        return
    if distributed.match_collectives(recorded):
        err.print("collectives: gloo in one process, as the run reduced (replay.runtime.distributed)")


def _with_steps(typed: Sequence[str], steps: str, option: str = "--steps") -> list[str]:
    """The command line ``typed`` (as the user gave it, without ``replay``) with ``--steps`` (or
    ``option``) set to ``steps``."""
    out, replaced, skip = [], False, False
    for n, tok in enumerate(typed):
        if skip:
            skip = False
            continue
        if tok == option and n + 1 < len(typed):
            out += [option, steps]
            replaced = skip = True
        elif tok.startswith(f"{option}="):
            out.append(f"{option}={steps}")
            replaced = True
        else:
            out.append(tok)
    return out if replaced else [*out, option, steps]


def _next_commands(typed: Sequence[str], args, e) -> list[tuple[str, str]]:
    """``(command, why)`` to try after a range outside the logged steps (``StepRangeError``): the
    same command on the nearest logged range, and ``replay inspect``, which lists any step."""
    out = []
    if e.suggestion is not None:
        a, b = e.suggestion
        if args.command == "triage":  # one step (--step), the nearest logged one
            near = a if e.start is not None and e.start < a else b - 1
            out.append((shlex.join(["replay", *_with_steps(typed, str(near), "--step")]), "the nearest logged step"))
        else:
            out.append((shlex.join(["replay", *_with_steps(typed, f"{a}:{b}")]), "the nearest logged range"))
    if e.start is not None and e.start >= 0 and args.command != "inspect":
        run = ["--run", args.run] if args.run_source == "--run" else []
        stop = min(e.stop, e.start + MAX_INSPECT_STEPS)
        out.append((shlex.join(["replay", "inspect", *run, "--steps", f"{e.start}:{stop}"]),
                    "lists the documents of any step, logged or not"))
    return out


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--steps -5:3`` written ``--steps=-5:3``: argparse reads a value that starts with
    ``-`` (other than a plain negative number) as an option and stops with "expected one argument"; joined
    to its option, the value reaches ``parse_steps``, whose usage error says what a range looks like."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return out + list(argv[i:])
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if tok == "--steps" and len(nxt) > 1 and nxt[0] == "-" and (nxt[1].isdigit() or nxt[1] in ":."):
            out.append(f"{tok}={nxt}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


COMMAND_TABLE: tuple[Command, ...] = (
    Command(
        "range", help="rerun steps and diff them with the log (the default)",
        description="Restore the newest checkpoint at or before A (read-only), rebuild the batches with the loader "
                    "(phases and skipped windows followed), replay steps checkpoint..B-1 on two independent "
                    "placements of the chosen devices and compare every step with the logged fingerprints.",
        epilog=DEVICE_SPEC_HELP + "\n" + RANGE_EXIT_HELP, handler=_cmd_range, parents=(_device_work("good"),),
        args=(
            _arg("--steps", metavar="A:B", required=True, help="A:B, steps A..B-1 (half-open), or one step A"),
            _arg("--repeats", type=int, default=1, help="replays per placement (faulty chips are often inconsistent)"),
            _arg("--placements", type=int, default=2, help="independent device placements (>= 2 to convict)"),
            _arg("--plot", metavar="OUT.png", help="write a steps x devices plot with mismatches marked"),
            _arg("--allow-env-drift", action="store_true",
                 help="replay even if library versions, XLA flags, device kind or mesh differ from env.json"),
            _arg("--tolerance", type=float, metavar="RTOL",
                 help="compare loss and gradient norm within RTOL only (weaker evidence: can acquit, never convict)"),
            _arg("--onset", type=int, metavar="STEP",
                 help="the first suspect step: replay its checkpoint segment first and stop at a conviction there "
                      "(default: the onset 'replay scan' wrote to suspects.json, if any)"),
            _arg("--exhaustive", action="store_true", help="replay every segment of the range, even after a conviction"),
            _arg("--sequential", action="store_true",
                 help="run the placements one after the other (default: placements on disjoint devices at once)"),
        )),
    Command(
        "canary", help="run the fixed canary batch on each device",
        description="Forward and backward of a fixed, versioned canary batch with fixed weights on each chosen "
                    "device, --repeats times; all must be bit-identical and equal to the golden value of this "
                    "environment (created from the majority when absent). The odd device out is named.",
        epilog=DEVICE_SPEC_HELP + "\n" + CANARY_EXIT_HELP, handler=_cmd_canary, parents=(_device_work("all"),),
        args=(
            _arg("--repeats", type=int, default=2, help="runs per device; all must give the same fingerprints"),
            _arg("--checkpoint", type=int, help="weights from this checkpoint step (default: seeded init)"),
            _arg("--step", type=int, help="canary batch: rows of this step (default: run config canary.step or 0)"),
            _arg("--rows", type=int, help="canary batch rows (default: the run config's canary.rows)"),
            _arg("--seq-len", type=int, help="keep the first N slots of each row, a valid packed prefix (default: the "
                                              "run config's canary.seq_len; whole rows when unset)"),
            _arg("--golden", metavar="FILE", help="golden values file (default <run>/canary/golden.json)"),
            _arg("--reset-golden", action="store_true", help="re-create this environment's golden value"),
        )),
    Command(
        "inspect", help="list the documents of each row of any steps",
        description="For each step and row: source, document key, chunk and token span; a per-source summary; the "
                    "shards and records touched. Needs no device work (no --devices): a batch is a pure function "
                    "of the step, so any step can be looked up, logged or not (e.g. the batches a run is about to "
                    f"train on), at most {MAX_INSPECT_STEPS} steps a call.",
        epilog=INSPECT_TEXT_HELP + "\n" + INSPECT_EXIT_HELP, handler=_cmd_inspect,
        parents=(_run_option(RUN_HELP + " (its run config names the dataset)"), _processes),
        args=(
            _arg("--steps", metavar="A:B", required=True, help="A:B (half-open) or A"),
            _arg("--text", action="store_true",
                 help="decode each document's tokens with the dataset's tokenizer (normalized text: below); the "
                      "table shows the start of each, --json OUT the whole text"),
            _arg("--json", metavar="OUT",
                 help="write the full report (every row and document, with its token_ids) as JSON here"),
            _arg("--max-rows", type=int, default=200, help="documents shown in the table (default 200; the JSON has all)"),
        )),
    Command(
        "scan", help="screen a run from its logs alone, rank suspects",
        description="From the run's logs alone (signals.jsonl, canary.jsonl, fingerprints.jsonl, events.jsonl; no "
                    "device work): replica gradient-norm drift and spikes (robust log-ratios against the "
                    "cross-replica median), canary mismatches, NaN/Inf per leaf and device, loss spikes, router "
                    "health per layer (the run config's router_health), loader stalls. Prints the ranked suspects, "
                    "writes <run>/suspects.json (used by --devices suspect / good) and suggests the range replay to "
                    "run.",
        epilog=SCAN_EXIT_HELP, handler=_cmd_scan, parents=(_run_option(), _processes),
        args=(
            _arg("--steps", metavar="A:B", help="A:B: report findings in steps A..B-1 (earlier steps serve as history)"),
            _arg("--json", metavar="OUT", help="write the full report as JSON here"),
            _arg("--plot", metavar="OUT.png", help="write the per-step signals with the suspects marked"),
            _arg("--follow", action="store_true",
                 help="watch a live run: score each new step as it lands, print each new suspect, until the run ends "
                      "(its 'end' event) or --timeout; with --on-suspect, run CMD once, at the first suspect, with "
                      "the suspect's JSON on stdin"),
            _arg("--on-suspect", metavar="CMD",
                 help="with --follow: a shell command run the first time a suspect appears (page someone, or start "
                      "'replay triage'); stdin: the suspect as JSON, with its next step"),
            _arg("--interval", type=float, default=2.0, help="with --follow: seconds between looks (default 2)"),
            _arg("--timeout", type=float, help="with --follow: stop after this many seconds"),
        )),
    Command(
        "triage", help="walk a loss spike: events, replicas, data, router",
        description="The triage of a loss spike at --step, in the field's order, from the run's lineage: 1 events in "
                    "the window (with the exact restore check from the logged loader states and batch hashes), 2 "
                    "replicas (replay scan's statistics; --replay runs the range replay on good devices), 3 data (the "
                    "onset's rows against earlier rows, per shard and source), 4 router health per layer. Each check "
                    "is clear, suspect or not available; the conclusion gives the cause, the confidence and the next "
                    "command.",
        epilog=TRIAGE_EXIT_HELP, handler=_cmd_triage, parents=(_run_option(),),
        args=(
            _arg("--step", type=int, required=True, help="the step of the loss spike"),
            _arg("--window", type=int, default=1000, help="steps before --step the checks look at (default 1000)"),
            _arg("--replay", action="store_true",
                 help="run the range replay on good devices from the newest checkpoint before the onset"),
            _arg("--devices", metavar="SPEC", default="good", help="with --replay: the device spec (default good)"),
            _arg("--quarantine", metavar="FILE", help="quarantined device ids (default: <run>/quarantine.txt)"),
            _arg("--json", metavar="OUT", help="write the full report as JSON here"),
            _arg("--plot", metavar="OUT.png", help="write the dashboard over the window (events as lines)"),
            _arg("--no-progress", action="store_true", help="no progress of the range replay"),
        )),
    Command(
        "skip", help="rewind to a checkpoint and skip a data window",
        description="Record, as events of the run (never an edit of a file), a rewind to checkpoint C (default: the "
                    "newest at or before A) and a skipped data window A:B (steps A..B-1: from step A on, step s "
                    "trains on the data of s + B - A). The next 'python -m replay.reference.train --run DIR' resumes "
                    "from C with the window skipped; the steps trained after C become a superseded attempt, kept. "
                    "replay inspect and range replay follow the window at once.",
        epilog=SKIP_EXIT_HELP, handler=_cmd_skip, parents=(_run_option(),),
        args=(
            _arg("--steps", metavar="A:B", required=True, help="the data window to skip, A:B (half-open) or A"),
            _arg("--reason", required=True, help="why (recorded in the events)"),
            _arg("--checkpoint", type=int, metavar="C", help="the checkpoint to rewind to (default: newest <= A)"),
            _arg("--json", metavar="OUT", help="write what was recorded as JSON here"),
        )),
    Command(
        "goodput", help="where the run's wall time and tokens went",
        description="From the run directory alone: the wall time from the first launch to the last record split into "
                    "productive step time of the lineage, start-up, compilation, checkpoint save stalls and "
                    "restores, work lost to crashes, rewound work, steps trained on later-skipped data, loader "
                    "waits, the canary, gaps between attempts, the loop's other host time and what the log cannot "
                    "tell (unknown); the parts add up exactly. Tokens split the same way and reconcile with the "
                    "loader's step -> rows arithmetic. MFU per step from the trainer's logged FLOPs.",
        epilog=GOODPUT_EXIT_HELP, handler=_cmd_goodput, parents=(_run_option(),),
        args=(
            _arg("--json", metavar="OUT", help="write the full report as JSON here"),
            _arg("--plot", metavar="OUT.png", help="write the waterfall and goodput over time"),
            _arg("--peak-flops", type=_positive_float, metavar="F",
                 help="peak FLOP/s of one device for MFU (default: a table of known device kinds)"),
            _arg("--mtbf", type=_positive_float, metavar="S",
                 help="the fleet's mean time between failures in seconds, for Young's checkpoint interval (default: "
                      "the run config's mtbf_s, else the seed's design point, 8,800 s)"),
        )),
    Command(
        "drill", help="inject a bit flip, check replay and canary catch it",
        description="Flip one bit (chosen, or random from --seed) in one device's local gradient (or, with --where, "
                    "inside its computation) at one step of a replay of the run, then check that range replay "
                    "convicts that device at that step and that the canary names it. Exit 0 when caught, "
                    f"{DRILL_NOT_CAUGHT} when not.",
        epilog=DEVICE_SPEC_HELP + "\n" + DRILL_EXIT_HELP, handler=_cmd_drill, parents=(_device_work("all"),),
        args=(
            _arg("--seed", type=int, default=0, help="seed of the random fault fields"),
            _arg("--count", type=int, help="number of drills (default 1; triage scenarios: 5 seeds each)"),
            _arg("--step", type=int, help="the logged step the fault fires at (default: random)"),
            _arg("--device", type=int, help="jax.Device.id of the faulty device of the run's mesh (default: random)"),
            _arg("--leaf", help="parameter leaf path, e.g. \"['layers'][0]['w_in']\""),
            _arg("--element", type=int, help="flat index into the device's local shard of the leaf (default: random)"),
            _arg("--bit", type=int, help="0 = lowest mantissa bit"),
            _arg("--where", choices=FAULT_SITES, default="local_gradient", metavar="SITE",
                 help="where the fault enters the device's step: its finished local gradient (default), its experts' "
                      "output in the forward pass, an expert weight's gradient in the backward pass, an attention "
                      "output, or inside the arithmetic (issue 27): ffn_up / ffn_down (the expert FFN matmuls, before "
                      "the nonlinearity / the down matmul's input), ffn_{up,down}_grad_input / _grad_weight (the "
                      "backward's activation- and weight-gradient products), attn_scores / attn_probs / attn_pv "
                      "(QK^T, the softmax output, PV), router_logits (before top-k), transit_dispatch / "
                      "transit_combine and their _grad (what the device received at an all-to-all: the verdict names "
                      "the link sender -> receiver), host_batch (a token of the device's rows after the loader "
                      f"handed them over). One of: {', '.join(FAULT_SITES)}"),
            _arg("--layer", type=int, help="--where a per-layer site: the layer (default: random)"),
            _arg("--mode", choices=("flip", "scale", "set"), default="flip",
                 help="flip --bit (default), scale the element by --value, or set it to --value (nan, inf)"),
            _arg("--value", type=float, default=None,
                 help="--mode scale: the factor (e.g. 1.001); --mode set: the value, 'nan' and 'inf' included; triage "
                      "drill nonfinite: nan or inf, the value the device's local gradient is multiplied into "
                      "(default: both, with --grid; else nan)"),
            _arg("--no-canary", action="store_true", help="check range replay only, not the canary"),
            _arg("--to-disk", metavar="DIR",
                 help="write each drill as a short faulty training run DIR/drill-N (fingerprints, a checkpoint after "
                      "the faulty step) and replay it from disk"),
            _arg("--scenario", choices=("drift", "flip", "canary", "expert_drift", *TRIAGE_SCENARIOS, "all"),
                 help="a screening drill instead: retrain the run from a checkpoint with a persistent small error on "
                      "one device (drift: --magnitude, --kind), intermittent bit flips (flip: --flips, --bit) or a "
                      "wrong canary (canary), then check that 'replay scan' names that device and the first step "
                      "(expert_drift: one expert device's experts' output x(1 + --magnitude) at every step, which "
                      "'replay scan' must name by its expert_drift check); --step is the fault's first step, the "
                      "drilled runs go to --to-disk (default: a temporary folder). Or a triage drill (sdc, restart, "
                      "data, duplicate, router, router_scale, nonfinite: a device's gradient made NaN or Inf, "
                      "clean; all: each of them): a short training run of its own (no --run) with one planted "
                      "cause, and 'replay triage' must name it; --count seeds each (default 5), from --seed, at the "
                      "largest magnitude of the scenario's grid (--grid: at each, down to the check's floor; "
                      "nonfinite: --value)"),
            _arg("--grid", action="store_true",
                 help="triage drills: every magnitude of each scenario's fixed grid (replay.triage_drill.GRIDS), with "
                      "the detections per magnitude"),
            _arg("--magnitude", type=_positive_float, default=0.2,
                 help="drift: relative error of the device's local gradient, a finite number > 0 (default 0.2)"),
            _arg("--kind", choices=("scale", "bias"), default="scale", help="drift: scale or bias (default scale)"),
            _arg("--flips", type=int, default=3, help="flip: number of bit flips (default 3)"),
        )),
    Command(
        "certify", help="certify the newest clean checkpoint",
        description="From a checkpoint taken as trusted (the first, or --from), replay each checkpoint segment on "
                    "good devices and compare the state it reaches with the next checkpoint's state record, leaf by "
                    "leaf; restore each checkpoint and check its files against its record. Each checkpoint is "
                    "certified, poisoned (replicas disagreed at the save, or the replay does not reach it), damaged "
                    "(its files do not match its record) or not certifiable; segments on disjoint placements run at "
                    "the same time.",
        epilog=DEVICE_SPEC_HELP + "\n" + CERTIFY_EXIT_HELP, handler=_cmd_certify, parents=(_device_work("good"),),
        args=(
            _arg("--from", dest="from_step", type=int, metavar="STEP",
                 help="the checkpoint taken as trusted (default: the run's first)"),
            _arg("--to", dest="to_step", type=int, metavar="STEP", help="the last checkpoint to judge (default: newest)"),
            _arg("--plot", metavar="OUT.png", help="write the chain: checkpoints on a step axis, each marked"),
            _arg("--allow-env-drift", action="store_true", help="certify even if the environment differs"),
            _arg("--sequential", action="store_true", help="one placement at a time"),
        )),
)
COMMANDS = tuple(c.name for c in COMMAND_TABLE)
_HANDLERS = {c.name: c.handler for c in COMMAND_TABLE}


def _parse(argv: Sequence[str]):
    """``(args, None)``, or ``(None, exit code)`` when there is nothing to run: no arguments (the help, exit
    2), ``--help`` (0) or a usage error argparse printed (2). A first argument that is no command is the
    range command's (``replay --run DIR --steps A:B``)."""
    argv = _join_dash_values(argv)
    if argv and argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["range", *argv]
    parser = build_parser()
    if not argv:
        parser.print_help()
        return None, int(ExitCode.USAGE)
    try:
        return parser.parse_args(argv), None
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return None, int(e.code or 0)


def _check_usage(args) -> None:
    """The usage errors found before any work: a malformed ``--steps`` (before the run directory is looked
    for), no run directory (``--run``, ``$REPLAY_RUN`` or the current folder), a typo in ``--devices``. Sets
    ``args.run`` and ``args.run_source``.

    Raises:
      RunNotGivenError, DeviceSpecError, StepsSpecError: the usage error.
    """
    from replay.runtime.devices import parse_spec
    from replay.run.runlog import parse_steps, resolve_run_dir

    if getattr(args, "steps", None) is not None:
        parse_steps(args.steps)
    if args.command == "drill" and args.scenario in (*TRIAGE_SCENARIOS, "all"):
        args.run, args.run_source = args.run or "", "--run"  # a triage drill trains runs of its own
    else:
        args.run, args.run_source = resolve_run_dir(args.run)
    if hasattr(args, "devices"):
        parse_spec(args.devices)


def _failures() -> tuple[tuple[tuple[type, ...], str, ExitCode], ...]:
    """What each error a command raises is called and the exit code it gives, first match wins (a
    subclass before its base); anything else is an internal error (a traceback, exit 1)."""
    from contract.config import ConfigError
    from replay.drill import DrillError
    from replay.runtime.devices import DeviceSpecError
    from replay.run.runlog import RunDirError, StepRangeError, StepsSpecError
    from replay.run.statefp import DamagedCheckpointError, PoisonedCheckpointError
    from replay.screen.forensics import TokenizerUnavailableError
    from replay.verify.compare import PairingError
    from replay.verify.engine import EnvDriftError

    return (
        ((StepsSpecError, DeviceSpecError, DrillError, _Usage), "usage error", ExitCode.USAGE),
        ((EnvDriftError,), "environment drift", ExitCode.ENV_DRIFT),
        ((DamagedCheckpointError,), "damaged checkpoint", ExitCode.DAMAGED_CHECKPOINT),
        ((PoisonedCheckpointError,), "poisoned checkpoint", ExitCode.POISONED_CHECKPOINT),
        ((StepRangeError,), "run directory or data error", ExitCode.RUN_ERROR),
        ((RunDirError, ConfigError, TokenizerUnavailableError, FileNotFoundError, PairingError),
         "run directory or data error", ExitCode.RUN_ERROR),
        ((OSError,), "run directory or data error", ExitCode.RUN_ERROR),  # permission denied, disk full, ...
    )


def _report_failure(e: Exception, typed: Sequence[str], args, err) -> int:
    """Says ``e`` on stderr as :func:`_failures` names it, with the next command to try where there is one
    (the nearest logged range, the nearest run directory); returns the exit code."""
    from rich.markup import escape

    from replay.run.runlog import StepRangeError

    named = next(((kind, code) for kinds, kind, code in _failures() if isinstance(e, kinds)), None)
    if named is None and type(e).__module__.startswith("loader") and isinstance(e, ValueError):
        named = ("run directory or data error", ExitCode.RUN_ERROR)  # the loader's checks of the dataset
    if named is None:
        traceback.print_exc()
        return int(ExitCode.INTERNAL)
    kind, code = named
    message = str(e)
    if isinstance(e, OSError) and kind == "run directory or data error" and not isinstance(e, FileNotFoundError):
        message = f"{f'cannot read or write {e.filename}: ' if e.filename else ''}{e.strerror or e}"
    err.print(f"[red]{kind}:[/] {escape(message)}")
    if isinstance(e, StepRangeError):
        for n, (command, why) in enumerate(_next_commands(typed, args, e)):
            err.print(f"{'next' if n == 0 else '  or'}: {escape(command)}   ({why})")
    elif getattr(e, "nearest", None):  # a run directory that is not there: the same command on the nearest
        err.print(f"next: {escape(shlex.join(['replay', *_with_steps(typed, e.nearest, '--run')]))}")
    return int(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``replay`` console script; returns the exit code (``ExitCode``).

    The run directory is ``--run``, else ``$REPLAY_RUN``, else the current folder when it is a run
    directory (``replay.run.runlog.resolve_run_dir``); when not ``--run``, one line on stderr says which
    (``run: DIR (from REPLAY_RUN)``). Messages go to stderr, never wrapped (``report.make_console``).
    """
    import logging

    from rich.markup import escape

    from replay.report import make_console
    from replay.runtime.devices import DeviceSpecError
    from replay.run.runlog import RunNotGivenError, StepsSpecError

    if argv is None:  # the console script: a whole process of its own
        from replay.runtime.quiet import exit_quietly_after_failed_restore

        code = main(sys.argv[1:])
        exit_quietly_after_failed_restore(code)
        return code
    typed = list(argv)
    args, code = _parse(argv)
    if args is None:
        return code
    console = make_console()  # one width policy: messages never wrap, tables fit (160 columns when piped)
    err = make_console(stderr=True)
    try:
        _check_usage(args)
    except (RunNotGivenError, DeviceSpecError, StepsSpecError) as e:
        err.print(f"[red]usage error:[/] {escape(str(e))}")
        return int(ExitCode.USAGE)
    if args.run_source != "--run":
        err.print(f"run: {escape(args.run)} (from {args.run_source})")
    _pin_determinism_flags(args.run)
    try:
        _start_processes(args, err)
    except distributed.DistributedConfigError as e:
        err.print(f"[red]usage error:[/] {escape(str(e))}")
        return int(ExitCode.USAGE)
    if not _primary():  # one report, from process 0; every process shows its own progress and errors
        import io

        console.file = io.StringIO()
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes on read-only restores are not news
    try:
        return _HANDLERS[args.command](args, console)
    except Exception as e:  # noqa: BLE001 - each error has its exit code (_failures); the rest is a bug, traced
        return _report_failure(e, typed, args, err)


if __name__ == "__main__":
    sys.exit(main())
