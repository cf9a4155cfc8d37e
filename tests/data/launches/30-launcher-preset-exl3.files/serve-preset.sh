#!/usr/bin/env bash
# A serving preset in the shape of the fork's published launchers (our own words): defaults that the caller's
# environment overrides, validation with die(), an ONLINE_QUANT switch that picks the overlay and exports the
# online-Trellis variables, arrays of optional flags, cache folders made with mkdir -p, a DRY_RUN=1 mode that
# prints KEY=%q lines and the Command: line, then exec.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=serve-runtime-env.sh
source "${here}/serve-runtime-env.sh"

die() {
  echo "ERROR: $*" >&2
  exit 2
}

MODEL="${MODEL:-example-org/NotDownloaded}"
MODEL_REVISION="${MODEL_REVISION:-}"
PORT="${PORT:-8000}"
TP="${TP:-8}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-16}"
GRAPH="${GRAPH:-$((MAX_NUM_SEQS * 2))}"
MTP="${MTP:-0}"
ONLINE_QUANT="${ONLINE_QUANT:-}"
QUANTIZATION="${QUANTIZATION:-exl3}"
QUANTIZATION_CONFIG_JSON="${QUANTIZATION_CONFIG_JSON:-}"
if [[ "${TP}" == "6" ]]; then
  MAX_MODEL_LEN="${MAX_MODEL_LEN:-131072}"
else
  MAX_MODEL_LEN="${MAX_MODEL_LEN:-262144}"
fi

[[ "${TP}" =~ ^[1-9][0-9]*$ ]] || die "TP must be a positive integer"
[[ "${MTP}" =~ ^[0-9]+$ ]] || die "MTP must be a token count"

case "${ONLINE_QUANT:-none}" in
  none|off|0)
    ONLINE_QUANT=none
    ;;
  mxfp8)
    [[ -n "${QUANTIZATION_CONFIG_JSON}" ]] || QUANTIZATION_CONFIG_JSON='{"linear":{"weight":"mxfp8"}}'
    ;;
  exl3-b6|trellis-b6)
    [[ "${QUANTIZATION}" == "exl3" ]] || die "ONLINE_QUANT=${ONLINE_QUANT} needs QUANTIZATION=exl3"
    if [[ -n "${VLLM_EXL3_ONLINE_TRELLIS_BITS:-}" && "${VLLM_EXL3_ONLINE_TRELLIS_BITS}" != "6" ]]; then
      die "ONLINE_QUANT=${ONLINE_QUANT} needs VLLM_EXL3_ONLINE_TRELLIS_BITS=6"
    fi
    export VLLM_EXL3_ONLINE_TRELLIS_BITS=6
    export VLLM_EXL3_ENCODER_SOURCE="${VLLM_EXL3_ENCODER_SOURCE:-/opt/exllamav3-python/exllamav3}"
    export VLLM_EXL3_ONLINE_CACHE_DIR="${VLLM_EXL3_ONLINE_CACHE_DIR:-/cache/exl3-online}"
    export VLLM_EXL3_ONLINE_CACHE_MODE="${VLLM_EXL3_ONLINE_CACHE_MODE:-readwrite}"
    if [[ -z "${QUANTIZATION_CONFIG_JSON}" ]]; then
      QUANTIZATION_CONFIG_JSON='{"linear":{"weight":"mxfp8"},"shared_experts":{"weight":"mxfp8"},"ignore":["re:.*\\.q_a_proj$","lm_head"]}'
    fi
    ;;
  custom)
    [[ -n "${QUANTIZATION_CONFIG_JSON}" ]] || die "ONLINE_QUANT=custom needs QUANTIZATION_CONFIG_JSON"
    ;;
  *)
    die "ONLINE_QUANT must be none, mxfp8, exl3-b6 or custom"
    ;;
esac

configure_runtime_env "${TP}"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/cache}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-${XDG_CACHE_HOME}/vllm}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${XDG_CACHE_HOME}/triton}"
mkdir -p "${VLLM_CACHE_ROOT}" "${TRITON_CACHE_DIR}" "${XDG_CACHE_HOME}/torchinductor"

revision_args=()
if [[ -n "${MODEL_REVISION}" && "${MODEL}" != /* ]]; then
  revision_args=(--revision "${MODEL_REVISION}")
fi
quant_args=()
[[ -n "${QUANTIZATION}" && "${QUANTIZATION}" != auto ]] && quant_args+=(--quantization "${QUANTIZATION}")
if [[ "${ONLINE_QUANT}" != "none" ]]; then
  quant_args+=(--quantization-config "${QUANTIZATION_CONFIG_JSON}")
fi
spec_args=()
if ((MTP > 0)); then
  spec_args=(--speculative-config "$(printf '{"method":"mtp","num_speculative_tokens":%s}' "${MTP}")")
fi
sizes=""
for ((n = MTP + 1; n <= GRAPH; n += MTP + 1)); do
  sizes+="${sizes:+,}${n}"
done

cmd=(vllm serve "${MODEL}" "${revision_args[@]}"
  --host 0.0.0.0 --port "${PORT}" --trust-remote-code
  --tensor-parallel-size "${TP}"
  "${quant_args[@]}"
  --compilation-config "{\"cudagraph_capture_sizes\":[${sizes}]}"
  --max-model-len "${MAX_MODEL_LEN}" --max-num-seqs "${MAX_NUM_SEQS}"
  "${spec_args[@]}")
cmd+=("$@")  # wrappers forward their arguments: new flags, or overrides of the preset's

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf 'CUDA_VISIBLE_DEVICES=%q\n' "${CUDA_VISIBLE_DEVICES:-}"
  printf 'ONLINE_QUANT=%q\n' "${ONLINE_QUANT}"
  printf 'QUANTIZATION_CONFIG_JSON=%q\n' "${QUANTIZATION_CONFIG_JSON}"
  printf 'VLLM_EXL3_ONLINE_TRELLIS_BITS=%q\n' "${VLLM_EXL3_ONLINE_TRELLIS_BITS:-}"
  printf 'VLLM_EXL3_ENCODER_SOURCE=%q\n' "${VLLM_EXL3_ENCODER_SOURCE:-}"
  printf 'VLLM_EXL3_ENCODER_REVISION=%q\n' "${VLLM_EXL3_ENCODER_REVISION:-}"
  printf 'VLLM_EXL3_ONLINE_CACHE_DIR=%q\n' "${VLLM_EXL3_ONLINE_CACHE_DIR:-}"
  printf 'Command:'
  printf ' %q' "${cmd[@]}"
  printf '\n'
  exit 0
fi

exec "${cmd[@]}"
