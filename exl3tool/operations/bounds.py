"""``verify``'s pass bounds (no torch: the CLI shows them in ``verify --help``); ``operations.verify`` applies them.

Default thresholds: the kernel error at fp16-accumulation level (2e-3), and the quantization error at 1.5x the
relative RMS error the reference encoder reaches on the golden tiles for that bit width (K=6: 0.0177, so 0.0266).
"""

from __future__ import annotations

__all__ = ["QUANT_ERR_GOLDEN", "DEFAULT_KERNEL_ERR", "QUANT_MARGIN", "default_quant_err"]

# sqrt(MSE) of the reference tile quantizer on unit-variance Gaussian tiles (golden README, mcg), i.e.
# the relative RMS error of one tile; whole-layer encodes land on the same figure (K=6: 0.0177-0.0179).
QUANT_ERR_GOLDEN = {2: 0.2715, 3: 0.1352, 4: 0.0684, 5: 0.0348, 6: 0.0177, 7: 0.00943, 8: 0.00546}
DEFAULT_KERNEL_ERR = 2e-3
QUANT_MARGIN = 1.5


def default_quant_err(bits: int) -> float:
    """1.5x the reference's relative error at ``bits`` (extrapolated by 2x per bit outside 2..8)."""
    if bits in QUANT_ERR_GOLDEN:
        return QUANT_MARGIN * QUANT_ERR_GOLDEN[bits]
    return QUANT_MARGIN * QUANT_ERR_GOLDEN[2] * 2.0 ** (2 - bits)
