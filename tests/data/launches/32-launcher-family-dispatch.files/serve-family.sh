#!/usr/bin/env bash
# The image's entrypoint (our own words): MODEL_FAMILY picks a preset and its defaults; an optional cache
# sidecar wraps the command.
set -euo pipefail
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
printf 'Process-group interface: %s\n' "${GLOO_SOCKET_IFNAME}"

model_command=()
case "${MODEL_FAMILY:-}" in
  dense|llama)
    model_command=(/usr/local/bin/serve-wrapper.sh "$@")
    ;;
  dense-exl3|exl3)
    export MODEL="${MODEL:-example-org/Tiny-EXL3}"
    export TP="${TP:-4}"
    export MAX_NUM_SEQS="${MAX_NUM_SEQS:-8}"
    export QUANTIZATION="${QUANTIZATION:-exl3}"
    export ONLINE_QUANT="${ONLINE_QUANT:-none}"
    model_command=(/usr/local/bin/serve-wrapper.sh "$@")
    ;;
  *)
    echo "ERROR: MODEL_FAMILY must be dense or dense-exl3" >&2
    exit 2
    ;;
esac

sidecar="${CACHE_SIDECAR:-off}"
if [[ "${sidecar,,}" == "off" || "${sidecar}" == "0" ]]; then
  exec "${model_command[@]}"
fi
exec /usr/local/bin/cache-sidecar.sh "${model_command[@]}"
