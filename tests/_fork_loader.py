"""Load an encoder source directory the way the vLLM fork's ``_load_exl3_online_quantizer`` does.

Written from reading the fork (vllm/model_executor/layers/quantization/exl3.py): the root is resolved, it must
hold ``modules/quant/exl3_lib/quantize.py``, four empty modules with a ``__path__`` stand in for the packages
(``_vllm_exl3_encoder``, ``.modules``, ``.modules.quant``, ``.modules.quant.exl3_lib``) so no ``__init__.py`` runs,
and ``...exl3_lib.quantize`` is imported by name; it must have ``quantize_exl3``. Also the fork's call: the
weight's transpose as float32, a meta-device H, and the quant_args of its online path.
"""

from __future__ import annotations

import importlib
import sys
import types
import zlib
from pathlib import Path

import torch

PACKAGE = "_vllm_exl3_encoder"


def load_quantize_exl3(root: str | Path, package: str = PACKAGE):
    """The ``quantize_exl3`` the fork would call for ``VLLM_EXL3_ENCODER_SOURCE=root`` (``package``: its name)."""
    base = Path(root).resolve()
    lib = base / "modules" / "quant" / "exl3_lib"
    if not (lib / "quantize.py").is_file():
        raise RuntimeError(f"not an encoder source: {base}")
    folders = {package: base, f"{package}.modules": base / "modules",
               f"{package}.modules.quant": base / "modules" / "quant", f"{package}.modules.quant.exl3_lib": lib}
    for name, folder in folders.items():
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [str(folder)]
            stub.__package__ = name
            sys.modules[name] = stub
    module = importlib.import_module(f"{package}.modules.quant.exl3_lib.quantize")
    if not hasattr(module, "quantize_exl3"):
        raise RuntimeError("no quantize_exl3")
    return module.quantize_exl3


def unload(package: str = PACKAGE) -> None:
    """Forget the synthetic packages (the fork keeps them for the process; tests load several roots)."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


def fork_seed(prefix: str) -> int:
    return zlib.crc32(prefix.encode("utf-8")) & 0x7FFFFFFF


def fork_call(quantize_exl3, layer_weight: torch.Tensor, bits: int, seed: int, device: torch.device | str,
              codebook: str = "mcg") -> tuple[dict[str, torch.Tensor], float, dict, dict]:
    """One online encode as the fork makes it: (tensors it keeps, proxy error, quant_args, H_data) after the call.

    ``layer_weight`` is a torch Linear weight (out_features, in_features); the fork checks ``q_fallback`` after.
    """
    device = torch.device(device)
    source = layer_weight.detach().t().float().contiguous()
    k = source.shape[0]
    h_data = {"H": torch.zeros(k, k, dtype=torch.float32, device="meta"), "first_key": "vllm-online", "count": 0,
              "finalized": False, "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
              "device": device}
    quant_args = {"K": bits, "seed": seed, "devices": [device], "apply_out_scales": True, codebook: True}
    _, proxy_error, tensors = quantize_exl3(source, h_data, quant_args, return_weight_q=False, verbose=False)
    if not quant_args.get("q_fallback", False):
        raise RuntimeError("online EXL3 Trellis unexpectedly used calibrated LDLQ")
    return {name: tensors[name] for name in ("trellis", "suh", "svh")}, float(proxy_error), quant_args, h_data
