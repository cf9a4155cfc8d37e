"""Target for Nsight Compute: a few calls of the fused GEMM at one shape and m (default and, for m = 1, the FMA
variant), so that `ncu -k regex:_gemm_kernel` can profile them. Not a benchmark: no timing here.

    ncu --clock-control none -k regex:_gemm_kernel --launch-skip 2 --launch-count 1 python3 benchmarks/_ncu_gemm.py 4096 14336 1
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl3tool.kernels.gemm import GemmConfig, choose_config, trellis_matmul  # noqa: E402

k, n, m = (int(v) for v in sys.argv[1:4])
variant = sys.argv[4] if len(sys.argv) > 4 else "default"
tr = torch.randint(-32768, 32768, (k // 16, n // 16, 96), dtype=torch.int16, device="cuda")
suh = (torch.randn(k, device="cuda") * 0.05).half()
svh = (torch.randn(n, device="cuda").abs() + 0.5).half()
x = torch.randn(m, k, device="cuda").half()
cfg = choose_config(m, k, n, x.device)
if variant == "fma":
    cfg = GemmConfig(**dict(cfg.__dict__, fma=True))
for _ in range(4):
    trellis_matmul(x, tr, suh, svh, bits=6, config=cfg)
torch.cuda.synchronize()
print(cfg)
