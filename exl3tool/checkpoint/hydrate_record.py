"""The record `exl3tool hydrate` leaves in OUT: which TP sizes OUT was checked for, and what it stores.

It sits beside ``tensor_storage`` as ``exl3tool_hydrate`` (in quantization_config.json, or config.json's inline
``quantization_config``); the fork reads neither it nor any other key it does not know (``Exl3Config.from_config``).
``exl3tool identity`` and ``cache check`` read it (``read_hydrate_record``) and print "hydrated for TP 1,2"; a check
at a TP size where a stored layer cannot be sliced names that layer and the server's error (``fails_at``).
Torch-free: the commands that print it load no tensor library for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["HYDRATED_BY", "HydrateRecord", "read_hydrate_record", "hydrate_note"]

HYDRATED_BY = "exl3tool_hydrate"  # the note's key beside tensor_storage
_QUANT = "quantization_config.json"


@dataclass(frozen=True)
class HydrateRecord:
    """What one ``exl3tool_hydrate`` note says (``read_hydrate_record``)."""

    bits: int  # the default K (``--bits``)
    tp_sizes: tuple[int, ...]  # the TP sizes the hydrate was checked for: OUT loads at each
    modules: dict[str, str] = field(default_factory=dict)  # EXL3 tensor prefix -> SOURCE's weight it replaced
    bits_by_module: dict[str, int] = field(default_factory=dict)  # modules stored at another K than ``bits``
    left_bf16: tuple[str, ...] = ()  # layers kept BF16 (as SOURCE)
    left_tp: dict[str, tuple[int, ...]] = field(default_factory=dict)  # of those: the TP sizes that could not slice them
    fails_at: dict[int, str] = field(default_factory=dict)  # TP size <= checked_up_to -> "layer: the server's error"
    checked_up_to: int = 0  # every TP size up to this one vLLM can split the model into was checked (0: old record)
    path: str = ""  # the file the note was read from
    not_modelled: tuple[str, ...] = ()  # modules the server still encodes online that exl3tool does not model

    def loads_at(self, tp: int) -> Optional[bool]:
        """Whether a server at TP ``tp`` loads every stored layer: True, False (``fails_at`` says why), or None
        when the hydrate did not check that size."""
        if tp in self.fails_at:
            return False
        if tp in self.tp_sizes or tp <= self.checked_up_to:
            return True
        return None

    def line(self) -> str:
        """One line for people: "hydrated for TP 1,2 (K6, 14 modules stored, 2 layers left BF16)"."""
        ks = sorted({self.bits, *self.bits_by_module.values()})
        left = f", {len(self.left_bf16)} layer{'s' if len(self.left_bf16) != 1 else ''} left BF16" if self.left_bf16 else ""
        online = (f", {', '.join(self.not_modelled)} still encoded online (not modelled)" if self.not_modelled
                  else "")
        return (f"hydrated for TP {','.join(map(str, self.tp_sizes))} ({'/'.join(f'K{k}' for k in ks)}, "
                f"{len(self.modules)} module{'s' if len(self.modules) != 1 else ''} stored{left}{online}; "
                "exl3tool hydrate)")

    def as_json(self) -> dict[str, Any]:
        return {"tp_sizes": list(self.tp_sizes), "bits": self.bits, "bits_by_module": dict(self.bits_by_module),
                "modules": len(self.modules), "left_bf16": list(self.left_bf16),
                "left_bf16_tp_sizes": {p: list(t) for p, t in self.left_tp.items()},
                "fails_at": {str(tp): why for tp, why in sorted(self.fails_at.items())},
                "checked_up_to": self.checked_up_to, "not_modelled": list(self.not_modelled), "path": self.path}


def hydrate_note(*, bits: int, tp_sizes: tuple[int, ...], modules: dict[str, str], bits_by_module: dict[str, int],
                 left_bf16: list[str], left_tp: dict[str, tuple[int, ...]], fails_at: dict[int, str],
                 checked_up_to: int, not_modelled: list[str] = ()) -> dict[str, Any]:
    """The ``exl3tool_hydrate`` note a hydrate writes (the one place its keys are spelled)."""
    note: dict[str, Any] = {"bits": int(bits), "tp_sizes": list(tp_sizes), "modules": dict(sorted(modules.items())),
                            "left_bf16": list(left_bf16), "tp_checked_up_to": int(checked_up_to),
                            "fails_at": {str(tp): why for tp, why in sorted(fails_at.items())}}
    if bits_by_module:
        note["bits_by_module"] = dict(sorted(bits_by_module.items()))
    if left_tp:
        note["left_bf16_tp_sizes"] = {p: list(t) for p, t in sorted(left_tp.items()) if t}
    if not_modelled:  # OUT does not store them: a server of it still encodes them online
        note["not_modelled"] = list(not_modelled)
    return note


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list):
        return ()
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)


def read_hydrate_record(root: str | Path) -> Optional[HydrateRecord]:
    """The ``exl3tool_hydrate`` note of the checkpoint folder ``root``, or None (not a folder, not hydrated by
    exl3tool, or a note that is not an object). Only the small JSON files are read."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return None
    for name, inline in ((_QUANT, False), ("config.json", True)):
        try:
            doc = json.loads((root / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if inline:
            doc = doc.get("quantization_config") if isinstance(doc, dict) else None
        note = doc.get(HYDRATED_BY) if isinstance(doc, dict) else None
        if not isinstance(note, dict):
            continue
        modules = note.get("modules") if isinstance(note.get("modules"), dict) else {}
        bits = note.get("bits") if isinstance(note.get("bits"), int) else 0
        fails: dict[int, str] = {}
        for tp, why in (note.get("fails_at") or {}).items() if isinstance(note.get("fails_at"), dict) else ():
            if str(tp).isdigit() and isinstance(why, str):
                fails[int(tp)] = why
        left_tp = note.get("left_bf16_tp_sizes") if isinstance(note.get("left_bf16_tp_sizes"), dict) else {}
        by_module = note.get("bits_by_module") if isinstance(note.get("bits_by_module"), dict) else {}
        up_to = note.get("tp_checked_up_to")
        return HydrateRecord(
            bits=bits, tp_sizes=_ints(note.get("tp_sizes")), modules={str(k): str(v) for k, v in modules.items()},
            bits_by_module={str(k): v for k, v in by_module.items() if isinstance(v, int)},
            left_bf16=tuple(str(p) for p in note.get("left_bf16") or () if isinstance(p, str)),
            left_tp={str(p): _ints(t) for p, t in left_tp.items()}, fails_at=fails,
            checked_up_to=up_to if isinstance(up_to, int) and not isinstance(up_to, bool) else 0,
            path=str(root / name),
            not_modelled=tuple(str(p) for p in note.get("not_modelled") or () if isinstance(p, str)))
    return None
