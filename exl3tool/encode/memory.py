"""How much memory one encode takes, and how it fits a budget: the sizes of its Viterbi chunks.

An encode of a (k, n) weight (W = 4 k n bytes in fp32) runs in phases whose peaks, above the weight itself,
are known in closed form (``encode_linear`` frees every intermediate as soon as it is used):

* regularize: 2 W (one scaled copy and its Hadamard product; the RMS reductions run in slabs);
* scale search: 2 W (the regularised weight, its tiles squared for the per-tile mean square), then the weight and
  the sample's batch of five scales (with its values and states) while it goes through the quantizer in chunks;
* tile quantization: 1.19 W at K = 6 (the regularised weight, overwritten chunk by chunk with the squared
  error, plus the packed trellis) and one chunk of tiles in flight, each with its Viterbi scratch (on a GPU
  256 * 2^(16-K) bytes of back-pointers, 256 KiB at K = 6);
* proxy error: 1 W + the trellis + 2 W (the squared error widened to float64 for the sum).

The budget is shared out so that the chunk gets what the fixed phases leave. The default budget of one encode
is what exllamav3's ``quantize_exl3`` needs for the same layer (5.5 W, measured on an H200), with a floor for
small layers, where every encoder needs a few waves of Viterbi scratch whatever the weight's size.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES", "EncodeMemoryError", "EncodeMemoryPlan", "MIN_CHUNK_TILES", "REFERENCE_FACTOR",
    "default_budget", "device_budget", "plan_encode_memory", "reference_peak_bytes", "viterbi_bytes_per_tile",
]

REFERENCE_FACTOR = 5.5  # exllamav3 1.6.5 quantize_exl3 peak / fp32 weight, uncalibrated K6 on an H200 (issue 24)
MIN_CHUNK_TILES = 128  # the smallest Viterbi chunk: slower than a full wave, but it still finishes
DEFAULT_FLOOR_TILES = 1024  # a default budget always holds this many tiles of scratch (a small layer's whole)
DEFAULT_MAX_CHUNK_BYTES = 2 << 30  # more scratch than this does not make the kernel faster (8,192 tiles at K=6)
_TILE_BYTES = 1024  # 256 fp32 values
_GPU_TILE_EXTRA = 8 * 1024  # per tile in flight besides the scratch: tiles, values, states, indices, packing
_CPU_TILE_BYTES = 48 * 1024  # per tile in flight on the CPU (numba keeps its scratch per thread, not per tile)
_SLACK = 4 << 20  # small tensors: sign vectors, scales, codebook table, per-launch bookkeeping
GPU_MARGIN_BYTES = 1 << 30  # left free by the default device budget (allocator fragmentation, CUDA context)
GPU_MARGIN_FRACTION = 0.05  # ... or this share of the device, whichever is larger


class EncodeMemoryError(ValueError):
    """An encode does not fit its memory budget even at the smallest chunk; the message gives the figure."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


@dataclass(frozen=True)
class EncodeMemoryPlan:
    """Chunking of one encode: ``chunk_tiles`` tiles per Viterbi call; ``peak_bytes`` the predicted peak.

    Every figure is bytes above the fp32 weight the caller passes in.
    """

    budget_bytes: int
    chunk_tiles: int
    peak_bytes: int
    fixed_bytes: int  # the largest phase that does not depend on the chunk
    tile_bytes: int  # bytes per tile in flight


def weight_bytes(k: int, n: int) -> int:
    return 4 * k * n


def reference_peak_bytes(k: int, n: int) -> int:
    """What the reference's uncalibrated encode of a (k, n) layer takes above its fp32 weight (5.5 W)."""
    return int(REFERENCE_FACTOR * weight_bytes(k, n))


def viterbi_bytes_per_tile(bits: int, device_type: str) -> int:
    """Bytes one tile in flight costs: Viterbi back-pointers and cost scratch on a GPU, buffers on the CPU."""
    if device_type == "cpu":
        return _CPU_TILE_BYTES
    edges = 1 << (16 - bits)
    return 256 * edges + 4 * edges + _GPU_TILE_EXTRA


