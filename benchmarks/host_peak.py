"""Host memory of one CPU encode, phase by phase, for any layer in seconds: peak RSS above the fp32 weight.

The resident high-water mark (VmHWM, reset through ``/proc/self/clear_refs``) is read and reset at every phase
boundary, so each phase's figure is the largest resident size while it ran, less the resident size with the weight
loaded. Phases (``PHASES``): checks (the weight's finiteness, the sign vectors, the plan), regularize, scale search,
tile quantization (a chunk's tiles gathered, the Viterbi call, their squared error scattered back), packing
(``pack_trellis`` of a chunk, with the chunk's tiles, values and states alive), proxy error (the end of
``finish_encode``: the float64 sum and the fp16 scales). A stage's phase lasts until the next one starts.

The numba Viterbi quantizes ~200 tiles/s on 2 cores: a (7168, 36864) layer's 1M tiles take ~90 minutes, one chunk of
its plan several. What the kernel allocates does not depend on the tiles' values: the (n, 256) int32 states it
returns and a fixed scratch per thread (``kernels.viterbi_numba._quantize_tiles_kernel``). With ``real_tiles`` R each call
allocates the (n, 256) int32 result first, runs the real kernel on the first R tiles (its scratch and its own R-row
result) and copies their states into every row, so it holds what the kernel holds plus R KiB; every other operation
of the encode runs unchanged on tensors of the real size, every chunk of the plan included. The states (and so g,
the trellis and the proxy error) are not the real ones, and they depend on the chunking: only the memory is real.
``calibrate`` compares one call of each kind on the same tiles.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import numpy as np
import torch

__all__ = ["PHASES", "PhaseMeter", "calibrate", "can_measure", "measure_encode", "release_free_heap",
           "standin_viterbi", "warm_up", "weight"]

PHASES = ("checks", "regularize", "scale search", "tile quantization", "packing", "proxy error")
_STAGE_PHASE = {"h2d": "checks", "regularize": "regularize", "scale_search": "scale search",
                "viterbi": "tile quantization", "pack": "proxy error"}  # encode_linear's timer stages -> phases


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Set VmHWM to the current resident size (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def can_measure() -> str | None:
    """None where the resident high-water mark can be read and reset, else why not."""
    try:
        _status("VmHWM:")
        reset_peak()
    except (OSError, RuntimeError) as exc:
        return f"the resident high-water mark cannot be read and reset here ({exc})"
    return None


def release_free_heap() -> None:
    """Give the C heap's free pages back (glibc ``malloc_trim``), so that memory freed before a measurement cannot be
    reused unseen by it: the figures are those of a fresh process."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError, TypeError):
        pass


class PhaseMeter:
    """Peak resident bytes above ``base`` (the resident size when made) per phase; one phase at a time."""

    def __init__(self, first: str = PHASES[0]) -> None:
        self.base = _status("VmRSS:")
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._phase: Optional[str] = first
        self._since = time.perf_counter()
        reset_peak()

    def enter(self, phase: Optional[str]) -> Optional[str]:
        """Close the current phase (record its peak), open ``phase``; returns the phase that was current."""
        peak = _status("VmHWM:") - self.base
        now = time.perf_counter()
        prev = self._phase
        if prev is not None:
            self.peaks[prev] = max(self.peaks.get(prev, 0), peak)
            self.seconds[prev] = self.seconds.get(prev, 0.0) + now - self._since
        reset_peak()
        self._phase, self._since = phase, now
        return prev

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        prev = self.enter(name)
        try:
            yield
        finally:
            self.enter(prev)

    def timer(self):
        """A ``StageTimer`` stand-in for ``encode_linear(timer=...)``: each stage opens its phase, which lasts until
        the next stage (what runs between two stages is the tail of the first)."""
        meter = self

        @contextmanager
        def stage(name: str, device=None) -> Iterator[None]:
            meter.enter(_STAGE_PHASE[name])
            yield

        return stage


