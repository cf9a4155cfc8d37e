"""``exl3tool identity``: the model and encoder identities the server would compute, and how."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import typer

from exl3tool.cli.commands.command import Call, command
from exl3tool.cli.commands.launching import launch_json
from exl3tool.cli.output import Output
from exl3tool.errors import ConfigError

if TYPE_CHECKING:
    from exl3tool.plan import ServerRequest

__all__ = ["register", "identity"]


def identity(call: Call) -> None:
    """Print the model and encoder identities the server derives, how, and the --revision to start it with.

    Warns when a branch or tag was resolved (the server resolves it again when it starts; the full commit hash is
    always safe). With --encoder-source the local copy's .py files are hashed under the --encoder-root string.

    The identities do not depend on --quantization-config; it is validated as the server does and shown, so one
    command line can be checked before a warm. Without MODEL and launch, --encoder-root (or --encoder-source) prints
    the encoder identity alone, e.g. of an `exl3tool encoder-source DIR` export.

    Example: exl3tool identity org/model --encoder-root /encoders/exllamav3 --encoder-revision 1a2b3c

    Exit codes: 0 printed, 2 usage or configuration error (no encoder root, a revision that does not resolve).
    """
    from exl3tool.cache.identity import server_identities
    from exl3tool.checkpoint import resolve_overlay

    out = call.out
    request = call.request()
    if not request.model and not call.launch.launch_given and call.given_fields & {"encoder_root", "encoder_source"}:
        _encoder_only(out, request, call.launch.env_files)
        return
    request, launched, environ = call.resolve(request, need_cache=False, no_lookup="warn")
    model = request.model
    overlay = resolve_overlay(request.quantization_config)
    try:
        ids = server_identities(model, revision=request.revision, server_path=request.server_path,
                                encoder_root=request.encoder_root, encoder_revision=request.encoder_revision,
                                encoder_source=request.encoder_source, environ=environ, view=request.server_view)
    except ConfigError as exc:
        from exl3tool.operations.hydrate import nothing_encoded_online

        why = str(exc).startswith("no encoder identity") and nothing_encoded_online(request, environ)
        if not why:
            raise
        _model_only(out, request, environ, launched, overlay, why)
        return
    mid, eid, settings = ids.model, ids.encoder, ids.encoder_settings
    source = _encoder_from(call, settings, launched)
    out.fields("Identities", [("model identity", mid.identity), ("model derivation", f"{mid.kind}: {mid.derivation}"),
                              ("encoder identity", eid.identity),
                              ("encoder derivation", _encoder_derivation(eid, settings, source))])
    out.wrapped(f"revision: {mid.revision or '(none)'}")
    out.wrapped(f"server --revision: {ids.server_revision or '(none)'}: {ids.revision_note}")
    out.wrapped(f"encoder root (server's VLLM_EXL3_ENCODER_SOURCE): {eid.root}")
    if eid.mode == "files":
        out.wrapped(f"encoder files hashed from: {eid.files_from}")
    out.wrapped(f"cache dir: v1/{mid.identity[:20]}/")
    out.wrapped(f"quantization config: {overlay.text}" + (" (default)" if overlay.default else ""))
    from exl3tool.checkpoint.hydrate_record import read_hydrate_record

    hydrated = read_hydrate_record(model) if model and os.path.isdir(os.path.expanduser(model)) else None
    if hydrated is not None:  # `exl3tool hydrate` wrote it: the TP sizes it was checked for
        out.wrapped(f"checkpoint: {hydrated.line()}")
    for warning in ids.warnings:
        out.warn(warning)
    out.data({**ids.as_json(model, source_detail=source, quantization_config=overlay.as_json()),
              **({} if hydrated is None else {"hydrated": hydrated.as_json()}), **launch_json(launched)})


def _model_only(out, request, environ, launched, overlay, why: str) -> None:
    """A checkpoint whose every online layer is stored (a hydrated one) and no encoder given: the model identity,
    and that the server needs no encoder identity (it encodes nothing online, so it computes no cache key)."""
    from exl3tool.cache.identity import resolve_model_identity
    from exl3tool.checkpoint.hydrate_record import read_hydrate_record

    model = request.model
    mid = resolve_model_identity(model, revision=request.revision, server_path=request.server_path,
                                 view=request.server_view, environ=environ)
    line = f"none needed: {why}; the server encodes nothing online, so it computes no cache key"
    out.fields("Identities", [("model identity", mid.identity), ("model derivation", f"{mid.kind}: {mid.derivation}"),
                              ("encoder identity", line)])
    out.wrapped(f"quantization config: {overlay.text}" + (" (default)" if overlay.default else ""))
    hydrated = read_hydrate_record(model)
    if hydrated is not None:
        out.wrapped(f"checkpoint: {hydrated.line()}")
    for warning in mid.warnings:
        out.warn(warning)
    out.data({"model": {"name": model, "identity": mid.identity, "kind": mid.kind, "revision": mid.revision,
                        "payload": mid.payload, "derivation": mid.derivation},
              "encoder": None, "encoder_needed": False, "why": why, "quantization_config": overlay.as_json(),
              **({} if hydrated is None else {"hydrated": hydrated.as_json()}), **launch_json(launched)})


def _encoder_from(call: Call, settings, launched) -> str:
    """Where the encoder root and revision came from, for people: the launch's sources (an env file, the launch's
    own -e, a flag) when a launch was read, ``--env-file`` files without one, else the library's own label."""
    names = {"encoder_root": "VLLM_EXL3_ENCODER_SOURCE", "encoder_revision": "VLLM_EXL3_ENCODER_REVISION"}
    env_files = call.launch.env_files
    if launched is not None:
        found = {field: launched.settings.get(field) for field in names}
        parts = {field: f"{s.source} {s.detail}".strip() for field, s in found.items() if s is not None}
    elif env_files:
        from exl3tool.launch.env import read_env_file

        parts = {}
        for field, variable in names.items():
            files = [path for path in env_files if variable in read_env_file(path)]
            if field in call.given_fields:
                parts[field] = "flag --" + field.replace("_", "-")
            elif files:
                parts[field] = f"env file {files[-1]}"
            elif variable in os.environ:
                parts[field] = "environment"
    else:
        return settings.source
    if not parts:
        return settings.source
    if len(set(parts.values())) == 1:
        return next(iter(parts.values()))
    return "; ".join(f"{field.removeprefix('encoder_')}: {where}" for field, where in parts.items())


