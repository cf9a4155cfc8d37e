#!/bin/bash
# start the server in the background, its settings in vllm_config.yaml
export CUDA_VISIBLE_DEVICES=0,1
nohup vllm serve --config vllm_config.yaml > vllm_server.log 2>&1 &
