#!/usr/bin/env bash
# Write this model's entries of $TP_SIZES from $CACHE_DIR into $BUNDLE (BUNDLE=- writes to stdout).
# The model identity is computed here from the same settings; when identity-key.sh wrote $IDENTITY_JSON (the
# bundle's key), it must name the same model, or the bundle would not match its key.
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
: "${CACHE_DIR:?set CACHE_DIR}" "${BUNDLE:?set BUNDLE}"
IDENTITY_JSON=${IDENTITY_JSON:-identity.json}
read_id='import json, sys
d = json.load(sys.stdin)
sys.exit(2) if "model" not in d else print(d["model"]["identity"])'  # an error document: exl3tool said why
model_id=$(exl3tool identity "$MODEL" "${ids[@]}" --json | python3 -c "$read_id")
if [ -f "$IDENTITY_JSON" ]; then
    keyed=$(python3 -c "$read_id" < "$IDENTITY_JSON")
    if [ "$keyed" != "$model_id" ]; then
        echo "error: $IDENTITY_JSON is for model ${keyed:0:20}, not ${model_id:0:20} (this MODEL);" \
             "rerun identity-key.sh with these settings" >&2
        exit 2
    fi
fi
exl3tool cache export "$BUNDLE" --model "$model_id" --tp-size "$TP_SIZES" --cache-dir "$CACHE_DIR"