def _encoder_derivation(eid, settings, source: str | None = None) -> str:
    if eid.mode == "revision":
        how = f"revision mode: root {eid.root} + revision {settings.revision.strip()!r}"
    elif eid.files_from != eid.root:
        how = f"files mode: every *.py of the local copy {eid.files_from} hashed, keyed with the server's root {eid.root}"
    else:
        how = f"files mode: every *.py under {eid.root} hashed"
    return f"{how} (from {source or settings.source})"


def _encoder_only(out: Output, request: ServerRequest, env_files: tuple[str, ...]) -> None:
    """The encoder identity alone: no model to derive one for (``model`` is null in --json)."""
    import os

    from exl3tool.cache.identity import encoder_json, server_encoder_identity
    from exl3tool.checkpoint import resolve_overlay

    if env_files:
        raise typer.BadParameter("--env-file needs a launch (--launch, --pid or -- ARGV); without MODEL and launch "
                                 "give the encoder with --encoder-root and --encoder-revision", param_hint="'--env-file'")
    overlay = resolve_overlay(request.quantization_config) if request.quantization_config else None
    eid, settings, warnings = server_encoder_identity(request.encoder_root, request.encoder_revision,
                                                      request.encoder_source, os.environ)
    out.fields("Identities", [("encoder identity", eid.identity),
                              ("encoder derivation", _encoder_derivation(eid, settings))])
    out.wrapped(f"encoder root (server's VLLM_EXL3_ENCODER_SOURCE): {eid.root}")
    if eid.mode == "files":
        out.wrapped(f"encoder files hashed from: {eid.files_from}")
    out.wrapped("model: none given (pass MODEL or the server's launch for the model identity and the cache dir)")
    for warning in warnings:
        out.warn(warning)
    out.data({"model": None, "encoder": encoder_json(eid, settings),
              "quantization_config": overlay.as_json() if overlay is not None else None, "warnings": list(warnings)})


def register(app: typer.Typer) -> None:
    """Add the ``identity`` command."""
    command(app, "identity", groups=("model", "encoder", "launch"), options=("quantization_config",))(identity)
