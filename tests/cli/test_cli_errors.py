"""Errors, exit codes and output as a user meets them: each test pins a defect found by trying exl3tool as a
new user (issue 14), and fails on the code before its fix."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from rich.table import Table
from rich.text import Text

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import debug_enabled
from exl3tool.format.encoded import EncodedLinear
from exl3tool.errors import describe
from exl3tool.cli.output import plain_table

from helpers import ENC_ARGS as ENC, TINY_1, run, refuse_encodes
from seeds import fresh_seed



@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny"
    write_llama_checkpoint(path, **TINY_1,
                           seed=fresh_seed(), shards=1)
    return path


@pytest.fixture
def no_encode(monkeypatch):
    refuse_encodes(monkeypatch)


# --- usage errors -------------------------------------------------------------------------------------------

# Click's own sentence: "No such option: --frobnicate" up to Click 8.4, "No such option '--frobnicate'." from 8.5
NO_SUCH_OPTION = r"No such option(: --frobnicate| '--frobnicate'\.)"


def test_unknown_option_prints_clicks_usage_block_not_a_class_name(capsys):
    code, out, err = run(["cache", "warm", "./m", "--frobnicate"], capsys)
    assert code == 2
    assert "Usage: exl3tool cache warm" in err
    assert "Try 'exl3tool cache warm --help' for help." in err
    assert re.search(NO_SUCH_OPTION, err), err
    assert "NoSuchOption" not in err and "DEBUG" not in err


def test_bare_group_shows_its_help_and_exits_0(capsys):
    code, out, err = run(["cache"], capsys)
    assert code == 0
    assert "Usage: exl3tool cache" in out and "warm" in out
    assert "error" not in err.lower()


def test_command_of_a_group_called_at_the_top_suggests_the_group(capsys):
    code, _, err = run(["warm", "x"], capsys)
    assert code == 2
    assert "Did you mean 'exl3tool cache warm'?" in err


def test_mode_error_names_the_option_not_the_environment_variable(model, capsys):
    code, _, err = run(["encode", str(model), "--mode", "bogus", *ENC], capsys)
    assert code == 2
    assert "--mode" in err and "bogus" in err
    assert "VLLM_EXL3_ONLINE_CACHE_MODE" not in err


# --- debug, JSON errors, messages ---------------------------------------------------------------------------


def test_debug_flag_values():
    assert debug_enabled({"EXL3TOOL_DEBUG": "1"}) and debug_enabled({"EXL3TOOL_DEBUG": "yes"})
    assert not debug_enabled({"EXL3TOOL_DEBUG": "0"}) and not debug_enabled({"EXL3TOOL_DEBUG": "false"})
    assert not debug_enabled({})


@pytest.mark.parametrize("debug", ["", "0", "1"])
def test_debug_adds_the_traceback_and_keeps_the_exit_code(model, capsys, monkeypatch, debug):
    monkeypatch.setenv("EXL3TOOL_DEBUG", debug)
    code, _, err = run(["identity", str(model), "--encoder-root", "/nonexistent/exllamav3"], capsys)
    assert code == 2
    assert ("Traceback" in err) == (debug == "1")
    assert "error: EXL3 encoder source /nonexistent/exllamav3 does not exist" in err
    assert "contains no Python files" not in err


def test_json_mode_errors_are_a_json_document_on_stdout(model, capsys):
    code, out, err = run(["identity", str(model), "--encoder-root", "/nonexistent/x", "--json"], capsys)
    assert code == 2
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and "does not exist" in doc["error"]
    assert "does not exist" in err
    code, out, _ = run(["cache", "warm", str(model), "--frobnicate", "--json"], capsys)
    doc = json.loads(out)
    assert code == 2 and set(doc) == {"error", "exit_code"} and doc["exit_code"] == 2
    assert re.fullmatch(NO_SUCH_OPTION, doc["error"]), doc


def test_describe_gives_the_sentence_not_the_class():
    assert describe(ValueError("bad shape")) == "bad shape"
    assert describe(IsADirectoryError(21, "Is a directory", "/c/e.safetensors")) == "/c/e.safetensors: Is a directory"
    assert describe(KeyError("trellis")) == "missing 'trellis'"
    assert describe(RuntimeError()) == "RuntimeError"


def test_failed_layer_errors_carry_no_exception_class(tmp_path):
    from exl3tool.operations.warm.pipeline import _failed
    from exl3tool.plan.plan import LookupJob

    key = CacheKey.for_layer(model_identity="m" * 64, encoder_identity="e" * 64, prefix="model.layers.0.mlp.down_proj",
                             bits=6, tp_world_size=1, tp_rank=0, input_size=256, output_size=256)
    job = LookupJob(key.prefix, 1, 0, 256, 256, key, tmp_path / "e", "miss")
    result = _failed(job, 0, ValueError("3 non-finite weight values in the rank-local weight"), 0.1)
    assert result.error == "3 non-finite weight values in the rank-local weight"


# --- nothing to do, unwritable cache ------------------------------------------------------------------------


def test_exclude_everything_is_a_usage_error_like_an_unmatched_layers_glob(model, tmp_path, capsys, no_encode):
    code, _, err = run(["cache", "warm", str(model), "--exclude", "*", "--cache-dir", str(tmp_path), *ENC], capsys)
    assert code == 2 and "leaves no layer" in err
    code, _, err = run(["cache", "warm", str(model), "--layers", "nope.*", "--cache-dir", str(tmp_path), *ENC], capsys)
    assert code == 2 and "no eligible layer matches" in err


@pytest.mark.parametrize("case", ["file", "below-a-file"])
def test_unwritable_cache_fails_in_one_line_before_any_encode(model, tmp_path, capsys, no_encode, case):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    root = blocker if case == "file" else blocker / "cache"
    code, out, err = run(["cache", "warm", str(model), "--layers", "*.o_proj", "--cache-dir", str(root), *ENC], capsys)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith(f"error: cache directory {root}") and ("not a directory" in lines[-1].lower())
    assert "encoded" not in out and blocker.read_text() == "not a directory"


# --- output people can read ---------------------------------------------------------------------------------


def test_plain_table_never_cuts_names_or_numbers():
    table = Table(title="verify")
    for col in ("layer", "shape", "kernel err"):
        table.add_column(col)
    names = [f"model.language_model.layers.{i}.self_attn.indexer.wq_b" for i in (10, 11, 12)]
    for name in names:
        table.add_row(name, "3840x12288", Text("2.1034e-04", style="green"))
    text = plain_table(table)
    assert "…" not in text
    for name in names:
        assert f"{name}  3840x12288  2.1034e-04" in text


def test_piped_dry_run_lists_full_layer_names(model, tmp_path, capsys):
    code, out, _ = run(["cache", "warm", str(model), "--dry-run", "--cache-dir", str(tmp_path), *ENC], capsys)
    assert code == 0
    assert "…" not in out
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"):
        assert name in out
    assert "256 x 1024" in out  # gate_up at TP 1: in 256, out 2 x 512
    assert max(len(ln) for ln in out.splitlines()) > 80  # not folded to a terminal width


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_encode_reports_tiles_inside_a_layer():
    from exl3tool.encode import encode_linear

    seen: list[int] = []
    weight = torch.randn(512, 512) * 0.02  # 1024 tiles: two CPU progress steps
    # a given global scale: progress counts the layer's tiles, not the scale search's (left out to save time)
    enc = encode_linear(weight, bits=6, seed=fresh_seed(), progress=seen.append,
                        g_scale=random.uniform(0.7, 0.9))
    assert sum(seen) == 1024 and len(seen) >= 2
    assert enc.trellis.shape[:2] == (32, 32)


def test_pipeline_passes_tile_progress_before_the_job_is_done(model, tmp_path):
    from exl3tool.plan import ServerRequest, prepare
    from exl3tool.operations.warm import run_plan

    checkpoint, plan, store = prepare(ServerRequest(model=str(model), cache_dir=str(tmp_path),
                                                  encoder_root="/e", encoder_revision="r"))
    events: list[tuple[str, str, int]] = []

    def fake_encode(weight, bits, seed, device, progress=None):
        k, n = weight.shape
        tiles = (k // 16) * (n // 16)
        for _ in range(4):
            progress(tiles // 4)
        g = torch.Generator().manual_seed(seed)
        return EncodedLinear(torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g,
                                           dtype=torch.int32).to(torch.int16),
                             torch.rand(k, generator=g).half(), torch.rand(n, generator=g).half(), 0.1, 1.0, bits)

    run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=fake_encode,
             on_tiles=lambda job, n: events.append(("tiles", job.digest, n)),
             on_done=lambda job, result: events.append(("done", job.digest, job.tiles)))
    for job in plan.todo:
        mine = [e for e in events if e[1] == job.digest]
        assert [e[0] for e in mine] == ["tiles"] * 4 + ["done"]
        assert sum(e[2] for e in mine[:4]) == job.tiles


def test_waiting_for_a_held_lock_names_the_entry_and_the_holder(tmp_path, caplog):
    key = CacheKey.for_layer(model_identity="m" * 64, encoder_identity="e" * 64, prefix="model.layers.0.mlp.down_proj",
                             bits=6, tp_world_size=1, tp_rank=0, input_size=256, output_size=256)
    store = CacheStore(tmp_path, "readwrite", lock_timeout=30)
    entry = store.path(key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(entry) + '.lock'!r}, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(3.5)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with caplog.at_level("WARNING"):
            claimed = store.claim(key)
        waited = time.monotonic() - start
        claimed.release()
    finally:
        holder.wait(10)
    notes = [r.getMessage() for r in caplog.records if "Waiting" in r.getMessage()]
    assert len(notes) == 1 and str(entry) in notes[0]
    if Path("/proc/locks").exists():
        assert f"pid {holder.pid}" in notes[0]
    assert waited > 2.0


@pytest.mark.parametrize("mode, why", [("0000", "lacks owner read"), ("0200", "lacks owner read"),
                                       ("04755", "bits beyond the permissions"), ("0777", "group/world-writable"),
                                       ("0620", "group/world-writable"), ("9", "must be octal")])
def test_file_mode_the_server_cannot_read_or_trust_is_a_usage_error(mode, why, model, tmp_path, capsys, no_encode):
    """One rule for every command that writes entries: exit 2 before anything is created."""
    cache = tmp_path / "cache"
    for argv in (["cache", "warm", str(model), "--layers", "*.o_proj", "--cache-dir", str(cache), *ENC],
                 ["encode", str(model), "--layers", "*.o_proj", "--cache-dir", str(cache), *ENC],
                 ["cache", "import", str(tmp_path / "none.tar"), "--cache-dir", str(cache)]):
        code, _, err = run([*argv, "--file-mode", mode], capsys)
        assert code == 2 and why in err and "--file-mode" in err, (argv, err)
        assert "Traceback" not in err and not cache.exists()
    assert CacheStore(cache, file_mode=0o644).file_mode == 0o644
    with pytest.raises(ValueError, match="lacks owner read"):
        CacheStore(cache, file_mode=0o044)


def test_verify_usage_and_io_errors_exit_2_before_any_check(model, tmp_path, capsys):
    """A rank outside the TP size, a missing or non-directory cache, a report folder that does not exist and a
    non-positive threshold are usage or I/O errors (2), not N failed layers (1)."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "file").write_text("x")
    base = ["verify", str(model), *ENC]
    cases = [
        (["--tp-size", "2", "--tp-rank", "5", "--cache-dir", str(tmp_path / "cache")], "--tp-rank 5 is outside 0..1"),
        (["--cache-dir", str(tmp_path / "missing")], "does not exist"),
        (["--cache-dir", str(tmp_path / "file")], "is not a directory"),
        (["--cache-dir", str(tmp_path / "cache"), "--report", str(tmp_path / "no" / "r.md")], "does not exist"),
        (["--cache-dir", str(tmp_path / "cache"), "--max-kernel-err", "-1"], "must be positive"),
    ]
    for extra, why in cases:
        code, _, err = run([*base, *extra], capsys)
        assert code == 2 and why in err and "Traceback" not in err, (extra, err)


