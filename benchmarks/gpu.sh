#!/usr/bin/env bash
# The one runner for GPU jobs: named parts, run in order; logs and JSON land in $OUT (default /tmp/exl3tool-gpu).
#
#   bash benchmarks/gpu.sh PART [PART ...]           parts one after another, on this process's GPU(s)
#   bash benchmarks/gpu.sh A B / C D                 lanes: A then B on GPU 0 while C then D run on GPU 1
#   bash benchmarks/gpu.sh A / B then C              `then` waits for every lane, then runs C (on all GPUs)
#   bash benchmarks/gpu.sh check                     a preset (below); --list shows parts and presets
#   DRY_RUN=1 bash benchmarks/gpu.sh final           print the lanes and commands, run nothing
#
# Run from the repository root (the device machine's copy). Goldens: $EXL3TOOL_GOLDEN, default ./golden (carry it;
# 31 MB). MiniLM: $EXL3TOOL_MINILM_DIR, default ./.minilm (carry it; it does not fit in one carry with ./golden).
# Time limits per part: T_<PART> seconds (e.g. T_TESTS=300). benchmarks/README.md says what each part measured.
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 EXL3TOOL_GOLDEN=${EXL3TOOL_GOLDEN:-$PWD/golden}
export EXL3TOOL_MINILM_DIR=${EXL3TOOL_MINILM_DIR:-$PWD/.minilm}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
OUT=${OUT:-/tmp/exl3tool-gpu}
ENC=(--encoder-root /encoders/exllamav3 --encoder-revision gpu-verify)

declare -A ABOUT=(
  [env]="versions of torch and triton, the GPUs and their clocks"
  [tests]="every GPU-marked test (golden encodes byte for byte, Viterbi, GEMM paths, signs); needs the goldens"
  [gemm-tests]="the trellis GEMM's GPU tests only (no goldens needed)"
  [verify]="synthetic Llama (hidden 2048, 2 layers): warm TP 1,2 on the GPU, verify TP 2 with the trellis GEMM"
  [minilm]="the MiniLM example: quality_minilm.py (warm 36 layers, verify, embeddings), then exl3tool verify"
  [encode]="encode_linear's time for (4096, 4096) and (4096, 14336) (bench_encode.py, 3 repeats)"
  [kernels]="bench_kernels.py: the Triton Viterbi and GEMM tables against the reference kernels"
  [gemm]="the trellis GEMM benchmark, default configs, m in {1,4,16,64,512,4096}"
  [gemm-sweep]="every candidate GEMM config at m = 1 .. 4096 (_bench_gemm.py, EXL3_BENCH_SWEEP=1)"
  [determinism]="the stage-by-stage determinism probe in two processes, then the full-size warm determinism check"
  [warm-torchrun]="the 2-GPU warm scaling run (bench_warm_torchrun.py --nproc 2 --layers 4, TP 1,2); 2 GPUs"
  [dropin]="the drop-in quantize_exl3 against exllamav3 1.6.5 (gpu_dropin.sh: wheel from \$WHL, JIT compile, bench_dropin.py)"
  [release]="the tree against exllamav3 1.6.5 in one run (gpu_release.sh: GPU tests during the JIT compile, bench_dropin, bench_encode_memory; carry golden and .whl)"
  [fleet]="the deployed models' warm presets and the 8B pipeline stages (gpu_fleet.sh: bench_fleet.py)"
)
PARTS=(env tests gemm-tests verify minilm encode kernels gemm gemm-sweep determinism warm-torchrun dropin release fleet)
declare -A PRESET=(
  [check]="env tests verify encode"                                  # nvidia-h200, about 6 min: after a merge
  [final]="env kernels / tests verify then warm-torchrun"            # nvidia-h200-x2, about 6 min: the figures
  [confirm]="env kernels / gemm-tests verify minilm"                 # nvidia-h200-x2, about 4 min; carry .minilm
  [diagnose]="env gemm-tests gemm-sweep / determinism"               # nvidia-h200-x2: GEMM sweep, determinism
  [gemm-speed]="env gemm-tests gemm"                                 # nvidia-h200: the GEMM table
)

lim() { local v="T_${1//-/_}"; v=${v^^}; echo "${!v:-$2}"; }   # T_<PART> or the default
run() { if [ -n "${DRY_RUN:-}" ]; then echo "    $*" >&3; else "$@"; fi; }  # fd 3: the runner's own stdout
exec 3>&1

