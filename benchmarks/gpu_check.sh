#!/usr/bin/env bash
# One device call on nvidia-h200 (about 6 minutes): the whole tree on one GPU after a merge.
#   1. every GPU-marked test (the golden encodes byte for byte, Viterbi, GEMM paths, signs), goldens from ./golden;
#   2. the synthetic warm + verify of gpu_verify.sh on the GPU (warm TP 1,2; verify TP 2 with the trellis GEMM);
#   3. encode_linear's time (bench_encode.py), against the figures of results/bench_encode_h200.json.
# Carry ./golden. Logs land in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${T_TESTS:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 -rs tests > "$OUT/tests.log" 2>&1
echo "== tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
PART=synthetic timeout "${T_VERIFY:-200}" bash benchmarks/gpu_verify.sh > "$OUT/verify.log" 2>&1
echo "== verify"; grep -v "^│" "$OUT/verify.log" | tail -30
timeout "${T_ENCODE:-120}" python3 benchmarks/bench_encode.py --repeats 3 > "$OUT/encode.log" 2>&1
echo "== encode"; tail -8 "$OUT/encode.log"
