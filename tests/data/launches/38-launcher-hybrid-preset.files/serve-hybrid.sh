#!/usr/bin/env bash
# the preset for one published checkpoint (our own words): its exact overlay, then the generic preset
set -euo pipefail
export MODEL="${MODEL:-@MODELS@/tiny-llama}"
export TP="${TP:-2}"
export QUANTIZATION="${QUANTIZATION:-exl3}"
export ONLINE_QUANT="${ONLINE_QUANT:-custom}"
export VLLM_EXL3_ONLINE_TRELLIS_BITS=6
if [[ -z "${QUANTIZATION_CONFIG_JSON:-}" ]]; then
  QUANTIZATION_CONFIG_JSON='{"linear":{"weight":"mxfp8"},"ignore":["re:.*\\.o_proj$","lm_head"]}'
fi
export QUANTIZATION_CONFIG_JSON
exec /usr/local/bin/serve-preset.sh "$@"
