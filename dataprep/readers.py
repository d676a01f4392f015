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

A document's own id (the source's ``id_field``: a JSON field or a Parquet column, e.g. a
URL) is read as text (:func:`id_text`) and carried into each packed row's provenance; a
document without one has ``""``. Text sources have no ids.
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import io
import json
import re
import zlib
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

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
    EMPTY = "empty_after_tokenization"  # no token besides BOS/EOS, or only whitespace
    UNREADABLE_FILE = "unreadable_file"  # corrupt compression or Parquet; rest of file lost
    TOO_LONG = "too_long"  # a JSONL line, text document or Parquet text over MAX_DOCUMENT_BYTES


class Document(NamedTuple):
    """One document: its stable key, its text and its own id (a tuple: cheap to make per document).

    ``doc_id`` is the value of the source's ``id_field`` as text (:func:`id_text`), ``""``
    when the source has none or the document lacks it.
    """

    key: str
    text: str
    doc_id: str = ""


# The longest id kept, in UTF-8 bytes (URLs stay under about 2,000 characters); a document
# whose id is longer is rejected as too_long, with its raw input in the dead letter.
MAX_ID_BYTES = 4096


def id_text(value: Any) -> Optional[str]:
    """The id ``value`` of a JSON field or Parquet cell as text: strings as they are, other
    JSON values as compact JSON (``17``, ``["a", 1]``), bytes decoded as UTF-8 (with
    ``\\x`` escapes where they are not UTF-8); None for a missing or null id."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, _LongInt):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _with_id(doc: "Item", source: SourceConfig, value: Any, raw: Union[bytes, str]) -> "Item":
    """``doc`` with its id ``value`` (:func:`id_text`); a :class:`Rejected` when the id is too long."""
    text = id_text(value)
    if not text or type(doc) is not Document:
        return doc
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        return Rejected(doc.key, Reason.TOO_LONG, raw,
                        f"id_field {source.id_field!r} holds {size} bytes, over the limit of {MAX_ID_BYTES} for an id")
    return Document(doc.key, doc.text, text)


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


def _check_json_text(key: str, text: str, line: bytes) -> Item:
    """:func:`_check_text` for text parsed from a UTF-8 JSON line, without a copy when ASCII.

    Only a ``\\u`` escape can put a lone surrogate into such text (decoding UTF-8 never
    yields one), and an ASCII string holds none: ``str.isascii()`` reads a flag, so the
    encode check runs only on non-ASCII text.
    """
    return Document(key, text) if text.isascii() else _check_text(key, text, line)


class _LongInt(str):
    """A JSON integer too long for ``int()`` (over ``sys.get_int_max_str_digits()`` digits)."""


def _json_loads(s: str):
    """``json.loads``; a valid line with a very long integer somewhere still parses.

    Python refuses to convert integers of more than 4300 digits, so ``json.loads`` raises
    ``ValueError`` for a valid JSON line holding one (in any field). Such a line is parsed
    again with those integers kept as :class:`_LongInt` strings; a ``_LongInt`` text field
    is still rejected as ``non_string_text``.

    Raises:
      ValueError: not JSON; :class:`RepeatedKeyError`: an object (at any depth) names a key twice.
    """
    if s.startswith("\ufeff"):  # as json.loads says it
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", s, 0)
    try:
        return _DECODER.decode(s)
    except ValueError as e:
        if "integer string conversion" not in str(e):
            raise
        return _LONG_INT_DECODER.decode(s)


class RepeatedKeyError(ValueError):
    """A JSON object names a key twice (``json`` would keep the last value silently)."""


def _unique_keys(pairs: list) -> dict:
    """``object_pairs_hook``: the object as a dict, or :class:`RepeatedKeyError` naming a key given twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise RepeatedKeyError(f"key {k!r} repeated in one object (JSON would keep only its last value); "
                                       f"write each key once")
            seen.add(k)
    return obj


# One decoder each, made once (json.loads with a hook would build one a line).
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)
_LONG_INT_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_int=lambda digits: int(digits) if len(digits) < 4000 else _LongInt(digits))


def missing_detail(what: str, name: str, present) -> str:
    """``no field 'text'; the object has fields ['body', 'id']`` (at most 20 names listed)."""
    names = sorted(str(n) for n in present)
    shown = names[:20] + ([f"... {len(names) - 20} more"] if len(names) > 20 else [])
    holder = "object" if what == "field" else "file"
    if not names:
        return f"no {what} {name!r}; the {holder} has no {what}s"
    return f"no {what} {name!r}; the {holder} has {what}s {shown}; set text_field to the one that holds the text"


