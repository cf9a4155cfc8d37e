"""The EXL3 format core (docs/format.md): codebook, trellis packing, tile layout, Hadamard rotations, sign
vectors, decoding and the encoded layer. Everything above reads and writes weights through these; they import
nothing of exl3tool.
"""

from __future__ import annotations

from exl3tool.format.codebook import CODEBOOKS, CODEBOOK_MARKERS, codebook_table, decode_states
from exl3tool.format.decode import dequantize, dequantize_tensors, reconstruct
from exl3tool.format.encoded import EncodedLinear
from exl3tool.format.hadamard import hadamard_128, hadamard_left, hadamard_right
from exl3tool.format.layout import TENSOR_CORE_PERM, matrix_to_tiles, tile_position, tiles_to_matrix
from exl3tool.format.signs import reference_signs, torch_signs
from exl3tool.format.trellis import pack_trellis, unpack_trellis

__all__ = [
    "CODEBOOKS", "CODEBOOK_MARKERS", "EncodedLinear", "TENSOR_CORE_PERM", "codebook_table", "decode_states",
    "dequantize", "dequantize_tensors", "hadamard_128", "hadamard_left", "hadamard_right", "matrix_to_tiles",
    "pack_trellis", "reconstruct", "reference_signs", "tile_position", "tiles_to_matrix", "torch_signs",
    "unpack_trellis",
]
