"""Parsing JSON we did not write (cache files, bundles, checkpoints, the user's overlay) without a traceback.

``json.loads`` raises RecursionError, not ValueError, on arrays nested a few thousand deep: a 20 kB file
would escape every ``except ValueError`` and crash the command. ``loads_json`` turns that into ValueError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from exl3tool.errors import InputError

__all__ = ["loads_json", "read_json_object", "to_jsonable"]


def loads_json(data: str | bytes | bytearray) -> Any:
    """``json.loads``, raising ValueError for every way ``data`` is not usable JSON (also nesting too deep).

    >>> loads_json('{"a": [1]}')
    {'a': [1]}
    >>> loads_json("[" * 100_000)
    Traceback (most recent call last):
    ValueError: JSON nested too deeply to parse
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def read_json_object(path: Path) -> dict:
    """A small JSON file of a checkpoint as a dict: InputError naming ``path`` when it cannot be read, is not
    JSON or is not an object. FileNotFoundError propagates: whether a missing file is an error is the caller's."""
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path}: cannot parse ({e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a JSON object")
    return data


def to_jsonable(obj: Any) -> Any:
    """Turn dataclasses, paths and tuples into plain JSON values (stable key order)."""
    import dataclasses
    from pathlib import PurePath

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_none") and getattr(obj, f.name) is None)}  # optional, absent when None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    return obj
