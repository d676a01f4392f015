"""The loader's checkpoint state: the next step and a fingerprint of what the order depends on.

docs/design.md: ``batch(step) = f(manifest, mixture schedule, seed, global batch size, step)``, so
the state is the step plus enough of those inputs to refuse a resume that would silently
change the order, and to name what changed.

May import: ``loader.index`` (for the fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from loader import index as ix

STATE_VERSION = 1


class ResumeError(ValueError):
    """A saved loader state does not fit the loader it is restored into; names what changed."""


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Small, JSON-able loader state (a few hundred bytes).

    Attributes:
      next_step: the first step not yet handed to the trainer.
      fingerprint: sha256 hex of the other fields (see :func:`schedule_fingerprint`).
      manifest_sha256: sha256 of the dataset's ``manifest.json`` bytes.
      schedule: ``Schedule.to_dict()``: sources, records, phases (exact weights), global
        batch, seed, skip windows.
      version: state format version.
    """

    next_step: int
    fingerprint: str
    manifest_sha256: str
    schedule: Mapping[str, Any]
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The state as plain JSON values (what :meth:`from_dict` reads back)."""
        return {
            "version": self.version,
            "next_step": self.next_step,
            "fingerprint": self.fingerprint,
            "manifest_sha256": self.manifest_sha256,
            "schedule": json.loads(json.dumps(self.schedule)),
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces; a few hundred bytes), for a file of one's own or
        a checkpoint: ``LoaderState.from_json(state.to_json()) == state``."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LoaderState:
        """Parses and checks a state dict.

        Raises:
          ResumeError: a missing field, an unknown version, or a fingerprint that does not
            match the fields (edited or corrupted state).
        """
        try:
            if not isinstance(raw, Mapping):
                raise TypeError(f"expected a mapping, got {type(raw).__name__}")
            fields = {"next_step": raw["next_step"], "version": raw.get("version", STATE_VERSION)}
            for key, v in fields.items():  # exact integers: "12", 12.7 or True are not steps
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"{key} must be an integer, got {v!r}")
            for key in ("fingerprint", "manifest_sha256"):
                if not isinstance(raw[key], str):
                    raise TypeError(f"{key} must be a string, got {raw[key]!r}")
            if not isinstance(raw["schedule"], Mapping):
                raise TypeError(f"schedule must be a mapping, got {raw['schedule']!r}")
            state = cls(
                next_step=fields["next_step"], fingerprint=raw["fingerprint"],
                manifest_sha256=raw["manifest_sha256"], schedule=dict(raw["schedule"]),
                version=fields["version"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ResumeError(f"loader state is malformed ({e!r}): {raw!r}"[:2000]) from None
        if state.version != STATE_VERSION:
            raise ResumeError(f"loader state version {state.version}, this loader reads {STATE_VERSION}")
        if state.next_step < 0:
            raise ResumeError(f"loader state next_step must be >= 0, got {state.next_step}")
        expect = schedule_fingerprint(state.manifest_sha256, state.schedule)
        if expect != state.fingerprint:
            raise ResumeError(f"loader state fingerprint {state.fingerprint} does not match its fields ({expect})")
        return state

    @classmethod
    def from_json(cls, text: str | bytes) -> LoaderState:
        """Parses a state saved with :meth:`to_json`.

        Raises:
          ResumeError: not JSON (e.g. a truncated checkpoint file), or as :meth:`from_dict`.
        """
        try:
            raw = json.loads(text)
        except (ValueError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ResumeError(f"loader state is not JSON ({e}): {str(text)[:200]!r}") from None
        return cls.from_dict(raw)


def schedule_fingerprint(manifest_sha256: str, schedule: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of (manifest sha256, schedule dict)."""
    return ix.fingerprint({"manifest_sha256": manifest_sha256, "schedule": schedule})


def compare(saved: LoaderState, manifest_sha256: str, schedule: Mapping[str, Any]) -> list[dict]:
    """Checks that ``saved`` can resume under the current manifest and schedule.

    The only change allowed is appending skip windows that start at or after
    ``saved.next_step`` (they alter no batch already trained on).

    Returns:
      The skip windows added (``[{"start": A, "end": B}, ...]``), for the caller to log.

    Raises:
      ResumeError: naming every field that changed, old and new value.
    """
    changes = []
    if saved.manifest_sha256 != manifest_sha256:
        changes.append(f"manifest sha256 {saved.manifest_sha256} -> {manifest_sha256} (a different dataset)")
    old, new = saved.schedule, schedule
    for key, what in (("sources", "sources"), ("records", "records per source"), ("phases", "mixture phases/weights"),
                      ("global_batch", "global batch"), ("seed", "seed"), ("max_period", "interleave period limit")):
        if old.get(key) != new.get(key):
            changes.append(f"{what} {old.get(key)} -> {new.get(key)}")
    old_w = [list(w) for w in old.get("skip_windows", [])]
    new_w = [list(w) for w in new.get("skip_windows", [])]
    added = []
    if new_w[: len(old_w)] != old_w:
        changes.append(f"skip windows {old_w} -> {new_w} (only appending windows is allowed)")
    else:
        for a, b in new_w[len(old_w):]:
            if a < saved.next_step:
                changes.append(
                    f"new skip window [{a}, {b}] starts before the saved next step {saved.next_step}: "
                    "it would change batches already trained on"
                )
            added.append({"start": a, "end": b})
    if changes:
        raise ResumeError("loader state does not match this loader: " + "; ".join(changes))
    return added
