"""Strings we print are data: a path, layer name or reason that looks like Rich markup prints as itself."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table
from rich.text import Text
from helpers import ENCODER_ID, MODEL_ID, CliRunner, make_encoded

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.cli import _register, app
from exl3tool.cli.output import Output


_register()
NASTY = "models/[/bold] and [red]x[/]"


def _terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=200, color_system=None), buf


def test_notes_warnings_lines_and_tables_print_markup_literally():
    (out_console, out_buf), (err_console, err_buf) = _terminal(), _terminal()
    out = Output(stdout=out_console, stderr=err_console)
    out.note(f"skipping {NASTY}")
    out.warn(f"{NASTY}: a symlink")
    out.line(f"exported to {NASTY}")
    table = Table(title=NASTY)
    table.add_column("path")
    table.add_column("state")
    table.add_row(NASTY, Text("hit", style="green"))
    out.table(table)
    assert f"skipping {NASTY}" in err_buf.getvalue()
    assert f"warning: {NASTY}: a symlink" in err_buf.getvalue()
    assert f"exported to {NASTY}" in out_buf.getvalue()
    assert out_buf.getvalue().count(NASTY) == 3  # line, title, cell


def test_cache_commands_on_a_root_whose_name_looks_like_markup(tmp_path):
    root = tmp_path / "cache[/bold]"
    store = CacheStore(root)
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.self_attn.o_proj", 6, 1, 0, 128, 256)
    store.publish(key, make_encoded(128, 256))
    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "ls", "--cache-dir", str(root)])
    assert listed.exit_code == 0, listed.output
    assert str(root) in listed.stdout.replace("\n", "")
    entry = next(root.rglob("*.safetensors"))
    shown = runner.invoke(app, ["cache", "show", str(entry)])
    assert shown.exit_code == 0, shown.output
    assert "model.layers.0.self_attn.o_proj" in shown.stdout
