#!/usr/bin/env bash
#| modeled_on: a launcher that measures the GPUs before it starts (serve-glm52-v19.sh's PCIe calibration: a probe whose last output line is parsed, validated with [[ =~ ]] and die()), read through its own DRY_RUN=1 mode because the probe cannot run where exl3tool reads it
#| model: llama
#| server:
#|   model: "@MODELS@/tiny-llama"
#|   model_resolved: "@MODELS@/tiny-llama"
#|   tp: 2
#|   bits: 4
#|   overlay: '{"linear":{"weight":"mxfp8"}}'
#|   encoder_root: /opt/exllamav3
#|   encoder_revision: v0.0.18
#|   cache_root: "@JIT@/exl3-online"
#| expect: all-hit
set -euo pipefail
die() { echo "ERROR: $*" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TP="${TP:-2}"
PREFETCH="${PREFETCH:-auto}"
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  probe_status="skipped:dry-run"
elif [[ "${PREFETCH}" == "auto" ]]; then
  line="$(python3 "${here}/probe.py" --tp "${TP}" | awk 'NF { last = $0 } END { print last }')"
  IFS=$'\t' read -r probe_status PREFETCH <<<"${line}"
  [[ "${PREFETCH}" =~ ^[01]$ ]] || die "the probe returned no prefetch decision"
fi
echo "probe: ${probe_status:-not-run}" >&2
export VLLM_PREFETCH_DEPTH="${PREFETCH/auto/0}"
export VLLM_EXL3_ONLINE_TRELLIS_BITS=4 VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ENCODER_REVISION=v0.0.18
export VLLM_EXL3_ONLINE_CACHE_DIR="@JIT@/exl3-online"
cmd=(vllm serve "@MODELS@/tiny-llama" -tp "${TP}" --quantization-config '{"linear":{"weight":"mxfp8"}}')
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf 'VLLM_PREFETCH_DEPTH=%q\n' "${VLLM_PREFETCH_DEPTH}"
  printf 'Command:'; printf ' %q' "${cmd[@]}"; printf '\n'
  exit 0
fi
exec "${cmd[@]}"
