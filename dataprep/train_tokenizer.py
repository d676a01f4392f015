"""Train a SentencePiece tokenizer on a deterministic sample of a mixture's sources.

    python -m dataprep.train_tokenizer --config configs/mixtures/demo.yaml --vocab-size 8000 --out tok.model

Writes ``tok.model`` and ``tok.model.sha256`` (the hex digest and the file name, as
``sha256sum`` prints them), and prints the exact lines that pin it in the mixture config's
``tokenizer:`` section; ``--pin`` writes them there itself (:func:`pin_config`: the config
file is edited line by line, so its comments and layout stay).

Sample, chosen here, never by SentencePiece:

1. documents: a document is in the sample when ``stable_hash64(seed, "tokenizer-sample",
   key)`` falls in the first ``sample_fraction`` of the 64-bit range;
2. lines: the documents are split into lines (longer ones cut into pieces of at most
   SentencePiece's ``max_sentence_length`` bytes, so the trainer skips none), and the
   ``max_sentences`` pieces with the smallest ``stable_hash64(seed, "tokenizer-line", key,
   line, piece)`` are kept (a bottom-k sample: the same set whatever the order of files,
   sources or workers);
3. they are handed to SentencePiece sorted by that hash, with ``input_sentence_size=0``
   (keep everything) and ``shuffle_input_sentence=false``.

SentencePiece never samples on its own: its reservoir sampler (``trainer_interface.cc``,
``SentenceSelector``) is what made models differ from run to run when a sample held more
lines than ``input_sentence_size`` (google/sentencepiece#496). Its E-step and pruning
split the sentences over ``num_threads`` threads by index and add the partial sums in
thread order (``unigram_model_trainer.cc``), so a model depends on the thread count but
not on scheduling: ``--num-threads`` is fixed (default 4, never the machine's core
count) and recorded in the model's trainer spec.

The same config, seed and options give the same model bytes on any machine with the same
SentencePiece wheel (version and CPU architecture: floating-point results of other builds
may differ) and the same input files.

Normalization: SentencePiece normalizes text before training and encoding, and decoding
returns the normalized text, not the input bytes. ``--normalization nmt_nfkc`` (the
default, SentencePiece's): Unicode NFKC plus a few NMT rules, and runs of whitespace
collapse to one space; ``identity`` keeps text byte-exact (with byte fallback, every byte
round-trips; whitespace is kept too). Training uses a fixed random seed
(``sentencepiece.set_random_generator_seed``), byte fallback (on by default), and
in-memory input and output, so no local path ends up in the model's trainer spec.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import io
import sys
from typing import Iterator, Optional, Sequence

if not __package__:  # run as a script: the repository root replaces dataprep/ on sys.path
    import os as _os

    sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

import sentencepiece as spm  # noqa: E402
import yaml  # noqa: E402

from contract.config import ConfigError, MixtureConfig, load_mixture  # noqa: E402
from contract.hashing import _encode_part, stable_hash64  # noqa: E402
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


NORMALIZATIONS = {
    "nmt_nfkc": "Unicode NFKC, plus NMT rules (control characters removed, some spaces unified); "
    "runs of whitespace collapse to one space",
    "nfkc": "Unicode NFKC; runs of whitespace collapse to one space",
    "nmt_nfkc_cf": "nmt_nfkc, then Unicode case folding (lower case); runs of whitespace collapse",
    "nfkc_cf": "nfkc, then Unicode case folding (lower case); runs of whitespace collapse",
    "identity": "none: text is kept byte-exact, whitespace included (with byte fallback every byte round-trips)",
}
DEFAULT_NUM_THREADS = 4
DEFAULT_CHARACTER_COVERAGE = 0.9995  # SentencePiece's default
DEFAULT_MAX_SENTENCES = 2_000_000


def sample_lines(
    config: MixtureConfig,
    files: dict[str, Sequence[str]],
    sample_fraction: float,
    seed: int,
    max_bytes: int = MAX_SENTENCE_BYTES,
) -> Iterator[tuple[str, int, int, str]]:
    """Yields ``(key, line, piece, text)`` for the non-blank lines of the sampled documents.

    Args:
      config: the mixture (formats and fields of each source).
      files: per source, its input files (``dataprep.preflight.match_inputs``).
      sample_fraction: share of documents kept, in ``(0, 1]``.
      seed: sampling seed.
      max_bytes: longer lines are cut into pieces of at most this many UTF-8 bytes.

    ``line`` is the 0-based index of the line in its document (blank lines count) and
    ``piece`` the index of the piece in its line. Sources and files in config order.
    """
    threshold = int(sample_fraction * 2**64)
    for source in config.sources:
        for path in files[source.name]:
            for item in readers.read_file(source, path):
                if not isinstance(item, readers.Document):
                    continue
                if stable_hash64(seed, "tokenizer-sample", item.key) >= threshold:
                    continue
                for i, line in enumerate(item.text.splitlines()):
                    line = line.strip()
                    if line:
                        for j, piece in enumerate(_cut(line, max_bytes)):
                            yield item.key, i, j, piece


def choose_sentences(lines: Iterator[tuple[str, int, int, str]], seed: int, max_sentences: int) -> list[str]:
    """The bottom-``max_sentences`` lines by ``stable_hash64(seed, "tokenizer-line", key, line, piece)``.

    Returns:
      The chosen texts in increasing hash order: the same list whatever order ``lines``
      come in (keys are unique, so no two lines share all hash parts). Memory: at most
      ``max_sentences`` lines are kept while streaming.
    """
    prefix = hashlib.blake2b(digest_size=8)
    for part in (seed, "tokenizer-line"):
        prefix.update(_encode_part(part))
    heap: list[tuple[int, str, int, int, str]] = []  # (-hash, key, line, piece, text): a max-heap
    for key, i, j, text in lines:
        h = prefix.copy()
        h.update(_encode_part(key) + _encode_part(i) + _encode_part(j))
        value = int.from_bytes(h.digest(), "little")
        if len(heap) < max_sentences:
            heapq.heappush(heap, (-value, key, i, j, text))
        elif value < -heap[0][0]:
            heapq.heapreplace(heap, (-value, key, i, j, text))
    return [entry[4] for entry in sorted(heap, reverse=True)]


def train(
    config: MixtureConfig,
    vocab_size: int,
    out: str,
    sample_fraction: float = 1.0,
    seed: int = 0,
    model_type: str = "unigram",
    byte_fallback: bool = True,
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    character_coverage: float = DEFAULT_CHARACTER_COVERAGE,
    num_threads: int = DEFAULT_NUM_THREADS,
    normalization: str = "nmt_nfkc",
) -> str:
    """Trains the tokenizer and writes ``out`` and ``out + ".sha256"`` through FileSystems.

    Special ids: unk 0, bos 1, eos 2, pad 3. The sample is chosen by :func:`sample_lines`
    and :func:`choose_sentences` (at most ``max_sentences`` lines); SentencePiece keeps all
    of it and samples nothing.

    Returns:
      The sha256 hex digest of the model written.

    Raises:
      TrainError: ``vocab_size`` < 16, ``sample_fraction`` not in (0, 1], ``seed`` not in
        [0, 2**32), ``max_sentences`` < 1, ``num_threads`` not in [1, 1024],
        ``character_coverage`` not in (0, 1], an unknown ``normalization`` (or ``identity``
        without byte fallback), ``out`` is a folder (or under a file), no line sampled, or
        SentencePiece refuses the sample (e.g. fewer pieces than characters).
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
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or not 1 <= num_threads <= 1024:
        raise TrainError(
            f"--num-threads must be in [1, 1024], got {num_threads!r}; keep it fixed: the model depends on it"
        )
    if isinstance(character_coverage, bool) or not isinstance(character_coverage, (int, float)) or not (
        0 < character_coverage <= 1
    ):
        raise TrainError(f"--character-coverage must be in (0, 1], got {character_coverage!r}")
    if normalization not in NORMALIZATIONS:
        raise TrainError(f"--normalization must be one of {sorted(NORMALIZATIONS)}, got {normalization!r}")
    if normalization == "identity" and not byte_fallback:
        raise TrainError(
            "--normalization identity keeps text byte-exact only with byte fallback; drop --no-byte-fallback"
        )
    _check_out(out)
    files = preflight.match_inputs(config)
    sentences = choose_sentences(sample_lines(config, files, sample_fraction, seed), seed, max_sentences)
    if not sentences:
        raise TrainError("the sample holds no text; raise --sample-fraction")
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        _train_spm(
            iter(sentences), model, vocab_size, model_type, byte_fallback, character_coverage, num_threads,
            normalization,
        )
    except RuntimeError as e:  # SentencePiece's own checks, e.g. a vocabulary too small
        raise TrainError(_refusal(str(e), character_coverage)) from None
    data = model.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    fsutil.write_bytes(out, data)
    name = out.rsplit("/", 1)[-1]
    fsutil.write_bytes(out + ".sha256", f"{sha}  {name}\n".encode("ascii"))
    return sha