def _from_json_line(source: SourceConfig, key: str, line: bytes) -> Item:
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(key, Reason.INVALID_UTF8, line, str(e))
    try:
        obj = _json_loads(s)
    except (ValueError, RecursionError) as e:
        return Rejected(key, Reason.INVALID_JSON, line, str(e)[:200])
    if not isinstance(obj, dict):
        return Rejected(key, Reason.NOT_AN_OBJECT, line, type(obj).__name__)
    if source.text_field not in obj:
        return Rejected(key, Reason.MISSING_TEXT, line, missing_detail("field", source.text_field, obj))
    text = obj[source.text_field]
    if isinstance(text, _LongInt):
        return Rejected(key, Reason.NON_STRING_TEXT, line, f"{source.text_field} is int")
    if not isinstance(text, str):
        return Rejected(key, Reason.NON_STRING_TEXT, line, f"{source.text_field} is {type(text).__name__}")
    doc = _check_json_text(key, text, line)
    return _with_id(doc, source, obj.get(source.id_field), line) if source.id_field else doc


_BOM = b"\xef\xbb\xbf"
# The largest JSONL line or whole-file text document read into memory. A longer one (a
# decompression bomb without a newline, a stray multi-GB file) is rejected as ``too_long``
# with its first ``TOO_LONG_RAW_BYTES`` bytes, instead of exhausting a worker's memory.
MAX_DOCUMENT_BYTES = 256 << 20
TOO_LONG_RAW_BYTES = 1024


def _iter_jsonl(source: SourceConfig, rel: str, stream: io.BufferedIOBase) -> Iterator[Item]:
    """Yields one item per non-blank line; a UTF-8 byte order mark starting a line is dropped.

    ``stream`` may be a :class:`_Readable` that stops at a decompression error: then a last
    line without its newline is the cut-off part of a longer line, not a document; it is
    left to the caller's ``unreadable_file`` dead letter (``_Readable.partial``).
    """
    limit = MAX_DOCUMENT_BYTES
    lineno = 0
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        lineno += 1
        if line.startswith(_BOM):  # a file's BOM, or one left inside by concatenating files
            line = line[len(_BOM) :]
        if len(line) > limit and not line.endswith(b"\n"):
            head, size = line[:TOO_LONG_RAW_BYTES], len(line)
            del line
            more = b""
            while not more.endswith(b"\n"):  # skip the rest of the line, a block at a time
                more = stream.readline(1 << 20)
                if not more:
                    break
                size += len(more)
            yield _too_long(document_key(source.name, rel, lineno), head, size)
            continue
        if not line.endswith(b"\n") and getattr(stream.raw, "error", None) is not None:
            stream.raw.partial = line
            return
        if not line.strip():
            continue
        yield _from_json_line(source, document_key(source.name, rel, lineno), line.rstrip(b"\r\n"))


def _too_long(key: str, head: bytes, size: int) -> Rejected:
    return Rejected(
        key,
        Reason.TOO_LONG,
        head,
        f"{size} bytes, over the limit of {MAX_DOCUMENT_BYTES}; raw holds the first {len(head)}",
    )


_BLANK_LINE = re.compile(rb"[ \t\f\v]*\r?\n")


@dataclasses.dataclass(frozen=True)
class _Oversize:
    """A blank-line block over ``MAX_DOCUMENT_BYTES``: its first bytes and its size."""

    head: bytes
    size: int


