"""Progress a CI log can show: under ``--json`` stdout stays one JSON document and stderr gets log lines
(one per job done, with tiles done/total, rate and ETA; a line when the first job's preparation starts; a status
line every N seconds); ``--progress auto|bar|lines|none``; a bar that fits 80 columns."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import main
from exl3tool.cli.progress import BarProgress, LineProgress, progress_mode
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm.results import job_result

from helpers import ENC, ENC_ARGS, TINY_1, fake_encode
from seeds import fresh_seed

DONE_LINE = re.compile(r"^\[(\d+)/(\d+) jobs\] (encoded|hit|failed) (\S+) tp\d+-rank\d+.*; "
                       r"[\d,]+/[\d,]+ tiles \(\d+%\), ([\d,]+|\?) tiles/s, elapsed .+, ETA .+$")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "tiny"
    write_llama_checkpoint(path, **TINY_1,
                           seed=fresh_seed(), shards=1)
    return path


@pytest.fixture
def quick_encode(monkeypatch):
    """The real warm with ``fake_encode``, which reports its tiles in two steps as the real encoder does."""
    import exl3tool.operations.warm.run as req

    real = req.run_plan

    def encode(weight, bits, seed, device, progress=None):
        k, n = weight.shape
        tiles = (k // 16) * (n // 16)
        if progress is not None:
            progress(tiles // 2)
            progress(tiles - tiles // 2)
        return fake_encode(weight, bits, seed, device)

    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": encode}))


def run(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
        sys.exit(0)
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def _warm(model, cache, *extra):
    return ["cache", "warm", str(model), "--tp-size", "1,2", "--cache-dir", str(cache), "--device", "cpu",
            *ENC_ARGS, *extra]


@pytest.mark.parametrize("choice", ["auto", "lines"])
def test_json_warm_keeps_stdout_pure_and_logs_lines_on_stderr(model, tmp_path, capsys, quick_encode, choice):
    code, out, err = run(_warm(model, tmp_path / "c", "--json", "--progress", choice), capsys)
    assert code == 0
    doc = json.loads(out)  # the whole of stdout is the one document
    todo = doc["counts"]["encoded"]
    lines = err.splitlines()
    assert any(ln.startswith("[0/") and " preparing " in ln and "tiles)" in ln for ln in lines), err
    done = [m for m in map(DONE_LINE.match, lines) if m]
    assert len(done) == todo == 12  # 4 linears at TP 1, 8 rank jobs at TP 2
    assert [int(m.group(1)) for m in done] == list(range(1, todo + 1))
    assert {m.group(3) for m in done} == {"encoded"}
    assert done[-1].group(0).endswith("ETA 0 s") and "100%" in done[-1].group(0)


def test_plain_run_in_a_pipe_logs_lines_and_prints_the_summary(model, tmp_path, capsys, quick_encode):
    code, out, err = run(_warm(model, tmp_path / "c"), capsys)
    assert code == 0
    assert "12 encoded" in out
    assert len([ln for ln in err.splitlines() if DONE_LINE.match(ln)]) == 12
    assert "\r" not in err and "\x1b" not in err  # no bar drawing in a log


def test_progress_none_and_quiet_print_no_job_lines(model, tmp_path, capsys, quick_encode):
    for extra in (["--progress", "none"], ["--quiet"]):
        code, out, err = run(_warm(model, tmp_path / extra[-1].strip("-"), "--json", *extra), capsys)
        assert code == 0 and json.loads(out)["counts"]["encoded"] == 12
        assert not [ln for ln in err.splitlines() if ln.startswith("[")], err


def test_progress_option_refuses_an_unknown_mode(model, tmp_path, capsys):
    code, _, err = run(_warm(model, tmp_path / "c", "--progress", "fancy"), capsys)
    assert code == 2 and "--progress" in err and "auto, bar, lines, none" in err


def test_auto_is_a_bar_on_a_terminal_and_lines_elsewhere():
    assert progress_mode("auto", terminal=True, quiet=False) == "bar"
    assert progress_mode("auto", terminal=False, quiet=False) == "lines"
    assert progress_mode("auto", terminal=True, quiet=True) == "none"
    assert progress_mode("lines", terminal=True, quiet=True) == "lines"  # asked for explicitly


def _jobs(model, tmp_path):
    _, plan, _ = prepare(ServerRequest(model=str(model), tp_sizes=(1,), cache_dir=str(tmp_path / "c"), **ENC))
    return plan.todo


def test_lines_show_a_status_line_when_a_long_layer_runs(model, tmp_path):
    now = [0.0]
    buf = io.StringIO()
    lines = LineProgress(Console(file=buf, width=80), every=30, clock=lambda: now[0], beat_thread=False)
    jobs = _jobs(model, tmp_path)
    lines.begin(jobs)
    lines.started(jobs[0])
    now[0] = 29.0
    assert not lines.beat()
    lines.tiles(jobs[0], 100)
    now[0] = 31.0
    assert lines.beat()
    status = buf.getvalue().splitlines()[-1]
    total = sum(j.tiles for j in jobs)
    assert status.startswith(f"[0/{len(jobs)} jobs] working on {jobs[0].prefix} tp1-rank0; 100/{total:,} tiles")
    eta = (total - 100) / (100 / 31.0)
    assert "3 tiles/s" in status and f"ETA {int(round(eta)) // 60} min" in status
    assert not lines.beat()  # the next one only after another 30 s
    lines.done(jobs[0], job_result(jobs[0], "encoded", 0, seconds=31.0))
    assert DONE_LINE.match(buf.getvalue().splitlines()[-1])
    assert all(len(ln) > 80 for ln in buf.getvalue().splitlines()[1:])  # one line each, never folded at 80


@pytest.mark.parametrize("width", [60, 80, 120])
def test_bar_fits_the_terminal_and_says_preparing_before_the_first_tiles(model, tmp_path, width):
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    bar = BarProgress(console)
    jobs = _jobs(model, tmp_path)
    bar.begin(jobs)
    try:
        bar.started(jobs[0])

        def rendered() -> list[str]:
            probe = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
            probe.print(bar.progress.make_tasks_table(bar.progress.tasks))
            return [ln for ln in probe.file.getvalue().splitlines() if ln.strip()]

        (line,) = rendered()
        # what tells the job apart, whole at every width (issue 44: the bar sat on "preparing …_proj")
        end = jobs[0].prefix.rsplit(".", 1)[-1] + " tp1-rank0"
        assert end in line and len(line) <= width, line
        if width >= 120:
            assert "preparing" in line
        bar.tiles(jobs[0], 64)
        (line,) = rendered()
        assert "preparing" not in line and f"64/{sum(j.tiles for j in jobs)}" in line and len(line) <= width
    finally:
        bar.end()
