"""Host side of the Triton trellis GEMM: ``trellis_matmul`` and ``fold_weight`` check their arguments, take the
launch from ``tuning.choose_config`` (or the caller's) and run ``triton_kernels``."""

from __future__ import annotations

import os

import torch

from exl3tool.format.hadamard import HADAMARD_SCALE, hadamard_128
from exl3tool.kernels.gemm.config import (_FOLDS, FOLD_BOTH, FOLD_BOTH16, FOLD_NONE, FOLD_OUT, GemmConfig,
                                          ReconConfig, pair_block_bits)
from exl3tool.kernels.gemm.reference import check_inputs
from exl3tool.kernels.gemm.triton_kernels import HAVE_TRITON, triton
from exl3tool.kernels.gemm.tuning import choose_config


if HAVE_TRITON:
    from exl3tool.kernels.gemm.triton_kernels import _gemm_kernel, _post_kernel, _prep_kernel, _recon_kernel


__all__ = ["trellis_matmul", "fold_weight"]

_CB_ID = {"3inst": 0, "mcg": 1, "mul1": 2}

# Under TRITON_INTERPRET the Hadamards use one fp32 dot, because the interpreter's tl.dot reads bf16 storage as
# raw integers. A test that patches the interpreter's dot sets this to False to run the GPU's bf16-split path.
INTERPRETER_EXACT_HADAMARD = True


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_HAD_CACHE: dict[str, torch.Tensor] = {}
_CNT_CACHE: dict[str, torch.Tensor] = {}


def _hadamard_bf16(device: torch.device) -> torch.Tensor:
    key = str(device)
    h = _HAD_CACHE.get(key)
    if h is None:
        h = hadamard_128(torch.float32, device).to(torch.bfloat16).contiguous()
        _HAD_CACHE[key] = h
    return h


