"""One printed, settable seed for the tests' fresh random inputs.

Every test that wants OS-fresh randomness asks ``fresh_seed()``: a seed derived from the session's base seed, the
running test's id and how many it asked before, so a run is repeated by setting ``EXL3TOOL_TEST_SEED`` to the base
seed that the run printed (in the header, the summary and each failure's report), with the same test selection.
"""

from __future__ import annotations

import hashlib
import inspect
import os

ENV = "EXL3TOOL_TEST_SEED"
_base: int | None = None
drawn: dict[str, list[int]] = {}  # test id (or module, at import) -> seeds handed out, in order


def base_seed() -> int:
    """$EXL3TOOL_TEST_SEED, else one OS-random draw per session (xdist workers get the controller's)."""
    global _base
    if _base is None:
        text = os.environ.get(ENV, "").strip()
        if text:
            try:
                _base = int(text, 0)
            except ValueError:
                raise SystemExit(f"{ENV}={text!r}: not an integer; set it to the seed a run printed") from None
        else:
            _base = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    return _base


def set_base_seed(value: int) -> None:
    global _base
    _base = int(value)


def _owner() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if current:
        return current.rsplit(" (", 1)[0]
    caller = inspect.stack()[2]  # at import time (a module constant): the calling module
    return os.path.basename(caller.filename)


def fresh_seed(bits: int = 31) -> int:
    """A fresh seed in [0, 2**bits), repeatable through EXL3TOOL_TEST_SEED."""
    owner = _owner()
    seeds = drawn.setdefault(owner, [])
    digest = hashlib.sha256(f"{base_seed()}:{owner}:{len(seeds)}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") & ((1 << bits) - 1)
    seeds.append(value)
    return value


def fresh_bytes(n: int) -> bytes:
    """n random bytes (file contents, garbage), repeatable through EXL3TOOL_TEST_SEED."""
    import random

    return random.Random(fresh_seed(63)).randbytes(n)
