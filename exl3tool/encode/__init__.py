"""The online (uncalibrated) encoder, and the format core's names (``exl3tool.format``) re-exported.

The public names below are a contract: tests, the cache and outside checks import them from here.
"""

from __future__ import annotations

from exl3tool.format import (
    CODEBOOKS, CODEBOOK_MARKERS, TENSOR_CORE_PERM, EncodedLinear, codebook_table, decode_states, dequantize,
    dequantize_tensors, hadamard_128, hadamard_left, hadamard_right, matrix_to_tiles, pack_trellis, reconstruct,
    reference_signs, tile_position, tiles_to_matrix, torch_signs, unpack_trellis,
)

__all__ = [
    "CODEBOOKS", "CODEBOOK_MARKERS", "EncodedLinear", "TENSOR_CORE_PERM",
    "codebook_table", "decode_states", "dequantize", "dequantize_tensors", "encode_linear",
    "hadamard_128", "hadamard_left", "hadamard_right", "matrix_to_tiles", "pack_trellis",
    "quantize_regularized", "quantize_tiles", "reconstruct", "reference_signs", "regularize", "search_global_scale",
    "tile_position", "tiles_to_matrix", "torch_signs", "unpack_trellis",
]

_ONLINE = ("encode_linear", "quantize_regularized", "regularize", "search_global_scale")


def __getattr__(name: str):
    # The Viterbi and the online encoder pull in numba/Triton; import them only when used.
    if name == "quantize_tiles":
        from exl3tool.encode.viterbi import quantize_tiles

        return quantize_tiles
    if name in _ONLINE:
        from exl3tool.encode import online

        return getattr(online, name)
    raise AttributeError(f"module 'exl3tool.encode' has no attribute {name!r}")
