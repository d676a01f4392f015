"""report.png's fill labels read as the totals text and the closing table do (rounded to 0.01)."""

from dataprep.report import _fill_pct


def test_fill_labels_round_like_the_tables_and_never_read_full_below_100():
    assert _fill_pct(99.6655) == "99.67%"  # the table's f"{0.996655:.2%}"; flooring gave 99.66%
    assert _fill_pct(96.69) == "96.69%"
    assert _fill_pct(99.996) == "99.99%"  # not "100.00%": a row slot is still empty
    assert _fill_pct(100.0) == "100.00%"
