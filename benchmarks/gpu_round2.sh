#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (about 8 minutes):
#   lane A, GPU 0: bench_kernels.py with the GEMM config sweep (EXL3_BENCH_SWEEP=1): Viterbi and GEMM figures;
#   lane B, GPU 1: gpu_verify.sh (synthetic and MiniLM warm + verify + embeddings);
#   then, on both GPUs: the 2-GPU warm scaling run (bench_warm_torchrun.py, 4 layers, TP 1,2).
# Run from the repository root with ./.minilm present (carry it); results land in $OUT (8 files).
# (The GPU tests are gpu_diagnose.sh's and gpu_suite.sh's job: ./golden and ./.minilm together exceed a carry.)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=$PWD/golden EXL3TOOL_MINILM_DIR=$PWD/.minilm
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
(
  export CUDA_VISIBLE_DEVICES=0
  EXL3_BENCH_SWEEP=1 timeout "${T_BENCH:-330}" python3 benchmarks/bench_kernels.py 2>&1 | grep -v '^  sweep'
) > "$OUT/bench.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout "${T_VERIFY:-150}" bash benchmarks/gpu_verify.sh 2>&1 | tail -70
) > "$OUT/tests_verify.log" 2>&1 &
wait
timeout "${T_SCALE:-200}" python3 benchmarks/bench_warm_torchrun.py --nproc 2 --layers 4 > "$OUT/scaling.log" 2>&1
echo "== bench"; cat "$OUT/bench.log"; echo "== tests + verify"; cat "$OUT/tests_verify.log"; echo "== scaling"; tail -25 "$OUT/scaling.log"
