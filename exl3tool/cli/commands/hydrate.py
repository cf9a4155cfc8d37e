"""`exl3tool hydrate SOURCE OUT`: a new checkpoint whose online-encoded layers are stored as EXL3 (docs/hydrate.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from exl3tool.cli.commands.command import Call, command
from exl3tool.cli.commands.launching import launch_json
from exl3tool.cli.output import plural

__all__ = ["register", "hydrate_command"]


def _ks(plan) -> str:
    """"K6", or "K6 (4 modules at K5)" with --bits-for rules."""
    other: dict[int, int] = {}
    for k in plan.bits_by_module().values():
        other[k] = other.get(k, 0) + 1
    return f"K{plan.bits}" + (" (" + ", ".join(f"{plural(n, 'module')} at K{k}" for k, n in sorted(other.items()))
                              + ")" if other else "")


def _interrupted(plan) -> tuple[dict, str]:
    """What a Ctrl-C left (``stopped_state``: the fields of the --json error document) and the error line that says
    it: where the kept results are and that the same command resumes (not the cache commands' line about entries)."""
    from exl3tool.operations.hydrate import stopped_state

    state = stopped_state(plan)
    if state["out_written"]:
        return state, f"interrupted once {plan.out} was written whole; there is nothing to resume"
    if state["kept"]:
        return state, (f"interrupted: OUT was not written; the {plural(state['kept'], 'module')} encoded so far "
                       f"{'is' if state['kept'] == 1 else 'are'} kept in {state['kept_in']}: run the same command "
                       "again to resume (or remove that folder to start over)")
    return state, "interrupted before any module was kept: nothing was written; run the same command again"


def _still_online(plan) -> str:
    """"; visual.* still encoded online (not modelled)" where the server encodes modules hydrate cannot store."""
    names = [p for p, _ in plan.not_modelled]
    return f"; {', '.join(names)} still encoded online (not modelled)" if names else ""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def hydrate_command(
    call: Call,
    out_dir: Annotated[str, typer.Argument(metavar="OUT", help="The new checkpoint folder (must not exist; not inside SOURCE).")],
    bits_for: Annotated[list[str], typer.Option(
        "--bits-for", metavar="GLOB=K",
        help="Store the modules GLOB matches (checkpoint module or vLLM layer name) at K bits instead of --bits; "
             "repeatable, the last matching rule wins, e.g. --bits 6 --bits-for '*.mlp.down_proj=5'.")] = [],
    leave_unaligned: Annotated[bool, typer.Option(  # accepted for earlier scripts, with a warning; not in the help
        "--leave-unaligned", hidden=True, help="No effect: a layer a TP size cannot slice is always kept BF16.")] = False,
    plan_only: Annotated[bool, typer.Option("--dry-run", help="Print the plan (layers, shapes, sizes) and write nothing.")] = False,
) -> None:
    """Write OUT: SOURCE with every layer the server would encode online stored as EXL3 (no cache needed).

    The layers are `cache warm`'s plan at TP 1 (bits, overlay and dtype as the server's; a launch gives them). OUT
    must start at every TP size SOURCE starts at: by default each size up to 8 a server of SOURCE starts at (vLLM
    splits the model there and every rank slices SOURCE's own stored modules; with a launch: its TP size); a
    layer one of them could not slice stays BF16, as in SOURCE, and is listed with the size. Modules the server
    encodes online that exl3tool does not model (a vision tower the overlay does not ignore) are named: a server
    of OUT still encodes them. The sizes checked are recorded in OUT, where `identity` and `cache check` read them. Changed shards are
    rewritten (kept tensors byte for byte), the rest hard-linked or copied, the index and tensor_storage
    rewritten; OUT appears only when complete.
    A killed run resumes from the temporary folder beside OUT. A checkpoint already hydrated is a no-op. Under
    `torchrun --nproc-per-node N -m exl3tool hydrate ...` each process encodes a share on its GPU.

    Exit codes: 0 written (or nothing to do: already stored), 2 usage, configuration or I/O error, 130 interrupted.

    Example: exl3tool hydrate /models/Qwen3.8-27B-exl3 /models/Qwen3.8-27B-exl3-hydrated --bits 6 --tp-size 1,2
    --quantization-config "$OVERLAY"
    """
    from exl3tool.operations.hydrate import hydrate, plan_hydrate, refuse_other_launch_model

    out = call.out
    out.note_interrupted({}, "interrupted before any module was encoded: nothing was written; run the same command "
                             "again")  # until the run says what it kept
    if leave_unaligned:
        out.warn("--leave-unaligned has no effect: a layer a TP size cannot slice is always kept BF16 (as in SOURCE) "
                 "and listed; drop it")
    request, settings, environ = call.resolve(call.request(), add_tp_sizes=True, need_cache=False,
                                              no_lookup="ignore")
    refuse_other_launch_model(request.model, settings)
    extra = launch_json(settings)
    plan = plan_hydrate(request, out_dir, environ=environ, bits_for=bits_for)
    for prefix, why in plan.left_bf16:
        out.warn(f"left BF16 (as in SOURCE): {prefix}: {why}")
    for tp, why in sorted(plan.fails_at.items()):
        out.note(f"not for TP {tp} (not asked for): {why}")
    for prefix, why in plan.not_modelled:
        out.warn(f"not stored: {prefix}: {why}; OUT cannot store it either, so a server of OUT still encodes it "
                 "online at start-up")
    if plan.left_out:
        out.warn(f"left out of OUT: {', '.join(f + '/' for f in plan.left_out)} (hidden folders of SOURCE: a tool's "
                 "data, not the model; OUT holds only the model)")
    if plan.already_stored:
        out.line(f"nothing to do: {plan.source} is hydrated already ({plan.already_stored}); nothing written")
        report = None if plan_only else hydrate(plan)
        out.data({**(plan.as_json() if report is None else report.as_json()), **extra})
        return
    mods = plan.modules
    if plan_only:
        for layer in plan.layers:
            for m in layer.modules:
                s = m.source
                k = f"  K{m.bits}" if m.bits != plan.bits else ""
                out.line(f"{m.module}  [{s.in_features} x {s.out_features}]{k}  {_mib(m.weight_bytes)} -> "
                         f"{_mib(m.exl3_bytes)}  ({layer.prefix}, {layer.parallel})")
    sizes = ",".join(map(str, plan.tp_sizes)) + (" (every size SOURCE starts at)" if plan.tp_default else "")
    head = (f"{plural(len(mods), 'module')} of {plural(len(plan.layers), 'layer')} to store as EXL3 {_ks(plan)} "
            f"for TP {sizes}; {plural(len(plan.changed_shards), 'shard')} rewritten, "
            f"{plural(len(plan.unchanged_files), 'file')} linked; {_mib(plan.bytes_before)} -> {_mib(plan.bytes_after)}")
    narrowed = sorted({tp for at in plan.left_tp.values() for tp in at})
    if narrowed:
        head += (f"; {plural(sum(1 for at in plan.left_tp.values() if at), 'layer')} left BF16 because TP "
                 f"{','.join(map(str, narrowed))} cannot slice them (a --tp-size without that size stores them)")
    head += _still_online(plan) + (f"; hidden folders left out: {', '.join(plan.left_out)}" if plan.left_out else "")
    if plan_only:
        out.line(head + " (dry run: nothing written)")
        out.data({**plan.as_json(), **extra})
        return

    def on_layer(done: int, total: int, module: str, seconds: float, reused: bool) -> None:
        what = "kept from an interrupted run" if reused else f"encoded in {seconds:.1f} s"
        out.note(f"[{done}/{total}] {module}: {what}")

    try:
        report = hydrate(plan, device=request.device, on_layer=on_layer)
    except KeyboardInterrupt:
        out.note_interrupted(*_interrupted(plan))
        raise
    except OSError:
        from exl3tool.operations.hydrate import temp_dir

        if temp_dir(plan.out).exists():
            out.warn(f"stopped: the modules encoded so far are kept in {temp_dir(plan.out)}; OUT was not written; "
                     "run the same command again to resume (or remove that folder)")
        raise
    if report is None:  # a torchrun worker other than 0: worker 0 writes OUT and reports
        return
    out.line(f"wrote {plan.out}: {plural(len(mods), 'module')} stored as EXL3 {_ks(plan)} ({report.encoded} encoded, "
             f"{report.reused} kept from an interrupted run), {_mib(plan.bytes_before)} -> {_mib(report.bytes_after)}, "
             f"{report.seconds:.1f} s; hydrated for TP {','.join(map(str, plan.tp_sizes))}{_still_online(plan)}"
             + (f"; hidden folders left out: {', '.join(plan.left_out)}" if plan.left_out else ""))
    out.data({**report.as_json(), **extra})


def register(app: typer.Typer) -> None:
    """Add the ``hydrate`` command."""
    command(app, "hydrate", groups=("plan", "launch"), options=("source", "hydrate_tp_sizes", "device"))(hydrate_command)
