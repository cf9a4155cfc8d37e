"""The same weight gives the same entry bytes whatever torch's CPU thread count (one process vs torchrun).

Under torchrun each process gets ``cpu_count // LOCAL_WORLD_SIZE`` threads (often 1); a plain run keeps
torch's default. torch's CPU sum of a large tensor to one value splits it per thread, so the proxy error
(and, through the scale search's MSEs, g and the trellis) used to change with the thread count.
"""

from __future__ import annotations

import pytest
import torch

from exl3tool.cache import CacheKey, write_entry
from exl3tool.encode import encode_linear

from helpers import ENCODER_ID, MODEL_ID
from seeds import fresh_seed


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_fixed_sum_does_not_depend_on_the_thread_count(threads):
    from exl3tool.encode.online import _fixed_sum, _mean

    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(1_000_003, generator=gen, dtype=torch.float64)
    x32 = torch.randn(700_001, generator=gen)
    got = set()
    for n in (1, 2, 3, 7):
        threads(n)
        got.add((repr(_fixed_sum(x64).item()), repr(_fixed_sum(x32).item()), repr(_mean(x32).item())))
    assert len(got) == 1
    small = torch.randn(3000, generator=gen)
    assert _mean(small).item() == small.mean().item()  # below one chunk it is torch's own mean


@pytest.mark.parametrize("slab_rows", [1, 3, 2048])
def test_proxy_error_in_slabs_is_the_whole_float64_sum(threads, slab_rows, monkeypatch):
    """The CPU proxy error widens the squared error a slab of rows at a time: the same value as the whole widened
    at once (the sum before issue 24's CPU bound), with 1 and 3 threads, slabs of one row, three, or all."""
    import exl3tool.encode.online as online

    monkeypatch.setattr(online, "PROXY_SLAB_ROWS", slab_rows)
    gen = torch.Generator().manual_seed(fresh_seed())
    sq = (torch.randn(384, 1408, generator=gen) * torch.rand(1, 1408, generator=gen)).square()  # 132 rows of 4096
    whole = float(online._fixed_sum(sq.to(torch.float64))) / sq.numel()
    for n in (1, 3):
        threads(n)
        assert online._proxy_error_of_squares(sq) == whole
        assert online._fixed_sum_float64(sq).item() == online._fixed_sum(sq.to(torch.float64)).item()
    plain = float(sq.to(torch.float64).sum()) / sq.numel()
    assert abs(whole - plain) <= 1e-12 * plain  # and it is the float64 sum


@pytest.mark.slow
@pytest.mark.parametrize("k, n, seed", [(384, 768, 1152)])
def test_entry_bytes_do_not_depend_on_the_thread_count(threads, viterbi_memo, tmp_path, k, n, seed):
    """One layer encoded with 1 and 3 threads: same trellis, scales, proxy error and file bytes.

    Before the fix this layer differed in the proxy error's last digit, in g and in the trellis. (A second case,
    (512, 256), differed in the proxy error only: that sum is checked on its own above, in a fraction of the time.)
    The numba Viterbi (its own threads, not torch's) runs once per distinct input (conftest's viterbi_memo): the
    3-thread encode reuses the 1-thread encode's states only where its tiles are the same bits.
    """
    gen = torch.Generator().manual_seed(k * 100003 + n)
    weight = (torch.randn(k, n, generator=gen) * 0.02).to(torch.bfloat16).to(torch.float32)
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, k, n)
    blobs, proxies = [], []
    for count in (1, 3):
        threads(count)
        enc = encode_linear(weight, bits=6, seed=seed)
        proxies.append(repr(enc.proxy_error))
        blobs.append(write_entry(tmp_path / f"t{count}" / "e.safetensors", key, enc.tensors(), enc.proxy_error).read_bytes())
    assert viterbi_memo["miss"] > 0
    assert proxies[0] == proxies[1]
    assert blobs[0] == blobs[1]
