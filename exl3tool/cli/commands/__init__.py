"""Command groups of the CLI. Each module exposes ``register(app)``."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Register every command module that exists on the app."""
    import importlib

    # the order of `--help`'s lists: `cache warm` and `cache check` come after the `cache` group's own commands
    for name in ("identity", "cache", "warm", "check", "verify", "encoder_source", "synth", "hydrate"):
        try:
            module = importlib.import_module(f"exl3tool.cli.commands.{name}")
        except ModuleNotFoundError as exc:  # a command group not written yet
            if exc.name == f"exl3tool.cli.commands.{name}":
                continue
            raise
        module.register(app)
