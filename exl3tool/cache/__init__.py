"""The serving stack's online EXL3 cache: identities, keys, paths, entries and the store (rules: docs/cache-format.md).

Everything here reproduces the server's behaviour byte for byte; see each module for the section it follows.
"""

from __future__ import annotations

from exl3tool.cache.entry import Exl3OnlineNonFiniteError, InvalidEntryError, tensor_sha256, validate_entry, write_entry
from exl3tool.cache.hub import ResolvedRevision, resolve_hub_revision
from exl3tool.cache.identity import (
    EncoderIdentity,
    EncoderSettings,
    ModelIdentity,
    ServerIdentities,
    encoder_settings,
    resolve_encoder_identity,
    resolve_model_identity,
    server_encoder_identity,
    server_identities,
)
from exl3tool.cache.key import CACHE_DISABLED, CacheKey, layer_seed
from exl3tool.cache.paths import entry_path, lock_path
from exl3tool.cache.scan import CacheHealth, EntryInfo, PrunePlan, PruneResult, execute_prune, inspect_entry, plan_prune, scan
from exl3tool.cache.settings import CACHE_MODES, cache_mode, cache_root
from exl3tool.cache.store import LOCK_TIMEOUT_S, CacheStore, Claim, LoadResult, Lookup

__all__ = [
    "CACHE_DISABLED",
    "CACHE_MODES",
    "LOCK_TIMEOUT_S",
    "CacheKey",
    "CacheStore",
    "Claim",
    "EncoderIdentity",
    "EncoderSettings",
    "EntryInfo",
    "CacheHealth",
    "Exl3OnlineNonFiniteError",
    "InvalidEntryError",
    "LoadResult",
    "Lookup",
    "ModelIdentity",
    "PrunePlan",
    "ResolvedRevision",
    "ServerIdentities",
    "cache_mode",
    "cache_root",
    "encoder_settings",
    "entry_path",
    "execute_prune",
    "PruneResult",
    "inspect_entry",
    "layer_seed",
    "lock_path",
    "plan_prune",
    "resolve_encoder_identity",
    "resolve_hub_revision",
    "resolve_model_identity",
    "scan",
    "server_encoder_identity",
    "server_identities",
    "tensor_sha256",
    "validate_entry",
    "write_entry",
]
