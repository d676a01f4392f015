"""Train a SentencePiece tokenizer on a deterministic sample of a mixture's sources.

    python -m dataprep.train_tokenizer --config configs/mixtures/demo.yaml --vocab-size 8000 --out tok.model

Writes ``tok.model`` and ``tok.model.sha256`` (the hex digest and the file name, as
``sha256sum`` prints them), to pin in the mixture config's ``tokenizer.sha256``.

Sample: a document is in the sample when ``stable_hash64(seed, "tokenizer-sample", key)``
falls in the first ``sample_fraction`` of the 64-bit range, so the sample depends only on
the keys and the seed (DESIGN.md, "Determinism rules"). Documents are split into lines,
and lines longer than SentencePiece's ``max_sentence_length`` (bytes) are cut, so nothing
is silently skipped by the trainer. Training uses a fixed random seed
(``sentencepiece.set_random_generator_seed``), byte fallback (on by default), and
in-memory input and output, so no local path ends up in the model's trainer spec.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import sys
from typing import Iterator, Optional, Sequence

if not __package__:  # run as a script: the repository root replaces dataprep/ on sys.path
    import os as _os

    sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

import sentencepiece as spm  # noqa: E402

from contract.config import ConfigError, MixtureConfig, load_mixture  # noqa: E402
from contract.hashing import stable_hash64  # noqa: E402
from dataprep import fsutil, preflight, readers  # noqa: E402

MAX_SENTENCE_BYTES = 4192  # SentencePiece's default max_sentence_length


class TrainError(ValueError):
    """Bad training arguments (named with the allowed range), or an empty sample."""


def _cut(line: str, max_bytes: int) -> Iterator[str]:
    data = line.encode("utf-8")
    if len(data) <= max_bytes:
        yield line
        return
    start = 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # do not cut inside a UTF-8 sequence
            end -= 1
        yield data[start:end].decode("utf-8")
        start = end


def sample_lines(
    config: MixtureConfig,
    files: dict[str, Sequence[str]],
    sample_fraction: float,
    seed: int,
    max_bytes: int = MAX_SENTENCE_BYTES,
) -> Iterator[str]:
    """Yields the non-blank lines of the sampled documents, sources and files in order.

    Args:
      config: the mixture (formats and fields of each source).
      files: per source, its input files (``dataprep.preflight.match_inputs``).
      sample_fraction: share of documents kept, in ``(0, 1]``.
      seed: sampling seed.
      max_bytes: longer lines are cut into pieces of at most this many UTF-8 bytes.
    """
    threshold = int(sample_fraction * 2**64)
    for source in config.sources:
        for path in files[source.name]:
            for item in readers.read_file(source, path):
                if not isinstance(item, readers.Document):
                    continue
                if stable_hash64(seed, "tokenizer-sample", item.key) >= threshold:
                    continue
                for line in item.text.splitlines():
                    line = line.strip()
                    if line:
                        yield from _cut(line, max_bytes)


def train(
    config: MixtureConfig,
    vocab_size: int,
    out: str,
    sample_fraction: float = 1.0,
    seed: int = 0,
    model_type: str = "unigram",
    byte_fallback: bool = True,
    max_sentences: int = 2_000_000,
    character_coverage: float = 0.9995,
    num_threads: int = 2,
) -> str:
    """Trains the tokenizer and writes ``out`` and ``out + ".sha256"`` through FileSystems.

    Special ids: unk 0, bos 1, eos 2, pad 3.

    Returns:
      The sha256 hex digest of the model written.

    Raises:
      TrainError: ``vocab_size`` < 16, ``sample_fraction`` not in (0, 1], ``seed`` not in
        [0, 2**32), ``max_sentences`` < 1, ``out`` is a folder (or under a file), no line
        sampled, or SentencePiece refuses the sample (e.g. fewer pieces than characters).
      ConfigError: an input glob matches nothing.
    """
    if vocab_size < 16:
        raise TrainError(f"--vocab-size must be >= 16, got {vocab_size}")
    if not 0 < sample_fraction <= 1:
        raise TrainError(f"--sample-fraction must be in (0, 1], got {sample_fraction}")
    if model_type not in ("unigram", "bpe"):
        raise TrainError(f"--model-type must be unigram or bpe, got {model_type!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise TrainError(
            f"--seed (default: the config's seed) must be an integer in [0, 2**32), got {seed!r}"
        )
    if isinstance(max_sentences, bool) or not isinstance(max_sentences, int) or max_sentences < 1:
        raise TrainError(f"--max-sentences must be >= 1, got {max_sentences!r}")
    _check_out(out)
    files = preflight.match_inputs(config)
    # Streamed, not a list: SentencePiece keeps a sample of at most ``max_sentences`` lines
    # itself, so a corpus larger than memory can be sampled.
    lines = sample_lines(config, files, sample_fraction, seed)
    first = next(lines, None)
    if first is None:
        raise TrainError("the sample holds no text; raise --sample-fraction")
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        _train_spm(
            itertools.chain([first], lines), model, vocab_size, model_type, byte_fallback, max_sentences,
            character_coverage, num_threads,
        )
    except RuntimeError as e:  # SentencePiece's own checks, e.g. a vocabulary too small
        raise TrainError(f"SentencePiece refused to train: {e}") from None
    data = model.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    fsutil.write_bytes(out, data)
    name = out.rsplit("/", 1)[-1]
    fsutil.write_bytes(out + ".sha256", f"{sha}  {name}\n".encode("ascii"))
    return sha


def _check_out(out: str) -> None:
    """Raises :class:`TrainError` where a local ``out`` cannot be written as a file."""
    import os

    from apache_beam.io.filesystems import FileSystems
    from apache_beam.io.localfilesystem import LocalFileSystem

    try:
        if not isinstance(FileSystems.get_filesystem(out), LocalFileSystem):
            return
    except ValueError:
        return
    path = os.path.abspath(out)
    if out.endswith("/") or os.path.isdir(path):
        raise TrainError(
            f"--out {out} is a folder; name the model file, e.g. {out.rstrip('/')}/tokenizer.model"
        )
    parent = os.path.dirname(path)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise TrainError(f"--out {out} is inside {parent}, which is a file, not a folder")


def _train_spm(
    sentences, model, vocab_size, model_type, byte_fallback, max_sentences, character_coverage, num_threads
) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        character_coverage=character_coverage,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dataprep.train_tokenizer", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True, help="mixture config YAML whose sources are sampled")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", required=True, help="model path (local or gs://); writes OUT and OUT.sha256")
    parser.add_argument(
        "--sample-fraction", type=float, default=1.0, help="share of documents sampled (0, 1]"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="sampling and training seed (default: config seed)"
    )
    parser.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    parser.add_argument("--no-byte-fallback", action="store_true")
    parser.add_argument("--max-sentences", type=int, default=2_000_000, help="lines SentencePiece keeps")
    args = parser.parse_args(argv)
    try:
        config = load_mixture(args.config)
        sha = train(
            config,
            args.vocab_size,
            args.out,
            args.sample_fraction,
            config.seed if args.seed is None else args.seed,
            args.model_type,
            not args.no_byte_fallback,
            args.max_sentences,
        )
    except (ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (sha256 {sha}) and {args.out}.sha256")
    return 0


if __name__ == "__main__":
    sys.exit(main())
