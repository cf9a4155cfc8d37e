"""Typer's CliRunner with stdout and stderr apart on every Click the pyproject allows.

Click 8.2+ always keeps them apart; Click 8.1 (typer 0.15 with an external Click) mixes them unless asked not to.
"""

from __future__ import annotations

import inspect

from typer.testing import CliRunner as _TyperRunner

_SEPARATE = {"mix_stderr": False} if "mix_stderr" in inspect.signature(_TyperRunner.__init__).parameters else {}


class CliRunner(_TyperRunner):
    def __init__(self, **kwargs) -> None:
        super().__init__(**{**_SEPARATE, **kwargs})
