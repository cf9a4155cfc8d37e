#!/usr/bin/env bash
# a site launcher with its own options (our own words)
set -eu
model="" tp=1 bits=6 extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --bits) bits="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 64 ;;
  esac
done
[ -n "$model" ] || { echo "--model is required" >&2; exit 64; }
set -a
. ./site.env
set +a
export VLLM_EXL3_ONLINE_TRELLIS_BITS="$bits"
exec python3 -m vllm.entrypoints.openai.api_server --model "$model" --tensor-parallel-size "$tp" \
  --quantization-config "$QUANT_CONFIG" "${extra[@]}"
