#!/usr/bin/env bash
# One run on an H200 (nvidia-h200, under 10 minutes): the tree against the reference (exllamav3 1.6.5) and the
# previous version. Steps, chosen by $PRE (while the reference compiles) and $POST (once it is there):
#   setup  install the exllamav3 1.6.5 wheel (+ what its quantize.py imports) from ./.whl into /tmp/site; with a
#          built extension carried in ./.ext (exllamav3_ext.so.part-*, from an earlier run's $OUT/ext) it is used
#          as is, else the CUDA extension is JIT-compiled in the background (about 5 minutes on 16 cores: keep the
#          other CPU work light meanwhile) and comes back stripped in 15 MiB parts in $OUT/ext;
#   PRE    (one GPU process at a time, little CPU)
#          ktests   the Viterbi kernel's GPU tests (tests/kernels/test_kernels_viterbi.py);
#          slots    bench_viterbi_slots.py: back-pointers against cost rows (all, or every other), K = 6 and 4, warps, programs per SM;
#          profile  profile_encode.py on this tree and on the previous version (./.bench-out/base.tar, made with
#                   `git archive -o .bench-out/base.tar <rev>`), alternately, for a same-run A/B per stage;
#          tests    every GPU-marked test (pytest -n 6: CPU heavy, best after the compile; $TEST_PATHS: a subset);
#          timeline timeline_encode.py: where a small layer's wall time goes (GPU idle gaps, Viterbi launches, syncs);
#          fleet    bench_fleet.py --preset $FLEET_PRESET (llama-8b: issue 20's warm rate; all: the deployed models);
#   POST   dropin   bench_dropin.py --reference (the fork's call convention, drop-in vs exllamav3);
#          memory   bench_encode_memory.py --reference (peak memory and time per shape);
#          fleetref bench_fleet.py --add-reference on the fleet step's results;
#          variants bench_dropin.py beside the reference under other speed rules ($VARIANTS, bench_rules.py's syntax);
#          rounds   profile_encode.py with 16 and 4 tiles per slot in an in-place chunk;
#          rules    bench_rules.py: profile_encode.py on the deployed layers under each rule set of $RULES (memory.py's
#                   EXL3TOOL_* knobs), against the dropin step's reference seconds (in PRE: against the first set);
#          tests, fleet as above.
# Carry ./golden, ./.whl (and ./.bench-out, ./.ext when used). Logs and JSON land in $OUT, packed into
# $OUT/results.tgz at the end (the device runner returns at most 8 files), beside $OUT/ext.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-14}
OUT=${OUT:-/tmp/exl3tool-release}; mkdir -p "$OUT"
PRE=${PRE-ktests slots profile}; POST=${POST-dropin memory}  # set but empty: no step
FLEET_PRESET=${FLEET_PRESET:-llama-8b}  # the fleet step's bench_fleet.py preset (all: every deployed model)
FLEET=bench_fleet_${FLEET_PRESET/llama-/}
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
. benchmarks/_reference_build.sh && reference_build "$OUT/compile.log"

step() {
  case "$1" in
    ktests)
      timeout "${T_KTESTS:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/test_kernels_viterbi.py \
        > "$OUT/ktests.log" 2>&1
      echo "== kernel GPU tests ($(since)): $(tail -1 "$OUT/ktests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/ktests.log" | head ;;
    slots)
      timeout "${T_SLOTS:-150}" python3 benchmarks/bench_viterbi_slots.py --bits "${SLOT_BITS:-6,4}" --rows "${SLOT_ROWS:-0,1,2}" \
        --warps "${SLOT_WARPS:-4,8}" --edges 1024 --per-sm "${SLOT_PER_SM:-2,4,8,12}" ${SLOT_ARGS:-} --json "$OUT/bench_viterbi_slots.json" \
        > "$OUT/bench_viterbi_slots.log" 2>&1
      echo "== bench_viterbi_slots ($(since))"; grep -v -i warn "$OUT/bench_viterbi_slots.log" | cut -c1-150 ;;
    profile)
      rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .bench-out/base.tar -C /tmp/base || { echo "no base"; return; }
      for run in 1 2; do
        PYTHONPATH=$PWD timeout 90 python3 benchmarks/profile_encode.py --json "$OUT/profile_new$run.json" \
          > "$OUT/profile_new$run.log" 2>&1
        (cd /tmp/base && PYTHONPATH=/tmp/base timeout 90 python3 benchmarks/profile_encode.py \
          --json "$OUT/profile_base$run.json" > "$OUT/profile_base$run.log" 2>&1)
      done
      echo "== profile A/B ($(since))"; python3 - "$OUT" <<'EOF'
