#!/usr/bin/env bash
# One device call on nvidia-h200-x2, two lanes in parallel:
#   GPU 0: the GEMM's GPU tests, then the GEMM config sweep (EXL3_BENCH_SWEEP=1);
#   GPU 1: the stage-by-stage determinism probe in two processes, then the full-size warm determinism check
#          (two single-process warms and one torchrun warm of two processes, all on that GPU).
# Run from the repository root with the goldens in ./golden; logs land in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=$PWD/golden
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout "${T_TESTS:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/test_kernels_gemm.py 2>&1 | tail -15
  EXL3_BENCH_SWEEP=1 timeout "${T_SWEEP:-300}" python3 benchmarks/_bench_gemm.py 2>&1 | grep -v '^  sweep'
) > "$OUT/gemm.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/determinism_probe.py --device cuda:0 --out "$OUT/probe_a.json" > /dev/null
  timeout 150 python3 benchmarks/determinism_probe.py --device cuda:0 --out "$OUT/probe_b.json" > /dev/null
  python3 benchmarks/determinism_probe.py --compare "$OUT/probe_a.json" "$OUT/probe_b.json"
  timeout "${T_DET:-240}" python3 benchmarks/determinism_check.py --devices cuda:0,cuda:0 --torchrun 2 \
    --hidden 4096 --intermediate 14336 > "$OUT/determinism.log" 2>&1
) > "$OUT/probe.log" 2>&1 &
wait
echo "== gemm"; cat "$OUT/gemm.log"; echo "== probe"; tail -30 "$OUT/probe.log"; echo "== warm determinism"; tail -60 "$OUT/determinism.log"
