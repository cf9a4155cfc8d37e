"""The server's and the container runners' flags as data: what each takes and what it does to a look-up.

The vLLM names are those of the fork's ``vllm serve`` parser (``vllm/engine/arg_utils.py`` EngineArgs,
``vllm/entrypoints/openai/cli_args.py`` FrontendArgs, ``vllm/entrypoints/cli/serve.py``; snapshot ``main``):
every flag there is known, so a flag that is not is reported as unknown rather than guessed at. Booleans take no
value (``--x`` / ``--no-x``); everything else takes one (list-typed flags take several).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerFlag", "SERVER_FLAGS", "VLLM_FLAGS", "VLLM_BOOLEANS", "server_flag", "ContainerFlag",
           "CONTAINER_FLAGS", "container_flag"]

# every long option of the fork's `vllm serve` (without the leading --)
VLLM_FLAGS: frozenset[str] = frozenset("""
    additional-config aggregate-engine-logging all2all-backend allow-credentials allow-deprecated-quantization
    allowed-headers allowed-local-media-path allowed-media-domains allowed-methods allowed-origins api-key
    api-server-count async-scheduling attention-backend attention-config block-size calculate-kv-scales
    chat-template chat-template-content-format code-revision collect-detailed-traces compilation-config config
    config-format convert cp-kv-cache-interleave-size cpu-offload-gb cpu-offload-params cudagraph-capture-sizes
    cudagraph-metrics data-parallel-address data-parallel-backend data-parallel-external-lb
    data-parallel-hybrid-lb data-parallel-rank data-parallel-rpc-port data-parallel-size
    data-parallel-size-local data-parallel-start-rank dbo-decode-token-threshold dbo-prefill-token-threshold
    dcp-comm-backend dcp-kv-cache-interleave-size decode-context-parallel-size default-chat-template-kwargs
    default-mm-loras disable-access-log-for-endpoints disable-cascade-attn disable-chunked-mm-input
    disable-custom-all-reduce disable-fastapi-docs disable-hybrid-kv-cache-manager disable-log-stats
    disable-nccl-for-dp-synchronization disable-sliding-window disable-uvicorn-access-log
    distributed-executor-backend distributed-timeout-seconds download-dir dtype ec-transfer-config
    enable-auto-tool-choice enable-chunked-prefill enable-dbo enable-elastic-ep enable-ep-weight-filter
    enable-eplb enable-expert-parallel enable-flash-late-interaction enable-flashinfer-autotune
    enable-force-include-usage enable-layerwise-nvtx-tracing enable-log-deltas enable-log-outputs
    enable-log-requests enable-logging-iteration-details enable-lora enable-mamba-cache-stochastic-rounding
    enable-mfu-metrics enable-mixed-moe-lora-format enable-mm-embeds enable-mm-processor-stats
    enable-offline-docs enable-prefix-caching enable-prompt-embeds enable-prompt-tokens-details
    enable-request-id-headers enable-return-routed-experts enable-server-load-tracking enable-sleep-mode
    enable-ssl-refresh enable-tokenizer-info-endpoint enable-tower-connector-lora enforce-eager eplb-config
    exclude-tools-when-tool-choice-none expert-placement-strategy fail-on-environ-validation fingerprint-mode
    fingerprint-value fully-sharded-loras gdn-prefill-backend generation-config gpu-memory-utilization grpc
    h11-max-header-count h11-max-incomplete-event-size headless hf-config-path hf-overrides hf-token host
    ignore-patterns interleave-mm-strings io-processor-plugin ir-op-priority kernel-config kv-cache-dtype
    kv-cache-dtype-skip-layers kv-cache-memory-bytes kv-cache-metrics kv-cache-metrics-sample kv-events-config
    kv-offloading-backend kv-offloading-size kv-sharing-fast-prefill kv-transfer-config language-model-only
    limit-mm-per-prompt linear-backend load-format log-config-file log-error-stack logits-processors
    logprobs-mode long-prefill-token-threshold lora-dtype lora-modules lora-target-modules mamba-backend
    mamba-block-size mamba-cache-dtype mamba-cache-mode mamba-cache-philox-rounds mamba-config
    mamba-ssm-cache-dtype master-addr master-port max-cpu-loras max-cudagraph-capture-size max-log-len
    max-logprobs max-long-partial-prefills max-lora-rank max-loras max-model-len max-num-batched-tokens
    max-num-partial-prefills max-num-seqs max-parallel-loading-workers media-io-kwargs middleware
    mm-encoder-attn-backend mm-encoder-attn-dtype mm-encoder-fp8-scale-path mm-encoder-fp8-scale-save-margin
    mm-encoder-fp8-scale-save-path mm-encoder-only mm-encoder-tp-mode mm-processor-cache-gb
    mm-processor-cache-type mm-processor-kwargs mm-shm-cache-max-object-size-mb mm-tensor-ipc model model-impl
    model-loader-extra-config model-weights moe-backend nnodes node-rank num-gpu-blocks-override numa-bind
    numa-bind-cpus numa-bind-nodes offload-backend offload-group-size offload-num-in-group offload-params
    offload-prefetch-step optimization-level otlp-traces-endpoint override-attention-dtype
    override-generation-config performance-mode pipeline-parallel-size pooler-config port
    prefill-context-parallel-size prefix-caching-hash-algo profiler-config pt-load-map-location quantization
    quantization-config ray-workers-use-nsight reasoning-config reasoning-parser reasoning-parser-plugin
    renderer-num-workers response-role return-tokens-as-token-ids revision root-path runner
    safetensors-load-strategy safetensors-prefetch-block-size safetensors-prefetch-num-threads scheduler-cls
    scheduler-reserve-full-isl scheduling-policy seed served-model-name show-hidden-metrics-for-version
    shutdown-timeout skip-mm-profiling skip-tokenizer-init spec-method spec-model spec-tokens
    specialize-active-lora speculative-config ssl-ca-certs ssl-cert-reqs ssl-certfile ssl-ciphers ssl-keyfile
    stream-interval structured-outputs-config tensor-parallel-size tokenizer tokenizer-mode tokenizer-revision
    tokens-only tool-call-parser tool-parser-plugin tool-server trust-remote-code trust-request-chat-template
    ubatch-size uds use-fp64-gumbel use-tqdm-on-load uvicorn-log-level video-pruning-rate weight-transfer-config
    worker-cls worker-extension-cls
