"""The serving stack's online EXL3 cache: identities, keys, paths, entries and the store (rules: docs/cache-format.md).

Everything here reproduces the server's behaviour byte for byte; see each module for the section it follows.
"""

from __future__ import annotations

from exl3tool.lazy import lazy_exports

# Each name is imported from its module on first use: the CLI's `--help` reads cache.settings without torch.
__getattr__, __dir__ = lazy_exports(__name__, {
    "exl3tool.cache.entry": ("Exl3OnlineNonFiniteError", "InvalidEntryError", "tensor_sha256", "validate_entry",
                             "write_entry"),
    "exl3tool.cache.hub": ("ResolvedRevision", "resolve_hub_revision"),
    "exl3tool.cache.identity": ("EncoderIdentity", "EncoderSettings", "ModelIdentity", "ServerIdentities",
                                "encoder_settings", "resolve_encoder_identity", "resolve_model_identity",
                                "server_encoder_identity", "server_identities"),
    "exl3tool.cache.key": ("CACHE_DISABLED", "CacheKey", "layer_seed"),
    "exl3tool.cache.paths": ("entry_path", "lock_path"),
    "exl3tool.cache.scan": ("CacheHealth", "EntryInfo", "PrunePlan", "PruneResult", "execute_prune", "inspect_entry",
                            "plan_prune", "scan"),
    "exl3tool.cache.settings": ("CACHE_MODES", "cache_mode", "cache_root"),
    "exl3tool.cache.store": ("LOCK_TIMEOUT_S", "CacheStore", "Claim", "LoadResult", "Lookup"),
})

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
