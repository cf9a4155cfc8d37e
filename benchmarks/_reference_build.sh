# Sourced by the GPU scripts (gpu_all.sh, gpu_callers.sh, gpu_dropin.sh, gpu_hydrate.sh): the reference's extension,
# from ./.ext (exllamav3_ext.so.part-*, a stripped build an earlier call returned) or JIT-built in the background.
#   reference_build LOG   sets PREBUILT (1 with ./.ext), adds to PYTHONPATH, starts the build+import into LOG, CPID
# Expects PYTHONPATH and TORCH_EXTENSIONS_DIR exported and the wheels installed under /tmp/site.
reference_build() {
  PREBUILT=
  if ls .ext/exllamav3_ext.so.part-* > /dev/null 2>&1; then
    mkdir -p /tmp/prebuilt && cat .ext/exllamav3_ext.so.part-* > /tmp/prebuilt/exllamav3_ext.so && PREBUILT=1
    export PYTHONPATH=$PYTHONPATH:/tmp/prebuilt
  fi
  # a build killed by an earlier call on the same warm machine leaves its lock: the next build would wait on it for good
  pgrep -f "[_]reference_compile.py" > /dev/null || rm -f "${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}"/*/lock
  python3 benchmarks/_reference_compile.py > "$1" 2>&1 &
  CPID=$!
}
