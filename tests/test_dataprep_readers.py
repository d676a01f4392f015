"""Input readers (dataprep.readers): every format, keys, and bad content as Rejected."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.config import SourceConfig, SourceFormat, TextSplit
from dataprep import readers
from dataprep.readers import Document, Reason, Rejected


def _src(tmp_path, fmt, **kw):
    return SourceConfig(name="s", paths=(str(tmp_path / "*"),), root=str(tmp_path), format=fmt, **kw)


def _read(src, path):
    return list(readers.read_file(src, str(path)))


def test_jsonl_keys_are_one_based_lines_and_blank_lines_are_skipped(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"text": "one"}\r\n\n{"text": "two", "id": 7}\n   \n{"text": "three"}')
    got = _read(_src(tmp_path, SourceFormat.JSONL), p)
    assert got == [
        Document("s/a.jsonl:1", "one"),
        Document("s/a.jsonl:3", "two", "7"),  # the id_field (default "id") as text
        Document("s/a.jsonl:5", "three"),
    ]


def test_compressed_jsonl(tmp_path):
    lines = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)).encode()
    (tmp_path / "sub").mkdir()
    gz, zst = tmp_path / "sub/a.jsonl.gz", tmp_path / "b.jsonl.zst"
    gz.write_bytes(gzip.compress(lines))
    # two zstd frames back to back: read across frames
    zst.write_bytes(zstandard.ZstdCompressor().compress(lines) + zstandard.ZstdCompressor().compress(lines))
    assert [d.key for d in _read(_src(tmp_path, SourceFormat.JSONL_GZ), gz)] == [
        f"s/sub/a.jsonl.gz:{i}" for i in (1, 2, 3)
    ]
    got = _read(_src(tmp_path, SourceFormat.JSONL_ZST), zst)
    assert [d.text for d in got] == ["doc 0", "doc 1", "doc 2"] * 2 and got[-1].key == "s/b.jsonl.zst:6"


def test_corrupt_gzip_keeps_what_was_read_and_rejects_the_rest(tmp_path):
    import hashlib

    lines = (
        json.dumps({"text": hashlib.sha256(str(i).encode()).hexdigest() * 4}) + "\n" for i in range(30000)
    )
    data = gzip.compress("".join(lines).encode())  # ~8 MB of text that does not compress much
    p = tmp_path / "bad.jsonl.gz"
    p.write_bytes(data[: len(data) // 2])
    got = _read(_src(tmp_path, SourceFormat.JSONL_GZ), p)
    assert all(isinstance(d, Document) for d in got[:-1]) and len(got) > 1
    assert isinstance(got[-1], Rejected) and got[-1].reason is Reason.UNREADABLE_FILE
    assert got[-1].key == "s/bad.jsonl.gz:file"


def test_parquet_by_row_group(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c", "d", "e"], "id": [1, 2, 3, 4, 5]}), p, row_group_size=2)
    got = _read(_src(tmp_path, SourceFormat.PARQUET), p)
    assert [(type(d).__name__, d.key) for d in got] == [
        ("Document", "s/t.parquet:0"),
        ("Rejected", "s/t.parquet:1"),
        ("Document", "s/t.parquet:2"),
        ("Document", "s/t.parquet:3"),
        ("Document", "s/t.parquet:4"),
    ]
    assert got[1].reason is Reason.NON_STRING_TEXT
    missing = _read(_src(tmp_path, SourceFormat.PARQUET, text_field="body"), p)
    assert [d.reason for d in missing] == [Reason.MISSING_TEXT] * 5


def test_text_whole_file_and_blank_line_blocks(tmp_path):
    p = tmp_path / "b.txt"
    p.write_bytes(b"first\r\nstill first\r\n\r\n \t\r\nsecond\n\n\n\nthird\xff\n\n")
    whole = _read(_src(tmp_path, SourceFormat.TEXT), p)
    assert [(d.key, d.reason) for d in whole] == [("s/b.txt:0", Reason.INVALID_UTF8)]
    blocks = _read(_src(tmp_path, SourceFormat.TEXT, text_split=TextSplit.BLANK_LINES), p)
    assert blocks[:2] == [Document("s/b.txt:0", "first\r\nstill first"), Document("s/b.txt:1", "second")]
    assert (
        blocks[2].key == "s/b.txt:2"
        and blocks[2].reason is Reason.INVALID_UTF8
        and blocks[2].raw == b"third\xff"
    )


def test_bad_json_lines(tmp_path):
    p = tmp_path / "h.jsonl"
    p.write_bytes(
        b"\n".join(
            [
                b'{"text": "ok"}',
                b"{nope",
                b"[1]",
                b'{"id": 1}',
                b'{"text": null}',
                b'{"text": 3}',
                b'{"text": "\\udc80"}',
                b'{"text": "\xc3\x28"}',
                b'"just a string"',
            ]
        )
    )
    got = _read(_src(tmp_path, SourceFormat.JSONL), p)
    assert [d.reason for d in got[1:]] == [
        Reason.INVALID_JSON,
        Reason.NOT_AN_OBJECT,
        Reason.MISSING_TEXT,
        Reason.NON_STRING_TEXT,
        Reason.NON_STRING_TEXT,
        Reason.INVALID_UNICODE,
        Reason.INVALID_UTF8,
        Reason.NOT_AN_OBJECT,
    ]
    assert got[1].raw == b"{nope"


def test_relative_path():
    assert readers.relative_path("/a/b/c.txt", "/a") == "b/c.txt"
    assert readers.relative_path("gs://x/y/z.txt", "gs://x/") == "y/z.txt"
    assert readers.relative_path("/other/c.txt", "/a") == "/other/c.txt"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_lines = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["text", "id", "x"]), _json_values, max_size=3).map(
        lambda d: json.dumps(d).encode()
    ),
    st.text(max_size=30).map(lambda t: json.dumps({"text": t}).encode()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_lines, max_size=12), crlf=st.booleans())
def test_any_jsonl_bytes_give_one_item_per_non_blank_line(tmp_path, lines, crlf):
    p = tmp_path / "fuzz.jsonl"
    p.write_bytes((b"\r\n" if crlf else b"\n").join(lines))
    got = _read(_src(tmp_path, SourceFormat.JSONL), p)
    if p.read_bytes()[:2] == b"\x1f\x8b" or p.read_bytes()[:4] == b"\x28\xb5\x2f\xfd":
        # gzip or zstd magic: a compressed file under format jsonl is one dead letter
        assert [(d.key, d.reason) for d in got] == [("s/fuzz.jsonl:file", Reason.UNREADABLE_FILE)]
        return
    if p.read_bytes()[:2] in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 file: one dead letter
        assert [(d.key, d.reason) for d in got] == [("s/fuzz.jsonl:file", Reason.INVALID_UTF8)]
        return
    bom = b"\xef\xbb\xbf"  # a byte order mark starting a line (or the file) is not content
    lines = [line[len(bom) :] if line.startswith(bom) else line for line in lines]
    non_blank = [i + 1 for i, line in enumerate(lines) if line.strip()]
    assert [d.key for d in got] == [f"s/fuzz.jsonl:{i}" for i in non_blank]
    for d in got:
        if isinstance(d, Document):
            d.text.encode("utf-8")  # every accepted text is valid Unicode
        else:
            assert d.reason in set(Reason) - {Reason.EMPTY, Reason.UNREADABLE_FILE}


def test_document_ids_from_jsonl(tmp_path):
    """The id_field's value is the document's id, as text; null, absent or id_field None: no id;
    an id over MAX_ID_BYTES rejects the document as too_long, naming the field."""
    p = tmp_path / "a.jsonl"
    long_id = "u" * (readers.MAX_ID_BYTES + 1)
    rows = [{"text": "a", "url": "https://example.org/a?x=1"}, {"text": "b", "url": 12}, {"text": "c", "url": None},
            {"text": "d"}, {"text": "e", "url": {"z": 1, "a": [1, "é"]}}, {"text": "f", "url": long_id},
            {"text": "g", "url": True}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    got = _read(_src(tmp_path, SourceFormat.JSONL, id_field="url"), p)
    assert got[:5] == [
        Document("s/a.jsonl:1", "a", "https://example.org/a?x=1"),
        Document("s/a.jsonl:2", "b", "12"),
        Document("s/a.jsonl:3", "c"),
        Document("s/a.jsonl:4", "d"),
        Document("s/a.jsonl:5", "e", '{"a":[1,"é"],"z":1}'),
    ]
    assert got[5] == Rejected("s/a.jsonl:6", Reason.TOO_LONG, json.dumps(rows[5]).encode(),
                              f"id_field 'url' holds {readers.MAX_ID_BYTES + 1} bytes, over the limit of 4096 for an id")
    assert got[6] == Document("s/a.jsonl:7", "g", "true")
    assert [d.doc_id for d in _read(_src(tmp_path, SourceFormat.JSONL, id_field=None), p)[:2]] == ["", ""]


def test_document_ids_from_parquet_and_none_for_text(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["x", "y", "z"], "doc": ["id-0", None, "id-2"]}), p)
    assert _read(_src(tmp_path, SourceFormat.PARQUET, id_field="doc"), p) == [
        Document("s/a.parquet:0", "x", "id-0"), Document("s/a.parquet:1", "y"), Document("s/a.parquet:2", "z", "id-2")]
    ints = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": ["x"], "n": pa.array([7], pa.int64())}), ints)
    assert _read(_src(tmp_path, SourceFormat.PARQUET, id_field="n"), ints) == [Document("s/b.parquet:0", "x", "7")]
    # no such column: documents without ids (the default id_field "id" is often absent)
    assert _read(_src(tmp_path, SourceFormat.PARQUET), p)[0] == Document("s/a.parquet:0", "x")
    t = tmp_path / "c.txt"
    t.write_text("plain", encoding="utf-8")
    assert _read(_src(tmp_path, SourceFormat.TEXT), t) == [Document("s/c.txt:0", "plain")]
