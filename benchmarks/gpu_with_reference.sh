#!/usr/bin/env bash
# One device call with exllamav3 1.6.5's extension already built (carried in ./.ext as exllamav3_ext.so.xz.part-*,
# from benchmarks/gpu_golden.sh's $OUT/ext): the whole tree's GPU tests with the reference's cases on, the golden
# regeneration compared with the committed set, then bench_hydrate.py against the reference
# (bench_fleet.py's reference run needs its own call: gpu_fleet_ref.sh).
#   parts (each with its own time limit, T_<PART> seconds): tests+golden (together), hydrate
# Carry: .whl (the exllamav3 wheel and pydantic's parts), .ext, golden. Results: $OUT/results.tgz.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/exl3tool-ref}; mkdir -p "$OUT/logs"
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/prebuilt && cat .ext/exllamav3_ext.so.xz.part-* | xz -d > /tmp/prebuilt/exllamav3_ext.so || exit 1
export PYTHONPATH=$PWD:/tmp/site:/tmp/prebuilt TORCH_EXTENSIONS_DIR=/tmp/torch_ext EXL3TOOL_GOLDEN=$PWD/golden
export EXL3TOOL_REFERENCE_SOURCE=/tmp/site/exllamav3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
( timeout "${T_GOLDEN:-200}" python3 benchmarks/make_golden.py /tmp/golden_new --previous golden \
    > "$OUT/logs/make_golden.log" 2>&1 \
  && python3 benchmarks/compare_golden.py /tmp/golden_new golden --json "$OUT/logs/compare_golden.json" \
    > "$OUT/logs/compare_golden.log" 2>&1 ) &
GPID=$!
timeout "${T_TESTS:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -n "${TEST_WORKERS:-8}" -rs tests \
  > "$OUT/logs/gpu_tests.log" 2>&1
echo "== GPU tests ($(since)): $(tail -1 "$OUT/logs/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|^SKIPPED" "$OUT/logs/gpu_tests.log" | head -20
wait $GPID
echo "== golden ($(since)): $(tail -1 "$OUT/logs/make_golden.log")"; tail -12 "$OUT/logs/compare_golden.log" 2>/dev/null
timeout "${T_HYDRATE:-230}" python3 benchmarks/bench_hydrate.py --reference /tmp/site/exllamav3 --per-shape \
  --time-budget "${HYDRATE_BUDGET:-200}" --json "$OUT/logs/bench_hydrate.json" > "$OUT/logs/bench_hydrate.log" 2>&1
echo "== hydrate vs reference ($(since))"; tail -25 "$OUT/logs/bench_hydrate.log"
(cd "$OUT" && tar czf results.tgz logs && rm -r logs)
echo "== total $(since)"
