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
rules of fork commit ``3cd48af0``). Releases before r20 (and Infernal Invocation r2 to r4) ship no online cache,
nor do the Kimi-K3 and Jovian Judgement lines: their servers encode no layer to EXL3 online and load only what the
checkpoint stores (``exl3tool hydrate`` writes that). Key, identities and entry format are the same in every version.

One run follows one release, resolved once (``resolve_release``: ``--server-release``, else an image's fork modules,
else its labels) into a ``ReleaseChoice`` that the request carries; what could not be told (an unknown label, a
patched image) is named in it. Where nothing names the release it is not determined: the rules an answer or a write
depends on are compared across every release it could be (``rule_splits``, ``operations.release_rules``), and no
command answers, writes or picks a cache root where they differ.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Union

from exl3tool.errors import ConfigError

__all__ = [
    "CacheModule", "ServerRelease", "RELEASES", "CACHE_MODULES", "NEWEST", "newest", "release", "release_from_labels",
    "ReleaseChoice", "ForkModules", "resolve_release", "no_online_encoding", "PATCHES",
    "git_blob", "exl3_unaligned_rule", "KEY_VARIABLES", "NO_KEY_VARIABLES", "variable_note", "server_vllm_root",
    "server_cache_root", "RELEASE_LABELS", "MXFP8_BLOCK", "unaligned_start_failure", "unaligned_start_unknown",
    "UNALIGNED_FIX", "R7_SCHEMA", "GLM53_SCOPE", "edit_distance", "ONLINE", "RuleSplit", "rule_splits",
    "release_span", "lock_waits", "release_depends", "release_same_note", "NAME_IT",
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


# What a 128-unaligned shard whose K_r is not a multiple of 32 does at start-up, by the exl3.py a server runs:
# "mxfp8": built with the MXFP8 online method, whose create_weights raises (fork issue #311; every release's exl3.py);
# "bf16": kept unquantized, the server starts (fork PR #312, in images that replace exl3.py, e.g. gg-r34-patched);
# "unknown": exl3tool could not read which exl3.py the server runs (a patched image known by its labels only).
UNALIGNED_RULES = ("mxfp8", "bf16", "unknown")


@dataclass(frozen=True)
class ServerRelease:
    """One release of the fork's images, as its composition records it."""

    name: str  # "gilded-gnosis-r33", "infernal-invocation-r18"
    date: str  # when blackwell-llm-docker recorded it
    vllm_base: str  # the fork's base commit (12 hex)
    tree: str  # the integration tree (label local-inference.vllm.integration.tree)
    docker_commit: str  # the blackwell-llm-docker commit that recorded it
    cache: Optional[str]  # key of CACHE_MODULES; None: no online EXL3 cache (and no online encode) in this release
    exl3_blob: Optional[str]  # exl3.py as the release ships it (12 hex), None when the patch leaves it as the base's
    retry_nonfinite: bool  # _load_online_encoding_with_retry: one more encode after a non-finite one
    r7_checkpoints: bool  # Exl3Config takes r7_routed_experts checkpoints whatever their quant_method
    unaligned: str = "mxfp8"  # one of UNALIGNED_RULES
    patched: str = ""  # what differs from the row it was derived from (a patched image's exl3.py), "" for a row

    @property
    def cache_module(self) -> Optional[CacheModule]:
        return CACHE_MODULES[self.cache] if self.cache else None

    @property
    def online_cache(self) -> bool:
        """Whether this release encodes layers online and looks them up in the cache (the two came together)."""
        return self.cache is not None

    @property
    def line(self) -> str:
        """The release line: gilded-gnosis, infernal-invocation, kimi-k3, jovian-judgement."""
        return next((p for p in _LINES if self.name.startswith(p + "-")), self.name.rpartition("-r")[0])

    @property
    def unaligned_falls_back_to(self) -> str:
        """What a 128-unaligned shard is built with: MXFP8 online, which refuses K_r % 32 != 0 at start-up (fork
        issue #311) in every release's exl3.py; PR #312 (keeping such a shard BF16) is in none of the table's rows,
        only in images that replace exl3.py (``unaligned == "bf16"``)."""
        return {"mxfp8": "mxfp8", "bf16": "mxfp8, else bf16", "unknown": "unknown"}[self.unaligned]

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
            "unaligned_shard": None if not self.online_cache else {
                "mxfp8": f"mxfp8 (K_r % {MXFP8_BLOCK} != 0 fails at start-up: fork issue #311)",
                "bf16": f"mxfp8, or BF16 when K_r % {MXFP8_BLOCK} != 0 (the server starts: fork PR #312)",
                "unknown": "not known (exl3tool did not read the server's exl3.py)"}[self.unaligned],
            "patched": self.patched or None,
        }


