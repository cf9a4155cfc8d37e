#!/usr/bin/env bash
#| modeled_on: jyothisambolu/InferenceMAX benchmarks/gptoss_fp4_b200_docker.sh (`cat > config.yaml << EOF ... EOF`, then `vllm serve $MODEL --host 0.0.0.0 --port $PORT --config config.yaml --gpu-memory-utilization 0.9 --tensor-parallel-size $TP ...`): the launcher writes its config just before the server reads it; the sandbox keeps that write in memory (or refuses it on a read-only folder), and exl3tool read the older config.yaml left here (no overlay: "encodes nothing online"); a server that reads a file its launcher has just written is refused, naming the file
#| model: llama
#| server:
#|   model: "@MODELS@/tiny-llama"
#|   model_resolved: "@MODELS@/tiny-llama"
#|   cache_root: "@CACHE@/exl3"
#| expect: {refused: "before it starts the server, whose command reads it (--config config.yaml)"}
cd @DIR@
cat > config.yaml << EOF
compilation-config: '{"cudagraph_mode":"PIECEWISE"}'
async-scheduling: true
max-num-batched-tokens: 8192
max-model-len: 10240
quantization-config: '{"linear":{"weight":"mxfp8"}}'
EOF
export PYTHONNOUSERSITE=1 VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ONLINE_CACHE_DIR=@CACHE@/exl3
export VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ENCODER_REVISION=v0.0.18
set -x
vllm serve @MODELS@/tiny-llama --host 0.0.0.0 --port 8000 --config config.yaml \
  --gpu-memory-utilization 0.9 --tensor-parallel-size 2 --max-num-seqs 512