def split_blank_lines(stream: io.BufferedIOBase, piece: int = 1 << 20) -> Iterator[Union[bytes, _Oversize]]:
    """Streams ``stream`` as ``_BLANK_LINES.split(data)`` would split it, block by block.

    A separator is the line break ending a line, then one or more blank lines (only spaces,
    tabs, form feeds or vertical tabs, then ``\r?\n``); the blocks are what lies between.
    Lines are read ``piece`` bytes at a time, so memory stays bounded by the largest block
    kept (``MAX_DOCUMENT_BYTES``; a larger one is an :class:`_Oversize`). One difference
    from the regex: a whitespace-only line longer than ``piece`` is not recognized as
    blank. Empty or whitespace-only blocks may be yielded; the caller drops them.
    """
    block: list[bytes] = []  # the block's lines (in pieces); emptied once it is too long
    head = b""  # the first bytes of a block that is too long
    last = b""  # the block's last piece: its line ending is cut off
    size = 0
    in_block = False  # a block has begun since the start or the last separator
    at_line_start = True
    prev_line = False  # a complete line was read before this one
    while True:
        chunk = stream.readline(piece)
        if not chunk:
            break
        if at_line_start and prev_line and chunk.endswith(b"\n") and _BLANK_LINE.fullmatch(chunk):
            if in_block:  # the line break ending the block's last line starts the separator
                cut = 2 if last.endswith(b"\r\n") else 1
                if size > MAX_DOCUMENT_BYTES:
                    yield _Oversize(head, size - cut)
                else:
                    data = b"".join(block)
                    yield data[: len(data) - cut]
                block, head, last, size, in_block = [], b"", b"", 0, False
        else:
            in_block = True
            size += len(chunk)
            last = chunk
            if size <= MAX_DOCUMENT_BYTES:
                block.append(chunk)
            elif size - len(chunk) <= MAX_DOCUMENT_BYTES:  # this piece went over: keep the head only
                head, block = b"".join(block + [chunk])[:TOO_LONG_RAW_BYTES], []
        at_line_start = chunk.endswith(b"\n")
        prev_line = prev_line or at_line_start
    if in_block:
        yield _Oversize(head, size) if size > MAX_DOCUMENT_BYTES else b"".join(block)


def _iter_text_blocks(source: SourceConfig, rel: str, stream: io.BufferedReader) -> Iterator[Item]:
    if stream.peek(3)[:3] == _BOM:  # a byte order mark is not text of the document
        stream.read(3)
    i = 0
    for block in split_blank_lines(stream):
        if isinstance(block, _Oversize):
            yield _too_long(document_key(source.name, rel, i), block.head, block.size)
            i += 1
            continue
        if not block.strip():
            continue
        yield from _iter_text(source, rel, block, index=i)
        i += 1


def _iter_text(source: SourceConfig, rel: str, data: bytes, index: Optional[int] = None) -> Iterator[Item]:
    """One whole-file document, or (``index`` given) the blank-line block at ``index``."""
    if index is not None:
        blocks = [data]
    else:
        if data.startswith(_BOM):  # a byte order mark is not text of the document
            data = data[len(_BOM) :]
        blocks = [data]  # an empty file is an (empty) document: it is rejected, not skipped
    for i, block in enumerate(blocks, start=index or 0):
        key = document_key(source.name, rel, i)
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError as e:
            yield Rejected(key, Reason.INVALID_UTF8, block, str(e))
            continue
        if source.text_split is TextSplit.BLANK_LINES:
            text = text.strip("\r\n")
        yield _check_text(key, text, block)


# Parquet is read PARQUET_BATCH_ROWS rows at a time through a buffered stream of
# PARQUET_BUFFER_BYTES, so a worker holds one batch of text, not a whole row group (a
# pandas-written file is often one row group of gigabytes).
PARQUET_BATCH_ROWS = 1024
PARQUET_BUFFER_BYTES = 1 << 20


