"""The fork's server releases in use and the rules each one follows: data, read in one place.

Every per-release rule exl3tool applies (the cache root, the entry lock, non-finite checks and the retry, the
start-up failure of a 32-unaligned shard, r7 routed-expert checkpoints, the ``VLLM_EXL3_*`` variables it reads)
is a field of a row below, and every module asks this table instead of spelling the rule again.
``docs/releases.md`` lists each rule with the fork file and commit it comes from.

Where the rows come from: each release of the fork's images is a composition recorded in
local-inference-lab/blackwell-llm-docker under ``patches/releases/<release>/vllm/`` (``integration.lock.json``:
the fork's base commit and the resulting tree, which the images carry as the label
``local-inference.vllm.integration.tree``; ``integration.patch``: the fork's ``exl3_online_cache.py`` and ``exl3.py``
as that release ships them). Two versions of the cache module ship: blob ``2855f2b1`` (Gilded Gnosis r20 to r33,
the rules of fork commit ``1702ed2d``) and blob ``335b04a5`` (Gilded Gnosis r34, Infernal Invocation r5 to r18, the
rules of fork commit ``3cd48af0``). Releases before r20 (and Infernal Invocation r2 to r4) ship no online cache.
Key, identities and entry format are the same in every version.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from exl3tool.errors import ConfigError

__all__ = [
    "CacheModule", "ServerRelease", "RELEASES", "CACHE_MODULES", "NEWEST", "release", "release_from_labels",
    "default_release", "KEY_VARIABLES", "NO_KEY_VARIABLES", "variable_note", "server_vllm_root", "server_cache_root",
    "RELEASE_LABELS", "MXFP8_BLOCK", "unaligned_start_failure", "UNALIGNED_FIX", "R7_SCHEMA", "GLM53_SCOPE", "edit_distance",
]

MXFP8_BLOCK = 32  # the MXFP8 fallback's block: its create_weights refuses a K_r that is not a multiple of it
R7_SCHEMA = "r7-complete-v2-checkpoint-v1"
GLM53_SCOPE = "glm53_routed_experts_only"


@dataclass(frozen=True)
class CacheModule:
    """One version of the fork's ``exl3_online_cache.py`` and the rules it applies (none of them changes a key)."""

    blob: str  # git blob of the file as the release patches add it
    fork_commit: str  # the fork commit (search index) whose file has the same rules
    xdg_cache_home: bool  # the default root honours XDG_CACHE_HOME (vLLM's envs.VLLM_CACHE_ROOT); else ~/.cache/vllm
    lock_timeout_s: Optional[float]  # None: the entry lock waits for ever (a warm holding it stalls the start)
    nonfinite_checks: bool  # loads and fresh encodes are refused when suh/svh or proxy_error are not finite
    publish_fallback: bool  # a failed publish keeps the encoded weights for the process (else the start fails)


CACHE_MODULES: dict[str, CacheModule] = {
    "older": CacheModule("2855f2b1a43fb6b6d7eeed5a933e042cdc76b80d", "1702ed2d28342d84551539f8d7e2de637f7ca04e",
                         xdg_cache_home=False, lock_timeout_s=None, nonfinite_checks=False, publish_fallback=False),
    "newer": CacheModule("335b04a5291e0754affbb151cbb532e66e5579ad", "3cd48af029cbc926fdd6c7efa9f31bd243ec4f2b",
                         xdg_cache_home=True, lock_timeout_s=600.0, nonfinite_checks=True, publish_fallback=True),
}


