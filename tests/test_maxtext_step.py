"""The integration's per-device step computes MaxText's own update (integrations/maxtext/trainer.py).

``make_step`` differentiates, on each device, ``c_d = xent_sum_d / W + moe_lb_loss_d / N`` (the module
docstring: MaxText's cross entropy and its per-sequence load-balancing loss over the device's rows, ``W``
the global target-token count). Their sum is MaxText's loss, so on the same state and batch the step's
loss and gradient norm must equal those of MaxText's own jitted ``train_step`` (GSPMD over the global
batch) up to float rounding, here with ``load_balance_loss_weight > 0`` so that the batch-level MoE term
is in play. Needs MaxText; skipped with the reason elsewhere.
"""

import numpy as np
import pytest

from integrations.maxtext import internals

pytestmark = pytest.mark.skipif(not internals.available(),
                                reason="MaxText is not installed in this Python (bash scripts/setup_maxtext.sh makes "
                                       ".venv-maxtext, where .ci/run runs these tests)")


def test_the_per_device_step_is_maxtexts_update(tmp_path):
    import jax
    from flax.core.spmd import logical_axis_rules

    from integrations.maxtext import trainer as mtt
    from integrations.maxtext.iterator import LoaderIterator, build_loader
    from integrations.maxtext.testing import TINY, base_yml, write_dataset

    mixture, dataset = write_dataset(str(tmp_path))
    config = mtt.maxtext_config(base_yml(), [*TINY, "steps=4", "learning_rate_schedule_steps=4",
                                             "load_balance_loss_weight=0.01"],
                                base_output_directory=str(tmp_path), run_name="same", enable_checkpointing="false")

    def make_iterator(cfg, mesh):
        return LoaderIterator(build_loader(cfg, mesh, mixture=mixture, dataset=dataset, seed=0))

    ctx = mtt.setup(config, make_iterator, jax.devices()[:4])
    batch = next(ctx.iterator)
    ours = mtt.make_step(ctx, mtt.leaf_table(ctx.graphdef, ctx.state)[0])
    own, _ = internals.get("maxtext.utils.train_utils", "jit_train_and_eval_step")(
        config, ctx.graphdef, ctx.mesh, ctx.state, ctx.state_shardings,
        internals.get("maxtext.trainers.pre_train.train", "train_step"))
    copy = jax.tree_util.tree_map(lambda x: x.copy(), ctx.state)
    with jax.set_mesh(ctx.mesh):
        _, out = ours(copy, batch, np.zeros(5, np.int32), np.zeros(4, np.float32))
        with logical_axis_rules(config.logical_axis_rules):
            _, metrics = own(ctx.state, batch)  # MaxText's step donates its state: last
    scalars = jax.device_get(metrics["scalar"])
    assert float(scalars["learning/moe_lb_loss"]) > 0  # the batch-level MoE term is in the loss
    assert float(out["loss"]) == pytest.approx(float(scalars["learning/loss"]), rel=1e-5)
    assert float(out["grad_norm"]) == pytest.approx(float(scalars["learning/raw_grad_norm"]), rel=1e-4)
    # the batch hash, added up from each device's block of rows in the step, is the whole batch's fingerprint
    from replay.run import fingerprint as fpm

    host = np.asarray(jax.device_get(batch["inputs"]))
    assert fpm.fingerprint_int(np.asarray(out["batch"])) == fpm.fingerprint_int(fpm.fingerprint_np(host))
    ctx.iterator.close()
