#!/bin/bash
#| modeled_on: malaiwah/qwen38-27b-exl3 run-qwen38-27b.sh (a Qwen3.8-27B service launcher for the fork's r34 image): it checks that the model snapshot is there, refuses to start while a conflicting container exists (`for other in ...; do if podman inspect "$other" >/dev/null 2>&1; then exit 3; fi; done`), removes its old container, then `podman run -d --replace ... --entrypoint /bin/bash IMAGE -lc "...; exec vllm serve ..."`; the stand-in podman answers as a clean host (no such container), so the guard passes as it would there
#| model: llama
#| server:
#|   model: /models/tiny-llama
#|   model_resolved: /models/tiny-llama
#|   tp: 2
#|   bits: 6
#|   overlay: '{"linear":{"weight":"mxfp8"},"ignore":["re:.*visual\\..*","lm_head"]}'
#|   encoder_root: /opt/exllamav3-python/exllamav3
#|   encoder_revision: 704aefd743b390af4bd0fb429d1906f9b964c7d8
#|   cache_root: /cache/jit/exl3-online
#| mounts: {/models: "@MODELS@", /cache/jit: "@JIT@"}
#| expect: planned
set -euo pipefail
IMAGE="${IMAGE:-quay.io/example/vllm:exl3}"
NAME="${NAME:-tiny-llama}"
MODEL_HOST="${MODEL_HOST:-@MODELS@/tiny-llama}"
[ -f "${MODEL_HOST}/config.json" ] || { echo "model is missing: ${MODEL_HOST}" >&2; exit 4; }
QUANTIZATION_CONFIG='{"linear":{"weight":"mxfp8"},"ignore":["re:.*visual\\..*","lm_head"]}'
# one model owns this GPU: refuse to start beside a conflicting workload
for other in qwen36-27b vllm-sanity llama-gemma-31b; do
  if podman inspect "${other}" >/dev/null 2>&1; then
    echo "refusing to start: conflicting container '${other}' exists" >&2
    exit 3
  fi
done
podman rm -f "${NAME}" >/dev/null 2>&1 || true
podman run -d --replace --name "${NAME}" \
  --device nvidia.com/gpu=all --ipc=host --network host \
  -e HF_HUB_OFFLINE=1 -e XDG_CACHE_HOME=/cache/jit \
  -e QUANTIZATION_CONFIG="${QUANTIZATION_CONFIG}" \
  -e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 \
  -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/jit/exl3-online \
  -e VLLM_EXL3_ONLINE_CACHE_MODE=readwrite \
  -e VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3-python/exllamav3 \
  -e VLLM_EXL3_ENCODER_REVISION=704aefd743b390af4bd0fb429d1906f9b964c7d8 \
  -v "@MODELS@":/models:ro \
  -v "@JIT@":/cache/jit \
  --entrypoint /bin/bash \
  "${IMAGE}" \
  -lc "set -euo pipefail; cd /; \
       exec vllm serve /models/tiny-llama --served-model-name tiny --host 0.0.0.0 --port 8000 \
         --quantization exl3 --tensor-parallel-size 2 \
         --quantization-config \"\${QUANTIZATION_CONFIG}\" --max-model-len 32768"
for _ in 1 2 3; do
  state="$(podman inspect -f '{{.State.Status}}' "${NAME}" 2>/dev/null || echo missing)"
  [ "${state}" = running ] && exit 0
  sleep 1
done
