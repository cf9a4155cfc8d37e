"""How much memory one encode takes, and how it fits a budget: Viterbi slots and chunks of tiles.

An encode of a (k, n) weight (W = 4 k n bytes in fp32) runs in phases whose peaks, above the weight itself,
are known in closed form (``encode_linear`` frees every intermediate as soon as it is used):

* checks: 1.75 W (the weight's finiteness: its magnitudes and three boolean masks);
* regularize: 2 W (one scaled copy and its Hadamard product; the RMS reductions run in slabs);
* scale search: 2 W (the regularised weight, its tiles squared for the per-tile mean square), then the weight and
  the sample's batch of five scales (with its values and states) while it goes through the quantizer, and beside
  it the sample, its distinct tiles, the fine centre's values and one expanded mse operand;
* tile quantization: 1.19 W at K = 6 (the regularised weight, overwritten chunk by chunk with the squared error,
  plus the packed trellis), one chunk's states (``chunk_tiles``; on a GPU at the K of ``IN_PLACE_BITS`` and for a
  layer of at most ``IN_PLACE_MAX_TILES`` tiles the kernel reads the tiles where they lie and writes their errors
  over them, so 512 B a tile; elsewhere the tiles are gathered, with their index and values: 8 KiB a tile on a GPU),
  then either the Viterbi kernel's scratch: ``slots`` tiles in flight, each slot 256 positions x 2^(16-K)
  back-pointers (a byte each, two per byte at K <= 4) and two cost rows, or at the K of ``COST_ROW_BITS`` 256 cost
  rows of 2^(16-K) fp16 (129 where the plan keeps every other row: ``HALF_ROW_BITS``,
  ``HALF_ROWS_BELOW_PER_SM``) and no back-pointers, and a row of values (the kernel's
  programs are persistent, so the scratch is ``slots`` slots whatever the chunk), or, once the kernel has returned
  and freed it, the packing's bit streams (about 20 KiB per tile, 2,048 tiles at a time);
* proxy error: 1 W + the trellis + the squared error widened to float64 for the sum: on the CPU a slab of
  PROXY_SLAB_ROWS x 4,096 values at a time (64 MiB at most), elsewhere the whole (2 W; CUDA makes no copy at all,
  so the GPU figure is an upper bound).

On the CPU every phase also counts ``_CPU_HEAP_SLACK`` for what the C allocator keeps of freed blocks (the encoder
hands the heap's free pages back between phases, ``online._release_host_heap``); ``phase_bytes`` and
``EncodeMemoryPlan.phases`` give each phase's figure, which ``benchmarks/bench_encode_memory.py --phases``
compares with the host's measured peak.

The default budget of one encode on a GPU is what exllamav3's ``quantize_exl3`` needs for the same layer,
measured on an H200 against 1.6.5 (issues 21, 24): 3.5 W per call at least (3.5-4.5 W over the deployed shapes),
more where the scale search's sample is large beside the weight (``reference_call_bytes``: 7.1 W at (128, 4096)),
plus the Viterbi scratch it keeps allocated between calls, 4 programs per SM with a byte per back-pointer
(133 MiB at K = 6, 532 MiB at K = 4 on 132 SMs). Within it the slots go up to 2 GiB of scratch (more programs than
the resident wave still help) and the chunk to a few rounds of slots.

The speed rules (which K keep cost rows, which quantize in place, how many rounds a chunk holds...) are a
``knobs.Tuning``: every function that applies one takes ``tuning`` (None: ``knobs.current_tuning()``, the
``EXL3TOOL_*`` variables as they are at the call). docs/tuning.md gives each rule's default and its measurements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from exl3tool.format.trellis import PACK_SLICE_TILES  # noqa: F401 - pack_trellis's slice, counted here
from exl3tool.kernels.geometry import (  # noqa: F401 - the kernel's geometry, re-exported for the plan's users
    _TILE_BYTES, DEFAULT_MAX_SCRATCH, MAX_HALF_ROW_BITS, cost_row_stride, slot_cost_rows, viterbi_slot_bytes,
)
from exl3tool.knobs import Tuning, current_tuning

__all__ = [
    "DEFAULT_MAX_CHUNK_TILES", "DEFAULT_MAX_SCRATCH", "EncodeMemoryError", "EncodeMemoryPlan",
    "MAX_HALF_ROW_BITS", "MIN_CHUNK_TILES", "MIN_SLOTS", "PHASES", "PROXY_SLAB_BYTES", "PROXY_SLAB_ROWS",
    "REFERENCE_FACTOR", "REFERENCE_PROGRAMS_PER_SM", "cost_row_stride",
    "default_budget", "device_budget", "phase_bytes", "plan_encode_memory", "quantizes_in_place",
    "reference_call_bytes", "reference_peak_bytes", "reference_scratch_bytes", "slot_cost_rows",
    "viterbi_slot_bytes",
]

REFERENCE_FACTOR = 3.5  # exllamav3 1.6.5 quantize_exl3 per-call peak / fp32 weight, the least measured (H200)
REFERENCE_PROGRAMS_PER_SM = 4  # tiles in flight per SM of the reference's kernel (its cached scratch, sm_90)
REFERENCE_SMS = 132  # the H200's SMs: the reference's scratch where the device is not known
MIN_CHUNK_TILES = 128  # the smallest chunk of tiles gathered at once: slower, but it still finishes
MIN_SLOTS = 16  # the fewest tiles in flight in the Viterbi kernel
DEFAULT_MAX_CHUNK_TILES = 65536  # the reference's batch bound for one quantize_tiles call


DEFAULT_FLOOR_TILES = 1024  # CPU: a default budget always holds this many tiles in flight (a small layer's whole)
_GPU_TILE_EXTRA = 1024  # per tile of a chunk on a GPU in place: its int16 states (512 B; viterbi_matrix)
_GPU_TILE_GATHERED = 8 * 1024  # per tile of a gathered chunk on a GPU: the tile, its int64 index, values, states
WHOLE_LAYER_SLOTS = 0.9  # a chunk of the whole layer (one launch) when it leaves at least this share of the slots
_PACK_TILE_BYTES = 20 * 1024  # pack_trellis's int32 bit streams per tile (2 + 2 K KiB), PACK_SLICE_TILES at a time
_CPU_TILE_BYTES = 48 * 1024  # per tile in flight on the CPU (numba keeps its scratch per thread, not per tile;
# measured 10-25 KiB with the packing at issue 24's shapes' chunks: an upper bound)
_SLACK = 4 << 20  # small tensors: sign vectors, scales, codebook table, per-launch bookkeeping
# CPU: what the C heap holds beyond the live bytes within a phase (bench_encode_memory.py --phases): a few MiB from
# a 64 MiB weight up, up to 30 MiB in regularize at 16 MiB (matrices under glibc's 32 MiB mmap ceiling share its heap
# and fragment it)
_CPU_HEAP_SLACK = 64 << 20
PROXY_SLAB_ROWS = 2048  # CPU proxy error: rows of 4,096 squared errors widened to float64 at once (online.py)
PROXY_SLAB_BYTES = PROXY_SLAB_ROWS * 4096 * 8  # 64 MiB: above glibc's 32 MiB mmap ceiling, so freed to the system
PHASES = ("checks", "regularize", "scale search", "tile quantization", "proxy error")  # encode_linear's, in order
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
    """Chunking of one encode: ``chunk_tiles`` tiles per quantizer call, ``slots`` of them in flight in the
    GPU kernel (None on the CPU); ``peak_bytes`` the predicted peak.

    Every figure is bytes above the fp32 weight the caller passes in.
    """

    budget_bytes: int
    chunk_tiles: int
    peak_bytes: int
    fixed_bytes: int  # the largest phase that does not depend on the chunk
    tile_bytes: int  # bytes per tile of a chunk
    slots: int | None = None
    slot_bytes: int = 0
    tile_phase_bytes: int = 0  # the tile quantization's peak: a chunk in flight beside W_r and the trellis
    rows: int | None = None  # the cost rows a slot keeps (``viterbi_slot_bytes``'s rows); None: the kernel's rule

    def phases(self, k: int, n: int, bits: int, device_type: str) -> dict[str, int]:
        """The model's peak of every phase (``PHASES``) for this plan's (k, n) layer: what a measurement is
        compared with phase by phase (``benchmarks/host_peak.py``)."""
        fixed = phase_bytes(k, n, bits, device_type)
        return {p: self.tile_phase_bytes if p == "tile quantization" else fixed[p] for p in PHASES}


def weight_bytes(k: int, n: int) -> int:
    return 4 * k * n


def quantizes_in_place(bits: int, tiles: int, tuning: Tuning | None = None) -> bool:
    """Whether a GPU encode of a layer of ``tiles`` tiles at K = ``bits`` quantizes them where they lie
    (``viterbi_matrix``) instead of gathering them: the rule of IN_PLACE_BITS and IN_PLACE_MAX_TILES."""
    tuning = tuning or current_tuning()
    return bits in tuning.in_place_bits or tiles <= tuning.in_place_max_tiles


def reference_scratch_bytes(bits: int, sms: int | None = None) -> int:
    """The Viterbi scratch exllamav3 keeps allocated once it has encoded at K = ``bits``: 4 programs per SM, each
    256 positions x 2^(16-K) one-byte back-pointers."""
    return REFERENCE_PROGRAMS_PER_SM * (sms or REFERENCE_SMS) * 256 * (1 << (16 - bits))


def reference_call_bytes(k: int, n: int, tuning: Tuning | None = None) -> int:
    """The reference's per-call peak above the fp32 weight of a (k, n) encode: 3.5 W, or for a layer whose scale
    search sample is large beside it (e.g. (128, 4096)) the weight and REFERENCE_SEARCH_TILE_KIB a sample tile."""
    w = weight_bytes(k, n)
    kib = (tuning or current_tuning()).reference_search_tile_kib
    search = w + kib * 1024 * (sample_tile_count(k, n) // 5)
    return max(int(REFERENCE_FACTOR * w), search)  # with the knob at 0, search = W: 3.5 W


def reference_peak_bytes(k: int, n: int, bits: int = 6, sms: int | None = None,
                         tuning: Tuning | None = None) -> int:
    """What the reference's uncalibrated encode of a (k, n) layer takes above its fp32 weight: its per-call peak
    (``reference_call_bytes``) plus the scratch it keeps between calls."""
    return reference_call_bytes(k, n, tuning) + reference_scratch_bytes(bits, sms)


def _trellis_bytes(k: int, n: int, bits: int) -> int:
    return (k // 16) * (n // 16) * 32 * bits  # 16 * bits int16 per tile


def phase_bytes(k: int, n: int, bits: int, device_type: str, sample_tiles: int | None = None) -> dict[str, int]:
    """The model's peak of each phase of a (k, n) encode that does not depend on the chunk, bytes above the weight.

    ``PHASES`` less the tile quantization, whose figure is ``EncodeMemoryPlan.tile_phase_bytes``. ``sample_tiles``
    defaults to ``sample_tile_count(k, n)``.
    """
    w = weight_bytes(k, n)
    trellis = _trellis_bytes(k, n, bits)
    if sample_tiles is None:
        sample_tiles = sample_tile_count(k, n)
    search = _search_bytes(w, sample_tiles)
    if device_type == "cpu":  # the squared error widened to float64 a slab at a time, and the row sums
        error = w + trellis + min(2 * w, PROXY_SLAB_BYTES) + w // 2048
    else:  # CUDA sums 16-row blocks (no copy at all), other devices widen it whole: the larger figure for both
        error = w + trellis + 2 * w
    slack = _slack(device_type)
    return {
        "checks": 7 * w // 4 + slack,  # isfinite: |w| and three boolean masks
        "regularize": 2 * w + w // 4 + slack,  # the copy, its product, one reduction slab
        "scale search": max(2 * w, search) + slack,  # weight and its squared tiles; or the sample and its batch
        "proxy error": error + slack,
    }


def _search_bytes(w: int, sample_tiles: int) -> int:
    """The scale search's largest moment: the weight, the batch of five scales with its values and states, and per
    sample tile four more (the sample, its distinct tiles, the fine centre's values, one scale's mse operand
    expanded back to the sample)."""
    return w + sample_tiles * (_TILE_BYTES // 5 + _TILE_BYTES + _TILE_BYTES + _TILE_BYTES // 2) + (
        sample_tiles // 5) * 4 * _TILE_BYTES


def _slack(device_type: str) -> int:
    return _SLACK + (_CPU_HEAP_SLACK if device_type == "cpu" else 0)


def _fixed_bytes(k: int, n: int, bits: int, sample_tiles: int, device_type: str = "cuda") -> tuple[int, int]:
    """(the largest phase without tiles in flight, what stays allocated while tiles are quantized)."""
    w = weight_bytes(k, n)
    search = _search_bytes(w, sample_tiles)
    during_quantize = max(w + _trellis_bytes(k, n, bits), search)
    return max(phase_bytes(k, n, bits, device_type, sample_tiles).values()), during_quantize + _slack(device_type)


def _pack_bytes(chunk: int) -> int:
    return min(chunk, PACK_SLICE_TILES) * _PACK_TILE_BYTES


def sample_tile_count(k: int, n: int, width: int = 3) -> int:
    """Tiles in the scale search's largest batch (5 scales of the sample, docs/format.md §7.4)."""
    tk, tn = k // 16, n // 16
    d = max(tk, tn)
    num_x = min(max(8, (width * d) // 16), (tk * tn + 1) // 2)
    return 5 * (width * d + 2 * num_x)


def default_budget(k: int, n: int, bits: int = 6, device_type: str = "cuda", sms: int | None = None,
                   tuning: Tuning | None = None) -> int:
    """The budget of a single encode when none is given: the reference's figure on a GPU (``sms`` SMs, an
    H200's 132 if None); on the CPU 3.5 W or a small layer's floor."""
    if device_type != "cpu":
        return reference_peak_bytes(k, n, bits, sms, tuning)
    fixed, during = _fixed_bytes(k, n, bits, sample_tile_count(k, n), "cpu")
    tiles = (k // 16) * (n // 16)
    floor = max(fixed, during + min(tiles, DEFAULT_FLOOR_TILES) * _CPU_TILE_BYTES)
    return max(int(REFERENCE_FACTOR * weight_bytes(k, n)), floor)


def plan_encode_memory(k: int, n: int, bits: int, device_type: str, budget_bytes: int | None = None,
                       *, wave: int | None = None, slot_bytes: int | None = None, sms: int | None = None,
                       name: str | None = None, rows_slot_bytes: dict[int, int] | None = None,
                       tuning: Tuning | None = None) -> EncodeMemoryPlan:
    """Slots and chunk size for a (k, n) encode within ``budget_bytes`` (None: ``default_budget``).

    On a GPU, ``wave`` is how many tiles the kernel keeps resident at once (more slots would only queue) and
    ``slot_bytes`` the scratch of one (``viterbi_slot_bytes`` if None); the slots are as many as fit beside a
    chunk of CHUNK_ROUNDS tiles per slot, up to the wave, and the chunk is then as large as the rest allows, in
    whole rounds of slots. ``rows_slot_bytes`` ({rows: a slot's bytes} for the cost rows the kernel can keep,
    ``slot_bytes`` then unused): every row (1), or every other (2) where every row leaves fewer than
    HALF_ROWS_BELOW_PER_SM slots per SM of the ``sms``; the plan's ``rows`` says which. Raises EncodeMemoryError,
    naming ``name`` and the bytes needed, when not even MIN_SLOTS slots and MIN_CHUNK_TILES tiles fit. ``tuning``:
    the speed rules (None: ``knobs.current_tuning()``).
    """
    tuning = tuning or current_tuning()
    if rows_slot_bytes:  # plan with every row (or the one stride there is); every other row where that is tight
        every = 1 if 1 in rows_slot_bytes else min(rows_slot_bytes)
        may_halve = every == 1 and 2 in rows_slot_bytes
        try:
            plan = plan_encode_memory(k, n, bits, device_type, budget_bytes, wave=wave,
                                      slot_bytes=rows_slot_bytes[every], sms=sms, name=name, tuning=tuning)
        except EncodeMemoryError:
            if not may_halve:
                raise
            plan = None  # every row does not fit at all: every other may
        below = tuning.half_rows_below_per_sm * (sms or REFERENCE_SMS)
        if may_halve and (plan is None or (plan.slots or 0) < below):
            half = plan_encode_memory(k, n, bits, device_type, budget_bytes, wave=wave,
                                      slot_bytes=rows_slot_bytes[2], sms=sms, name=name, tuning=tuning)
            return dataclasses.replace(half, rows=2)
        return dataclasses.replace(plan, rows=every)
    if budget_bytes is None:
        budget_bytes = default_budget(k, n, bits, device_type, sms, tuning)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive integer, got {budget_bytes!r}")
    tiles = (k // 16) * (n // 16)
    gpu = device_type != "cpu"
    in_place = quantizes_in_place(bits, tiles, tuning)  # on a GPU
    per_tile = (_GPU_TILE_EXTRA if in_place else _GPU_TILE_GATHERED) if gpu else _CPU_TILE_BYTES
    per_slot = (slot_bytes or viterbi_slot_bytes(bits, tuning=tuning)) if gpu else 0
    fixed, during = _fixed_bytes(k, n, bits, sample_tile_count(k, n), device_type)
    smallest = min(tiles, MIN_CHUNK_TILES)
    min_slots = min(tiles, MIN_SLOTS) if gpu else 0
    # on the CPU the 48 KiB per tile in flight include the packing
    needed = max(fixed, during + smallest * per_tile + (max(min_slots * per_slot, _pack_bytes(smallest)) if gpu else 0))
    if needed > budget_bytes:
        where = f"{name}: " if name else ""
        raise EncodeMemoryError(
            f"{where}encoding a ({k}, {n}) weight at K={bits} needs at least {needed / 2**20:,.0f} MiB of "
            f"{'GPU' if gpu else 'host'} memory besides the weight, the budget is "
            f"{budget_bytes / 2**20:,.0f} MiB; raise the budget"
            f"{' (cache warm --gpu-memory)' if gpu else ''} or encode on a larger device",
            needed, budget_bytes)
    avail = budget_bytes - during
    if not gpu:
        chunk = max(smallest, min(tiles, avail // per_tile))
        peak = max(fixed, during + chunk * per_tile)
        return EncodeMemoryPlan(budget_bytes=budget_bytes, chunk_tiles=chunk, peak_bytes=peak, fixed_bytes=fixed,
                                tile_bytes=per_tile, tile_phase_bytes=during + chunk * per_tile)
    # more programs than the resident wave still run faster (each queued one starts as one ends: +4 % at K = 6 for
    # 8,064 slots against the 1,188 resident on an H200, bench_viterbi_slots.py), so where the budget allows the
    # slots go up to 2 GiB of scratch; a tight budget (the reference's, for a small layer) gets fewer
    most = min(tiles, max(wave or 0, MIN_SLOTS, DEFAULT_MAX_SCRATCH // per_slot))
    fit = max(1, min(most, (avail - smallest * per_tile) // per_slot))  # slots beside the smallest chunk
    rounds = min(tuning.chunk_rounds_in_place if in_place else tuning.chunk_rounds, max(1, tiles // fit))
    slots = min(most, (avail - smallest * per_tile) // per_slot, avail // (per_slot + rounds * per_tile))
    # one launch over the whole layer (up to the largest chunk) beats a launch per round of slots when it costs
    # few slots: separate launches each wait for their slowest tile (a (512, 4096) layer in 16 launches of one
    # round took 47 ms on an H200, in one launch 39 ms)
    whole = min(tiles, DEFAULT_MAX_CHUNK_TILES)
    whole_slots = min(most, (avail - whole * per_tile) // per_slot)
    if whole_slots >= WHOLE_LAYER_SLOTS * slots:
        slots = whole_slots
    slots = max(slots, min_slots)
    pack_most = _pack_bytes(tiles)
    chunk = min(tiles, DEFAULT_MAX_CHUNK_TILES, (avail - max(slots * per_slot, pack_most)) // per_tile)
    if slots < chunk < tiles:
        chunk -= chunk % slots  # whole rounds: every program gets as many tiles as the next
    chunk = max(chunk, smallest)
    slots = min(slots, chunk)
    tile_phase = during + chunk * per_tile + max(slots * per_slot, _pack_bytes(chunk))
    return EncodeMemoryPlan(budget_bytes=budget_bytes, chunk_tiles=chunk, peak_bytes=max(fixed, tile_phase),
                            fixed_bytes=fixed, tile_bytes=per_tile, slots=slots, slot_bytes=per_slot,
                            tile_phase_bytes=tile_phase)


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
