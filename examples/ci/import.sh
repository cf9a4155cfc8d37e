#!/usr/bin/env bash
# On a serving node, before the server starts: publish $BUNDLE (a file, or - for stdin) into $CACHE_DIR,
# readable by the server's user (FILE_MODE 0644; CACHE_OWNER=uid:gid hands the tree to that user).
set -euo pipefail
: "${CACHE_DIR:?set CACHE_DIR}" "${BUNDLE:?set BUNDLE}"
exl3tool cache import "$BUNDLE" --cache-dir "$CACHE_DIR" --file-mode "${FILE_MODE:-0644}"
if [ -n "${CACHE_OWNER:-}" ]; then chown -R "$CACHE_OWNER" "$CACHE_DIR"; fi
