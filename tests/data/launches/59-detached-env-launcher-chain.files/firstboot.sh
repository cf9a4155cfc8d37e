#!/usr/bin/env bash
# first-boot launcher: checks its inputs, asks python for the compilation config, execs vllm with ARGS
set -euo pipefail
: "${MODEL_DIR:?set MODEL_DIR to the prepared EXL3 pack}"
: "${GPU_MEM_UTIL:?set GPU_MEM_UTIL explicitly for the target card}"
[[ -f "$MODEL_DIR/config.json" ]] || { echo "ERROR: missing $MODEL_DIR/config.json" >&2; exit 2; }
export VLLM_EXL3_MODEL_DIR="$MODEL_DIR" VLLM_EXL3_COOP="${VLLM_EXL3_COOP:-1}"
SPLIT_OPS="$(
  python - <<'PY'
import json
print(json.dumps(["vllm::unified_attention"]))
PY
)"
COMPILATION_CONFIG="$(
  python - "$SPLIT_OPS" <<'PY'
import json, sys
print(json.dumps({"cudagraph_mode": "PIECEWISE", "splitting_ops": json.loads(sys.argv[1] or "[]")}))
PY
)"
ARGS=(serve "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --tensor-parallel-size 2
  --quantization-config '{"linear":{"weight":"mxfp8"}}' --max-model-len "$MAX_MODEL_LEN"
  --gpu-memory-utilization "$GPU_MEM_UTIL")
[[ -n "$COMPILATION_CONFIG" ]] && ARGS+=(--compilation-config "$COMPILATION_CONFIG")
echo "[exec] vllm ${ARGS[*]}"
exec vllm "${ARGS[@]}"
