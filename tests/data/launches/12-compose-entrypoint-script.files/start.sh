#!/bin/bash
# entrypoint of the serving container: the launch's settings come from the environment
set -euo pipefail
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
MODEL="${SERVED_MODEL:?SERVED_MODEL must name the checkpoint}"
echo "serving ${MODEL} with TP ${TP_SIZE:-1}"
exec vllm serve "${MODEL}" \
    --tensor-parallel-size "${TP_SIZE:-1}" \
    --quantization-config "${QUANT_CONFIG}" \
    --trust-remote-code "$@"
