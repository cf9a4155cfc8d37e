#!/usr/bin/env bash
# detach a long-running command from the session that starts it: usage detached.sh LOG COMMAND...
set -euo pipefail
LOG="$1"; shift
mkdir -p "$(dirname "$LOG")"
setsid bash -c "$*" > "$LOG" 2>&1 < /dev/null &
PID=$!
disown "$PID" 2>/dev/null || true
echo "launched pid=$PID log=$LOG"
