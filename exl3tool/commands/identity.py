"""``exl3tool identity``: the model and encoder identities the server would compute, and how."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from exl3tool.cache import encoder_settings, resolve_encoder_identity, resolve_model_identity
from exl3tool.commands.options import (
    EncoderRevisionOpt,
    EncoderRootOpt,
    JsonOpt,
    QuantizationConfigOpt,
    QuietOpt,
    RevisionOpt,
    ServerPathOpt,
)
from exl3tool.output import Output

__all__ = ["register", "identity"]


def identity(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Hub repo id or local checkpoint path, exactly as given to --model.")],
    revision: RevisionOpt = None,
    server_path: ServerPathOpt = None,
    encoder_root: EncoderRootOpt = None,
    encoder_revision: EncoderRevisionOpt = None,
    quantization_config: QuantizationConfigOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Print the model and encoder identities the server derives, the resolved revision and how.

    The identities do not depend on --quantization-config; it is validated as the server does and shown, so one
    command line can be checked before a warm.

    Example: exl3tool identity org/model --encoder-root /encoders/exllamav3 --encoder-revision 1a2b3c
    """
    from exl3tool.checkpoint import resolve_overlay

    out = Output(json=json, quiet=quiet)
    overlay = resolve_overlay(quantization_config)
    mid = resolve_model_identity(model, revision=revision, server_path=server_path)
    settings = encoder_settings(encoder_root, encoder_revision)
    eid = resolve_encoder_identity(settings.root, settings.revision)
    table = Table(title="Identities", show_header=True)
    table.add_column("")
    table.add_column("identity", overflow="fold", min_width=64)
    table.add_column("derivation", overflow="fold")
    table.add_row("model", mid.identity, f"{mid.kind}: {mid.derivation}")
    how = (
        f"revision mode: root {eid.root} + revision {settings.revision.strip()!r}"
        if eid.mode == "revision"
        else f"files mode: every *.py under {eid.root} hashed"
    )
    table.add_row("encoder", eid.identity, f"{how} (from {settings.source})")
    out.table(table)
    out.line(f"revision: {mid.revision or '(none)'}")
    out.line(f"cache dir: v1/{mid.identity[:20]}/")
    out.line(f"quantization config: {overlay.text}" + (" (default)" if overlay.default else ""))
    out.data(
        {
            "model": {
                "name": model,
                "identity": mid.identity,
                "kind": mid.kind,
                "revision": mid.revision,
                "payload": mid.payload,
                "derivation": mid.derivation,
            },
            "encoder": {
                "identity": eid.identity,
                "mode": eid.mode,
                "root": eid.root,
                "payload": eid.payload,
                "source": settings.source,
            },
            "quantization_config": overlay.as_json(),
        }
    )


def register(app: typer.Typer) -> None:
    """Add the ``identity`` command."""
    app.command("identity")(identity)
