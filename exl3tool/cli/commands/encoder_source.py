"""``exl3tool encoder-source DIR``: the directory the vLLM fork loads exl3tool's encoder from."""

from __future__ import annotations

from typing import Annotated

import typer

from exl3tool.cli.commands.command import command
from exl3tool.cli.commands.options import non_empty
from exl3tool.cli.output import Output

__all__ = ["register", "encoder_source"]


def encoder_source(
    out: Output,
    directory: Annotated[str, typer.Argument(metavar="DIR", parser=non_empty("a directory (`.` for this one)"), help="Directory to write; the server's "
                                             "VLLM_EXL3_ENCODER_SOURCE (e.g. /opt/exl3tool-encoder).")],
    force: Annotated[bool, typer.Option("--force", help="Replace DIR's whole content even if it is not an "
                                        "earlier export.")] = False,
) -> None:
    """Write an encoder source that runs exl3tool's encoder inside the server, with exllamav3's bytes.

    DIR/modules/quant/exl3_lib/quantize.py provides quantize_exl3 with exllamav3's signature; it needs exl3tool
    installed in the server's Python. Start the server with VLLM_EXL3_ENCODER_SOURCE=DIR. The encoder identity is
    new (it hashes this file, which depends only on the exl3tool version): warm with --encoder-root DIR as the
    server sees it, or set one VLLM_EXL3_ENCODER_REVISION on both sides. An earlier export is replaced; another
    non-empty directory only with --force.

    Example: exl3tool encoder-source /opt/exl3tool-encoder

    Exit codes: 0 written or already current, 2 a directory it may not replace, usage or I/O error.
    """
    from exl3tool.cache import resolve_encoder_identity
    from exl3tool.serving.encoder_source import write_encoder_source

    result = write_encoder_source(directory, force=force)
    eid = resolve_encoder_identity(result.path)
    what = {"none": "written", "empty": "written into the empty directory", "export": "replaced an earlier export",
            "forced": "replaced the directory's content (--force)", "unchanged": "already current, nothing written"}
    out.line(f"encoder source {result.path}: {what[result.replaced]} (exl3tool {result.exl3tool_version})")
    out.line(f"server: VLLM_EXL3_ENCODER_SOURCE={result.path}")
    out.line(f"encoder identity (files mode, root {eid.root}): {eid.identity}")
    out.note("warm with --encoder-root set to this directory as the server sees it (or one "
             "VLLM_EXL3_ENCODER_REVISION on both sides); exl3tool must be installed in the server's Python")
    out.data(result.as_json(eid))


def register(app: typer.Typer) -> None:
    """Add the ``encoder-source`` command."""
    command(app, "encoder-source")(encoder_source)