@dataclass(frozen=True)
class ServerRelease:
    """One release of the fork's images, as its composition records it."""

    name: str  # "gilded-gnosis-r33", "infernal-invocation-r18"
    date: str  # when blackwell-llm-docker recorded it
    vllm_base: str  # the fork's base commit (12 hex)
    tree: str  # the integration tree (label local-inference.vllm.integration.tree)
    docker_commit: str  # the blackwell-llm-docker commit that recorded it
    cache: Optional[str]  # key of CACHE_MODULES; None: no online EXL3 cache in this release
    exl3_blob: Optional[str]  # exl3.py as the release ships it (12 hex), None when the patch leaves it as the base's
    retry_nonfinite: bool  # _load_online_encoding_with_retry: one more encode after a non-finite one
    r7_checkpoints: bool  # Exl3Config takes r7_routed_experts checkpoints whatever their quant_method

    @property
    def cache_module(self) -> Optional[CacheModule]:
        return CACHE_MODULES[self.cache] if self.cache else None

    @property
    def online_cache(self) -> bool:
        return self.cache is not None

    # The rules below hold in every release that has the online cache (each exl3.py of the patches reads them so).
    @property
    def unaligned_falls_back_to(self) -> str:
        """A 128-unaligned shard is built with the MXFP8 online method, which refuses K_r % 32 != 0 at start-up
        (fork issue #311; PR #312, keeping such a layer BF16, is in no release)."""
        return "mxfp8"

    @property
    def encoder_source_tilde_expanded_for_import(self) -> bool:
        """``_load_exl3_online_quantizer`` takes ``Path(VLLM_EXL3_ENCODER_SOURCE).resolve()``: no ``~`` expansion,
        while the encoder identity expands it (``expanduser().resolve()``)."""
        return False

    def as_json(self) -> dict:
        m = self.cache_module
        return {
            "name": self.name, "date": self.date, "vllm_base": self.vllm_base, "integration_tree": self.tree,
            "online_cache": self.online_cache,
            "cache_module": None if m is None else {
                "blob": m.blob, "fork_commit": m.fork_commit, "xdg_cache_home": m.xdg_cache_home,
                "lock_timeout_s": m.lock_timeout_s, "nonfinite_checks": m.nonfinite_checks,
                "publish_fallback": m.publish_fallback},
            "retry_nonfinite": self.retry_nonfinite, "r7_checkpoints": self.r7_checkpoints,
            "unaligned_shard": f"{self.unaligned_falls_back_to} (K_r % {MXFP8_BLOCK} != 0 fails at start-up)",
        }


def _row(name: str, date: str, base: str, tree: str, docker: str, cache: Optional[str], exl3: Optional[str],
         newer_loader: bool = False) -> ServerRelease:
    return ServerRelease(name, date, base, tree, docker, cache, exl3, retry_nonfinite=newer_loader,
                         r7_checkpoints=newer_loader)


