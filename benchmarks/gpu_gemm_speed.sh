#!/usr/bin/env bash
# One device call on nvidia-h200 (issue 13): the GEMM's GPU tests, then the GEMM benchmark.
#   bash benchmarks/gpu_gemm_speed.sh sweep   # every candidate config at m = 1 .. 4096 (bench_gemm.json)
#   bash benchmarks/gpu_gemm_speed.sh final   # the default configs only, m in {1,4,16,64,512,4096}
# Goldens: EXL3TOOL_GOLDEN (default ./golden). Logs and JSON go to $OUT.
set -u
mode=${1:-final}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TEST_TIMEOUT:-210}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 tests/test_kernels_gemm.py \
  > "$OUT/tests.log" 2>&1
echo "== tests: $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
if [ "$mode" = sweep ]; then
  EXL3_BENCH_SWEEP=1 EXL3_BENCH_MS=${EXL3_BENCH_MS:-1,4,16,64,128,256,512,4096} timeout "${BENCH_TIMEOUT:-330}" \
    python3 benchmarks/_bench_gemm.py > "$OUT/bench.log" 2>&1
  grep -v "^  sweep" "$OUT/bench.log" | tail -60
else
  EXL3_BENCH_PARTS=gemm timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_kernels.py > "$OUT/bench.log" 2>&1
  tail -30 "$OUT/bench.log"
fi
