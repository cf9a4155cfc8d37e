"""Tables at a terminal never cut a layer name: at 80 and 120 columns the other columns wrap or are left out
(and the caption names them); what does not fit at all is printed as plain rows."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table
from rich.text import Text

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli.commands.encode import render_plan, render_summary
from exl3tool.cli.output import Output
from exl3tool.plan import WarmRequest, prepare
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


@pytest.mark.parametrize("width", [80, 120])
def test_verify_table_keeps_layer_names_whole(width):
    out, buf = _terminal(width)
    out.table(_verify_table())
    text = buf.getvalue()
    assert all(_whole(name, text) for name in LONG), text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    assert "ok" in text  # the status is the last column to go
    assert "2.1034e-0\n" not in text  # a number is never folded
    if width == 80:
        assert "left out at this width: shape, rows, kernel err" in " ".join(text.split())


@pytest.mark.parametrize("width", [80, 120])
def test_plan_and_failure_tables_keep_layer_names_whole(width, tmp_path):
    model = write_llama_checkpoint(tmp_path / "m", **TINY_1, seed=fresh_seed(), shards=1)
    _, plan, _ = prepare(WarmRequest(model=str(model), tp_sizes=(1, 2), cache_dir=str(tmp_path / "c"), **ENC))
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


def test_a_layer_name_wider_than_the_terminal_is_printed_plain(capsys):
    name = "model." + "very_long_module_name." * 5 + "down_proj"
    table = Table(title="t")
    table.add_column("layer")
    table.add_column("status")
    table.add_row(name, "ok")
    out = Output(stdout=Console(width=80, force_terminal=True, color_system=None))
    out.table(table)
    printed = capsys.readouterr().out
    assert f"{name}  ok" in printed
