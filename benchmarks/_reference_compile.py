"""Build (JIT) and import exllamav3 1.6.5's CUDA extension from /tmp/site, the reference every GPU script times
against; run in the background by ``_reference_build.sh``, its last line says ok or FAILED with the seconds."""
import sys
import time

sys.path.insert(0, "tests")
start = time.perf_counter()
from _fork_loader import load_quantize_exl3  # noqa: E402

try:
    load_quantize_exl3("/tmp/site/exllamav3", package="_exllamav3_reference")
    print(f"compile+import ok {time.perf_counter() - start:.1f} s")
except BaseException as exc:
    print(f"compile+import FAILED after {time.perf_counter() - start:.1f} s: {type(exc).__name__}: {exc}")
    raise
