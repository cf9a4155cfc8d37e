"""Prove a cache holds the right weights: run the trellis GEMM on every cached layer against FP32 references.

For each planned (layer, rank) the entry is found exactly as the server would (read-only), the same
rank-local FP32 weight the encoder saw is loaded from the checkpoint, and for each row count m a
fixed-seed activation x gives three products:

* ``y_gemm``: the trellis GEMM (Triton on CUDA; on the CPU the plain-PyTorch reference path),
* ``y_deq``:  x @ dequantize(entry) in float64  ->  kernel error ||y_gemm - y_deq|| / ||y_deq||,
* ``y_ref``:  x @ W_fp32 (the original weight)  ->  quantization error ||y_gemm - y_ref|| / ||y_ref||.

Default thresholds: the kernel error at fp16-accumulation level (2e-3), and the quantization error at
1.5x the relative RMS error the reference encoder reaches on the golden tiles for that bit width
(K=6: 0.0177, so 0.0266), see ``QUANT_ERR_GOLDEN`` (in ``operations.bounds``, re-exported here).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from exl3tool.cache import CacheStore
from exl3tool.checkpoint import encoder_input, rank_local_weight
from exl3tool.encode import dequantize_tensors
from exl3tool.errors import describe
from exl3tool.operations.bounds import DEFAULT_KERNEL_ERR, QUANT_ERR_GOLDEN, default_quant_err
from exl3tool.jsontext import to_jsonable
from exl3tool.operations.exact import ExactCheck, compare_exact, fresh_encode

__all__ = [
    "QUANT_ERR_GOLDEN", "DEFAULT_KERNEL_ERR", "default_quant_err", "LayerCheck", "VerifyReport",
    "verify_plan", "verify_entry", "verify_hydrated",
]

@dataclass(frozen=True)
class RowCheck:
    """The three errors for one activation batch of ``rows`` rows."""

    rows: int
    kernel_err: float
    quant_err: float


@dataclass(frozen=True)
class LayerCheck:
    """Everything verify learned about one (layer, rank)."""

    prefix: str
    tp_size: int
    tp_rank: int
    input_size: int
    output_size: int
    status: str  # "pass" | "fail"
    reason: str = ""
    path: Optional[str] = None
    rows: tuple[RowCheck, ...] = ()
    proxy_error: Optional[float] = None  # as stored in the entry
    weight_rel_err: Optional[float] = None  # fresh ||W_deq - W|| / ||W||
    weight_mse: Optional[float] = None  # fresh mean((W_deq - W)^2)
    seconds: float = 0.0
    exact: Optional[ExactCheck] = None  # with --exact: the entry against a fresh encode (exl3tool.operations.exact)

    @property
    def kernel_err(self) -> Optional[float]:
        return max((r.kernel_err for r in self.rows), default=None)

    @property
    def quant_err(self) -> Optional[float]:
        return max((r.quant_err for r in self.rows), default=None)


@dataclass(frozen=True)
class VerifyReport:
    """The verify outcome: per-layer checks, thresholds, what ran where."""

    model: str
    model_identity: str
    bits: int
    tp_size: int
    device: str
    gemm: str  # "triton" or "reference (GPU kernel not run: ...)"
    seed: int
    rows: tuple[int, ...]
    max_kernel_err: float
    max_quant_err: float
    layers: tuple[LayerCheck, ...] = field(default_factory=tuple)
    exact: bool = False  # every entry was also compared with a fresh encode
    # the provenance records' encoder parity verdicts of the entries checked (operations.parity.recorded_parity)
    encoder_parity: tuple[dict, ...] = field(default_factory=tuple)

    @property
    def unproved(self) -> list[LayerCheck]:
        """Layers the exact check could not decide (another platform's global scale; see ``exl3tool.operations.exact``)."""
        return [c for c in self.layers if c.exact is not None and c.exact.verdict == "unproved"]

    @property
    def failed(self) -> list[LayerCheck]:
        return [c for c in self.layers if c.status != "pass"]

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.layers)

    @property
    def differing(self) -> list[LayerCheck]:
        """Layers whose entry differs from a fresh encode (``--exact``)."""
        return [c for c in self.layers if c.exact is not None and c.exact.verdict == "differs"]

    def as_json(self) -> dict[str, Any]:
        """The `verify --json` document, also what ``--report FILE.json`` holds (stable keys, docs/cache.md)."""
        data = to_jsonable(self)
        data["ok"] = self.ok
        data["counts"] = {"pass": sum(c.status == "pass" for c in self.layers), "fail": len(self.failed)}
        for entry, check in zip(data["layers"], self.layers):
            entry["kernel_err"] = check.kernel_err
            entry["quant_err"] = check.quant_err
        if self.exact:
            verdicts = [c.exact.verdict for c in self.layers if c.exact is not None]
            data["counts"]["exact"] = {v: verdicts.count(v) for v in ("identical", "equivalent", "differs", "unproved")}
            data["differs"] = [{"prefix": c.prefix, "tp_rank": c.tp_rank, "path": c.path, "detail": c.exact.detail}
                               for c in self.differing]
        return data


GemmFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def pick_gemm(device: torch.device) -> tuple[GemmFn, str]:
    """The Triton GEMM on CUDA when it imports; otherwise the reference path, saying why."""
    from exl3tool.kernels.gemm import trellis_matmul_reference

    def reference(x, trellis, suh, svh, bits):
        return trellis_matmul_reference(x, trellis, suh, svh, bits=bits, codebook="mcg")

    if device.type != "cuda":
        return reference, "reference (GPU kernel not run: no CUDA device selected)"
    try:
        from exl3tool.kernels.gemm import trellis_matmul
    except Exception as exc:  # Triton missing or broken: say so, run the reference
        return reference, f"reference (GPU kernel not run: Triton GEMM unavailable: {exc})"

    def triton(x, trellis, suh, svh, bits):
        return trellis_matmul(x, trellis, suh, svh, bits=bits, codebook="mcg")

    return triton, "triton"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else float(a.norm().item() > 0) * math.inf


def verify_entry(
    tensors: dict[str, torch.Tensor], weight: torch.Tensor, *, bits: int, rows: tuple[int, ...], seed: int,
    device: torch.device, gemm: GemmFn,
) -> tuple[tuple[RowCheck, ...], float, float]:
    """Row checks plus the fresh weight-space relative error and MSE of one entry against ``weight`` (K_r, N_r)."""
    trellis, suh, svh = tensors["trellis"], tensors["suh"], tensors["svh"]
    w_deq = dequantize_tensors(trellis, suh, svh, bits, "mcg", dtype=torch.float64)  # (K_r, N_r)
    w = weight.to(torch.float64)
    checks = []
    gen = torch.Generator().manual_seed(seed)
    dev_t, dev_suh, dev_svh = trellis.to(device), suh.to(device), svh.to(device)
    for m in rows:
        x16 = torch.randn(m, w.shape[0], generator=gen).to(torch.float16)  # fp16 activations, as served
        y_gemm = gemm(x16.to(device), dev_t, dev_suh, dev_svh, bits).to("cpu", torch.float64)
        x64 = x16.to(torch.float64)
        checks.append(RowCheck(m, _rel(y_gemm, x64 @ w_deq), _rel(y_gemm, x64 @ w)))
    diff = w_deq - w
    return tuple(checks), _rel(w_deq, w), float((diff * diff).mean())


