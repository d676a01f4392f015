"""replay.runtime.progress: the plain lines on a non-terminal stream, the closing line, counted progress, the bar."""

import io

import pytest

from replay.runtime.progress import StepProgress, line_interval, rate, step_progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _train(interval, steps=40, first=3.0, each=0.5, tokens=8192):
    clock, out = Clock(), io.StringIO()
    with step_progress("train", 0, steps, stream=out, interval=interval, clock=clock) as shown:
        for step in range(steps):
            clock.t += first if step == 0 else each
            shown.update(step, tokens=tokens, step_s=each, loss=6.0 - step / 100)
        clock.t += 2.0  # the final checkpoint: in "done in", not in the rates
    return out.getvalue().splitlines()


def test_plain_lines_first_every_interval_last_and_done():
    lines = _train(interval=10.0)
    assert lines == [
        "train: step 0 of 0:40 (2%), step 0.50 s, loss 6.0000",  # no rate yet: the first step compiles
        "train: step 20 of 0:40 (52%), 2.0 steps/s, 16.4 k tokens/s, step 0.50 s, loss 5.8000, ETA 9.5 s",
        "train: step 39 of 0:40 (100%), 2.0 steps/s, 16.4 k tokens/s, step 0.50 s, loss 5.6100",
        "train: steps 0:40 done in 24 s (2.0 steps/s, 16.4 k tokens/s)",
    ]


def test_interval_zero_prints_every_step():
    lines = _train(interval=0, steps=5)
    assert len(lines) == 6
    assert [x.split(",")[0] for x in lines[:5]] == [f"train: step {s} of 0:5 ({(s + 1) / 5:.0%})" for s in range(5)]
    assert lines[-1] == "train: steps 0:5 done in 7.0 s (2.0 steps/s, 16.4 k tokens/s)"


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv("REPLAY_PROGRESS_EVERY", "0")
    assert line_interval() == 0.0
    assert len(_train(interval=None, steps=4)) == 5
    assert line_interval(2.5) == 2.5  # the parameter wins
    monkeypatch.setenv("REPLAY_PROGRESS_EVERY", "soon")
    with pytest.raises(ValueError, match=r"REPLAY_PROGRESS_EVERY='soon': must be a number of seconds >= 0"):
        line_interval()
    monkeypatch.delenv("REPLAY_PROGRESS_EVERY")
    assert line_interval() == 10.0


def test_resumed_range_and_an_early_stop():
    clock, out = Clock(), io.StringIO()
    with step_progress("train", 20, 40, stream=out, interval=0, clock=clock) as shown:
        for step in (20, 21, 22):
            clock.t += 1.0
            shown.update(step)
    assert out.getvalue().splitlines() == [
        "train: step 20 of 20:40 (5%)",
        "train: step 21 of 20:40 (10%), 1.0 steps/s, ETA 18 s",
        "train: step 22 of 20:40 (15%), 1.0 steps/s, ETA 17 s",
        "train: steps 20:23 of 20:40 done in 3.0 s (1.0 steps/s)",  # stopped early (a canary stop)
    ]


def test_a_failure_says_where_it_stopped_and_propagates():
    clock, out = Clock(), io.StringIO()
    with pytest.raises(OSError, match="No space left"):
        with step_progress("train", 0, 10, stream=out, interval=10, clock=clock) as shown:
            clock.t += 4.0
            shown.update(0, loss=5.5)
            clock.t += 1.5
            raise OSError(28, "No space left on device")
    assert out.getvalue().splitlines() == [
        "train: step 0 of 0:10 (10%), loss 5.5000",
        "train: stopped at step 0 of 0:10 (10%) after 5.5 s",
    ]


def test_counted_progress_as_replay_uses_it():
    clock, out = Clock(), io.StringIO()
    shown = StepProgress("replay 15:20", 0, 20, stream=out, interval=0, counted=True, clock=clock)
    advance = shown.advance  # what replay_range's progress factory returns
    for n in (1, 4, 15):
        clock.t += 2.0
        advance(n)
    shown.close()
    assert out.getvalue().splitlines() == [
        "replay 15:20: 1 of 20 steps (5%)",
        "replay 15:20: 5 of 20 steps (25%), 2.0 steps/s, ETA 7.5 s",
        "replay 15:20: 20 of 20 steps (100%), 4.8 steps/s",
        "replay 15:20: 20 steps done in 6.0 s (4.8 steps/s)",
    ]


def test_disabled_progress_keeps_only_the_closing_line():
    clock, out = Clock(), io.StringIO()
    with step_progress("canary", 0, 3, unit="run", counted=True, stream=out, enabled=False, clock=clock) as shown:
        for _ in range(3):
            clock.t += 1.0
            shown.advance()
    assert out.getvalue() == "canary: 3 runs done in 3.0 s (1.0 runs/s)\n"


def test_nothing_to_run():
    out = io.StringIO()
    with step_progress("train", 20, 20, stream=out, clock=Clock()):
        pass
    assert out.getvalue() == "train: no steps to run (20:20), done in 0.0 s\n"


def test_a_closed_stream_does_not_fail_the_loop():
    out = io.StringIO()
    with step_progress("train", 0, 3, stream=out, interval=0, clock=Clock()) as shown:
        out.close()
        for step in range(3):
            shown.update(step, loss=1.0)  # no ValueError: progress is a view


def test_terminal_bar_and_a_nested_one_print_lines_above_it():
    out = io.StringIO()
    out.isatty = lambda: True
    with step_progress("drill", 0, 2, unit="drill", counted=True, stream=out) as outer:
        for n in range(2):
            with step_progress("train", 0, 3, stream=out, interval=0) as inner:
                for step in range(3):
                    inner.update(step, loss=1.0)
            outer.update(n + 1)
    text = out.getvalue()
    assert "\x1b[" in text  # a Rich live bar
    assert text.count("train: step 0 of 0:3 (33%), loss 1.0000\n") == 2  # the inner one as lines
    assert text.count("train: steps 0:3 done in ") == 2
    assert text.rstrip("\n").splitlines()[-1].split("\x1b[2K")[-1].startswith("drill: 2 drills done in ")


def test_rates():
    assert [rate(x, "tokens") for x in (0.25, 1.94, 152.9, 15_600, 2.5e6)] == [
        "0.25 tokens/s", "1.9 tokens/s", "152.9 tokens/s", "15.6 k tokens/s", "2.5 M tokens/s"]
