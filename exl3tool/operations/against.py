"""Entries checked against a checkpoint: ``cache import --against MODEL [--exact]``.

A bundle's own checks (manifest hashes, the server's checks, our checksums) prove that an entry is well formed and
unchanged since it was written, not that its weights are MODEL's: whoever wrote the bundle chose them. Against the
checkpoint, an entry must

* have a key of MODEL's plan: the model and encoder identities, bits, a planned layer at a TP size and rank with
  its rank-local sizes, exactly as a warm with the same options would build it;
* decode to MODEL's rank-local weight within the verify bound (relative Frobenius error at most
  ``verify.default_quant_err(bits)``, 0.0266 at K=6; an honest encode gives about 0.018), or, with ``exact``,
  compare with a fresh encode of the same key as ``verify --exact`` does (``identical`` or ``equivalent``;
  ``differs`` and ``unproved`` are refused).
"""

from __future__ import annotations

from typing import Optional

import torch

from exl3tool.cache.entry import EntryContents
from exl3tool.cache.key import CacheKey
from exl3tool.checkpoint import Checkpoint, LayerPlan, RankJob, encoder_input, rank_local_weight
from exl3tool.encode import dequantize_tensors
from exl3tool.operations.exact import compare_exact, fresh_encode
from exl3tool.operations.verify import default_quant_err

__all__ = ["AgainstModel"]


class AgainstModel:
    """``check(key, contents)`` for ``import_bundle``: raises ValueError naming why an entry is not MODEL's.

    Keys are matched against the plan of every TP size an entry names (built once per TP size, on demand).
    """

    def __init__(
        self, checkpoint: Checkpoint, layer_plan: LayerPlan, *, model_identity: str, encoder_identity: str, bits: int,
        device: torch.device = torch.device("cpu"), dtype: Optional[torch.dtype] = None, exact: bool = False,
    ) -> None:
        self.checkpoint, self.layer_plan = checkpoint, layer_plan
        self.model_identity, self.encoder_identity, self.bits = model_identity, encoder_identity, bits
        self.device, self.dtype, self.exact = device, dtype, exact
        self._planned: dict[int, dict[str, RankJob]] = {}

    @classmethod
    def from_request(cls, request, *, exact: bool = False, environ: Optional[dict] = None) -> "AgainstModel":
        """The check for a warm's options (``ServerRequest``: model, revision, overlay, layers, identities, bits,
        dtype, device): the same checkpoint, identities and layer plan that warm would use, in the server's
        environment ``environ`` (a launch's; None: this process's). Reads no cache."""
        from dataclasses import replace

        from exl3tool.plan.request import prepare, resolve_device, serving_torch_dtype

        checkpoint, plan, _ = prepare(replace(request, tp_sizes=(), mode="readonly"), environ=environ,
                                      check_hits=False)
        return cls(checkpoint, plan.layer_plan, model_identity=plan.model_identity,
                   encoder_identity=plan.encoder_identity, bits=plan.bits, device=resolve_device(request.device),
                   dtype=serving_torch_dtype(request.dtype), exact=exact)

    def _jobs(self, tp_size: int) -> dict[str, RankJob]:
        if tp_size not in self._planned:
            jobs = {}
            try:
                planned = self.layer_plan.for_tp(tp_size)
            except Exception as exc:  # a TP size the server refuses for this checkpoint
                raise ValueError(f"not in MODEL's plan: TP {tp_size}: {exc}") from None
            for rj in planned:
                key = CacheKey.for_layer(
                    model_identity=self.model_identity, encoder_identity=self.encoder_identity, prefix=rj.prefix,
                    bits=self.bits, tp_world_size=tp_size, tp_rank=rj.tp_rank, input_size=rj.input_size,
                    output_size=rj.output_size)
                jobs[key.digest()] = rj
            self._planned[tp_size] = jobs
        return self._planned[tp_size]

    def _not_planned(self, key: CacheKey) -> str:
        if key.model_identity != self.model_identity:
            return f"another model identity ({key.model_identity[:16]}..., MODEL's is {self.model_identity[:16]}...)"
        if key.encoder_identity != self.encoder_identity:
            return (f"another encoder identity ({key.encoder_identity[:16]}..., this one's is "
                    f"{self.encoder_identity[:16]}...; check --encoder-root/--encoder-revision)")
        if key.bits != self.bits:
            return f"{key.bits} bits, the plan's are {self.bits} (--bits)"
        return (f"no planned layer {key.prefix} at TP {key.tp_world_size} rank {key.tp_rank} with sizes "
                f"{key.input_size}x{key.output_size} (check --quantization-config, --layers and --exclude)")

    def __call__(self, key: CacheKey, contents: EntryContents) -> None:
        rj = self._jobs(key.tp_world_size).get(key.digest())
        if rj is None:
            raise ValueError(f"not in MODEL's plan: {self._not_planned(key)}")
        weight = encoder_input(rank_local_weight(self.checkpoint, rj, dtype=self.dtype))  # (K_r, N_r) f32
        t = contents.tensors
        if self.exact:
            fresh, w_r = fresh_encode(weight, key, self.device)
            check = compare_exact(t, contents.proxy_error, contents.metadata, fresh, w_r)
            if check.verdict in ("differs", "unproved"):
                raise ValueError(f"not MODEL's weights exactly ({check.verdict}): {check.detail}")
            return
        w_deq = dequantize_tensors(t["trellis"], t["suh"], t["svh"], key.bits, key.codebook, dtype=torch.float64)
        w = weight.to(torch.float64)
        norm = float(w.norm())
        rel = float((w_deq - w).norm()) / norm if norm > 0 else float(w_deq.norm() > 0) * float("inf")
        limit = default_quant_err(key.bits)
        if not rel <= limit:
            raise ValueError(f"not MODEL's weights: decodes {rel:.3g} away from {key.prefix} rank {key.tp_rank} "
                             f"(relative error; the verify bound is {limit:.3g})")
