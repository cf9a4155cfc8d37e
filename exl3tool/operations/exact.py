"""Exact checks: an entry against a fresh encode of the same key from the checkpoint's weight.

The encode is deterministic, so on the platform that wrote an entry (device kind and model, CPU vector ISA, torch
and exl3tool versions: ``encoder_platform``, recorded in new entries as ``exl3tool_platform``) a correct entry is
byte-identical to a fresh encode: any difference there is a wrong entry (``differs``).

Across platforms only the Hadamard summation order differs (docs/format.md §9): the rotated weight
W_r moves by an ulp or two, an fp16 rounding of a tile input may flip, and that tile's trellis path may change.
An entry written elsewhere (the server's have no platform record; nor do entries of older exl3tool versions) is
therefore checked for what such a difference can and cannot do:

* ``svh`` and ``suh`` within one fp16 ulp of the fresh encode's, element by element;
* every tile whose bytes differ is, under this platform's W_r, within ``TILE_TOLERANCE`` of the fresh encode's
  own (optimal) tile error. Measured (``benchmarks/exact_margins.py``): tiles of another Hadamard order come within
  1 % (0.995-1.009 on golden case0 and simulated platforms at K=3, 6, 8); a single flipped trellis bit makes its
  tile 1.7x or more worse at K=6 (median 66x), 7.6x at K=8, but at K=3 as little as 1.04x (median 3.2x; 1 of 200
  flips within the tolerance): across platforms such a flip passes as ``equivalent``;
* the stored ``proxy_error`` within 2 % of the fresh one.

Such an entry is ``equivalent``: as good as this platform's own encode tile for tile, though not proven to be the
bytes its writer's encode gave. When the two searched global scales differ by a grid step (a near-tie of the scale
search, rare) every ``suh`` differs by one common factor and no tile comparison holds: ``unproved`` (re-run the
check on the writer's platform). Nothing written on another platform is ever called ``differs`` for bytes that
platform's encode could have produced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from exl3tool.version import __version__
from exl3tool.cache.key import CacheKey
from exl3tool.format.codebook import decode_states
from exl3tool.format.encoded import EncodedLinear
from exl3tool.format.layout import matrix_to_tiles
from exl3tool.format.trellis import unpack_trellis

__all__ = ["ExactCheck", "TILE_TOLERANCE", "PROXY_TOLERANCE", "PLATFORM_KEY", "compare_exact", "fresh_encode",
           "written_on"]

PLATFORM_KEY = "exl3tool_platform"  # entry metadata: where the encode ran (encode.online.encoder_platform)
TILE_TOLERANCE = 1.25  # a differing tile's error over the fresh encode's, across platforms (see the module doc)
PROXY_TOLERANCE = 0.02  # relative, across platforms (golden case0 on a CPU: 1e-16 to 2e-2 as the tiles differ)
_CHUNK_TILES = 4096  # differing tiles decoded per step (bounds the unpacking's memory)


@dataclass(frozen=True)
class ExactCheck:
    """The outcome of one exact check.

    ``verdict``: ``identical`` (every tensor and the proxy error equal the fresh encode's), ``equivalent``
    (written on another platform; differs only as another Hadamard order can make it differ), ``differs``
    (a wrong entry; ``detail`` says where) or ``unproved`` (another platform's scale search chose another
    global scale; nothing can be said here). ``written_on`` is the entry's platform record ("" when it has none),
    ``platform`` this check's.
    """

    verdict: str
    detail: str
    written_on: str
    platform: str
    tiles: int = 0
    tiles_differing: int = 0

    @property
    def ok(self) -> bool:
        """True unless the entry is shown wrong (``unproved`` is not a finding, see the module doc)."""
        return self.verdict != "differs"


def written_on(metadata: dict[str, str]) -> str:
    """The entry's platform record, with the exl3tool version that wrote it ("" for the server's and older entries)."""
    platform = metadata.get(PLATFORM_KEY)
    if not platform:
        return ""
    return f"{platform}; exl3tool {metadata.get('exl3tool_version', '?')}"


def _this_platform(fresh: EncodedLinear) -> str:
    return f"{fresh.platform}; exl3tool {__version__}" if fresh.platform else ""


def fresh_encode(weight: torch.Tensor, key: CacheKey, device: torch.device) -> tuple[EncodedLinear, torch.Tensor]:
    """The encode a warm would publish for ``key`` (same weight, bits and seed), with its rotated weight W_r."""
    from exl3tool.encode.online import encode_linear_with_input

    return encode_linear_with_input(weight.to(device), bits=key.bits, seed=key.seed, device=device, name=key.prefix)


def _fp16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in fp16 units in the last place (same-sign values; a sign change counts large)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def _tile_errors(trellis: torch.Tensor, tiles: torch.Tensor, bits: int, codebook: str) -> torch.Tensor:
    """Squared error of each packed tile (T, 16 bits) against its W_r tile (T, 256), float64, in chunks."""
    out = []
    for start in range(0, trellis.shape[0], _CHUNK_TILES):
        values = decode_states(unpack_trellis(trellis[start:start + _CHUNK_TILES], bits), codebook)
        out.append((values.double() - tiles[start:start + _CHUNK_TILES].double()).square().sum(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _first_tile(mask: torch.Tensor) -> str:
    i, j = (int(v) for v in mask.nonzero()[0])
    return f"tile ({i}, {j})"


def _same_platform_differences(entry: dict[str, torch.Tensor], proxy: Optional[float], fresh: EncodedLinear) -> list[str]:
    problems = []
    diff = (entry["trellis"] != fresh.trellis).any(-1)
    if diff.any():
        problems.append(f"trellis: {int(diff.sum())} of {diff.numel()} tiles differ (first {_first_tile(diff)})")
    for name in ("suh", "svh"):
        n = int((entry[name].view(torch.int16) != getattr(fresh, name).view(torch.int16)).sum())
        if n:
            problems.append(f"{name}: {n} of {entry[name].numel()} values differ")
    if proxy != fresh.proxy_error:
        problems.append(f"proxy_error {proxy!r}, a fresh encode gives {fresh.proxy_error!r}")
    return problems


def compare_exact(
    entry: dict[str, torch.Tensor], proxy_error: Optional[float], metadata: dict[str, str],
    fresh: EncodedLinear, w_r: torch.Tensor,
) -> ExactCheck:
    """Compare an entry's tensors and proxy error with ``fresh`` (``fresh_encode`` of its key) as the module doc says."""
    entry = {name: entry[name].to("cpu") for name in ("trellis", "suh", "svh")}
    fresh = replace(fresh, **fresh.tensors())  # on the CPU, as the entry's
    wrote, here = written_on(metadata), _this_platform(fresh)
    tiles = entry["trellis"].shape[0] * entry["trellis"].shape[1]
    same = bool(wrote) and wrote == here
    problems = _same_platform_differences(entry, proxy_error, fresh)
    if not problems:
        return ExactCheck("identical", "byte-identical to a fresh encode", wrote, here, tiles, 0)
    diff = (entry["trellis"] != fresh.trellis).any(-1)
    n_diff = int(diff.sum())
    if same:
        return ExactCheck("differs", "; ".join(problems) + f" (written on this platform: {here})", wrote, here,
                          tiles, n_diff)
    where = f"written on {wrote}" if wrote else "written without a platform record (the server's or an older exl3tool's)"
    svh_far = int((_fp16_ulps(entry["svh"], fresh.svh) > 1).sum())
    suh_far = int((_fp16_ulps(entry["suh"], fresh.suh) > 1).sum())
    if svh_far:
        return ExactCheck("differs", f"svh: {svh_far} values more than one fp16 ulp from a fresh encode's ({where})",
                          wrote, here, tiles, n_diff)
    if suh_far:
        ratio = fresh.suh.double() / entry["suh"].double()
        ratio = ratio[torch.isfinite(ratio)]
        if ratio.numel() and bool(((ratio / ratio.median()) - 1).abs().max() < 2e-3) and float(ratio.median()) != 1.0:
            return ExactCheck("unproved", f"the global scale differs from this platform's by {float(ratio.median()):.4f}x "
                              f"(a near-tie of the scale search; {where}): check it on that platform", wrote, here,
                              tiles, n_diff)
        return ExactCheck("differs", f"suh: {suh_far} values more than one fp16 ulp from a fresh encode's ({where})",
                          wrote, here, tiles, n_diff)
    if n_diff:
        flat = matrix_to_tiles(w_r.to("cpu", torch.float32)).reshape(tiles, 256)
        mask = diff.reshape(-1)
        bits = fresh.bits
        got = _tile_errors(entry["trellis"].reshape(tiles, -1)[mask], flat[mask], bits, fresh.codebook)
        best = _tile_errors(fresh.trellis.reshape(tiles, -1)[mask], flat[mask], bits, fresh.codebook)
        ratio = got / best.clamp_min(1e-30)
        worst = int(ratio.argmax())
        if float(ratio[worst]) > TILE_TOLERANCE:
            index = int(mask.nonzero()[worst])
            i, j = divmod(index, entry["trellis"].shape[1])
            return ExactCheck("differs", f"trellis tile ({i}, {j}): error {float(ratio[worst]):.3g}x a fresh encode's "
                              f"(another platform stays within {TILE_TOLERANCE}x; {where})", wrote, here, tiles, n_diff)
    if proxy_error is not None and abs(proxy_error - fresh.proxy_error) > PROXY_TOLERANCE * fresh.proxy_error:
        return ExactCheck("differs", f"proxy_error {proxy_error!r}, a fresh encode gives {fresh.proxy_error!r} ({where})",
                          wrote, here, tiles, n_diff)
    return ExactCheck("equivalent", f"{n_diff} of {tiles} tiles differ from this platform's encode, each within "
                      f"{TILE_TOLERANCE}x of its error, scales within an fp16 ulp ({where}; re-encoded on {here})",
                      wrote, here, tiles, n_diff)
