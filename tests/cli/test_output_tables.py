"""Tables at a terminal never split a word of any cell (issue 44): at 60, 80 and 120 columns the columns wrap at
spaces, or each row folds into label/value lines; no column is left out (the failed layers' error included)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli.commands.warm import render_plan, render_summary
from exl3tool.cli.output import Output
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm.results import job_result, summarize

from helpers import ENC, TINY_1
from seeds import fresh_seed

LONG = [f"model.language_model.layers.{i}.self_attn.indexer.wq_b" for i in (10, 11, 12)]


def _terminal(width: int) -> tuple[Output, io.StringIO]:
    buf = io.StringIO()
    return Output(stdout=Console(file=buf, width=width, force_terminal=True, color_system=None)), buf


def _verify_table() -> Table:
    table = Table(title="verify m (6 bits, TP 2, GEMM: triton)")
    for col in ("layer", "rank", "shape", "rows", "kernel err", "quant err", "proxy err", "weight MSE", "status"):
        table.add_column(col, justify="left" if col in ("layer", "status", "shape") else "right")
    for name in LONG:
        table.add_row(name, "1", "3840x12288", "all", "2.1034e-04", "1.0417e-02", "3.2e-03", "1.11e-06",
                      Text("ok", style="green"))
    return table


def _whole(name: str, text: str) -> bool:
    return any(name in line for line in text.splitlines())


def _words_whole(table_cells: list[str], text: str) -> list[str]:
    """The words of the cells that the printed text does not hold whole (a word split across lines)."""
    printed = set(text.split())
    return [w for cell in table_cells for w in cell.split() if w not in printed]


@pytest.mark.parametrize("width", [60, 80, 120])
def test_verify_table_keeps_every_word_and_column(width):
    out, buf = _terminal(width)
    table = _verify_table()
    cells = [str(c.header) for c in table.columns] + [getattr(x, "plain", x) for c in table.columns for x in c._cells]
    out.table(table)
    text = buf.getvalue()
    assert all(_whole(name, text) for name in LONG), text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    assert not _words_whole(cells, text), text  # every header and value, whole: nothing left out or split
    assert "left out" not in text


@pytest.mark.parametrize("width", [60, 80, 120])
def test_plan_and_failure_tables_keep_layer_names_whole(width, tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", **TINY_1, seed=fresh_seed(), shards=1)
    _, plan, _ = prepare(ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=str(tmp_path / "c"), **ENC))
    out, buf = _terminal(width)
    render_plan(out, plan)
    text = buf.getvalue()
    names = {j.prefix for j in plan.jobs}
    assert names and all(_whole(n, text) for n in names), text
    assert "model.layers.0.mlp.d…" not in text and "…" not in text.split("plan for")[-1].split("jobs:")[0]
    failed = [job_result(j, "failed", 0, error=f"{j.path} is a directory where the entry file should be; no warm "
                         "can replace it; remove it with: exl3tool cache prune --invalid") for j in plan.todo]
    out, buf = _terminal(width)
    render_summary(out, summarize(plan, failed, device="cpu", workers=1, seconds=1.0))
    text = buf.getvalue()
    assert all(_whole(j.prefix, text) for j in plan.todo), text
    assert "--invalid" in text and "…" not in text  # the error column wraps, it is not cut
    assert not _words_whole([failed[0].error, "error"], text), text  # the error column is shown, every word whole


def test_a_layer_name_wider_than_the_terminal_is_printed_whole_on_its_own_line(capsys):
    name = "model." + "very_long_module_name." * 5 + "down_proj"
    table = Table(title="t")
    table.add_column("layer")
    table.add_column("status")
    table.add_row(name, "ok")
    out = Output(stdout=Console(width=80, force_terminal=True, color_system=None))
    out.table(table)
    printed = capsys.readouterr().out
    assert printed.splitlines() == ["t", "layer", f"  {name}", "status  ok"]
