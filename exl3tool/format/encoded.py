"""The result of encoding one linear layer: what the cache stores plus the encoder's diagnostics."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EncodedLinear"]


@dataclass(frozen=True)
class EncodedLinear:
    """One EXL3-encoded (in_features, out_features) weight.

    ``trellis`` int16 (k/16, n/16, 16*bits), ``suh`` fp16 (k,), ``svh`` fp16 (n,) are exactly the
    tensors of a cache entry; ``proxy_error`` is the encoder's MSE in the regularised domain and
    ``g_scale`` the global scale the search chose; ``zeros`` is True for a weight whose column RMS averages
    to zero (the reference reports it as ``quant_args["zeros"]``); ``platform`` where it was computed
    (``encoder_platform``; "" when unknown), recorded in the entry so an exact re-check knows whether bytes must agree.
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    proxy_error: float
    g_scale: float
    bits: int
    codebook: str = "mcg"
    zeros: bool = False
    platform: str = ""

    @property
    def in_features(self) -> int:
        return int(self.suh.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.svh.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The three tensors a cache entry holds, contiguous on the CPU."""
        return {name: getattr(self, name).detach().to("cpu").contiguous() for name in ("trellis", "suh", "svh")}