_GG, _II = "gilded-gnosis", "infernal-invocation"
# name, recorded, fork base, integration tree, blackwell-llm-docker commit, cache module, exl3.py blob
RELEASES: tuple[ServerRelease, ...] = (
    _row(f"{_GG}-r5", "2026-07-28", "4247d6765398", "936ed4829ed6b6a34b9052a7a2614333ee3b2623", "1e4d0c7", None, None),
    _row(f"{_GG}-r9", "2026-07-28", "4247d6765398", "34f26c2848e4ec99c4bec80bf8d46bb5f5de367e", "7159452", None, None),
    _row(f"{_GG}-r11", "2026-07-29", "4247d6765398", "9502cc7ee9dbc060899a2b1d30fac6916d3a4a95", "54887a1", None, None),
    _row(f"{_GG}-r12", "2026-07-30", "f978d009fab9", "b46c3aac9421ec6c03b9dfcb5aacc8c1eb11f09b", "a0c4a46", None, None),
    _row(f"{_GG}-r13", "2026-07-30", "f978d009fab9", "69ba80b9e49b5ad6740f8b3d5d0e592213b25959", "97c83c3", None, None),
    _row(f"{_GG}-r14", "2026-07-30", "f978d009fab9", "749050edab1b6664937c52fa1b0be360be632c1e", "2464cc0", None, None),
    _row(f"{_GG}-r15", "2026-07-31", "30038602b713", "0bc48c5943561c56353ce1f8047f81d5e0517237", "87bbf8c", None, None),
    _row(f"{_GG}-r16", "2026-07-31", "30038602b713", "1e9c9c3475fa30ab48d5639f8882f1e93bb552bf", "2fb66ed", None, None),
    _row(f"{_GG}-r17", "2026-08-01", "30038602b713", "db293280d021d32db0552f3f6e4b95abbd9c69a1", "f5ba50b", None,
         "65c6ac2226a1"),
    _row(f"{_GG}-r18", "2026-08-01", "30038602b713", "ab358b11844ab626ca227be455165e336d5f855a", "8384480", None,
         "757cf31dc2d0"),
    _row(f"{_GG}-r19", "2026-08-01", "30038602b713", "6634ec930a746753441d2244bc8c0c7003f0143d", "c12011b", None,
         "1a36f9b018f3"),
    _row(f"{_GG}-r20", "2026-08-02", "30038602b713", "72c35f14b65857110a7434e9243ca18b8cabd032", "8376fe3", "older",
         "175268fe30ca"),
    _row(f"{_GG}-r24", "2026-08-03", "30038602b713", "f5981f14b4d39979bc0d799c020d42002b707257", "e116229", "older",
         "175268fe30ca"),
    _row(f"{_GG}-r25", "2026-08-03", "30038602b713", "f5981f14b4d39979bc0d799c020d42002b707257", "65c88fb", "older",
         "175268fe30ca"),
    _row(f"{_GG}-r26", "2026-08-03", "30038602b713", "f5981f14b4d39979bc0d799c020d42002b707257", "e8dce02", "older",
         "175268fe30ca"),
    _row(f"{_GG}-r27", "2026-08-03", "30038602b713", "966d57c8c1d9f643eaac8aa231c6e1027936ef2a", "73bf74e", "older",
         "175268fe30ca"),
    _row(f"{_GG}-r28", "2026-08-04", "30038602b713", "e1e94267f014eeace6d40337611046d567f6cd83", "a412b04", "older",
         "f7e6fab0f3d3"),
    _row(f"{_GG}-r29", "2026-08-07", "30038602b713", "55db47246a3365ca0a8f908f83a0b0ea06f0856a", "615dba7", "older",
         "b2e698eebc79"),
    _row(f"{_GG}-r30", "2026-08-07", "e2666d9a65f4", "20ed7f98b1ab2c0e6f008a6ad34306fd3b72b33f", "cff4633", "older",
         "b78ae2abc7ef"),
    _row(f"{_GG}-r31", "2026-08-07", "e2666d9a65f4", "fa13d334a2962756f9f7e9b562deb85387359f42", "3d3b94a", "older",
         "36bd8c525b3b"),
    _row(f"{_GG}-r32", "2026-08-09", "e2666d9a65f4", "fa13d334a2962756f9f7e9b562deb85387359f42", "6b3456a", "older",
         "36bd8c525b3b"),
    _row(f"{_GG}-r33", "2026-08-09", "e2666d9a65f4", "fa13d334a2962756f9f7e9b562deb85387359f42", "47ac813", "older",
         "36bd8c525b3b"),
    _row(f"{_GG}-r34", "2026-08-10", "e2666d9a65f4", "4d006a43928cdee01306691a766542c1e9bebb59", "98224d1", "newer",
         "47ae794becad", newer_loader=True),
    _row(f"{_II}-r2", "2026-08-12", "c8d04a543e0e", "344438d742b3cb3f3bd1851a0e9f33f4ebac64e0", "70ea936", None, None),
    _row(f"{_II}-r3", "2026-08-12", "ce5f50f6d01b", "6c50b0af7cc611703119d91970fbf84e4e540dab", "35d0cb7", None, None),
    _row(f"{_II}-r4", "2026-08-12", "ce5f50f6d01b", "3226eb7ff642702908f502a2402f9d083d16511c", "0040f0a", None, None),
    _row(f"{_II}-r5", "2026-08-12", "ce5f50f6d01b", "7ed814e29c18c0b9580a8b09e707d377d10af847", "a1a0d74", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r6", "2026-08-13", "ce5f50f6d01b", "7ed814e29c18c0b9580a8b09e707d377d10af847", "6f9d6d5", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r7", "2026-08-13", "ce5f50f6d01b", "7ed814e29c18c0b9580a8b09e707d377d10af847", "9f0ddc8", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r8", "2026-08-13", "ce5f50f6d01b", "fb60774d00967b251732f9ba12f2c4cc4784d27b", "97fc88a", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r9", "2026-08-13", "ce5f50f6d01b", "88aafbfa10cdb73adc50265a129edc0306541288", "33bd3c5", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r10", "2026-08-13", "ce5f50f6d01b", "a7f04eb1215330d18421c0179e86077be01d9086", "694a55c", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r11", "2026-08-13", "ce5f50f6d01b", "908522a320ecc26582926228c9644af085f5a86c", "e9320de", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r12", "2026-08-14", "ad848fc4141f", "dc2934ef69de7dc4d35c2ec13e088db47ce1d7d7", "1401571", "newer",
         "6dfca71594aa", newer_loader=True),
    _row(f"{_II}-r13", "2026-08-14", "ad848fc4141f", "0af7310227b44f210db77f91749df06d8c40ebf0", "3411649", "newer",
         "0035f64ef437", newer_loader=True),
    _row(f"{_II}-r14", "2026-08-15", "ad848fc4141f", "91e2adf75b271a88bd4d18a081f40fa65e82d469", "945205e", "newer",
         "0035f64ef437", newer_loader=True),
    _row(f"{_II}-r15", "2026-08-15", "ad848fc4141f", "068fc8e7270b92077ba753d002da179c865e444d", "d2f47ca", "newer",
         "0035f64ef437", newer_loader=True),
    _row(f"{_II}-r16", "2026-08-17", "d6e0bb7c8132", "5beffc48f7cd9d4ade076e4b6d1f117ac8e79d4a", "f1d96a7", "newer",
         "8e96942deb60", newer_loader=True),
    _row(f"{_II}-r17", "2026-08-17", "d6e0bb7c8132", "c53cc73dd64992f013842edf53513f604457c402", "076b08c", "newer",
         "4a4baac4ae3b", newer_loader=True),
    _row(f"{_II}-r18", "2026-08-18", "6dc2f516688f", "f0fa1cefc1865d316c2478525f550e7646addc40", "07c6aa5", "newer",
         "4a4baac4ae3b", newer_loader=True),
)
_BY_NAME = {r.name: r for r in RELEASES}
NEWEST = max(RELEASES, key=lambda r: r.date).name  # infernal-invocation-r18

