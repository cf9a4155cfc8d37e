"""``quantize_exl3`` with exllamav3's signature and return convention, run by exl3tool's encoder.

The vLLM fork encodes a BF16 linear it finds no cache entry for by calling exllamav3's
``modules/quant/exl3_lib/quantize.py:quantize_exl3`` from the directory ``VLLM_EXL3_ENCODER_SOURCE`` names, and
the fork's image-build gate and round-trip tools (vision towers, ``lm_head``) load the same function through the
same loader. A directory written by ``exl3tool encoder-source`` holds a one-line ``quantize.py`` that re-exports
the function below, so all of them run exl3tool's encoder (the Triton Viterbi on CUDA, the numba one on CPU
tensors) with the bytes exllamav3 1.6.5 gives for the same call on the same GPU:

    weight_q, proxy_error, tensors = quantize_exl3(weight_kn_fp32, H_data, quant_args, return_weight_q,
                                                   verbose=False)

``H_data["H"]`` on the meta device (no calibration: the reference's fallback path; ``count``, ``first_key``,
``num_total``, ``inf_nan``, ``L``, ``finalized`` are not read there and may be anything), ``quant_args`` with
``K`` (1-8), ``seed``, ``devices`` (``torch.device``, index or string), ``apply_out_scales`` (True, None or
False) and a codebook flag (``mcg``, ``mul1``, neither: 3INST). The result is the reference's:

* ``weight_q``: with ``return_weight_q=True`` the dequantised weight (k, n) float32 on ``devices[0]``, computed as
  the reference computes it (the decoded codebook values Q_r, blockwise Hadamard on the left, times the fp32
  input scales, blockwise Hadamard on the right, times the fp32 output scales, with the reference's torch ops).
  On a GPU it is the reference's bit for bit wherever the trellis and the fp32 scales are (the scales' fp16
  forms suh/svh are byte-identical; their fp32 forms may differ in the last bit on a few elements, spec 9.2);
  elsewhere each element is within ``WEIGHT_Q_ULPS`` units of fp32 rounding of the exact product (see
  ``weight_q_bound``). With ``return_weight_q=False`` it is None: the reference computes the weight either way,
  but every caller that passes False discards it (the fork's online linear method, its graph-capture gate, the
  K8/K4 round-trip tools), and computing it would add a (k, n) float32 matrix to every server encode.
* ``proxy_error``: the mean squared error in the regularised domain (a float).
* ``tensors``: ``{"suh", "svh", "trellis"[, "mcg" | "mul1"]}``; with ``quant_args["no_pack"]`` the trellis is
  the unpacked (k/16, n/16, 256) int16 states, as the reference returns them.

``quant_args`` gets ``apply_out_scales``, ``g_scale``, ``q_fallback`` (True), ``zeros`` and
``out_scales_hessian`` (False), and ``H_data`` gets ``L``, ``finalized``, ``diag``, ``q_fallback`` and ``su``
(the input sign draw), as the reference writes them. Unlike the reference, the global torch RNG is left alone
(the sign draws are computed from the seed, ``reference_signs``) and the caller's weight is not overwritten.

Refused (``UnsupportedCallError``, naming the argument and the encoder to use instead) is what needs what the
drop-in does not do: a real Hessian (calibrated LDLQ), a fractional ``K`` (mul1's half-integer trellis), no
``seed`` (the reference would continue torch's global RNG stream), sign draws on two devices (``H_data["device"]``
other than ``devices[0]``), ``save_reg`` (an image of the regularised weight) and a quant_args key exllamav3
1.6.5 does not read (its meaning is unknown). Keys that 1.6.5 reads only with a Hessian (``sigma_reg``,
``H_out``, ...) change nothing on this path and are accepted, as the reference ignores them too. A call the
reference fails on (a shape not a multiple of 128, a non-float32 weight, missing keys) raises ``ValueError``.

Importing this module imports torch only: no CUDA initialisation, no kernel compilation, no typer/rich. The
first call on a device compiles what it needs (Triton's on-disk cache, ``triton_cache``, keeps the kernels across
processes and restarts); calls are serialised per device (several threads may call, one process per TP rank may
call; the CPU path's numba pool is not re-entrant, and two encodes on one GPU would only add their peaks).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["REFERENCE", "WEIGHT_Q_ULPS", "UnsupportedCallError", "dequantized_weight", "quantize_exl3",
           "weight_q_bound"]

REFERENCE = "exllamav3 1.6.5"
_INSTEAD = ("use exllamav3's own quantize_exl3 for this call (point VLLM_EXL3_ENCODER_SOURCE at the exllamav3 "
            "package directory, the one holding modules/quant/exl3_lib/quantize.py)")
# quant_args keys 1.6.5 reads only on the calibrated (Hessian) path: with a meta H they change nothing.
_HESSIAN_ONLY = frozenset({"sigma_reg", "sigma_reg_out", "scaled_hessian", "H_out", "no_refit",
                           "out_hessian_diag", "out_sensitivity", "debug_dir"})
# Keys that change where the work runs, not the result (1.6.5 splits tiles over devices; the kernel is exact).
_PLACEMENT = frozenset({"device_ratios"})
# Keys 1.6.5 writes into quant_args after a call: a reused dict carries them in.
_WRITTEN = frozenset({"apply_out_scales", "g_scale", "q_fallback", "zeros", "out_scales_hessian"})
_READ = frozenset({"K", "seed", "devices", "apply_out_scales", "mcg", "mul1", "buf_size_k", "no_pack"})
_KNOWN = _HESSIAN_ONLY | _PLACEMENT | _WRITTEN | _READ
# The reference's right-hand rotation of weight_q runs as GEMMs of at most this many rows (1.6.5's
# _HAD_MAX_GEMM_ROWS); the same chunks here give the same cuBLAS calls, hence the same bits.
_HAD_ROWS = 1 << 19
# |weight_q - exact| <= WEIGHT_Q_ULPS * 2^-24 * (|su| (|B| |Q| |B|) |sv|) elementwise, the exact product taken with
# the same fp32 su, sv: two 128-term fp32 dot products (error at most 128 u times the sum of magnitudes each) and
# two products by a scale. The worst case; fp32 matmuls give under 1 unit (tests: at most 8 on the CPU).
WEIGHT_Q_ULPS = 2 * 128 + 4
_DECODE_TILES = 8192  # tiles decoded at once for weight_q / no_pack (the unpacked bit streams take ~16 KiB a tile)

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


class UnsupportedCallError(NotImplementedError):
    """A call exl3tool's encoder cannot answer with the reference's exact bytes; the message says what to use."""


def _refuse(what: str) -> UnsupportedCallError:
    return UnsupportedCallError(f"quantize_exl3 (exl3tool drop-in for {REFERENCE}): {what}; {_INSTEAD}")


def _bad(what: str) -> ValueError:
    return ValueError(f"quantize_exl3 (exl3tool drop-in for {REFERENCE}): {what}")


def _device(value: Any, what: str) -> torch.device:
    """``value`` as torch would read it (``"cuda:1"``, ``torch.device``, an int index); a bare ``cuda`` is the current one."""
    try:
        dev = torch.device(value)
    except (TypeError, RuntimeError, ValueError):
        raise _bad(f"{what} {value!r} is not a torch device") from None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise _refuse(f"{what} {value!r}: exl3tool encodes on CUDA or the CPU only")
    return dev


def _check_quant_args(quant_args: Any) -> tuple[int, str, int, bool]:
    """(K, codebook, seed, out_scales) of a call exl3tool can answer exactly, else an error naming the key."""
    if not isinstance(quant_args, MutableMapping):
        raise _bad(f"quant_args must be a dict, got {type(quant_args).__name__}")
    unknown = sorted(str(k) for k in quant_args if k not in _KNOWN)
    if unknown:
        raise _refuse(f"quant_args key(s) {', '.join(repr(k) for k in unknown)} are not ones {REFERENCE} reads, so "
                      "exl3tool cannot tell what result they ask for")
    for key in ("K", "devices", "apply_out_scales"):
        if key not in quant_args:
            raise _bad(f"quant_args has no {key!r} (exllamav3 raises KeyError too); the fork passes K, seed, devices, "
                       "apply_out_scales and the codebook flag")
    bits = quant_args["K"]
    if isinstance(bits, float) and not bits.is_integer() and 1 <= bits <= 8:
        raise _refuse(f"quant_args['K'] = {bits!r} is a fractional bitrate (mul1 only in exllamav3); exl3tool encodes "
                      "integer K from 1 to 8")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 1 <= bits <= 8 or bits != int(bits):
        raise _bad(f"quant_args['K'] = {bits!r}: K must be an integer from 1 to 8")
    out_scales = quant_args["apply_out_scales"]
    if out_scales not in (True, False, None):
        raise _bad(f"quant_args['apply_out_scales'] = {out_scales!r}: True, False or None (None: as True without a "
                   "Hessian)")
    if "seed" not in quant_args:
        raise _refuse("quant_args has no 'seed': exllamav3 would then continue torch's global RNG stream, which "
                      "exl3tool cannot reproduce; pass the seed (the fork passes crc32 of the layer prefix)")
    seed = quant_args["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _bad(f"quant_args['seed'] = {seed!r}: the seed must be a non-negative integer")
    mcg, mul1 = bool(quant_args.get("mcg")), bool(quant_args.get("mul1"))
    if mcg and mul1:
        raise _bad("quant_args selects both the mcg and mul1 codebooks (exllamav3 asserts the same)")
    devices = quant_args["devices"]
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
        raise _bad(f"quant_args['devices'] = {devices!r}: a non-empty list of devices (the work runs on the first)")
    return int(bits), "mcg" if mcg else "mul1" if mul1 else "3inst", seed, out_scales is not False


def _check_h_data(h_data: Any, k: int) -> torch.device:
    """The device of the input sign draw for an uncalibrated call; a Hessian is refused."""
    if not isinstance(h_data, MutableMapping) or "H" not in h_data:
        raise _bad("H_data must be a dict with an 'H' tensor (the fork passes a meta-device (k, k) placeholder)")
    hessian = h_data["H"]
    if not isinstance(hessian, torch.Tensor):
        raise _bad(f"H_data['H'] must be a tensor, got {type(hessian).__name__}")
    if not hessian.is_meta:
        raise _refuse(f"H_data['H'] is a real Hessian on {hessian.device} (a calibrated LDLQ encode); the drop-in does "
                      "only the uncalibrated encode of a meta-device H")
    if tuple(hessian.shape) != (k, k):
        raise _bad(f"H_data['H'] has shape {tuple(hessian.shape)}, expected ({k}, {k}) for a weight with {k} input "
                   "features")
    if "device" not in h_data:
        raise _bad("H_data has no 'device' (exllamav3 draws the input signs there; the fork passes the layer's device)")
    return _device(h_data["device"], "H_data['device']")


def _check_buf_size(quant_args: Mapping, k: int, n: int) -> None:
    """``buf_size_k`` only splits the uncalibrated work; exllamav3 fails on one that does not divide the weight."""
    if "buf_size_k" not in quant_args:
        return
    value = quant_args["buf_size_k"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"quant_args['buf_size_k'] = {value!r} must be an integer")
    size = max(value, 16)
    if size % 16 or n % size or k % size:
        raise _bad(f"quant_args['buf_size_k'] = {value!r} must be a multiple of 16 dividing both dimensions of the "
                   f"({k}, {n}) weight (exllamav3 fails on it)")


def _lock(device: torch.device) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(str(device), threading.Lock())


def _sign_vectors(seed: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's CUDA sign draws after ``manual_seed(seed)``, for this GPU's multiprocessor count."""
    from exl3tool.format.signs import reference_signs

    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        return reference_signs(seed, k, n, sm_count=sm_count)
    return reference_signs(seed, k, n)


