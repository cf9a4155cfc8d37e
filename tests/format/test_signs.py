"""The reference's CUDA sign draws, reproduced on the CPU (exl3tool.format.signs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from goldens import golden_case

from exl3tool.format.signs import (
    _COS_FLIPS, _SIN_FLIPS, _box_muller_parts, _draw_words, _normal_signs, normal_launch, philox4x32_10,
    reference_normals, reference_signs, sign_prime, torch_signs,
)
from seeds import fresh_seed

# (file, tag): the golden encodes; their seeds and shapes are read from the files' metadata.
GOLDEN_CASES = [("encode_e2e", "case0"), ("encode_e2e", "case1"), ("encode_e2e", "case2"), ("gemm_k6", "enc")]


def _golden_case(golden, fname: str, tag: str) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    gold = golden_case(golden, fname, tag)
    return gold["seed"], gold["weight"], gold["su_sign"], gold["sv_sign"]


@pytest.mark.parametrize(
    "ctr, key, expected",
    [  # Random123's published known-answer vectors for Philox4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox_known_answers(ctr, key, expected):
    out = philox4x32_10(tuple(np.array([c], dtype=np.uint32) for c in ctr), key)
    assert tuple(int(w[0]) for w in out) == expected


@pytest.mark.parametrize("fname, tag", GOLDEN_CASES)
def test_reference_signs_match_goldens(golden, fname, tag):
    seed, weight, su_gold, sv_gold = _golden_case(golden, fname, tag)
    k, n = weight.shape
    su, sv = reference_signs(seed, k, n)
    assert su.dtype == torch.float32 and su.shape == (k,) and sv.shape == (n,)
    assert torch.equal(su, su_gold), f"{tag}: {(su != su_gold).sum()} of {k} su signs differ"
    assert torch.equal(sv, sv_gold), f"{tag}: {(sv != sv_gold).sum()} of {n} sv signs differ"


def test_signs_depend_on_seed_and_order(golden):
    seed, weight, su_gold, sv_gold = _golden_case(golden, "encode_e2e", "case0")
    k, n = weight.shape
    su, _ = reference_signs(seed + 1, k, n)
    assert (su != su_gold).float().mean() > 0.3  # a different seed gives unrelated signs
    # sv is the *second* draw: it starts at Philox offset 4, not 0
    assert not torch.equal(torch.from_numpy(_normal_signs(seed, [(n, 0)], 132)), sv_gold)


def test_launch_configuration():
    assert normal_launch(256) == (1, 4)
    assert normal_launch(257) == (2, 4)
    assert normal_launch(1056 * 256) == (1056, 4)  # the largest uncapped grid on an H100/H200
    assert normal_launch(1056 * 256 + 1) == (1056, 4)
    assert normal_launch(1056 * 256 * 4 + 1) == (1056, 8)  # two loop iterations per thread
    assert normal_launch(1000, sm_count=1) == (4, 4)
    assert normal_launch(5000, sm_count=1) == (8, 4)
    assert normal_launch(2048 * 4 + 1, sm_count=1) == (8, 8)


def test_sm_count_only_matters_above_the_grid_cap():
    seed = fresh_seed()
    small = 108 * 8 * 256  # fits an A100's (108 SMs) uncapped grid
    a = reference_signs(seed, small, 4096, sm_count=132)
    b = reference_signs(seed, small, 4096, sm_count=108)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    big = small + 4096
    c = reference_signs(seed, big, 256, sm_count=132)
    d = reference_signs(seed, big, 256, sm_count=108)
    assert not torch.equal(c[0], d[0])


def test_signs_are_sign_of_the_normals():
    """The sign shortcut agrees with the full Box-Muller values, and those look standard normal."""
    seed = fresh_seed()
    numel = 300_000  # above the H100 grid cap: exercises the grid-stride loop
    values = reference_normals(seed, numel, offset=8)
    signs = _normal_signs(seed, [(numel, 8)], 132)
    decisive = np.abs(values) > 1e-5  # away from the six sin/cos angles with a hardware-specific sign
    assert np.array_equal(np.where(values[decisive] < 0, -1.0, 1.0), signs[decisive])
    assert abs(values.mean()) < 0.01 and abs(values.std() - 1) < 0.01


def test_flip_angles_change_exactly_those_elements():
    """The sm_90 sin/cos exceptions flip the exact-math sign of the elements whose angle is one of them."""
    seed, numel, offset = 1389828893, 1_000_000, 0  # contains an angle f32(pi) draw (found by search)
    radius, angle, use_cos = _draw_words(seed, [(numel, offset)], 132)
    u, v = _box_muller_parts(radius, angle)
    v64 = v.astype(np.float64)
    exact = np.where((np.where(use_cos == 1, np.cos(v64), np.sin(v64)) < 0) & (u < 1), -1.0, 1.0)
    signs = _normal_signs(seed, [(numel, offset)], 132)
    bits = v.view(np.int32)
    listed = np.where(use_cos == 1, np.isin(bits, _COS_FLIPS), np.isin(bits, _SIN_FLIPS))
    assert listed.sum() >= 1
    assert np.array_equal(signs != exact, listed)


def test_sign_prime_maps_zero_to_plus_one():
    g = torch.tensor([-2.0, -0.0, 0.0, 1e-30, -1e-30, 3.0])
    assert sign_prime(g).tolist() == [-1.0, 1.0, 1.0, 1.0, -1.0, 1.0]


def test_torch_signs_cpu_is_the_literal_draw():
    seed = fresh_seed()
    su, sv = torch_signs(seed, 384, 256, "cpu")
    torch.manual_seed(seed)
    assert torch.equal(su, sign_prime(torch.randn(384))) and torch.equal(sv, sign_prime(torch.randn(256)))


@pytest.mark.parametrize("bad", [(-1, 256, 256), (1, 0, 256), (1, 256, -3), (2**64, 1, 1)])
def test_reference_signs_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        reference_signs(*bad)


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(256, 512), (4096, 14336), (14336, 4096), (1_000_000, 3_000_001)])
def test_torch_signs_on_cuda_equal_reference_signs(k, n):
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for seed in [0, 1389828893, 17790420, fresh_seed()]:
        su, sv = torch_signs(seed, k, n, "cuda")
        rsu, rsv = reference_signs(seed, k, n, sm_count=sm)
        assert torch.equal(su.cpu(), rsu) and torch.equal(sv.cpu(), rsv), (seed, k, n)