# Image labels that name the release (the fork's Dockerfiles set them): the integration tree is exact; a release
# name label is read when it spells one of ours.
RELEASE_LABELS = ("local-inference.vllm.integration.tree", "local-inference.release.name")
_ALIASES = {"gg": _GG, "gilded-gnosis-v20": _GG, "ii": _II, "infernal-invocation-vllm": _II}


def _canonical(text: str) -> str:
    s = text.strip().lower().replace("_", "-").replace(" ", "-")
    line, sep, rel = s.rpartition("-r")
    if sep and rel.isdigit():
        line = _ALIASES.get(line, line)
        return f"{line}-r{int(rel)}"
    return s


def release(name: str) -> ServerRelease:
    """The row for ``name`` (``infernal-invocation-r18``, ``gilded-gnosis-v20-r33``, ``gg-r33``, ``GG r33``);
    ConfigError listing the names otherwise."""
    row = _BY_NAME.get(_canonical(name))
    if row is None:
        names = ", ".join(f"{line}-r{lo}..r{hi}" for line, lo, hi in _ranges())
        raise ConfigError(f"--server-release {name!r} is not a release exl3tool knows ({names}; "
                          "docs/releases.md lists each)")
    return row


def _ranges() -> list[tuple[str, int, int]]:
    out: dict[str, list[int]] = {}
    for r in RELEASES:
        line, _, n = r.name.rpartition("-r")
        out.setdefault(line, []).append(int(n))
    return [(line, min(ns), max(ns)) for line, ns in out.items()]


