"""The online (uncalibrated) EXL3 encoder: exllamav3's ``quantize_exl3`` without a Hessian (docs/format.md §7).

encode_linear = signs (7.2) -> regularize (7.3) -> global-scale search (7.4) -> tile quantization
(7.5, 7.6) -> packing and fp16 scales (7.7, 7.8). Every stage is a function of its own so the
conformance tests can feed each one the reference's intermediate values.

Arithmetic follows the reference's CUDA semantics where the spec says they matter: a division of an
fp32 tensor by a Python scalar is a multiplication by ``f32(1 / s)`` (``_div_scalar``), a tensor by
tensor division is a true division, and scalars are rounded to fp32 before they touch a tensor. The
reductions (block RMS, means) and the Hadamard matmuls are plain fp32 torch ops, so on the CPU the
regularised weight agrees with the GPU's to ~1-2 ulp, not bit for bit (docs/format.md §9.2).

Whole-tensor sums on the CPU (the scale search's MSEs, the proxy error) go through ``_fixed_sum``: torch's
CPU reduction of a large tensor to one value splits it by thread count, so a process with 1 thread (torchrun's
default) and one with 2 rounded differently, which changed the proxy error and, through g, the trellis.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from exl3tool.format.codebook import check_codebook
from exl3tool.format.encoded import EncodedLinear
from exl3tool.format.hadamard import hadamard_left, hadamard_right  # noqa: F401 (benchmarks/exact_margins.py patches it here)
from exl3tool.format.layout import matrix_to_tiles, tile_element_index
from exl3tool.encode.memory import PROXY_SLAB_ROWS, EncodeMemoryPlan, plan_encode_memory
from exl3tool.format.signs import reference_signs
from exl3tool.format.trellis import check_bits, pack_trellis
from exl3tool.timing import StageTimer, stage

__all__ = [
    "CODEBOOK_SCALE", "MAX_TILES_PER_CALL", "Regularized", "ScaledWeight", "encode_linear",
    "encode_linear_with_input", "encode_memory_plan", "encoder_platform", "finish_encode", "prepare_encode",
    "quantize_regularized", "regularize",
    "sample_scale_tiles", "scale_mse", "search_global_scale", "search_global_scale_tensor",
]

CODEBOOK_SCALE = 1.24371088  # RMS of the 3inst codebook; the reference uses it (negated) for every codebook
MAX_TILES_PER_CALL = 65536  # the reference's batch bound for one quantize_tiles call
_EPS = 1e-10  # added to su and sv so that no scale is exactly zero
_ZERO = 1e-30  # an RMS below this counts as zero and becomes 0.1
_DRIFT = {1: 1.08, 2: 1.018, 3: 1.004}  # LDLQ drift factors, applied in the fallback path too (docs/format.md §7.4)
_COARSE = [0.1 + 0.2 * i for i in range(10)]  # Python doubles, exactly as the reference builds them
_FINE_STEP = 0.075


@dataclass(frozen=True)
class Regularized:
    """The matrix after docs/format.md §7.3 steps 1-7 (before the global scale), with its scale vectors.

    ``weight`` f32 (k, n) in the rotated basis; ``su`` f32 (k,) (opposite sign to the draw, no g yet);
    ``sv`` f32 (n,) (exactly 0 on all-zero columns); ``zeros`` is True for an all-zero weight.
    """

    weight: torch.Tensor
    su: torch.Tensor
    sv: torch.Tensor
    zeros: bool


def _f32(x: float) -> float:
    """Round a Python double to the nearest fp32 value (what CUDA does to a scalar operand)."""
    return float(np.float32(x))


def _recip32(s: float) -> float:
    """f32(1 / s), the reciprocal taken in double: the multiplier CUDA uses for ``tensor / scalar``.

    The spec (section 0) says f32(1 / f32(s)); golden case2 (su ÷s g with g = 0.7865423261524054, where
    the two differ) shows the double reciprocal: on an H200 every su_f32 element matches this way;
    with f32(1 / f32(g)) only ~5 % do.
    """
    return float(np.float32(1.0 / float(s)))


def _div_scalar(x: torch.Tensor, s: float) -> torch.Tensor:
    """``x / s`` for a Python scalar s the way PyTorch computes it on CUDA (docs/format.md §0, ÷s)."""
    return x * _recip32(s)


def _sequential_sum(x: torch.Tensor) -> torch.Tensor:
    """x[0] + x[1] + ... + x[-1] along dim 0, strictly in that order (fp32 rounding after every add).

    On CUDA one Triton launch does it (``exl3tool.kernels.reduce``, the same sums); elsewhere, or for strides
    that kernel cannot view, one torch add per row.
    """
    if x.is_cuda and x.shape[0] > 2:
        from exl3tool.kernels.reduce import sequential_sum_dim0

        out = sequential_sum_dim0(x)
        if out is not None:
            return out
    out = x[0].clone()
    for i in range(1, x.shape[0]):
        out += x[i]
    return out


_ROW_SLABS = 4  # row-RMS reductions run on this many row slabs (identical sums: every op is per row)


def _block_sum_squares(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of squares along ``dim`` in 32-long blocks, block sums accumulated in block order (fp32).

    Inside a block the order mimics PyTorch's CUDA reduction: across rows (dim 0) one thread walks the
    32 rows with four strided accumulators; along a row (dim 1) a warp halving tree adds x[i] + x[i + 16],
    then + 8, ... These orders bring su and sv to ~0.05 ulp mean difference from the goldens
    (the plain CPU sums give ~1 ulp). Every block is reduced at once (a few whole-tensor ops, not a few
    per block: on a GPU the per-block form was thousands of tiny launches per layer). The adds run in place in
    the squares (the same fp32 sums): on the CPU their temporaries, under glibc's 32 MiB mmap ceiling for a layer
    under 256 MiB, stayed in the C heap through the rest of regularize (up to 0.6 W, issue 24).
    """
    k, n = w.shape
    if dim == 0:
        sq = w.square()
        acc = sq.reshape(k // 32, 8, 4, n).transpose(0, 1)  # [i, block, j] = row 32 block + 4 i + j
        for i in range(1, 8):  # accumulator j walks rows j, j + 4, ... (in acc[0], as _sequential_sum)
            acc[0] += acc[i]
        blocks = acc[0, :, 0]  # ((a0 + a1) + a2) + a3: (blocks, n)
        for j in range(1, 4):
            blocks += acc[0, :, j]
    else:
        # Rows are independent, so the squares and the halving tree run on row slabs (a quarter of the memory
        # of the whole), and the block sums of all slabs go through one sequential pass (n/32 adds, not 4x)
        slabs = w.tensor_split(_ROW_SLABS if k >= _ROW_SLABS else 1)
        blocks = torch.empty((n // 32, k), dtype=w.dtype, device=w.device)  # (blocks, k)
        lo = 0
        for part in slabs:
            x = part.square().reshape(part.shape[0], n // 32, 32).permute(2, 1, 0)  # (32, blocks, rows)
            while x.shape[0] > 1:  # x[i] + x[i + half], halving
                half = x.shape[0] // 2
                x[:half] += x[half:]
                x = x[:half]
            blocks[:, lo : lo + part.shape[0]] = x[0]
            lo += part.shape[0]
            del x
    return _sequential_sum(blocks)


def _cuda_mean(x: torch.Tensor) -> float:
    """fp32 mean of a 1-D tensor (length a multiple of 128) in the order of PyTorch's CUDA reduction.

    Lengths over 128 are read as float4 vectors: thread t of ``T = min(pow2 floor(len / 4), 512)``
    keeps four accumulators over vectors t, t + T, ..., added in order; then a halving tree over the
    threads (x[i] + x[i + T/2], ...), which reproduces the means of all four golden encodes.
    The sum is multiplied by f32(1 / len).
    """
    n = x.shape[0]
    vec = 4 if n > 128 else 1
    dim0 = n // vec
    threads = min(1 << (dim0.bit_length() - 1), 512)
    v = x.reshape(-1, vec)  # (n / vec, vec) vectors
    full, rem = divmod(dim0, threads)  # every thread has `full` vectors; threads below `rem` one more
    lanes = _sequential_sum(v[: full * threads].reshape(full, threads, vec))  # (threads, vec)
    if rem:
        lanes[:rem] += v[full * threads :]
    sums = _sequential_sum(lanes.t())  # (threads,): lane 0 + lane 1 + ...
    return float(_halving_sum_to(sums, 1)[0] * _recip32(n))


_SUM_CHUNK = 4096  # below torch's GRAIN_SIZE (32768): a sum this long is one serial loop on one thread


def _fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of every element of ``x`` (0-d, x's dtype) in an order that does not depend on the thread count.

    On the CPU the flattened tensor is summed in rows of ``_SUM_CHUNK`` (zero-padded; adding +0.0 is exact),
    row by row, until one row is left: torch gives each row's sum to a single thread, while a plain
    ``x.sum()`` of a large tensor splits it into one chunk per thread. Elsewhere this is ``x.sum()``
    (CUDA reductions do not depend on a thread count; the GPU bytes stay as they were).

    >>> _fixed_sum(torch.ones(100_000)).item()
    100000.0
    """
    if x.device.type != "cpu":
        return x.sum()
    x = x.reshape(-1)
    while x.numel() > _SUM_CHUNK:
        pad = -x.numel() % _SUM_CHUNK
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        x = x.view(-1, _SUM_CHUNK).sum(dim=1)
    return x.sum()


def _mean(x: torch.Tensor) -> torch.Tensor:
    """``x.mean()`` (sum, then a true division by the count, as torch's CPU mean does) via ``_fixed_sum`` on the CPU."""
    if x.device.type != "cpu":
        return x.mean()
    return _fixed_sum(x) / x.numel()


def _halving_sum_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """Tree-sum dim 0 (a power of 2 long) down to ``width`` rows: x[i] + x[i + half], halving each step."""
    while x.shape[0] > width:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x


def _sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (CUDA's ``sqrtf``), on every device.

    PyTorch's vectorised CPU sqrt is not always correctly rounded (on an AMD EPYC with AVX-512, 92 of the 512
    column RMS values of golden case0 were off by one ulp); the double sqrt rounded once to fp32 is exact.
    """
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _block_rms(w: torch.Tensor, dim: int) -> torch.Tensor:
    """RMS along ``dim`` (0: one value per column, 1: per row) as the reference's block_rms computes it."""
    return _sqrt32(_div_scalar(_block_sum_squares(w, dim), w.shape[dim]))


def regularize(weight: torch.Tensor, su_sign: torch.Tensor, sv_sign: torch.Tensor, *,
               out_scales: bool = True) -> Regularized:
    """Spec 7.3 steps 1-11: output scales, output Hadamard, input scales, input Hadamard (no g yet).

    weight f32 (k, n); su_sign (k,) and sv_sign (n,) are the +-1 draws. Returns new tensors.
    ``out_scales=False`` is the reference's ``apply_out_scales=False``: sv keeps the bare signs (all-zero columns
    still 0), except for an all-zero weight, where the reference applies the scales anyway.
    """
    w = weight.to(torch.float32)
    dev = w.device
    su_sign = su_sign.to(device=dev, dtype=torch.float32).reshape(-1)
    sv_sign = sv_sign.to(device=dev, dtype=torch.float32).reshape(-1)

    ocs = _block_rms(w, 0)  # (n,) column RMS over the input dimension
    mean = _cuda_mean(ocs)
    zeros = not mean > _ZERO
    if not zeros:
        ocs = _div_scalar(ocs, mean)
    zero_cols = ocs.abs() < _ZERO
    if out_scales or zeros:
        ocs = torch.where(zero_cols, torch.full_like(ocs, _f32(0.1)), ocs)
        sv = sv_sign * ocs + _f32(_EPS)
    else:
        sv = sv_sign.clone()
    # Each step below drops its input as soon as the output exists: never more than two (k, n) matrices
    # besides the caller's weight (hadamard_left's transposes are spelled out for that reason)
    w = hadamard_right(w / sv)  # true division, column-wise
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)

    ics = _block_rms(w, 1)  # (k,) row RMS over the output dimension
    ics = torch.where(ics.abs() < _ZERO, torch.full_like(ics, _f32(0.1)), ics)
    su = (su_sign * ics) * _recip32(-CODEBOOK_SCALE) + _f32(_EPS)  # ÷s (-codebook_scale): su flips sign
    w = w / su[:, None]  # true division, row-wise
    w = w.t().contiguous()  # hadamard_left(w) = hadamard_right(w^T)^T, one matrix at a time
    w = hadamard_right(w)
    w = w.t().contiguous()
    return Regularized(weight=w, su=su, sv=sv, zeros=zeros)


def sample_scale_index(w_rot: torch.Tensor, width: int = 3) -> torch.Tensor:
    """The flat tile numbers (row-major over the (k/16, n/16) tiles) the scale search evaluates, in docs/format.md §7.4's
    order: the wrapped diagonal, then the num_x tiles of largest and of smallest mean square; duplicates kept."""
    tk, tn = w_rot.shape[0] // 16, w_rot.shape[1] // 16
    d = max(tk, tn)
    a = torch.arange(d).repeat_interleave(width)
    off = torch.arange(width).repeat(d)
    diag_k, diag_n = a % tk, (a + off) % tn
    squares = matrix_to_tiles(w_rot).reshape(tk * tn, 256).square_()  # one (k, n) buffer, squared in place
    ms = squares.mean(dim=1)  # per-tile mean square, flat index tk * tn_total + tn
    del squares
    num_x = min(max(8, (width * d) // 16), (tk * tn + 1) // 2)
    top = torch.topk(ms, num_x, largest=True, sorted=True).indices  # descending
    bottom = torch.topk(ms, num_x, largest=False, sorted=True).indices  # ascending
    return torch.cat([(diag_k * tn + diag_n).to(ms.device), top, bottom])


def _gather_tiles(w_rot: torch.Tensor, index: torch.Tensor, bits: int) -> torch.Tensor:
    """The tiles ``index`` of ``w_rot`` in trellis-position order, times the drift factor of ``bits``."""
    sample = w_rot.reshape(-1)[tile_element_index(w_rot.shape[1], index)]  # only these tiles
    drift = _DRIFT.get(bits, 1.0)
    return sample * _f32(drift) if drift != 1.0 else sample


def sample_scale_tiles(w_rot: torch.Tensor, bits: int, width: int = 3) -> torch.Tensor:
    """The tiles the scale search evaluates: wrapped diagonal plus extreme tiles, drift applied.

    Returns (3D + 2 num_x, 256) f32 in trellis-position order (docs/format.md §7.4); duplicates are kept.
    """
    return _gather_tiles(w_rot, sample_scale_index(w_rot, width), bits)


ProgressFn = Callable[[int], None]
CPU_PROGRESS_TILES = 512  # with a progress callback, CPU calls of this many tiles (seconds each, not minutes)


def _quantize_batched(tiles: torch.Tensor, bits: int, codebook: str,
                      progress: Optional[ProgressFn] = None, chunk_tiles: Optional[int] = None,
                      slots: Optional[int] = None, rows: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_tiles over (N, 256) tiles in calls of at most ``chunk_tiles``, ``slots`` in flight in the GPU
    kernel, each keeping the plan's ``rows`` (results depend on none of them).

    ``chunk_tiles`` defaults to MAX_TILES_PER_CALL; ``progress(n)`` is called after every call with the number of
    tiles it quantized; on the CPU the calls are then CPU_PROGRESS_TILES long, so a progress bar moves inside a
    large layer.
    """
    from exl3tool.encode.viterbi import quantize_tiles

    # on a GPU the kernel writes into the outputs (no per-call copies), so only its scratch (``slots``) bounds a
    # call: the batch goes through in calls of MAX_TILES_PER_CALL, not of the plan's chunk
    step = _step(tiles.device, None if tiles.is_cuda else chunk_tiles, progress)
    if tiles.shape[0] <= step:
        values, states = quantize_tiles(tiles.contiguous(), bits, codebook, programs=slots, rows=rows)
        if progress is not None:
            progress(values.shape[0])
        return values, states
    values = torch.empty(tiles.shape, dtype=torch.float32, device=tiles.device)  # filled chunk by chunk: no
    states = torch.empty(tiles.shape, dtype=torch.int16, device=tiles.device)  # list of parts and concatenation
    for start in range(0, tiles.shape[0], step):
        end = min(start + step, tiles.shape[0])
        quantize_tiles(tiles[start:end].contiguous(), bits, codebook, programs=slots, rows=rows,
                       out=(values[start:end], states[start:end]))
        if progress is not None:
            progress(end - start)
    return values, states


def _step(device: torch.device, chunk_tiles: Optional[int], progress: Optional[ProgressFn]) -> int:
    step = min(MAX_TILES_PER_CALL, chunk_tiles or MAX_TILES_PER_CALL)
    if progress is not None and device.type == "cpu":
        step = min(step, CPU_PROGRESS_TILES)
    if step < 1:
        raise ValueError(f"chunk_tiles must be positive, got {chunk_tiles!r}")
    return step


ChunkFn = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _quantize_matrix(w_r: torch.Tensor, err: torch.Tensor, bits: int, codebook: str, chunk_tiles: Optional[int],
                     progress: Optional[ProgressFn], on_chunk: ChunkFn, slots: Optional[int] = None,
                     rows: Optional[int] = None) -> None:
    """Quantize every tile of the (k, n) matrix ``w_r`` in chunks of ``chunk_tiles``, never all tiles at once.

    Each chunk's tiles are gathered from ``w_r``, quantized, and their squared error (W_r - Q_r)^2 scattered
    into ``err`` at the same places; ``err`` may be ``w_r`` itself (each chunk reads its tiles before it
    writes them). ``on_chunk(lo, hi, index, values, states)`` gets flat tiles lo..hi-1, their element index
    (``tile_element_index``), values and int16 states. Every value is that of the whole-matrix computation.
    """
    from exl3tool.encode.viterbi import quantize_tiles

    k, n = w_r.shape
    total = (k // 16) * (n // 16)
    src, dst = w_r.reshape(-1), err.reshape(-1)
    step = _step(w_r.device, chunk_tiles, progress)
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        index = tile_element_index(n, torch.arange(lo, hi, device=w_r.device))
        tiles = src[index]
        values, states = quantize_tiles(tiles, bits, codebook, programs=slots, rows=rows)
        on_chunk(lo, hi, index, values, states)
        dst[index] = tiles.sub_(values).square_()
        del tiles, values, states, index
        if progress is not None:
            progress(hi - lo)


def _quantize_in_place(w_r: torch.Tensor, bits: int, codebook: str, chunk_tiles: Optional[int],
                       progress: Optional[ProgressFn], on_chunk: ChunkFn, slots: Optional[int] = None,
                       rows: Optional[int] = None) -> None:
    """``_quantize_matrix(w_r, w_r, ...)``: every tile quantized and overwritten with its squared error.

    On CUDA where ``memory.quantizes_in_place`` (the K of IN_PLACE_BITS, small layers) the Triton kernel reads
    the tiles where they lie and writes the errors over them (``viterbi_matrix``): a chunk holds only its states,
    so chunks are as large as the plan allows and a small layer is one launch; ``on_chunk`` then gets no index or
    values (None). Elsewhere, or for a weight that is not contiguous, ``_quantize_matrix``.
    """
    from exl3tool.encode import memory

    k, n = w_r.shape
    total = (k // 16) * (n // 16)
    if not (w_r.is_cuda and w_r.is_contiguous() and memory.quantizes_in_place(bits, total)):  # as the plan sized it
        return _quantize_matrix(w_r, w_r, bits, codebook, chunk_tiles, progress, on_chunk, slots, rows)
    try:
        from exl3tool.kernels.viterbi import viterbi_matrix
    except ImportError:  # no Triton: the gathering path, whose quantize_tiles says what it runs instead
        return _quantize_matrix(w_r, w_r, bits, codebook, chunk_tiles, progress, on_chunk, slots, rows)
    step = _step(w_r.device, chunk_tiles, progress)
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        states = viterbi_matrix(w_r, lo, hi - lo, bits, codebook, programs=slots, rows=rows)
        on_chunk(lo, hi, None, None, states)
        del states
        if progress is not None:
            progress(hi - lo)


def scale_mse(tiles: torch.Tensor, scales: list[float], bits: int, codebook: str = "mcg",
              chunk_tiles: Optional[int] = None, slots: Optional[int] = None) -> list[float]:
    """mse(s) of docs/format.md §7.4 for each scale: mean((f32(q ÷s s) - T)^2) with q = quantize(f32(T * f32(s))).

    All scales go through the quantizer together (batched, ``chunk_tiles`` tiles per call); each mse is an
    fp32 mean (``_mean``).
    """
    if not scales:
        return []
    batch = torch.cat([tiles * _f32(s) for s in scales])
    values, _ = _quantize_batched(batch, bits, codebook, chunk_tiles=chunk_tiles, slots=slots)
    del batch
    values = values.reshape(len(scales), *tiles.shape)
    return _mses([values[i] for i in range(len(scales))], tiles, scales)


def _mses(values: list[torch.Tensor], tiles: torch.Tensor, scales: list[float]) -> list[float]:
    """``scale_mse``'s fp32 means of quantized ``values[i]`` (contiguous, ``tiles``' shape) at ``scales[i]``,
    read back with one host sync for all of them."""
    return [float(m) for m in _mses_tensor(values, tiles, scales).tolist()]


def _first_argmin(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v < values[best]:
            best = i
    return best


def search_global_scale(w_rot: torch.Tensor, bits: int, codebook: str = "mcg",
                        chunk_tiles: Optional[int] = None, slots: Optional[int] = None) -> float:
    """Spec 7.4: coarse grid on every third sample tile, fine grid on all, parabola; returns g (double).

    The mses are those of ``scale_mse`` on ``sample_scale_tiles`` bit for bit, but the quantizer sees each
    (tile, scale) pair once: a tile the sample holds twice (an extreme tile on the diagonal) is quantized once
    per scale, and the fine grid's centre, a coarse scale, reuses the coarse pass's tiles (every third sample
    tile), since quantizing a tile depends on nothing else in its batch.
    """
    return float(search_global_scale_tensor(w_rot, bits, codebook, chunk_tiles, slots))


_FINE_OFFSETS = [_FINE_STEP * (i - 2) for i in range(5)]  # Python doubles: fine scale i = centre + offset i


def search_global_scale_tensor(w_rot: torch.Tensor, bits: int, codebook: str = "mcg",
                               chunk_tiles: Optional[int] = None, slots: Optional[int] = None,
                               rows: Optional[int] = None) -> torch.Tensor:
    """``search_global_scale`` as a 0-d float64 tensor on ``w_rot``'s device, computed there.

    The choice of the centre, the fine scales and the parabola are the host's double arithmetic done by the
    device (IEEE +, -, *, / in float64, the first minimum as ``_first_argmin`` takes it), so the result is the
    host computation's bit for bit; on a GPU nothing waits for the mses, and the fine grid and the tile
    quantization that follow are queued behind the coarse grid without a round trip to the host.
    """
    check_bits(bits)
    check_codebook(codebook)
    dev = w_rot.device
    index = sample_scale_index(w_rot)
    sample = _gather_tiles(w_rot, index, bits)  # the mses' targets, in the spec's layout
    # which tiles are distinct, worked out on the host (a few thousand numbers, one transfer)
    index_h = index.cpu()
    uniq, inverse = torch.unique(index_h, return_inverse=True)  # uniq sorted: inverse maps sample rows into it
    distinct = uniq.numel() == index_h.numel()
    if distinct:  # no duplicates: the distinct tiles are the sample's own rows, in its order
        inverse = torch.arange(index_h.numel())
    coarse_u, coarse_inv = torch.unique(inverse[0::3], return_inverse=True)  # rows of tiles_u the coarse grid uses
    have = torch.zeros(uniq.numel(), dtype=torch.bool)
    have[coarse_u] = True
    rest = (~have).nonzero().squeeze(1)  # rows the fine centre still needs
    if distinct:
        tiles_u, expand = sample, (lambda v: v)
    else:
        tiles_u = _gather_tiles(w_rot, uniq.to(dev), bits)
        inverse_d = inverse.to(dev)
        expand = lambda v: v[inverse_d]  # noqa: E731
    coarse_u, coarse_inv, rest = coarse_u.to(dev), coarse_inv.to(dev), rest.to(dev)
    # host constants go to the device before the first launch: a copy from the host waits for the queue to drain
    coarse_scales = torch.tensor(_COARSE, dtype=torch.float64, device=dev)
    fine_offsets = torch.tensor(_FINE_OFFSETS, dtype=torch.float64, device=dev)
    values = _quantize_scaled(tiles_u[coarse_u], _COARSE, bits, codebook, chunk_tiles, slots, rows)
    coarse = _mses_tensor(values, sample[0::3], [float(c) for c in _COARSE], lambda v: v[coarse_inv])
    best = _first_argmin_tensor(coarse)
    center = _pick(coarse_scales, best)
    fine_scales = center + fine_offsets  # fine_scales[2] = centre + 0.0 == centre
    center_values = torch.empty_like(tiles_u)
    center_values[coarse_u] = _pick(_stacked(values), best)
    del values
    parts = [tiles_u, tiles_u, tiles_u[rest], tiles_u, tiles_u]
    fine_values = _quantize_scaled(parts, fine_scales, bits, codebook, chunk_tiles, slots, rows)
    center_values[rest] = fine_values[2]
    fine_values[2] = center_values
    del center_values
    fine = _mses_tensor(fine_values, sample, fine_scales, expand).to(torch.float64)
    b = _first_argmin_tensor(fine)
    inner = (b > 0) & (b < 4)
    bc = b.clamp(1, 3)
    y0, y1, y2 = _pick(fine, bc - 1), _pick(fine, bc), _pick(fine, bc + 1)
    den = y0 - 2.0 * y1 + y2
    off = torch.where(den > 0, 0.5 * (y0 - y2) / den, torch.zeros_like(den)).clamp(-0.5, 0.5)
    off = torch.where(inner, off, torch.zeros_like(off))
    return (_pick(fine_scales, b) + off * _FINE_STEP).clamp_min(0.01)


def _pick(values: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """values[i] for a 0-d index tensor without reading it on the host (plain indexing would)."""
    return values.index_select(0, i.view(1)).squeeze(0)


def _first_argmin_tensor(values: torch.Tensor) -> torch.Tensor:
    """``_first_argmin`` on the device: the first minimum, NaNs never chosen unless the first value is one."""
    clean = torch.where(torch.isnan(values), torch.full_like(values, float("inf")), values)
    return torch.where(torch.isnan(values[0]), torch.zeros((), dtype=torch.int64, device=values.device),
                       torch.argmin(clean))


def _mses_tensor(values: list[torch.Tensor], tiles: torch.Tensor, scales: list[float] | torch.Tensor,
                 expand: Callable[[torch.Tensor], torch.Tensor] = lambda v: v) -> torch.Tensor:
    """``_mses`` as an fp32 tensor (one mean per scale), with no host round trip: the mean for scale i is taken
    on ``expand(values[i])`` (the sample's rows from the distinct tiles'), one scale at a time so that only one
    expanded copy exists. ``scales`` may be a float64 tensor: ``÷s`` multiplies by f32(1 / s), the reciprocal
    taken in double as ``_recip32`` does."""
    if isinstance(scales, torch.Tensor):
        recips = (1.0 / scales).to(torch.float32)
        means = [_mean((expand(v) * recips[i] - tiles).square()) for i, v in enumerate(values)]
    else:
        means = [_mean((_div_scalar(expand(v), s) - tiles).square()) for v, s in zip(values, scales)]
    return torch.stack(means)


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """Equal-sized consecutive views of one tensor (``_quantize_scaled``'s result) as one (len, n, 256) view."""
    base = parts[0]
    return base.as_strided((len(parts), *base.shape), (base.numel(), *base.stride()))


def _quantize_scaled(tiles: torch.Tensor | list[torch.Tensor], scales: list[float] | torch.Tensor, bits: int,
                     codebook: str, chunk_tiles: Optional[int], slots: Optional[int],
                     rows: Optional[int] = None) -> list[torch.Tensor]:
    """The quantized values of f32(tiles_i * f32(s_i)) for each scale (one tile set for all, or one per scale),
    through the quantizer as one batch; a list of per-scale (n_i, 256) tensors."""
    sets = tiles if isinstance(tiles, list) else [tiles] * len(scales)
    if isinstance(scales, torch.Tensor):  # float64 scales on the device: f32(s) rounded there
        factors = scales.to(torch.float32)
        batch = torch.cat([t * factors[i] for i, t in enumerate(sets)])
    else:
        batch = torch.cat([t * _f32(s) for t, s in zip(sets, scales)])
    values, _ = _quantize_batched(batch, bits, codebook, chunk_tiles=chunk_tiles, slots=slots, rows=rows)
    del batch
    return list(values.split([t.shape[0] for t in sets]))


def quantize_regularized(
    w_r: torch.Tensor, bits: int, codebook: str = "mcg", progress: Optional[ProgressFn] = None,
    chunk_tiles: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Spec 7.5-7.6: quantize every tile of the g-scaled matrix (no error feedback).

    Returns (states (k/16, n/16, 256) int16 in trellis order, Q_r f32 (k, n), proxy_error), where
    proxy_error = sum((W_r - Q_r)^2) / (k n) with fp32 differences and squares summed in float64.
    ``chunk_tiles`` tiles go through the quantizer at a time (results do not depend on it).
    """
    check_bits(bits)
    check_codebook(codebook)
    w32 = w_r.to(torch.float32)
    k, n = w32.shape
    tk, tn = k // 16, n // 16
    states = torch.empty((tk * tn, 256), dtype=torch.int16, device=w32.device)
    q_r = torch.empty_like(w32)
    err = torch.empty_like(w32)
    q_flat = q_r.reshape(-1)

    def keep(lo: int, hi: int, index: torch.Tensor, values: torch.Tensor, st: torch.Tensor) -> None:
        states[lo:hi] = st
        q_flat[index] = values

    _quantize_matrix(w32, err, bits, codebook, chunk_tiles, progress, keep)
    return states.reshape(tk, tn, 256), q_r, _proxy_error_of_squares(err)


def _fixed_sum_float64(x: torch.Tensor) -> torch.Tensor:
    """``_fixed_sum(x.to(torch.float64))`` of a CPU tensor without a float64 copy of the whole of ``x``.

    The first level of ``_fixed_sum`` is one float64 sum per row of ``_SUM_CHUNK`` values, each on one thread; those
    rows are widened and summed ``PROXY_SLAB_ROWS`` at a time into the vector of row sums, which then goes through
    ``_fixed_sum`` as before: the same sums in the same order, so the same value. Widened at once it took 2 W
    beside W_r and the trellis: the CPU encode's peak, 3.4-3.7 W at issue 24's shapes (above the plan's 3.5 W at
    three of the four).
    """
    flat = x.reshape(-1)
    if flat.numel() <= _SUM_CHUNK or flat.numel() % _SUM_CHUNK:
        return _fixed_sum(flat.to(torch.float64))  # one row, or a padded last row: small or not a layer's shape
    rows = flat.view(-1, _SUM_CHUNK)
    sums = torch.empty(rows.shape[0], dtype=torch.float64)
    for lo in range(0, rows.shape[0], PROXY_SLAB_ROWS):
        sums[lo : lo + PROXY_SLAB_ROWS] = rows[lo : lo + PROXY_SLAB_ROWS].to(torch.float64).sum(dim=1)
    return _fixed_sum(sums)


def _proxy_error_of_squares(sq: torch.Tensor) -> float:
    """sum(sq) / (k n) in float64, for the (k, n) fp32 squared errors ``sq`` = (W_r - Q_r)^2.

    On CUDA in the reference's order (``fallback_quant``): one float64 ``torch.sum`` per contiguous 16-row block,
    added into a float64 accumulator from the last block to the first, so the proxy error (an entry's metadata)
    is the reference's bit for bit on the same GPU, and no float64 copy of the matrix is made. On the CPU
    ``_fixed_sum`` (which does not depend on the thread count) of the values widened to float64, a slab at a
    time (``_fixed_sum_float64``); elsewhere ``_fixed_sum`` of the whole widened at once.
    """
    if sq.device.type == "cpu":
        return float(_fixed_sum_float64(sq)) / sq.numel()
    if sq.device.type != "cuda":
        return float(_fixed_sum(sq.to(torch.float64))) / sq.numel()
    acc = torch.zeros((), dtype=torch.float64, device=sq.device)
    for i in range(sq.shape[0] - 16, -1, -16):
        acc += torch.sum(sq[i : i + 16], dtype=torch.float64)
    return (acc / sq.numel()).item()


@functools.cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (AttributeError, OSError, TypeError):  # another C library, or no process handle (Windows)
        return None


def _release_host_heap(device: torch.device) -> None:
    """After a CPU phase, give the C heap's free pages back to the system (glibc ``malloc_trim``).

    glibc serves blocks under its 32 MiB mmap ceiling from the heap and keeps them when freed, so what one phase
    freed stayed resident under the next: the chunks' temporaries under the proxy error's sum (up to 181 MiB at
    issue 24's shapes), regularize's under the scale search. Elsewhere nothing to do.
    """
    if device.type == "cpu" and (trim := _malloc_trim()) is not None:
        trim(0)


def _fail(name: str | None, message: str) -> ValueError:
    return ValueError(f"{name}: {message}" if name else message)


def _check_weight(weight: torch.Tensor, name: str | None) -> None:
    if not isinstance(weight, torch.Tensor):
        raise _fail(name, f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise _fail(name, f"weight must be 2-D (in_features, out_features), got shape {tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise _fail(name, f"weight must be float32, got {weight.dtype} (shape {tuple(weight.shape)}); pass weight.float()")
    k, n = weight.shape
    for label, dim in (("in_features", k), ("out_features", n)):
        if dim == 0 or dim % 128:
            raise _fail(name, f"{label} {dim} is not a positive multiple of 128 (weight shape {tuple(weight.shape)}); "
                        "EXL3 keeps such layers unencoded")
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        first = tuple(int(i) for i in bad[0])
        raise _fail(name, f"weight has {bad.shape[0]} non-finite values (first at [{first[0]}, {first[1]}] = "
                    f"{float(weight[first])}); shape {tuple(weight.shape)}")


def _check_signs(sign_vectors: tuple[torch.Tensor, torch.Tensor], k: int, n: int, name: str | None) -> None:
    if not isinstance(sign_vectors, (tuple, list)) or len(sign_vectors) != 2:
        raise _fail(name, "sign_vectors must be a pair (su_sign (k,), sv_sign (n,))")
    for label, vec, length in (("su_sign", sign_vectors[0], k), ("sv_sign", sign_vectors[1], n)):
        if not isinstance(vec, torch.Tensor) or vec.numel() != length or vec.dim() not in (1, 2):
            shape = tuple(vec.shape) if isinstance(vec, torch.Tensor) else type(vec).__name__
            raise _fail(name, f"{label} must have {length} elements for a ({k}, {n}) weight, got {shape}")
        if not bool(((vec == 1) | (vec == -1)).all()):
            raise _fail(name, f"{label} must hold only +1 and -1")


@dataclass(frozen=True)
class ScaledWeight:
    """``encode_linear``'s first half: the regularised weight times the searched global scale, with its scales.

    ``w_r`` f32 (k, n) goes to the tile quantizer (``finish_encode``), which overwrites it; ``su`` f32 (k,) is
    already divided by ``g``; ``plan`` is the chunking chosen for the memory budget. Splitting here lets a warm run
    the first half of the next layer (on another CUDA stream) while the Viterbi of this one runs: the bytes are
    those of ``encode_linear``, which is the two halves one after the other.
    """

    w_r: torch.Tensor
    su: torch.Tensor
    sv: torch.Tensor
    g_value: torch.Tensor | float  # the global scale: a 0-d float64 tensor on the device until read (``g``)
    bits: int
    codebook: str
    plan: EncodeMemoryPlan
    zeros: bool = False  # the weight's column RMS averages to zero (``Regularized.zeros``)

    @property
    def g(self) -> float:
        """The global scale (double); on a GPU reading it waits for the scale search."""
        return float(self.g_value)


def prepare_encode(
    weight: torch.Tensor,
    *,
    bits: int = 6,
    seed: int | None,
    codebook: str = "mcg",
    sign_vectors: tuple[torch.Tensor, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    g_scale: float | None = None,
    name: str | None = None,
    memory_budget_bytes: int | None = None,
    timer: Optional[StageTimer] = None,
    out_scales: bool = True,
) -> ScaledWeight:
    """Checks, the memory plan, signs (7.2), regularisation (7.3) and the global-scale search (7.4).

    See ``encode_linear`` for the arguments; ``out_scales`` goes to ``regularize`` (False only for the drop-in's
    ``apply_out_scales=False``).
    """
    check_bits(bits)
    check_codebook(codebook)
    _check_weight(weight, name)
    k, n = weight.shape
    if sign_vectors is None:
        if seed is None:
            raise _fail(name, "need a seed (or sign_vectors) to draw the sign vectors")
        sign_vectors = reference_signs(seed, k, n)
    _check_signs(sign_vectors, k, n, name)
    if g_scale is not None and not (np.isfinite(g_scale) and g_scale > 0):
        raise _fail(name, f"g_scale must be a positive finite number, got {g_scale!r}")
    dev = torch.device(device) if device is not None else weight.device
    plan = encode_memory_plan(k, n, bits, dev, memory_budget_bytes, codebook=codebook, name=name)
    _release_host_heap(weight.device)  # the finiteness check's masks
    with stage(timer, "h2d", dev):
        w = weight.to(dev)  # the caller's tensor when it is already there: never written
    with stage(timer, "regularize", dev):
        reg = regularize(w, sign_vectors[0].reshape(-1), sign_vectors[1].reshape(-1), out_scales=out_scales)
    del w  # a copy made here is no longer needed
    w_r, su, sv, zeros = reg.weight, reg.su, reg.sv, reg.zeros
    del reg
    _release_host_heap(dev)
    with stage(timer, "scale_search", dev):
        # g stays on the device (no wait for the search): f32(g) and f32(1 / g) are rounded there from the double
        g = (torch.tensor(float(g_scale), dtype=torch.float64, device=w_r.device) if g_scale is not None
             else search_global_scale_tensor(w_r, bits, codebook, plan.chunk_tiles, plan.slots, plan.rows))
        w_r.mul_(g.to(torch.float32))  # docs/format.md §7.5's W_r, in place: the regularised weight is not needed any more
        su = su * (1.0 / g).to(torch.float32)  # ÷s g
    _release_host_heap(dev)
    return ScaledWeight(w_r=w_r, su=su, sv=sv, g_value=g, bits=bits, codebook=codebook, plan=plan, zeros=zeros)


def finish_encode(prepared: ScaledWeight, *, progress: Optional[ProgressFn] = None,
                  timer: Optional[StageTimer] = None) -> EncodedLinear:
    """Tile quantization (7.5, 7.6) in the plan's chunks, packing and fp16 scales (7.7, 7.8).

    Consumes ``prepared.w_r``: it becomes the squared error (W_r - Q_r)^2 the proxy error is summed from.
    """
    w_r, bits = prepared.w_r, prepared.bits
    dev = w_r.device
    k, n = w_r.shape
    tk, tn = k // 16, n // 16
    trellis = torch.empty((tk * tn, 16 * bits), dtype=torch.int16, device=dev)

    def pack(lo: int, hi: int, index: torch.Tensor, values: torch.Tensor, states: torch.Tensor) -> None:
        trellis[lo:hi] = pack_trellis(states, bits)

    with stage(timer, "viterbi", dev):
        _quantize_in_place(w_r, bits, prepared.codebook, prepared.plan.chunk_tiles, progress, pack,
                           prepared.plan.slots, prepared.plan.rows)
    _release_host_heap(dev)
    with stage(timer, "pack", dev):
        proxy_error = _proxy_error_of_squares(w_r)
        suh, svh = prepared.su.to(torch.float16), prepared.sv.to(torch.float16)
    return EncodedLinear(
        trellis=trellis.reshape(tk, tn, 16 * bits),
        suh=suh,
        svh=svh,
        proxy_error=proxy_error,
        g_scale=prepared.g,
        bits=bits,
        codebook=prepared.codebook,
        zeros=prepared.zeros,
        platform=encoder_platform(dev),
    )


def encode_linear(
    weight: torch.Tensor,
    *,
    bits: int = 6,
    seed: int | None,
    codebook: str = "mcg",
    sign_vectors: tuple[torch.Tensor, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    g_scale: float | None = None,
    name: str | None = None,
    progress: Optional[ProgressFn] = None,
    memory_budget_bytes: int | None = None,
    timer: Optional[StageTimer] = None,
) -> EncodedLinear:
    """Encode one float32 (in_features, out_features) weight as the reference's online path does.

    The sign vectors are ``reference_signs(seed, k, n)``: the reference's CUDA draws, computed on the
    CPU, so an encode on any device gets the signs a server's own encode would (pass ``sign_vectors``
    to inject others; ``seed`` is then unused and may be None). ``device=None`` works where the weight
    lives; on CUDA everything stays on the GPU and the Triton Viterbi does the tiles. ``g_scale``
    skips the scale search (conformance tests); ``name`` prefixes error messages (e.g. the layer key);
    ``progress(n)`` hears of every n tiles quantized (the k/16 * n/16 tiles of the weight, not the scale search).
    ``memory_budget_bytes`` bounds what the encode allocates on ``device`` besides the weight (None: what the
    reference encoder needs for this layer, ``exl3tool.encode.memory.default_budget``); the tiles go through
    the quantizer in chunks sized to it, with the same bytes for any budget. A budget too small even for the
    smallest chunk raises EncodeMemoryError (a ValueError) naming ``name`` and the bytes needed.
    ``timer`` (a ``StageTimer``) gets the seconds of each stage. It is ``prepare_encode`` then
    ``finish_encode``. The result records the ``platform`` it was computed on (``encoder_platform``).

    Args:
        weight: the (in_features, out_features) weight, float32 (or castable).
        bits: K, the trellis bits per weight (1-8).
        seed: the cache key's seed, which draws the sign vectors (unused with ``sign_vectors``).
        codebook: ``mcg`` (the server's) or another of ``CODEBOOKS``.
        sign_vectors, device, g_scale, name, progress, memory_budget_bytes, timer: as described above.

    Returns:
        The ``EncodedLinear``: trellis, suh, svh (a cache entry's tensors), proxy error, global scale, platform.

    >>> w = torch.randn(128, 128) * 0.02
    >>> enc = encode_linear(w, bits=2, seed=7, g_scale=0.8)
    >>> tuple(enc.trellis.shape), enc.suh.dtype
    ((8, 8, 32), torch.float16)
    """
    prepared = prepare_encode(weight, bits=bits, seed=seed, codebook=codebook, sign_vectors=sign_vectors,
                              device=device, g_scale=g_scale, name=name, memory_budget_bytes=memory_budget_bytes,
                              timer=timer)
    return finish_encode(prepared, progress=progress, timer=timer)


def encode_memory_plan(k: int, n: int, bits: int, device: torch.device | str,
                       memory_budget_bytes: int | None = None, *, codebook: str = "mcg",
                       name: str | None = None) -> EncodeMemoryPlan:
    """The chunking ``encode_linear`` uses for a (k, n) weight on ``device`` within ``memory_budget_bytes``.

    On CUDA the Viterbi kernel's slots go up to its resident wave (tiles the GPU runs at once, which compiles
    the kernel if it was not yet) and the default budget is the reference's for this device's SMs. Raises
    EncodeMemoryError (a ValueError naming ``name``) when the budget cannot hold even the smallest chunk.
    """
    dev = torch.device(device)
    wave = sms = None
    rows_slots: dict[int, int] | None = None
    if dev.type == "cuda":
        from exl3tool.kernels.viterbi import resident_tiles, row_choices

        wave = resident_tiles(dev, bits, codebook)
        rows_slots = row_choices(bits)  # the cost-row strides the kernel can run here, with a slot's bytes
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return plan_encode_memory(k, n, bits, dev.type, memory_budget_bytes, wave=wave, sms=sms, name=name,
                              rows_slot_bytes=rows_slots)


def encode_linear_with_input(
    weight: torch.Tensor, *, bits: int = 6, seed: int | None, codebook: str = "mcg",
    sign_vectors: tuple[torch.Tensor, torch.Tensor] | None = None, device: torch.device | str | None = None,
    g_scale: float | None = None, name: str | None = None, progress: Optional[ProgressFn] = None,
) -> tuple[EncodedLinear, torch.Tensor]:
    """``encode_linear`` plus the g-scaled rotated weight W_r (k, n) f32 whose tiles were quantized.

    What an exact comparison needs (``exl3tool.operations.exact``): an entry written on another platform may differ from this
    one's encode in tiles where the two W_r round differently, and W_r tells whether each such tile is as good as
    this one's. The encode works on W_r in place, so W_r is computed again here: the same operations on the same
    device (``regularize``, then the product with f32(g)) give the same values.
    """
    encoded = encode_linear(weight, bits=bits, seed=seed, codebook=codebook, sign_vectors=sign_vectors,
                            device=device, g_scale=g_scale, name=name, progress=progress)
    k, n = weight.shape
    if sign_vectors is None:
        sign_vectors = reference_signs(seed, k, n)
    dev = torch.device(device) if device is not None else weight.device
    reg = regularize(weight.to(dev), sign_vectors[0].reshape(-1), sign_vectors[1].reshape(-1))
    return encoded, reg.weight.mul_(_f32(encoded.g_scale))


def encoder_platform(device: torch.device | str) -> str:
    """Where an encode ran, as far as its bytes depend on it: device kind and model, CPU vector ISA, torch version.

    Two encodes of the same key agree byte for byte when this string (and the exl3tool version) agree; across
    platforms the Hadamard summation order differs (README "Conformance"), so some tiles may differ.

    >>> encoder_platform("cpu")  # doctest: +SKIP
    'cpu AVX512; torch 2.13.0'
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        where = f"cuda {torch.cuda.get_device_name(dev)}"
    else:
        where = f"{dev.type} {torch.backends.cpu.get_cpu_capability()}"
    return f"{where}; torch {torch.__version__}"
