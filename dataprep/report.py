"""``<dataset>/report.png``: what a packing run did, to look at before training on it.

Six panels, drawn with matplotlib (Agg) from the manifest and the run's stats:

1. segment lengths: a histogram per source of the segments (document chunks) placed in
   rows, in tokens (log count);
2. fill per shard: tokens / (rows x seq_len) of every shard, by source;
3. tokens per source against the mixture: each source's share of packed tokens next to
   its weight share in every phase (weights count rows, and rows are full);
4. documents split: documents longer than seq_len, cut into chunks, per source;
5. rejected documents by reason, per source (the dead letters in ``errors/``);
6. the totals.

The picture is a view of the run, not part of the dataset contract: it is not listed in
``manifest.json``, the loader never reads it, and it is drawn after the manifest is
committed (or, when a source lost too much, in place of the manifest, to show why). Its
bytes depend only on the data and the matplotlib version, so reruns reproduce it.
"""

from __future__ import annotations

import io
from typing import Mapping, Sequence

import numpy as np

from contract.config import MixtureConfig
from contract.manifest import Manifest


def segment_histograms(stats: Sequence[Sequence]) -> dict[str, np.ndarray]:
    """Per source, the sum over its shards of the ``segment_lengths`` histograms in the stats."""
    out: dict[str, np.ndarray] = {}
    for s in stats:
        if s[0] == "shard" and "segment_lengths" in s[3]:
            h = np.asarray(s[3]["segment_lengths"], np.int64)
            out[s[1]] = out[s[1]] + h if s[1] in out else h
    return out


