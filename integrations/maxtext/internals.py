"""Every MaxText internal this integration relies on, named in one place.

MaxText (AI-Hypercomputer/maxtext) has no data plug-in and does not expose per-device gradients, so
the integration uses a few of its functions that are not a public API. They are all looked up here,
by name, and :func:`check` verifies each one (module, attribute, the parameters we pass) so that a
MaxText release that moves one fails with a message naming it (``tests/test_maxtext_internals.py``),
not with an ``AttributeError`` deep inside a run. Checked against ``maxtext==0.2.5``
(``integrations/maxtext/constraints.txt``).

What each is used for:

``pyconfig.initialize(argv)``            MaxText's own config: base YAML plus ``key=value`` overrides,
                                         validated by its pydantic types (the launcher and replay build
                                         the run's config with it).
``train_utils.setup_train_loop``         builds MaxText's mesh, NNX model, optimizer, checkpoint manager
                                         and train state (restored from ``load_full_state_path`` or the
                                         run's latest checkpoint); it imports
``input_pipeline_interface.create_data_iterator``  *inside the function*, so setting that attribute
                                         before the call installs our iterator (the lazy import).
``train.loss_fn(model, config, data, dropout_rng, params, is_train=)``  MaxText's loss: the forward pass
                                         and ``aux`` (``xent_sum``, ``total_weights``, ``moe_lb_loss``);
                                         our step differentiates it per device.
``train.train_step``                     the module-level step MaxText jits (``train_utils.jit_train_and_eval_step``);
                                         the benchmark times it beside ours.
``maxtext_utils.apply_gradient_clipping`` the clipping MaxText's step applies (``gradient_clipping_threshold``).
``sharding.get_input_data_sharding``     MaxText's input sharding (the batch's ``NamedSharding``); the
                                         loader places batches with the same axes.
``checkpointing.save_checkpoint``        MaxText's Orbax save: ``checkpoints/<step>/items`` and, for
                                         ``dataset_type=grain`` (the checkpoint fallback for non-Grain
                                         iterators), ``checkpoints/<step>/iter/process_<i>-of-<n>.json``
                                         holding ``iterator.get_state().decode()``
                                         (``grain_utility._state_to_text``); restore calls ``set_state(bytes)``.
``checkpointing.latest_step``, ``wait_until_finished``  the run's latest checkpoint; a save committed.
``train_state_nnx.TrainStateNNX.apply_gradients``  the optimizer update of MaxText's state.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

MAXTEXT_VERSION = "0.2.5"  # the release this list was checked against

# (module, attribute, parameters our calls pass by name or position; () to check existence only)
INTERNALS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("maxtext.configs.pyconfig", "initialize", ("argv",)),
    ("maxtext.utils.train_utils", "setup_train_loop", ("config", "recorder", "devices")),
    ("maxtext.input_pipeline.input_pipeline_interface", "create_data_iterator", ("config", "mesh")),
    ("maxtext.trainers.pre_train.train", "loss_fn", ("model", "config", "data", "dropout_rng", "params", "is_train")),
    ("maxtext.trainers.pre_train.train", "train_step",
     ("model", "config", "state_mesh_shardings", "params_shardings", "state", "data", "dropout_rng")),
    ("maxtext.utils.train_utils", "jit_train_and_eval_step",
     ("config", "model", "mesh", "state", "state_mesh_shardings", "train_step")),
    ("maxtext.utils.maxtext_utils", "apply_gradient_clipping", ("raw_grads", "state", "clipping_threshold")),
    ("maxtext.utils.sharding", "get_input_data_sharding", ("config", "mesh")),
    ("maxtext.common.checkpointing", "save_checkpoint",
     ("checkpoint_manager", "step", "state", "config", "data_iterator", "force")),
    ("maxtext.common.checkpointing", "latest_step", ("checkpoint_manager",)),
    ("maxtext.common.checkpointing", "wait_until_finished", ("checkpoint_manager",)),
    ("maxtext.common.grain_utility", "_state_to_text", ("iterator",)),
    ("maxtext.common.grain_utility", "_set_state_from_text", ("iterator", "text")),
    ("maxtext.common.train_state_nnx", "TrainStateNNX", ()),
)


class MaxTextMovedError(RuntimeError):
    """A MaxText internal the integration relies on is missing or changed its parameters."""


def available() -> bool:
    """Whether ``maxtext`` is importable here (``scripts/setup_maxtext.sh`` makes such an environment)."""
    return importlib.util.find_spec("maxtext") is not None


def decouple_gcloud() -> None:
    """MaxText's switch to run without Google Cloud packages (stubs for GCS, diagnostics, goodput):
    ``DECOUPLE_GCLOUD=TRUE`` before its first import (kept when the caller set it)."""
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")


def get(module: str, name: str) -> Any:
    """``module.name``, imported; raises :class:`MaxTextMovedError` naming both when it is gone."""
    decouple_gcloud()
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise MaxTextMovedError(f"MaxText internal {module} is not importable ({e}); this integration was checked "
                                f"against maxtext=={MAXTEXT_VERSION}: install that release "
                                "(scripts/setup_maxtext.sh) or update integrations/maxtext/internals.py") from None
    if not hasattr(mod, name):
        raise MaxTextMovedError(f"MaxText internal {module}.{name} is gone; this integration was checked against "
                                f"maxtext=={MAXTEXT_VERSION}: install that release (scripts/setup_maxtext.sh) or update "
                                "integrations/maxtext/internals.py")
    return getattr(mod, name)


def check() -> list[str]:
    """Every problem with :data:`INTERNALS` in this environment (empty: all there, with the parameters we pass).

    Also checks the lazy import the launcher depends on: ``setup_train_loop``'s source imports
    ``create_data_iterator`` inside the function (were it a module-level import, setting the attribute
    would not reach it)."""
    problems = []
    for module, name, params in INTERNALS:
        try:
            obj = get(module, name)
        except MaxTextMovedError as e:
            problems.append(str(e))
            continue
        if params:
            try:
                have = set(inspect.signature(obj).parameters)
            except (TypeError, ValueError) as e:
                problems.append(f"{module}.{name}: no signature ({e})")
                continue
            missing = [p for p in params if p not in have]
            if missing:
                problems.append(f"{module}.{name}: parameters {missing} are gone (has {sorted(have)}); checked against "
                                f"maxtext=={MAXTEXT_VERSION}")
    try:
        src = inspect.getsource(get("maxtext.utils.train_utils", "setup_train_loop"))
        if "from maxtext.input_pipeline.input_pipeline_interface import create_data_iterator" not in src:
            problems.append("maxtext.utils.train_utils.setup_train_loop no longer imports create_data_iterator inside "
                            "the function: the launcher's iterator would not be installed")
    except (MaxTextMovedError, OSError, TypeError) as e:
        problems.append(f"setup_train_loop's source: {e}")
    try:
        src = inspect.getsource(get("maxtext.common.checkpointing", "save_checkpoint"))
        if 'checkpointables["iter"]' not in src or '"grain"' not in src:
            problems.append("maxtext.common.checkpointing.save_checkpoint no longer saves the data iterator under "
                            "'iter' for dataset_type=grain: the loader state would not be checkpointed")
    except (MaxTextMovedError, OSError, TypeError) as e:
        problems.append(f"save_checkpoint's source: {e}")
    return problems


def require() -> None:
    """Raises :class:`MaxTextMovedError` listing every problem :func:`check` finds."""
    problems = check()
    if problems:
        raise MaxTextMovedError("MaxText has moved internals this integration relies on:\n  " + "\n  ".join(problems))
