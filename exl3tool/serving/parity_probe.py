"""One probe encode with an encoder source directory, loaded and called as the vLLM fork's server does.

This file is self-contained (the standard library and torch only): exl3tool runs it as a script in a subprocess
for a local encoder copy, and inside the server's image (``docker|podman run ... python -c SOURCE``), where
exl3tool is not installed. It reads one JSON request on stdin and prints one line, ``EXL3TOOL-PARITY {json}``:
the SHA-256 of each tensor the server keeps (``trellis``, ``suh``, ``svh``) or the error that stopped it.

How the server loads and calls its encoder (the fork's ``_load_exl3_online_quantizer`` and online linear method,
vllm/model_executor/layers/quantization/exl3.py; docs/images.md cites the commit): the root is resolved, it must
hold ``modules/quant/exl3_lib/quantize.py``, empty modules with a ``__path__`` stand for the packages above the
file (so no ``__init__.py`` runs), and ``quantize_exl3`` is called with the layer weight transposed to float32
(k, n), a Hessian on the meta device, and ``quant_args`` ``K``, ``seed``, ``devices``, ``apply_out_scales`` True
and ``mcg`` True. The same functions run exl3tool's own encoder in-process (``probe``), so both sides of a parity
comparison are made by one convention.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import sys
import types
from pathlib import Path

MARK = "EXL3TOOL-PARITY "
PACKAGE = "_exl3tool_parity_encoder"
KEPT = ("trellis", "suh", "svh")  # what the server stores of an encode


def load_quantize_exl3(root: str, package: str = PACKAGE):
    """``quantize_exl3`` of the encoder source ``root``, imported as the fork imports it."""
    base = Path(root).resolve()
    lib = base / "modules" / "quant" / "exl3_lib"
    if not (lib / "quantize.py").is_file():
        raise RuntimeError(f"{base} holds no modules/quant/exl3_lib/quantize.py (not an encoder source)")
    for name, folder in ((package, base), (f"{package}.modules", base / "modules"),
                         (f"{package}.modules.quant", base / "modules" / "quant"),
                         (f"{package}.modules.quant.exl3_lib", lib)):
        stub = types.ModuleType(name)
        stub.__path__ = [str(folder)]
        stub.__package__ = name
        sys.modules[name] = stub
    module = importlib.import_module(f"{package}.modules.quant.exl3_lib.quantize")
    if not hasattr(module, "quantize_exl3"):
        raise RuntimeError(f"{lib / 'quantize.py'} has no quantize_exl3")
    return module.quantize_exl3


def _sha256(t) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def call_like_server(quantize_exl3, weight, bits: int, seed: int, device: str) -> dict:
    """One encode of ``weight`` (a torch Linear weight, (n, k) bfloat16) as the server makes it: the digests of
    the kept tensors, their dtypes and shapes, and the proxy error."""
    import torch

    dev = torch.device(device)
    source = weight.detach().t().float().contiguous().to(dev)
    k = source.shape[0]
    h_data = {"H": torch.zeros(k, k, dtype=torch.float32, device="meta"), "first_key": "vllm-online", "count": 0,
              "finalized": False, "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=dev),
              "device": dev}
    quant_args = {"K": bits, "seed": seed, "devices": [dev], "apply_out_scales": True, "mcg": True}
    _, proxy_error, tensors = quantize_exl3(source, h_data, quant_args, return_weight_q=False, verbose=False)
    missing = [n for n in KEPT if n not in tensors]
    if missing:
        raise RuntimeError(f"quantize_exl3 returned no {', '.join(missing)}")
    return {"tensors": {n: {"dtype": str(tensors[n].dtype).removeprefix("torch."), "shape": list(tensors[n].shape),
                            "sha256": _sha256(tensors[n])} for n in KEPT},
            "proxy_error": float(proxy_error)}


def device_name(device: str) -> str:
    """The device as a comparison needs it: ``cpu``, or ``cuda (GPU model)``."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return dev.type


def weight_from(request: dict):
    import torch

    n, k = request["shape"]
    raw = bytearray(base64.b64decode(request["weight"]))
    return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(n, k).clone()


def run(request: dict) -> dict:
    """The child's work: load the encoder at ``request["root"]`` and encode the probe weight with it."""
    try:
        quantize_exl3 = load_quantize_exl3(request["root"])
        import torch

        device = request.get("device") or "auto"
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        out = call_like_server(quantize_exl3, weight_from(request), int(request["bits"]), int(request["seed"]),
                               device)
        return {"ok": True, "device": device_name(device), **out}
    except BaseException as exc:  # a line for the report, whatever the foreign encoder raised
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return {"ok": False, "error": f"{type(exc).__name__}: {first}"}


def main() -> None:
    request = json.loads(sys.stdin.read())
    if len(sys.argv) > 1:
        request["root"] = sys.argv[1]
    result = run(request)
    sys.stdout.write("\n" + MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
