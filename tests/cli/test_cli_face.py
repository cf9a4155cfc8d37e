"""What a person sees (issue 37's face): tables and label/value lines at 80 and 120 columns cut no identity,
checksum or layer name; the progress bar shows the end of the layer name and jobs done/total; and the listed
defects (cache ls's model path and ISO times, identity's env-file label, a missing MODEL, an interrupted warm's
count, gpu_budget_mib on CPU, a 0-byte shard)."""

from __future__ import annotations

import datetime as dt
import io
import json
import random
import re
import types
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from helpers import ENC, ENC_ARGS, CliRunner, fake_warm

from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.cli import _register, app
from exl3tool.cli.progress import BarProgress, _Counts, elide_start
from exl3tool.plan import ServerRequest

_register()
SEED = random.randrange(2**32)
print(f"test_cli_face seed {SEED}")


def cli(*args, columns: int | None = None, **env):
    """``exl3tool ARGS``; with ``columns`` as at a terminal that wide (Rich draws for it)."""
    extra = {"TTY_COMPATIBLE": "1", "COLUMNS": str(columns)} if columns else {}
    return CliRunner().invoke(app, [str(a) for a in args], env={**extra, **env}, prog_name="exl3tool")


def _plain(text: str) -> str:
    """``text`` without the terminal's style codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    root = tmp_path_factory.mktemp("face")
    model = write_tiny(root / "llama", "llama")
    mp = pytest.MonkeyPatch()
    try:
        summary = fake_warm(ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=root / "cache", **ENC), mp)
    finally:
        mp.undo()
    return model, root / "cache", summary


def _fits(text: str, columns: int) -> None:
    text = _plain(text)
    assert "…" not in text
    for line in text.splitlines():  # a single word longer than the line (a long path) is the terminal's to wrap
        assert len(line) <= columns or " " not in line.strip(), line


@pytest.mark.parametrize("columns", [80, 120])
def test_cache_show_keeps_identities_and_checksums_whole(warmed, columns):
    _, cache, summary = warmed
    entry = Path(summary.entries[0].path)
    res = cli("cache", "show", entry, columns=columns)
    assert res.exit_code == 0, res.output
    _fits(res.stdout, columns)
    words = res.stdout.split()
    assert summary.model_identity in words and summary.encoder_identity in words
    meta = json.loads(cli("cache", "show", entry, "--json").stdout)["metadata"]
    assert meta["exl3tool_sha256"] in words and summary.entries[0].prefix in words


@pytest.mark.parametrize("columns", [80, 120])
def test_cache_ls_fits_and_names_the_model_path(warmed, columns):
    model, cache, summary = warmed
    res = cli("cache", "ls", "--cache-dir", cache, columns=columns)
    assert res.exit_code == 0, res.output
    _fits(res.stdout, columns)
    assert "malformed" in _plain(res.stdout).split() and str(model) in res.stdout.split()
    newest = dt.datetime.fromtimestamp(max(Path(e.path).stat().st_mtime for e in summary.entries), dt.timezone.utc)
    assert newest.strftime("%Y-%m-%d %H:%M") in res.stdout


def test_cache_ls_json_gives_iso_times_beside_the_epoch(warmed):
    _, cache, _ = warmed
    doc = json.loads(cli("cache", "ls", "--cache-dir", cache, "--json").stdout)
    for group in doc["groups"]:
        iso = dt.datetime.strptime(group["newest_utc"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc)
        assert isinstance(group["newest"], float) and abs(iso.timestamp() - group["newest"]) < 1e-3


@pytest.mark.parametrize("columns", [80, 120])
def test_identity_fits_and_keeps_identities_whole(warmed, columns):
    model, _, summary = warmed
    res = cli("identity", model, *ENC_ARGS, columns=columns)
    assert res.exit_code == 0, res.output
    _fits(res.stdout, columns)
    assert summary.model_identity in res.stdout.split() and summary.encoder_identity in res.stdout.split()


def test_identity_labels_settings_from_an_env_file(warmed, tmp_path):
    model, _, _ = warmed
    env = tmp_path / "server.env"
    env.write_text(f"VLLM_EXL3_ENCODER_SOURCE=/enc/{SEED}\nVLLM_EXL3_ENCODER_REVISION=r{SEED}\n")
    unset = {"VLLM_EXL3_ENCODER_SOURCE": None, "VLLM_EXL3_ENCODER_REVISION": None}
    alone = cli("identity", model, "--env-file", env, **unset)
    assert alone.exit_code == 0, alone.output
    assert f"(from env file {env})" in alone.stdout and json.loads(
        cli("identity", model, "--env-file", env, "--json", **unset).stdout)["encoder"]["source_detail"] == \
        f"env file {env}"
    mixed = cli("identity", model, "--env-file", env, "--encoder-revision", "x", **unset)
    assert f"root: env file {env}; revision: flag --encoder-revision" in " ".join(mixed.stdout.split())
    launched = cli("identity", "--launch", f"vllm serve {model}", "--env-file", env, **unset)
    assert launched.exit_code == 0, launched.output
    text = " ".join(launched.stdout.split())
    assert "(from options)" not in text and "env file VLLM_EXL3_ENCODER_SOURCE" in text, text


def test_a_missing_model_is_named_as_model(tmp_path, capsys):
    from helpers import exit_code

    missing = tmp_path / f"nope{SEED}"
    code = exit_code(["identity", missing, "--server-path", "/srv/models/m", *ENC_ARGS])
    err = capsys.readouterr().err
    assert code == 2 and f"MODEL {str(missing)!r} does not exist here" in err and "--server-path applies" not in err


def test_an_empty_shard_is_a_warning_naming_it(tmp_path):
    model = write_tiny(tmp_path / "llama", "llama")
    (Path(model) / "model-extra.safetensors").write_bytes(b"")
    res = cli("identity", model, *ENC_ARGS, "--json")
    assert res.exit_code == 0, res.output
    warnings = json.loads(res.stdout)["warnings"]
    assert any("model-extra.safetensors is empty (0 bytes)" in w for w in warnings), warnings
    assert "model-extra.safetensors is empty" in " ".join(cli("identity", model, *ENC_ARGS).stderr.split())


def test_worker_stats_has_gpu_budget_null_on_cpu(warmed):
    _, _, summary = warmed
    [stats] = summary.worker_stats
    assert stats["device"] == "cpu" and "gpu_budget_mib" in stats and stats["gpu_budget_mib"] is None


def test_a_small_write_shows_in_kilobytes(warmed, capsys):
    from exl3tool.cli.commands.warm import render_summary
    from exl3tool.cli.output import Output

    _, _, summary = warmed
    size = random.Random(SEED).randrange(20_000, 99_000)
    render_summary(Output(), replace(summary, bytes_written=size))
    out = capsys.readouterr().out
    assert f"{size / 1000:.1f} kB written" in out and "MiB" not in out


def test_an_interrupted_warm_says_what_it_published(warmed, monkeypatch, capsys):

    model, cache, summary = warmed
    n = random.Random(SEED).randrange(1, 5)

    def interrupted(request, *, on_done, **kwargs):
        for result in summary.entries[:n]:
            on_done(types.SimpleNamespace(digest=result.digest, tiles=1), result)
        on_done(types.SimpleNamespace(digest="h", tiles=1), replace(summary.entries[0], status="hit"))
        raise KeyboardInterrupt

    monkeypatch.setattr("exl3tool.operations.warm.warm", interrupted)
    from helpers import exit_code

    code = exit_code(["cache", "warm", model, "--cache-dir", cache, "--json", "--quiet", *ENC_ARGS])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == 130 and doc["exit_code"] == 130 and doc["published"] == n
    assert doc["counts"] == {"hit": 1, "encoded": n, "skipped": 0, "failed": 0}
    assert f"after publishing {n} entr" in err


# --- the progress bar ------------------------------------------------------------------------------------------

PREFIX = "language_model.model.layers.{}.mlp.experts.{}.down_proj"


def _jobs(k: int, rng: random.Random) -> list:
    return [types.SimpleNamespace(prefix=PREFIX.format(i, rng.randrange(256)), tp_size=8, tp_rank=rng.randrange(8),
                                  tiles=rng.randrange(1, 5000), digest=f"d{i}") for i in range(k)]


@pytest.mark.parametrize("width", [80, 120])
def test_bar_shows_the_end_of_the_layer_name_and_jobs(width):
    rng = random.Random(SEED)
    jobs = _jobs(6, rng)
    buf = io.StringIO()
    bar = BarProgress(Console(file=buf, width=width, force_terminal=True, color_system=None))
    bar.begin(jobs)
    for job in jobs[:3]:
        bar.started(job)
        bar.tiles(job, job.tiles // 2)
        bar.done(job, types.SimpleNamespace(status="encoded", seconds=1.0, error=""))
    bar.started(jobs[3])
    bar.tiles(jobs[3], 1)
    line = Console(file=io.StringIO(), width=width)
    with line.capture() as cap:
        line.print(bar.progress.make_tasks_table(bar.progress.tasks))
    text = cap.get().rstrip("\n")
    bar.progress.stop()
    name = f"{jobs[3].prefix} tp8-rank{jobs[3].tp_rank}"
    assert len(text) <= width and "3/6 jobs" in text
    shown = text.split(" ")[1:]
    shown = " ".join(shown[:shown.index(next(w for w in shown if w.startswith(("━", "╸", "╺"))))]).rstrip()
    assert shown.startswith("…") and name.endswith(shown[1:]) and len(shown) >= 16, (shown, text)


def test_elide_start_keeps_the_end():
    rng = random.Random(SEED)
    for _ in range(200):
        text = "".join(rng.choice("abc._ ") for _ in range(rng.randrange(0, 80)))
        width = rng.randrange(1, 90)
        shown = elide_start(text, width)
        assert len(shown) <= width
        assert shown == text if len(text) <= width else (shown.startswith("…") and text.endswith(shown[1:]))


def test_tiles_never_run_ahead_of_jobs():
    """Tile reports (more than a job's own tiles, too) never bring the count to the total before the last job is
    done, nor past it."""
    rng = random.Random(SEED)
    for _ in range(50):
        jobs = _jobs(rng.randrange(1, 8), rng)
        counts = _Counts(lambda: 0.0)
        counts.begin(jobs)
        for job in jobs:
            for _ in range(rng.randrange(0, 4)):
                counts.tiles(job, rng.randrange(0, 2 * job.tiles + 2))
                assert counts.done_tiles < counts.total
            counts.done(job, types.SimpleNamespace(status=rng.choice(["encoded", "hit", "failed"])))
            done_jobs = jobs[:counts.jobs_done]
            assert counts.done_tiles == sum(j.tiles for j in done_jobs)
            assert (counts.done_tiles == counts.total) == (counts.jobs_done == len(jobs))