@contextmanager
def standin_viterbi(real_tiles: int) -> Iterator[dict]:
    """Within, the numba kernel runs on the first ``real_tiles`` tiles of each call and its (n, 256) int32 result
    holds their states in every row (see the module docstring); yields counts of the calls and tiles."""
    import exl3tool.kernels.viterbi_numba as nb

    if real_tiles < 1:
        raise ValueError(f"real_tiles must be at least 1, got {real_tiles}")
    real_fn = nb.quantize_tiles_numba
    counts = {"calls": 0, "tiles": 0, "real_tiles": 0}

    def quantize_tiles_numba(x: np.ndarray, bits: int, dec16: np.ndarray, force_generic: bool = False) -> np.ndarray:
        n = x.shape[0]
        r = min(n, real_tiles)
        out = np.empty((n, 256), dtype=np.int32)  # the kernel's own first allocation, before its scratch
        head = real_fn(x[:r], bits, dec16, force_generic)
        for lo in range(0, n, r):  # every row written, as the kernel writes them (no temporary)
            out[lo : lo + r] = head[: n - lo]
        del head
        counts["calls"] += 1
        counts["tiles"] += n
        counts["real_tiles"] += r
        return out

    nb.quantize_tiles_numba = quantize_tiles_numba
    try:
        yield counts
    finally:
        nb.quantize_tiles_numba = real_fn


@contextmanager
def _packing_phase(meter: PhaseMeter) -> Iterator[None]:
    import exl3tool.encode.online as online

    real_pack = online.pack_trellis

    def pack_trellis(states: torch.Tensor, bits: int) -> torch.Tensor:
        with meter.phase("packing"):
            return real_pack(states, bits)

    online.pack_trellis = pack_trellis
    try:
        yield
    finally:
        online.pack_trellis = real_pack


def weight(k: int, n: int) -> torch.Tensor:
    """The benchmark's fp32 (k, n) weight (per-column scales, as ``bench_encode_memory``'s)."""
    gen = torch.Generator().manual_seed(k * 131 + n)
    return torch.randn(k, n, generator=gen) * torch.empty(1, n).uniform_(0.005, 0.05, generator=gen)


def warm_up() -> None:
    """One small real encode (64 tiles, no scale search): numba's compiled kernel loaded and its threads started
    outside the figures."""
    from exl3tool.encode.online import encode_linear

    encode_linear(weight(128, 128), bits=6, seed=1, g_scale=0.8)


def measure_encode(k: int, n: int, *, bits: int = 6, seed: int = 1234, real_tiles: Optional[int] = 4,
                   budget: Optional[int] = None) -> dict:
    """Peak resident bytes per phase of ``encode_linear`` of a (k, n) fp32 weight on the CPU, above the resident
    size with the weight allocated, with the plan's figures; ``real_tiles`` None runs the real kernel on every
    tile. Call ``warm_up`` first."""
    from exl3tool.encode.memory import plan_encode_memory
    from exl3tool.encode.online import encode_linear

    w = weight(k, n)
    release_free_heap()
    meter = PhaseMeter()
    t0 = time.perf_counter()
    standin = standin_viterbi(real_tiles) if real_tiles is not None else nullcontext(None)
    with _packing_phase(meter), standin as counts:
        enc = encode_linear(w, bits=bits, seed=seed, memory_budget_bytes=budget, timer=meter.timer())
        del enc
    meter.enter(None)
    wall = time.perf_counter() - t0
    plan = plan_encode_memory(k, n, bits, "cpu", budget)
    model = plan.phases(k, n, bits, "cpu")
    model["packing"] = model["tile quantization"]  # on the CPU the per-tile figure includes the packing
    return {"k": k, "n": n, "bits": bits, "weight_bytes": 4 * k * n, "peaks": meter.peaks, "model": model,
            "plan": plan, "seconds": meter.seconds, "wall_s": wall, "viterbi": counts}


def calibrate(tiles: int, real_tiles: int, bits: int = 6) -> dict:
    """Peak resident bytes of one ``quantize_tiles`` call on ``tiles`` random tiles: the stand-in, then the real
    kernel (the heap given back before each), with their seconds."""
    from exl3tool.encode.viterbi import quantize_tiles

    x = torch.randn(tiles, 256) * 0.3
    out: dict = {"tiles": tiles, "real_tiles": real_tiles}
    for label in ("standin", "real"):
        release_free_heap()
        meter = PhaseMeter(first="setup")
        with meter.phase(label), (standin_viterbi(real_tiles) if label == "standin" else nullcontext()):
            values, states = quantize_tiles(x, bits)
            del values, states
        meter.enter(None)
        out[f"{label}_bytes"] = meter.peaks[label]
        out[f"{label}_s"] = meter.seconds[label]
    return out
