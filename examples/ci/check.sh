#!/usr/bin/env bash
# On a serving node (or in the container's entrypoint), before the server starts: will every look-up hit?
# Run it with the server's view: MODEL is the checkpoint as the server sees it, ENCODER_ROOT its encoder.
# Exit 0: every look-up hits; 1: some miss or are invalid (each cause printed once, with its fix); 2: usage.
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
: "${CACHE_DIR:?set CACHE_DIR}"
layers=()
if [ -n "${LAYERS:-}" ]; then layers=(--layers "$LAYERS"); fi
exl3tool cache check "$MODEL" "${ids[@]}" "${plan[@]}" --tp-size "$TP_SIZES" --bits "$BITS" \
    --cache-dir "$CACHE_DIR" "${layers[@]}"
