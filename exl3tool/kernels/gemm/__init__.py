"""EXL3 trellis GEMM: y = x @ W with W = diag(suh) B_k Q B_n diag(svh) (docs/format.md §1.4), in Triton.

Two paths, chosen by ``choose_config`` (``trellis_matmul`` is the entry point):

- Fused (m < RECON_MIN_M): Q is never written to memory. Each program loads the packed u32 words of the tiles
  it needs as one aligned word pair per block of 2-4 consecutive trellis positions (docs/format.md §4.5), cuts each 16-bit
  state out of its pair with one 64-bit shift, decodes it with the codebook (docs/format.md §3) and feeds the block to
  tl.dot with fp32 accumulation (for a few rows: fp32 FMAs instead, ``GemmConfig.fma``). The input side (x * suh,
  128-point Hadamard) is done by a small prep kernel (the GEMM would otherwise redo it for every column block)
  or, on request, fused into the GEMM. The output side (Hadamard, * svh, cast) is always fused into the
  epilogue; split-K partials are reduced by the last program of each output block (serial reduction through a
  counter, in a fixed order), so no extra launch is needed for the reduction either.
- Reconstruct (m >= RECON_MIN_M): ``_recon_kernel`` writes an fp16 weight (Q with none, one or both Hadamard
  sides folded in, ``ReconConfig.fold``), torch.mm (cuBLAS) multiplies, and the prep / post kernels do the
  sides that are not folded.

Hadamards run on tensor cores against the exact +-1 matrix: fp16 operands where they are exact (fp16 x, Q,
fp16 y1), otherwise the fp32 operand split into two bf16 parts (16 mantissa bits, full fp32 range).

The package: ``reference`` (plain torch, the oracle), ``config`` (launch configurations), ``tuning`` (the H200
tables and ``choose_config``), ``triton_kernels`` (the ``@triton.jit`` code) and ``launch`` (``trellis_matmul``,
``fold_weight``). Its names are importable from here as before; a test that patches a module global
(``launch.INTERPRETER_EXACT_HADAMARD``, ``tuning._num_sms``) patches the module that reads it.
"""

from __future__ import annotations

from exl3tool.kernels.gemm.config import _FOLDS  # noqa: F401 - the tests' list of folds
from exl3tool.kernels.gemm.config import (FOLD_BOTH, FOLD_BOTH16, FOLD_IN, FOLD_NONE, FOLD_OUT, GemmConfig, ReconConfig,
                                          pair_block_bits)
from exl3tool.kernels.gemm.launch import fold_weight, trellis_matmul
from exl3tool.kernels.gemm.reference import fold_weight_reference, trellis_matmul_reference
from exl3tool.kernels.gemm.triton_kernels import HAVE_TRITON, triton  # noqa: F401 - the sweep reports its version
from exl3tool.kernels.gemm.tuning import (RECON_COST_US, RECON_MIN_M, SMALL_M_TABLE, balanced_split, choose_config,
                                          config_from_entry, recon_cost, small_m_entry)

if HAVE_TRITON:  # for tests and tools that compile a kernel offline
    from exl3tool.kernels.gemm.triton_kernels import _gemm_kernel, _recon_kernel  # noqa: F401

__all__ = ["trellis_matmul", "trellis_matmul_reference", "fold_weight", "fold_weight_reference", "GemmConfig",
           "ReconConfig", "choose_config", "config_from_entry", "small_m_entry", "SMALL_M_TABLE", "recon_cost",
           "pair_block_bits", "RECON_MIN_M", "FOLD_NONE", "FOLD_OUT", "FOLD_IN", "FOLD_BOTH", "FOLD_BOTH16",
           "HAVE_TRITON", "RECON_COST_US", "balanced_split"]
