"""The Viterbi kernel's geometry: what one tile in flight costs in scratch, and which cost rows the kernel keeps.

These rules belong to the kernel (``kernels/viterbi``) and the memory plan (``encode/memory``) sizes its chunks with
them: they live here so the kernels need nothing from the encoder (imports go down: format <- kernels <- encode).
"""

from __future__ import annotations

from exl3tool.knobs import Tuning, current_tuning

__all__ = ["DEFAULT_MAX_SCRATCH", "MAX_HALF_ROW_BITS", "cost_row_stride", "slot_cost_rows", "viterbi_slot_bytes"]

DEFAULT_MAX_SCRATCH = 2 << 30  # Viterbi scratch beyond this does not make the kernel faster (8,064 slots at K = 6)
_TILE_BYTES = 1024  # 256 fp32 values
MAX_HALF_ROW_BITS = 6  # every other row only up to K = 6 (a recomputed odd row costs 2^(2K) candidates)


def cost_row_stride(bits: int, tuning: Tuning | None = None) -> int:
    """The cost rows the Viterbi kernel keeps at K = ``bits`` in its packed modes: 0 (back-pointers instead), 1
    (every step's) or 2 (every other step's); the rule of COST_ROW_BITS and HALF_ROW_BITS."""
    tuning = tuning or current_tuning()
    if bits not in tuning.cost_row_bits:
        return 0
    return 2 if bits in tuning.half_row_bits and bits <= MAX_HALF_ROW_BITS else 1


def slot_cost_rows(rows: int) -> int:
    """fp16 cost rows of 2^(16-K) entries a Viterbi slot holds for the kernel's ROWS: 2 with back-pointers (the
    previous and the current step's), 256 with every step's row, 129 with every other (and the odd one in flight)."""
    return {0: 2, 1: 256, 2: 129}[int(rows)]


def viterbi_slot_bytes(bits: int, packed: bool = True, rows: bool | int | None = None,
                       tuning: Tuning | None = None) -> int:
    """GPU scratch of one tile in flight: back-pointers (256 positions x 2^(16-K) edges, a byte each, or two per
    byte at K <= 4 when ``packed``, the kernel's default modes) and two fp16 cost rows; or with ``rows`` no
    back-pointers and 256 cost rows of 2^(16-K) fp16 (``rows`` 1) or 129 (2: every other row and the one in
    flight); None: ``cost_row_stride`` when ``packed``. And, in an in-place launch over a weight
    (``viterbi_matrix``), the 1 KiB row of the tile's values."""
    e = 1 << (16 - bits)
    if rows is None:
        rows = cost_row_stride(bits, tuning) if packed else 0
    back_pointers = 0 if rows else 256 * (e // 2 if packed and bits <= 4 else e)
    return back_pointers + slot_cost_rows(rows) * 2 * e + _TILE_BYTES
