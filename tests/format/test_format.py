"""Conformance of the EXL3 format core with the reference goldens and the spec's worked examples."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from exl3tool.encode import (
    TENSOR_CORE_PERM, decode_states, dequantize_tensors, hadamard_128, hadamard_left, hadamard_right,
    matrix_to_tiles, pack_trellis, reconstruct, tile_position, tiles_to_matrix, unpack_trellis,
)
from exl3tool.format.codebook import codebook_table, edge_major_table

from goldens import golden_file
from seeds import fresh_seed


@pytest.fixture(scope="module")
def recon(golden):
    return load_file(golden / "reconstruct_k6.safetensors")


def _bits16(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.view(torch.int16).tolist()]


@pytest.mark.parametrize(
    "codebook, expected",
    [
        ("3inst", [0x3A25, 0xBB5B, 0xC066, 0xB7F8, 0xB110]),
        ("mcg", [0x3F60, 0x304E, 0x3E0F, 0xB915, 0x3ACD]),
        ("mul1", [0xC2E8, 0x3921, 0xB89E, 0xBAF2, 0xB936]),
    ],
)
def test_codebook_worked_examples(codebook, expected):
    states = torch.tensor([0x0000, 0x0001, 0x1234, 0x8000, 0xFFFF])
    assert _bits16(decode_states(states, codebook)) == expected


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_codebook_tables_match_golden(recon, codebook):
    ours = codebook_table(codebook).to(torch.float32)
    assert torch.equal(ours, recon[f"codebook_{codebook}"]), f"{codebook}: {(ours != recon[f'codebook_{codebook}']).sum()} states differ"


@pytest.mark.parametrize("codebook", ["mcg", "mul1", "3inst"])
def test_edge_major_table_orders_each_edges_candidates_side_by_side(codebook):
    """Entry e * 2^K + k of the edge-major table is state (k << (16 - K)) | e of the codebook (edge e's k-th
    candidate), for every K and random (e, k); bad K is refused."""
    table = codebook_table(codebook)
    g = torch.Generator().manual_seed(fresh_seed())
    for bits in range(1, 9):
        em = edge_major_table(codebook, bits)
        assert em.shape == table.shape and em.dtype == table.dtype
        e = torch.randint(0, 1 << (16 - bits), (64,), generator=g)
        k = torch.randint(0, 1 << bits, (64,), generator=g)
        assert torch.equal(em[e * (1 << bits) + k], table[(k << (16 - bits)) | e]), bits
        assert torch.equal(em.sort().values, table.sort().values)  # a permutation of the codebook
    for bad in (0, 9, True):
        with pytest.raises(ValueError, match="bits"):
            edge_major_table(codebook, bad)


def test_decode_accepts_int16_raw_bits_and_wider_ints():
    s = torch.randint(0, 65536, (1000,), dtype=torch.int64)
    as_int16 = torch.where(s >= 32768, s - 65536, s).to(torch.int16)
    assert torch.equal(decode_states(s).view(torch.int16), decode_states(as_int16).view(torch.int16))
    assert torch.equal(decode_states(s.to(torch.int32)).view(torch.int16), decode_states(s).view(torch.int16))
    with pytest.raises(ValueError, match="integer"):
        decode_states(torch.rand(3))
    with pytest.raises(ValueError, match="unknown codebook"):
        decode_states(s, "nope")


@pytest.mark.parametrize("name, bits", [("p0_k6", 6), ("p1_k6", 6), ("p2_k4", 4)])
def test_unpack_pack_and_reconstruct_match_golden(recon, name, bits):
    packed = recon[f"{name}.packed"]
    states = unpack_trellis(packed, bits)
    assert torch.equal(states, recon[f"{name}.unpacked"])
    assert torch.equal(pack_trellis(states, bits), packed)
    for cb in ("3inst", "mcg", "mul1"):
        q = reconstruct(packed, bits, cb)
        want = recon[f"{name}.recon_{cb}"]
        mismatches = int((q.view(torch.int16) != want.view(torch.int16)).sum())
        assert mismatches == 0, f"{name} {cb}: {mismatches} of {q.numel()} values differ"


def test_pack_worked_example_k6():
    v = [0x3F, 0x00, 0x2A, 0x15, 0x01, 0x20, 0x3E, 0x07] + [(7 * i + 3) % 64 for i in range(8, 256)]
    record = pack_trellis(torch.tensor(v), 6)
    assert _bits16(record[:6]) == [0x9506, 0xFC0A, 0xEC22, 0x0F87, 0xE96C, 0x505D]
    assert _bits16(record[94:]) == [0xED7C, 0x609E]
    states = unpack_trellis(record, 6)
    assert _bits16(states[[0, 1, 2, 3, 4, 5, 6, 7, 255]]) == [0x5F3F, 0xCFC0, 0xF02A, 0x0A95, 0xA541, 0x5060, 0x183E, 0x0F87, 0xED7C]


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip_every_k(bits):
    """Ring-consistent random states survive pack -> unpack for every K, with leading dims kept."""
    v = torch.randint(0, 1 << bits, (3, 5, 256))
    state = torch.zeros_like(v)
    for back in range((16 + bits - 1) // bits):
        state |= torch.roll(v, shifts=back, dims=-1) << (back * bits)
    state &= 0xFFFF
    packed = pack_trellis(state, bits)
    assert packed.shape == (3, 5, 16 * bits) and packed.dtype == torch.int16
    assert torch.equal(unpack_trellis(packed, bits).to(torch.int64) & 0xFFFF, state)
    raw = torch.randint(-32768, 32768, (4, 16 * bits), dtype=torch.int32).to(torch.int16)
    assert torch.equal(pack_trellis(unpack_trellis(raw, bits), bits), raw)


@pytest.mark.parametrize("bits", [4, 6])
def test_pack_across_slices_equals_tile_by_tile(bits):
    """More tiles than one packing slice (PACK_SLICE_TILES): every tile packs as it does alone, across the seams."""
    from exl3tool.encode import memory
    from exl3tool.format import trellis

    assert memory.PACK_SLICE_TILES == trellis.PACK_SLICE_TILES
    count = 2 * trellis.PACK_SLICE_TILES + 3
    states = torch.randint(-32768, 32768, (count, 256), dtype=torch.int32).to(torch.int16)
    packed = pack_trellis(states, bits)
    for i in sorted({0, trellis.PACK_SLICE_TILES - 1, trellis.PACK_SLICE_TILES, count - 1,
                     int(torch.randint(0, count, ()))}):
        assert torch.equal(packed[i], pack_trellis(states[i], bits)), i
    assert torch.equal(unpack_trellis(packed, bits).to(torch.int64) & ((1 << bits) - 1),
                       states.to(torch.int64) & ((1 << bits) - 1))


@pytest.mark.parametrize("bits", [0, 9, 6.0, "6"])
def test_bad_bits_rejected(bits):
    with pytest.raises(ValueError, match="bits"):
        pack_trellis(torch.zeros(256, dtype=torch.int16), bits)


def test_tile_layout_matches_golden_perm_and_table(golden):
    perm = load_file(golden / "tiles_golden.safetensors")["tensor_core_perm"].to(torch.int64)
    assert torch.equal(perm, TENSOR_CORE_PERM)
    # spec table 5.3, first row and first column
    assert [tile_position(0, c) for c in range(16)] == [0, 32, 64, 96, 128, 160, 192, 224, 4, 36, 68, 100, 132, 164, 196, 228]
    assert [tile_position(r, 0) for r in range(16)] == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27]


def test_matrix_tiles_roundtrip_and_orientation():
    m = torch.randn(64, 48)
    tiles = matrix_to_tiles(m)
    assert tiles.shape == (4, 3, 256)
    assert torch.equal(tiles_to_matrix(tiles), m)
    i, j, r, c = 2, 1, 9, 12
    assert tiles[i, j, tile_position(r, c)] == m[16 * i + r, 16 * j + c]


def test_hadamard_matches_golden(recon):
    h = hadamard_128()
    assert torch.equal(h, recon["had128"])
    assert torch.equal(h @ h, 128 * torch.eye(128))
    y = hadamard_right(recon["had.x"])
    assert (y - recon["had.y"]).abs().max() < 2e-6


def test_hadamard_left_right_are_involutions_on_fresh_data():
    m = torch.randn(256, 384, dtype=torch.float64)
    assert torch.allclose(hadamard_left(hadamard_left(m)), m, atol=1e-12)
    assert torch.allclose(hadamard_right(hadamard_right(m)), m, atol=1e-12)
    h = hadamard_128(torch.float64) / 128**0.5
    assert torch.allclose(hadamard_left(m)[128:256], h @ m[128:256], atol=1e-12)
    with pytest.raises(ValueError, match="multiple of 128"):
        hadamard_right(torch.randn(4, 100))


def test_reconstruct_and_dequantize_match_gemm_golden(golden):
    g = load_file(golden_file(golden, "gemm_k6", "enc.trellis", "inner_weight", "weight_dequant"))
    q = reconstruct(g["enc.trellis"], 6, "mcg")
    assert torch.equal(q.view(torch.int16), g["inner_weight"].view(torch.int16))
    w = dequantize_tensors(g["enc.trellis"], g["enc.suh"], g["enc.svh"], 6, "mcg")
    ref = g["weight_dequant"].to(torch.float32)  # the reference rounds each stage to fp16
    assert ((w - ref).norm() / ref.norm()) < 1e-3
    if "enc.weight" in g:  # the full set only (the subset's column crop leaves the source weight out)
        err = ((w - g["enc.weight"]).norm() / g["enc.weight"].norm()).item()
        assert abs(err - 0.01773) < 2e-4  # ||weight_dequant - weight|| / ||weight|| = 0.01773 (docs/format.md)
