#| modeled_on: ardanlabs/ai-training makefile (a `vllm-run:` target whose recipe is `uv run vllm serve MODEL`) and alexander-sony/vllm-server README.md (`make serve` started inside a screen session): given as --launch-file, bash read `$(BITS)` as a command substitution, so the recipe's bits were empty and its TP word swallowed the next flag ("the server refuses it too"); a Makefile is refused, naming `--launch 'make -f FILE TARGET'`, which runs make in the sandbox
#| model: llama
#| server:
#|   model: "@MODELS@/tiny-llama"
#|   model_resolved: "@MODELS@/tiny-llama"
#|   cache_root: "@CACHE@/exl3"
#| expect: {refused: "is a Makefile, not a shell script"}
MODEL ?= @MODELS@/tiny-llama
BITS ?= 6
TP ?= 2
export VLLM_EXL3_ENCODER_SOURCE = /opt/exllamav3

.PHONY: vllm-run
vllm-run:
	VLLM_EXL3_ONLINE_TRELLIS_BITS=$(BITS) VLLM_EXL3_ONLINE_CACHE_DIR=@CACHE@/exl3 VLLM_EXL3_ENCODER_REVISION=v0.0.18 \
	  vllm serve $(MODEL) -tp $(TP) --quantization-config '{"linear":{"weight":"mxfp8"}}'
