"""Epochs of each source over a planned run (contract/plan.py): table-driven, exact values."""

import pytest

from contract import plan

PHASES = [(0, {"web": 3.0, "books": 1.0}), (100, {"web": 1.0, "books": 1.0})]


@pytest.mark.parametrize("steps, batch, rows", [
    (1, 8, {"web": 6.0, "books": 2.0}),
    (100, 8, {"web": 600.0, "books": 200.0}),  # all in phase 0
    (150, 8, {"web": 800.0, "books": 400.0}),  # + 50 steps of 4 + 4 rows
    (150, 1, {"web": 100.0, "books": 50.0}),
])
def test_rows_and_epochs_per_source(steps, batch, rows):
    got = plan.source_epochs(PHASES, {"web": 400, "books": 50}, steps, batch)
    assert {e.source: e.rows for e in got} == rows
    assert {e.source: e.epochs for e in got} == {"web": rows["web"] / 400, "books": rows["books"] / 50}
    # an epoch at the highest weight of the run: web 3/4 (phase 0), books 1/2 only when phase 1 is reached
    books_share = 0.5 if steps > 100 else 0.25
    assert {e.source: e.steps_per_epoch for e in got} == {"web": 400 / (batch * 0.75),
                                                          "books": 50 / (batch * books_share)}


def test_describe_warns_above_the_threshold():
    items = plan.source_epochs(PHASES, {"web": 4000, "books": 50}, 150, 8)
    lines, warnings = plan.describe(items, 150, 8, max_epochs=4)
    assert lines == [
        "web: 4,000 rows, 0.20 epochs in 150 steps of 8 rows (an epoch every 666.7 steps at its highest weight)",
        "books: 50 rows, 8.00 epochs in 150 steps of 8 rows (an epoch every 12.5 steps at its highest weight)",
    ]
    assert warnings == [
        "source 'books' repeats 8.0 times in the planned 150 steps (an epoch every 12.5 steps), over 4 epochs, "
        "beyond which repeated data helps less and less (Muennighoff et al. 2023); lower its weight, add "
        "documents to it, or plan fewer steps"
    ]


def test_a_source_never_drawn_and_epoch_lengths_without_a_plan():
    phases = [(0, {"a": 1.0, "b": 0.0}), (10, {"a": 1.0, "b": 1.0})]
    items = plan.source_epochs(phases, {"a": 10, "b": 5}, 10, 4)
    assert [(e.source, e.rows, e.epochs, e.steps_per_epoch) for e in items] == [("a", 40.0, 4.0, 2.5),
                                                                                ("b", 0.0, 0.0, None)]
    assert plan.describe(items, 10, 4)[0][1] == "b: 5 rows, 0.00 epochs in 10 steps of 4 rows (never drawn)"
    assert plan.epoch_lengths(phases, {"a": 10, "b": 5, "c": 3}) == [
        "a: 10 rows, one epoch every 10 rows of training (weight 1 from step 0)",
        "b: 5 rows, one epoch every 10 rows of training (weight 0.5 from step 10)",
        "c: 3 rows, weight 0 in every phase",
    ]


def test_steps_for_tokens_and_bad_values():
    assert plan.steps_for_tokens(10**9, 256, 8192) == 477  # ceil(1e9 / 2,097,152)
    assert plan.steps_for_tokens(256 * 8192, 256, 8192) == 1
    with pytest.raises(plan.PlanError, match=r"^--train-tokens: must be an integer >= 1, got 0$"):
        plan.steps_for_tokens(0, 256, 8192)
    with pytest.raises(plan.PlanError, match=r"^--global-batch: must be an integer >= 1, got 0$"):
        plan.source_epochs(PHASES, {"web": 1}, 10, 0)