""".split())

# the ones that take no value (bool fields: argparse BooleanOptionalAction, plus store_true flags)
VLLM_BOOLEANS: frozenset[str] = frozenset("""
    aggregate-engine-logging allow-credentials allow-deprecated-quantization async-scheduling
    calculate-kv-scales cudagraph-metrics data-parallel-external-lb data-parallel-hybrid-lb disable-cascade-attn
    disable-chunked-mm-input disable-custom-all-reduce disable-fastapi-docs disable-hybrid-kv-cache-manager
    disable-log-stats disable-nccl-for-dp-synchronization disable-sliding-window disable-uvicorn-access-log
    enable-auto-tool-choice enable-chunked-prefill enable-dbo enable-elastic-ep enable-ep-weight-filter
    enable-eplb enable-expert-parallel enable-flash-late-interaction enable-flashinfer-autotune
    enable-force-include-usage enable-layerwise-nvtx-tracing enable-log-deltas enable-log-outputs
    enable-log-requests enable-logging-iteration-details enable-lora enable-mamba-cache-stochastic-rounding
    enable-mfu-metrics enable-mixed-moe-lora-format enable-mm-embeds enable-mm-processor-stats
    enable-offline-docs enable-prefix-caching enable-prompt-embeds enable-prompt-tokens-details
    enable-request-id-headers enable-return-routed-experts enable-server-load-tracking enable-sleep-mode
    enable-ssl-refresh enable-tokenizer-info-endpoint enable-tower-connector-lora enforce-eager
    exclude-tools-when-tool-choice-none fail-on-environ-validation fully-sharded-loras grpc headless
    interleave-mm-strings kv-cache-metrics kv-sharing-fast-prefill language-model-only log-error-stack
    mm-encoder-only numa-bind ray-workers-use-nsight return-tokens-as-token-ids scheduler-reserve-full-isl
    skip-mm-profiling skip-tokenizer-init specialize-active-lora tokens-only trust-remote-code
    trust-request-chat-template use-fp64-gumbel use-tqdm-on-load