def release_from_labels(labels: Optional[Mapping[str, str]]) -> Optional[ServerRelease]:
    """The release an image's labels name (its integration tree, else a release name label), or None."""
    if not labels:
        return None
    tree = (labels.get(RELEASE_LABELS[0]) or "").strip().lower()
    if tree:
        found = [r for r in RELEASES if r.tree == tree]
        if found:
            # a tree shipped by several releases: the same files, the same rules; the latest name
            return max(found, key=lambda r: (r.date, int(r.name.rpartition("-r")[2])))
    name = (labels.get(RELEASE_LABELS[1]) or "").strip()
    return _BY_NAME.get(_canonical(name)) if name else None


def default_release(name: Optional[str] = None, labels: Optional[Mapping[str, str]] = None) -> tuple[ServerRelease, str]:
    """The release a command follows and why: ``--server-release NAME``, else the one an image label names, else
    the newest."""
    if name:
        return release(name), "--server-release"
    found = release_from_labels(labels)
    if found is not None:
        return found, "the image's labels"
    return _BY_NAME[NEWEST], "the newest release (no --server-release, no image label names one)"


# --- the cache root (one function: the library's cache_root and the launch's resolution both call it) ---------

def server_vllm_root(get: Callable[[str], Optional[str]], rel: Optional[ServerRelease] = None) -> tuple[str, str]:
    """vLLM's cache root as the release's cache module computes it, before ``~`` expansion, and the variable that
    gave it (``""``: the built-in default).

    Newer module: ``envs.VLLM_CACHE_ROOT``: ``$VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else
    ``~/.cache/vllm`` (``os.getenv``: a variable set to "" counts as set). Older module: ``$VLLM_CACHE_ROOT``, else
    ``~/.cache/vllm``; ``XDG_CACHE_HOME`` is never read.
    """
    module = (rel or _BY_NAME[NEWEST]).cache_module or CACHE_MODULES["newer"]
    root = get("VLLM_CACHE_ROOT")
    if root is not None:
        return root, "VLLM_CACHE_ROOT"
    if module.xdg_cache_home:
        xdg = get("XDG_CACHE_HOME")
        if xdg is not None:
            return posixpath.join(xdg, "vllm"), "XDG_CACHE_HOME"
    return "~/.cache/vllm", ""


def server_cache_root(get: Callable[[str], Optional[str]], rel: Optional[ServerRelease] = None) -> tuple[str, str]:
    """The online cache root (before ``~`` expansion) and the variable that gave it: a non-blank
    ``VLLM_EXL3_ONLINE_CACHE_DIR`` as given (not stripped), else ``server_vllm_root``/exl3_online."""
    value = get("VLLM_EXL3_ONLINE_CACHE_DIR")
    if value is not None and value.strip():
        return value, "VLLM_EXL3_ONLINE_CACHE_DIR"
    root, var = server_vllm_root(get, rel)
    return posixpath.join(root, "exl3_online"), var


# --- start-up failures -----------------------------------------------------------------------------------------

def unaligned_start_failure(k_r: int, rel: ServerRelease) -> Optional[str]:
    """Why a server of ``rel`` fails at start-up building a 128-unaligned shard of input width ``k_r``, or None."""
    if not rel.online_cache or k_r % MXFP8_BLOCK == 0:
        return None
    return (f"K_r={k_r} is not a multiple of {MXFP8_BLOCK}: {rel.name} builds a 128-unaligned shard with the MXFP8 "
            f"online method, whose create_weights raises \"MXFP8 requires input_size_per_partition ({k_r}) to be "
            f"divisible by {MXFP8_BLOCK}\" (fork issue #311)")


