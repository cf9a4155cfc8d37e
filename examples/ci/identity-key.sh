#!/usr/bin/env bash
# Print the bundle's key (model identity, encoder identity, bits) and write the identities to $IDENTITY_JSON.
# The server looks entries up by exactly these; a bundle with another key is of no use to it.
here=$(cd "$(dirname "$0")" && pwd)
source "$here/common.sh"
IDENTITY_JSON=${IDENTITY_JSON:-identity.json}
exl3tool identity "$MODEL" "${ids[@]}" --json > "$IDENTITY_JSON.tmp"  # a failed run leaves no stale key
mv "$IDENTITY_JSON.tmp" "$IDENTITY_JSON"
python3 - "$IDENTITY_JSON" "$BITS" <<'PY'
import json, sys

doc = json.load(open(sys.argv[1]))
print(f"exl3-{doc['model']['identity'][:20]}-{doc['encoder']['identity'][:20]}-k{sys.argv[2]}")
for warning in doc["warnings"]:
    print(f"warning: {warning}", file=sys.stderr)
print(f"server: --revision {doc['model']['server_revision'] or '(none)'}: {doc['model']['server_revision_note']}",
      file=sys.stderr)
PY
