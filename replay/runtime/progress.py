"""Progress of long step loops: training, range replay, canary, drills.

What is shown (as ``dataprep.progress`` does for ``pack``, through ``common.progress``): on a terminal, a Rich progress bar;
otherwise (a log file, a pipe) one plain line for the first update, then at most one every
``interval`` seconds, and one for the last, e.g.::

    train: step 12 of 0:40 (32%), 1.9 steps/s, 15.6 k tokens/s, step 0.52 s, loss 6.1234, ETA 15 s

and, when the loop ends, how long it took::

    train: steps 0:40 done in 21.3 s (1.9 steps/s, 15.6 k tokens/s)

Counted work (``unit`` items that are not one step range, e.g. a replay's steps over several
device placements) reads ``replay 15:20: 12 of 20 steps (10 steps from checkpoint 10 x 2
placements, 60%), ...`` and ``replay 15:20: 20 steps (10 steps from checkpoint 10 x 2 placements)
done in 6.4 s (3.1 steps/s)``: ``breakdown`` says what the count counts.

Nothing is silent for long: what a command does before its first step shows at once (:func:`note`,
``train: restoring checkpoint 20``), and ``first`` says what the first step waits for
(``train: step 0 of 0:30: compiling the train step ...``); that step's time then reads
``step 43.15 s (compiling included)``.

Rates (steps/s, tokens/s) and the ETA count from the first update on: the first step of a JAX
loop compiles, and its seconds say nothing of the steps after it. Progress goes to stderr by
default, so that a command's stdout stays what it was (reports, JSON). The line interval is
``interval`` seconds, else ``$REPLAY_PROGRESS_EVERY``, else 10; 0 prints every update.
Progress is a view, never the record: once its stream fails (a pipe whose reader has gone) it
goes quiet instead of failing the run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional, TextIO

from common.progress import duration, print_line, rate, rich_bar, stop_bar

INTERVAL_ENV = "REPLAY_PROGRESS_EVERY"
DEFAULT_INTERVAL = 10.0
_LIVE: list = []  # the StepProgress objects whose Rich bar is live, innermost last


def line_interval(interval: Optional[float] = None) -> float:
    """Seconds between plain lines: ``interval``, else ``$REPLAY_PROGRESS_EVERY``, else 10.

    Raises:
      ValueError: the environment variable is not a number >= 0 (the message names it).
    """
    if interval is not None:
        return float(interval)
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: must be a number of seconds >= 0 (0: a line per step)")
    return value


def loss_text(value: float) -> str:
    """A loss as people read it: 4 decimals (``"5.0869"``; a float32 loss has about 7 significant
    digits, and a spike shows in the first two), ``"nan"``/``"inf"`` as such, 4 significant digits
    from 1000 on."""
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:.4g}"


def note(label: str, text: str, stream: Optional[TextIO] = None) -> None:
    """Prints ``"<label>: <text>"`` at once: what a command is doing before its steps start (loading,
    restoring, compiling), so that no long wait is silent. Above a live Rich bar when there is one;
    a failed stream is ignored (progress is a view, never the record)."""
    print_line(f"{label}: {text}", stream if stream is not None else sys.stderr, _LIVE[-1]._bar if _LIVE else None)


def _metric(name: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{name} {loss_text(value) if name == 'loss' else f'{value:.4f}'}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{name} {value:,}"
    return f"{name} {value}"


class StepProgress:
    """Progress over steps ``start .. stop-1`` (or over ``stop - start`` counted items).

    Args:
      label: the line's prefix (``"train"``, ``"replay 15:20"``).
      start, stop: the half-open step range (``counted``: 0 and the number of items).
      unit: what one step is called (``"step"``, ``"drill"``); plural adds an ``s``.
      stream: where output goes (default ``sys.stderr``).
      interval: seconds between plain lines (:func:`line_interval`).
      terminal: force the Rich bar on (True) or off (False); default ``stream.isatty()``.
      counted: show ``12 of 20 steps`` instead of ``step 12 of 0:40``.
      breakdown: counted: what the total counts, shown beside it (``"10 steps from checkpoint 10 x
        2 placements"``).
      first: what the first step waits for (``"compiling the train step"``): printed at once (on a
        terminal: the bar's text until the first update), and the first update's step time
        reads ``(compiling included)``.
      enabled: False: no bar or progress lines, only the closing line.
      clock: ``time.monotonic``, replaceable in tests.

    Raises:
      ValueError: ``stop < start``, or a bad ``$REPLAY_PROGRESS_EVERY``.
    """

    def __init__(self, label: str, start: int, stop: int, *, unit: str = "step", stream: Optional[TextIO] = None,
                 interval: Optional[float] = None, terminal: Optional[bool] = None, counted: bool = False,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 breakdown: Optional[str] = None, first: Optional[str] = None):
        if stop < start:
            raise ValueError(f"progress range {start}:{stop}: stop must be >= start")
        self.label, self.start, self.stop, self.unit, self.counted = label, int(start), int(stop), unit, counted
        self.breakdown, self.first = breakdown, first
        self._stream = stream if stream is not None else sys.stderr
        self._interval = line_interval(interval)
        self._enabled = enabled
        if terminal is None:
            try:
                terminal = bool(self._stream.isatty())
            except (AttributeError, ValueError):
                terminal = False
        self._terminal = terminal and enabled
        self._clock = clock
        self._t0 = clock()
        self._first: Optional[float] = None  # time of the first update
        self._latest: Optional[float] = None  # time of the latest update
        self._last_line: Optional[float] = None
        self.done = 0  # steps (items) done
        self.last: Optional[int] = None  # the last step updated
        self.metrics: dict[str, Any] = {}
        self._tokens = 0.0  # tokens after the first update (rates exclude the first step's)
        self._tokens_first = 0.0
        self._bar = None
        self._via: Optional[StepProgress] = None  # the live bar this progress prints its lines above
        self._task = None
        self._broken = False
        if self._terminal:  # the bar shows from the start (a first step's compilation takes a while)
            if _LIVE:  # another bar is live (a drill's training inside the drill's bar): lines above it
                self._via, self._terminal = _LIVE[-1], False
            else:
                try:
                    self._start_bar()
                except (OSError, ValueError):
                    self._broken = True
        if first and enabled and self.total and not self._terminal:
            self._print(f"{label}: {self._waiting()}")

    def _waiting(self) -> str:
        """What the first step waits for: ``"step 0 of 0:30: compiling the train step"``."""
        where = f"{self.unit} {self.start} of {self.start}:{self.stop}" if not self.counted else (
            f"0 of {self.total:,} {self._plural(self.total)}" + (f" ({self.breakdown})" if self.breakdown else ""))
        return f"{where}: {self.first}"

    @property
    def total(self) -> int:
        return self.stop - self.start

    def _plural(self, n: int) -> str:
        return self.unit if n == 1 else self.unit + "s"

    # -- rendering -------------------------------------------------------------------------

    def _print(self, line: str) -> None:
        bar = self._bar if self._bar is not None else (self._via._bar if self._via is not None else None)
        if not self._broken and not print_line(line, self._stream, bar):
            self._broken = True

    def _rates(self, now: float, whole: bool = False) -> tuple[Optional[float], Optional[float]]:
        """(steps/s, tokens/s) since the first update; after a single update None (its time is
        mostly compilation), or with ``whole`` over the whole time."""
        if self._first is None:
            return None, None
        if self.done > 1 and now > self._first:
            return (self.done - 1) / (now - self._first), (self._tokens / (now - self._first) if self._tokens else None)
        if not whole:
            return None, None
        spent = max(now - self._t0, 1e-9)
        return self.done / spent, (self._tokens_first / spent if self._tokens_first else None)

    def _eta(self, now: float) -> Optional[float]:
        steps_s, _ = self._rates(now)
        if not steps_s:
            return None
        return (self.total - self.done) / steps_s

    def position(self) -> str:
        """``"step 12 of 0:40 (32%)"`` or ``"12 of 20 steps (60%)"``."""
        pct = f"{self.done / self.total:.0%}" if self.total else "100%"
        if self.counted:
            what = f"{self.breakdown}, " if self.breakdown else ""
            return f"{self.done:,} of {self.total:,} {self._plural(self.total)} ({what}{pct})"
        return f"{self.unit} {self.last} of {self.start}:{self.stop} ({pct})"

    def _details(self, now: float) -> list[str]:
        steps_s, tokens_s = self._rates(now)
        out = []
        if steps_s is not None:
            out.append(rate(steps_s, self._plural(2)))
        if tokens_s is not None:
            out.append(rate(tokens_s, "tokens"))
        compiled = " (compiling included)" if self.first and self.done == 1 else ""
        for k, v in self.metrics.items():
            out.append(f"{self.unit} {v:.2f} s{compiled}" if k == "step_s" else _metric(k, v))
        return out

    def line(self, now: Optional[float] = None) -> str:
        """The plain progress line for the current state."""
        now = self._clock() if now is None else now
        eta = self._eta(now)
        parts = [self.position(), *self._details(now)]
        if eta is not None and self.done < self.total:
            parts.append(f"ETA {duration(eta)}")
        return f"{self.label}: " + ", ".join(parts)

    def summary(self, now: Optional[float] = None) -> str:
        """The closing line: ``"train: steps 0:40 done in 21.3 s (1.9 steps/s, 15.6 k tokens/s)"``."""
        now = self._clock() if now is None else now
        spent = duration(now - self._t0)
        # rates up to the last update: the time after it (a final checkpoint, a report) is no step's
        steps_s, tokens_s = self._rates(self._latest if self._latest is not None else now, whole=True)
        rates = [rate(steps_s, self._plural(2))] if steps_s is not None else []
        if tokens_s is not None:
            rates.append(rate(tokens_s, "tokens"))
        tail = f" ({', '.join(rates)})" if rates else ""
        if self.counted:
            head = f"{self.done:,} {self._plural(self.done)}" + (f" of {self.total:,}" if self.done < self.total else "")
            head += f" ({self.breakdown})" if self.breakdown else ""
            return f"{self.label}: {head} done in {spent}{tail}"
        if self.done == 0:
            return f"{self.label}: no {self._plural(2)} to run ({self.start}:{self.stop}), done in {spent}"
        end = self.last + 1 if self.last is not None else self.start
        head = f"{self._plural(2)} {self.start}:{end}" + (f" of {self.start}:{self.stop}" if end < self.stop else "")
        return f"{self.label}: {head} done in {spent}{tail}"

    def _start_bar(self) -> None:
        self._bar = rich_bar(self._stream, transient=True)
        _LIVE.append(self)
        self._task = self._bar.add_task(self.label, total=max(self.total, 1),
                                        detail=self._waiting() if self.first else "")

    def _update_bar(self, now: float) -> None:
        if self._bar is None:
            self._start_bar()
        where = (f"{self.done:,}/{self.total:,}" + (f" ({self.breakdown})" if self.breakdown else "") if self.counted
                 else f"{self.unit} {self.last} of {self.start}:{self.stop}" if self.last is not None
                 else f"{self.unit}s {self.start}:{self.stop}")
        eta = self._eta(now)
        late = eta is not None and self.done < self.total
        detail = ", ".join([where, *self._details(now)] + ([f"ETA {duration(eta)}"] if late else []))
        self._bar.update(self._task, completed=self.done, detail=detail)

    # -- updates ---------------------------------------------------------------------------

    def update(self, step: int, *, tokens: Optional[float] = None, **metrics: Any) -> None:
        """Step ``step`` is done (steps ``start .. step`` are).

        Args:
          step: the step just finished (counted: the number of items done so far).
          tokens: tokens the step processed (for tokens/s).
          metrics: shown after the rates in order given: ``step_s`` (seconds of the step) as
            ``step 0.52 s``, floats with 4 decimals (``loss 6.1234``), others as they print.
        """
        now = self._clock()
        if self.counted:
            self.done = min(int(step), self.total)
            self.last = int(step)
        else:
            self.last = int(step)
            self.done = min(max(int(step) + 1 - self.start, 0), self.total)
        self._latest = now
        if self._first is None:
            self._first = now
            self._tokens_first = float(tokens or 0)
        elif tokens:
            self._tokens += float(tokens)
        self.metrics = dict(metrics)
        if not self._enabled or self._broken:
            return
        if self._terminal:
            try:
                self._update_bar(now)
            except (OSError, ValueError):
                self._broken = True
            return
        first = self._last_line is None
        if first or self.done >= self.total or now - self._last_line >= self._interval:
            self._last_line = now
            self._print(self.line(now))

    def advance(self, n: int = 1, **metrics: Any) -> None:
        """Counted progress: ``n`` more items are done (the ``advance`` callback replay's engine takes)."""
        self.update((self.done if self.counted else (self.last if self.last is not None else self.start - 1)) + n,
                    **metrics)

    def close(self, ok: bool = True) -> None:
        """Stops the bar and prints the closing line (``ok`` False: the loop failed; says where it stopped)."""
        if self._bar is not None:
            if not stop_bar(self._bar):
                self._broken = True
            self._bar = None
            if self in _LIVE:
                _LIVE.remove(self)
        if ok:
            self._print(self.summary())
        else:
            at = self.position() if self.last is not None else f"before its first {self.unit}"
            self._print(f"{self.label}: stopped at {at} after {duration(self._clock() - self._t0)}")


@contextlib.contextmanager
def step_progress(label: str, start: int, stop: int, *, unit: str = "step", stream: Optional[TextIO] = None,
                  interval: Optional[float] = None, terminal: Optional[bool] = None, counted: bool = False,
                  enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                  breakdown: Optional[str] = None, first: Optional[str] = None) -> Iterator[StepProgress]:
    """A :class:`StepProgress` for a ``with`` block: closes it at the end with the closing line
    (``done in``), or, when the block raises, with where it stopped (and the error propagates)."""
    progress = StepProgress(label, start, stop, unit=unit, stream=stream, interval=interval, terminal=terminal,
                            counted=counted, enabled=enabled, clock=clock, breakdown=breakdown, first=first)
    try:
        yield progress
    except BaseException:
        progress.close(ok=False)
        raise
    progress.close()
