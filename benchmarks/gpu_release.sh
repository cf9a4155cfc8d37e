#!/usr/bin/env bash
# One device call on nvidia-h200 (under 10 minutes): the whole merged tree against the reference, in one run.
#   1. install the exllamav3 1.6.5 wheel (+ what its quantize.py imports) from ./.whl into /tmp/site and start
#      JIT-compiling its CUDA extension in the background (about 5 minutes on 16 cores);
#   2. meanwhile every GPU-marked test (goldens from ./golden), then (FLEET=1, the default) the llama-8b warm of
#      bench_fleet.py and the stage profile of profile_encode.py (SLOTS=1: the K=6 slot sweep of
#      bench_viterbi_slots.py too) on the otherwise idle GPU;
#   3. once the extension is built: bench_dropin.py (the fork's call convention, drop-in vs exllamav3: time, peak
#      GPU memory, byte identity) and bench_encode_memory.py (peak memory and time per shape, with the reference);
#      if the compile did not finish by $T_COMPILE s, both run without the reference and say so; with the reference,
#      bench_fleet.py --add-reference times it on the encodes of the 8B warm.
# Carry ./golden and ./.whl (see benchmarks/gpu_dropin.sh for how .whl is filled). Logs and JSON land in $OUT.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-14}
OUT=${OUT:-/tmp/exl3tool-release}; mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 - > "$OUT/compile.log" 2>&1 <<'EOF' &
import sys, time
sys.path.insert(0, "tests")
start = time.perf_counter()
from _fork_loader import load_quantize_exl3
load_quantize_exl3("/tmp/site/exllamav3", package="_exllamav3_reference")
print(f"compile+import ok {time.perf_counter() - start:.1f} s")
EOF
CPID=$!
timeout "${T_TESTS:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 -rs tests > "$OUT/tests.log" 2>&1
echo "== GPU tests ($(( $(date +%s) - T0 )) s): $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
# the GPU is idle while the compile goes on: the 8B warm (issue 20's rate) and the K=6 slot sweep; the warm runs
# without /tmp/site on its path (importing exllamav3 there would wait for the extension being built)
if [ -n "${FLEET:-1}" ]; then
  PYTHONPATH=$PWD timeout "${T_FLEET:-120}" python3 benchmarks/bench_fleet.py --preset llama-8b --workdir "$(mktemp -d /tmp/fleet-XXXX)" \
    --json "$OUT/bench_fleet_8b.json" > "$OUT/bench_fleet_8b.log" 2>&1
  echo "== bench_fleet llama-8b ($(( $(date +%s) - T0 )) s)"; tail -8 "$OUT/bench_fleet_8b.log"
  if [ -n "${SLOTS:-}" ]; then
    timeout "${T_SLOTS:-60}" python3 benchmarks/bench_viterbi_slots.py --bits 6 --warps 4 --per-sm 4,6,9,12 \
      --json "$OUT/bench_viterbi_slots.json" > "$OUT/bench_viterbi_slots.log" 2>&1
    echo "== bench_viterbi_slots ($(( $(date +%s) - T0 )) s)"; grep -E "baseline|edges 1024" "$OUT/bench_viterbi_slots.log"
  fi
  if [ -n "${PROFILE:-1}" ]; then
    PYTHONPATH=$PWD timeout "${T_PROFILE:-60}" python3 benchmarks/profile_encode.py --json "$OUT/profile_encode.json" \
      > "$OUT/profile_encode.log" 2>&1
    echo "== profile_encode ($(( $(date +%s) - T0 )) s)"; grep -v -i warn "$OUT/profile_encode.log" | tail -8
  fi
fi
while kill -0 $CPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "${T_COMPILE:-400}" ]; do sleep 2; done
echo "== reference compile: $(tail -1 "$OUT/compile.log") ($(( $(date +%s) - T0 )) s since start)"
if kill -0 $CPID 2>/dev/null || ! grep -q "compile+import ok" "$OUT/compile.log"; then
  kill $CPID 2>/dev/null; REF=(); MREF=(--no-reference); echo "== the reference is NOT measured in this run"
else
  REF=(--reference /tmp/site/exllamav3); MREF=("${REF[@]}")
fi
timeout "${T_DROPIN:-100}" python3 benchmarks/bench_dropin.py "${REF[@]}" --json "$OUT/bench_dropin.json" > "$OUT/bench_dropin.log" 2>&1
echo "== bench_dropin ($(( $(date +%s) - T0 )) s)"; cat "$OUT/bench_dropin.log" | tail -28
timeout "${T_MEMORY:-80}" python3 benchmarks/bench_encode_memory.py --device cuda --shapes "${SHAPES:-5120x6144,16384x7168,18432x7168,7168x36864}" "${MREF[@]}" \
  --json "$OUT/bench_encode_memory.json" > "$OUT/bench_encode_memory.log" 2>&1
echo "== bench_encode_memory ($(( $(date +%s) - T0 )) s)"; tail -24 "$OUT/bench_encode_memory.log"
# the reference's rate on the encodes of the 8B warm above (issue 20's presets beside the reference, same run)
if [ -n "${FLEET:-1}" ] && [ ${#REF[@]} -gt 0 ] && [ -f "$OUT/bench_fleet_8b.json" ]; then
  timeout "${T_FLEETREF:-120}" python3 benchmarks/bench_fleet.py --add-reference "$OUT/bench_fleet_8b.json" "${REF[@]}" \
    --json "$OUT/bench_fleet_8b_ref.json" > "$OUT/bench_fleet_8b_ref.log" 2>&1
  echo "== bench_fleet llama-8b + reference ($(( $(date +%s) - T0 )) s)"; tail -3 "$OUT/bench_fleet_8b_ref.log"
fi
