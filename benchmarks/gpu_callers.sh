#!/usr/bin/env bash
# One run on an H200 (nvidia-h200): the drop-in against exllamav3 1.6.5 in the conventions of the fork loader's three
# callers (online linear method, image-build gate with return_weight_q=True, K8/K4 round-trip tools).
#   1. install the exllamav3 wheel (+ pydantic, which its quantize.py imports) from $WHL into /tmp/site; a built
#      extension carried in ./.ext (exllamav3_ext.so.part-*, from an earlier run's $OUT/ext) is used as is, else it
#      JIT-compiles in the background (TORCH_CUDA_ARCH_LIST=9.0, about 5-6 minutes on 16 cores);
#   2. meanwhile the drop-in's GPU tests of tests/serving/test_encoder_source.py (goldens from ./golden; the reference's
#      cases skip: EXL3TOOL_REFERENCE_SOURCE unset), the Triton-cache-across-processes test among them;
#      ($BENCH_ONLY set: no tests, steps 2 and 3 run the benchmark alone);
#   3. once the reference loads (at most $T_COMPILE s after the start): the reference cases of the same file
#      (EXL3TOOL_REFERENCE_SOURCE=/tmp/site/exllamav3), then bench_callers.py --reference --probe.
# Logs and the JSON come back in $OUT/results.tgz, the stripped extension in 15 MiB parts in $OUT/ext.
# $WHL: exllamav3-1.6.5-py3-none-any.whl plus pydantic pydantic-core annotated-types typing-inspection
# typing_extensions (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64).
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-15}
OUT=${OUT:-/tmp/exl3tool-callers}; mkdir -p "$OUT"
WHL=${WHL:-.whl}
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
. benchmarks/_reference_build.sh && reference_build "$OUT/compile.log"
[ -n "${BENCH_ONLY:-}" ] || timeout "${T_TESTS:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -s tests/serving/test_encoder_source.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "== drop-in GPU tests ($(since)): $(tail -1 "$OUT/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|first call:" "$OUT/gpu_tests.log" | head -10
while kill -0 $CPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "${T_COMPILE:-370}" ]; do sleep 2; done
echo "== reference ($(since)): $(tail -1 "$OUT/compile.log")"
if kill -0 $CPID 2>/dev/null || ! grep -q "compile+import ok" "$OUT/compile.log"; then
  OBJ=$(find /tmp/torch_ext -name '*.o' 2>/dev/null | wc -l)
  echo "== no reference: compile not done ($OBJ objects); drop-in only"
  kill $CPID 2>/dev/null
  timeout "${T_BENCH:-120}" python3 benchmarks/bench_callers.py --probe --json "$OUT/bench_callers.json" \
    > "$OUT/bench.log" 2>&1
else
  SO=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  if [ -z "$PREBUILT" ] && [ -n "$SO" ]; then
    strip --strip-debug -o /tmp/exllamav3_ext.so "$SO" && mkdir -p "$OUT/ext" \
      && split -b 15m /tmp/exllamav3_ext.so "$OUT/ext/exllamav3_ext.so.part-" && ls -la "$OUT/ext"
  fi
  [ -n "${BENCH_ONLY:-}" ] || EXL3TOOL_REFERENCE_SOURCE=/tmp/site/exllamav3 timeout "${T_REFTESTS:-80}" python3 -m pytest -q -m gpu \
    -p no:cacheprovider -rs -s -k callers_get tests/serving/test_encoder_source.py > "$OUT/reference_tests.log" 2>&1
  echo "== reference GPU tests ($(since)): $(tail -1 "$OUT/reference_tests.log")"
  grep -E "^(FAILED|ERROR)|weight_q bit-identical" "$OUT/reference_tests.log" | head -20
  timeout "${T_BENCH:-120}" python3 benchmarks/bench_callers.py --reference /tmp/site/exllamav3 --probe \
    --json "$OUT/bench_callers.json" > "$OUT/bench.log" 2>&1
fi
cat "$OUT/bench.log" | tail -45
echo "== total $(since)"
(cd "$OUT" && tar czf results.tgz --exclude=ext --exclude=results.tgz -- * && find . -maxdepth 1 -type f ! -name results.tgz -delete)
