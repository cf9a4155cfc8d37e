#!/usr/bin/env bash
# Write this model's entries of $TP_SIZES from $CACHE_DIR into $BUNDLE (BUNDLE=- writes to stdout).
# The model identity comes from $IDENTITY_JSON (written by identity-key.sh), so the bundle matches its key.
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
: "${CACHE_DIR:?set CACHE_DIR}" "${BUNDLE:?set BUNDLE}"
IDENTITY_JSON=${IDENTITY_JSON:-identity.json}
if [ ! -f "$IDENTITY_JSON" ]; then exl3tool identity "$MODEL" "${ids[@]}" --json > "$IDENTITY_JSON"; fi
model_id=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"]["identity"])' "$IDENTITY_JSON")
exl3tool cache export "$BUNDLE" --model "$model_id" --tp-sizes "$TP_SIZES" --cache-dir "$CACHE_DIR"
