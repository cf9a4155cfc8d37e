"""``exl3tool identity``: the model and encoder identities the server would compute, and how."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from exl3tool.cache import server_identities
from exl3tool.commands.options import (
    EncoderRevisionOpt,
    EncoderRootOpt,
    EncoderSourceOpt,
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
    encoder_source: EncoderSourceOpt = None,
    quantization_config: QuantizationConfigOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Print the model and encoder identities the server derives, how, and the --revision to start it with.

    Warns when a branch or tag was resolved (the server resolves it again when it starts; the full commit hash is
    always safe). With --encoder-source the local copy's .py files are hashed under the --encoder-root string.

    The identities do not depend on --quantization-config; it is validated as the server does and shown, so one
    command line can be checked before a warm.

    Example: exl3tool identity org/model --encoder-root /encoders/exllamav3 --encoder-revision 1a2b3c
    """
    from exl3tool.checkpoint import resolve_overlay

    out = Output(json=json, quiet=quiet)
    overlay = resolve_overlay(quantization_config)
    ids = server_identities(model, revision=revision, server_path=server_path, encoder_root=encoder_root,
                            encoder_revision=encoder_revision, encoder_source=encoder_source)
    mid, eid, settings = ids.model, ids.encoder, ids.encoder_settings
    table = Table(title="Identities", show_header=True)
    table.add_column("")
    table.add_column("identity", overflow="fold", min_width=64)
    table.add_column("derivation", overflow="fold")
    table.add_row("model", mid.identity, f"{mid.kind}: {mid.derivation}")
    if eid.mode == "revision":
        how = f"revision mode: root {eid.root} + revision {settings.revision.strip()!r}"
    elif eid.files_from != eid.root:
        how = f"files mode: every *.py of the local copy {eid.files_from} hashed, keyed with the server's root {eid.root}"
    else:
        how = f"files mode: every *.py under {eid.root} hashed"
    table.add_row("encoder", eid.identity, f"{how} (from {settings.source})")
    out.table(table)
    out.line(f"revision: {mid.revision or '(none)'}")
    out.line(f"server --revision: {ids.server_revision or '(none)'}: {ids.revision_note}")
    out.line(f"encoder root (server's VLLM_EXL3_ENCODER_SOURCE): {eid.root}")
    if eid.mode == "files":
        out.line(f"encoder files hashed from: {eid.files_from}")
    out.line(f"cache dir: v1/{mid.identity[:20]}/")
    out.line(f"quantization config: {overlay.text}" + (" (default)" if overlay.default else ""))
    for warning in ids.warnings:
        out.warn(warning)
    out.data(
        {
            "model": {
                "name": model,
                "identity": mid.identity,
                "kind": mid.kind,
                "revision": mid.revision,
                "revision_from": mid.revision_from,
                "server_revision": ids.server_revision,
                "server_revision_note": ids.revision_note,
                "payload": mid.payload,
                "derivation": mid.derivation,
            },
            "encoder": {
                "identity": eid.identity,
                "mode": eid.mode,
                "root": eid.root,
                "files_from": eid.files_from,
                "payload": eid.payload,
                "source": settings.source,
            },
            "quantization_config": overlay.as_json(),
            "warnings": list(ids.warnings),
        }
    )


def register(app: typer.Typer) -> None:
    """Add the ``identity`` command."""
    app.command("identity")(identity)
