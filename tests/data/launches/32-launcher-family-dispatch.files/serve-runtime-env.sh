#!/usr/bin/env bash
# Sourced by the presets: the process environment shared by a GPU probe and the server (our own words).
configure_runtime_env() {
  local tp="$1"
  local nccl_lib="${NCCL_LIB:-/opt/nccl/libnccl.so.2}"
  export CUDA_DEVICE_ORDER=PCI_BUS_ID
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((tp * 2))}"
  export NCCL_P2P_LEVEL="${NCCL_P2P_LEVEL:-SYS}"
  if [[ -f "${nccl_lib}" ]]; then
    export LD_PRELOAD="${nccl_lib}${LD_PRELOAD:+:${LD_PRELOAD}}"
  fi
}
