"""The MaxText internals integrations/maxtext/ relies on are where it expects them (internals.py names them all).

Fails with the list of what moved when a MaxText release moves one; skipped where MaxText is absent.
"""

import pytest

from integrations.maxtext import internals

pytestmark = pytest.mark.skipif(not internals.available(),
                                reason="MaxText is not installed in this Python (bash scripts/setup_maxtext.sh makes "
                                       ".venv-maxtext, where .ci/run runs these tests)")


def test_every_internal_is_there_with_the_parameters_we_pass():
    assert internals.check() == []


def test_a_moved_internal_is_named():
    with pytest.raises(internals.MaxTextMovedError, match=r"maxtext\.utils\.train_utils\.no_such_function is gone"):
        internals.get("maxtext.utils.train_utils", "no_such_function")
    with pytest.raises(internals.MaxTextMovedError, match="maxtext.no_such_module is not importable"):
        internals.get("maxtext.no_such_module", "x")


def test_the_installed_release_is_the_checked_one():
    from importlib.metadata import version

    assert version("maxtext") == internals.MAXTEXT_VERSION


def test_unsupported_config_is_refused_naming_the_key():
    from types import SimpleNamespace

    from integrations.maxtext.trainer import MaxTextConfigError, check_config

    with pytest.raises(MaxTextConfigError, match="gradient_accumulation_steps=4.*set gradient_accumulation_steps=1"):
        check_config(SimpleNamespace(gradient_accumulation_steps=4))
    check_config(SimpleNamespace(gradient_accumulation_steps=1, enable_dropout=False))