""".split())


@dataclass(frozen=True)
class ServerFlag:
    """A vLLM flag that matters to a look-up, or that exl3tool has to refuse; ``why`` is said to the user."""

    name: str  # the long name without --
    aliases: tuple[str, ...] = ()  # short spellings (-tp)
    setting: str = ""  # the setting it fills (model, revision, tp_size, ...); "" = noted only
    refused: bool = False  # always a usage error (changes the layer set in a way exl3tool cannot reproduce)
    why: str = ""


SERVER_FLAGS: tuple[ServerFlag, ...] = (
    ServerFlag("model", setting="model"),
    ServerFlag("revision", setting="revision"),
    ServerFlag("tensor-parallel-size", ("-tp",), setting="tp_size"),
    ServerFlag("dtype", setting="dtype"),
    ServerFlag("quantization", ("-q",), setting="quantization"),
    ServerFlag("quantization-config", setting="quantization_config"),
    ServerFlag("download-dir", setting="download_dir",
               why="where the server keeps Hub downloads; a Hub model's identity does not depend on it"),
    ServerFlag("language-model-only", setting="language_model_only"),
    ServerFlag("limit-mm-per-prompt", setting="limit_mm_per_prompt"),
    ServerFlag("pipeline-parallel-size", ("-pp",), setting="pipeline_parallel_size"),
    ServerFlag("data-parallel-size", ("-dp",), setting="data_parallel_size"),
    ServerFlag("enable-expert-parallel", ("-ep",), setting="enable_expert_parallel"),
    ServerFlag("all2all-backend", setting="all2all_backend"),
    ServerFlag("prefill-context-parallel-size", ("-pcp",), setting="prefill_context_parallel_size"),
    ServerFlag("decode-context-parallel-size", ("-dcp",),
               why="decode context parallelism shares the KV cache inside the TP group; every linear is sharded "
                   "as at its TP size"),
    ServerFlag("speculative-config", ("-sc",), setting="speculative_config"),
    ServerFlag("spec-method", setting="speculative_config"),
    ServerFlag("spec-model", setting="speculative_config"),
    ServerFlag("spec-tokens", setting="speculative_config"),
    ServerFlag("load-format", setting="load_format"),
    ServerFlag("model-impl", setting="model_impl"),
    ServerFlag("runner", setting="runner"),
    ServerFlag("convert", setting="convert"),
    ServerFlag("trust-remote-code",
               why="the layers come from the fork's own model classes (config.architectures), not remote code"),
    ServerFlag("hf-overrides", setting="hf_overrides",
               why="applied to config.json as the fork applies it before the layers are built"),
    ServerFlag("hf-config-path", refused=True,
               why="the server reads the model's config from another place, so the layer set exl3tool plans from "
                   "config.json may not be the server's: copy that config into the checkpoint"),
    ServerFlag("model-weights", refused=True,
               why="the server loads weights from another location than the model path it hashes; exl3tool "
                   "cannot tell which files it sees"),
    ServerFlag("mm-encoder-only", refused=True,
               why="the server builds only the multimodal encoder, which exl3tool does not plan"),
    ServerFlag("config", why=""),  # read by the parser itself (a YAML file of flags)
)

_BY_NAME = {f.name: f for f in SERVER_FLAGS}
_BY_ALIAS = {a: f for f in SERVER_FLAGS for a in f.aliases}
# the fork's other short spellings: -O<n> is handled by the parser; these take a value
VLLM_SHORT: dict[str, str] = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size", "-q": "quantization",
                              "-dp": "data-parallel-size", "-ep": "enable-expert-parallel", "-sc": "speculative-config",
                              "-dcp": "decode-context-parallel-size", "-pcp": "prefill-context-parallel-size",
                              "-cc": "compilation-config", "-ac": "attention-config", "-asc": "api-server-count",
                              "-n": "nnodes", "-r": "node-rank", "-dpa": "data-parallel-address",
                              "-dpb": "data-parallel-backend", "-dpe": "data-parallel-external-lb",
                              "-dph": "data-parallel-hybrid-lb", "-dpl": "data-parallel-size-local",
                              "-dpn": "data-parallel-rank", "-dpp": "data-parallel-rpc-port",
                              "-dpr": "data-parallel-start-rank"}


def server_flag(name: str) -> ServerFlag | None:
    """The table row for a long name (without --) or a short alias, or None when it does not matter."""
    return _BY_NAME.get(name) or _BY_ALIAS.get(name)


@dataclass(frozen=True)
class ContainerFlag:
    """One option of `docker run` / `podman run`: its spellings, whether it takes a value, what it gives us."""

    names: tuple[str, ...]
    takes_value: bool
    role: str = ""  # env | env_file | volume | mount | entrypoint | workdir | env_host | rootfs | "" (ignored)


_C = ContainerFlag
CONTAINER_FLAGS: tuple[ContainerFlag, ...] = (
    _C(("-e", "--env"), True, "env"), _C(("--env-file",), True, "env_file"),
    _C(("-v", "--volume"), True, "volume"), _C(("--mount",), True, "mount"),
    _C(("--entrypoint",), True, "entrypoint"), _C(("-w", "--workdir"), True, "workdir"),
    _C(("--env-host",), False, "env_host"),  # podman: the container gets the whole host environment
    _C(("--rootfs",), False, "rootfs"),  # podman: the "image" is a root folder here
    # options that take a value and change nothing here
    *(_C((n,), True) for n in (
        "-a", "--attach", "--add-host", "--annotation", "--blkio-weight", "--blkio-weight-device", "--cap-add",
        "--cap-drop", "--cgroup-parent", "--cgroupns", "--cidfile", "--cpu-period", "--cpu-quota",
        "--cpu-rt-period", "--cpu-rt-runtime", "--cpu-shares", "-c", "--cpus", "--cpuset-cpus", "--cpuset-mems",
        "--device", "--device-cgroup-rule", "--device-read-bps", "--device-read-iops", "--device-write-bps",
        "--device-write-iops", "--dns", "--dns-opt", "--dns-option", "--dns-search", "--domainname", "--expose",
        "--gpus", "--group-add", "--health-cmd", "--health-interval", "--health-retries", "--health-start-period",
        "--health-start-interval", "--health-timeout", "-h", "--hostname", "--ip", "--ip6", "--ipc", "--isolation",
        "--kernel-memory", "-l", "--label", "--label-file", "--link", "--link-local-ip", "--log-driver",
        "--log-opt", "--mac-address", "-m", "--memory", "--memory-reservation", "--memory-swap",
        "--memory-swappiness", "--name", "--network", "--net", "--network-alias", "--net-alias", "--oom-score-adj",
        "--pid", "--pids-limit", "--platform", "-p", "--publish", "--pull", "--restart", "--runtime",
        "--security-opt", "--shm-size", "--stop-signal", "--stop-timeout", "--storage-opt", "--sysctl", "--tmpfs",
        "--ulimit", "-u", "--user", "--userns", "--uts", "--volume-driver", "--volumes-from",
        # podman
        "--arch", "--authfile", "--cgroup-conf", "--cgroups", "--chrootdirs", "--conmon-pidfile", "--decryption-key",
        "--gidmap", "--hooks-dir", "--hostuser", "--image-volume", "--init-path", "--log-level", "--os",
        "--passwd-entry", "--personality", "--pod", "--pod-id-file", "--preserve-fd", "--rdt-class",
        "--requires", "--sdnotify", "--seccomp-policy", "--secret", "--subgidname", "--subuidname", "--systemd",
        "--timeout", "--tz", "--uidmap", "--umask", "--unsetenv", "--variant", "--device-cgroup-rule",
        "--cert-dir", "--creds", "--mount-propagation", "--retry", "--retry-delay", "--shm-size-systemd", "--env-merge",
    )),
    # options without a value
    *(_C((n,), False) for n in (
        "-d", "--detach", "-i", "--interactive", "-t", "--tty", "--rm", "--init", "--privileged", "-P",
        "--publish-all", "--read-only", "--sig-proxy", "--oom-kill-disable", "--no-healthcheck", "-q", "--quiet",
        "--disable-content-trust", "--help", "--use-api-socket",
        # podman
        "--http-proxy", "--no-hosts", "--passwd", "--read-only-tmpfs", "--replace", "--rmi",
        "--tls-verify", "--unsetenv-all",
    )),
)
_CONTAINER = {n: f for f in CONTAINER_FLAGS for n in f.names}


def container_flag(name: str) -> ContainerFlag | None:
    """The row for one `docker run` / `podman run` spelling (``--env``, ``-e``), or None when unknown."""
    return _CONTAINER.get(name)
