#!/bin/bash
# the serving image's entrypoint (our own words): every setting from the container's environment
set -e
MODEL="${MODEL_PATH:-/root/.cache/huggingface/models--example--tiny-llama}"
exec python3 -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" \
  --served-model-name "${SERVED_MODEL_NAME:-tiny}" \
  --port "${PORT:-8000}" \
  --quantization "${QUANT_METHOD:-exl3}" \
  --quantization-config "${QUANTIZATION_CONFIG}" \
  --tensor-parallel-size "${TP:-1}" \
  --max-model-len "${MAX_MODEL_LEN:-32768}" \
  --kv-cache-dtype "${KV_CACHE_DTYPE:-fp8_e4m3}" \
  $([ -n "${SPEC_CONFIG}" ] && echo "--speculative-config ${SPEC_CONFIG}")