def _row(name: str, date: str, base: str, tree: str, docker: str, cache: Optional[str], exl3: Optional[str],
         newer_loader: bool = False) -> ServerRelease:
    return ServerRelease(name, date, base, tree, docker, cache, exl3, retry_nonfinite=newer_loader,
                         r7_checkpoints=newer_loader)


_GG, _II, _KK, _JJ = "gilded-gnosis", "infernal-invocation", "kimi-k3", "jovian-judgement"
_LINES = (_GG, _II, _KK, _JJ)
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
    # Kimi-K3: compositions on dev/infernal-invocation bases (whose exl3.py, blob bcb58fb8, has no online method:
    # every Infernal Invocation patch adds it and exl3_online_cache.py as new files) and on dev/heraldic-harbinger;
    # no patch adds either (docs/releases.md). exl3.py: the base's, or hh-runtime's rename of its kernel package.
    _row(f"{_KK}-hh-runtime-r1", "2026-08-11", "6389c45f4d17", "6ecf5dbe724774b170fca82a366ab48ea9264830", "75b075f",
         None, "39932667b1da"),
    _row(f"{_KK}-production-lmcache-r1", "2026-08-16", "ad848fc4141f", "eed8e5e2a94cfee651fa34a0f026b849b2377438",
         "499bac5", None, None),
    _row(f"{_KK}-qsrt-ii-r3", "2026-08-16", "ad848fc4141f", "f21a391de0a1b127c93ac718fd7d1818f025317b", "2c469ba",
         None, None),
    _row(f"{_KK}-production-lmcache-r2", "2026-08-17", "abeaacfe9ace", "60141a0a953e787bcecc6b69d5d15a1af1a50eee",
         "90997a7", None, None),
    _row(f"{_KK}-production-lmcache-r3", "2026-08-17", "d6e0bb7c8132", "f66693106798399b8a6e3d89b7fe2588ba5f15dd",
         "8d2851f", None, None),
    _row(f"{_KK}-production-lmcache-r5", "2026-08-17", "d6e0bb7c8132", "e567fdcd8de761260d99e8142fb7eff31d473ff2",
         "f5d10c3", None, None),
    _row(f"{_KK}-production-lmcache-r6", "2026-08-17", "d6e0bb7c8132", "df13924cb12279f8144019800fad7e27640acaea",
         "f7180f3", None, None),
    _row(f"{_KK}-production-lmcache-mamba-dcp-protocol", "2026-08-18", "d6e0bb7c8132",
         "f67105dd807842a3c1f1fc07931e1e4dadc0b68c", "de9f8dd", None, None),
    _row(f"{_KK}-production-lmcache-vision-warmup", "2026-08-18", "6dc2f516688f",
         "227d058dc47cf61699af4c2b087834ac8dfdec95", "c793832", None, None),
    _row(f"{_KK}-production-lmcache-sampler-overlay", "2026-08-19", "6dc2f516688f",
         "12776c0df15ca4087b636c43004b5bc1fde61434", "f9cc49c", None, None),
    # Jovian Judgement (dev/jovian-judgement, a line apart from dev/infernal-invocation): the DeepSeek-V4-Flash
    # compositions cherry-pick fork PRs 628, 630 and 634, none of which touches a file under
    # vllm/model_executor/layers/quantization/ (docs/releases.md); the r5 image is tagged 20260904.
    _row(f"{_JJ}-ds4-r3", "2026-09-04", "a50ebee1d246", "d6f9e777bdf23304ace1ce3b311935390009a149", "50043a9",
         None, None),
    _row(f"{_JJ}-ds4-r4", "2026-09-04", "a50ebee1d246", "075caea7bf032731baeca337a9ee882ab8967c20", "572c134",
         None, None),
    _row(f"{_JJ}-ds4-r5", "2026-09-04", "a50ebee1d246", "08e1c7de14c4754facf53d26f0888f649a478ff4", "7e7e9e4",
         None, None),
)
_BY_NAME = {r.name: r for r in RELEASES}
ONLINE = tuple(r for r in RELEASES if r.online_cache)  # the releases that encode online (and look entries up)
# the row whose rules fill a request when nothing names its release: only where every release that encodes online
# gives the same (``ReleaseChoice.could_be``, ``rule_splits``), never as the server's release
NEWEST = max((r for r in RELEASES if r.online_cache), key=lambda r: r.date).name  # infernal-invocation-r18


