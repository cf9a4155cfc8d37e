#!/usr/bin/env bash
#| modeled_on: Luke458/qwen38-27b-exl3-rdna4 vllm_plugin/run_exl3_server.sh (`podman run --rm ... $ENV_FWD -e PYTHONPATH=... --entrypoint bash IMAGE -c "cp -r /plugin /tmp/plugin && pip install ... && exec vllm serve /model --served-model-name '$NAME' ... $MM_ARGS $ARGS"`, every VLLM_EXL3_* variable of the caller forwarded as a bare `-e NAME`, the extra serve arguments quoted with printf ' %q'): the container gets the caller's values, and the script's own words are read by bash in the container's view (an answer that was already right, kept as a case)
#| model: llama
#| server:
#|   model: /model
#|   model_resolved: /model
#|   tp: 2
#|   bits: 6
#|   overlay: '{"linear":{"weight":"mxfp8"}}'
#|   encoder_root: /opt/exllamav3
#|   encoder_revision: v0.0.18
#|   cache_root: /root/.cache/vllm/exl3
#| mounts: {/model: "@MODELS@/tiny-llama", /root/.cache/vllm: "@CACHE@"}
#| expect: planned
set -euo pipefail
export VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ONLINE_CACHE_DIR=/root/.cache/vllm/exl3
export VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ENCODER_REVISION=v0.0.18
set -- --tensor-parallel-size 2 --quantization-config '{"linear":{"weight":"mxfp8"}}'
MODEL_DIR=@MODELS@/tiny-llama; NAME=tiny
IMAGE=docker.io/example/vllm-rocm-rdna4:0.28.0-rdna4
ARGS=$(printf ' %q' "$@")
ENV_FWD=""
for v in $(compgen -e | grep '^VLLM_EXL3_'); do ENV_FWD="$ENV_FWD -e $v"; done
MM_ARGS="--mm-processor-kwargs '{\"max_pixels\":1048576}'"
exec podman run --rm --name vllm-exl3 \
  --device /dev/kfd --device /dev/dri --group-add keep-groups \
  --security-opt label=disable --ipc=host -p 127.0.0.1:8000:8000 \
  -v "$MODEL_DIR":/model:ro -v "@CACHE@":/root/.cache/vllm \
  $ENV_FWD -e GPU_MAX_HW_QUEUES=1 \
  --entrypoint bash "$IMAGE" -c "
    cp -r /plugin /tmp/plugin 2>/dev/null; pip install --no-deps -q /tmp/plugin >/dev/null;
    exec vllm serve /model --served-model-name '$NAME' --host 0.0.0.0 --port 8000 \
      --attention-backend TRITON_ATTN $MM_ARGS $ARGS"
