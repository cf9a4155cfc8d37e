#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (about 6 minutes), the figures of the closing note:
#   lane A, GPU 0: bench_kernels.py with the GEMM config sweep (Viterbi and GEMM tables, JSON);
#   lane B, GPU 1: every GPU-marked test, then the synthetic half of gpu_verify.sh (warm + verify at TP 2);
#   then, on both GPUs: the 2-GPU warm scaling run (bench_warm_torchrun.py, 4 layers, TP 1,2).
# Run from the repository root with ./golden present (carry it); results land in $OUT (7 files).
# The MiniLM half of gpu_verify.sh needs ./.minilm, which does not fit in one carry with ./golden:
#   PART=minilm bash benchmarks/gpu_verify.sh   (a second call, carrying .minilm)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=$PWD/golden
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
(
  export CUDA_VISIBLE_DEVICES=0
  EXL3_BENCH_SWEEP=1 timeout "${T_BENCH:-300}" python3 benchmarks/bench_kernels.py 2>&1 | grep -v '^  sweep'
) > "$OUT/bench.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout "${T_TESTS:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 -rs tests > "$OUT/tests.log" 2>&1
  PART=synthetic timeout 200 bash benchmarks/gpu_verify.sh > "$OUT/verify.log" 2>&1
) &
wait
timeout "${T_SCALE:-200}" python3 benchmarks/bench_warm_torchrun.py --nproc 2 --layers 4 > "$OUT/scaling.log" 2>&1
echo "== bench"; cat "$OUT/bench.log"; echo "== tests"; tail -15 "$OUT/tests.log"; echo "== verify"; tail -40 "$OUT/verify.log"
echo "== scaling"; tail -8 "$OUT/scaling.log"
