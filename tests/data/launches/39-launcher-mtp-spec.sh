#!/usr/bin/env bash
#| modeled_on: a launcher with an MTP draft and CUDA-graph sizes built in a loop (printf-made JSON for --speculative-config and --compilation-config, (( )) arithmetic, readonly and declare -x, a function with local variables, its own EXIT trap)
#| model: llama
#| server:
#|   model: "@MODELS@/tiny-llama"
#|   model_resolved: "@MODELS@/tiny-llama"
#|   tp: 1
#|   bits: 3
#|   overlay: '{"linear":"mxfp8"}'
#|   encoder_root: /opt/exllamav3
#|   encoder_revision: v0.0.18
#|   cache_root: "@CACHE@"
#| expect: all-hit
set -euo pipefail
trap 'echo "launcher exiting" >&2' EXIT
readonly MTP="${MTP:-3}" GRAPH="${GRAPH:-16}"
declare -x VLLM_EXL3_ONLINE_TRELLIS_BITS=3
export VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ENCODER_REVISION=v0.0.18 VLLM_EXL3_ONLINE_CACHE_DIR=@CACHE@
capture_sizes() {
  local step=$(($1 + 1)) out="" n
  for ((n = step; n <= $2; n += step)); do out+="${out:+,}${n}"; done
  printf '%s' "${out:-$2}"
}
spec="$(printf '{"method":"mtp","num_speculative_tokens":%d}' "${MTP}")"
compile="$(printf '{"cudagraph_mode":"FULL_AND_PIECEWISE","cudagraph_capture_sizes":[%s]}' "$(capture_sizes "${MTP}" "${GRAPH}")")"
vllm serve "@MODELS@/tiny-llama" --quantization-config '{"linear":"mxfp8"}' \
  --speculative-config "${spec}" --compilation-config "${compile}" --max-num-seqs $((GRAPH / 4))
