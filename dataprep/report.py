"""``<dataset>/report.png``: what a packing run did, to look at before training on it.

Six panels, drawn with matplotlib (Agg) from the manifest and the run's stats:

1. segment lengths: a histogram per source of the segments (document chunks) placed in
   rows, in tokens (log count); each source in its own line style and width, so that two
   sources with the same counts stay visible one over the other;
2. fill per shard: tokens / (rows x seq_len) of every shard, by source, on an axis from 0
   to 100% (a zoomed axis made 99.5% look half of 100%), each bar labelled;
3. tokens per source against the mixture: each source's share of packed tokens next to
   its weight in every phase, which is its sampling share: the share of rows the loader
   draws from it (rows are full, so it counts tokens too); legends sit under the axes, never on
   the bars or their labels;
4. documents: packed, split (longer than seq_len, cut into chunks) and exact duplicates
   of an earlier document (dropped with ``dedup: exact``), per source;
5. rejected documents by reason, per source (the dead letters in ``errors/``);
6. the totals.

The picture is a view of the run, not part of the dataset contract: it is not listed in
``manifest.json``, the loader never reads it, and it is drawn after the manifest is
committed (or, when a source lost too much, in place of the manifest, to show why: its
title then says it was not committed, and the failure message is printed in red). Its
bytes depend only on the data and the matplotlib version, so reruns reproduce it.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Mapping, Optional, Sequence

import numpy as np

from common import figures
from contract.config import MixtureConfig
from contract.manifest import Manifest



def _fill_pct(f: float) -> str:
    """A fill percentage as the totals table and the closing table print it (rounded to 0.01), except
    that a fill below 100 never reads "100.00%"."""
    text = f"{f:.2f}%"
    return "99.99%" if text == "100.00%" and f < 100.0 else text

def segment_histograms(stats: Sequence[Sequence]) -> dict[str, np.ndarray]:
    """Per source, the sum over its shards of the ``segment_lengths`` histograms in the stats."""
    out: dict[str, np.ndarray] = {}
    for s in stats:
        if s[0] == "shard" and "segment_lengths" in s[3]:
            h = np.asarray(s[3]["segment_lengths"], np.int64)
            out[s[1]] = out[s[1]] + h if s[1] in out else h
    return out


# Phases with distinct weights drawn beside the packed tokens (more would be unreadable bars).
MAX_PHASES_DRAWN = 5
# Rows of the totals table (sources beyond it are summed in the total row only).
MAX_TABLE_SOURCES = 24
LINE_STYLES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 2, 1, 2)))


def short_names(names: Sequence[str], width: int) -> list[str]:
    """``names`` cut to at most ``width`` characters, keeping head and tail (``"web_…_v2"``), unique.

    Source names often share a long prefix and differ at the end, so a plain cut would make
    them all look alike. Where cut names still collide, the name's index is prefixed.
    """
    def cut(n: str) -> str:
        if len(n) <= width:
            return n
        head = (width - 1) // 2
        return n[:head] + "\u2026" + n[len(n) - (width - 1 - head):]

    out = [cut(n) for n in names]
    if len(set(out)) < len(out):
        out = [cut(f"{i}:{n}") for i, n in enumerate(names)]
    return out


def _phase_groups(config: MixtureConfig, names: Sequence[str]) -> list[tuple[list[int], np.ndarray]]:
    """Phases grouped by identical weights (in order of first appearance): ``(from_steps, weights)``."""
    groups: list[tuple[list[int], np.ndarray]] = []
    for p in config.phases:
        w = np.array([p.weights.get(n, 0.0) for n in names], float)
        w = 100.0 * w / w.sum()
        for steps, seen in groups:
            if np.array_equal(seen, w):
                steps.append(p.from_step)
                break
        else:
            groups.append(([p.from_step], w))
    return groups


@dataclasses.dataclass(frozen=True)
class _Page:
    """What every panel of the report draws from: the manifest, the config and the names' looks."""

    manifest: Manifest
    config: MixtureConfig
    names: list[str]  # sorted source names
    colors: dict[str, str]
    tick_names: list[str]  # names cut to 24 characters
    long_labels: bool  # many or long names: ticks slanted, labels shorter
    dups: Optional[Mapping]  # manifest.duplicates (None: dedup off)
    dup: np.ndarray  # per source, its exact duplicates (0 without dups)

    @property
    def seq(self) -> int:
        return self.manifest.seq_len

    @property
    def dropped(self) -> bool:
        """Whether the duplicates were dropped (``dedup: exact``), not only reported."""
        return bool(self.dups) and self.dups["mode"] == "exact"

    def source_ticks(self, ax, positions, labels) -> None:
        if self.long_labels:
            ax.set_xticks(positions, labels, fontsize=8, rotation=30, ha="right", rotation_mode="anchor")
        else:
            ax.set_xticks(positions, labels, fontsize=9)


