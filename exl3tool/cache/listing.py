"""What `cache ls` lists: a cache's entries grouped by model directory and TP size, and by model and encoder
identity with the provenance that explains them; headers only (``scan(deep=False)``), nothing loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from exl3tool.cache.records import StoredRecord, group_by_identity, read_records
from exl3tool.cache.scan import EntryInfo, iso_utc, matches_model, scan

__all__ = ["CacheListing", "list_cache"]


@dataclass(frozen=True)
class CacheListing:
    """A cache's entries by (model directory, TP size) and by identity pair, with the records read beside them."""

    root: Path
    infos: tuple[EntryInfo, ...]  # the entries listed
    groups: tuple[dict[str, Any], ...]  # one per (model directory, TP size), sorted by identity and TP size
    identities: list[dict[str, Any]]  # ``records.group_by_identity``
    records: tuple[StoredRecord, ...]

    @property
    def bytes(self) -> int:
        return sum(i.size for i in self.infos)

    @property
    def bad_records(self) -> list[StoredRecord]:
        """Record files that cannot be read as records (`cache prune --invalid` removes them)."""
        return [sr for sr in self.records if sr.record is None]

    def as_json(self) -> dict[str, Any]:
        """The `cache ls --json` document (docs/cache.md)."""
        return {"root": str(self.root), "groups": [{**g, "newest_utc": iso_utc(g["newest"])} for g in self.groups],
                "entries": len(self.infos), "bytes": self.bytes, "identities": self.identities,
                "bad_records": [{"path": str(sr.path), "error": sr.error} for sr in self.bad_records]}


def list_cache(root: Path, *, model: Optional[str] = None) -> CacheListing:
    """List the entries under ``root`` (of model identities starting with ``model``, when given).

    One group per (model directory, TP size): an unreadable entry has no identity of its own but sits in its model's
    directory; the group carries the full identity that the directory's readable entries carry.
    """
    infos = [i for i in scan(root, deep=False) if i.kind == "entry" and matches_model(i, model)]
    groups: dict[tuple[str, int | None], dict[str, Any]] = {}
    for info in infos:
        folder = info.model_dir or "?"
        g = groups.setdefault((folder, info.tp_world_size), {
            "model_identity": folder, "tp_world_size": info.tp_world_size, "ranks": set(), "entries": 0,
            "malformed": 0, "bytes": 0, "newest": 0.0,
        })
        if info.model_identity and info.model_identity.startswith(folder) and info.status != "invalid":
            g["model_identity"] = info.model_identity
        g["ranks"].add(info.tp_rank)
        g["entries"] += 1
        g["malformed"] += info.status == "invalid"
        g["bytes"] += info.size
        g["newest"] = max(g["newest"], info.mtime)
    rows = tuple({**g, "ranks": sorted(r for r in g["ranks"] if r is not None)}
                 for g in sorted(groups.values(), key=lambda g: (g["model_identity"], g["tp_world_size"] or 0)))
    records = read_records(root, model_prefix=model)
    return CacheListing(root, tuple(infos), rows, group_by_identity(root, infos, records), tuple(records))