part() {  # one part: its command(s), output to $OUT/<part>.log, then the lines worth reading
  local name=$1 log="$OUT/$1.log"
  echo "== $name (GPU ${CUDA_VISIBLE_DEVICES:-all}) $(date +%T): ${ABOUT[$name]}"
  case $name in
    env)
      run nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
      run python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" ;;
    tests)
      run timeout "$(lim tests 300)" python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 -rs tests > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && { tail -1 "$log"; grep -E "^(FAILED|ERROR)" "$log" | head -20; } ;;
    gemm-tests)
      run timeout "$(lim gemm-tests 210)" python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 tests/kernels/test_kernels_gemm.py > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && { tail -1 "$log"; grep -E "^(FAILED|ERROR)" "$log" | head -20; } ;;
    verify)
      local w; w=$(mktemp -d)
      run python3 -c "from exl3tool.checkpoint import write_llama_checkpoint; write_llama_checkpoint('$w/model', hidden=2048, heads=16, kv_heads=4, intermediate=5632, layers=2, seed=5)"
      run timeout "$(lim verify 240)" python3 -m exl3tool cache warm "$w/model" --tp-size 1,2 --cache-dir "$w/cache" "${ENC[@]}" --device cuda > "$log" 2>&1
      COLUMNS=200 run timeout 120 python3 -m exl3tool verify "$w/model" --tp-size 2 --cache-dir "$w/cache" "${ENC[@]}" --device cuda --report "$OUT/verify_synthetic.md" >> "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && { grep -E "encoded|pass," "$log" | tail -3; } ;;
    minilm)
      local w; w=$(mktemp -d)
      run timeout "$(lim minilm 150)" python3 benchmarks/quality_minilm.py --device cuda --cache-dir "$w/minilm" --json "$OUT/quality_minilm.json" > "$log" 2>&1
      COLUMNS=200 run timeout 100 python3 -m exl3tool verify "$EXL3TOOL_MINILM_DIR" --layers 'encoder.layer.*' --dtype float32 --cache-dir "$w/minilm" --encoder-root /encoders/exllamav3 --encoder-revision minilm-example --device cuda --report "$OUT/verify_minilm.md" >> "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && { grep -E "warmed in|embeddings via|pass," "$log"; } ;;
    encode)
      run timeout "$(lim encode 120)" python3 benchmarks/bench_encode.py --repeats 3 > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -8 "$log" ;;
    kernels)
      run timeout "$(lim kernels 300)" python3 benchmarks/bench_kernels.py > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -30 "$log" ;;
    gemm)
      EXL3_BENCH_PARTS=gemm run timeout "$(lim gemm 200)" python3 benchmarks/bench_kernels.py > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -30 "$log" ;;
    gemm-sweep)
      EXL3_BENCH_SWEEP=1 EXL3_BENCH_MS=${EXL3_BENCH_MS:-1,4,16,64,128,256,512,4096} run timeout "$(lim gemm-sweep 330)" python3 benchmarks/_bench_gemm.py > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && { grep -v "^  sweep" "$log" | tail -60; } ;;
    determinism)
      run timeout 150 python3 benchmarks/determinism_probe.py --device cuda:0 --out "$OUT/probe_a.json" > /dev/null
      run timeout 150 python3 benchmarks/determinism_probe.py --device cuda:0 --out "$OUT/probe_b.json" > /dev/null
      run python3 benchmarks/determinism_probe.py --compare "$OUT/probe_a.json" "$OUT/probe_b.json" > "$log" 2>&1
      run timeout "$(lim determinism 240)" python3 benchmarks/determinism_check.py --devices cuda:0,cuda:0 --torchrun 2 --hidden 4096 --intermediate 14336 >> "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -40 "$log" ;;
    warm-torchrun)
      run timeout "$(lim warm-torchrun 200)" python3 benchmarks/bench_warm_torchrun.py --nproc 2 --layers 4 > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -8 "$log" ;;
    dropin)
      # its own steps (install, background compile, tests, benchmark) stay in gpu_dropin.sh; run with timeout_s 600
      OUT="$OUT/dropin" run bash benchmarks/gpu_dropin.sh > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -30 "$log" ;;
    release)
      # its own steps stay in gpu_release.sh (about 7 minutes): run with timeout_s 600
      OUT="$OUT/release" run bash benchmarks/gpu_release.sh > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -40 "$log" ;;
    fleet)
      OUT="$OUT/fleet" run bash benchmarks/gpu_fleet.sh > "$log" 2>&1
      [ -z "${DRY_RUN:-}" ] && tail -40 "$log" ;;
  esac
}

lane() { for p in "$@"; do part "$p"; done; }

stage() {  # parts with `/` between lanes; lane k runs on GPU k, all lanes at once
  local lanes=() cur=""
  for a in "$@"; do if [ "$a" = / ]; then lanes+=("$cur"); cur=""; else cur="$cur $a"; fi; done
  lanes+=("$cur")
  if [ ${#lanes[@]} -eq 1 ]; then lane ${lanes[0]}; return; fi
  local i=0
  for l in "${lanes[@]}"; do
    if [ -n "${DRY_RUN:-}" ]; then (export CUDA_VISIBLE_DEVICES=$i; lane $l)
    else (export CUDA_VISIBLE_DEVICES=$i; lane $l > "$OUT/lane$i.txt" 2>&1) & fi
    i=$((i + 1))
  done
  wait
  [ -z "${DRY_RUN:-}" ] && for ((k = 0; k < i; k++)); do cat "$OUT/lane$k.txt"; done
  return 0
}

if [ $# -eq 0 ] || [ "$1" = --list ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  echo "parts:"; for p in "${PARTS[@]}"; do printf '  %-14s %s\n' "$p" "${ABOUT[$p]}"; done
  echo "presets:"; for p in check final confirm diagnose gemm-speed; do printf '  %-14s %s\n' "$p" "${PRESET[$p]}"; done
  [ $# -eq 0 ] && exit 2 || exit 0
fi
args=()
for a in "$@"; do
  if [ -n "${PRESET[$a]:-}" ]; then args+=(${PRESET[$a]})
  elif [ -n "${ABOUT[$a]:-}" ] || [ "$a" = / ] || [ "$a" = then ]; then args+=("$a")
  else echo "error: unknown part or preset '$a' (bash benchmarks/gpu.sh --list)" >&2; exit 2; fi
done
mkdir -p "$OUT"
current=()
for a in "${args[@]}" then; do
  if [ "$a" = then ]; then [ ${#current[@]} -gt 0 ] && stage "${current[@]}"; current=(); else current+=("$a"); fi
done
