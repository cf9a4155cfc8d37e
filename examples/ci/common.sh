# Sourced by the other scripts: the identity options, from the environment, exactly as the server is configured.
#   MODEL              Hub repo id, or the local checkpoint folder here
#   REVISION           Hub branch, tag or commit (a full commit hash is what the server should be started with)
#   SERVER_MODEL_PATH  where the server sees a local checkpoint (e.g. /models/NAME); unset for a Hub model
#   ENCODER_ROOT       the server's VLLM_EXL3_ENCODER_SOURCE path string (inside the image)
#   ENCODER_REVISION   the server's VLLM_EXL3_ENCODER_REVISION, if it sets one
#   ENCODER_SOURCE     else: a local copy of the image's encoder package, whose .py files are hashed
#   QUANT_CONFIG       the server's --quantization-config JSON, verbatim (it decides which layers are encoded);
#                      unset: exl3tool's default overlay, {"linear": {"weight": "mxfp8"}}
#   BITS (6), TP_SIZES (1,2,4,8), CACHE_DIR, BUNDLE, FILE_MODE (0644)
set -euo pipefail
: "${MODEL:?set MODEL}" "${ENCODER_ROOT:?set ENCODER_ROOT to the VLLM_EXL3_ENCODER_SOURCE of the server}"
BITS=${BITS:-6}
TP_SIZES=${TP_SIZES:-1,2,4,8}
FILE_MODE=${FILE_MODE:-0644}
ids=(--encoder-root "$ENCODER_ROOT")
if [ -n "${REVISION:-}" ]; then ids+=(--revision "$REVISION"); fi
if [ -n "${SERVER_MODEL_PATH:-}" ]; then ids+=(--server-path "$SERVER_MODEL_PATH"); fi
if [ -n "${ENCODER_REVISION:-}" ]; then ids+=(--encoder-revision "$ENCODER_REVISION"); fi
if [ -n "${ENCODER_SOURCE:-}" ]; then ids+=(--encoder-source "$ENCODER_SOURCE"); fi
plan=()
if [ -n "${QUANT_CONFIG:-}" ]; then plan=(--quantization-config "$QUANT_CONFIG"); fi