def test_ctrl_c_says_the_cache_is_consistent_and_how_to_resume(model, tmp_path, capsys, monkeypatch):

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("exl3tool.plan.request.prepare", interrupted)  # verify imports it when it runs
    (tmp_path / "cache").mkdir()
    code, out, err = run(["verify", str(model), "--cache-dir", str(tmp_path / "cache"), "--json", *ENC], capsys)
    assert code == 130 and "interrupted" in err and "run the same command again to resume" in err
    assert json.loads(out)["exit_code"] == 130 and "Traceback" not in err


def test_ctrl_c_before_the_command_began_says_nothing_was_written(model, tmp_path, capsys, monkeypatch):
    """Ctrl-C before a command has made its output from its options (imports, parsing): no work had begun, so the
    line says nothing was written, not the cache commands' "entries published so far" (a hydrate's first second)."""

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("exl3tool.cli.commands.command.Output", interrupted)
    code, _, err = run(["hydrate", str(model), str(tmp_path / "out"), "--dry-run"], capsys)
    assert code == 130 and "before the command began its work: nothing was written" in err, err
    assert "entries published" not in err and "Traceback" not in err


def test_identity_names_a_missing_path_and_warns_on_a_folder_without_config(tmp_path, capsys):
    """identity says what encode says for a path that does not exist; a folder without config.json gets an identity
    (the server would compute one) and a warning that no server can load it."""
    code, _, err = run(["identity", str(tmp_path / "missing" / "model"), *ENC], capsys)
    assert code == 2 and "no such local path, and not a valid Hub repo id" in err and "HFValidationError" not in err
    (tmp_path / "empty").mkdir()
    code, out, err = run(["identity", str(tmp_path / "empty"), "--json", *ENC], capsys)
    assert code == 0 and any("has no config.json" in w for w in json.loads(out)["warnings"])


