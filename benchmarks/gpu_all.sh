#!/usr/bin/env bash
# Every GPU test and measurement against exllamav3 1.6.5 in one device call (600 s), in parts with time limits.
#
#   OUT=$OUT bash benchmarks/gpu_all.sh                    # the default parts (below), about 580 s
#   PARTS="tests viterbi" OUT=$OUT bash benchmarks/gpu_all.sh
#
# Run from the repository root on the device machine; carry ./.whl (the exllamav3 1.6.5 wheel, pydantic,
# pydantic_core, annotated_types, typing_inspection, marisa_trie, llguidance: benchmarks/README.md "Running") and, if
# at hand, ./.ext (exllamav3_ext.so.part-*, the stripped extension an earlier run left in $OUT/ext). Without ./.ext
# the extension JIT-compiles in the background (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS, 214-320 s on 16 cores) while the
# parts that need no reference run, and comes back in $OUT/ext (15 MB parts: copy them to ./.ext for the next call).
# Goldens: $EXL3TOOL_GOLDEN or ./golden (the full set), else the tests' subset.
#
# Parts, in this order (each one's time limit T_<PART> in seconds; its log $OUT/<part>.log):
#   env       the GPU, clocks, torch and triton
#   sweep     bench_viterbi_lanes.py: the Viterbi's variants at K 6,4,8,5,7 against the default launch (T_SWEEP 200)
#   tests     pytest -m gpu tests/kernels tests/encode (T_TESTS 150; $TESTS other paths, $TESTS_K a -k)
#   viterbi   the default Viterbi launch (and the sweep's best variant per K, if it ran) and the reference's
#             quantize_tiles at K 6,4,8 on the same tiles (T_VITERBI 60)                                [reference]
#   dropin    bench_dropin.py --warm-each: the fork's 20 layer calls ($DROPIN_MODELS), both (T_DROPIN 150) [reference]
#   callers   bench_callers.py --probe: the fork loader's three callers, 13 calls (T_CALLERS 120)      [reference]
#   hydrate   bench_hydrate.py --per-shape: Qwen3.8-27B and GLM-5 shapes ($HYDRATE_MODELS; T_HYDRATE 200) [reference]
#   fleet     bench_fleet.py --reference: the fleet presets, both (T_FLEET 300)                        [reference]
# A part's own environment: ENV_<PART>="VAR=value ..." (e.g. ENV_TESTS="EXL3TOOL_VITERBI_LANES=4").
# Default PARTS="env tests viterbi dropin hydrate fleet" with the limits shrunk to what is left of T_TOTAL (580 s).
# Parts marked [reference] wait for the extension (at most until T_COMPILE, 340 s) and are left out without it.
# Results: $OUT/results.tgz (logs and JSON), $OUT/ext/ (a newly built extension); the summary lines on stdout.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-12}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/exl3tool-all}; mkdir -p "$OUT"
PARTS=${PARTS:-env tests viterbi dropin hydrate fleet}
T0=$(date +%s)
TOTAL=${T_TOTAL:-580}
since() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(since) )); }
lim() {  # the part's limit: T_<PART>, else its default, never past what is left (less 25 s to pack the results)
  local v="T_${1^^}" want l; want=${!v:-$2}; l=$(( $(left) - 25 ))
  [ "$want" -gt "$l" ] && want=$l; [ "$want" -lt 1 ] && want=1; echo "$want"
}
[ -d golden ] && export EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}

# the reference: wheels, then a carried extension or a background JIT build
REF_OK=
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "== wheels did not install: $(tail -1 "$OUT/pip.log")"
fi
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext
PREBUILT= CPID=
if [ -d /tmp/site/exllamav3 ]; then
  . benchmarks/_reference_build.sh && reference_build "$OUT/compile.log"
fi
reference() {  # wait for the extension; 0 once it loads
  [ -n "$REF_OK" ] && return 0
  [ -z "$CPID" ] && return 1
  while kill -0 "$CPID" 2>/dev/null && [ "$(since)" -lt "${T_COMPILE:-340}" ]; do sleep 2; done
  if kill -0 "$CPID" 2>/dev/null || ! grep -q "compile+import ok" "$OUT/compile.log"; then
    echo "== no reference ($(since) s): $(tail -1 "$OUT/compile.log" 2>/dev/null)"; return 1
  fi
  REF_OK=1
  echo "== reference loaded ($(since) s): $(tail -1 "$OUT/compile.log")"
  local so; so=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  if [ -z "$PREBUILT" ] && [ -n "$so" ]; then
    strip --strip-debug -o /tmp/exllamav3_ext.so "$so" && mkdir -p "$OUT/ext" \
      && split -b 15m /tmp/exllamav3_ext.so "$OUT/ext/exllamav3_ext.so.part-"
  fi
  return 0
}

