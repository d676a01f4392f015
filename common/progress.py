"""Terminal progress shared by ``dataprep.progress`` (``pack``) and ``replay.runtime.progress`` (step loops).

What both show: on a terminal a Rich bar (:func:`rich_bar`), otherwise plain lines
(:func:`print_line`); durations (:func:`duration`) and rates (:func:`rate`) as people read them.
Progress is a view, never the record: a stream that fails (a pipe whose reader has gone) makes
:func:`print_line` return False, and the caller goes quiet instead of failing the run.
"""

from __future__ import annotations

from typing import Any, Optional, TextIO


def duration(seconds: float) -> str:
    """``"9 s"``, ``"2 min 05 s"``, ``"1 h 02 min"`` (``seconds`` >= 0; tenths below 10 s: ``"4.2 s"``)."""
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def rate(n: float, unit: str) -> str:
    """``"15.6 k tokens/s"``, ``"1.9 steps/s"``, ``"0.25 steps/s"``: ``n`` per second, with a
    k/M/G prefix from 10^3 on."""
    for scale, prefix in ((1e9, "G "), (1e6, "M "), (1e3, "k ")):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {prefix}{unit}/s"
    return f"{n:.2f} {unit}/s" if abs(n) < 1 else f"{n:.1f} {unit}/s"


def print_line(line: str, stream: TextIO, bar: Optional[Any] = None) -> bool:
    """Prints ``line`` above the live Rich ``bar`` (a ``rich.progress.Progress``), else on ``stream``.

    The line is printed as it is: no Rich markup or highlighting, never wrapped (paths stay whole).

    Returns:
      False when the stream failed (``OSError``, ``ValueError``: closed, or a pipe whose reader is
      gone): the caller then stops printing.
    """
    try:
        if bar is not None:
            bar.console.print(line, highlight=False, soft_wrap=True, markup=False)
        else:
            print(line, file=stream, flush=True)
    except (OSError, ValueError):
        return False
    return True


def rich_bar(stream: TextIO, *, transient: bool, eta: bool = False) -> Any:
    """A started ``rich.progress.Progress`` on ``stream``: description, bar, percentage, the task's
    ``detail`` field and, with ``eta``, Rich's time remaining. ``transient``: the bar is erased when
    stopped (a closing line says the rest). Stop it with ``.stop()``.

    Raises:
      OSError, ValueError: the stream cannot be written.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TextColumn("{task.fields[detail]}")]
    bar = Progress(*columns, *([TimeRemainingColumn()] if eta else []), console=Console(file=stream),
                   transient=transient)
    bar.start()
    return bar


def stop_bar(bar: Any) -> bool:
    """Stops a bar from :func:`rich_bar`; returns False when its stream failed on the way (``OSError``,
    ``ValueError``: the caller then stops printing)."""
    try:
        bar.stop()
    except (OSError, ValueError):
        return False
    return True
