"""The reference encoder's random sign vectors, reproduced on any device (docs/format.md §7.2).

exllamav3 draws ``su = sign'(randn(k))`` then ``sv = sign'(randn(n))`` on CUDA right after
``torch.manual_seed(seed)``, with sign'(g) = +1 for g >= 0 (including -0) and -1 for g < 0. The spec
calls these draws CPU-irreproducible; they are not. PyTorch's CUDA ``normal_`` for float32 is a
grid-stride kernel over cuRAND's Philox4x32-10, and every piece of it is deterministic:

* launch: 256-thread blocks, ``grid = min(ceil(numel / 256), sm_count * (2048 // 256))``
  (2048 threads per SM on sm_80/sm_90; an H100/H200 has 132 SMs, hence 1056 blocks);
* each call advances the generator's Philox offset (0 after ``manual_seed``) by
  ``((numel - 1) // (256 * grid * 4) + 1) * 4``;
* thread ``idx`` starts at Philox counter ``(offset / 4, idx)`` (two 64-bit halves), key
  ``(seed & 0xffffffff, seed >> 32)``, and on its ``j``-th loop iteration turns the four outputs
  ``x0..x3`` of Philox4x32-10 at counter ``(offset / 4 + j, idx)`` into four normals by Box-Muller:
  ``(s0 sin v1, s0 cos v1, s2 sin v3, s2 cos v3)`` with ``s = sqrt(-2 log u)``,
  ``u = x * 2^-32 + 2^-33`` and ``v = x * 2^-32 * 2pi + 2^-33 * 2pi`` in float32;
* component ``ii`` of that float4 is element ``idx + stride * (4 j + ii)``, ``stride = 256 * grid``.

Only the sign is needed, so no transcendental has to match the GPU's to the ulp. The value is +0
(sign +1) when ``u`` rounds to exactly 1.0f (``x >= 2^32 - 128``): ``__logf(1) = 0``. Otherwise its sign
is that of ``__sinf(v)`` / ``__cosf(v)`` (cuRAND uses the ``__sincosf`` intrinsic, i.e. the
``sin.approx`` / ``cos.approx`` instructions). Those agree in sign with the exact sin/cos of the float32
``v`` everywhere except at six float32 angles next to pi/2, pi, 3pi/2 and 2pi, where the H200 returns
+-0 or a wrong-signed tiny value (``_SIN_FLIPS``, ``_COS_FLIPS``). This was measured on an H200
(sm_90) by evaluating both instructions on every float32 angle within 4e-5 of a quadrant boundary and
on every angle the draw can produce near 0, and checked against 163 million ``torch.randn`` values
on the same GPU with zero sign mismatches (plus every (k, n) pair in ``tests/format/test_signs.py``).
``lg2.approx`` never returns a value >= 0 below 1, so no draw is NaN.

Dependence on the GPU model: the grid is capped at ``sm_count * threads_per_sm / 256`` blocks
(1056 on an H100/H200). A length with ``ceil(numel / 256)`` at or below the cap, i.e.
``numel <= 256 * cap`` (270,336 on an H100/H200, 221,184 on an A100), gets grid ``ceil(numel / 256)``,
one loop iteration per thread and a Philox offset increment of 4, whatever the GPU: such draws do not
depend on ``sm_count``. Above the cap, the stride and the thread that owns an element change with it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "H100_SM_COUNT", "normal_launch", "philox4x32_10", "reference_normals", "reference_signs",
    "sign_prime", "torch_signs",
]

H100_SM_COUNT = 132  # H100 SXM / H200: the GPUs the goldens and the serving stack run on
_BLOCK = 256
_UNROLL = 4  # curand_normal4: four normals per Philox call
_THREADS_PER_SM = 2048  # maxThreadsPerMultiProcessor on sm_80 / sm_90 (1536 on sm_86 / sm_89)

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)

# cuRAND's constants: CURAND_2POW32_INV = 2^-32 exactly, CURAND_2POW32_INV_2PI = 2^-32 * f32(2 pi).
_INV32 = np.float32(2.0**-32)
_INV32_2PI = np.float32(2.0**-32) * np.float32(2 * math.pi)

# float32 angles (bit patterns) where the sign of sm_90's sin.approx / cos.approx differs from the exact
# sin / cos of the float32 value: +-0 at f32(pi), its successor, f32(pi/2) and its successor (sign +1 where
# the exact value is negative), and -1.87e-7 at f32(2pi) and f32(3pi/2) (sign -1 where it is positive).
_SIN_FLIPS = np.array([0x40490FDB, 0x40490FDC, 0x40C90FDB], dtype=np.int32)
_COS_FLIPS = np.array([0x3FC90FDB, 0x3FC90FDC, 0x4096CBE4], dtype=np.int32)


def philox4x32_10(
    ctr: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], key: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 (Salmon et al. 2011, as in cuRAND) on uint32 counter words, vectorised.

    >>> [hex(int(w[0])) for w in philox4x32_10(tuple(np.zeros(1, np.uint32) for _ in range(4)), (0, 0))]
    ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    # the two multiplied words side by side, x = (c0, c2), and the two others, y = (c1, c3): one array operation per
    # step of the round for both halves (a few thousand elements are mostly per-operation overhead)
    x = np.stack([np.asarray(ctr[0], dtype=np.uint32), np.asarray(ctr[2], dtype=np.uint32)])
    y = np.stack([np.asarray(ctr[1], dtype=np.uint32), np.asarray(ctr[3], dtype=np.uint32)])
    mult = np.array([[_M0], [_M1]], dtype=np.uint64)
    keys = np.array([[key[0] & 0xFFFFFFFF], [key[1] & 0xFFFFFFFF]], dtype=np.uint32)
    bumps = np.array([[_W0], [_W1]], dtype=np.uint32)
    with np.errstate(over="ignore"):
        for r in range(10):
            p = x.astype(np.uint64) * mult  # (c0 M0, c2 M1), exact in 64 bits
            hi, lo = (p >> np.uint64(32)).astype(np.uint32), p.astype(np.uint32)  # astype keeps the low 32 bits
            # c0 = hi1 ^ c1 ^ k0, c2 = hi0 ^ c3 ^ k1; c1 = lo1, c3 = lo0
            x, y = hi[::-1] ^ y ^ keys, lo[::-1]
            if r < 9:
                keys = keys + bumps
    return x[0], y[0], x[1], y[1]


def normal_launch(
    numel: int, sm_count: int = H100_SM_COUNT, threads_per_sm: int = _THREADS_PER_SM
) -> tuple[int, int]:
    """(grid blocks, Philox offset increment) of PyTorch's CUDA float32 ``normal_`` for ``numel`` values."""
    if numel <= 0:
        raise ValueError(f"numel must be positive, got {numel}")
    grid = min((numel + _BLOCK - 1) // _BLOCK, sm_count * (threads_per_sm // _BLOCK))
    increment = ((numel - 1) // (_BLOCK * grid * _UNROLL) + 1) * 4  # already a multiple of 4
    return grid, increment


def _counters(numel: int, offset: int, sm_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every element of a ``normal_`` draw at Philox ``offset``: the 64-bit counter's low half, the global
    thread id (its high half) and the component of the float4 it takes."""
    grid, _ = normal_launch(numel, sm_count)
    stride = _BLOCK * grid
    e = np.arange(numel, dtype=np.int64)
    j, rem = np.divmod(e, stride * _UNROLL)  # loop iteration of the owning thread
    ii, idx = np.divmod(rem, stride)  # component of the float4, global thread id
    return (offset // 4) + j, idx, ii  # counter low half: skipahead(offset) then one step per iteration


def _draw_words(seed: int, draws: list[tuple[int, int]],
                sm_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every element of the ``draws`` ((numel, Philox offset) each, concatenated): the Philox word feeding its
    radius, the one feeding its angle, and sin/cos (0/1). One Philox evaluation for all draws (its ~120 array
    operations are most of the time of a few thousand elements)."""
    ctr_lo, idx, ii = (np.concatenate(parts) for parts in zip(*(_counters(m, o, sm_count) for m, o in draws)))
    words = philox4x32_10(
        ((ctr_lo & 0xFFFFFFFF).astype(np.uint32), (ctr_lo >> 32).astype(np.uint32),
         (idx & 0xFFFFFFFF).astype(np.uint32), (idx >> 32).astype(np.uint32)),
        (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF),
    )
    out = np.stack(words)  # (4, total)
    e = np.arange(ctr_lo.shape[0])
    pair = ii // 2  # (x0, x1) for components 0, 1; (x2, x3) for 2, 3
    radius_word = out[2 * pair, e]
    angle_word = out[2 * pair + 1, e]
    return radius_word, angle_word, (ii % 2)  # 0 -> sin, 1 -> cos


def _f32_fma(a: np.ndarray, b: np.float32, c: np.float32) -> np.ndarray:
    """f32(a*b + c) with one rounding: the product of two float32 is exact in float64."""
    return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)


def _box_muller_parts(radius_word: np.ndarray, angle_word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 u and v exactly as cuRAND's _curand_box_muller forms them (uint -> float, fused a*b + c)."""
    u = _f32_fma(radius_word.astype(np.float32), _INV32, _INV32 / np.float32(2))
    v = _f32_fma(angle_word.astype(np.float32), _INV32_2PI, _INV32_2PI / np.float32(2))
    return u, v


def reference_normals(
    seed: int, numel: int, *, offset: int = 0, sm_count: int = H100_SM_COUNT
) -> np.ndarray:
    """float64 approximations of CUDA ``randn(numel)`` at Philox ``offset`` (for checks and diagnostics).

    u and v are the GPU's float32 values; the log/sqrt/sin/cos are float64, so values agree with the GPU's
    to ~3e-6 absolute (the fast intrinsics' error); use ``reference_signs`` for the exact signs.
    """
    radius_word, angle_word, use_cos = _draw_words(seed, [(numel, offset)], sm_count)
    u, v = _box_muller_parts(radius_word, angle_word)
    s = np.sqrt(-2.0 * np.log(u.astype(np.float64)))
    v64 = v.astype(np.float64)
    return s * np.where(use_cos == 1, np.cos(v64), np.sin(v64))


def _normal_signs(seed: int, draws: list[tuple[int, int]], sm_count: int) -> np.ndarray:
    """sign'(randn(numel)) at Philox ``offset`` for each (numel, offset) of ``draws``, concatenated, as float32
    +-1 (see the module docstring)."""
    radius_word, angle_word, use_cos = _draw_words(seed, draws, sm_count)
    u, v = _box_muller_parts(radius_word, angle_word)
    v64 = v.astype(np.float64)
    trig = np.where(use_cos == 1, np.cos(v64), np.sin(v64))
    bits = v.view(np.int32)
    flip = np.where(use_cos == 1, np.isin(bits, _COS_FLIPS), np.isin(bits, _SIN_FLIPS))
    negative = ((trig < 0) != flip) & (u < np.float32(1.0))  # u == 1.0f -> radius 0 -> value +-0 -> +1
    return np.where(negative, np.float32(-1.0), np.float32(1.0)).astype(np.float32)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2^64), got {seed!r}")
    return int(seed)


def _check_length(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def reference_signs(seed: int, k: int, n: int, *, sm_count: int = H100_SM_COUNT) -> tuple[torch.Tensor, torch.Tensor]:
    """(su_sign (k,), sv_sign (n,)) float32 +-1: what the reference draws on CUDA after manual_seed(seed).

    Computed on the CPU from Philox4x32-10, so any device gets the server's signs. ``sm_count`` is the
    GPU's multiprocessor count; it only matters for a length over ``sm_count * 8 * 256`` (270,336 on
    H100/H200), where the launch grid is capped.

    >>> su, sv = reference_signs(1597376838, 256, 512)
    >>> su.shape, sv.shape, set(su.tolist()) <= {-1.0, 1.0}
    (torch.Size([256]), torch.Size([512]), True)
    """
    seed, k, n = _check_seed(seed), _check_length("k", k), _check_length("n", n)
    sm_count = _check_length("sm_count", sm_count)
    _, inc_k = normal_launch(k, sm_count)
    # su at offset 0 right after manual_seed, sv where that call left off; drawn together
    signs = torch.from_numpy(_normal_signs(seed, [(k, 0), (n, inc_k)], sm_count))
    return signs[:k].clone(), signs[k:].clone()


def sign_prime(g: torch.Tensor) -> torch.Tensor:
    """The reference's sign(sign(g) + 1e-5): +1 for g >= 0 (and -0), -1 for g < 0."""
    return torch.sign(torch.sign(g) + 1e-5)


def torch_signs(
    seed: int, k: int, n: int, device: torch.device | str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The literal reference draw on ``device``: manual_seed(seed), sign'(randn(k)), sign'(randn(n)).

    On CUDA this equals ``reference_signs`` (with the GPU's SM count); on the CPU it uses PyTorch's CPU
    generator and gives different signs. Note: reseeds the global RNGs, as the reference does.
    """
    seed, k, n = _check_seed(seed), _check_length("k", k), _check_length("n", n)
    torch.manual_seed(seed)
    su = sign_prime(torch.randn(k, device=device))
    sv = sign_prime(torch.randn(n, device=device))
    return su, sv