penv() { local v="ENV_${p^^}"; env ${!v:-} "$@"; }  # the part's own settings: ENV_<PART>="VAR=value ..."
for p in $PARTS; do
  log="$OUT/$p.log"
  echo "== $p ($(since) s)"
  case $p in
    env)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" ;;
    sweep)
      penv timeout "$(lim sweep 200)" python3 benchmarks/bench_viterbi_lanes.py --bits "${SWEEP_BITS:-6,4,8,5,7}" \
        --sass "$OUT/sass" --compile-jobs "${COMPILE_JOBS:-4}" --json "$OUT/bench_viterbi_lanes.json" > "$log" 2>&1
      grep -E "^K=|tiles/s|failed|inner loop" "$log" | tail -80 ;;
    tests)
      n=; python3 -c "import xdist" 2> /dev/null && n="-n ${TEST_WORKERS:-8}"  # Triton compiles in parallel
      penv timeout "$(lim tests 150)" python3 -m pytest -q -m gpu -p no:cacheprovider -rs $n ${TESTS:-tests/kernels tests/encode} ${TESTS_K:+-k "$TESTS_K"} \
        > "$log" 2>&1
      tail -1 "$log"; grep -E "^(FAILED|ERROR)" "$log" | head -20 ;;
    viterbi)
      reference || continue
      v=none; [ -f "$OUT/bench_viterbi_lanes.json" ] && v="best=$OUT/bench_viterbi_lanes.json"
      penv timeout "$(lim viterbi 60)" python3 benchmarks/bench_viterbi_lanes.py --bits 6,4,8 --variants "${VITERBI_VARIANTS:-$v}" \
        --compile-jobs 1 --tiles 32768 --reference /tmp/site/exllamav3 --json "$OUT/bench_viterbi_ref.json" > "$log" 2>&1
      grep -E "^K=|reference" "$log" ;;
    dropin)
      reference || continue
      penv timeout "$(lim dropin 150)" python3 benchmarks/bench_dropin.py --reference /tmp/site/exllamav3 --warm-each \
        ${DROPIN_MODELS:+--models "$DROPIN_MODELS"} \
        --json "$OUT/bench_dropin.json" > "$log" 2>&1
      tail -32 "$log" ;;
    callers)
      reference || continue
      penv timeout "$(lim callers 120)" python3 benchmarks/bench_callers.py --reference /tmp/site/exllamav3 --probe \
        --json "$OUT/bench_callers.json" > "$log" 2>&1
      tail -20 "$log" ;;
    hydrate)
      reference || continue
      b=$(lim hydrate 200)
      penv timeout "$b" python3 benchmarks/bench_hydrate.py --reference /tmp/site/exllamav3 --per-shape \
        --models "${HYDRATE_MODELS:-qwen38-27b,glm5}" \
        --time-budget $(( b - 20 )) --json "$OUT/bench_hydrate.json" > "$log" 2>&1
      tail -30 "$log" ;;
    fleet)
      reference || continue
      b=$(lim fleet 300)
      penv timeout "$b" python3 benchmarks/bench_fleet.py --preset "${FLEET_PRESET:-all}" --reference /tmp/site/exllamav3 \
        --budget-s $(( b - 15 )) --workdir "$(mktemp -d /tmp/fleet-XXXX)" --json "$OUT/bench_fleet_ref.json" \
        > "$log" 2>&1
      tail -25 "$log" ;;
    *) echo "unknown part $p (env sweep tests viterbi dropin callers hydrate fleet)" ;;
  esac
done
[ -n "$CPID" ] && [ -z "$PREBUILT" ] && [ -z "$REF_OK" ] && [ "${WAIT_EXT:-0}" = 1 ] && reference > /dev/null
[ -n "$CPID" ] && kill "$CPID" 2>/dev/null
echo "== total $(since) s"
(cd "$OUT" && tar czf results.tgz --exclude=ext --exclude=results.tgz -- * \
  && find . -maxdepth 1 ! -name results.tgz ! -name ext ! -name . -exec rm -rf {} +)