import json, sys, statistics
out = sys.argv[1]
runs = {v: [json.load(open(f"{out}/profile_{v}{r}.json")) for r in (1, 2)] for v in ("base", "new")}
for i, row in enumerate(runs["new"][0]):
    b = [r[i]["seconds"]["total"] for r in runs["base"]]; n = [r[i]["seconds"]["total"] for r in runs["new"]]
    vb = [r[i]["seconds"]["viterbi"] for r in runs["base"]]; vn = [r[i]["seconds"]["viterbi"] for r in runs["new"]]
    print(f"({row['k']},{row['n']}) K{row['bits']}: total base {min(b)*1e3:.1f} new {min(n)*1e3:.1f} ms "
          f"(x{min(b)/min(n):.2f}); viterbi {min(vb)*1e3:.1f} -> {min(vn)*1e3:.1f}; slots {runs['base'][0][i]['slots']} -> {row['slots']}")
EOF
      ;;
    timeline)  # timeline_encode.py: GPU busy and idle time, Viterbi launches and host syncs of small layers
      timeout "${T_TIMELINE:-120}" python3 benchmarks/timeline_encode.py ${TIMELINE_ARGS:-} --json "$OUT/timeline_encode.json" \
        > "$OUT/timeline_encode.log" 2>&1
      echo "== timeline_encode ($(since))"; grep -v -i warn "$OUT/timeline_encode.log" | cut -c1-220 ;;
    tests)
      timeout "${T_TESTS:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 -rs ${TEST_PATHS:-tests} > "$OUT/tests.log" 2>&1
      echo "== GPU tests ($(since)): $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 ;;
    fleet)
      PYTHONPATH=$PWD timeout "${T_FLEET:-150}" python3 benchmarks/bench_fleet.py --preset "$FLEET_PRESET" \
        --workdir "$(mktemp -d /tmp/fleet-XXXX)" --json "$OUT/$FLEET.json" > "$OUT/$FLEET.log" 2>&1
      echo "== bench_fleet $FLEET_PRESET ($(since))"; tail -8 "$OUT/$FLEET.log" ;;
    dropin)
      timeout "${T_DROPIN:-120}" python3 benchmarks/bench_dropin.py "${REF[@]}" ${DROPIN_ARGS:-} --json "$OUT/bench_dropin.json" \
        > "$OUT/bench_dropin.log" 2>&1
      echo "== bench_dropin ($(since))"; tail -28 "$OUT/bench_dropin.log" ;;
    memory)
      timeout "${T_MEMORY:-100}" python3 benchmarks/bench_encode_memory.py --device cuda \
        --shapes "${SHAPES:-5120x6144,16384x7168,18432x7168,7168x36864}" "${MREF[@]}" \
        --json "$OUT/bench_encode_memory.json" > "$OUT/bench_encode_memory.log" 2>&1
      echo "== bench_encode_memory ($(since))"; tail -16 "$OUT/bench_encode_memory.log" ;;
    variants)  # bench_dropin.py beside the reference under other speed rules (memory.py's EXL3TOOL_* knobs), one
      # process each: $VARIANTS in bench_rules.py's syntax (NAME:VAR=VALUE,...;NAME:...), $VARIANT_ARGS e.g. --models
      while IFS=$'\t' read -r name envs; do
        env $envs timeout "${T_VARIANT:-120}" python3 benchmarks/bench_dropin.py "${REF[@]}" ${VARIANT_ARGS:-} \
          --json "$OUT/bench_dropin_$name.json" > "$OUT/bench_dropin_$name.log" 2>&1
        echo "== bench_dropin, $name: $envs ($(since))"; tail -28 "$OUT/bench_dropin_$name.log"
      done < <(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from bench_rules import parse_rules
for name, env in parse_rules(sys.argv[1]): print(name, " ".join(f"{k}={v}" for k, v in env.items()), sep="\t")' \
        "${VARIANTS:-k6-half:HALF_ROW_BITS=4,6}") ;;
    rules)  # bench_rules.py: the speed rules ($RULES) on the deployed layers against the dropin step's reference
      RJ=(); [ -f "$OUT/bench_dropin.json" ] && RJ=(--reference-json "$OUT/bench_dropin.json")
      RN=bench_rules; [ -f "$OUT/$RN.json" ] && RN=bench_rules_post  # a second rules step (POST) keeps the first's
      timeout "${T_RULES:-260}" python3 benchmarks/bench_rules.py "${RJ[@]}" ${RULES_ARGS:-} \
        --rules "${RULES:-now:;k4-pointers:COST_ROW_BITS=6}" --json "$OUT/$RN.json" > "$OUT/$RN.log" 2>&1
      echo "== $RN ($(since))"; tail -32 "$OUT/$RN.log" ;;
    rounds)  # profile_encode at 16 (the rule) and 4 tiles per slot in an in-place chunk
      for r in 16 4; do
        EXL3TOOL_CHUNK_ROUNDS_IN_PLACE=$r timeout 90 python3 benchmarks/profile_encode.py \
          --shapes "${ROUND_SHAPES:-512x4096:6,1536x3072:6,4096x4096:6,5120x6144:6}" --json "$OUT/profile_rounds$r.json" \
          > "$OUT/profile_rounds$r.log" 2>&1
        echo "== profile, $r rounds in place ($(since))"; python3 -c "
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f\"  ({r['k']},{r['n']}) K{r['bits']}: total {r['seconds']['total']*1e3:.1f} ms, viterbi {r['seconds']['viterbi']*1e3:.1f} ms, slots {r['slots']}, chunk {r['chunk']}\")" "$OUT/profile_rounds$r.json"
      done ;;
    fleetref)
      [ -f "$OUT/$FLEET.json" ] && [ ${#REF[@]} -gt 0 ] || { echo "== fleetref: no fleet results or no reference"; return; }
      timeout "${T_FLEETREF:-150}" python3 benchmarks/bench_fleet.py --add-reference "$OUT/$FLEET.json" "${REF[@]}" \
        --json "$OUT/${FLEET}_ref.json" > "$OUT/${FLEET}_ref.log" 2>&1
      echo "== bench_fleet $FLEET_PRESET + reference ($(since))"; tail -8 "$OUT/${FLEET}_ref.log" ;;
  esac
}

for s in $PRE; do step "$s"; done
while kill -0 $CPID 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "${T_COMPILE:-420}" ]; do sleep 2; done
echo "== reference: $(tail -1 "$OUT/compile.log") ($(since); prebuilt: ${PREBUILT:-no})"
if kill -0 $CPID 2>/dev/null || ! grep -q "compile+import ok" "$OUT/compile.log"; then
  kill $CPID 2>/dev/null; REF=(); MREF=(--no-reference); echo "== the reference is NOT measured in this run"
else
  REF=(--reference /tmp/site/exllamav3); MREF=("${REF[@]}")
  SO=$(find /tmp/torch_ext -name 'exllamav3_ext*.so' 2>/dev/null | head -1)
  if [ -z "$PREBUILT" ] && [ -n "$SO" ]; then
    strip --strip-debug -o /tmp/exllamav3_ext.so "$SO" && mkdir -p "$OUT/ext" \
      && split -b 15m /tmp/exllamav3_ext.so "$OUT/ext/exllamav3_ext.so.part-" && ls -la "$OUT/ext"
  fi
fi
for s in $POST; do step "$s"; done
echo "== total $(since)"
# at most 8 files come back from the device runner: everything but the extension's parts in one archive
(cd "$OUT" && tar czf results.tgz --exclude=ext --exclude=results.tgz -- * && find . -maxdepth 1 -type f ! -name results.tgz -delete)
