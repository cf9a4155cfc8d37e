"""Which launch ``trellis_matmul`` takes for a problem: the H200 tuning tables (``SMALL_M_TABLE``,
``RECON_COST_US``, ``RECON_MIN_M``) as data and the rules that read them (``choose_config``).

The figures come from the H200 sweeps in benchmarks/README.md ("Trellis GEMM"); ``benchmarks/gemm_sweep_small_m.py
--print-table`` prints ``SMALL_M_TABLE`` rows from a sweep's JSON. Tests that mirror a GPU patch ``_num_sms`` here.
"""

from __future__ import annotations

import functools

import torch

from exl3tool.kernels.gemm.config import (_FOLDS, FOLD_BOTH, FOLD_BOTH16, FOLD_IN, FOLD_NONE, FOLD_OUT, GemmConfig,
                                          ReconConfig)


__all__ = ["RECON_MIN_M", "RECON_COST_US", "SMALL_M_TABLE", "recon_cost", "balanced_split", "config_from_entry",
           "small_m_entry", "choose_config"]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


# m at and above which trellis_matmul takes the reconstruct path (measured on the H200: benchmarks/README.md,
# "Trellis GEMM")
RECON_MIN_M = 128

# The reconstruct path's costs on the H200, in microseconds per million elements (fitted to the sweep in
# benchmarks/results/, benchmarks/README.md): the reconstruct kernel per weight for each fold, then the passes over
# the activations that the fold leaves (prep: x's input side, per element of x; post: y's output side, per
# element of y; to_fp16: bf16 x cast for the folds that hand x to cuBLAS as it is).
RECON_COST_US = {"recon": {FOLD_NONE: 0.88, FOLD_OUT: 1.72, FOLD_IN: 1.64, FOLD_BOTH: 2.77, FOLD_BOTH16: 2.09},
                 "prep": 1.28, "post": 1.45, "to_fp16": 1.0}
_FOLD_PASSES = {FOLD_NONE: ("prep", "post"), FOLD_OUT: ("prep",), FOLD_IN: ("post", "to_fp16"),
                FOLD_BOTH: ("to_fp16",), FOLD_BOTH16: ("to_fp16",)}


def recon_cost(fold: int, m: int, k: int, n: int, dtype: torch.dtype = torch.float16) -> float:
    """Predicted extra time (us) of the reconstruct path over the bare fp16 matmul, from ``RECON_COST_US``."""
    size = {"prep": m * k, "post": m * n, "to_fp16": m * k if dtype != torch.float16 else 0}
    return 1e-6 * (RECON_COST_US["recon"][fold] * k * n
                   + sum(RECON_COST_US[p] * size[p] for p in _FOLD_PASSES[fold]))


