#!/bin/bash
#| modeled_on: malaiwah/qwen38-27b-exl3 patches/run-qwen38-27b.sh (a patched exl3.py mounted over the pinned r34 image's, `-v HOST/vllm-exl3-multiprecision.py:/opt/venv/lib/python3.12/site-packages/vllm/model_executor/layers/quantization/exl3.py:ro`, checked first with `sha256sum -c`, a PROFILE case of `: "${VAR:=...}"` defaults, `podman run -d --replace`) and tools/frontier_clean_incumbent_callback.sh (`--entrypoint /opt/venv/bin/vllm IMAGE serve /models/...`); the mounted file keeps a shard neither 128-aligned nor a multiple of 32 wide BF16 (PR #312's rule), so the server starts: exl3tool took r34's labels and said "this server will not start" (fork issue #311)
#| model: llama-odd
#| starts: true
#| server:
#|   model: /models/odd-llama
#|   model_resolved: /models/odd-llama
#|   tp: 2
#|   bits: 6
#|   overlay: '{"linear":{"weight":"mxfp8"},"ignore":["lm_head"]}'
#|   encoder_root: /opt/exllamav3-python/exllamav3
#|   encoder_revision: 704aefd743b390af4bd0fb429d1906f9b964c7d8
#|   cache_root: /cache/jit/exl3-online
#| mounts: {/models: "@MODELS@", /cache/jit: "@JIT@"}
#| expect: planned
set -euo pipefail
IMAGE="${IMAGE:-docker.io/voipmonitor/vllm:gilded-gnosis-v20-vllm4d006a4-b12xcd3ce19-fi1ac6942-cu132-20260810-r34}"
NAME="${NAME:-odd-llama}"
EXL3_PATCH_HOST="${EXL3_PATCH_HOST:-@DIR@/patches/exl3.py}"
EXL3_PATCH_SHA256="95d9cff0492c5f68901886de38cb5c5e5ec7719fb75fb281e2b097278000e849"
EXL3_PATCH_CTR="/opt/venv/lib/python3.12/site-packages/vllm/model_executor/layers/quantization/exl3.py"
[ -f "${EXL3_PATCH_HOST}" ] || { echo "EXL3 patch is missing: ${EXL3_PATCH_HOST}" >&2; exit 4; }
printf '%s  %s\n' "${EXL3_PATCH_SHA256}" "${EXL3_PATCH_HOST}" | sha256sum -c - >/dev/null
QUANTIZATION_CONFIG='{"linear":{"weight":"mxfp8"},"ignore":["lm_head"]}'
PROFILE="${PROFILE:-fidelity}"
case "${PROFILE}" in
  fidelity) : "${VLLM_EXL3_FP4_LAYERS:=,}"; : "${MAX_MODEL_LEN:=32768}" ;;
  throughput) : "${VLLM_EXL3_FP4_LAYERS:=mlp.gate_up_proj,mlp.down_proj}"; : "${MAX_MODEL_LEN:=65536}" ;;
  *) echo "unknown PROFILE=${PROFILE}" >&2; exit 4 ;;
esac
podman rm -f "${NAME}" >/dev/null 2>&1 || true
podman run -d --replace --name "${NAME}" \
  --device nvidia.com/gpu=all --ipc=host --network host \
  -e HF_HUB_OFFLINE=1 -e XDG_CACHE_HOME=/cache/jit \
  -e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/jit/exl3-online \
  -e VLLM_EXL3_MULTIPRECISION=1 -e VLLM_EXL3_FP4_LAYERS="${VLLM_EXL3_FP4_LAYERS}" \
  -v "@MODELS@:/models:ro" -v "@JIT@:/cache/jit" \
  -v "${EXL3_PATCH_HOST}:${EXL3_PATCH_CTR}:ro" \
  --entrypoint /opt/venv/bin/vllm \
  "${IMAGE}" serve /models/odd-llama --served-model-name odd --tensor-parallel-size 2 \
  --quantization exl3 --quantization-config "${QUANTIZATION_CONFIG}" --max-model-len "${MAX_MODEL_LEN}"
