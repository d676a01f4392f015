"""Shard counts from input sizes, and the bucket budget: decided before any work starts.

Pure functions, no Beam and no I/O. ``dataprep.preflight`` lists the input files with their
byte sizes (``FileSystems.match`` metadata, no file is opened) and calls :func:`plan_shards`.

Glossary:
  input bytes       the listed sizes of a source's files, as stored (compressed or not).
  estimated tokens  ``ceil(input bytes * TOKENS_PER_INPUT_BYTE[format])``: an estimate
                    made high on purpose, so that shards come out at or below the target.
  shard count       ``shards_per_source`` when the config sets it, else
                    ``max(1, ceil(estimated tokens / target_shard_tokens))``.
  bucket            the documents of one shard; the packing step holds one bucket at a
                    time (on a distributed runner: its tokens, 2 or 4 bytes each).
  bucket budget     ``--max-shard-tokens`` of ``dataprep.pack``: the most estimated tokens
                    one shard may get. A config over it is refused before any work.

Worked example: 3 files of ``jsonl.gz``, 1.2 GB listed, ``target_shard_tokens`` 2**28::

    estimated tokens = ceil(1.2e9 * 2.0)           = 2,400,000,000
    shards           = ceil(2.4e9 / 268,435,456)   = 9   (about 267 M tokens each)

With ``shards_per_source: 2`` instead, a shard would get about 1.2e9 estimated tokens, over
the default budget of 2**30 (1,073,741,824): the config is refused and the message says to
set ``shards_per_source`` to at least 3.

The estimates: tokenizers with 1k-256k pieces give 0.2-0.5 tokens per byte of UTF-8 text
(0.46 measured here with a 1,000-piece vocabulary on Python code and prose, 0.23 with
8,000); JSON adds field names and escapes, so a JSONL byte holds at most a byte of text.
gzip and zstd shrink text 3-5x and Parquet (snappy or zstd pages) 2-4x. Text that is
denser than 0.5 tokens per byte (byte fallback on scripts the vocabulary lacks) gives
shards up to 2x the target.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from contract.config import MAX_SHARDS, ConfigError, MixtureConfig, SourceFormat

TOKENS_PER_INPUT_BYTE = {
    SourceFormat.JSONL: 0.5,
    SourceFormat.TEXT: 0.5,
    SourceFormat.JSONL_GZ: 2.0,
    SourceFormat.JSONL_ZST: 2.0,
    SourceFormat.PARQUET: 1.5,
}
# The most estimated tokens in one shard by default: 2 GiB of uint16 tokens in the packing
# step of a distributed runner (docs/dataprep.md, "Sizing").
DEFAULT_MAX_SHARD_TOKENS = 2**30


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one source is sharded.

    Attributes:
      input_bytes: sum of the listed sizes of the source's files.
      estimated_tokens: ``ceil(input_bytes * TOKENS_PER_INPUT_BYTE[format])``.
      num_shards: shards written for the source, in ``[1, 99999]``.
      auto: True when ``num_shards`` came from ``target_shard_tokens``.
    """

    input_bytes: int
    estimated_tokens: int
    num_shards: int
    auto: bool

    @property
    def tokens_per_shard(self) -> int:
        """Estimated tokens of the largest shard (``ceil(estimated_tokens / num_shards)``)."""
        return -(-self.estimated_tokens // self.num_shards)


def estimated_tokens(input_bytes: int, fmt: SourceFormat) -> int:
    """Returns ``ceil(input_bytes * TOKENS_PER_INPUT_BYTE[fmt])``.

    Raises:
      ValueError: ``input_bytes < 0``.
    """
    if input_bytes < 0:
        raise ValueError(f"input_bytes must be >= 0, got {input_bytes}")
    return math.ceil(input_bytes * TOKENS_PER_INPUT_BYTE[fmt])


def auto_shard_count(tokens: int, target_shard_tokens: int) -> int:
    """Returns ``max(1, ceil(tokens / target_shard_tokens))``.

    Raises:
      ValueError: ``target_shard_tokens < 1`` or ``tokens < 0``.
    """
    if target_shard_tokens < 1 or tokens < 0:
        raise ValueError(f"need tokens >= 0 and target_shard_tokens >= 1, got {tokens}, {target_shard_tokens}")
    return max(1, -(-tokens // target_shard_tokens))


def plan_shards(
    config: MixtureConfig,
    sizes: Mapping[str, Sequence[int]],
    max_shard_tokens: int = DEFAULT_MAX_SHARD_TOKENS,
) -> dict[str, ShardPlan]:
    """Returns each source's :class:`ShardPlan`, checked against the bucket budget.

    Args:
      config: the validated mixture config.
      sizes: per source name, the listed byte sizes of its input files.
      max_shard_tokens: the bucket budget, >= ``config.seq_len``.

    Raises:
      ConfigError: the budget is below ``seq_len``; ``target_shard_tokens`` is over it; a source's estimated tokens
        per shard are over it (naming the ``shards_per_source`` to set); or the automatic
        count would exceed 99999 shards (naming the ``target_shard_tokens`` to set).
    """
    if max_shard_tokens < config.seq_len:
        raise ConfigError(
            f"--max-shard-tokens: must be >= seq_len ({config.seq_len}), got {max_shard_tokens}; a shard holds "
            f"whole rows of seq_len tokens"
        )
    explicit = config.shards_per_source
    if explicit is None and config.target_shard_tokens > max_shard_tokens:
        raise ConfigError(
            f"target_shard_tokens: {config.target_shard_tokens:,} is over the bucket budget of "
            f"{max_shard_tokens:,} tokens a shard (--max-shard-tokens); set target_shard_tokens to at most "
            f"{max_shard_tokens}, or raise --max-shard-tokens if the packing workers have the memory"
        )
    plans = {}
    for i, source in enumerate(config.sources):
        total = int(sum(sizes[source.name]))
        est = estimated_tokens(total, source.format)
        where = f"sources[{i}] {source.name!r}"
        what = (
            f"{total:,} bytes of {source.format.value} at the estimate of "
            f"{TOKENS_PER_INPUT_BYTE[source.format]:g} tokens a byte is about {est:,} tokens"
        )
        if explicit is None:
            n = auto_shard_count(est, config.target_shard_tokens)
            if n > MAX_SHARDS:
                need = -(-est // MAX_SHARDS)
                raise ConfigError(
                    f"{where}: {what}, {n:,} shards of target_shard_tokens {config.target_shard_tokens:,}, "
                    f"over the {MAX_SHARDS} a source may have; set target_shard_tokens to at least {need}, "
                    "or split the source in two"
                )
            plans[source.name] = ShardPlan(total, est, n, auto=True)
            continue
        plan = ShardPlan(total, est, explicit, auto=False)
        if plan.tokens_per_shard > max_shard_tokens:
            need = -(-est // max_shard_tokens)
            raise ConfigError(
                f"shards_per_source: {where}: {what}, {plan.tokens_per_shard:,} a shard in {explicit} shards, "
                f"over the bucket budget of {max_shard_tokens:,} (--max-shard-tokens); set shards_per_source "
                f"to at least {need}, or remove it so that target_shard_tokens picks the count"
            )
        plans[source.name] = plan
    return plans


# Dataflow worker sizing, from the measurements of docs/dataprep.md ("Measured" and "Sizing"):
# pipeline tokens per CPU second with an 8,000-piece vocabulary (4.34 M on the 2-core machine,
# loaded), Dataflow's own work (GCS, shuffle, harness) taken as 1.5x that (not measured here),
# what the packing step holds per token of a bucket on the shuffle path (2.1 bytes) and the
# base of one Python SDK process (0.25 GB; Dataflow runs one per vCPU).
PIPELINE_TOKENS_PER_CPU_SECOND = 4.34e6
DATAFLOW_OVERHEAD = 1.5
SHUFFLE_BUCKET_BYTES_PER_TOKEN = 2.1
SDK_PROCESS_BASE_BYTES = 0.25e9
# GB of memory per vCPU of the n1 machine families.
MACHINE_GB_PER_VCPU = {"n1-standard": 3.75, "n1-highmem": 6.5}


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """A Dataflow worker suggestion for a run (:func:`worker_plan`).

    Attributes:
      tokens: estimated tokens of the run (high on purpose, :func:`estimated_tokens`).
      vcpu_hours: ``tokens / PIPELINE_TOKENS_PER_CPU_SECOND * DATAFLOW_OVERHEAD / 3600``.
      hours: the wall time aimed at.
      workers: ``max(1, ceil(vcpu_hours / hours / vcpus))`` machines of ``vcpus`` vCPUs.
      vcpus: vCPUs a machine.
      machine: the n1 family whose memory a vCPU covers the packing step's need, or None
        when none does (then more shards are needed).
      gb_per_vcpu: ``largest shard's estimated tokens * 2.1 bytes + 0.25 GB``.
    """

    tokens: int
    vcpu_hours: float
    hours: float
    workers: int
    vcpus: int
    machine: str | None
    gb_per_vcpu: float

    def describe(self) -> str:
        """One line: ``2 n1-standard-4 workers for a 24 h run (...)``."""
        if self.machine is None:
            return (f"the largest shard needs about {self.gb_per_vcpu:.2f} GB a vCPU in the packing step, more than "
                    f"any n1 machine has ({max(MACHINE_GB_PER_VCPU.values())} GB): set a smaller target_shard_tokens")
        return (f"{self.workers:,} {self.machine}-{self.vcpus} worker{'s' if self.workers != 1 else ''} for a "
                f"{self.hours:g} h run: {_hours(self.vcpu_hours)} vCPU-hours for about {self.tokens:,} tokens (estimated "
                f"high on purpose) at {PIPELINE_TOKENS_PER_CPU_SECOND / 1e6:.2f} M tokens a CPU second x "
                f"{DATAFLOW_OVERHEAD:g} for Dataflow's own work; the packing step needs about "
                f"{self.gb_per_vcpu:.2f} GB a vCPU (largest shard x {SHUFFLE_BUCKET_BYTES_PER_TOKEN} bytes a token + "
                f"{SDK_PROCESS_BASE_BYTES / 1e9:g} GB a Python process)")


def _hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 100 else f"{h:.1f}" if h >= 1 else f"{h:.3f}"


def worker_plan(plans: Mapping[str, ShardPlan], hours: float = 24.0, vcpus: int = 4) -> WorkerPlan:
    """The Dataflow workers docs/dataprep.md's "Sizing" section suggests for these shard plans.

    Raises:
      ValueError: ``hours <= 0`` or ``vcpus < 1``.
    """
    if not hours > 0 or vcpus < 1:
        raise ValueError(f"need hours > 0 and vcpus >= 1, got {hours}, {vcpus}")
    tokens = sum(p.estimated_tokens for p in plans.values())
    vcpu_hours = tokens / PIPELINE_TOKENS_PER_CPU_SECOND * DATAFLOW_OVERHEAD / 3600
    largest = max((p.tokens_per_shard for p in plans.values()), default=0)
    gb = (largest * SHUFFLE_BUCKET_BYTES_PER_TOKEN + SDK_PROCESS_BASE_BYTES) / 1e9
    machine = next((m for m, cap in MACHINE_GB_PER_VCPU.items() if gb <= cap), None)
    return WorkerPlan(tokens, vcpu_hours, hours, max(1, math.ceil(vcpu_hours / hours / vcpus)), vcpus, machine, gb)
