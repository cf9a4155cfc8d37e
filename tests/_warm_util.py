"""Helpers for warm tests that need no real encode: a tiny local checkpoint and a warm with a fake encoder.

``fake_encode`` gives tensors of the right shapes, deterministic in the layer's seed, so a re-encode writes the
same bytes as the first one; ``fake_warm`` runs the real ``warm()`` (plan, pipeline, store) with it.
"""

from __future__ import annotations

import torch

from exl3tool.encode.encoded import EncodedLinear
from exl3tool.warm import WarmRequest, warm

TINY = dict(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=512)
ENC = dict(encoder_root="/encoders/exllamav3", encoder_revision="test-rev")
ENC_ARGS = ["--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]


def fake_encode(weight, bits, seed, device, progress=None):
    k, n = weight.shape
    g = torch.Generator().manual_seed(seed)
    return EncodedLinear(torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g,
                                       dtype=torch.int32).to(torch.int16),
                         (torch.rand(k, generator=g) + 0.5).half(), (torch.rand(n, generator=g) + 0.5).half(), 0.1, 1.0,
                         bits)


def fake_warm(request: WarmRequest, monkeypatch, calls: list | None = None):
    """``warm(request)`` with ``fake_encode``; ``calls`` collects the (in, out) shape of every encode."""
    import exl3tool.warm.request as req

    real = getattr(req.run_plan, "__wrapped__", req.run_plan)  # the real one, also on a second call in one test

    def encode(weight, bits, seed, device, progress=None):
        if calls is not None:
            calls.append((seed, tuple(weight.shape)))
        return fake_encode(weight, bits, seed, device)

    def run_plan(*args, **kwargs):
        kwargs["encode"] = encode
        return real(*args, **kwargs)

    run_plan.__wrapped__ = real
    monkeypatch.setattr(req, "run_plan", run_plan)
    return warm(request)
