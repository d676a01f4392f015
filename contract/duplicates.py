"""Duplicated data in a packed dataset, from its manifest alone: pure functions, no I/O.

``dataprep.pack`` (before it commits the manifest) and ``loader.build`` (when it opens a dataset)
call :func:`find`, then warn or refuse by the caller's choice (:data:`MODES`). Two signs::

    shared sha256    two or more shards (of any sources) whose files have the same sha256: the
                     same rows stored again (a packer that wrote one shard several times, a copy
                     step that duplicated files); every row of each later copy repeats.
    repeated share   per source, the share of its rows that repeat others': the records of its
                     shards that copy an earlier shard (manifest order: sources, then shards),
                     over its records, plus the tokens of its documents that the pack's
                     duplicate report (``dedup: report``) found to repeat an earlier document,
                     over its packed tokens; reported above ``max_fraction``. With
                     ``dedup: exact`` those documents were left out of the rows (the ledger's
                     ``duplicates_dropped``), so they repeat nothing that is packed.

Worked example: source ``docs`` with 4 shards of 10 records each, all with one sha256 ``h``::

    shared sha256   docs/data-00000 (kept), docs/data-00001, -00002, -00003 copy it
    repeated share  30 of 40 records = 0.75 > 0.05: reported
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

MODES = ("warn", "refuse", "off")
DEFAULT_MAX_FRACTION = 0.05  # a source whose rows repeat beyond 5% is reported


@dataclasses.dataclass(frozen=True)
class Finding:
    """One sign of duplicated data.

    Attributes:
      kind: ``"shared_sha256"`` or ``"repeated_share"``.
      shards: the shards concerned (the kept copy first for ``shared_sha256``).
      sources: the sources concerned.
      fraction: ``repeated_share``: the source's repeated share in [0, 1]; else None.
      message: in words, with what to do next.
    """

    kind: str
    shards: tuple[str, ...]
    sources: tuple[str, ...]
    fraction: Optional[float]
    message: str


def check_mode(mode: str, field: str) -> str:
    """``mode`` when it is one of :data:`MODES`; raises ValueError naming ``field`` otherwise."""
    if mode not in MODES:
        raise ValueError(f"{field}: must be one of {list(MODES)}, got {mode!r}")
    return mode


def find(manifest: Any, max_fraction: float = DEFAULT_MAX_FRACTION) -> list[Finding]:
    """The signs of duplicated data in ``manifest`` (a ``contract.manifest.Manifest``; module docstring).

    Args:
      max_fraction: a source's repeated share above this is reported, in [0, 1].

    Raises:
      ValueError: ``max_fraction`` outside [0, 1].
    """
    if not 0 <= max_fraction <= 1:
        raise ValueError(f"max_fraction: must be in [0, 1], got {max_fraction!r}")
    out: list[Finding] = []
    first: dict[str, str] = {}  # sha256 -> the first shard with it
    copies: dict[str, list[str]] = {}  # the first shard -> its later copies
    copied_records: dict[str, int] = {}
    for name, entry in manifest.sources.items():
        for sh in entry.shards:
            if not sh.sha256 or not sh.records:  # empty shards are alike without holding any data twice
                continue
            kept = first.setdefault(sh.sha256, sh.path)
            if kept != sh.path:
                copies.setdefault(kept, []).append(sh.path)
                copied_records[name] = copied_records.get(name, 0) + int(sh.records)
    for kept, later in copies.items():
        shards = (kept, *later)
        sources = tuple(sorted({p.split("/")[0] for p in shards}))
        out.append(Finding("shared_sha256", shards, sources, None,
                           f"{len(shards)} shards have the same sha256 (the same rows stored {len(shards)} times): "
                           f"{', '.join(shards[:4])}{' ...' if len(shards) > 4 else ''}; repack the source(s) "
                           f"{', '.join(sources)} (a packer or copy step wrote one shard more than once)"))
    report = getattr(manifest, "duplicates", None) or {}
    # dedup: exact dropped the documents it found: none of them is in a row
    dup = (report.get("by_source") or {}) if report.get("mode") != "exact" else {}
    for name, entry in manifest.sources.items():
        records = entry.records
        tokens = sum(int(sh.tokens) for sh in entry.shards)
        share = copied_records.get(name, 0) / records if records else 0.0
        dup_tokens = int((dup.get(name) or {}).get("tokens", 0))
        share = min(1.0, share + (dup_tokens / tokens if tokens else 0.0))
        if share > max_fraction:
            parts = []
            if copied_records.get(name):
                parts.append(f"{copied_records[name]:,} of its {records:,} records are in copies of other shards")
            if dup_tokens:
                parts.append(f"{dup_tokens:,} of its {tokens:,} tokens are documents that repeat earlier ones "
                             "(the pack's duplicate report)")
            out.append(Finding("repeated_share", tuple(s.path for s in entry.shards), (name,), round(share, 6),
                               f"source {name!r}: {share:.1%} of its data repeats data packed before it (records and tokens: "
                               f"{'; '.join(parts)}), over "
                               f"{max_fraction:.1%}; repack it with dedup: exact, or lower its weight"))
    return out