def _refusal(message: str, character_coverage: float) -> str:
    """SentencePiece's refusal in this command's terms (its own flags, e.g. ``--character_coverage``,
    are not this command's options)."""
    import re

    m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if m:
        return (
            f"SentencePiece refused to train: the sample's characters (at --character-coverage "
            f"{character_coverage:g}) and the special pieces need {m.group(2)} pieces, more than --vocab-size "
            f"{m.group(1)}; set --vocab-size to at least {m.group(2)}, or lower --character-coverage"
        )
    return f"SentencePiece refused to train: {message}"


class PinError(ValueError):
    """The config file's ``tokenizer:`` section could not be edited line by line (e.g. flow style)."""


def pin_values(config: MixtureConfig, out: str, sha: str) -> dict[str, str]:
    """The ``tokenizer:`` fields that pin the model at ``out``: ``sha256``, and ``path`` when the
    config names another file (relative to the config's folder for a local model, else the URL)."""
    import os

    values = {}
    if fsutil.is_local(out) and config.path:
        here = os.path.dirname(os.path.abspath(config.path))
        if os.path.realpath(out) != os.path.realpath(config.tokenizer.path):
            values["path"] = os.path.relpath(os.path.abspath(out), here)
    elif out != config.tokenizer.path:
        values["path"] = out
    values["sha256"] = sha
    return values


