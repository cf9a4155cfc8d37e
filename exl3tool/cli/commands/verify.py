"""`exl3tool verify`: check every cached layer of a model with the trellis GEMM against FP32 references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from exl3tool.cli.commands.command import Call, NotWith, command
from exl3tool.cli.commands.launching import launch_json
from exl3tool.cli.commands.options import existing_cache_dir, parse_positive_ints
from exl3tool.errors import ConfigError, FindingsError, InputError
from exl3tool.cli.output import Output
from exl3tool.operations.bounds import DEFAULT_KERNEL_ERR

if TYPE_CHECKING:
    from exl3tool.operations.verify import VerifyReport

# The library (and torch through it) is imported inside the command, where the work happens: `--help` stays light.

__all__ = ["register", "verify", "report_markdown"]


def _fmt(v: Optional[float], spec: str = ".2e") -> str:
    return "-" if v is None else format(v, spec)


def _exact_cell(c) -> str:
    return "-" if c.exact is None else c.exact.verdict


def report_markdown(report: VerifyReport) -> str:
    """A Markdown report for CI artifacts and pull requests."""
    lines = [
        f"# exl3tool verify: {report.model}",
        "",
        f"- model identity `{report.model_identity}`, {report.bits} bits, TP {report.tp_size}",
        f"- GEMM: {report.gemm} on {report.device}; activations seed {report.seed}, rows {list(report.rows)}",
        f"- thresholds: kernel error <= {report.max_kernel_err:.1e}, quantization error <= {report.max_quant_err:.3g}",
        f"- exact: {'every entry compared with a fresh encode (identical, equivalent, differs or unproved)' if report.exact else 'not run (--exact)'}",
        f"- result: **{'PASS' if report.ok else 'FAIL'}** ({len(report.layers) - len(report.failed)} pass, {len(report.failed)} fail)",
        "",
        "| layer | rank | shape | kernel err | quant err | proxy err | weight MSE | exact | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report.layers:
        status = "pass" if c.status == "pass" else f"FAIL: {c.reason}"
        lines.append(f"| {c.prefix} | {c.tp_rank} | {c.input_size}x{c.output_size} | {_fmt(c.kernel_err)} | "
                     f"{_fmt(c.quant_err, '.4f')} | {_fmt(c.proxy_error)} | {_fmt(c.weight_mse)} | {_exact_cell(c)} | {status} |")
    return "\n".join(lines) + "\n"


def render(out: Output, report: VerifyReport, extra: Optional[dict] = None) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"verify {report.model} ({report.bits} bits, TP {report.tp_size}, GEMM: {report.gemm})")
    columns = ["layer", "rank", "shape", "rows", "kernel err", "quant err", "proxy err", "weight MSE"]
    columns += ["exact", "status"] if report.exact else ["status"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("layer", "status", "shape", "exact") else "right")
    for c in report.layers:
        status = Text("pass", style="green") if c.status == "pass" else Text.assemble(("FAIL", "red"), f" {c.reason}")
        cells = [c.prefix, str(c.tp_rank), f"{c.input_size}x{c.output_size}", ",".join(str(r.rows) for r in c.rows) or "-",
                 _fmt(c.kernel_err), _fmt(c.quant_err, ".4f"), _fmt(c.proxy_error), _fmt(c.weight_mse)]
        table.add_row(*cells, *([_exact_cell(c)] if report.exact else []), status)
    out.table(table)
    if report.gemm != "triton":
        out.warn(f"GEMM: {report.gemm}")
    for c in report.unproved:
        out.warn(f"{c.prefix} rank {c.tp_rank}: exact check unproved: {c.exact.detail}")
    out.line(f"{len(report.layers) - len(report.failed)} pass, {len(report.failed)} fail; thresholds kernel "
             f"{report.max_kernel_err:.1e}, quantization {report.max_quant_err:.3g}; activations seed {report.seed}")
    out.data({**report.as_json(), **(extra or {})})


def verify(
    call: Call,
    rows: Annotated[str, typer.Option("--rows", metavar="TEXT", help="Comma-separated activation row counts.")] = "1,16,256",
    seed: Annotated[int, typer.Option("--seed", metavar="INTEGER", help="Seed of the activations (printed in the report).")] = 0,
    max_kernel_err: Annotated[float, typer.Option("--max-kernel-err", metavar="FLOAT", help="Largest allowed ||y_gemm - x@W_deq|| / ||x@W_deq||.")] = DEFAULT_KERNEL_ERR,
    max_quant_err: Annotated[Optional[float], typer.Option("--max-quant-err", metavar="FLOAT", help="Largest allowed ||y_gemm - x@W|| / ||x@W|| (default: 1.5x the reference encoder's error for --bits).")] = None,
    exact: Annotated[bool, typer.Option("--exact", help="Also re-encode every layer and compare the entry with it (bytes on the platform that wrote it; tile by tile elsewhere): catches a single flipped bit.")] = False,
    against: Annotated[Optional[str], typer.Option("--against", metavar="SOURCE", help="MODEL is a checkpoint `exl3tool hydrate` wrote from SOURCE: check its stored layers against SOURCE's weights (no cache).")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", metavar="PATH", help="Also write the report to FILE (.json or .md).")] = None,
) -> None:
    """Verify MODEL's cache entries: trellis GEMM vs FP32 references, layer by layer. Reads the cache only.

    With --exact each layer is also re-encoded (as a warm would) and compared with its entry: byte for byte when the
    entry records this platform, tile by tile (each within 1.25x of the fresh tile's error) when another platform or
    the server wrote it; a layer that differs fails. Costs one encode per layer.

    Exit codes: 0 every layer passes, 1 any failure (missing, invalid or wrong entry; error over threshold; with
    --exact an entry that differs from a fresh encode), 2 usage or I/O error.

    Example: exl3tool verify ./my-model --tp-size 2 --rows 1,16,256 --report verify.md
    """
    if report is not None and report.suffix.lower() not in (".json", ".md"):
        raise typer.BadParameter(f"--report must end in .json or .md, got {report}")
    if report is not None and not report.resolve().parent.is_dir():
        raise typer.BadParameter(f"--report {report}: folder {report.resolve().parent} does not exist")
    if not max_kernel_err > 0 or (max_quant_err is not None and not max_quant_err > 0):
        raise typer.BadParameter("--max-kernel-err and --max-quant-err must be positive")
    row_counts = parse_positive_ints(rows, "--rows")
    out = call.out
    request, settings, environ = call.resolve(call.request(mode="readonly"))
    from exl3tool.operations.verify import verify_hydrated, verify_plan
    from exl3tool.plan.request import prepare, resolve_device, serving_torch_dtype

    dev = resolve_device(request.device)
    torch_dtype = serving_torch_dtype(request.dtype)
    if against is not None:  # a hydrated checkpoint: its stored layers against SOURCE's weights, no cache
        if not dev.type == "cuda":
            out.note("no CUDA device: the stored layers go through the reference GEMM path (the Triton kernel is "
                     "not run), as verify does on a CPU")
        result = verify_hydrated(request.model, against, rows=row_counts, seed=seed, device=dev,
                                 max_kernel_err=max_kernel_err, max_quant_err=max_quant_err, dtype=torch_dtype,
                                 on_done=lambda c: out.note(f"{c.status:4s} {c.prefix} {c.reason}"))
    else:
        # verify only reads: a missing cache is an I/O error, not N failed layers
        from exl3tool.operations.release_rules import cache_root

        existing_cache_dir(cache_root(request, environ))  # nor, where the root depends on a release nothing named
        checkpoint, plan, store = prepare(request, environ=environ)
        result = verify_plan(plan, checkpoint, store, rows=row_counts, seed=seed, device=dev,
                             max_kernel_err=max_kernel_err, max_quant_err=max_quant_err, dtype=torch_dtype,
                             on_done=lambda c: out.note(f"{c.status:4s} {c.prefix} rank {c.tp_rank} {c.reason}"),
                             exact=exact)
    render(out, result, launch_json(settings))
    from exl3tool.operations.parity import parity_line

    for item in result.encoder_parity:  # what the warms that wrote these entries could prove of their encoder
        if item["status"] != "identical":
            what, fix = parity_line(item)
            out.warn(f"{what}; {fix}")
    if report is not None:
        try:
            text = report_markdown(result) if report.suffix.lower() == ".md" else json.dumps(result.as_json(), indent=2, sort_keys=True) + "\n"
            report.write_text(text)
        except OSError as exc:
            raise InputError(f"cannot write --report {report}: {exc.strerror}") from exc
    if not result.layers:
        raise ConfigError("nothing to do: no layer to verify (check --layers / --exclude and the TP size)")
    if not result.ok:
        differing = result.differing
        named = f"; differ from a fresh encode: {', '.join(f'{c.prefix} rank {c.tp_rank}' for c in differing)}" if differing else ""
        raise FindingsError(f"{len(result.failed)} of {len(result.layers)} layer checks failed{named}")


def register(app: typer.Typer) -> None:
    # a hydrated checkpoint against its SOURCE: no cache, no plan, no launch (verify_hydrated reads the stored modules
    # the hydrate recorded, at TP 1, with the bits it recorded); --exact compares cache entries only
    hydrated = NotWith("against", groups=("plan", "encoder", "cache", "launch"), names=("revision", "server_path", "exact"),
                       but=("dtype",),
                       fix="drop it (the hydrated checkpoint's stored layers are compared with SOURCE's weights, no "
                       "cache), or verify the cache without --against")
    command(app, "verify", groups=("model", "plan", "encoder", "cache", "launch"), options=("tp_size", "tp_rank", "device"),
            rules=(hydrated,))(verify)