def verify_plan(
    plan, checkpoint, store: CacheStore, *, rows: tuple[int, ...] = (1, 16, 256), seed: int = 0,
    device: torch.device = torch.device("cpu"), max_kernel_err: float = DEFAULT_KERNEL_ERR,
    max_quant_err: Optional[float] = None, dtype: Optional[torch.dtype] = None,
    on_done: Optional[Callable[[LayerCheck], None]] = None, exact: bool = False,
) -> VerifyReport:
    """Check every non-skipped job of a warm plan (one TP size) against its cache entry. Never writes.

    ``exact`` also re-encodes each layer from the same weight (same key, so the same seed and bits) on ``device``
    and compares the entry with it (``exl3tool.operations.exact.compare_exact``): a layer whose entry ``differs`` fails even
    when its errors are within the thresholds (e.g. one flipped trellis bit).

    Args:
        plan, checkpoint, store: ``exl3tool.plan.prepare``'s result for one TP size.
        rows: the batch sizes the trellis GEMM is checked at.
        seed: seed of the random inputs.
        device: where the GEMMs (and ``exact``'s re-encodes) run.
        max_kernel_err, max_quant_err: the thresholds (kernel vs reference; encoded vs original weight).
        dtype: the serving dtype the weights are cast to (None: the checkpoint's).
        on_done: hears of each layer's ``LayerCheck``.
        exact: also re-encode each layer and compare its bytes with the entry.

    Returns:
        A ``VerifyReport``: one ``LayerCheck`` per job, with the failures and the figures.
    """
    gemm, gemm_name = pick_gemm(device)
    quant_limit = default_quant_err(plan.bits) if max_quant_err is None else max_quant_err
    checks: list[LayerCheck] = []
    tp = plan.tp_sizes[0] if plan.tp_sizes else 1
    for job in plan.jobs:
        if job.state == "skipped":
            continue
        start = time.perf_counter()
        base = dict(prefix=job.prefix, tp_size=job.tp_size, tp_rank=job.tp_rank, input_size=job.input_size,
                    output_size=job.output_size)
        found = store.lookup(job.key)
        if found.status != "hit":
            reason = "no cache entry (run `exl3tool cache warm` first)" if found.status == "miss" else f"invalid entry: {found.reason}"
            check = LayerCheck(**base, status="fail", reason=reason, path=str(job.path), seconds=time.perf_counter() - start)
        else:
            try:
                weight = encoder_input(rank_local_weight(checkpoint, job.rank_job, dtype=dtype))
                row_checks, rel, mse = verify_entry(found.tensors, weight, bits=plan.bits, rows=rows, seed=seed,
                                                    device=device, gemm=gemm)
                exact_check = None
                if exact:
                    fresh, w_r = fresh_encode(weight, job.key, device)
                    exact_check = compare_exact(found.tensors, found.proxy_error, found.metadata or {}, fresh, w_r)
            except Exception as exc:
                check = LayerCheck(**base, status="fail", reason=describe(exc), path=str(job.path),
                                   seconds=time.perf_counter() - start)
            else:
                problems = []
                k_err = max(r.kernel_err for r in row_checks)
                q_err = max(r.quant_err for r in row_checks)
                if not k_err <= max_kernel_err:
                    problems.append(f"kernel error {k_err:.2e} > {max_kernel_err:.1e}")
                if not q_err <= quant_limit:
                    problems.append(f"quantization error {q_err:.3g} > {quant_limit:.3g}"
                                    " (entry does not match this checkpoint's weights or slice)")
                if exact_check is not None and not exact_check.ok:
                    problems.append(f"differs from a fresh encode: {exact_check.detail}")
                check = LayerCheck(**base, status="fail" if problems else "pass", reason="; ".join(problems),
                                   path=str(found.path), rows=row_checks, proxy_error=found.proxy_error,
                                   weight_rel_err=rel, weight_mse=mse, seconds=time.perf_counter() - start,
                                   exact=exact_check)
        checks.append(check)
        if on_done:
            on_done(check)
    from exl3tool.cache.records import read_records
    from exl3tool.operations.parity import recorded_parity

    parity = recorded_parity(read_records(plan.cache_root), plan.model_identity, plan.encoder_identity,
                             [j.digest for j in plan.jobs if j.state == "hit"])
    return VerifyReport(model=plan.model, model_identity=plan.model_identity, bits=plan.bits, tp_size=tp,
                        device=str(device), gemm=gemm_name, seed=seed, rows=tuple(rows), max_kernel_err=max_kernel_err,
                        max_quant_err=quant_limit, layers=tuple(checks), exact=exact, encoder_parity=tuple(parity))


