"""The one-launch sequential sum (exl3tool.kernels.reduce) against the torch loop it replaces on CUDA.

The kernel runs under the Triton interpreter in a subprocess (TRITON_INTERPRET=1 must be set before triton is
imported); the GPU test runs the encoder's own reductions on CUDA tensors both ways.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from seeds import fresh_seed

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import torch
    from exl3tool.kernels.reduce import sequential_sum_dim0

    def loop(x):
        out = x[0].clone()
        for i in range(1, x.shape[0]):
            out += x[i]
        return out

    g = torch.Generator().manual_seed({seed})
    def draw(*shape):  # a wide dynamic range, so that another order of the adds rounds differently
        return torch.randn(*shape, generator=g) * torch.randn(*shape, generator=g).mul(4).exp()
    cases = [draw(37, 300), draw(5, 8, 4, 64).transpose(0, 1), draw(512, 4).t(), draw(3, 1)]
    for x in cases:
        got = sequential_sum_dim0(x)
        assert got is not None and got.shape == x.shape[1:], (tuple(x.shape), got)
        assert torch.equal(got, loop(x)), tuple(x.shape)
    assert not torch.equal(sequential_sum_dim0(cases[0]), cases[0].sum(dim=0))  # the order matters on these inputs
    assert sequential_sum_dim0(draw(4, 6).double()) is None  # only fp32: the caller loops
    print("ok")
""")


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_sequential_sum_matches_the_loop_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    seed = fresh_seed(32)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(seed=seed)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (seed, proc.stderr[-2000:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_sums_on_cuda_equal_the_torch_loop(monkeypatch):
    from exl3tool.encode import online
    from exl3tool.kernels import reduce

    w = torch.randn(512, 7168, device="cuda") * torch.rand(1, 7168, device="cuda")
    fast = [online._block_sum_squares(w, 0), online._block_sum_squares(w, 1), online._cuda_mean(w[0])]
    monkeypatch.setattr(reduce, "sequential_sum_dim0", lambda x: None)  # the torch loop, one add per row
    slow = [online._block_sum_squares(w, 0), online._block_sum_squares(w, 1), online._cuda_mean(w[0])]
    assert all(torch.equal(a, b) for a, b in zip(fast[:2], slow[:2])) and fast[2] == slow[2]
