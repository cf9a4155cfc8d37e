#!/usr/bin/env bash
# the environment wrapper: the venv's tools first, then the first-boot launcher with its inputs
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export VLLM_EXL3_NGRAM_TABLE="${VLLM_EXL3_NGRAM_TABLE:-disk}"
exec env MODEL_DIR="${MODEL_DIR:-@MODELS@/tiny-llama}" GPU_MEM_UTIL="${GPU_MEM_UTIL:-0.9}" \
  MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}" PORT="${PORT:-8002}" bash "$ROOT/firstboot.sh"
