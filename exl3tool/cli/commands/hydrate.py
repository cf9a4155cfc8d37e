"""`exl3tool hydrate SOURCE OUT`: a new checkpoint whose online-encoded layers are stored as EXL3 (docs/hydrate.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer

from exl3tool.cli.commands.launching import ComposeOpt, LaunchFileOpt, ServiceOpt  # the other launch forms
from exl3tool.cli.commands.launching import EnvFileOpt, LaunchCommand, LaunchOpt, PidOpt, apply_options, launch_json
from exl3tool.cli.commands.options import (
    BitsOpt, DeviceOpt, DtypeOpt, ExcludeOpt, JsonOpt, LayersOpt, QuantizationConfigOpt, QuietOpt, SharedOpt,
    parse_positive_ints, request_from_options,
)
from exl3tool.cli.output import Output, plural

__all__ = ["register", "hydrate_command"]

SourceArg = Annotated[str, typer.Argument(metavar="SOURCE", help="The EXL3 checkpoint folder (read only, never written).")]
OutArg = Annotated[str, typer.Argument(metavar="OUT", help="The new checkpoint folder (must not exist; not inside SOURCE).")]
HydrateTpOpt = Annotated[Optional[str], typer.Option(
    "--tp-size", "-tp", "--tp-sizes", metavar="N[,N...]",
    help="The TP sizes OUT must start at; a layer one of them cannot slice stays BF16 and is listed. Default: the "
         "launch's, else every size up to 8 vLLM can split the model into.")]


def _ks(plan) -> str:
    """"K6", or "K6 (4 modules at K5)" with --bits-for rules."""
    other: dict[int, int] = {}
    for m in plan.modules:
        if m.bits != plan.bits:
            other[m.bits] = other.get(m.bits, 0) + 1
    return f"K{plan.bits}" + (" (" + ", ".join(f"{plural(n, 'module')} at K{k}" for k, n in sorted(other.items()))
                              + ")" if other else "")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def hydrate_command(
    ctx: typer.Context,
    model: SourceArg,
    out_dir: OutArg,
    tp_sizes: HydrateTpOpt = None,
    bits: BitsOpt = None,
    bits_for: Annotated[list[str], typer.Option(
        "--bits-for", metavar="GLOB=K",
        help="Store the modules GLOB matches (checkpoint module or vLLM layer name) at K bits instead of --bits; "
             "repeatable, the last matching rule wins, e.g. --bits 6 --bits-for '*.mlp.down_proj=5'.")] = [],
    layers: LayersOpt = [],
    exclude: ExcludeOpt = [],
    shared_experts: SharedOpt = False,
    quantization_config: QuantizationConfigOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    leave_unaligned: Annotated[bool, typer.Option(
        "--leave-unaligned", help="No effect, kept for earlier scripts: a layer a TP size cannot slice is always "
        "kept BF16 and listed.")] = False,
    launch: LaunchOpt = None,
    pid: PidOpt = None,
    env_file: EnvFileOpt = [],
    launch_file: LaunchFileOpt = None,
    compose: ComposeOpt = None,
    service: ServiceOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (layers, shapes, sizes) and write nothing.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write OUT: SOURCE with every layer the server would encode online stored as EXL3 (no cache needed).

    The layers are `cache warm`'s plan at TP 1 (bits, overlay and dtype as the server's; a launch gives them). OUT
    must start at every TP size SOURCE starts at: by default each size up to 8 vLLM can split the model into (with
    a launch: its TP size); a layer one of them could not slice stays BF16, as in SOURCE, and is listed with the
    size. The sizes checked are recorded in OUT, where `identity` and `cache check` read them. Changed shards are
    rewritten (kept tensors byte for byte), the rest hard-linked or copied, the index and tensor_storage
    rewritten; OUT appears only when complete.
    A killed run resumes from the temporary folder beside OUT. A checkpoint already hydrated is a no-op. Under
    `torchrun --nproc-per-node N -m exl3tool hydrate ...` each process encodes a share on its GPU.

    Exit codes: 0 written (or nothing to do: already stored), 2 usage, configuration or I/O error, 130 interrupted.

    Example: exl3tool hydrate /models/Qwen3.8-27B-exl3 /models/Qwen3.8-27B-exl3-hydrated --bits 6 --tp-size 1,2
    --quantization-config "$OVERLAY"
    """
    from exl3tool.operations.hydrate import hydrate, plan_hydrate

    out = Output(json=json_out, quiet=quiet)
    request, given = request_from_options(ctx, skip=("tp_sizes",))
    if tp_sizes is not None:  # narrows the default on purpose; with a launch, adds to its TP size
        request, given = replace(request, tp_sizes=parse_positive_ints(tp_sizes, "--tp-size")), {*given, "tp_sizes"}
    else:
        request = replace(request, tp_sizes=())  # every size vLLM can split the model into (a launch: its own)
    request, settings, environ = apply_options(ctx, out, request, launch, pid, env_file, given, add_tp_sizes=True,
                                               need_cache=False)
    extra = launch_json(settings)
    plan = plan_hydrate(request, out_dir, environ=environ, bits_for=bits_for)
    for prefix, why in plan.left_bf16:
        out.warn(f"left BF16 (as in SOURCE): {prefix}: {why}")
    for tp, why in sorted(plan.fails_at.items()):
        out.note(f"not for TP {tp} (not asked for): {why}")
    if plan.already_stored:
        out.line(f"nothing to do: {plan.source} is hydrated already ({plan.already_stored}); nothing written")
        report = None if dry_run else hydrate(plan)
        out.data({**(plan.as_json() if report is None else report.as_json()), **extra})
        return
    mods = plan.modules
    if dry_run:
        for layer in plan.layers:
            for m in layer.modules:
                s = m.source
                k = f"  K{m.bits}" if m.bits != plan.bits else ""
                out.line(f"{m.module}  [{s.in_features} x {s.out_features}]{k}  {_mib(m.weight_bytes)} -> "
                         f"{_mib(m.exl3_bytes)}  ({layer.prefix}, {layer.parallel})")
    sizes = ",".join(map(str, plan.tp_sizes)) + (" (every size vLLM can split it into)" if plan.tp_default else "")
    head = (f"{plural(len(mods), 'module')} of {plural(len(plan.layers), 'layer')} to store as EXL3 {_ks(plan)} "
            f"for TP {sizes}; {plural(len(plan.changed_shards), 'shard')} rewritten, "
            f"{plural(len(plan.unchanged_files), 'file')} linked; {_mib(plan.bytes_before)} -> {_mib(plan.bytes_after)}")
    narrowed = sorted({tp for at in plan.left_tp.values() for tp in at})
    if narrowed:
        head += (f"; {plural(sum(1 for at in plan.left_tp.values() if at), 'layer')} left BF16 because TP "
                 f"{','.join(map(str, narrowed))} cannot slice them (a --tp-size without that size stores them)")
    if dry_run:
        out.line(head + " (dry run: nothing written)")
        out.data({**plan.as_json(), **extra})
        return

    def on_layer(done: int, total: int, module: str, seconds: float, reused: bool) -> None:
        if not quiet:
            what = "kept from an interrupted run" if reused else f"encoded in {seconds:.1f} s"
            print(f"[{done}/{total}] {module}: {what}", file=sys.stderr, flush=True)

    try:
        report = hydrate(plan, device=request.device, on_layer=on_layer)
    except (KeyboardInterrupt, OSError):
        from exl3tool.operations.hydrate import temp_dir

        if temp_dir(plan.out).exists():
            out.warn(f"stopped: the modules encoded so far are kept in {temp_dir(plan.out)}; OUT was not written; "
                     "run the same command again to resume (or remove that folder)")
        raise
    if report is None:  # a torchrun worker other than 0: worker 0 writes OUT and reports
        return
    out.line(f"wrote {plan.out}: {plural(len(mods), 'module')} stored as EXL3 {_ks(plan)} ({report.encoded} encoded, "
             f"{report.reused} kept from an interrupted run), {_mib(plan.bytes_before)} -> {_mib(report.bytes_after)}, "
             f"{report.seconds:.1f} s; hydrated for TP {','.join(map(str, plan.tp_sizes))}")
    out.data({**report.as_json(), **extra})


def register(app: typer.Typer) -> None:
    """Add the ``hydrate`` command."""
    app.command("hydrate", cls=LaunchCommand)(hydrate_command)
