"""Parsing JSON we did not write (cache files, bundles, checkpoints, the user's overlay) without a traceback.

``json.loads`` raises RecursionError, not ValueError, on arrays nested a few thousand deep: a 20 kB file
would escape every ``except ValueError`` and crash the command. ``loads_json`` turns that into ValueError.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads_json"]


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
