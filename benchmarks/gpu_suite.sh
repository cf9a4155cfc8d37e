#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks and the 2-GPU warm scaling (gpu_verify.sh does warm+verify+MiniLM).
# Run from the repository root with the goldens in ./golden; logs and JSON land in $OUT (at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=$PWD/golden
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
LOG=$OUT/suite.log
step() {  # name timeout command...
  local name=$1 t=$2; shift 2
  echo "== $name ($(date +%T))" | tee -a "$LOG"
  timeout "$t" "$@" >> "$LOG" 2>&1; local rc=$?
  echo "== $name rc=$rc" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$LOG"
python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$LOG"
step gpu_tests "${T_TESTS:-170}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 -rs \
  tests/test_kernels_viterbi.py tests/test_kernels_gemm.py tests/test_gpu_encode.py tests/test_signs.py
grep -E "passed|failed|error" "$LOG" | tail -3
step bench_kernels "${T_BENCH:-110}" python3 benchmarks/bench_kernels.py
rate=$(python3 -c "import json;d=json.load(open('$OUT/bench_kernels.json'));print(max([v.get('tiles_per_s',0) for v in d['viterbi'].values()]+[0]))" 2>/dev/null || echo 0)
layers=$(python3 -c "r=float('$rate'); print(max(1, min(4, int(r * 90 / 1.7e6))))")
echo "viterbi rate $rate tiles/s -> scaling run with $layers layer(s)" | tee -a "$LOG"
if [ "$(python3 -c 'import torch;print(torch.cuda.device_count())')" -ge 2 ] && [ "$layers" -ge 1 ] && python3 -c "import sys; sys.exit(0 if float('$rate') > 5000 else 1)"; then
  step scaling "${T_SCALE:-230}" python3 benchmarks/bench_warm_torchrun.py --nproc 2 --layers "$layers"
fi
echo "== summary"; grep -E "^== |passed|failed|tiles/s|x[0-9.]+ |speed-up|byte-identical|embeddings via|verify (PASS|FAIL)|ERROR" "$LOG" | tail -60
