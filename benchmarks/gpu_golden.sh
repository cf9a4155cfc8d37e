#!/usr/bin/env bash
# One GPU run: regenerate the full golden set with exllamav3 1.6.5 (make_golden.py) and compare it with the committed
# full set, while the GPU tests run; bring the reference's built extension back for later runs.
#   1. install the exllamav3 wheel and what its package imports (pydantic and its parts, marisa_trie, llguidance)
#      from $WHL into /tmp/site;
#   2. in the background: make_golden.py into /tmp/golden_new (its first import JIT-compiles the extension,
#      about 5 minutes on 16 cores), then compare_golden.py against ./golden (the current full set, carried);
#   3. meanwhile every GPU-marked test (goldens from ./golden);
#   4. the stripped extension, xz-compressed, in 15 MiB parts in $OUT/ext (carry them as ./.ext next time).
# Carry: golden (31 MB) and .whl. Results: $OUT/results.tgz (logs, the comparison JSON) and $OUT/ext/*.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-12}
OUT=${OUT:-/tmp/exl3tool-golden}; mkdir -p "$OUT/logs"
WHL=${WHL:-.whl}
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
( timeout "${T_GOLDEN:-500}" python3 benchmarks/make_golden.py /tmp/golden_new --previous "$EXL3TOOL_GOLDEN" \
    > "$OUT/logs/make_golden.log" 2>&1 && echo "make_golden ok" >> "$OUT/logs/make_golden.log" \
  && python3 benchmarks/compare_golden.py /tmp/golden_new "$EXL3TOOL_GOLDEN" --json "$OUT/logs/compare_golden.json" \
    > "$OUT/logs/compare_golden.log" 2>&1 ) &
GPID=$!
timeout "${T_TESTS:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider -n "${TEST_WORKERS:-4}" -rs tests \
  > "$OUT/logs/gpu_tests.log" 2>&1
echo "== GPU tests ($(since)): $(tail -1 "$OUT/logs/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/logs/gpu_tests.log" | head -20
wait $GPID
echo "== make_golden ($(since)):"; tail -8 "$OUT/logs/make_golden.log"
echo "== compare:"; cat "$OUT/logs/compare_golden.log" 2>/dev/null | tail -40
SO=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
if [ -n "$SO" ]; then
  strip --strip-debug -o /tmp/exllamav3_ext.so "$SO" && xz -T0 -6 -k /tmp/exllamav3_ext.so \
    && mkdir -p "$OUT/ext" && split -b 15m /tmp/exllamav3_ext.so.xz "$OUT/ext/exllamav3_ext.so.xz.part-" \
    && ls -la "$SO" /tmp/exllamav3_ext.so /tmp/exllamav3_ext.so.xz "$OUT/ext"
fi
python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton) " > "$OUT/logs/versions.txt"
(cd "$OUT" && tar czf results.tgz logs && rm -r logs)
echo "== total $(since)"