def test_option_values_a_server_would_not_take_are_usage_errors(model, tmp_path, capsys, no_encode):
    """An empty item in --tp-size, an empty --quantization-config (the server would run with no overlay at all)
    and --tp-size 0 are exit 2 with the option named; --layers matching only modules the server does not encode
    says why instead of 'no eligible layer'."""
    from exl3tool.checkpoint.tiny import write_mla

    cache = ["--cache-dir", str(tmp_path / "cache"), *ENC]
    for argv, why in ((["cache", "warm", str(model), "--tp-size", "1,,2", "--layers", "*.o_proj"], "empty item"),
                      (["cache", "warm", str(model), "--quantization-config", " "], "--quantization-config is empty"),
                      (["encode", str(model), "--tp-size", "0"], "--tp-size")):
        code, _, err = run([*argv, "--dry-run", *cache], capsys)
        assert code == 2 and why in err and "Traceback" not in err, (argv, err)
    mla = write_mla(tmp_path / "mla")
    code, _, err = run(["encode", str(mla), "--layers", "model.layers.1.self_attn.q_b_proj", "--dry-run", *cache],
                       capsys)
    assert code == 2 and "matches only modules the server does not encode online" in err
    assert "stored as EXL3 in the checkpoint" in err


def test_shared_experts_flag_is_not_labelled_the_default_overlay():
    from exl3tool.checkpoint import resolve_overlay

    assert resolve_overlay(None).default and not resolve_overlay(None, shared_experts=True).default


@pytest.mark.parametrize("name, value", [("RESIDENT_CAP", "x"), ("HALF_ROW_BITS", "4,six"),
                                         ("HALF_ROWS_BELOW_PER_SM", "")])
def test_a_bad_speed_rule_in_the_environment_is_one_line_naming_it(name, value):
    """The CLI checks every EXL3TOOL_* variable (knobs.read_knobs) before a command runs: a value that is not one is
    refused by name in one line with exit 2, not a traceback (in a fresh process)."""

    env = dict(os.environ, **{f"EXL3TOOL_{name}": value})
    r = subprocess.run([sys.executable, "-m", "exl3tool", "identity", "--encoder-root", "/nonexistent", "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    doc = json.loads(r.stdout)
    assert f"EXL3TOOL_{name}={value!r}" in doc["error"] and "unset it" in doc["error"]
