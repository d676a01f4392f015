"""Input readers: one input file in, documents and rejected inputs out.

Every file is opened through Beam's ``FileSystems`` (so ``gs://`` and any registered file
system work) and read as a stream. Formats (``contract.config.SourceFormat``):

========== ================================================ ==========================
format     one document is                                  locator in the key
========== ================================================ ==========================
jsonl      one line holding a JSON object                   1-based line number
jsonl.gz   same, gzip-compressed                            1-based line number
jsonl.zst  same, zstd-compressed (``zstandard`` streaming)  1-based line number
parquet    one row (read by row group with pyarrow)         0-based row in the file
text       the whole file, or each blank-line block         0 / 0-based block index
========== ================================================ ==========================

Blank JSONL lines are not documents and are skipped. Everything else either becomes a
:class:`Document` or a :class:`Rejected` with a :class:`Reason`; nothing is dropped
silently, and nothing raises for bad content (only for an unreadable file system).
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import io
import json
import re
from typing import Iterator, Optional, Union

from contract.config import SourceConfig, SourceFormat, TextSplit
from contract.hashing import document_key
from dataprep import fsutil


class Reason(str, enum.Enum):
    """Why an input was rejected (the ``reason`` of a dead letter and a ledger key)."""

    INVALID_UTF8 = "invalid_utf8"  # bytes that do not decode as UTF-8
    INVALID_JSON = "invalid_json"  # a JSONL line that does not parse
    NOT_AN_OBJECT = "not_a_json_object"  # parses, but is not a JSON object
    MISSING_TEXT = "missing_text"  # no text field / column
    NON_STRING_TEXT = "non_string_text"  # text is null, a number, a list, ...
    INVALID_UNICODE = "invalid_unicode"  # lone surrogates (e.g. "\ud800" in JSON)
    EMPTY = "empty_after_tokenization"  # no token besides BOS/EOS
    UNREADABLE_FILE = "unreadable_file"  # corrupt compression or Parquet; rest of file lost


@dataclasses.dataclass(frozen=True)
class Document:
    key: str
    text: str


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A rejected input: its key, the reason, and the raw input (bytes or text)."""

    key: str
    reason: Reason
    raw: Union[bytes, str]
    detail: str = ""


Item = Union[Document, Rejected]

_BLANK_LINES = re.compile(rb"\r?\n(?:[ \t\f\v]*\r?\n)+")


def relative_path(path: str, root: str) -> str:
    """Returns ``path`` relative to the source ``root`` with ``/`` separators.

    Files outside ``root`` keep their full path, so keys never collide.
    """
    root = root.rstrip("/")
    if path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return path


def _check_text(key: str, text: str, raw: Union[bytes, str]) -> Item:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return Rejected(key, Reason.INVALID_UNICODE, raw, str(e))
    return Document(key, text)


def _from_json_line(source: SourceConfig, key: str, line: bytes) -> Item:
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(key, Reason.INVALID_UTF8, line, str(e))
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError) as e:
        return Rejected(key, Reason.INVALID_JSON, line, str(e)[:200])
    if not isinstance(obj, dict):
        return Rejected(key, Reason.NOT_AN_OBJECT, line, type(obj).__name__)
    if source.text_field not in obj:
        return Rejected(key, Reason.MISSING_TEXT, line, f"no field {source.text_field!r}")
    text = obj[source.text_field]
    if not isinstance(text, str):
        return Rejected(key, Reason.NON_STRING_TEXT, line, f"{source.text_field} is {type(text).__name__}")
    return _check_text(key, text, line)


def _iter_jsonl(source: SourceConfig, rel: str, stream: io.BufferedIOBase) -> Iterator[Item]:
    for lineno, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        yield _from_json_line(source, document_key(source.name, rel, lineno), line.rstrip(b"\r\n"))


def _iter_text(source: SourceConfig, rel: str, data: bytes) -> Iterator[Item]:
    if source.text_split is TextSplit.FILE:
        blocks = [data]  # an empty file is an (empty) document: it is rejected, not skipped
    else:
        blocks = [b for b in _BLANK_LINES.split(data) if b.strip()]
    for i, block in enumerate(blocks):
        key = document_key(source.name, rel, i)
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError as e:
            yield Rejected(key, Reason.INVALID_UTF8, block, str(e))
            continue
        if source.text_split is TextSplit.BLANK_LINES:
            text = text.strip("\r\n")
        yield _check_text(key, text, block)


def _iter_parquet(source: SourceConfig, rel: str, f) -> Iterator[Item]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    names = set(pf.schema_arrow.names)
    row = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        if source.text_field not in names:
            for _ in range(n):
                key = document_key(source.name, rel, row)
                yield Rejected(key, Reason.MISSING_TEXT, "", f"no column {source.text_field!r}")
                row += 1
            continue
        texts = pf.read_row_group(rg, columns=[source.text_field]).column(0).to_pylist()
        for text in texts:
            key = document_key(source.name, rel, row)
            row += 1
            if not isinstance(text, str):
                raw = json.dumps({source.text_field: text}, default=repr)
                yield Rejected(key, Reason.NON_STRING_TEXT, raw, type(text).__name__)
            else:
                yield _check_text(key, text, text)


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import pyarrow

        errors.append(pyarrow.ArrowException)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def read_file(source: SourceConfig, path: str, root: Optional[str] = None) -> Iterator[Item]:
    """Yields the documents and rejected inputs of one input file, in file order.

    Args:
      source: the source's config (format, fields, text split).
      path: the file, local or any FileSystems URL.
      root: folder keys are relative to (default ``source.root``).

    Yields:
      :class:`Document` or :class:`Rejected`. A file that turns out corrupt part-way (bad
      gzip/zstd stream, bad Parquet) yields what it read so far, then one ``Rejected`` with
      reason ``unreadable_file`` and locator ``file``.
    """
    rel = relative_path(path, root or source.root)
    fmt = source.format
    try:
        with fsutil.open_raw(path) as raw:
            if fmt is SourceFormat.JSONL:
                yield from _iter_jsonl(source, rel, io.BufferedReader(_Readable(raw), 1 << 20))
            elif fmt is SourceFormat.JSONL_GZ:
                yield from _iter_jsonl(source, rel, io.BufferedReader(gzip.GzipFile(fileobj=raw), 1 << 20))
            elif fmt is SourceFormat.JSONL_ZST:
                import zstandard

                reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
                yield from _iter_jsonl(source, rel, io.BufferedReader(reader, 1 << 20))
            elif fmt is SourceFormat.PARQUET:
                yield from _iter_parquet(source, rel, raw)
            elif fmt is SourceFormat.TEXT:
                yield from _iter_text(source, rel, raw.read())
            else:  # pragma: no cover - the config validates formats
                raise ValueError(f"unknown format {fmt!r}")
    except _unreadable_errors() as e:
        yield Rejected(
            document_key(source.name, rel, "file"), Reason.UNREADABLE_FILE, "", f"{type(e).__name__}: {e}"
        )


class _Readable(io.RawIOBase):
    """Adapts any object with ``read(n)`` to ``io.RawIOBase`` so it can be buffered."""

    def __init__(self, f):
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        return n
