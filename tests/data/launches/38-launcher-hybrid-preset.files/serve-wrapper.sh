#!/usr/bin/env bash
# A release wrapper (our own words): decides two runtime switches from TP, prints them in a dry run, then hands
# over to the preset installed in the image (an absolute path of the image).
set -euo pipefail

TP="${TP:-8}"
SPLIT="${SPLIT:-auto}"
case "${TP}" in
  4|8) [[ "${SPLIT}" == "auto" ]] && SPLIT=1 ;;
  *) [[ "${SPLIT}" == "auto" ]] && SPLIT=0 ;;
esac
export VLLM_QUERY_SPLIT="${SPLIT}"
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf 'VLLM_QUERY_SPLIT=%q\n' "${VLLM_QUERY_SPLIT}"
fi
exec /usr/local/bin/serve-preset.sh "$@"
