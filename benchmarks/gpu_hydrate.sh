#!/usr/bin/env bash
# One device call (600 s) on one GPU: hydrate's encodes against exllamav3 1.6.5's quantize_exl3 (benchmarks/bench_hydrate.py)
# on the deployed layers of a Qwen3.8-27B- and a GLM-5-shaped checkpoint, plus hydrate's GPU tests.
#   1. install the exllamav3 wheel (+ pydantic) from $WHL into /tmp/site; a built extension carried in ./.ext
#      (exllamav3_ext.so.part-*, from an earlier run's $OUT/ext) is used as is, else it JIT-compiles in the background
#      (TORCH_CUDA_ARCH_LIST=9.0, about 320 s on 16 cores);
#   2. meanwhile: the GPU tests of tests/operations/test_hydrate.py (the Triton GEMM through `verify --against`) and
#      bench_hydrate.py without the reference (ours alone, warms Triton's cache);
#   3. once the reference loads: bench_hydrate.py --reference --per-shape with the time left ($T_BENCH, default 230 s)
#      as --time-budget, so it prints what it has.
# $WHL as for gpu_callers.sh. Results: $OUT/results.tgz (logs, bench_hydrate.json), the stripped extension in $OUT/ext.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-15}
OUT=${OUT:-/tmp/exl3tool-hydrate}; mkdir -p "$OUT"
WHL=${WHL:-.whl}
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext
. benchmarks/_reference_build.sh && reference_build "$OUT/compile.log"
timeout "${T_TESTS:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/operations/test_hydrate.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "== hydrate GPU tests ($(since)): $(tail -1 "$OUT/gpu_tests.log")"
timeout "${T_OURS:-150}" python3 benchmarks/bench_hydrate.py --per-shape --time-budget "${T_OURS_BUDGET:-120}" \
  --json "$OUT/bench_hydrate_ours.json" > "$OUT/bench_ours.log" 2>&1
echo "== ours alone ($(since))"; tail -4 "$OUT/bench_ours.log"
while kill -0 $CPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "${T_COMPILE:-350}" ]; do sleep 2; done
echo "== reference ($(since)): $(tail -1 "$OUT/compile.log")"
if kill -0 $CPID 2>/dev/null || ! grep -q "compile+import ok" "$OUT/compile.log"; then
  echo "== no reference: compile not done; ours alone above"
  kill $CPID 2>/dev/null
else
  SO=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  if [ -z "$PREBUILT" ] && [ -n "$SO" ]; then
    strip --strip-debug -o /tmp/exllamav3_ext.so "$SO" && mkdir -p "$OUT/ext" \
      && split -b 15m /tmp/exllamav3_ext.so "$OUT/ext/exllamav3_ext.so.part-"
  fi
  LEFT=$(( ${T_TOTAL:-585} - $(date +%s) + T0 - 20 ))
  BUDGET=$(( LEFT < ${T_BENCH:-230} ? LEFT : ${T_BENCH:-230} ))
  timeout "$(( BUDGET + 15 ))" python3 benchmarks/bench_hydrate.py --reference /tmp/site/exllamav3 --per-shape \
    --time-budget "$BUDGET" --json "$OUT/bench_hydrate.json" > "$OUT/bench.log" 2>&1
  tail -30 "$OUT/bench.log"
fi
echo "== total $(since)"
(cd "$OUT" && tar czf results.tgz --exclude=ext --exclude=results.tgz -- * && find . -maxdepth 1 -type f ! -name results.tgz -delete)