def render(
    manifest: Manifest,
    config: MixtureConfig,
    histograms: Mapping[str, np.ndarray],
    failure: Optional[str] = None,
) -> bytes:
    """Returns the PNG bytes of the report (1600 x 1200 pixels).

    ``failure``: the message of a run that was not committed (a source lost too much); the
    title then says so in red and the message is printed under the totals.
    """
    figures.use_agg()
    from matplotlib.figure import Figure

    names = sorted(manifest.sources)
    dups = manifest.duplicates
    page = _Page(manifest, config, names, colors={n: f"C{i % 10}" for i, n in enumerate(names)},
                 tick_names=short_names(names, 24), long_labels=len(names) > 6 or max(map(len, names)) > 14,
                 dups=dups,
                 dup=np.array([dups["by_source"].get(n, {}).get("documents", 0) if dups else 0 for n in names], float))
    fig = Figure(figsize=(16, 12), dpi=100, layout="constrained")
    axes = fig.subplots(3, 2)
    title = (
        f"dataset {manifest.name} v{manifest.version}: seq_len {page.seq:,}, {manifest.token_dtype} tokens, "
        f"{len(names)} source{'s' if len(names) != 1 else ''}"
    )
    if failure:
        title = "NOT COMMITTED (no manifest.json): " + title
    fig.suptitle(title, fontsize=15, color="C3" if failure else "black")
    _segment_lengths(axes[0, 0], page, histograms)
    _fill_per_shard(axes[0, 1], page)
    _shares(axes[1, 0], page)
    _documents(axes[1, 1], page)
    _rejected(axes[2, 0], page)
    _totals(axes[2, 1], page, failure)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _segment_lengths(ax, page: _Page, histograms: Mapping[str, np.ndarray]) -> None:
    """Segment lengths per source (log counts), earlier sources wider and solid."""
    names, seq, colors = page.names, page.seq, page.colors
    drawn = [n for n in names if histograms.get(n) is not None and histograms[n].sum()]
    for i, n in enumerate(drawn):
        h = histograms[n]
        width = -(-seq // len(h))
        edges = np.minimum(np.arange(len(h) + 1) * width, seq) + 0.5
        # Earlier sources wider and solid, later ones narrower and dashed: equal counts stay visible.
        ax.stairs(h, edges, baseline=0.5, label=f"{n} ({int(h.sum()):,} segments)", color=colors[n],
                  linewidth=max(1.2, 4.0 - 2.8 * i / max(1, len(drawn) - 1)), linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                  zorder=2 + i)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)
    ax.set_xlim(0, seq)
    ax.set_xlabel("segment length (tokens)")
    ax.set_ylabel("segments (log scale)")
    ax.set_title("segment lengths (chunks of documents placed in rows)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(3, len(drawn)), frameon=False)
    else:
        ax.text(0.5, 0.5, "no segment packed", ha="center", va="center", fontsize=14, transform=ax.transAxes)


def _fill_per_shard(ax, page: _Page) -> None:
    """Fill of each shard (% of row slots holding tokens), shards grouped by source."""
    from matplotlib.ticker import MultipleLocator

    manifest, names, seq, colors, tick_names = page.manifest, page.names, page.seq, page.colors, page.tick_names
    long_labels = page.long_labels
    x, fills, cols, ticks, labels = 0, [], [], [], []
    x_slots = sum(manifest.sources[n].totals()["records"] for n in names) * seq
    for n in names:
        shards = manifest.sources[n].shards
        start = x
        for s in shards:
            fills.append(100.0 * s.tokens / (s.records * seq) if s.records else 0.0)
            cols.append(colors[n])
            x += 1
        if shards:
            ticks.append((start + x - 1) / 2)
            label = tick_names[names.index(n)]
            labels.append(f"{label} ({len(shards)})" if long_labels else
                          f"{label}\n({len(shards)} shard{'s' if len(shards) > 1 else ''})")
    if fills:
        ax.bar(np.arange(len(fills)), fills, color=cols, width=0.8 if len(fills) <= 200 else 1.0)
        ax.set_ylim(0, 100.0)
        ax.yaxis.set_major_locator(MultipleLocator(10))
        if len(fills) <= 64:
            for i, f in enumerate(fills):
                label = "empty" if f == 0 else _fill_pct(f)
                ax.text(i, 2.0, label, ha="center", va="bottom", fontsize=8,
                        rotation=90 if len(fills) > 16 else 0, color="0.2" if f == 0 else "white")
    used = [f for f in fills if f > 0]
    overall = 100.0 * sum(manifest.sources[n].totals()["tokens"] for n in names) / max(1, x_slots)
    summary = f": lowest {_fill_pct(min(used))}, all shards {_fill_pct(overall)}" if used else ""
    page.source_ticks(ax, ticks, labels)
    ax.set_ylabel("fill (% of row slots holding tokens)")
    ax.set_title(f"fill per shard{summary} (axis from 0)" + ("; labels: source (shard count)" if long_labels else ""))


def _shares(ax, page: _Page) -> None:
    """Each source's share of the packed tokens beside its sampling share in each weighting."""
    manifest, names, tick_names, long_labels = page.manifest, page.names, page.tick_names, page.long_labels
    tokens = np.array([manifest.sources[n].totals()["tokens"] for n in names], float)
    bars = [("packed tokens (% of all)", 100.0 * tokens / tokens.sum() if tokens.sum() else tokens)]
    groups = _phase_groups(page.config, names)
    for steps, w in groups[:MAX_PHASES_DRAWN]:
        shown = ", ".join(f"{st:,}" for st in steps[:4]) + (f" (+{len(steps) - 4})" if len(steps) > 4 else "")
        bars.append((f"sampling share from step{'s' if len(steps) > 1 else ''} {shown}", w))
    width = 0.8 / len(bars)
    idx = np.arange(len(names))
    for i, (label, values) in enumerate(bars):
        b = ax.bar(idx + (i - (len(bars) - 1) / 2) * width, values, width, label=label,
                   color="0.25" if i == 0 else f"C{(i + 1) % 10}", alpha=1.0 if i == 0 else 0.75)
        if len(bars) * len(names) <= 40:
            ax.bar_label(b, fmt="%.0f%%", fontsize=8)
    page.source_ticks(ax, idx, tick_names)
    ax.set_ylabel("share (%)")
    more = len(groups) - MAX_PHASES_DRAWN
    ax.set_title("tokens per source against the mixture weights\n(a weight is a sampling share: the % of rows the "
                 "loader draws from the source)"
                 + (f" (first {MAX_PHASES_DRAWN} weightings; {more} more not drawn)" if more > 0 else ""), fontsize=11)
    ax.set_ylim(0, max(float(max(v.max() for _, v in bars)), 1.0) * 1.15)
    # Above the bars, never over them (or their labels).
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 if not long_labels else -0.22),
              ncol=2, frameon=False)


