"""``quantize_exl3`` with exllamav3's signature and return convention, run by exl3tool's encoder.

The vLLM fork encodes a BF16 linear it finds no cache entry for by calling exllamav3's
``modules/quant/exl3_lib/quantize.py:quantize_exl3`` from the directory ``VLLM_EXL3_ENCODER_SOURCE`` names. A
directory written by ``exl3tool encoder-source`` holds a one-line ``quantize.py`` that re-exports the function
below, so the fork's start-up encodes run exl3tool's encoder (the Triton Viterbi on CUDA, the numba one on CPU
tensors) with the bytes exllamav3 1.6.5 gives for the same call on the same GPU:

    weight_q, proxy_error, tensors = quantize_exl3(weight_kn_fp32, H_data, quant_args, return_weight_q=False,
                                                   verbose=False)

``H_data["H"]`` on the meta device (no calibration: exllamav3's fallback path), ``quant_args`` with ``K``,
``seed``, ``devices``, ``apply_out_scales`` and a codebook flag. The result is ``(None, proxy_error, {"suh",
"svh", "trellis", marker})`` (the reference's first element, the dequantised weight, is not computed: the fork
discards it), and ``quant_args`` / ``H_data`` are updated as the reference updates them (``q_fallback`` is what
the fork checks). Unlike the reference, the global torch RNG is left alone: the sign draws are computed from the
seed (``reference_signs``), not drawn.

Everything the encoder cannot answer with the reference's exact bytes is refused (``UnsupportedCallError``,
naming the argument and the encoder to use instead): a real Hessian, a count of calibration rows, a fractional
``K``, ``apply_out_scales=False``, ``no_pack``, ``return_weight_q=True``, ``save_reg``, a quant_args key
exllamav3 1.6.5 does not read. Keys that 1.6.5 reads only with a Hessian (``sigma_reg``, ``H_out``, ...) change
nothing here and are accepted, as the reference ignores them too.

Importing this module imports torch only: no CUDA initialisation, no kernel compilation, no typer/rich. The
first call on a device compiles what it needs; calls are serialised per device (several threads may call, one
process per TP rank may call; the CPU path's numba pool is not re-entrant, and two encodes on one GPU would
only add their peaks).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["REFERENCE", "UnsupportedCallError", "quantize_exl3"]

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


def _check_quant_args(quant_args: Any) -> tuple[int, str, int]:
    """(K, codebook, seed) of a call exl3tool can answer exactly, else an error naming the key."""
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
    if isinstance(bits, float) and not bits.is_integer():
        raise _refuse(f"quant_args['K'] = {bits!r} is a fractional bitrate (mul1 only in exllamav3); exl3tool encodes "
                      "integer K from 1 to 8")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 1 <= bits <= 8:
        raise _bad(f"quant_args['K'] = {bits!r}: K must be an integer from 1 to 8")
    if quant_args["apply_out_scales"] not in (True, None):
        raise _refuse(f"quant_args['apply_out_scales'] = {quant_args['apply_out_scales']!r}: exl3tool always applies "
                      "the output scales (True, or None, which the uncalibrated path treats as True)")
    if "seed" not in quant_args:
        raise _refuse("quant_args has no 'seed': exllamav3 would then continue torch's global RNG stream, which "
                      "exl3tool cannot reproduce; pass the seed (the fork passes crc32 of the layer prefix)")
    seed = quant_args["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise _bad(f"quant_args['seed'] = {seed!r}: the seed must be a non-negative integer")
    mcg, mul1 = bool(quant_args.get("mcg")), bool(quant_args.get("mul1"))
    if mcg and mul1:
        raise _bad("quant_args selects both the mcg and mul1 codebooks (exllamav3 asserts the same)")
    if quant_args.get("no_pack"):
        raise _refuse("quant_args['no_pack'] asks for unpacked trellis states; the drop-in returns the packed trellis")
    devices = quant_args["devices"]
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
        raise _bad(f"quant_args['devices'] = {devices!r}: a non-empty list of devices (the work runs on the first)")
    return int(bits), "mcg" if mcg else "mul1" if mul1 else "3inst", seed


def _check_h_data(h_data: Any, k: int) -> torch.device:
    """The device of the sign draw for an uncalibrated call; a Hessian is refused."""
    if not isinstance(h_data, MutableMapping) or "H" not in h_data:
        raise _bad("H_data must be a dict with an 'H' tensor (the fork passes a meta-device (k, k) placeholder)")
    hessian = h_data["H"]
    if not isinstance(hessian, torch.Tensor):
        raise _bad(f"H_data['H'] must be a tensor, got {type(hessian).__name__}")
    if not hessian.is_meta:
        raise _refuse(f"H_data['H'] is a real Hessian on {hessian.device} (a calibrated LDLQ encode); the drop-in does "
                      "only the uncalibrated encode of a meta-device H")
    count = h_data.get("count", 0)
    if count:
        raise _refuse(f"H_data['count'] = {count!r} says calibration rows were captured, but H is on the meta device "
                      "(exllamav3 would ignore the count and encode uncalibrated); pass count 0 for an uncalibrated "
                      "encode")
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
    from exl3tool.encode.signs import reference_signs

    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        return reference_signs(seed, k, n, sm_count=sm_count)
    return reference_signs(seed, k, n)


def quantize_exl3(
    weight: torch.Tensor,
    H_data: dict,
    quant_args: dict,
    return_weight_q: bool,
    progress_str: str | None = None,
    verbose: bool = False,
    swap_to_device: torch.device | None = None,
    save_reg: str | None = None,
) -> tuple[None, float, dict[str, torch.Tensor]]:
    """Encode ``weight`` (float32, (in_features, out_features)) as exllamav3 1.6.5's uncalibrated quantize_exl3.

    Returns ``(None, proxy_error, {"suh", "svh", "trellis"[, "mcg" | "mul1"]})`` with the tensors on
    ``quant_args["devices"][0]`` (the marker on the CPU, as the reference makes it). ``progress_str``,
    ``verbose`` and ``swap_to_device`` are accepted and change nothing (the reference uses them for display and
    placement only). Raises ``UnsupportedCallError`` for what it cannot reproduce exactly, ``ValueError`` for a
    call exllamav3 would fail too (non-finite or unaligned weight, missing keys).
    """
    if return_weight_q:
        raise _refuse("return_weight_q=True asks for the dequantised weight, which the drop-in does not compute "
                      "(the fork's online encode passes False)")
    if save_reg:
        raise _refuse(f"save_reg={save_reg!r} asks for an image of the regularised weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise _bad(f"weight must be a 2-D (in_features, out_features) tensor, got {shape}")
    k, n = weight.shape
    bits, codebook, seed = _check_quant_args(quant_args)
    draw_device = _check_h_data(H_data, k)
    device = _device(quant_args["devices"][0], "quant_args['devices'][0]")
    if draw_device != device:
        raise _refuse(f"H_data['device'] {draw_device} differs from quant_args['devices'][0] {device}: exllamav3 then "
                      "draws the input and output signs from two generators, which exl3tool does not model")
    _check_buf_size(quant_args, k, n)

    from exl3tool.encode.codebook import CODEBOOK_MARKERS
    from exl3tool.encode.online import encode_linear

    signs = _sign_vectors(seed, k, n, device)
    with _lock(device):
        if device.type == "cuda":
            with torch.cuda.device(device):
                enc = encode_linear(weight, bits=bits, seed=seed, codebook=codebook, sign_vectors=signs, device=device)
        else:
            enc = encode_linear(weight, bits=bits, seed=seed, codebook=codebook, sign_vectors=signs, device=device)
    for name in ("suh", "svh"):
        if not bool(torch.isfinite(getattr(enc, name)).all()):
            raise RuntimeError(f"quantize_exl3 (exl3tool): {name} of the ({k}, {n}) weight is not finite although the "
                               "weight is; this is an exl3tool bug, please report it")
    if not math.isfinite(enc.proxy_error):
        raise RuntimeError(f"quantize_exl3 (exl3tool): proxy error {enc.proxy_error!r} of the ({k}, {n}) weight is not "
                           "finite although the weight is; this is an exl3tool bug, please report it")

    tensors = {"suh": enc.suh, "svh": enc.svh, "trellis": enc.trellis}
    if codebook in CODEBOOK_MARKERS:
        tensors[codebook] = torch.tensor(CODEBOOK_MARKERS[codebook], dtype=torch.int32)
    H_data.update({"L": None, "finalized": True, "diag": None, "q_fallback": True,
                   "su": signs[0].reshape(k, 1).to(device=draw_device, dtype=torch.float32)})
    quant_args.update({"apply_out_scales": True, "g_scale": enc.g_scale, "q_fallback": True, "zeros": enc.zeros,
                       "out_scales_hessian": False})
    return None, enc.proxy_error, tensors
