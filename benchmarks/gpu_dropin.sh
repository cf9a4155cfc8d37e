#!/usr/bin/env bash
# One run on an H200 (nvidia-h200): the drop-in encoder against exllamav3 1.6.5, as the vLLM fork calls them.
#   1. install the exllamav3 wheel (and pydantic, which its quantize.py imports) from $WHL into /tmp/site;
#   2. JIT-compile its CUDA extension (TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16), timed, in the background while the
#      drop-in's GPU tests run (goldens from ./golden);
#   3. once the compile is done (at most $T_COMPILE s), bench_dropin.py with the reference; else without it,
#      reporting how far the compile got (objects built of sources).
# Logs and the JSON land in $OUT; the stripped extension comes back in 15 MiB parts when it fits.
# Measured 2026-12-02: the compile had built 147 of 202 objects after 211 s (16 cores, torch 2.11, CUDA 13.0), so
# the defaults leave it 400 s and the benchmark 180 s: run with timeout_s 600 (or carry a built extension).
# $WHL (here, then carried): the exllamav3 wheel plus what its quantize.py imports that the device image lacks:
#   mkdir -p W && cp exllamav3-1.6.5-py3-none-any.whl W/ && python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 -d W \
#     pydantic pydantic-core annotated-types typing-inspection typing_extensions
# Example (from the repository root, with W at .wt/dropin_whl and the tree at .wt/dropin):
#   cd .wt/dropin && WHL=../dropin_whl bash benchmarks/gpu_dropin.sh
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-/tmp/exl3tool-dropin}; mkdir -p "$OUT"
WHL=${WHL:-../dropin_whl}
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
. benchmarks/_reference_build.sh && reference_build "$OUT/compile.log"
timeout "${T_TESTS:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/serving/test_encoder_source.py > "$OUT/tests.log" 2>&1
echo "== drop-in GPU tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -10
SRC=$(find /tmp/site/exllamav3/exllamav3_ext -name '*.cu' -o -name '*.cpp' | wc -l)
while kill -0 $CPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "${T_COMPILE:-400}" ]; do sleep 2; done
OBJ=$(find /tmp/torch_ext -name '*.o' 2>/dev/null | wc -l)
echo "== compile: $(cat "$OUT/compile.log" | tail -2) (objects $OBJ of $SRC sources, $(( $(date +%s) - T0 )) s since start)"
SO=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
if [ -n "$SO" ] && ! kill -0 $CPID 2>/dev/null; then
  strip --strip-debug -o /tmp/exllamav3_ext.so "$SO"; ls -la "$SO" /tmp/exllamav3_ext.so
  if [ "$(stat -c %s /tmp/exllamav3_ext.so)" -le 62914560 ]; then
    mkdir -p "$OUT/ext" && split -b 15m /tmp/exllamav3_ext.so "$OUT/ext/exllamav3_ext.so.part-"
  fi
  REF=(--reference /tmp/site/exllamav3)
else
  REF=()
fi
timeout "${T_BENCH:-180}" python3 benchmarks/bench_dropin.py "${REF[@]}" --json "$OUT/bench_dropin.json" 2>&1 | tee "$OUT/bench.log"
echo "== total $(( $(date +%s) - T0 )) s"
