"""matplotlib set-up for every picture the toolkit draws (``report.png``, ``train.png``,
``replay.png``, ``scan.png``, ``triage.png``, ``goodput.png``).

Every figure is a PNG file, on machines that have no display: the Agg backend, selected before
``pyplot`` is first imported, and files written through a temporary name so that a reader never
sees half a picture.
"""

from __future__ import annotations

import os
from typing import Any


def use_agg() -> None:
    """Selects matplotlib's Agg backend (PNG rendering, no display): before any figure is made."""
    import matplotlib

    matplotlib.use("Agg")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (:func:`use_agg`)."""
    use_agg()
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str, dpi: int) -> str:
    """Writes the pyplot figure ``fig`` as a PNG at ``path`` (its folder made) and closes it.

    Written to a temporary name beside it (``<name>.tmp.png``), then renamed over ``path``: a reader
    sees the old picture or the new one, never half of one. The format follows ``path``'s
    extension as in ``Figure.savefig`` (PNG without one).

    Returns:
      ``path``.

    Raises:
      OSError: the folder or the file cannot be written (the temporary file is removed).
    """
    plt = pyplot()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    base, ext = os.path.splitext(path)
    tmp = f"{base}.tmp{ext or '.png'}"
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
