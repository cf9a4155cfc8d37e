#!/usr/bin/env bash
# One device call: warm + verify a synthetic Llama at TP 1/2 on the GPU, and the MiniLM example
# (warm all 36 dense encoder layers, verify them, embedding agreement via dequantize and the GEMM).
# Needs the MiniLM checkpoint at $EXL3TOOL_MINILM_DIR (default ./.minilm). Reports land in $OUT.
# PART=synthetic or PART=minilm runs one half (default: both).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EXL3TOOL_MINILM_DIR=${EXL3TOOL_MINILM_DIR:-$PWD/.minilm}
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
W=$(mktemp -d)
ENC=(--encoder-root /encoders/exllamav3 --encoder-revision gpu-verify)
[ "${PART:-all}" != minilm ] && python3 -c "
from exl3tool.checkpoint import write_llama_checkpoint
import torch
write_llama_checkpoint('$W/model', hidden=2048, heads=16, kv_heads=4, intermediate=5632, layers=2, dtype=torch.bfloat16, seed=5)
"
PART=${PART:-all}
if [ "$PART" != minilm ]; then
echo "== synthetic warm (hidden 2048, 2 layers, TP 1,2) $(date +%T)"
timeout 240 python3 -m exl3tool cache warm "$W/model" --tp-sizes 1,2 --cache-dir "$W/cache" "${ENC[@]}" --device cuda 2>&1 | tail -4
echo "== synthetic verify TP 2 $(date +%T)"
COLUMNS=200 timeout 120 python3 -m exl3tool verify "$W/model" --tp-size 2 --cache-dir "$W/cache" "${ENC[@]}" --device cuda --report "$OUT/verify_synthetic.md" | tail -25
fi
if [ "$PART" != synthetic ]; then
echo "== MiniLM example $(date +%T)"
timeout 150 python3 benchmarks/quality_minilm.py --device cuda --cache-dir "$W/minilm"
echo "== MiniLM verify $(date +%T)"
COLUMNS=200 timeout 100 python3 -m exl3tool verify "$EXL3TOOL_MINILM_DIR" --layers 'encoder.layer.*' --dtype float32 --cache-dir "$W/minilm" --encoder-root /encoders/exllamav3 --encoder-revision minilm-example --device cuda --report "$OUT/verify_minilm.md" | tail -8
fi
[ -f "$OUT/verify_synthetic.md" ] && head -30 "$OUT/verify_synthetic.md"
