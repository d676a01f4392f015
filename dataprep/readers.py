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
import zlib
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


_BOM = b"\xef\xbb\xbf"


def _iter_jsonl(source: SourceConfig, rel: str, stream: io.BufferedIOBase) -> Iterator[Item]:
    """Yields one item per non-blank line; a UTF-8 byte order mark at the file start is dropped.

    ``stream`` may be a :class:`_Readable` that stops at a decompression error: then a last
    line without its newline is the cut-off part of a longer line, not a document; it is
    left to the caller's ``unreadable_file`` dead letter (``_Readable.partial``).
    """
    for lineno, line in enumerate(stream, start=1):
        if lineno == 1 and line.startswith(_BOM):
            line = line[len(_BOM) :]
        if not line.endswith(b"\n") and getattr(stream.raw, "error", None) is not None:
            stream.raw.partial = line
            return
        if not line.strip():
            continue
        yield _from_json_line(source, document_key(source.name, rel, lineno), line.rstrip(b"\r\n"))


def _iter_text(source: SourceConfig, rel: str, data: bytes) -> Iterator[Item]:
    if data.startswith(_BOM):  # a byte order mark is not text of the document
        data = data[len(_BOM) :]
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
            if isinstance(text, bytes):  # a BINARY column (no UTF8 annotation): text if it decodes
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield Rejected(key, Reason.INVALID_UTF8, text, str(e))
                    continue
                yield _check_text(key, text, text)
            elif not isinstance(text, str):
                raw = json.dumps({source.text_field: text}, default=repr)
                yield Rejected(key, Reason.NON_STRING_TEXT, raw, type(text).__name__)
            else:
                yield _check_text(key, text, text)


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    """Errors that say the file's *bytes* are damaged: the file becomes a dead letter.

    ``zlib.error`` is what ``gzip`` raises for a damaged deflate stream. A plain ``OSError``
    from the file system (a network error reading ``gs://``, a file deleted mid-run) is not
    here on purpose: it fails the bundle, which the runner retries, instead of silently
    cutting the file short in one run and not in the next (which would break byte-identical
    reruns).
    """
    errors: list[type[BaseException]] = [EOFError, gzip.BadGzipFile, zlib.error]
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
      reason ``unreadable_file`` and locator ``file`` (its ``raw``: the cut-off last line).

    Raises:
      OSError: the file system failed (not the file's content); the runner retries.
    """
    rel = relative_path(path, root or source.root)
    fmt = source.format
    stream: Optional[_Readable] = None
    try:
        with fsutil.open_raw(path) as raw:
            if fmt in (SourceFormat.JSONL, SourceFormat.JSONL_GZ, SourceFormat.JSONL_ZST):
                if fmt is SourceFormat.JSONL:
                    inner = raw
                elif fmt is SourceFormat.JSONL_GZ:
                    inner = gzip.GzipFile(fileobj=raw)
                else:
                    inner = _ZstdFrames(raw)
                # Decompression errors are held back by _Readable until the complete lines
                # before them are yielded, then raised below.
                stream = _Readable(inner, hold_errors=_unreadable_errors())
                yield from _iter_jsonl(source, rel, io.BufferedReader(stream, 1 << 20))
                if stream.error is not None:
                    raise stream.error
            elif fmt is SourceFormat.PARQUET:
                yield from _iter_parquet(source, rel, raw)
            elif fmt is SourceFormat.TEXT:
                yield from _iter_text(source, rel, raw.read())
            else:  # pragma: no cover - the config validates formats
                raise ValueError(f"unknown format {fmt!r}")
    except _unreadable_errors() as e:
        partial = stream.partial if stream is not None else b""
        yield Rejected(
            document_key(source.name, rel, "file"), Reason.UNREADABLE_FILE, partial, f"{type(e).__name__}: {e}"
        )


class _Readable(io.RawIOBase):
    """Adapts any object with ``read(n)`` to ``io.RawIOBase`` so it can be buffered.

    With ``hold_errors``, such an error from ``read`` is kept in ``error`` and reads as the
    end of the stream, so that the bytes before it still reach the reader.
    """

    def __init__(self, f, hold_errors: tuple[type[BaseException], ...] = ()):
        self._f = f
        self._hold = hold_errors
        self.error: Optional[BaseException] = None
        self.partial = b""  # the cut-off last line, set by _iter_jsonl

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.error is not None:
            return 0
        try:
            # Small reads, so that a decompression error loses little of what came before it.
            data = self._f.read(min(len(b), 1 << 16) if self._hold else len(b))
        except self._hold as e:
            self.error = e
            return 0
        n = len(data)
        b[:n] = data
        return n


class _ZstdFrames(io.RawIOBase):
    """Decompresses a stream of zstd frames; a stream that ends inside a frame raises.

    (``zstandard``'s ``stream_reader`` returns a truncated stream as a clean, possibly empty
    end of data, which would lose the rest of the file silently.)
    """

    def __init__(self, f, read_size: int = 1 << 20):
        import zstandard

        self._zstd = zstandard
        self._f = f
        self._read_size = read_size
        self._d = None  # the decompressor of the frame in progress
        self._out = b""
        self._pos = 0
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._out) and not self._eof:
            data = self._f.read(self._read_size)
            if not data:
                self._eof = True
                if self._d is not None:
                    raise self._zstd.ZstdError("zstd stream ends inside a frame (truncated file)")
                break
            out = []
            while data:
                if self._d is None:
                    self._d = self._zstd.ZstdDecompressor().decompressobj()
                out.append(self._d.decompress(data))
                if self._d.eof:
                    data, self._d = self._d.unused_data, None
                else:
                    data = b""
            self._out, self._pos = b"".join(out), 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n