def newest() -> ServerRelease:
    """The newest release of the table that encodes online (``NEWEST``): the rules a request holds when neither
    ``--server-release`` nor the server's image names one, applied only where every release that encodes online
    gives the same (``ReleaseChoice.could_be``)."""
    return _BY_NAME[NEWEST]

# Image labels that name the release (the fork's Dockerfiles set them): the integration tree is exact; a release
# name label is read when it spells one of ours.
RELEASE_LABELS = ("local-inference.vllm.integration.tree", "local-inference.release.name")
_ALIASES = {"gg": _GG, "gilded-gnosis-v20": _GG, "ii": _II, "infernal-invocation-vllm": _II}

# Patches an image may carry over a release, named after the fork PR: ``--server-release gilded-gnosis-r34+pr312``
# for an image that replaces r34's exl3.py with PR #312's (malaiwah/qwen38-27b-exl3's gg-r34-patched).
PATCHES: dict[str, dict[str, str]] = {
    "pr312": {"unaligned": "bf16",
              "what": "fork PR #312's exl3.py: a shard neither Trellis nor MXFP8 can hold stays BF16 (the server starts)"},
}


def _canonical(text: str) -> str:
    s = text.strip().lower().replace("_", "-").replace(" ", "-")
    line, sep, rel = s.rpartition("-r")
    if sep and rel.isdigit():
        line = _ALIASES.get(line, line)
        return f"{line}-r{int(rel)}"
    return s


def _patch(text: str) -> Optional[str]:
    """The PATCHES key ``text`` spells (``pr312``, ``PR #312``, ``pr-312``), or None."""
    key = re.sub(r"[\s#_-]", "", text.lower())
    return key if key in PATCHES else None


def release(name: str) -> ServerRelease:
    """The row for ``name`` (``infernal-invocation-r18``, ``gilded-gnosis-v20-r33``, ``gg-r33``, ``GG r33``, a patched
    image's ``gilded-gnosis-r34+pr312``); ConfigError listing the names otherwise."""
    base, plus, patch = name.partition("+")
    row = _BY_NAME.get(_canonical(base))
    if row is None:
        raise ConfigError(f"--server-release {_shown(name)!r} is not a release exl3tool knows ({_known_names()}; "
                          "docs/releases.md lists each)")
    if plus:
        key = _patch(patch)
        if key is None:
            raise ConfigError(f"--server-release {name!r}: +{patch} is not a patch exl3tool knows (+"
                              f"{', +'.join(PATCHES)}; docs/releases.md)")
        if not row.online_cache:
            raise ConfigError(f"--server-release {name!r}: {row.name} encodes nothing online, so +{key} changes "
                              "nothing; name the release alone")
        row = replace(row, name=f"{row.name}+{key}", unaligned=PATCHES[key]["unaligned"], patched=PATCHES[key]["what"])
    return row


def _known_names() -> str:
    out: dict[str, list[str]] = {}
    for r in RELEASES:
        out.setdefault(r.line, []).append(r.name[len(r.line) + 1:])
    parts = []
    for line, tails in out.items():
        numbered = [int(t[1:]) for t in tails if re.fullmatch(r"r\d+", t)]
        if len(numbered) == len(tails):
            parts.append(f"{line}-r{min(numbered)}..r{max(numbered)}")
        else:
            parts.append(f"{line}-* ({len(tails)} compositions)")
    return ", ".join(parts)


def _latest(rows: list[ServerRelease]) -> ServerRelease:
    """Of rows sharing one tree (the same files, the same rules), the latest name."""
    return max(rows, key=lambda r: (r.date, int(r.name.rpartition("-r")[2]) if r.name.rpartition("-r")[2].isdigit()
                                    else 0))


def release_from_labels(labels: Optional[Mapping[str, str]]) -> Optional[ServerRelease]:
    """The release an image's labels name exactly (its integration tree, else a release name label), or None."""
    return _label_release(labels or {})[0]


def _shown(text: str) -> str:
    """A label's or name's value for a one-line message: as is when short and printable, else escaped and cut."""
    return text if text.isprintable() and len(text) <= 80 else repr(text[:80]) + ("..." if len(text) > 80 else "")


