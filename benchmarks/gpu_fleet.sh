#!/usr/bin/env bash
# One run on an H200 (nvidia-h200, about 4 minutes): the deployed models' warm rate (tiles/s per GPU).
#   1. the GPU test of the two-stream split encode (same bytes as one stream);
#   2. bench_fleet.py llama-8b with and without the split (8B shapes, TP 1,2,4,8; same bytes; stage timers);
#   3. bench_fleet.py on the deployed models' presets.
# Logs and JSON land in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/exl3tool-gpu}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout "${T_TESTS:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider -k split tests/checkpoint/test_shared_encodes.py > "$OUT/tests.log" 2>&1
echo "== tests: $(tail -1 "$OUT/tests.log")"
WORK=$(mktemp -d /tmp/fleet-XXXX)
timeout "${T_8B:-120}" python3 benchmarks/bench_fleet.py --preset llama-8b --both --workdir "$WORK" --json "$OUT/bench_fleet_8b.json" 2>&1 | tee "$OUT/bench_fleet_8b.log"
timeout "${T_FLEET:-200}" python3 benchmarks/bench_fleet.py --preset qwen38-27b --preset glm53-flash-tp2 --preset deepseek-v3-tp8 --preset glm5-tp8 --workdir "$WORK" --json "$OUT/bench_fleet.json" 2>&1 | tee "$OUT/bench_fleet.log"
nvidia-smi --query-gpu=name,memory.used --format=csv > "$OUT/nvidia-smi.txt" 2>&1
