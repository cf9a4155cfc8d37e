#!/bin/bash
#| modeled_on: a GLM launcher script that exports its cache roots under one folder and passes --hf-overrides on every launch (here the override also trims the layer count, so the plan must apply it as the server does)
#| model: llama
#| server:
#|   model: "@MODELS@/tiny-llama"
#|   model_resolved: "@MODELS@/tiny-llama"
#|   tp: 2
#|   bits: 6
#|   overlay: '{"linear":"mxfp8","shared_experts":"mxfp8"}'
#|   encoder_root: /opt/exllamav3
#|   encoder_revision: v0.0.18
#|   cache_root: "@JIT@/runtime/exl3-online"
#|   hf_overrides: {"num_hidden_layers": 1, "use_index_cache": true}
#| expect: all-hit
set -e
cache_root="@JIT@/runtime"
export XDG_CACHE_HOME="${cache_root}/xdg"
export TRITON_CACHE_DIR="${cache_root}/triton"
export VLLM_EXL3_ONLINE_CACHE_DIR="${cache_root}/exl3-online"
export VLLM_EXL3_ONLINE_CACHE_MODE=readwrite
export VLLM_EXL3_ONLINE_TRELLIS_BITS=6
export VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ENCODER_REVISION=v0.0.18

MODEL=@MODELS@/tiny-llama
HF_OVERRIDES='{"num_hidden_layers": 1, "use_index_cache": true}'

exec vllm serve "$MODEL" \
  --served-model-name glm \
  --tensor-parallel-size 2 \
  --quantization-config '{"linear":"mxfp8","shared_experts":"mxfp8"}' \
  --hf-overrides "$HF_OVERRIDES" \
  --max-num-seqs 8