def _label_release(labels: Mapping[str, str]) -> tuple[Optional[ServerRelease], str, list[str]]:
    """(the row the labels name, which label named it, what the release labels say that exl3tool cannot place)."""
    tree = (labels.get(RELEASE_LABELS[0]) or "").strip().lower()
    name = (labels.get(RELEASE_LABELS[1]) or "").strip()
    unknown: list[str] = []
    by_tree = [r for r in RELEASES if tree and r.tree == tree]
    if by_tree:
        return _latest(by_tree), f"label {RELEASE_LABELS[0]}={tree[:12]}", []
    if tree:
        unknown.append(f"the image's label {RELEASE_LABELS[0]}={_shown(tree[:40])} is the integration tree of no "
                       "release exl3tool knows")
    if name:
        try:
            row = release(name)
        except ConfigError:
            unknown.append(f"the image's label {RELEASE_LABELS[1]}={_shown(name)} names a release exl3tool does not "
                           "know")
        else:
            return row, f"label {RELEASE_LABELS[1]}={_shown(name)}", unknown  # a tree beside it that no row has stays named
    return None, "", unknown


def _patched_tag(image: str) -> str:
    """The tag of an image reference whose name says it is patched (``localhost/vllm:gg-r34-patched``), or ""."""
    ref = image.rsplit("/", 1)[-1].partition("@")[0]
    tag = ref.partition(":")[2] or ref
    return tag if re.search(r"patch", tag, re.IGNORECASE) else ""


@dataclass(frozen=True)
class ForkModules:
    """The fork's modules as a server's image holds them (``launch.forkfiles.read_fork_modules`` reads them): the
    cache module and ``exl3.py``, by git blob, and ``exl3.py``'s text for the rules that no blob of the table names."""

    where: str  # the vllm package folder they were read from
    cache_blob: Optional[str]  # git blob (40 hex) of exl3_online_cache.py; None: the image has none
    exl3_blob: Optional[str]  # git blob of exl3.py; None: the image's vLLM has no EXL3 support
    exl3_text: str = field(default="", repr=False, compare=False)