def _trellis_bytes(k: int, n: int, bits: int) -> int:
    return (k // 16) * (n // 16) * 32 * bits  # 16 * bits int16 per tile


def _fixed_bytes(k: int, n: int, bits: int, sample_tiles: int) -> tuple[int, int]:
    """(the largest chunk-independent phase, what stays allocated while tiles are quantized)."""
    w = weight_bytes(k, n)
    trellis = _trellis_bytes(k, n, bits)
    regularize = 2 * w + w // 4  # the copy, its product, one reduction slab
    search = w + sample_tiles * (_TILE_BYTES // 5 + _TILE_BYTES + _TILE_BYTES + _TILE_BYTES // 2)
    scale = max(2 * w, search)  # weight and its squared tiles; or the sample, the batch, its values and states
    error = w + trellis + 2 * w
    during_quantize = max(w + trellis, search)
    return max(regularize, scale, error) + _SLACK, during_quantize + _SLACK


def sample_tile_count(k: int, n: int, width: int = 3) -> int:
    """Tiles in the scale search's largest batch (5 scales of the sample, spec 7.4)."""
    tk, tn = k // 16, n // 16
    d = max(tk, tn)
    num_x = min(max(8, (width * d) // 16), (tk * tn + 1) // 2)
    return 5 * (width * d + 2 * num_x)


def default_budget(k: int, n: int, bits: int = 6, device_type: str = "cuda") -> int:
    """The budget of a single encode when none is given: the reference's figure, or a small layer's floor."""
    per_tile = viterbi_bytes_per_tile(bits, device_type)
    fixed, during = _fixed_bytes(k, n, bits, sample_tile_count(k, n))
    tiles = (k // 16) * (n // 16)
    floor = max(fixed, during + min(tiles, DEFAULT_FLOOR_TILES) * per_tile)
    return max(reference_peak_bytes(k, n), floor)


def plan_encode_memory(k: int, n: int, bits: int, device_type: str, budget_bytes: int | None = None,
                       *, wave: int | None = None, name: str | None = None) -> EncodeMemoryPlan:
    """Chunk size for a (k, n) encode within ``budget_bytes`` (None: ``default_budget``).

    ``wave`` is how many tiles the GPU keeps resident at once; a chunk of several waves is rounded down to
    whole waves (a partial last wave costs as long as a full one). Raises EncodeMemoryError, naming ``name``
    and the bytes needed, when not even MIN_CHUNK_TILES tiles fit.
    """
    if budget_bytes is None:
        budget_bytes = default_budget(k, n, bits, device_type)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive integer, got {budget_bytes!r}")
    tiles = (k // 16) * (n // 16)
    per_tile = viterbi_bytes_per_tile(bits, device_type)
    fixed, during = _fixed_bytes(k, n, bits, sample_tile_count(k, n))
    smallest = min(tiles, MIN_CHUNK_TILES)
    needed = max(fixed, during + smallest * per_tile)
    if needed > budget_bytes:
        where = f"{name}: " if name else ""
        raise EncodeMemoryError(
            f"{where}encoding a ({k}, {n}) weight at K={bits} needs at least {needed / 2**20:,.0f} MiB of "
            f"{'GPU' if device_type == 'cuda' else 'host'} memory besides the weight, the budget is "
            f"{budget_bytes / 2**20:,.0f} MiB; raise the budget"
            f"{' (cache warm --gpu-memory)' if device_type == 'cuda' else ''} or encode on a larger device",
            needed, budget_bytes)
    cap = max(smallest, DEFAULT_MAX_CHUNK_BYTES // per_tile) if device_type != "cpu" else tiles
    chunk = min(tiles, cap, (budget_bytes - during) // per_tile)
    if wave and chunk < tiles and chunk >= wave:
        chunk = (chunk // wave) * wave
    chunk = max(chunk, smallest)
    peak = max(fixed, during + chunk * per_tile)
    return EncodeMemoryPlan(budget_bytes=budget_bytes, chunk_tiles=chunk, peak_bytes=peak, fixed_bytes=fixed,
                            tile_bytes=per_tile)


def device_budget(device, gib: float | None = None) -> int:
    """What a warm may allocate on the CUDA ``device``: ``gib`` GiB, or what is free now less a margin.

    The margin (GPU_MARGIN_BYTES or GPU_MARGIN_FRACTION of the device, the larger) covers the caching
    allocator's fragmentation and what other processes allocate meanwhile. Raises ConfigError for a figure
    that is not positive or exceeds the device.
    """
    import torch

    from exl3tool.errors import ConfigError

    free, total = torch.cuda.mem_get_info(device)
    if gib is None:
        return max(1, free - max(GPU_MARGIN_BYTES, int(GPU_MARGIN_FRACTION * total)))
    if not gib > 0 or gib != gib:
        raise ConfigError(f"--gpu-memory {gib}: must be a positive number of GiB")
    if gib * 2**30 > total:
        raise ConfigError(f"--gpu-memory {gib}: {device} has {total / 2**30:.1f} GiB in all; give at most that")
    return int(gib * 2**30)
