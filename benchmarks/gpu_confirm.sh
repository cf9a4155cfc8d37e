#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (about 4 minutes), carrying ./.minilm:
#   lane A, GPU 0: bench_kernels.py (the default configs only: the table of the closing note);
#   lane B, GPU 1: the GEMM's GPU tests (without the golden), then gpu_verify.sh (synthetic and MiniLM).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_kernels.py > "$OUT/bench.log" 2>&1) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_kernels_gemm.py > "$OUT/tests.log" 2>&1
  timeout 300 bash benchmarks/gpu_verify.sh > "$OUT/verify.log" 2>&1
) &
wait
echo "== bench"; tail -14 "$OUT/bench.log"; echo "== tests"; tail -3 "$OUT/tests.log"; echo "== verify"; grep -v "^│\|^fail\|^pass" "$OUT/verify.log" | tail -60
