"""Wording helpers every layer uses for what a person reads (no rich: the library and the CLI share them)."""

from __future__ import annotations

__all__ = ["plural"]


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun that agrees with it, for every count a person reads.

    >>> plural(1, "job"), plural(3, "job"), plural(0, "entry", "entries")
    ('1 job', '3 jobs', '0 entries')
    """
    return f"{n:,} {one if n == 1 else (many or one + 's')}"
