"""common/: the neutral room (locks, figures, progress formatting) that dataprep and replay share."""

import os

import pytest

from common import figures, locks
from common.progress import duration, print_line, rate


def test_a_held_folder_lock_refuses_a_second_taker_until_released(tmp_path):
    fd = locks.acquire(str(tmp_path), wait=False)
    try:
        with pytest.raises(BlockingIOError):
            locks.acquire(str(tmp_path), wait=False)  # another open file description: refused
    finally:
        locks.release(fd)
    locks.release(locks.acquire(str(tmp_path), wait=False))
    assert os.listdir(tmp_path) == []  # a folder lock leaves no file behind


def test_a_lock_file_is_made_and_held_for_the_block(tmp_path):
    path = str(tmp_path / ".table.lock")
    with locks.held(path):
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
        with pytest.raises(BlockingIOError):
            locks.acquire(path, wait=False)
    locks.release(locks.acquire(path, wait=False))


def test_figures_save_writes_the_png_through_a_temporary_name(tmp_path):
    plt = figures.pyplot()
    import matplotlib

    assert matplotlib.get_backend().lower() == "agg"
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    path = str(tmp_path / "sub" / "pic.png")
    assert figures.save(fig, path, dpi=20) == path
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path / "sub")) == ["pic.png"]
    assert not plt.fignum_exists(fig.number)  # closed


@pytest.mark.parametrize("seconds, text", [(4.24, "4.2 s"), (59.4, "59 s"), (125, "2 min 05 s"), (3720, "1 h 02 min")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_rate_and_a_broken_stream():
    assert (rate(15600, "tokens"), rate(1.93, "steps"), rate(0.25, "steps")) == (
        "15.6 k tokens/s", "1.9 steps/s", "0.25 steps/s")

    class Gone:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    assert print_line("x", Gone()) is False