def pin_lines(values: dict[str, str], indent: str = "  ") -> list[str]:
    """``tokenizer:`` then one ``  key: "value"`` line per field (double-quoted: a hex digest of
    digits and one ``e`` would read as a number otherwise)."""
    import json

    return ["tokenizer:"] + [f"{indent}{k}: {json.dumps(v)}" for k, v in values.items()]


def pin_config(text: str, values: dict[str, str]) -> str:
    """``text`` (a mixture config's YAML) with ``tokenizer.<key>`` set to each of ``values``.

    Only the lines of those keys change (or are added at the end of the ``tokenizer:``
    block), so comments and layout stay. The result is parsed back and must equal the
    original with those fields changed.

    Raises:
      PinError: no block-style top-level ``tokenizer:`` mapping, or the edit does not parse back.
    """
    import json
    import re

    lines = text.splitlines(keepends=True)
    head = next((i for i, ln in enumerate(lines) if re.match(r"tokenizer:\s*(#.*)?$", ln.rstrip("\r\n"))), None)
    if head is None:
        raise PinError("the config has no block-style 'tokenizer:' section to edit")
    end, indent = head + 1, None
    while end < len(lines):
        stripped = lines[end].strip()
        if stripped and not stripped.startswith("#"):
            lead = lines[end][: len(lines[end]) - len(lines[end].lstrip(" "))]
            if not lead:
                break
            indent = indent or lead
        end += 1
    indent = indent or "  "
    last = max((i for i in range(head + 1, end) if lines[i].strip() and not lines[i].strip().startswith("#")),
               default=head)
    newline = "\r\n" if lines[head].endswith("\r\n") else "\n"
    for key, value in values.items():
        line = f"{indent}{key}: {json.dumps(value)}"
        at = next((i for i in range(head + 1, end) if re.match(rf"{re.escape(indent)}{key}\s*:", lines[i])), None)
        if at is not None:
            comment = re.search(r"\s+#.*$", lines[at].rstrip("\r\n"))
            lines[at] = line + (comment.group(0) if comment and '"' not in comment.group(0) else "") + newline
        else:
            lines.insert(last + 1, line + newline)
            last += 1
            end += 1
    new = "".join(lines)
    try:
        before, after = yaml.safe_load(text), yaml.safe_load(new)
    except yaml.YAMLError as e:
        raise PinError(f"the edited config does not parse: {e}") from None
    if not isinstance(before, dict) or not isinstance(before.get("tokenizer"), dict):
        raise PinError("the config's tokenizer is not a mapping")
    expected = {**before, "tokenizer": {**before["tokenizer"], **values}}
    if after != expected:
        raise PinError("the edited config does not read back as the original with the tokenizer pinned")
    return new


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
    sentences, model, vocab_size, model_type, byte_fallback, character_coverage, num_threads, normalization
) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        character_coverage=character_coverage,
        input_sentence_size=0,  # keep every sentence given: the sample is ours
        shuffle_input_sentence=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        normalization_rule_name=normalization,
        remove_extra_whitespaces=normalization != "identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
    )


