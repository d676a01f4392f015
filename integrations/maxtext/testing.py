"""The tiny MoE and the packed dataset that the MaxText tests and benchmark share.

``TINY``: MaxText overrides of a mixtral-style decoder (4 experts, top-2, 2 layers, width 64, rows of 128
tokens) on 4 CPU devices as data 2 x expert 2 (one row a device). :func:`write_dataset`: a real packed
dataset (``loader.testing``'s ArrayRecord shards and manifest) and its mixture config, two sources.
"""

from __future__ import annotations

import os

TINY = ("hardware=cpu skip_jax_distributed_system=true decoder_block=mixtral num_experts=4 num_experts_per_tok=2 "
        "base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=128 base_moe_mlp_dim=128 head_dim=16 "
        "base_num_decoder_layers=2 vocab_size=512 max_target_length=128 per_device_batch_size=1 megablox=false "
        "sparse_matmul=false attention=dot_product dtype=float32 weight_dtype=float32 ici_data_parallelism=2 "
        "ici_expert_parallelism=2 enable_dropout=false").split()


def base_yml() -> str:
    """MaxText's own base config (``<site-packages>/maxtext/configs/base.yml``)."""
    import maxtext

    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def write_dataset(root: str, rows: tuple[int, int] = (40, 30)) -> tuple[str, str]:
    """Writes ``<root>/mixture.yaml`` (sources a and b, equal weights, seq_len 128) and ``<root>/dataset``
    (``rows`` rows of each, token ids below 256); returns ``(mixture path, dataset path)``."""
    import yaml

    from contract.config import load_mixture
    from loader import testing as lt

    mixture, dataset = os.path.join(root, "mixture.yaml"), os.path.join(root, "dataset")
    with open(mixture, "w", encoding="utf-8") as f:
        yaml.safe_dump(lt.synthetic_mixture({"a": 0.5, "b": 0.5}, seq_len=128).to_dict(), f)
    lt.write_synthetic_dataset(dataset, {"a": rows[0], "b": rows[1]}, seq_len=128, vocab_size=256,
                               mixture=load_mixture(mixture))
    return mixture, dataset
