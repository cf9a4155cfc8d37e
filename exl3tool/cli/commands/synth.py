"""``exl3tool synth``: write a tiny EXL3 checkpoint of a family the server serves, to try the whole flow locally."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from exl3tool.checkpoint.tiny import TINY_FAMILIES, write_tiny
from exl3tool.cli.commands.command import command
from exl3tool.cli.commands.options import non_empty
from exl3tool.cli.output import Output

__all__ = ["register", "synth"]


def _family(value: str) -> str:
    if value not in TINY_FAMILIES:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(TINY_FAMILIES)}")
    return value


def synth(
    out: Output,
    directory: Annotated[Path, typer.Argument(metavar="DIR", parser=non_empty("a directory (`.` for this one)", Path), help="New (or empty) folder to write the checkpoint into.")],
    family: Annotated[str, typer.Option("--family", callback=_family, metavar="FAMILY",
                                        help=f"Which served family to write: {', '.join(TINY_FAMILIES)}.")] = "qwen3.5",
    seed: Annotated[int, typer.Option("--seed", metavar="INTEGER",
                                      help="Seed of the random weights (same seed, same bytes).")] = 0,
) -> None:
    """Write a tiny EXL3 checkpoint of a served family (random weights, a few MB) to try warm, verify and ls on.

    The checkpoint is what the server serves (EXL3 routed experts or blocks, BF16 dense linears, the family's
    real config.json names), so a warm of it plans exactly as for the full-size model, in about a minute on a CPU.
    Prints the overlay the family's deployments start the server with and the next commands.

    Example: exl3tool synth ./tiny-qwen3.5 --family qwen3.5

    Exit codes: 0 written, 2 usage or I/O error (a folder that is not empty, a full disk: nothing is left behind).
    """
    fam = TINY_FAMILIES[family]
    path = write_tiny(directory, family, seed=seed)
    written = fam.checkpoint_json(path, seed)
    files, size = written["files"], written["bytes"]
    overlay = fam.overlay
    flag = f" --quantization-config {shlex.quote(overlay)}" if overlay else ""
    where = shlex.quote(str(path))
    out.line(f"wrote a tiny {fam.name} EXL3 checkpoint ({fam.architecture}; {len(files)} files, {size:,} bytes) "
             f"to {path}: {fam.about}")
    out.line(f"overlay: {overlay or '(the default overlay)'}")
    out.line("next: exl3tool cache warm " + where + f" --tp-size {_next_tp(path, overlay)}" + flag
             + " --encoder-root /opt/exllamav3 --encoder-revision v0.0.18 --cache-dir ./exl3-cache")
    out.data(written)


def _next_tp(path: Path, overlay) -> int:
    """The TP size the next command warms for: 2 where a server of the checkpoint starts there, else the largest
    size up to 2 it starts at (``LayerPlan.startable_tp_sizes``: its stored modules must slice there too)."""
    from exl3tool.checkpoint import open_checkpoint, plan_layers
    from exl3tool.releases import newest

    starts = plan_layers(open_checkpoint(str(path)), overlay=overlay, release=newest()).startable_tp_sizes(2)
    return max(starts, default=1)


def register(app: typer.Typer) -> None:
    """Add the ``synth`` command."""
    command(app, "synth")(synth)