_EPILOG = f"""\
determinism: the sample is chosen here by a stable hash of (seed, document key, line),
never by SentencePiece (it gets input_sentence_size=0 and keeps the whole sample, at most
--max-sentences lines), and --num-threads is fixed (default {DEFAULT_NUM_THREADS}) and recorded in the
model. The same config, seed and options give the same model bytes on any machine with
the same SentencePiece version and CPU architecture and the same input files.

normalization: decoding returns the normalized text, not the original bytes. With the
default nmt_nfkc, U+FE30 becomes "..", "\ufb01" becomes "fi", full-width digits become
ASCII and runs of whitespace collapse; characters missing from the vocabulary decode as
" \u2047 " unless byte fallback is on. --normalization identity keeps text byte-exact.

pinning: the model's sha256 (and its path, when the config names another file) belong in
the config's tokenizer: section; the command prints the lines to add, and --pin edits the
--config file itself (only those lines change, comments stay).

exit status: 0 done; 2 bad arguments or config, SentencePiece refused the sample, or --pin
could not edit the config (the model is written; the message has the lines to add).
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dataprep.train_tokenizer",
        description=__doc__.split("\n")[0],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument(
        "--max-sentences",
        type=int,
        default=DEFAULT_MAX_SENTENCES,
        help="most lines in the sample (chosen by hash; SentencePiece keeps all of them)",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=DEFAULT_NUM_THREADS,
        help=f"SentencePiece training threads (default {DEFAULT_NUM_THREADS}); the model depends on it: keep it fixed",
    )
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=DEFAULT_CHARACTER_COVERAGE,
        help=f"share of the sample's characters the vocabulary must cover (0, 1] (default "
        f"{DEFAULT_CHARACTER_COVERAGE}); the rest decode by byte fallback",
    )
    parser.add_argument(
        "--normalization",
        default="nmt_nfkc",
        choices=sorted(NORMALIZATIONS),
        help="SentencePiece normalization rule (default nmt_nfkc); identity keeps text byte-exact",
    )
    parser.add_argument(
        "--pin", action="store_true",
        help="write the model's sha256 (and path) into the --config file's tokenizer: section; comments stay",
    )
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
            character_coverage=args.character_coverage,
            num_threads=args.num_threads,
            normalization=args.normalization,
        )
    except (ConfigError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (sha256 {sha}) and {args.out}.sha256")
    pieces = spm.SentencePieceProcessor(model_file=args.out).get_piece_size()
    if pieces < args.vocab_size:  # hard_vocab_limit=False: SentencePiece stops where the sample runs out
        print(f"vocabulary: {pieces:,} pieces, fewer than the {args.vocab_size:,} asked: the sample holds too little "
              "text for more; for the size asked, train on more text (a larger --sample-fraction or --max-sentences, "
              "or more input), or ask for --vocab-size " + f"{pieces}")
    else:
        print(f"vocabulary: {pieces:,} pieces")
    print(f"normalization: {args.normalization}: {NORMALIZATIONS[args.normalization]}; decoded text is the "
          "normalized text, not the original bytes" + ("" if args.normalization == "identity" else
                                                         " (--normalization identity keeps it byte-exact)"))
    print(f"threads: {args.num_threads} (recorded in the model; the same value gives the same model bytes)")
    values = pin_values(config, args.out, sha)
    lines = "\n".join("    " + ln for ln in pin_lines(values))
    if not args.pin:
        print(f"to pin it, set these in {args.config} (or rerun with --pin to write them there):\n{lines}")
        return 0
    try:
        with open(args.config, encoding="utf-8", newline="") as f:
            text = f.read()
        pinned = pin_config(text, values)
        with open(args.config, "w", encoding="utf-8", newline="") as f:
            f.write(pinned)
    except (OSError, PinError) as e:
        print(f"error: --pin: {args.config} not changed ({e}); the model is written: set these by hand:\n{lines}",
              file=sys.stderr)
        return 2
    print(f"pinned in {args.config}: tokenizer." + " and tokenizer.".join(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