def balanced_split(chunks: int, target: int, *, min_chunks: int = 1) -> int:
    """Split-K count near ``target`` whose splits all hold the same number of 128-row chunks, give or take one.

    The kernel gives each split ceil(chunks / split) chunks, so a split count that does not divide evenly leaves
    the last splits empty (32 chunks in 19 splits: 16 of 2 and 3 empty programs). ``min_chunks`` caps the count
    at ceil(chunks / min_chunks) (m = 1: 2, the H200 sweep's best at K = 4096; the gain is within run-to-run
    noise, benchmarks/README.md).
    """
    per = max(min(min_chunks, chunks), -(-chunks // max(1, min(chunks, target))))
    return -(-chunks // per)


# The fused kernel's launch below RECON_MIN_M rows, as data: rows (largest m, entry), the first row with
# m <= largest m applies. An entry holds GemmConfig fields (bm, bk, fma, x_f32, l2_prefetch, num_warps,
# num_stages, prefetch, trans; the rest fixed: prepared input, asm on CUDA) and the split-K rule: ``per_sm``
# programs per SM over the (n / 128) x m-blocks output blocks, ``min_chunks`` 128-row chunks per split at least,
# ``balanced`` (default True: ``balanced_split``; False: the plain ceil). Filled from the H200 sweeps
# (benchmarks/README.md, "Trellis GEMM"; ``benchmarks/gemm_sweep_small_m.py --print-table`` prints rows in this
# form from a sweep's JSON):
# - m == 1: the FMA form (no tensor cores, so no shared-memory staging and no barrier per step: 20-30 % faster
#   than tl.dot at one row), about sixteen programs per SM with at least two chunks per split, L2 prefetch.
# - m <= 16: BM=16 and about four programs per SM, so that enough loads are in flight; one pipeline stage
#   (Triton's shared-memory stages cost 2-3x here) and no register prefetch (its registers cost more occupancy
#   than it hides).
# - up to RECON_MIN_M: BM=64, BK=64, about four programs per SM (plain ceil) and the L2 prefetch.
SMALL_M_TABLE: tuple[tuple[int, dict], ...] = (
    (1, dict(bm=16, bk=32, fma=1, l2_prefetch=True, per_sm=16, min_chunks=2)),
    (16, dict(bm=16, bk=32, per_sm=4)),
    (RECON_MIN_M - 1, dict(bm=64, bk=64, l2_prefetch=True, per_sm=4, balanced=False)),
)

_ENTRY_CONFIG_KEYS = frozenset({"bm", "bk", "fma", "x_f32", "l2_prefetch", "num_warps", "num_stages", "prefetch",
                                "trans"})
_ENTRY_SPLIT_KEYS = frozenset({"per_sm", "min_chunks", "balanced"})


def config_from_entry(entry: dict, m: int, k: int, n: int, device: torch.device) -> GemmConfig:
    """The GemmConfig of one ``SMALL_M_TABLE`` entry for this problem (split-K from the entry's rule and the SM
    count), so that the table and the sweep that fills it build configs the same way."""
    unknown = set(entry) - _ENTRY_CONFIG_KEYS - _ENTRY_SPLIT_KEYS
    if unknown or "bm" not in entry or "bk" not in entry or "per_sm" not in entry:
        raise ValueError(f"table entry {entry}: needs bm, bk, per_sm; unknown keys {sorted(unknown)}")
    fields = {key: entry[key] for key in _ENTRY_CONFIG_KEYS & set(entry)}
    rows = int(fields.get("fma", 0)) or fields["bm"]
    programs = (n // 128) * -(-m // rows)
    target = -(-entry["per_sm"] * _num_sms(device) // programs)
    chunks = k // 128
    if entry.get("balanced", True):
        split = balanced_split(chunks, target, min_chunks=entry.get("min_chunks", 1))
    else:
        split = max(1, min(chunks, target))
    fields.setdefault("num_warps", 4)
    fields.setdefault("num_stages", 1)
    fields.setdefault("prefetch", False)
    return GemmConfig(split=split, fuse_in=False, asm=2 if device.type == "cuda" else 0, **fields)


def small_m_entry(m: int) -> dict:
    """The ``SMALL_M_TABLE`` entry for m rows (1 <= m < RECON_MIN_M)."""
    for largest, entry in SMALL_M_TABLE:
        if m <= largest:
            return entry
    raise ValueError(f"no SMALL_M_TABLE row for m = {m} (the table ends at {SMALL_M_TABLE[-1][0]})")


def choose_config(m: int, k: int, n: int, device: torch.device,
                  dtype: torch.dtype = torch.float16) -> GemmConfig | ReconConfig:
    """The launch for m rows: ``SMALL_M_TABLE`` below RECON_MIN_M (the fused kernel), from there on the
    reconstruct path with the fold of least predicted cost (``recon_cost``): the passes over the activations
    grow with m, the reconstruct kernel's cost with the folded Hadamards."""
    if m >= RECON_MIN_M:
        fold = min(_FOLDS, key=lambda f: recon_cost(f, m, k, n, dtype))
        return ReconConfig(fold=fold, br=32 if fold == FOLD_NONE else 64, num_warps=4,
                           asm=2 if device.type == "cuda" else 0)
    return config_from_entry(small_m_entry(m), m, k, n, device)
