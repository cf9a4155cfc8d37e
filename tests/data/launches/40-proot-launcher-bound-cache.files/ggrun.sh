#!/bin/bash
# Runs a command inside an image's root folder extracted on this machine, with no container runtime: proot traces
# the command and bind-mounts host folders into it (our own words after the shape of a public ggrun.sh).
set -euo pipefail
ROOTFS="${GG_ROOTFS:-/var/tmp/gg-rootfs}"
MODELS="${GG_MODELS:-/var/tmp/models}"
CACHE="${GG_CACHE:-/var/tmp/gg-cache}"
PROOT="${PROOT:-/var/tmp/proot}"
mkdir -p "$CACHE"
binds=(-b "$MODELS" -b "$CACHE:/cache")
for lib in libcuda.so.1 libnvidia-ml.so.1; do  # the driver's libraries, bound over the guest's names when present
  host=$(ls -1 /usr/lib/x86_64-linux-gnu/${lib%%.so.*}.so.[0-9]*.[0-9]* 2>/dev/null | head -1 || true)
  [ -n "$host" ] && binds+=(-b "$host:/usr/lib/x86_64-linux-gnu/$lib")
done
exec "$PROOT" -R "$ROOTFS" "${binds[@]}" \
  /usr/bin/env -i PATH=/opt/venv/bin:/usr/local/bin:/usr/bin:/bin HOME=/root TERM=dumb \
  HF_HUB_OFFLINE=1 HF_HOME=/cache/hf \
  VLLM_EXL3_ENCODER_SOURCE="${VLLM_EXL3_ENCODER_SOURCE:-/opt/exllamav3-python/exllamav3}" \
  ${GG_ENV:-} "$@"
