"""The cache key: 12 fields, canonical JSON and SHA-256 digest (docs/cache-format.md §2.1, §2.2, §2.7)."""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass, fields
from typing import Any

from exl3tool.jsontext import loads_json

__all__ = ["CacheKey", "layer_seed", "canonical_dumps", "KEY_SCHEMA", "CACHE_DISABLED", "HEX64"]

KEY_SCHEMA = 1
CACHE_DISABLED = "cache-disabled"
_INT_FIELDS = ("bits", "seed", "tp_world_size", "tp_rank", "input_size", "output_size", "schema")
_STR_FIELDS = ("model_identity", "encoder_identity", "prefix", "codebook")
HEX64 = re.compile(r"[0-9a-f]{64}")  # identities, digests, SHA-256s (fullmatch)


def layer_seed(prefix: str) -> int:
    """The encoder seed of a layer: ``crc32(prefix as UTF-8) & 0x7FFFFFFF``.

    >>> layer_seed("model.layers.0.self_attn.qkv_proj")
    293502257
    """
    return zlib.crc32(prefix.encode("utf-8")) & 0x7FFFFFFF


def _bits_or_rank_problem(bits: int, tp_world_size: int, tp_rank: int) -> str | None:
    """Why the server never builds a key with these bits and TP rank, or None."""
    if not 3 <= bits <= 8:
        return f"bits must be from 3 to 8, got {bits}"
    if not 0 <= tp_rank < tp_world_size:
        return f"tp_rank {tp_rank} is outside 0..{tp_world_size - 1}"
    return None


def canonical_dumps(obj: Any) -> str:
    """Sorted keys, compact separators, ASCII escaping: the server's canonical form."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class CacheKey:
    """The identity of one cache entry; field order as in the server (the JSON sorts them anyway)."""

    model_identity: str
    encoder_identity: str
    prefix: str
    bits: int
    seed: int
    tp_world_size: int
    tp_rank: int
    input_size: int
    output_size: int
    codebook: str = "mcg"
    apply_out_scales: bool = True
    schema: int = KEY_SCHEMA

    def __post_init__(self) -> None:
        # JSON integers only: 6.0 or True would serialise differently and never match the server's key.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int:
                raise ValueError(f"cache key field {name} must be an int, got {value!r}")
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"cache key field {name} must be a str, got {getattr(self, name)!r}")
        if type(self.apply_out_scales) is not bool:
            raise ValueError(f"cache key field apply_out_scales must be a bool, got {self.apply_out_scales!r}")

    @classmethod
    def for_layer(
        cls,
        model_identity: str,
        encoder_identity: str,
        prefix: str,
        bits: int,
        tp_world_size: int,
        tp_rank: int,
        input_size: int,
        output_size: int,
    ) -> "CacheKey":
        """The key the server builds for one layer on one TP rank (seed from the prefix, constants fixed)."""
        problem = _bits_or_rank_problem(bits, tp_world_size, tp_rank)
        if problem:
            raise ValueError(f"{prefix}: {problem}")
        return cls(
            model_identity=model_identity,
            encoder_identity=encoder_identity,
            prefix=prefix,
            bits=bits,
            seed=layer_seed(prefix),
            tp_world_size=tp_world_size,
            tp_rank=tp_rank,
            input_size=input_size,
            output_size=output_size,
        )

    @classmethod
    def from_json(cls, text: str) -> "CacheKey":
        """Parse a stored ``cache_key``; exactly the 12 members with the right JSON types, else ValueError."""
        obj = loads_json(text)
        if not isinstance(obj, dict):
            raise ValueError("cache_key is not a JSON object")
        names = {f.name for f in fields(cls)}
        if set(obj) != names:
            raise ValueError(f"cache_key members differ: missing {sorted(names - set(obj))}, extra {sorted(set(obj) - names)}")
        return cls(**obj)

    def unproducible_reason(self) -> str | None:
        """Why the server could never build this key (so never look it up), or None.

        A key read from a file someone handed us (a bundle) is checked with this: its fields must be ones the
        server's online encode produces, not merely well-typed JSON.
        """
        for name in ("model_identity", "encoder_identity"):
            if not HEX64.fullmatch(getattr(self, name)):
                return f"{name} is not 64 lower-case hex digits"
        if self.schema != KEY_SCHEMA:
            return f"schema {self.schema} (the server writes {KEY_SCHEMA})"
        if self.codebook != "mcg" or self.apply_out_scales is not True:
            return "codebook/apply_out_scales differ from the server's (mcg, true)"
        if not self.prefix:
            return "the prefix is empty"
        if self.seed != layer_seed(self.prefix):
            return f"seed {self.seed} is not the prefix's ({layer_seed(self.prefix)})"
        problem = _bits_or_rank_problem(self.bits, self.tp_world_size, self.tp_rank)
        if problem:
            return problem
        if min(self.input_size, self.output_size) <= 0 or self.input_size % 128 or self.output_size % 128:
            return f"size {self.input_size} x {self.output_size} is not a positive multiple of 128 both ways"
        return None

    def as_dict(self) -> dict[str, Any]:
        """The 12 members as a plain dict (all scalars: no deep copy needed)."""
        return {name: getattr(self, name) for name in _NAMES}

    def canonical_json(self) -> str:
        """The exact string the server hashes and stores as ``cache_key`` metadata."""
        cached = self.__dict__.get("_canonical")
        if cached is None:  # computed once per key: a plan and a check ask for it thousands of times
            cached = canonical_dumps(self.as_dict())
            object.__setattr__(self, "_canonical", cached)
        return cached

    def digest(self) -> str:
        """Lower-case hex SHA-256 of the canonical JSON: the entry's file name."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            cached = hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()
            object.__setattr__(self, "_digest", cached)
        return cached


_NAMES = tuple(f.name for f in fields(CacheKey))