UNALIGNED_FIX = ("add the layer to the overlay's ignore list (it then stays BF16), or serve at a TP size where its K_r is "
                 f"a multiple of {MXFP8_BLOCK}; the fork's fix (PR #312: such a shard stays BF16) is in no release yet")


# --- variables --------------------------------------------------------------------------------------------------

# The variables that reach a key or the entry's path (docs/cache-format.md §1.2).
KEY_VARIABLES = ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION",
                 "VLLM_EXL3_ONLINE_CACHE_MODE", "VLLM_EXL3_ONLINE_CACHE_DIR")
_KERNEL = "kernel dispatch at run time"
_MULTI = "converts stored trellis weights to FP4/FP6 after loading (layer routing), no online encode"
# Variables the fork reads (or its users set) that change no key: name -> (where it is read, what it does).
NO_KEY_VARIABLES: dict[str, tuple[str, str]] = {
    **{f"VLLM_EXL3_{n}": ("exl3.py of every release with the online cache", _KERNEL)
       for n in ("PREFILL_BLOCK_M", "PREFILL_CAPACITY", "PREFILL_TRELLIS", "TRELLIS_MIN_M", "TRELLIS_MAX_M")},
    **{f"VLLM_EXL3_R7_{n}": ("exl3.py of gilded-gnosis-r34 and infernal-invocation-r5..r18", "r7 routed-expert kernels")
       for n in ("A1_MIN_ROWS", "DEBUG", "FUSED", "FUSED_LAYERS", "ROUTE_BLOCK")},
    "VLLM_EXL3_MULTIPRECISION": ("the fork's later exl3.py (268,450 chars)", _MULTI),
    **{f"VLLM_EXL3_{n}": ("the fork's later exl3.py (268,450 chars)", _MULTI)
       for n in ("FP4_LAYERS", "FP6_LAYERS", "FP4_LAYER_RANGE", "FP6_LAYER_RANGE", "FP4_MODULE", "FP6_MODULE")},
    **{f"VLLM_EXL3_{n}": ("the fork's later exl3.py (268,450 chars)", _KERNEL)
       for n in ("GRAPH_DECODE", "B12X_SELFTEST", "PREFILL_RECONSTRUCT_CACHE", "B12X_MIN_M", "B12X_LM_HEAD_MIN_M")},
    "VLLM_EXL3_EMBED_ONLINE_BITS": ("the fork's tests/quantization/test_exl3.py",
                                    "int8/int6 embedding rows quantized at load (Exl3Int8EmbeddingMethod), no cache"),
    **{f"VLLM_EXL3_{n}": ("published launchers and compose files", _KERNEL)
       for n in ("FP4_TRITON_DECODE", "FP4_PER_ROW_GS", "FP4_DRAFT_HEAD", "FP4_BANDED_SELFTEST", "FP8DG_PREFILL_M",
                 "FP8DG_SELFTEST", "FP8DG_CACHE", "PREFILL_FP8", "PREFILL_RECONSTRUCT_M", "PRE_RECONSTRUCT",
                 "PREFILL_CHUNK", "TRELLIS_BLOCK_M", "B12X_ANY_BITS", "B12X_N_RANGE", "B12X_NATIVE_BF16",
                 "B12X_REACHABILITY", "EXT_PATH", "ABI_SHIM")},
}


def variable_note(name: str, value: str) -> Optional[str]:
    """One line for a ``VLLM_EXL3_*`` variable of the server's environment that is not a key variable: known and
    changing no key, or unknown to exl3tool (and then also changing no key: the key reads only KEY_VARIABLES)."""
    if not name.startswith("VLLM_EXL3_") or name in KEY_VARIABLES:
        return None
    known = NO_KEY_VARIABLES.get(name)
    if known is not None:
        return f"{name}={value}: known ({known[0]}: {known[1]}); changes no cache key"
    return (f"{name}={value}: not a variable exl3tool knows; the fork's cache key reads only "
            f"{', '.join(KEY_VARIABLES)}, so it changes no key")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), for 'did you mean' decisions."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]