class _FileCalls:
    """Forwards to a file object and keeps the last exception its own methods raised.

    pyarrow reports a damaged Parquet file (bad thrift footer, a page that does not
    decompress, corrupt levels) as a plain ``OSError`` of its own, the same type as a failing
    file system; an exception raised by the file object is passed through as that very object.
    So an ``OSError`` that is not ``error`` comes from the file's bytes (:func:`_iter_parquet`).
    """

    def __init__(self, f):
        self._f = f
        self.error: Optional[BaseException] = None

    def __getattr__(self, name: str):
        attr = getattr(self._f, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except BaseException as e:
                self.error = e
                raise

        return call


def _iter_parquet(source: SourceConfig, rel: str, f) -> Iterator[Item]:
    """The items of one Parquet file; a file pyarrow finds damaged ends in an ``unreadable_file``
    dead letter (the rows before the damage are kept), a file-system error is raised."""
    calls = _FileCalls(f)
    try:
        yield from _iter_parquet_rows(source, rel, calls)
    except OSError as e:
        if e is calls.error or type(e) is not OSError:
            raise  # the file system failed (or a subclass such as FileNotFoundError): the runner retries
        yield Rejected(document_key(source.name, rel, "file"), Reason.UNREADABLE_FILE, b"", f"OSError: {str(e).strip()}")


def _iter_parquet_rows(source: SourceConfig, rel: str, f) -> Iterator[Item]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f, buffer_size=PARQUET_BUFFER_BYTES)
    all_names = pf.schema_arrow.names
    names = set(all_names)
    missing = missing_detail("column", source.text_field, names) if source.text_field not in names else ""
    if all_names.count(source.text_field) > 1:  # pyarrow would read the first one silently
        yield Rejected(
            document_key(source.name, rel, "file"),
            Reason.UNREADABLE_FILE,
            b"",
            f"the file has {all_names.count(source.text_field)} columns named {source.text_field!r}; "
            "rewrite it with one",
        )
        return
    row = 0
    if missing:
        for _ in range(pf.metadata.num_rows):
            yield Rejected(document_key(source.name, rel, row), Reason.MISSING_TEXT, "", missing)
            row += 1
        return
    with_id = bool(source.id_field) and source.id_field != source.text_field and all_names.count(source.id_field) == 1
    columns = [source.text_field] + ([source.id_field] if with_id else [])
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns, use_threads=False):
        ids = batch.column(1).to_pylist() if with_id else None
        for j, text in enumerate(batch.column(0).to_pylist()):
            item = _parquet_item(source, rel, row, text)
            yield item if ids is None else _with_id(item, source, ids[j], text)
            row += 1


def _parquet_item(source: SourceConfig, rel: str, row: int, text: Any) -> Item:
    """The document (or rejected input) of one Parquet text cell."""
    key = document_key(source.name, rel, row)
    if isinstance(text, bytes):  # a BINARY column (no UTF8 annotation): text if it decodes
        if len(text) > MAX_DOCUMENT_BYTES:
            return _too_long(key, text[:TOO_LONG_RAW_BYTES], len(text))
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejected(key, Reason.INVALID_UTF8, text, str(e))
        return _check_text(key, decoded, decoded)
    if not isinstance(text, str):
        raw = json.dumps({source.text_field: text}, default=repr)
        return Rejected(key, Reason.NON_STRING_TEXT, raw, type(text).__name__)
    if len(text) > MAX_DOCUMENT_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_DOCUMENT_BYTES:
        data = text.encode("utf-8", "surrogatepass")
        return _too_long(key, data[:TOO_LONG_RAW_BYTES], len(data))
    return _check_text(key, text, text)


def _compressed_kind(head: bytes) -> Optional[tuple[str, str]]:
    """(name, format to use) when ``head`` starts a gzip or zstd stream, else None."""
    if head[:2] == b"\x1f\x8b":
        return "gzip", SourceFormat.JSONL_GZ.value
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd", SourceFormat.JSONL_ZST.value
    return None


def _utf16_bom(head: bytes) -> bool:
    """A UTF-16 byte order mark (what Windows PowerShell 5's ``>`` writes)."""
    return head[:2] in (b"\xff\xfe", b"\xfe\xff")


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