def git_blob(data: bytes) -> str:
    """The git blob id of a file's bytes (what a patch's ``index`` line and ``git hash-object`` name)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_PR312 = re.compile(r"self\.fallback\s*=\s*UnquantizedLinearMethod\(\)")
_PR311 = re.compile(r"self\.fallback\s*=\s*Mxfp8OnlineLinearMethod\(\)")


def exl3_unaligned_rule(text: str) -> Optional[str]:
    """What an ``exl3.py`` does with a shard that is neither 128-aligned nor a multiple of 32 wide, read from its
    ``Exl3OnlineLinearMethod.create_weights``: "bf16" (PR #312: ``self.fallback = UnquantizedLinearMethod()``),
    "mxfp8" (the releases': the MXFP8 fallback, unconditional, which raises), "unknown" (neither form), None when
    the file has no online method at all (it encodes nothing online)."""
    if "class Exl3OnlineLinearMethod" not in text:
        return None
    if _PR312.search(text):
        return "bf16"
    return "mxfp8" if _PR311.search(text) else "unknown"


@dataclass(frozen=True)
class ReleaseChoice:
    """The release one run follows, where it came from, and what could not be told (each naming the label, name or
    file it did not know and what was assumed): ``cache check`` never answers on an assumption."""

    release: ServerRelease
    source: str  # "--server-release" | "image files" | "image label" | "published-images table" | "default"
    detail: str = ""
    unknown: tuple[str, ...] = ()
    # the releases that could be serving when nothing determined one (the default: every release of the table that
    # encodes online; an unknown label: the same; a patched image not read: its release with and without PR #312);
    # () when the release is determined. ``candidates`` compares the rules an answer depends on across them.
    could_be: tuple[ServerRelease, ...] = field(default=(), repr=False)
    # rules found to differ between them while the launch was read (the cache root of its server's environment)
    splits: tuple["RuleSplit", ...] = ()

    @property
    def name(self) -> str:
        return self.release.name

    @property
    def determined(self) -> bool:
        """Whether one release is known to be the server's (named, or read from its image's files or labels)."""
        return not self.could_be

    @property
    def candidates(self) -> tuple[ServerRelease, ...]:
        """The releases whose rules could be the server's: the one applied when determined, else ``could_be``."""
        return self.could_be or (self.release,)

    @property
    def assumed(self) -> bool:
        """Whether the rules applied rest on an assumption (an unknown label, a patched image not read)."""
        return bool(self.unknown)

    def describe(self) -> str:
        """One line: the release and where it came from."""
        if self.source == "default":
            return ("server release not named (no --server-release, and neither the image's labels nor its files name "
                    f"one): every release that encodes online is compared ({release_span(self.candidates)}), and "
                    f"{self.release.name}'s rules apply only where they all give the same")
        how = self.source + (f" ({self.detail})" if self.detail else "")
        return f"server release {self.release.name}: {how}" + (f"; {self.release.patched}" if self.release.patched
                                                                 else "")

    def as_json(self) -> dict:
        return {"name": self.release.name, "source": self.source, "detail": self.detail or None,
                "assumed": self.assumed, "unknown": list(self.unknown), "determined": self.determined,
                "could_be": _names([r for r in self.could_be]), "differs": [x.as_json() for x in self.splits],
                "rules": self.release.as_json()}


def resolve_release(name: Union[str, ReleaseChoice, None] = None, labels: Optional[Mapping[str, str]] = None, *,
                    image: str = "", table_release: str = "", modules: Optional[ForkModules] = None) -> ReleaseChoice:
    """The release a run follows, resolved once: ``--server-release NAME`` (``name``; an unknown one is a
    ConfigError), else the fork modules the server's image holds (``modules``), else the release its labels name
    (``labels``; ``table_release``: the one exl3tool's published-images table names for it), else none: not
    determined, compared across every release that encodes online (``could_be``; the newest's rules fill the
    request where they all agree). A label that names no known release, or an image whose name says it is patched
    and whose files were not read, is an assumption named in ``ReleaseChoice.unknown``.
    """
    if isinstance(name, ReleaseChoice):
        return name
    if name is not None:  # "" too: a name was given, and it names nothing
        return ReleaseChoice(release(name), "--server-release", name)
    row, detail, unknown = _label_release(labels or {})
    source = "image label"
    if row is None and table_release:
        try:
            row, detail, source = release(table_release), table_release, "published-images table"
        except ConfigError:
            unknown.append(f"exl3tool's published-images table names the image's release {_shown(table_release)!r}, "
                           "which its release table lacks")
    if modules is not None:  # the files decide: a label exl3tool cannot place changes none of their rules
        choice = _from_modules(modules, row, [])
        said = "; ".join(u for u in unknown)
        return replace(choice, detail=choice.detail + (f" (labels: {said})" if said else ""))
    if row is not None and row.online_cache and _patched_tag(image):
        unknown.append(f"the image {image} carries {row.name}'s labels but its name says it is patched: exl3tool did "
                       f"not read its exl3.py, so it cannot tell whether a shard neither 128-aligned nor a multiple of "
                       f"{MXFP8_BLOCK} wide fails the start ({row.name}: fork issue #311) or stays BF16 (fork PR "
                       "#312); give its files (--image-root DIR) or name it (--server-release "
                       f"{row.name}+pr312, or {row.name})")
        could_be = (row, release(f"{row.name}+pr312")) if len(unknown) == 1 else None  # only #311 vs #312 unknown
        row = replace(row, unaligned="unknown", patched=f"patched image {image}: its exl3.py was not read")
        return _assumed(ReleaseChoice(row, source, detail), unknown, could_be)
    if row is not None:
        return _assumed(ReleaseChoice(row, source, detail), unknown)
    return _assumed(ReleaseChoice(newest(), "default", could_be=ONLINE), unknown)


def _assumed(choice: ReleaseChoice, unknown: list[str],
             could_be: Optional[tuple[ServerRelease, ...]] = None) -> ReleaseChoice:
    """``choice`` with each unknown sentence ending in what was assumed; the releases it could then be are
    ``could_be``, by default every release of the table that encodes online."""
    if not unknown:
        return choice
    said = tuple(u if "assumed" in u else f"{u}; assumed {choice.release.name}'s rules" for u in unknown)
    return replace(choice, unknown=said, could_be=could_be or choice.could_be or ONLINE)


def _from_modules(mods: ForkModules, named: Optional[ServerRelease], unknown: list[str]) -> ReleaseChoice:
    """The release whose rules the image's own modules follow: a row when its blobs are a row's (the labelled one
    first), else the labelled (or newest) row with the rules its files give."""
    base = named or newest()
    where = mods.where
    if mods.exl3_blob is None:
        rel = replace(base, cache=None, patched=f"no exl3.py under {where}: this vLLM has no EXL3 support")
        return _assumed(ReleaseChoice(rel, "image files", where), unknown)
    rule = exl3_unaligned_rule(mods.exl3_text)
    cache: Optional[str] = None
    if rule is not None:  # the online method, which the cache module serves
        if mods.cache_blob is None:
            unknown.append(f"{where}: exl3.py encodes online but the image holds no exl3_online_cache.py")
            cache = base.cache or "newer"
        else:
            cache = next((k for k, m in CACHE_MODULES.items() if m.blob == mods.cache_blob), None)
            if cache is None:
                unknown.append(f"{where}: exl3_online_cache.py is blob {mods.cache_blob[:12]}, no version exl3tool "
                               f"knows ({', '.join(m.blob[:8] for m in CACHE_MODULES.values())})")
                cache = base.cache or "newer"
    rows = [r for r in RELEASES if r.cache == cache and r.exl3_blob and mods.exl3_blob.startswith(r.exl3_blob)]
    files = (f"{where}: exl3.py {mods.exl3_blob[:12]}" + (f", exl3_online_cache.py {mods.cache_blob[:12]}"
                                                         if mods.cache_blob else ", no exl3_online_cache.py"))
    if rows:
        row = named if named in rows else _latest(rows)
        return _assumed(ReleaseChoice(row, "image files", files), unknown)
    if rule is None and not base.online_cache:
        return _assumed(ReleaseChoice(base, "image files", files), unknown)  # no online encoding, as labelled
    only_rule = rule == "unknown" and not unknown  # the cache module is known: only #311 vs #312 is not
    if rule == "unknown":
        unknown.append(f"{where}: exl3.py (blob {mods.exl3_blob[:12]}) is no release's, and exl3tool cannot read from "
                       f"it what a shard neither 128-aligned nor a multiple of {MXFP8_BLOCK} wide does")
    text = mods.exl3_text
    rel = replace(
        base, cache=cache, unaligned=rule or "mxfp8", retry_nonfinite="_load_online_encoding_with_retry" in text,
        r7_checkpoints=R7_SCHEMA in text,
        name=(f"{base.name}+pr312" if rule == "bf16" and cache == base.cache and named is not None else
              base.name if named is not None else f"{base.name} (as the image's files read)"),
        patched=(f"its exl3.py (blob {mods.exl3_blob[:12]}) is no release's: "
                 + ("it encodes nothing online" if rule is None else
                    {"bf16": "PR #312's rule, a shard neither Trellis nor MXFP8 can hold stays BF16",
                     "mxfp8": "the releases' rule for unaligned shards (fork issue #311)",
                     "unknown": "its rule for unaligned shards is not known"}[rule])))
    could_be = (replace(rel, unaligned="mxfp8"), replace(rel, unaligned="bf16")) if only_rule else None
    return _assumed(ReleaseChoice(rel, "image files", files), unknown, could_be)


def no_online_encoding(rel: ServerRelease) -> str:
    """Why a server of ``rel`` looks nothing up (one sentence, the fix included): it encodes nothing online. A
    release derived from an image's own files (``patched``) is said as those files, never as the row it was
    compared with (an r34 label on an image whose exl3.py has no online method: r34 encodes online, the image not)."""
    if rel.patched:
        base = rel.name.split(" (", 1)[0]
        return (f"the image's own files encode no layer to EXL3 online: {rel.patched}; the server runs those files, "
                f"not {base}'s, whatever its labels say, so it loads only the EXL3 layers the checkpoint stores and "
                "looks nothing up; to serve its BF16 layers as EXL3 there, store them: exl3tool hydrate MODEL OUT")
    return (f"{rel.name} encodes no layer to EXL3 online (no exl3_online_cache.py nor online Trellis method: they "
            "came with gilded-gnosis-r20 and infernal-invocation-r5, and the Kimi-K3 and Jovian Judgement lines ship "
            "neither): the server loads only the EXL3 layers the checkpoint stores and looks nothing up; to serve "
            "its BF16 layers as EXL3 there, store them: exl3tool hydrate MODEL OUT")


# --- the cache root (one function: the library's cache_root and the launch's resolution both call it) ---------

def server_vllm_root(get: Callable[[str], Optional[str]], rel: ServerRelease) -> tuple[str, str]:
    """vLLM's cache root as the release's cache module computes it, before ``~`` expansion, and the variable that
    gave it (``""``: the built-in default).

    Newer module: ``envs.VLLM_CACHE_ROOT``: ``$VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else
    ``~/.cache/vllm`` (``os.getenv``: a variable set to "" counts as set). Older module: ``$VLLM_CACHE_ROOT``, else
    ``~/.cache/vllm``; ``XDG_CACHE_HOME`` is never read.
    """
    module = rel.cache_module or CACHE_MODULES["newer"]  # a release without the cache: vLLM's own root rule
    root = get("VLLM_CACHE_ROOT")
    if root is not None:
        return root, "VLLM_CACHE_ROOT"
    if module.xdg_cache_home:
        xdg = get("XDG_CACHE_HOME")
        if xdg is not None:
            return posixpath.join(xdg, "vllm"), "XDG_CACHE_HOME"
    return "~/.cache/vllm", ""


def server_cache_root(get: Callable[[str], Optional[str]], rel: ServerRelease) -> tuple[str, str]:
    """The online cache root (before ``~`` expansion) and the variable that gave it: a non-blank
    ``VLLM_EXL3_ONLINE_CACHE_DIR`` as given (not stripped), else ``server_vllm_root``/exl3_online."""
    value = get("VLLM_EXL3_ONLINE_CACHE_DIR")
    if value is not None and value.strip():
        return value, "VLLM_EXL3_ONLINE_CACHE_DIR"
    root, var = server_vllm_root(get, rel)
    return posixpath.join(root, "exl3_online"), var


# --- start-up failures -----------------------------------------------------------------------------------------

def unaligned_start_failure(k_r: int, rel: ServerRelease) -> Optional[str]:
    """Why a server of ``rel`` fails at start-up building a 128-unaligned shard of input width ``k_r``, or None (it
    starts: K_r is a multiple of 32, or its exl3.py keeps such a shard BF16, or it encodes nothing online)."""
    if not rel.online_cache or k_r % MXFP8_BLOCK == 0 or rel.unaligned != "mxfp8":
        return None
    return (f"K_r={k_r} is not a multiple of {MXFP8_BLOCK}: {rel.name} builds a 128-unaligned shard with the MXFP8 "
            f"online method, whose create_weights raises \"MXFP8 requires input_size_per_partition ({k_r}) to be "
            f"divisible by {MXFP8_BLOCK}\" (fork issue #311)")


def unaligned_start_unknown(k_r: int, rel: ServerRelease) -> Optional[str]:
    """Why exl3tool cannot tell whether a server of ``rel`` starts with a 128-unaligned shard of width ``k_r`` (its
    exl3.py was not read: a patched image), or None when it can."""
    if not rel.online_cache or k_r % MXFP8_BLOCK == 0 or rel.unaligned != "unknown":
        return None
    return (f"K_r={k_r} is not a multiple of {MXFP8_BLOCK}: the releases' exl3.py fails the start on it (fork issue "
            f"#311), PR #312's keeps it BF16, and exl3tool did not read which one this server runs ({rel.patched})")


UNALIGNED_FIX = ("add the layer to the overlay's ignore list (it then stays BF16), or serve at a TP size where its K_r is "
                 f"a multiple of {MXFP8_BLOCK}; the fork's fix (PR #312: such a shard stays BF16) is in no release, "
                 "only in images that replace exl3.py (--server-release NAME+pr312)")


# --- when the release is not determined: the rules an answer depends on -----------------------------------------

@dataclass(frozen=True)
class RuleSplit:
    """One rule whose outcome for this request differs between the releases that could be serving it."""

    rule: str  # "cache_root" | "r7_checkpoints" | "unaligned_start" | "nonfinite_entries"
    text: str  # what each group of releases does, naming them

    def as_json(self) -> dict:
        return {"rule": self.rule, "text": self.text}


def _names(rows) -> list[str]:
    return list(dict.fromkeys(r.name for r in rows))


def release_span(rows) -> str:
    """Releases named compactly, in the table's order: ``gilded-gnosis-r20..r33, infernal-invocation-r5..r18``."""
    by_line: dict[str, list[str]] = {}
    for name in _names(rows):
        line = next((p for p in _LINES if name.startswith(p + "-")), "")
        by_line.setdefault(line, []).append(name)
    parts = []
    for line, names in by_line.items():
        parts.append(names[0] if len(names) == 1 or not line else f"{names[0]}..{names[-1][len(line) + 1:]}")
    return ", ".join(parts)


def _split(rows, value: Callable[[ServerRelease], object]) -> list[tuple[object, list[ServerRelease]]]:
    groups: dict[object, list[ServerRelease]] = {}
    for r in rows:
        groups.setdefault(value(r), []).append(r)
    return list(groups.items())


def rule_splits(candidates, *, root_env: Optional[Callable[[str], Optional[str]]] = None, r7: bool = False,
                unaligned: tuple[int, ...] = (), nonfinite: bool = False) -> tuple[RuleSplit, ...]:
    """The rules whose outcome for one request differs between ``candidates`` (``ReleaseChoice.candidates``), each
    decided from the request's own release-dependent inputs, never from a plan per release:

    * ``root_env``: the server's environment, when its cache root comes from the release's rule (no
      VLLM_EXL3_ONLINE_CACHE_DIR, no --cache-dir): ``server_cache_root`` per release (XDG_CACHE_HOME is read by the
      newer cache module only);
    * ``r7``: the checkpoint's r7_routed_experts block is read differently by releases that take r7 checkpoints
      and those that do not (``checkpoint.routing.r7_reading_differs``);
    * ``unaligned``: the K_r of the 128-unaligned shards the server builds (``unaligned_start_failure``: fork issue
      #311 or PR #312);
    * ``nonfinite``: an entry present is invalid only for its non-finite data (the newer cache module refuses and
      re-encodes it; the older one loads it as it is).
    """
    rows = list(candidates)
    if len(rows) < 2:
        return ()
    out: list[RuleSplit] = []
    if root_env is not None:
        groups = _split(rows, lambda r: server_cache_root(root_env, r)[0])
        if len(groups) > 1:
            out.append(RuleSplit("cache_root", "the cache root is " + ", but ".join(
                f"{root} for {release_span(g)}" for root, g in groups) + " (XDG_CACHE_HOME is read by the newer "
                "cache module only)"))
    if r7:
        groups = _split(rows, lambda r: r.r7_checkpoints)
        if len(groups) > 1:
            yes = [r for r in rows if r.r7_checkpoints]
            no = [r for r in rows if not r.r7_checkpoints]
            out.append(RuleSplit("r7_checkpoints", f"the checkpoint's r7_routed_experts block ({R7_SCHEMA}) is read "
                                 f"as EXL3 whatever its quant_method by {release_span(yes)}, and not by "
                                 f"{release_span(no)}"))
    for k_r in sorted({k for k in unaligned if k % MXFP8_BLOCK}):
        groups = _split(rows, lambda r: r.unaligned if r.online_cache else "")
        if len(groups) > 1:
            what = {"mxfp8": "fails the start (fork issue #311)", "bf16": "stays BF16 and the server starts (PR #312)",
                    "unknown": "is not known", "": "is never encoded online"}
            out.append(RuleSplit("unaligned_start", f"a shard of K_r={k_r} (neither 128-aligned nor a multiple of "
                                 f"{MXFP8_BLOCK}) " + ", but ".join(f"{what[rule]} under {release_span(g)}"
                                                                     for rule, g in groups)))
            break
    if nonfinite:
        groups = _split(rows, lambda r: bool(r.cache_module and r.cache_module.nonfinite_checks))
        if len(groups) > 1:
            refuse = [r for r in rows if r.cache_module and r.cache_module.nonfinite_checks]
            load = [r for r in rows if not (r.cache_module and r.cache_module.nonfinite_checks)]
            out.append(RuleSplit("nonfinite_entries", f"an entry with non-finite values is refused and encoded again "
                                 f"at start-up by {release_span(refuse)}, but loaded as it is by {release_span(load)}"))
    return tuple(out)


def lock_waits(candidates) -> str:
    """What the servers of ``candidates`` do on an entry lock a warm holds (one phrase per lock rule)."""
    parts = []
    for timeout, g in _split([r for r in candidates if r.cache_module is not None],
                             lambda r: r.cache_module.lock_timeout_s):
        parts.append(f"{release_span(g)} wait{'s' if len(_names(g)) == 1 else ''} "
                     + ("for as long as the warm holds it (no timeout)" if timeout is None else
                        f"up to {timeout:.0f} s, then encode{'s' if len(_names(g)) == 1 else ''} that layer without "
                        "the cache"))
    return "; ".join(parts)


NAME_IT = "name the release the server runs: --server-release NAME (docs/releases.md)"


def _not_named(choice: ReleaseChoice) -> str:
    if choice.assumed:
        return choice.unknown[0]
    return "the server's release is not named (no --server-release, and neither the image's labels nor its files " \
           "name one)"


def release_depends(choice: ReleaseChoice, splits: tuple[RuleSplit, ...], what: str = "this answer") -> list[str]:
    """One line per rule in ``splits``: the release was not determined and ``what`` depends on it."""
    return [f"{_not_named(choice)}, and {what} depends on it: {s.text}" for s in splits]


def release_same_note(choice: ReleaseChoice, what: str = "gives this answer") -> str:
    """The one note of a run whose release was not determined but whose answer every candidate gives ("" when
    the release is determined)."""
    if choice.determined:
        return ""
    default = choice.source == "default" and not choice.assumed
    whom = (f"every release exl3tool knows that encodes online ({release_span(choice.candidates)})" if default else
            f"every release it could be ({release_span(choice.candidates)})")
    tail = ("; a release that encodes nothing online (Gilded Gnosis up to r19, Infernal Invocation r2 to r4, the "
            "Kimi-K3 and Jovian Judgement lines) makes no look-up: --server-release NAME says which the server runs"
            if default else "")
    lead = "the server's release is not named" if default else "the server's release is assumed"
    return f"{lead}, but {whom} {what}{tail}"


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
