#!/usr/bin/env bash
# Warm $CACHE_DIR for every rank of $TP_SIZES; NPROC > 1 shares the work between that many GPUs (torchrun).
# LAYERS (a glob) restricts the layers, DEVICE (auto) picks the device. SHARD=I/N warms only shard I of N (a CI
# matrix); without it a Slurm array's or a Kubernetes Indexed Job's index is read (SHARD_COUNT: the Job's count).
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
: "${CACHE_DIR:?set CACHE_DIR}"
run=(exl3tool)
if [ "${NPROC:-1}" -gt 1 ]; then run=(torchrun --nproc-per-node "$NPROC" -m exl3tool); fi
layers=()
if [ -n "${LAYERS:-}" ]; then layers=(--layers "$LAYERS"); fi
shard=()
if [ -n "${SHARD:-}" ]; then shard=(--shard "$SHARD"); fi
if [ -n "${SHARD_COUNT:-}" ]; then shard+=(--shard-count "$SHARD_COUNT"); fi
"${run[@]}" cache warm "$MODEL" "${ids[@]}" "${plan[@]}" --tp-size "$TP_SIZES" --bits "$BITS" \
    --cache-dir "$CACHE_DIR" --file-mode "$FILE_MODE" --device "${DEVICE:-auto}" "${layers[@]}" "${shard[@]}" --json \
    > "${WARM_JSON:-warm.json}"
if [ -n "${CACHE_OWNER:-}" ]; then chown -R "$CACHE_OWNER" "$CACHE_DIR"; fi
