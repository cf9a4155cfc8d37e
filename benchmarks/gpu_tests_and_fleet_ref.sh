set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/prebuilt && cat .ext/exllamav3_ext.so.part-* > /tmp/prebuilt/exllamav3_ext.so
T0=$(date +%s)
PYTHONPATH=$PWD:/tmp/site:/tmp/prebuilt EXL3TOOL_REFERENCE_SOURCE=/tmp/site/exllamav3 timeout 230 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests > $OUT/gpu_tests.log 2>&1
echo "== gpu tests $(( $(date +%s) - T0 )) s: $(tail -1 $OUT/gpu_tests.log)"
grep -E "FAILED|Error" $OUT/gpu_tests.log | head -20
OUT=$OUT BUDGET=${BUDGET:-300} bash benchmarks/gpu_fleet_ref.sh > /dev/null 2>&1
tail -25 $OUT/bench_fleet_ref.log
echo "== total $(( $(date +%s) - T0 )) s"