def verify_hydrated(
    out: str, source: str, *, rows: tuple[int, ...] = (1, 16, 256), seed: int = 0,
    device: torch.device = torch.device("cpu"), max_kernel_err: float = DEFAULT_KERNEL_ERR,
    max_quant_err: Optional[float] = None, dtype: Optional[torch.dtype] = None,
    on_done: Optional[Callable[[LayerCheck], None]] = None,
) -> VerifyReport:
    """`verify OUT --against SOURCE`: every module `exl3tool hydrate` stored in ``out`` (its ``exl3tool_hydrate``
    note), through the trellis GEMM (Triton on CUDA, the reference path elsewhere) against the FP32 weight that
    ``source`` holds for it, with ``verify_plan``'s checks and thresholds. Never writes.
    """
    from pathlib import Path

    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.checkpoint.routing import read_json
    from exl3tool.errors import ConfigError

    hydrated, original = open_checkpoint(out), open_checkpoint(source)
    qc = read_json(Path(hydrated.root) / "quantization_config.json") or {}
    note = qc.get("exl3tool_hydrate") or (hydrated.config.get("quantization_config") or {}).get("exl3tool_hydrate")
    if not isinstance(note, dict) or not isinstance(note.get("modules"), dict) or not note["modules"]:
        raise ConfigError(f"{out}: not written by `exl3tool hydrate` (no exl3tool_hydrate note beside tensor_storage); "
                          "verify a cache with `exl3tool verify MODEL` instead")
    bits = int(note.get("bits", 6))
    gemm, gemm_name = pick_gemm(device)
    quant_limit = default_quant_err(bits) if max_quant_err is None else max_quant_err
    checks: list[LayerCheck] = []
    for module, source_weight in note["modules"].items():  # EXL3 tensor prefix -> SOURCE's weight it replaced
        start = time.perf_counter()
        try:
            tensors = {s: hydrated.get_tensor(f"{module}.{s}") for s in ("trellis", "suh", "svh")}
            k, n = tensors["suh"].shape[0], tensors["svh"].shape[0]
            base = dict(prefix=module, tp_size=1, tp_rank=0, input_size=k, output_size=n)
            weight = encoder_input(original.read(source_weight).to(dtype or original.dtype))
            k_bits = tensors["trellis"].shape[-1] // 16  # each module's own K (hydrate --bits-for)
            row_checks, rel, mse = verify_entry(tensors, weight, bits=k_bits, rows=rows, seed=seed, device=device,
                                                gemm=gemm)
        except Exception as exc:
            check = LayerCheck(prefix=module, tp_size=1, tp_rank=0, input_size=0, output_size=0, status="fail",
                               reason=describe(exc), seconds=time.perf_counter() - start)
        else:
            problems = []
            k_err, q_err = max(r.kernel_err for r in row_checks), max(r.quant_err for r in row_checks)
            if not k_err <= max_kernel_err:
                problems.append(f"kernel error {k_err:.2e} > {max_kernel_err:.1e}")
            limit = quant_limit if max_quant_err is not None or k_bits == bits else default_quant_err(k_bits)
            if not q_err <= limit:
                problems.append(f"quantization error {q_err:.3g} > {limit:.3g} (the stored layer is not SOURCE's)")
            check = LayerCheck(**base, status="fail" if problems else "pass", reason="; ".join(problems),
                               path=str(hydrated.info(f"{module}.trellis").file), rows=row_checks, weight_rel_err=rel,
                               weight_mse=mse, seconds=time.perf_counter() - start)
        checks.append(check)
        if on_done:
            on_done(check)
    return VerifyReport(model=str(out), model_identity="", bits=bits, tp_size=1, device=str(device), gemm=gemm_name,
                        seed=seed, rows=tuple(rows), max_kernel_err=max_kernel_err, max_quant_err=quant_limit,
                        layers=tuple(checks))
