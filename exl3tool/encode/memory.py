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
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = [
    "CHUNK_ROUNDS", "CHUNK_ROUNDS_IN_PLACE", "COST_ROW_BITS", "DEFAULT_MAX_CHUNK_TILES", "DEFAULT_MAX_SCRATCH",
    "EDGE_MAJOR_TRACEBACK", "EVEN_ROUNDS", "EncodeMemoryError", "EncodeMemoryPlan", "HALF_ROW_BITS",
    "HALF_ROWS_BELOW_PER_SM", "IN_PLACE_BITS", "IN_PLACE_MAX_TILES",
    "MAX_HALF_ROW_BITS", "MIN_CHUNK_TILES", "MIN_SLOTS", "PHASES", "PROXY_SLAB_BYTES", "PROXY_SLAB_ROWS",
    "REFERENCE_FACTOR", "REFERENCE_PROGRAMS_PER_SM", "REFERENCE_SEARCH_TILE_KIB", "RESIDENT_CAP", "cost_row_stride",
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


def _knob(name: str, default):
    """A speed rule below, or the value of EXL3TOOL_<name> when set (a comma-separated list of K for the sets):
    what benchmarks compare in separate processes. No result depends on these, only speed and memory."""
    raw = os.environ.get(f"EXL3TOOL_{name}")
    if raw is None:
        return default
    try:
        if isinstance(default, frozenset):
            return frozenset(int(v) for v in raw.split(",") if v.strip())
        return type(default)(raw)
    except ValueError:
        from exl3tool.errors import ConfigError

        what = {frozenset: "a comma-separated list of integers", int: "an integer", float: "a number"}[type(default)]
        raise ConfigError(f"EXL3TOOL_{name}={raw!r} is not {what} (a speed rule for benchmarks, default "
                          f"{sorted(default) if isinstance(default, frozenset) else default}); unset it") from None


# the reference's scale search holds about this many KiB per sample tile above the weight (its batches of scales
# with their values): its per-call peak is the larger of REFERENCE_FACTOR W and W + this x the sample, which is
# what decides it for a layer whose sample is large beside its weight. Fitted below the H200 measurements of
# 1.6.5 (results/bench_dropin_vs_reference_h200_2026-12-03.json): (128, 4096) 15.1 MiB above the weight
# (7.1 W; this model 14.7),
# (256, 7168) 30.8 MiB (4.4 W; model 29.2); every other deployed layer is at 3.5 W. 0: 3.5 W alone
REFERENCE_SEARCH_TILE_KIB = _knob("REFERENCE_SEARCH_TILE_KIB", 15)
CHUNK_ROUNDS = _knob("CHUNK_ROUNDS", 4)  # a gathered chunk holds about this many tiles per slot (8 KiB a tile)
# an in-place chunk (512 B a tile) this many: a launch of few tiles per program keeps the programs in step, so
# their tracebacks (latency, little issue) run all at once instead of beside other programs' forward passes
CHUNK_ROUNDS_IN_PLACE = _knob("CHUNK_ROUNDS_IN_PLACE", 16)
DEFAULT_FLOOR_TILES = 1024  # CPU: a default budget always holds this many tiles in flight (a small layer's whole)
DEFAULT_MAX_SCRATCH = 2 << 30  # Viterbi scratch beyond this does not make the kernel faster (8,064 slots at K = 6)
_TILE_BYTES = 1024  # 256 fp32 values
_GPU_TILE_EXTRA = 1024  # per tile of a chunk on a GPU in place: its int16 states (512 B; viterbi_matrix)
_GPU_TILE_GATHERED = 8 * 1024  # per tile of a gathered chunk on a GPU: the tile, its int64 index, values, states
# K at which the encode's tile quantization runs in place (viterbi_matrix); at the others it gathers the tiles. On an
# H200 in place was faster at K = 6 (one launch per small layer: (512, 4096) 97 -> 87 ms) and slower at K = 4
# ((4096, 12288) 965 -> 1,052 ms of Viterbi, the in-place variant of the packed 8-warp kernel); other K unmeasured
IN_PLACE_BITS = _knob("IN_PLACE_BITS", frozenset({6}))
# ... and at any K a layer of at most this many tiles: one launch over the weight, no gather, 1 KiB a tile of the
# chunk instead of 8 (more slots in the reference's budget: 515 instead of 501 at (128, 4096), K = 4). On an H200
# with half rows at K = 4 it was never slower: (128, 4096) 55.7 against 56.9 ms in one call (bench_rules.py), 53 against
# 64 ms across two calls (bench_dropin.py: 2.48x against 2.10x the reference), (4096, 128) the same (67.5 / 67.4
# ms); with every row kept +3 % on both (2.47 -> 2.55x). The larger K = 4 layers were slower in place; 0: off
IN_PLACE_MAX_TILES = _knob("IN_PLACE_MAX_TILES", 4096)
# K at which the Viterbi kernel keeps every step's cost row (256 x 2^(16-K) fp16 a slot) and no back-pointers: a
# candidate is then sub, fma, min, not sub, fma, compare and two selects, and the tracebacks recompute the choice.
# On an H200 (benchmarks/bench_viterbi_slots.py, same run): K = 6 312 K tiles/s at 12 programs per SM against 234 K
# for the back-pointer kernel at its best, 225 K at 2 per SM; K = 4 282 K against 212 K, 217 K at 2 per SM. Twice
# (K = 6) or four times (K = 4) the scratch a slot, so a budget holds fewer. At K = 4 every row (the reference's
# budget then leaves 2-3.6 programs per SM) was slower on 3 of 5 deployed layers ((4096, 2048) 224 -> 264 ms,
# (1024, 4096) 128 -> 162 ms; bench_dropin.py); K = 4 keeps every other row (HALF_ROW_BITS).
COST_ROW_BITS = _knob("COST_ROW_BITS", frozenset({4, 6}))
# K (of COST_ROW_BITS) at which a slot may keep every other step's row (129 rows: the even ones and the odd row in
# flight), the traceback recomputing an odd row's NL entries it needs from the even row before it (NL^2 fp16
# candidates at one position, against NL x 2^(16-K) a step): half the scratch a slot, so twice the slots in a
# budget, for a slower kernel at the same programs per SM (K = 6 on an H200, bench_viterbi_slots.py: 241 K tiles/s
# at 8 per SM against 321 K with every row). An encode's plan takes every other row where every row would leave
# fewer than HALF_ROWS_BELOW_PER_SM programs per SM (a tight budget: the reference's, for most deployed layers);
# a Viterbi call without a plan keeps every other row at these K. On an H200 (bench_rules.py) the DeepSeek-V3
# K = 6 layers at the reference's budget (1.8-3.8 per SM with every row) were 1.02-1.24x faster with every other
# row; with a warm's budget (a whole GPU) every other row at K = 6 cost the GLM-5.3-Flash and DeepSeek-V3 warms
# 19-20 % of their tiles/s (bench_fleet.py, 130.5 K and 111.2 K against 161.9 K and 138.6 K)
HALF_ROW_BITS = _knob("HALF_ROW_BITS", frozenset({4, 6}))
HALF_ROWS_BELOW_PER_SM = _knob("HALF_ROWS_BELOW_PER_SM", 4.0)
# 1: a Viterbi launch over more tiles than slots spreads them evenly (``kernels.viterbi._even_rounds``): as few
# programs as take the same rounds, in whole waves of SMs; 0: every slot a program
EVEN_ROUNDS = _knob("EVEN_ROUNDS", 1)
# 1: a Viterbi launch of more programs than the GPU keeps resident (the compiled kernel's occupancy) runs whole
# waves of them, its tiles spread evenly; 0: every slot a program, a part of a wave left over running alone at the
# end (GLM-5.3 down_proj, 713 programs against 660 resident at K = 4, 4 tiles each: 1.30x slower on an H200); 2: one
# wave at most
RESIDENT_CAP = _knob("RESIDENT_CAP", 1)
# 1: the cost-row kernel's traceback reads an edge's candidates from the edge-major codebook table
# (``codebook.edge_major_table``, 128 KiB more per device and K): one or a few cache lines a step instead of 2^K lines
# (2^2K at a recomputed odd row); 0: from the state-major table. Same states either way
EDGE_MAJOR_TRACEBACK = _knob("EDGE_MAJOR_TRACEBACK", 1)
MAX_HALF_ROW_BITS = 6  # every other row only up to K = 6 (a recomputed odd row costs 2^(2K) candidates)
WHOLE_LAYER_SLOTS = 0.9  # a chunk of the whole layer (one launch) when it leaves at least this share of the slots
_PACK_TILE_BYTES = 20 * 1024  # pack_trellis's int32 bit streams per tile (2 + 2 K KiB), PACK_SLICE_TILES at a time
PACK_SLICE_TILES = 2048  # tiles pack_trellis packs at once (exl3tool.encode.trellis uses this figure)
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


def quantizes_in_place(bits: int, tiles: int) -> bool:
    """Whether a GPU encode of a layer of ``tiles`` tiles at K = ``bits`` quantizes them where they lie
    (``viterbi_matrix``) instead of gathering them: the rule of IN_PLACE_BITS and IN_PLACE_MAX_TILES."""
    return bits in IN_PLACE_BITS or tiles <= IN_PLACE_MAX_TILES


def cost_row_stride(bits: int) -> int:
    """The cost rows the Viterbi kernel keeps at K = ``bits`` in its packed modes: 0 (back-pointers instead), 1
    (every step's) or 2 (every other step's); the rule of COST_ROW_BITS and HALF_ROW_BITS."""
    if bits not in COST_ROW_BITS:
        return 0
    return 2 if bits in HALF_ROW_BITS and bits <= MAX_HALF_ROW_BITS else 1


def slot_cost_rows(rows: int) -> int:
    """fp16 cost rows of 2^(16-K) entries a Viterbi slot holds for the kernel's ROWS: 2 with back-pointers (the
    previous and the current step's), 256 with every step's row, 129 with every other (and the odd one in flight)."""
    return {0: 2, 1: 256, 2: 129}[int(rows)]


def viterbi_slot_bytes(bits: int, packed: bool = True, rows: bool | int | None = None) -> int:
    """GPU scratch of one tile in flight: back-pointers (256 positions x 2^(16-K) edges, a byte each, or two per
    byte at K <= 4 when ``packed``, the kernel's default modes) and two fp16 cost rows; or with ``rows`` no
    back-pointers and 256 cost rows of 2^(16-K) fp16 (``rows`` 1) or 129 (2: every other row and the one in
    flight); None: ``cost_row_stride`` when ``packed``. And, in an in-place launch over a weight
    (``viterbi_matrix``), the 1 KiB row of the tile's values."""
    e = 1 << (16 - bits)
    if rows is None:
        rows = cost_row_stride(bits) if packed else 0
    back_pointers = 0 if rows else 256 * (e // 2 if packed and bits <= 4 else e)
    return back_pointers + slot_cost_rows(rows) * 2 * e + _TILE_BYTES


def reference_scratch_bytes(bits: int, sms: int | None = None) -> int:
    """The Viterbi scratch exllamav3 keeps allocated once it has encoded at K = ``bits``: 4 programs per SM, each
    256 positions x 2^(16-K) one-byte back-pointers."""
    return REFERENCE_PROGRAMS_PER_SM * (sms or REFERENCE_SMS) * 256 * (1 << (16 - bits))


def reference_call_bytes(k: int, n: int) -> int:
    """The reference's per-call peak above the fp32 weight of a (k, n) encode: 3.5 W, or for a layer whose scale
    search sample is large beside it (e.g. (128, 4096)) the weight and REFERENCE_SEARCH_TILE_KIB a sample tile."""
    w = weight_bytes(k, n)
    search = w + REFERENCE_SEARCH_TILE_KIB * 1024 * (sample_tile_count(k, n) // 5)
    return max(int(REFERENCE_FACTOR * w), search)  # with the knob at 0, search = W: 3.5 W


def reference_peak_bytes(k: int, n: int, bits: int = 6, sms: int | None = None) -> int:
    """What the reference's uncalibrated encode of a (k, n) layer takes above its fp32 weight: its per-call peak
    (``reference_call_bytes``) plus the scratch it keeps between calls."""
    return reference_call_bytes(k, n) + reference_scratch_bytes(bits, sms)


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


def default_budget(k: int, n: int, bits: int = 6, device_type: str = "cuda", sms: int | None = None) -> int:
    """The budget of a single encode when none is given: the reference's figure on a GPU (``sms`` SMs, an
    H200's 132 if None); on the CPU 3.5 W or a small layer's floor."""
    if device_type != "cpu":
        return reference_peak_bytes(k, n, bits, sms)
    fixed, during = _fixed_bytes(k, n, bits, sample_tile_count(k, n), "cpu")
    tiles = (k // 16) * (n // 16)
    floor = max(fixed, during + min(tiles, DEFAULT_FLOOR_TILES) * _CPU_TILE_BYTES)
    return max(int(REFERENCE_FACTOR * weight_bytes(k, n)), floor)


def plan_encode_memory(k: int, n: int, bits: int, device_type: str, budget_bytes: int | None = None,
                       *, wave: int | None = None, slot_bytes: int | None = None, sms: int | None = None,
                       name: str | None = None, rows_slot_bytes: dict[int, int] | None = None) -> EncodeMemoryPlan:
    """Slots and chunk size for a (k, n) encode within ``budget_bytes`` (None: ``default_budget``).

    On a GPU, ``wave`` is how many tiles the kernel keeps resident at once (more slots would only queue) and
    ``slot_bytes`` the scratch of one (``viterbi_slot_bytes`` if None); the slots are as many as fit beside a
    chunk of CHUNK_ROUNDS tiles per slot, up to the wave, and the chunk is then as large as the rest allows, in
    whole rounds of slots. ``rows_slot_bytes`` ({rows: a slot's bytes} for the cost rows the kernel can keep,
    ``slot_bytes`` then unused): every row (1), or every other (2) where every row leaves fewer than
    HALF_ROWS_BELOW_PER_SM slots per SM of the ``sms``; the plan's ``rows`` says which. Raises EncodeMemoryError,
    naming ``name`` and the bytes needed, when not even MIN_SLOTS slots and MIN_CHUNK_TILES tiles fit.
    """
    if rows_slot_bytes:  # plan with every row (or the one stride there is); every other row where that is tight
        every = 1 if 1 in rows_slot_bytes else min(rows_slot_bytes)
        may_halve = every == 1 and 2 in rows_slot_bytes
        try:
            plan = plan_encode_memory(k, n, bits, device_type, budget_bytes, wave=wave,
                                      slot_bytes=rows_slot_bytes[every], sms=sms, name=name)
        except EncodeMemoryError:
            if not may_halve:
                raise
            plan = None  # every row does not fit at all: every other may
        if may_halve and (plan is None or (plan.slots or 0) < HALF_ROWS_BELOW_PER_SM * (sms or REFERENCE_SMS)):
            half = plan_encode_memory(k, n, bits, device_type, budget_bytes, wave=wave,
                                      slot_bytes=rows_slot_bytes[2], sms=sms, name=name)
            return dataclasses.replace(half, rows=2)
        return dataclasses.replace(plan, rows=every)
    if budget_bytes is None:
        budget_bytes = default_budget(k, n, bits, device_type, sms)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be a positive integer, got {budget_bytes!r}")
    tiles = (k // 16) * (n // 16)
    gpu = device_type != "cpu"
    in_place = quantizes_in_place(bits, tiles)  # on a GPU
    per_tile = (_GPU_TILE_EXTRA if in_place else _GPU_TILE_GATHERED) if gpu else _CPU_TILE_BYTES
    per_slot = (slot_bytes or viterbi_slot_bytes(bits)) if gpu else 0
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
    rounds = min(CHUNK_ROUNDS_IN_PLACE if in_place else CHUNK_ROUNDS, max(1, tiles // fit))
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