def _documents(ax, page: _Page) -> None:
    """Documents packed, split into chunks and duplicated, per source."""
    from matplotlib.ticker import MaxNLocator

    manifest, names, seq, tick_names, long_labels = page.manifest, page.names, page.seq, page.tick_names, page.long_labels
    dups, dup, dropped = page.dups, page.dup, page.dropped
    idx = np.arange(len(names))
    packed = np.array([manifest.sources[n].ledger.packed for n in names], float)
    split = np.array([manifest.sources[n].ledger.docs_split for n in names], float)
    read = np.array([manifest.sources[n].ledger.read for n in names], float)
    w = 0.27
    b1 = ax.bar(idx - w, packed, w, label="documents packed", color="0.6")
    b2 = ax.bar(idx, split, w, label=f"split (longer than {seq:,} tokens)", color="C3")
    b3 = ax.bar(idx + w, dup, w, color="C4", hatch="//" if dropped else None,
                label="exact duplicates of an earlier document" + (", dropped" if dropped else ", packed")
                if dups else "duplicates: not looked for (dedup: off)")
    ax.bar_label(b1, labels=[f"{int(v):,}" for v in packed], fontsize=8)
    ax.bar_label(b2, labels=[f"{int(s):,} ({s / p:.0%})" if p else "0" for s, p in zip(split, packed)], fontsize=8)
    ax.bar_label(b3, labels=[f"{int(d):,} ({d / r:.0%})" if dups and r else "-" for d, r in zip(dup, read)],
                 fontsize=8)
    page.source_ticks(ax, idx, tick_names)
    ax.set_ylabel("documents")
    ax.set_ylim(0, max(1.0, float(max(packed.max(), dup.max())) if len(packed) else 1.0) * 1.15)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("documents: packed, split into chunks, duplicated")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 if not long_labels else -0.22), ncol=2,
              frameon=False)


