#!/bin/bash
#| modeled_on: IsaacGHX/AgentFlow_Isaac scripts/serve_vllm.sh (`tmux new-session -d -s SESSION`, then `tmux send-keys -t SESSION:0 "...; vllm serve MODEL --port ... --tensor-parallel-size $TP" C-m`): the server's environment is the tmux server's, not this script's (tmux(1)); the system's tmux ran for real in the sandbox and failed ("create window failed"), now tmux is recorded and refused naming the session
#| model: llama
#| server:
#|   model: "@MODELS@/tiny-llama"
#|   model_resolved: "@MODELS@/tiny-llama"
#|   cache_root: "@CACHE@/exl3"
#| expect: {refused: "the server runs in a tmux session"}
MODEL="@MODELS@/tiny-llama"
TMUX_SESSION="vllm_exl3"
TP=2
tmux new-session -d -s "$TMUX_SESSION"
CMD_START="
    export VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ONLINE_CACHE_DIR=@CACHE@/exl3;
    vllm serve \"$MODEL\" --port 8007 --tensor-parallel-size $TP --quantization-config '{\"linear\":{\"weight\":\"mxfp8\"}}'
"
tmux send-keys -t "${TMUX_SESSION}:0" "$CMD_START" C-m
echo "launched in tmux session $TMUX_SESSION"