def _tile_rows(trellis: torch.Tensor) -> int:
    """Tile rows of ``trellis`` decoded at once (at least one)."""
    return max(1, _DECODE_TILES // max(1, trellis.shape[1]))


def _unpacked(trellis: torch.Tensor, bits: int) -> torch.Tensor:
    """The (k/16, n/16, 256) int16 states of a packed trellis (``no_pack``), a slab of tile rows at a time."""
    from exl3tool.format.trellis import unpack_trellis

    out = torch.empty((*trellis.shape[:2], 256), dtype=torch.int16, device=trellis.device)
    step = _tile_rows(trellis)
    for lo in range(0, trellis.shape[0], step):
        out[lo : lo + step] = unpack_trellis(trellis[lo : lo + step], bits)
    return out


def dequantized_weight(trellis: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, bits: int,
                       codebook: str) -> torch.Tensor:
    """The reference's ``weight_q``: B_k Q_r, times su (k,) f32, then B_n, times sv (n,) f32; (k, n) float32.

    Q_r is the decoded trellis (the quantizer's values, exactly); the products are the reference's torch ops on
    the same shapes (a batched left product, a right product in GEMMs of at most 2^19 rows), so on the reference's
    GPU the bits are the reference's for the same trellis and scales.
    """
    from exl3tool.format.decode import reconstruct
    from exl3tool.format.hadamard import HADAMARD_SCALE, hadamard_128

    tk, tn = trellis.shape[:2]
    k, n = 16 * tk, 16 * tn
    dev = trellis.device
    q = torch.empty((k, n), dtype=torch.float32, device=dev)
    step = _tile_rows(trellis)
    for lo in range(0, tk, step):
        q[16 * lo : 16 * (lo + step)] = reconstruct(trellis[lo : lo + step], bits, codebook)
    hn = hadamard_128(torch.float32, dev) * torch.tensor(HADAMARD_SCALE, dtype=torch.float32, device=dev)
    w = (hn @ q.view(-1, 128, n)).view(k, n)
    del q
    w *= su.to(device=dev, dtype=torch.float32).reshape(k, 1)
    rows = max(1, _HAD_ROWS * 128 // n)
    if rows >= k:
        w = (w.view(k, -1, 128) @ hn).view(k, n)
    else:
        w = torch.cat([(w[i : i + rows].reshape(-1, 128) @ hn).view(-1, n) for i in range(0, k, rows)], dim=0)
    w *= sv.to(device=dev, dtype=torch.float32).reshape(1, n)
    return w


def weight_q_bound(trellis: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, bits: int,
                   codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound): the float64 product diag(su) B_k Q B_n diag(sv) and the elementwise bound on how far an fp32
    ``weight_q`` of the same trellis and scales may be from it (``WEIGHT_Q_ULPS`` units of 2^-24 times the same
    product of magnitudes). For tests and the benchmark; small layers only (float64 copies)."""
    from exl3tool.format.decode import reconstruct
    from exl3tool.format.hadamard import hadamard_128

    q = reconstruct(trellis, bits, codebook).to(torch.float64)
    h = hadamard_128(torch.float64, q.device) / 128 ** 0.5
    su64 = su.to(device=q.device, dtype=torch.float64).reshape(-1, 1)
    sv64 = sv.to(device=q.device, dtype=torch.float64).reshape(1, -1)
    k, n = q.shape

    def both(m: torch.Tensor, hm: torch.Tensor) -> torch.Tensor:
        left = (hm @ m.view(-1, 128, n)).view(k, n)
        return (left.view(k, -1, 128) @ hm).view(k, n)

    exact = both(q, h) * su64 * sv64
    bound = both(q.abs(), h.abs()) * su64.abs() * sv64.abs() * (WEIGHT_Q_ULPS * 2.0 ** -24)
    return exact, bound


def quantize_exl3(
    weight: torch.Tensor,
    H_data: dict,
    quant_args: dict,
    return_weight_q: bool,
    progress_str: str | None = None,
    verbose: bool = False,
    swap_to_device: torch.device | None = None,
    save_reg: str | None = None,
) -> tuple[torch.Tensor | None, float, dict[str, torch.Tensor]]:
    """Encode ``weight`` (float32, (in_features, out_features)) as exllamav3 1.6.5's uncalibrated quantize_exl3.

    Returns ``(weight_q or None, proxy_error, {"suh", "svh", "trellis"[, "mcg" | "mul1"]})`` (module docstring)
    with the tensors on ``quant_args["devices"][0]`` (the marker on the CPU, as the reference makes it).
    ``progress_str``, ``verbose`` and ``swap_to_device`` are accepted and change nothing (the reference uses them
    for display and placement only). Raises ``UnsupportedCallError`` for what it cannot reproduce exactly,
    ``ValueError`` for a call exllamav3 would fail too (non-finite or unaligned weight, missing keys).
    """
    if save_reg:
        raise _refuse(f"save_reg={save_reg!r} asks for an image of the regularised weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise _bad(f"weight must be a 2-D (in_features, out_features) tensor, got {shape}")
    k, n = weight.shape
    bits, codebook, seed, out_scales = _check_quant_args(quant_args)
    draw_device = _check_h_data(H_data, k)
    device = _device(quant_args["devices"][0], "quant_args['devices'][0]")
    if draw_device != device:
        raise _refuse(f"H_data['device'] {draw_device} differs from quant_args['devices'][0] {device}: exllamav3 then "
                      "draws the input and output signs from two generators, which exl3tool does not model")
    _check_buf_size(quant_args, k, n)

    from exl3tool.format.codebook import CODEBOOK_MARKERS
    from exl3tool.encode.online import finish_encode, prepare_encode
    from exl3tool.serving.triton_cache import drop_in_triton_cache

    signs = _sign_vectors(seed, k, n, device)
    on_gpu = device.type == "cuda"
    with (_lock(device), drop_in_triton_cache() if on_gpu else contextlib.nullcontext(),
          torch.cuda.device(device) if on_gpu else contextlib.nullcontext()):
        prepared = prepare_encode(weight, bits=bits, seed=seed, codebook=codebook, sign_vectors=signs, device=device,
                                  out_scales=out_scales)
        su, sv, zeros = prepared.su, prepared.sv, prepared.zeros
        enc = finish_encode(prepared)
        del prepared  # its w_r (now the squared errors) before weight_q's matrices
        weight_q = dequantized_weight(enc.trellis, su, sv, bits, codebook) if return_weight_q else None
        trellis = _unpacked(enc.trellis, bits) if quant_args.get("no_pack") else enc.trellis
    for name in ("suh", "svh"):
        if not bool(torch.isfinite(getattr(enc, name)).all()):
            raise RuntimeError(f"quantize_exl3 (exl3tool): {name} of the ({k}, {n}) weight is not finite although the "
                               "weight is; this is an exl3tool bug, please report it")
    if not math.isfinite(enc.proxy_error):
        raise RuntimeError(f"quantize_exl3 (exl3tool): proxy error {enc.proxy_error!r} of the ({k}, {n}) weight is not "
                           "finite although the weight is; this is an exl3tool bug, please report it")

    tensors = {"suh": enc.suh, "svh": enc.svh, "trellis": trellis}
    if codebook in CODEBOOK_MARKERS:
        tensors[codebook] = torch.tensor(CODEBOOK_MARKERS[codebook], dtype=torch.int32)
    H_data.update({"L": None, "finalized": True, "diag": None, "q_fallback": True,
                   "su": signs[0].reshape(k, 1).to(device=draw_device, dtype=torch.float32)})
    quant_args.update({"apply_out_scales": out_scales or zeros, "g_scale": enc.g_scale, "q_fallback": True,
                       "zeros": zeros, "out_scales_hessian": False})
    return weight_q, enc.proxy_error, tensors