def _rejected(ax, page: _Page) -> None:
    """Rejected documents by source and reason."""
    from matplotlib.ticker import MaxNLocator

    manifest, names, colors, tick_names = page.manifest, page.names, page.colors, page.tick_names
    rows = [(n, r, c) for n in names for r, c in sorted(manifest.sources[n].ledger.rejected.items())]
    if rows:
        y = np.arange(len(rows))
        b = ax.barh(y, [c for _, _, c in rows], color=[colors[n] for n, _, _ in rows])
        ax.bar_label(b, labels=[f"{c:,}" for _, _, c in rows], fontsize=8, padding=2)
        ax.set_yticks(y, [f"{tick_names[names.index(n)]}: {r}" for n, r, _ in rows], fontsize=9 if len(rows) <= 20 else 7)
        ax.invert_yaxis()
        ax.set_xlabel("documents rejected (dead letters in errors/)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.text(0.5, 0.5, "no document rejected", ha="center", va="center", fontsize=14, transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title("rejected documents by reason")


def _totals(ax, page: _Page, failure: Optional[str]) -> None:
    """The totals table, and the failure's message for a run that was not committed."""
    import textwrap

    manifest, names, seq, dups, dup, dropped = page.manifest, page.names, page.seq, page.dups, page.dup, page.dropped
    ax.axis("off")
    col = max(6, min(32, max(map(len, names)))) + 1
    table_names = short_names(names, col - 1)
    lines = [f"{'source':<{col}}{'read':>11}{'packed':>11}{'rejected':>10}{'dups':>9}{'rows':>10}{'tokens':>15}"
             f"{'fill':>9}"]
    tot = np.zeros(7)
    for i, n in enumerate(names):
        e = manifest.sources[n]
        t, led = e.totals(), e.ledger
        rej = sum(led.rejected.values())
        fill = t["tokens"] / (t["records"] * seq) if t["records"] else 0.0
        d = f"{int(dup[i]):,}" if dups else "-"
        if i < MAX_TABLE_SOURCES:
            lines.append(f"{table_names[i]:<{col}}{led.read:>11,}{led.packed:>11,}{rej:>10,}{d:>9}{t['records']:>10,}"
                         f"{t['tokens']:>15,}{fill:>9.2%}")
        tot += [led.read, led.packed, rej, t["records"], t["tokens"], t["bytes"], dup[i]]
    if len(names) > MAX_TABLE_SOURCES:
        lines.append(f"... {len(names) - MAX_TABLE_SOURCES} more sources (in manifest.json)")
    fill = tot[4] / (tot[3] * seq) if tot[3] else 0.0
    d = f"{int(tot[6]):,}" if dups else "-"
    lines.append(f"{'total':<{col}}{int(tot[0]):>11,}{int(tot[1]):>11,}{int(tot[2]):>10,}{d:>9}{int(tot[3]):>10,}"
                 f"{int(tot[4]):>15,}{fill:>9.2%}")
    if dups:
        lines.append(f"dups: exact duplicates of an earlier document ({'dropped' if dropped else 'packed'}; "
                     f"dedup: {dups['mode']})")
    shards = sum(len(manifest.sources[n].shards) for n in names)
    per_token = f"{tot[5] / tot[4]:.3f} bytes a token" if tot[4] else "no token packed"
    lines += ["", f"{shards:,} shard{'s' if shards != 1 else ''}, {tot[5] / 1e6:,.1f} MB on disk, {per_token}",
              f"tokenizer sha256 {str(manifest.tokenizer.get('sha256', ''))[:16]}..., "
              f"vocab {manifest.tokenizer.get('vocab_size', '?'):,}"]
    size = 10 if col + 75 <= 84 else 8
    ax.text(0.0, 1.0, "\n".join(lines), family="monospace", fontsize=size, va="top", transform=ax.transAxes)
    if failure:
        wrapped = [w for line in failure.splitlines() for w in textwrap.wrap(line, 95, subsequent_indent="    ")]
        if len(wrapped) > 14:
            wrapped = wrapped[:13] + ["    ... (the rest in the command's error message)"]
        ax.text(0.0, 0.0, "\n".join(wrapped), family="monospace", fontsize=8, va="bottom", color="C3",
                transform=ax.transAxes)
    ax.set_title("totals (documents read = packed + rejected" + (" + duplicates dropped)" if dropped else ")"))
