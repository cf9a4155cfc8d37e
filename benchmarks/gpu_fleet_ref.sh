#!/usr/bin/env bash
# One device call (600 s, one H200 or H100): every fleet preset's warm and the reference (exllamav3 1.6.5's
# quantize_exl3, called as the fork calls it) on the same presets, in one bench_fleet.py run: tiles/s per GPU and
# peak GPU memory of each, and the ratios. The reference's extension JIT-compiles (about 320 s) while the warms run;
# its timing then samples each preset's heaviest shapes within what is left of $BUDGET seconds.
# Carry ./.whl (the exllamav3 wheel and what its quantize.py imports, as for gpu_release.sh) and, to skip the
# compile, ./.ext (exllamav3_ext.so.part-* from an earlier run's $OUT/ext). Logs and JSON land in $OUT.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-12}
OUT=${OUT:-/tmp/exl3tool-fleet-ref}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext
if ls .ext/exllamav3_ext.so.part-* > /dev/null 2>&1; then
  mkdir -p /tmp/prebuilt && cat .ext/exllamav3_ext.so.part-* > /tmp/prebuilt/exllamav3_ext.so
  export PYTHONPATH=$PYTHONPATH:/tmp/prebuilt
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 benchmarks/bench_fleet.py --preset "${FLEET_PRESET:-all}" --reference /tmp/site/exllamav3 \
  --budget-s "${BUDGET:-540}" ${FLEET_ARGS:-} --workdir "$(mktemp -d /tmp/fleet-XXXX)" \
  --json "$OUT/bench_fleet_ref.json" 2>&1 | tee "$OUT/bench_fleet_ref.log"
