"""The run summary: a Rich table per source of documents, rows, tokens, fill, rejections and duplicates."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from rich.console import Console
from rich.table import Table

from contract.manifest import Manifest


def summary_table(manifest: Manifest, title: Optional[str] = None) -> Table:
    """Returns the table: one row per source plus a total row."""
    table = Table(
        title=title
        or f"{manifest.name} v{manifest.version}: seq_len {manifest.seq_len}, {manifest.token_dtype} tokens"
    )
    for col in ("source", "docs read", "packed", "rejected", "duplicates", "split", "shards", "rows", "tokens",
                "fill"):
        table.add_column(col, justify="left" if col in ("source", "rejected", "duplicates") else "right")
    tot = dict(read=0, packed=0, rejected=0, split=0, shards=0, rows=0, tokens=0)
    dups = manifest.duplicates
    for name, entry in sorted(manifest.sources.items()):
        t, led = entry.totals(), entry.ledger
        rej = ", ".join(f"{k}: {v}" for k, v in sorted(led.rejected.items())) or "0"
        slots = t["records"] * manifest.seq_len
        table.add_row(
            name,
            f"{led.read:,}",
            f"{led.packed:,}",
            rej,
            duplicates_cell(dups, name),
            f"{led.docs_split:,}",
            str(len(entry.shards)),
            f"{t['records']:,}",
            f"{t['tokens']:,}",
            f"{t['tokens'] / slots:.2%}" if slots else "-",
        )
        for k, v in (
            ("read", led.read),
            ("packed", led.packed),
            ("rejected", sum(led.rejected.values())),
            ("split", led.docs_split),
            ("shards", len(entry.shards)),
            ("rows", t["records"]),
            ("tokens", t["tokens"]),
        ):
            tot[k] += v
    slots = tot["rows"] * manifest.seq_len
    table.add_row(
        "total",
        f"{tot['read']:,}",
        f"{tot['packed']:,}",
        f"{tot['rejected']:,}",
        f"{dups['documents']:,}" + (" dropped" if dups["mode"] == "exact" and dups["documents"] else "")
        if dups else "-",
        f"{tot['split']:,}",
        str(tot["shards"]),
        f"{tot['rows']:,}",
        f"{tot['tokens']:,}",
        f"{tot['tokens'] / slots:.2%}" if slots else "-",
        style="bold",
    )
    return table


def duplicates_cell(duplicates: Optional[Mapping[str, Any]], source: str) -> str:
    """``10 dropped (of web)``: the source's documents that an earlier one duplicates, whether they
    were dropped (``dedup: exact``), and the other sources holding the kept copies; when some kept
    copies are in the source itself and some elsewhere, each count: ``3 (2 of web, 1 within)``;
    ``-`` with ``dedup: off``."""
    if not duplicates:
        return "-"
    entry = duplicates["by_source"].get(source, {"documents": 0, "of": {}})
    n = entry["documents"]
    others = [s for s in entry["of"] if s != source]
    within = int(entry["of"].get(source, 0))
    if others and within:  # some of each: every count named (was "3 (of web)" for 2 of web and 1 within)
        where = ", ".join(f"{int(entry['of'][s]):,} of {s}" for s in others) + f", {within:,} within"
    else:
        where = f"of {', '.join(others)}" if others else ""
    return (f"{n:,}" + (" dropped" if duplicates["mode"] == "exact" and n else "")
            + (f" ({where})" if where else ""))


def print_summary(result, console: Optional[Console] = None) -> None:
    """Prints where the dataset is, the table, and the ledger check (``result``: PackResult)."""
    if console is None:
        console = Console()
        if not console.is_terminal and console.width < 130:
            console = Console(width=130)
    console.print(summary_table(result.manifest))
    # soft_wrap: paths are never broken across lines, whatever the width.
    console.print(f"dataset: {result.output}  (manifest.json, <source>/data-*.array_record, errors/*.jsonl)",
                  soft_wrap=True, highlight=False)
    if getattr(result, "report", None):
        console.print(f"report: {result.report}  (segment lengths, fill per shard, tokens against weights, "
                      "documents split and duplicated, rejections: look before training)", soft_wrap=True,
                      highlight=False)
    dropped = any(e.ledger.duplicates_dropped for e in result.manifest.sources.values())
    console.print("ledger: documents read = packed + rejected" + (" + duplicates dropped" if dropped else "")
                  + ", tokens in = tokens packed" + (" + tokens dropped" if dropped else "") + ": reconciled")
    if result.metrics:
        shown = ", ".join(f"{k}={v:,}" for k, v in result.metrics.items())
        console.print(f"beam counters: {shown}", soft_wrap=True, highlight=False)