def render(manifest: Manifest, config: MixtureConfig, histograms: Mapping[str, np.ndarray]) -> bytes:
    """Returns the PNG bytes of the report (1600 x 1200 pixels)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    names = sorted(manifest.sources)
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    seq = manifest.seq_len
    fig = Figure(figsize=(16, 12), dpi=100, layout="constrained")
    axes = fig.subplots(3, 2)
    fig.suptitle(
        f"dataset {manifest.name} v{manifest.version}: seq_len {seq:,}, {manifest.token_dtype} tokens, "
        f"{len(names)} sources",
        fontsize=15,
    )

    ax = axes[0, 0]
    for n in names:
        h = histograms.get(n)
        if h is None or not h.sum():
            continue
        width = -(-seq // len(h))
        edges = np.minimum(np.arange(len(h) + 1) * width, seq) + 0.5
        ax.stairs(h, edges, baseline=0.5, label=f"{n} ({int(h.sum()):,} segments)", color=colors[n],
                  linewidth=1.8)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)
    ax.set_xlim(0, seq)
    ax.set_xlabel("segment length (tokens)")
    ax.set_ylabel("segments (log scale)")
    ax.set_title("segment lengths (chunks of documents placed in rows)")
    if any(n in histograms for n in names):
        ax.legend(loc="best", fontsize=9)

    ax = axes[0, 1]
    x, fills, cols, ticks, labels = 0, [], [], [], []
    for n in names:
        shards = manifest.sources[n].shards
        start = x
        for s in shards:
            fills.append(100.0 * s.tokens / (s.records * seq) if s.records else 0.0)
            cols.append(colors[n])
            x += 1
        if shards:
            ticks.append((start + x - 1) / 2)
            labels.append(f"{n}\n({len(shards)} shard{'s' if len(shards) > 1 else ''})")
    if fills:
        ax.bar(np.arange(len(fills)), fills, color=cols, width=0.8 if len(fills) <= 200 else 1.0)
        used = [f for f in fills if f > 0]
        low = min(used) if used else 0.0
        bottom = max(0.0, min(low - 1.0, 99.0)) if len(used) == len(fills) else 0.0
        ax.set_ylim(bottom, 100.2)
        ax.axhline(100.0, color="0.5", linewidth=0.8, linestyle="--")
        if len(fills) <= 64:
            for i, f in enumerate(fills):
                ax.text(i, bottom + (100.2 - bottom) * 0.02, "empty" if f == 0 else f"{f:.1f}%",
                        ha="center", fontsize=8, rotation=90 if len(fills) > 16 else 0,
                        color="0.2" if f == 0 else "white")
    ax.set_xticks(ticks, labels, fontsize=9)
    ax.set_ylabel("fill (% of row slots holding tokens)")
    ax.set_title("fill per shard")

    ax = axes[1, 0]
    tokens = np.array([manifest.sources[n].totals()["tokens"] for n in names], float)
    bars = [("packed tokens", 100.0 * tokens / tokens.sum() if tokens.sum() else tokens)]
    for p in config.phases:
        w = np.array([p.weights.get(n, 0.0) for n in names], float)
        bars.append((f"weights from step {p.from_step:,}", 100.0 * w / w.sum()))
    width = 0.8 / len(bars)
    idx = np.arange(len(names))
    for i, (label, values) in enumerate(bars):
        b = ax.bar(idx + (i - (len(bars) - 1) / 2) * width, values, width, label=label,
                   color="0.25" if i == 0 else f"C{(i + 1) % 10}", alpha=1.0 if i == 0 else 0.75)
        ax.bar_label(b, fmt="%.0f%%", fontsize=8)
    ax.set_xticks(idx, names)
    ax.set_ylabel("share (%)")
    ax.set_title("tokens per source against the mixture weights")
    ax.legend(fontsize=9)

    ax = axes[1, 1]
    packed = np.array([manifest.sources[n].ledger.packed for n in names], float)
    split = np.array([manifest.sources[n].ledger.docs_split for n in names], float)
    b1 = ax.bar(idx - 0.2, packed, 0.4, label="documents packed", color="0.6")
    b2 = ax.bar(idx + 0.2, split, 0.4, label=f"split (longer than {seq:,} tokens)", color="C3")
    ax.bar_label(b1, labels=[f"{int(v):,}" for v in packed], fontsize=8)
    ax.bar_label(b2, labels=[f"{int(s):,} ({s / p:.0%})" if p else "0" for s, p in zip(split, packed)], fontsize=8)
    ax.set_xticks(idx, names)
    ax.set_ylabel("documents")
    ax.set_ylim(0, max(1.0, float(packed.max()) if len(packed) else 1.0) * 1.3)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("documents split into chunks")
    ax.legend(fontsize=9, loc="upper right")

    ax = axes[2, 0]
    rows = [(n, r, c) for n in names for r, c in sorted(manifest.sources[n].ledger.rejected.items())]
    if rows:
        y = np.arange(len(rows))
        b = ax.barh(y, [c for _, _, c in rows], color=[colors[n] for n, _, _ in rows])
        ax.bar_label(b, labels=[f"{c:,}" for _, _, c in rows], fontsize=8, padding=2)
        ax.set_yticks(y, [f"{n}: {r}" for n, r, _ in rows], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("documents rejected (dead letters in errors/)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.text(0.5, 0.5, "no document rejected", ha="center", va="center", fontsize=14, transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title("rejected documents by reason")

    ax = axes[2, 1]
    ax.axis("off")
    lines = [f"{'source':<14}{'read':>11}{'packed':>11}{'rejected':>10}{'rows':>10}{'tokens':>15}{'fill':>9}"]
    tot = np.zeros(6)
    for n in names:
        e = manifest.sources[n]
        t, led = e.totals(), e.ledger
        rej = sum(led.rejected.values())
        fill = t["tokens"] / (t["records"] * seq) if t["records"] else 0.0
        lines.append(f"{n[:13]:<14}{led.read:>11,}{led.packed:>11,}{rej:>10,}{t['records']:>10,}"
                     f"{t['tokens']:>15,}{fill:>9.2%}")
        tot += [led.read, led.packed, rej, t["records"], t["tokens"], t["bytes"]]
    fill = tot[4] / (tot[3] * seq) if tot[3] else 0.0
    lines.append(f"{'total':<14}{int(tot[0]):>11,}{int(tot[1]):>11,}{int(tot[2]):>10,}{int(tot[3]):>10,}"
                 f"{int(tot[4]):>15,}{fill:>9.2%}")
    shards = sum(len(manifest.sources[n].shards) for n in names)
    lines += ["", f"{shards:,} shards, {tot[5] / 1e6:,.1f} MB on disk, "
              f"{tot[5] / max(tot[4], 1):.3f} bytes a token",
              f"tokenizer sha256 {str(manifest.tokenizer.get('sha256', ''))[:16]}..., "
              f"vocab {manifest.tokenizer.get('vocab_size', '?'):,}"]
    ax.text(0.0, 1.0, "\n".join(lines), family="monospace", fontsize=10, va="top", transform=ax.transAxes)
    ax.set_title("totals (documents read = packed + rejected)")

    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