def _counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters for the serial split-K reduction; kernels reset them, so they are reused."""
    key = str(device)
    c = _CNT_CACHE.get(key)
    if c is None or c.numel() < count:
        c = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _CNT_CACHE[key] = c
    return c


def _check_triton_device(dev: torch.device) -> None:
    if not HAVE_TRITON:
        raise ValueError("trellis_matmul needs triton; use trellis_matmul_reference")
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpret()):
        raise ValueError(f"trellis_matmul needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {dev}")


def fold_weight(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, bits: int, codebook: str = "mcg",
                fold: int = FOLD_OUT, config: ReconConfig | None = None) -> torch.Tensor:
    """The fp16 (k, n) weight of the reconstruct path (Triton kernel), Q with ``fold``'s sides folded in.

    Equal to ``fold_weight_reference`` bit for bit for FOLD_NONE/OUT/IN. Example: ``fold_weight(tr, suh, svh,
    bits=6, fold=FOLD_BOTH)`` is the dequantized weight in fp16.
    """
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be a 3-D int16 tensor (k/16, n/16, 16*bits), got {trellis.dtype} "
                         f"{tuple(trellis.shape)}")
    k = 16 * trellis.shape[0]
    x = torch.empty((0, k), dtype=torch.float16, device=trellis.device)
    check_inputs(x, trellis, suh, svh, bits, codebook)
    _check_triton_device(trellis.device)
    if fold not in _FOLDS:
        raise ValueError(f"fold must be one of {_FOLDS}, got {fold}")
    cfg = config or ReconConfig(fold=fold, asm=2 if trellis.device.type == "cuda" else 0)
    return _fold_weight(trellis.contiguous().view(torch.int32), suh.contiguous(), svh.contiguous(), k,
                        16 * trellis.shape[1], bits, codebook, fold, cfg)


def _fold_weight(words: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, k: int, n: int, bits: int,
                 codebook: str, fold: int, cfg: ReconConfig) -> torch.Tensor:
    dev = words.device
    if 128 % cfg.br or cfg.br < 16:
        raise ValueError(f"bad config {cfg}")
    w = torch.empty((k, n), dtype=torch.float16, device=dev)
    _recon_kernel[(n // 128, k // 128)](words, suh, svh, _hadamard_bf16(dev), w, n, HADAMARD_SCALE,
                                        K_BITS=bits, CB=_CB_ID[codebook],
                                        S1=1 if pair_block_bits(bits) == 2 else 2,
                                        ASM=cfg.asm if dev.type == "cuda" else 0, FOLD=fold, BR=cfg.br,
                                        num_warps=cfg.num_warps)
    return w


def _prep(x2d: torch.Tensor, suh: torch.Tensor, ieee: bool, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """x2 = fp16((x * suh) @ B_k) (the prep kernel), (m, k), stored as ``dtype`` (fp32: the same fp16 values)."""
    m, k = x2d.shape
    xin = torch.empty((m, k), dtype=dtype, device=x2d.device)
    pbm = 64 if m >= 64 else 16
    _prep_kernel[(-(-m // pbm), k // 128)](x2d, suh, _hadamard_bf16(x2d.device), xin, m, k, HADAMARD_SCALE,
                                           BM=pbm, IEEE=ieee, num_warps=4)
    return xin


def _mm(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> None:
    """y = a @ b for fp16 a, b (fp32 accumulation, one rounding to y's dtype): cuBLAS on CUDA."""
    if a.device.type != "cuda":  # the interpreter's CPU tests: the same arithmetic in fp32
        y.copy_(a.float() @ b.float())
    elif y.dtype == torch.float16:
        torch.mm(a, b, out=y)
    else:  # bf16 output: keep the fp32 product (fp16 could overflow where bf16 does not)
        y.copy_(torch.mm(a, b, out_dtype=torch.float32))


def _recon_matmul(x2d: torch.Tensor, words: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, k: int, n: int,
                  bits: int, codebook: str, cfg: ReconConfig, y: torch.Tensor, ieee: bool) -> None:
    """The reconstruct path: y = x @ W through the fp16 weight of ``cfg.fold`` and torch.mm."""
    m = x2d.shape[0]
    w = _fold_weight(words, suh, svh, k, n, bits, codebook, cfg.fold, cfg)
    if cfg.fold in (FOLD_NONE, FOLD_OUT):
        xin = _prep(x2d, suh, ieee)
    else:  # the input side is in w: x goes to cuBLAS as it is (fp16)
        xin = x2d.to(torch.float16)
    if cfg.fold in (FOLD_OUT, FOLD_BOTH, FOLD_BOTH16):
        _mm(xin, w, y)
        return
    y1 = torch.empty((m, n), dtype=torch.float16, device=x2d.device)
    _mm(xin, w, y1)
    _post_kernel[(-(-m // 64), n // 128)](y1, svh, _hadamard_bf16(x2d.device), y, m, n, HADAMARD_SCALE, BM=64,
                                          num_warps=4)


def trellis_matmul(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, bits: int,
                   codebook: str = "mcg", config: GemmConfig | ReconConfig | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W for an EXL3-encoded weight, decoding Q inside Triton kernels; y has x's dtype.

    x: float16/bfloat16 (..., k) on CUDA (or CPU under TRITON_INTERPRET=1). Below ``RECON_MIN_M`` rows the
    fused kernel decodes Q inside the GEMM; from there on a Triton kernel writes an fp16 weight and cuBLAS
    multiplies (``choose_config``). ``config`` overrides the heuristic (used by the benchmark sweep). Not safe
    to run concurrently on two streams of one device with split-K (the reduction counters are shared per
    device). ``out``: optional contiguous (m, n) tensor of x's dtype to write into (tests poison it to prove
    every element is written).
    """
    k, n = check_inputs(x, trellis, suh, svh, bits, codebook)
    dev = x.device
    _check_triton_device(dev)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k).contiguous()
    m = x2d.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=dev)
    else:
        if out.shape != (m, n) or out.dtype != x.dtype or out.device != dev or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({m}, {n}) {x.dtype} tensor on {dev}")
        y = out
    if m == 0:
        return y.reshape(*lead, n)
    cfg = config or choose_config(m, k, n, dev, x.dtype)
    words = trellis.contiguous().view(torch.int32)
    suh_c = suh.contiguous()
    svh_c = svh.contiguous()
    ieee = dev.type == "cpu" and INTERPRETER_EXACT_HADAMARD
    if isinstance(cfg, ReconConfig):
        if cfg.fold not in _FOLDS:
            raise ValueError(f"bad config {cfg}")
        _recon_matmul(x2d, words, suh_c, svh_c, k, n, bits, codebook, cfg, y, ieee)
        return y.reshape(*lead, n)
    if 128 % cfg.bk or cfg.bm < 16 or (cfg.trans and cfg.fuse_in):
        raise ValueError(f"bad config {cfg}")
    fma = int(cfg.fma)
    if fma and (fma not in (1, 2, 4, 8, 16) or fma > cfg.bm or cfg.trans or cfg.fuse_in or cfg.prefetch):
        raise ValueError(f"config {cfg}: fma takes 1, 2, 4, 8 or 16 rows (<= bm) and the plain prepared-input loop")
    if cfg.x_f32 and not fma:
        raise ValueError(f"config {cfg}: x_f32 is for the fma form only")
    had = _hadamard_bf16(dev)
    n_blocks = n // 128
    m_blocks = -(-m // (fma or cfg.bm))
    split = max(1, min(cfg.split, k // 128))
    xin = x2d if cfg.fuse_in else _prep(x2d, suh_c, ieee, torch.float32 if cfg.x_f32 else torch.float16)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=dev)
        cnt = _counters(dev, m_blocks * n_blocks)
    else:
        ws = y  # unused
        cnt = _counters(dev, 1)
    l2pf = 0
    if cfg.l2_prefetch and not ieee:  # the interpreter runs no PTX
        l2pf = triton.next_power_of_2(-(-(k // 128) // split) * 16 * bits)  # lines: chunks x 8 tile rows x 2K
    grid = (n_blocks, m_blocks, split)
    _gemm_kernel[grid](xin, words, suh_c, svh_c, had, y, ws, cnt, m, k, n, HADAMARD_SCALE,
                       K_BITS=bits, CB=_CB_ID[codebook], BM=cfg.bm, BK=cfg.bk, FUSE_IN=cfg.fuse_in, SPLIT=split,
                       IEEE=ieee, ASM=0 if ieee else cfg.asm,
                       S1=1 if pair_block_bits(bits) == 2 else 2, PREFETCH=cfg.prefetch, TRANS=cfg.trans,
                       L2PF=l2pf, FMA=fma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*lead, n)
