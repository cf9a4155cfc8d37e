"""The shared input of every command: ``ServerRequest`` (the server's settings) and ``prepare`` (the look-up plan).

``prepare`` opens the checkpoint, resolves both identities and plans; ``exl3tool.operations.warm.warm`` runs the
plan (encode, ``cache warm``), ``cache check``, ``verify`` and ``import --against`` read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from exl3tool.text import plural

if TYPE_CHECKING:
    import torch

    from exl3tool.plan.shards import Shard
    from exl3tool.releases import ReleaseChoice, ServerRelease

# torch, the store and the plan are imported where they are used: the CLI's option tables read SERVING_DTYPES
# from here, and `--help` must not pull in torch.

__all__ = ["SERVING_DTYPES", "DTYPE_SPELLINGS", "serving_dtype_name", "ServerRequest", "nothing_to_do", "prepare", "resolve_device", "serving_torch_dtype"]

# vLLM's --dtype values a server can run with; "auto" is the checkpoint's config dtype, float32 served as bfloat16
SERVING_DTYPES = ("auto", "bfloat16", "float16", "float32")
# every spelling of the server's --dtype (the fork's ModelDType values) -> exl3tool's name: one table for the
# commands' --dtype and a launch's
DTYPE_SPELLINGS = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
                   "float32": "float32", "float": "float32"}


def serving_dtype_name(value: str) -> Optional[str]:
    """``value`` as the server reads its --dtype (any case, ``half`` and ``float`` included), in exl3tool's
    spelling (one of SERVING_DTYPES); None when the server refuses it.

    >>> serving_dtype_name("half"), serving_dtype_name(" BFloat16 "), serving_dtype_name("fp8")
    ('float16', 'bfloat16', None)
    """
    return DTYPE_SPELLINGS.get(value.strip().lower())


def serving_torch_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The torch dtype the server casts weights to for ``--dtype name``; None for ``auto`` (the checkpoint's rule).

    >>> serving_torch_dtype("float16"), serving_torch_dtype("auto")
    (torch.float16, None)
    """
    if name is None or name == "auto":
        return None
    import torch

    if name not in SERVING_DTYPES:
        from exl3tool.errors import ConfigError

        raise ConfigError(f"--dtype {name!r}: must be one of {', '.join(SERVING_DTYPES)} (the server's --dtype)")
    return getattr(torch, name)


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """`auto` is this process's GPU (LOCAL_RANK under torchrun) when CUDA is present, else the CPU.

    A bare `cuda` gets the same index as `auto` would, so the result always names one GPU (which
    ``torch.cuda.set_device`` and the per-device kernel caches need).
    """
    import torch

    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"--device {spec!r} is not a device (use auto, cpu, cuda or cuda:N)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is None:
            return torch.device("cuda", local_rank % count)
        if dev.index >= count:
            raise ValueError(f"--device {spec}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return dev



@dataclass(frozen=True)
class ServerRequest:
    """Everything a warm needs; the CLI fills it from options and environment."""

    model: str
    tp_sizes: tuple[int, ...] = (1,)
    tp_ranks: Optional[tuple[int, ...]] = None
    bits: Optional[int] = None  # None: the server's VLLM_EXL3_ONLINE_TRELLIS_BITS of ``environ``, else 6
    revision: Optional[str] = None
    layers: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    shared_experts: bool = False
    cache_dir: Optional[str] = None
    mode: str = "readwrite"
    device: str = "auto"
    encoder_root: Optional[str] = None
    encoder_revision: Optional[str] = None
    encoder_source: Optional[str] = None  # local copy of the encoder whose .py files are hashed (files mode)
    server_path: Optional[str] = None
    dtype: Optional[str] = None  # one of SERVING_DTYPES; None is "auto"
    file_mode: int = 0o600
    overlap: bool = True
    quantization_config: Optional[str] = None  # the server's --quantization-config JSON (None: the default overlay)
    check_unchecked: bool = False  # re-encode hits without exl3tool's checksum, replace those that differ
    gpu_memory_gib: Optional[float] = None  # GPU memory budget per worker (None: what is free less a margin)
    lock_timeout: Optional[float] = None  # give up on an entry lock held this long (None: wait while its holder lives)
    language_model_only: bool = False  # the server's --language-model-only: its vision tower is not built
    server_view: Optional[Any] = None  # a launch's filesystem map (cache.serverfs.ServerView): server_path resolves there
    hf_overrides: Optional[str] = None  # the server's --hf-overrides JSON, applied to config.json before planning
    shard: Optional[Shard] = None  # ``plan.shards.Shard``: plan (and warm) only this shard's slice (``cache warm --shard``)
    # encoder parity (operations.parity): write under an encoder identity that is not exl3tool's own even when a
    # probe encode differs; the server's image (and its runner) a probe may run the image's encoder in
    trust_encoder_identity: bool = False
    encoder_image: Optional[str] = None
    encoder_image_runner: Optional[str] = None
    # the fork's release whose rules apply, resolved once (``exl3tool.releases.resolve_release``): given as a name
    # (``--server-release``), a ``ReleaseChoice`` (a launch's, with its source), or None (not determined: compared
    # across every release that encodes online, ``operations.release_rules``); always a ``ReleaseChoice`` once built
    server_release: Union[str, "ReleaseChoice", None] = None

    def __post_init__(self) -> None:
        from exl3tool.releases import ReleaseChoice, resolve_release

        if not isinstance(self.server_release, ReleaseChoice):
            object.__setattr__(self, "server_release", resolve_release(self.server_release))

    @property
    def release_choice(self) -> "ReleaseChoice":
        """The release this run follows, where it came from, and what was assumed (``exl3tool.releases``)."""
        return self.server_release  # type: ignore[return-value]  # resolved in __post_init__

    @property
    def release(self) -> "ServerRelease":
        """The release whose rules apply (cache root, lock, r7 routing, start-up failures)."""
        return self.release_choice.release

    def cache_root(self, environ: Optional[dict] = None) -> Path:
        """Where the server's cache is, here: ``cache_dir`` (``--cache-dir``, or a launch's root as seen from here),
        else the root the server computes from ``environ`` (None: this process's) by the release's rule
        (``exl3tool.cache.settings.cache_root``). The one rule of every command, warm and the cache commands. With
        the release not determined this is the newest's root: a command takes it through
        ``operations.release_rules.cache_root``, which refuses it where the releases it could be differ."""
        from exl3tool.cache.settings import cache_root

        return Path(self.cache_dir).expanduser() if self.cache_dir else cache_root(environ, self.release)


WarmRequest = ServerRequest  # its name before 0.2 (CHANGELOG "Renamed"), kept for one release

def prepare(request: ServerRequest, *, environ: Optional[dict] = None, check_hits: bool = True):
    """Open the checkpoint, resolve both identities, plan the layers and look every job up.

    Returns ``(checkpoint, plan, store)``. Raises ConfigError/InputError with a one-line fix. ``check_hits``
    hashes present entries against our checksum (see ``build_plan``).

    Args:
        request: the server's settings and what to plan (model, TP sizes, layers, cache, identities' inputs).
        environ: the environment the identities and the cache root are read from (None: ``os.environ``).
        check_hits: hash present entries against exl3tool's checksum (False: a hit is any valid entry).

    Returns:
        ``(checkpoint, plan, store)``: the opened ``Checkpoint``, the looked-up ``LookupPlan`` and its ``CacheStore``.
    """
    from exl3tool.cache import server_identities
    from exl3tool.checkpoint import open_checkpoint, plan_layers, resolve_overlay, tensors_to_fetch
    from exl3tool.errors import ConfigError

    from exl3tool.cache.settings import server_bits

    resolve_device(request.device)  # a bad --device fails before any work, --dry-run included
    request = replace(request, bits=server_bits(request.bits, environ))
    from exl3tool.releases import no_online_encoding

    release = request.release
    if not release.online_cache and request.mode != "off":  # mode off looks nothing up (hydrate's plan)
        raise ConfigError(f"nothing to plan: {no_online_encoding(release)} (check --server-release; "
                          "docs/releases.md)")
    serving_torch_dtype(request.dtype)  # a ConfigError for anything the server cannot run with
    if any(t < 1 for t in request.tp_sizes):
        raise ConfigError(f"TP sizes must be positive, got {list(request.tp_sizes)}")
    overlay = resolve_overlay(request.quantization_config, shared_experts=request.shared_experts)
    layers, exclude = list(request.layers) or None, list(request.exclude) or None
    from exl3tool.checkpoint.overrides import parse_hf_overrides

    hub_cache = None
    if request.server_view is not None:  # a launch's server reads a repo id from its own Hub cache (a volume)
        from exl3tool.cache.hub import server_hub_cache

        hub_cache = server_hub_cache(environ, request.server_view)
    checkpoint = open_checkpoint(  # a Hub download fetches only the shards holding planned tensors
        request.model, revision=request.revision, hf_overrides=parse_hf_overrides(request.hf_overrides),
        select=lambda root, config, names: tensors_to_fetch(root, config, names, overlay, layers, exclude,
                                                            release=release),
        hub_cache=hub_cache)
    mode = request.mode
    identity_warnings: tuple[str, ...] = ()
    if mode == "off":
        model_id = encoder_id = "cache-disabled"
    else:  # the same function as `exl3tool identity`, so both always agree
        ids = server_identities(
            request.model, revision=request.revision, server_path=request.server_path,
            encoder_root=request.encoder_root, encoder_revision=request.encoder_revision,
            encoder_source=request.encoder_source, hub_commit=checkpoint.commit_hash, environ=environ,
            view=request.server_view,
        )
        model_id, encoder_id, identity_warnings = ids.model.identity, ids.encoder.identity, ids.warnings
    layer_plan = plan_layers(checkpoint, overlay=overlay, layers=layers, exclude=exclude,
                             language_model_only=request.language_model_only, release=release)
    for tp in request.tp_sizes:  # vLLM cannot split the model there: the cause, before whatever the plan holds
        problem = layer_plan.shard_problem(tp)
        if problem:
            raise ConfigError(problem)
    if not layer_plan.layers:
        raise ConfigError(nothing_to_do(checkpoint.model, layer_plan, request.exclude))
    root_dir = request.cache_root(environ)
    from exl3tool.cache.store import CacheStore
    from exl3tool.plan.plan import build_plan

    store = CacheStore(root_dir, mode, file_mode=request.file_mode)
    plan = build_plan(checkpoint, layer_plan, tp_sizes=request.tp_sizes, bits=request.bits,
                      model_identity=model_id, encoder_identity=encoder_id, store=store, tp_ranks=request.tp_ranks,
                      check_hits=check_hits, shard=request.shard)
    if request.tp_sizes and plan.all_skipped:  # no TP size: a plan of layers only (import --against)
        tps = ",".join(map(str, plan.tp_sizes))
        jobs = plan.shard.plan_jobs if plan.shard is not None else len(plan.jobs)
        raise ConfigError(f"{checkpoint.model}: nothing to do at TP {tps}: the server keeps every planned layer MXFP8 "
                          f"there ({plural(jobs, 'rank job')}, rank-local sizes not 128-aligned) and looks no "
                          "entry up; try another TP size")
    if identity_warnings:
        plan = replace(plan, identity_warnings=identity_warnings)
    if mode != "off":
        plan = replace(plan, identities=ids)
    return checkpoint, plan, store


_WHY = {"stored_exl3": "stored as EXL3 in the checkpoint", "no_spec": "without a spec in the overlay",
        "ignored": "ignored by the overlay", "excluded": "left out by --exclude",
        "not_modelled": "encoded by the server but not modelled"}


def nothing_to_do(model: str, layer_plan, exclude: tuple[str, ...] = ()) -> str:
    """The one message for a plan without layers: a usage error (exit 2), whatever emptied it, with the counts.

    The rule everywhere: inputs that select no work (no layer planned, no entry to export) exit 2; work that is
    already done (every entry a hit, nothing to prune) exits 0.
    """
    counts: dict[str, int] = {}
    for e in layer_plan.excluded:
        counts[e.reason] = counts.get(e.reason, 0) + 1
    why = ", ".join(f"{n} {_WHY.get(r, r)}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if exclude and set(counts) <= {"excluded", "stored_exl3", "not_modelled"} and counts.get("excluded"):
        return (f"{model}: --exclude {' '.join(repr(g) for g in exclude)} leaves no layer to encode; nothing to do "
                f"({why}; narrow the globs)")
    return (f"{model}: nothing to do: the server encodes no layer of this checkpoint online with this plan"
            + (f" ({why})" if why else "") + "; check --quantization-config (its ignore list), --layers and --exclude")