def read_file(
    source: SourceConfig, path: str, root: Optional[str] = None, on_open: Optional[Callable[[Any], None]] = None
) -> Iterator[Item]:
    """Yields the documents and rejected inputs of one input file, in file order.

    Args:
      source: the source's config (format, fields, text split).
      path: the file, local or any FileSystems URL.
      root: folder keys are relative to (default ``source.root``).
      on_open: called with the file's raw stream once it is open (its ``tell()`` is the
        bytes read so far, as stored: what progress reports measure).

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
            if on_open is not None:
                on_open(raw)
            if fmt in (SourceFormat.JSONL, SourceFormat.JSONL_GZ, SourceFormat.JSONL_ZST):
                if fmt is SourceFormat.JSONL:
                    inner = raw
                elif fmt is SourceFormat.JSONL_GZ:
                    inner = gzip.GzipFile(fileobj=raw)
                else:
                    inner = _ZstdFrames(raw)
                # Decompression errors are held back by _Readable until the complete lines
                # before them are yielded, then raised below.
                hold = _unreadable_errors() if fmt is not SourceFormat.JSONL else ()
                stream = _Readable(inner, hold_errors=hold)
                buffered = io.BufferedReader(stream, 1 << 20)
                packed = _compressed_kind(buffered.peek(4)[:4]) if fmt is SourceFormat.JSONL else None
                if packed is not None:  # a config mistake: one dead letter, not one per "line"
                    name, fixed = packed
                    yield Rejected(
                        document_key(source.name, rel, "file"),
                        Reason.UNREADABLE_FILE,
                        b"",
                        f"the file is {name}-compressed but the source's format is 'jsonl'; use {fixed!r}",
                    )
                    return
                if _utf16_bom(buffered.peek(2)[:2]):
                    yield Rejected(
                        document_key(source.name, rel, "file"),
                        Reason.INVALID_UTF8,
                        b"",
                        "the file is UTF-16 (it starts with a UTF-16 byte order mark); convert it to UTF-8",
                    )
                    return
                yield from _iter_jsonl(source, rel, buffered)
                if stream.error is not None:
                    raise stream.error
            elif fmt is SourceFormat.PARQUET:
                yield from _iter_parquet(source, rel, raw)
            elif fmt is SourceFormat.TEXT and source.text_split is TextSplit.FILE:
                data = raw.read(MAX_DOCUMENT_BYTES + 1)
                if len(data) > MAX_DOCUMENT_BYTES:
                    size = len(data)
                    head = data[:TOO_LONG_RAW_BYTES]
                    del data
                    while block := raw.read(1 << 20):
                        size += len(block)
                    yield _too_long(document_key(source.name, rel, 0), head, size)
                else:
                    yield from _iter_text(source, rel, data)
            elif fmt is SourceFormat.TEXT:
                yield from _iter_text_blocks(source, rel, io.BufferedReader(_Readable(raw), 1 << 20))
            else:  # pragma: no cover - the config validates formats
                raise ValueError(f"unknown format {fmt!r}")
    except _unreadable_errors() as e:
        partial = stream.partial if stream is not None else b""
        yield Rejected(
            document_key(source.name, rel, "file"),
            Reason.UNREADABLE_FILE,
            partial,
            f"{type(e).__name__}: {e}",
        )


class _Readable(io.RawIOBase):
    """Adapts any object with ``read(n)`` to ``io.RawIOBase`` so it can be buffered.

    With ``hold_errors``, such an error from ``read`` is kept in ``error`` and reads as the
    end of the stream, so that the bytes before it still reach the reader.
    """

    def __init__(self, f, hold_errors: tuple[type[BaseException], ...] = ()):
        self._f = f
        self._hold = hold_errors
        self._readinto = getattr(f, "readinto", None)
        self.error: Optional[BaseException] = None
        self.partial = b""  # the cut-off last line, set by _iter_jsonl

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.error is not None:
            return 0
        if not self._hold and self._readinto is not None:
            return self._readinto(b)  # straight into the buffer: no new 1 MB bytes object a read
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

    Memory stays bounded for any input, a decompression bomb included: the compressed bytes
    are fed ``feed_size`` at a time, and a zstd block (at least 4 bytes with its header)
    never decompresses to more than 128 KiB, so one feed yields at most
    ``feed_size * 32768`` bytes (32 MiB for 1 KiB).
    """

    def __init__(self, f, read_size: int = 1 << 20, feed_size: int = 1 << 10):
        import zstandard

        self._zstd = zstandard
        self._f = f
        self._read_size = read_size
        self._feed_size = feed_size
        self._d = None  # the decompressor of the frame in progress
        self._in = memoryview(b"")
        self._ipos = 0
        self._out = b""
        self._pos = 0
        self._eof = False

    def readable(self) -> bool:
        return True

    def _next_output(self) -> None:
        """Decompresses the next feed into ``_out`` (possibly empty); sets ``_eof`` at the end."""
        if self._ipos >= len(self._in):
            data = self._f.read(self._read_size)
            if not data:
                self._eof = True
                if self._d is not None:
                    raise self._zstd.ZstdError("zstd stream ends inside a frame (truncated file)")
                return
            self._in, self._ipos = memoryview(data), 0
        feed = self._in[self._ipos : self._ipos + self._feed_size]
        self._ipos += len(feed)
        if self._d is None:
            self._d = self._zstd.ZstdDecompressor().decompressobj()
        self._out, self._pos = self._d.decompress(feed), 0
        if self._d.eof:  # the frame ended inside this feed: the rest starts the next frame
            self._ipos -= len(self._d.unused_data)
            self._d = None

    def readinto(self, b) -> int:
        while self._pos >= len(self._out) and not self._eof:
            self._next_output()
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n
