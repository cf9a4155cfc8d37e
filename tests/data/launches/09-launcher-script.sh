#!/usr/bin/env bash
#| modeled_on: a deployment repository's run.sh - defaults with ${VAR:-default}, exported server variables, cd into the deployment folder, exec with the flags in a variable
#| model: llama
#| server:
#|   model: ./models/tiny-llama
#|   model_resolved: "@MODELS@/tiny-llama"
#|   cwd: "@DIR@"
#|   tp: 2
#|   bits: 5
#|   overlay: '{"linear":{"weight":"mxfp8"}}'
#|   encoder_root: /opt/exllamav3
#|   encoder_revision: v0.0.18
#|   cache_root: "@CACHE@/exl3"
#| expect: all-hit
set -euo pipefail

# everything can be overridden from the caller's environment
DEPLOY_DIR="${DEPLOY_DIR:-@DIR@}"
MODEL="${MODEL:-./models/tiny-llama}"
TP_SIZE="${TP_SIZE:-2}"
PORT="${PORT:-8000}"
QUANT_CONFIG='{"linear":{"weight":"mxfp8"}}'
EXTRA_ARGS="--max-model-len 32768 --gpu-memory-utilization 0.92 --port ${PORT}"

export VLLM_EXL3_ONLINE_TRELLIS_BITS="${TRELLIS_BITS:-5}"
export VLLM_EXL3_ONLINE_CACHE_DIR="@CACHE@/exl3"
export VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3
export VLLM_EXL3_ENCODER_REVISION=v0.0.18

echo "starting ${MODEL} at TP ${TP_SIZE} on port ${PORT}"
cd "${DEPLOY_DIR}"
exec vllm serve "${MODEL}" \
    --tensor-parallel-size "${TP_SIZE}" \
    --quantization-config "${QUANT_CONFIG}" \
    ${EXTRA_ARGS}
