"""What a person reads: dry runs that check what the run would, missing shards named, prompts that say how to skip
them, help without type placeholders, counts that agree with their nouns, and notes said before the work."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.cli.output import plural

from helpers import ENCODER_ID, ENC_ARGS as ENC, MODEL_ID, make_encoded, run
from seeds import fresh_seed



@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("msg") / "mla", "deepseek-v3", seed=fresh_seed())


def test_dry_run_checks_the_device_as_the_run_would(tiny, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    for device in ("cuda:9", "tpu", "cuda"):
        code, out, err = run(["cache", "warm", tiny, "--device", device, "--dry-run", "--cache-dir", tmp_path, *ENC],
                             capsys)
        assert code == 2 and "--device" in err and device in err and "Traceback" not in err, (device, err)
        assert "jobs" not in out


def test_a_shard_the_index_names_but_the_folder_lacks(tiny, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (broken / gone).unlink()
    code, out, err = run(["identity", broken, *ENC], capsys)
    assert code == 0 and "warning:" in err and str(broken / gone) in err and "missing" in err
    code, out, err = run(["identity", broken, "--json", *ENC], capsys)
    assert any(gone in w for w in json.loads(out)["warnings"])
    for argv in (["cache", "warm", broken, "--cache-dir", tmp_path / "c"], ["verify", broken, "--cache-dir", tmp_path]):
        code, _, err = run([*argv, *ENC], capsys)
        assert code == 2 and str(broken / gone) in err and "missing" in err, argv
    code, _, err = run(["identity", tiny, *ENC], capsys)
    assert "warning" not in err  # a complete checkpoint: no word


def test_prune_without_a_terminal_says_pass_yes(tmp_path, capsys, monkeypatch):
    store = CacheStore(tmp_path)
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    path = store.publish(key, make_encoded(128, 256, seed=fresh_seed()))
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no answer: a script or CI step
    code, out, err = run(["cache", "prune", "--older-than", "0", "--cache-dir", tmp_path], capsys)
    assert code == 2 and "pass --yes to prune without a prompt" in err and "aborted" not in err
    assert path.is_file()


@pytest.mark.parametrize("command", [[], ["cache"], ["cache", "prune"], ["cache", "warm"], ["encode"], ["verify"],
                                     ["identity"], ["synth"], ["cache", "import"]])
def test_help_shows_no_type_placeholders(command, capsys):
    code, out, _ = run([*command, "--help"], capsys)
    assert code == 0 and not re.search(r"<(bool|str|int|float|path|list\[str\])>", out), out


def test_root_help_states_every_exit_code_and_cache_help_every_command(capsys):
    _, out, _ = run(["--help"], capsys)
    text = " ".join(out.replace("│", " ").split())
    for code in ("0 ok", "1 findings", "2 usage", "130 interrupted"):
        assert code in text
    _, cache_help, _ = run(["cache", "--help"], capsys)
    summary = " ".join(cache_help.replace("│", " ").split()).split("Options")[0].lower()
    for command in ("warm", "check", "list", "show", "verify", "prune", "export", "import"):
        assert command in summary, (command, summary)


def test_counts_agree_with_their_nouns(tmp_path, capsys):
    assert [plural(n, "job") for n in (0, 1, 2, 1500)] == ["0 jobs", "1 job", "2 jobs", "1,500 jobs"]
    model = write_tiny(tmp_path / "llama", "llama")
    code, out, _ = run(["encode", model, "--layers", "model.layers.0.self_attn.o_proj", "--tp-rank", "0",
                        "--cache-dir", tmp_path / "c", "--dry-run", *ENC], capsys)
    assert code == 0 and re.search(r"^1 job: ", out, re.M) and "1 jobs" not in out, out
    code, out, err = run(["identity", model, *ENC], capsys)
    assert "revision None" not in out + err and "no revision" in out


def test_dry_run_states_total_tiles_and_tiles_to_encode(tmp_path, capsys):
    model = write_tiny(tmp_path / "llama", "llama")
    code, out, _ = run(["cache", "warm", model, "--tp-size", "1,2", "--cache-dir", tmp_path / "c", "--dry-run",
                        "--json", *ENC], capsys)
    plan = json.loads(out)
    looked_up = [j for j in plan["jobs"] if j["state"] != "skipped"]
    assert plan["tiles"] == {"total": sum(j["tiles"] for j in looked_up),
                             "to_encode": sum(j["tiles"] for j in looked_up if j["state"] in ("miss", "invalid"))}
    code, out, _ = run(["cache", "warm", model, "--tp-size", "1,2", "--cache-dir", tmp_path / "c", "--dry-run",
                        *ENC], capsys)
    assert f"{plan['tiles']['total']:,} tiles in all, {plan['tiles']['to_encode']:,} tiles to encode" in out


@pytest.mark.parametrize("mode", ["readonly", "off"])
def test_modes_that_discard_say_so_before_encoding(mode, tmp_path, capsys, monkeypatch):
    import exl3tool.operations.warm.run as req

    said: list[str] = []

    def stop_at_encode(*args, **kwargs):  # where the first encode would start: the note must be out by then
        said.append(capsys.readouterr().err)
        raise KeyboardInterrupt

    monkeypatch.setattr(req, "run_plan", stop_at_encode)
    model = write_tiny(tmp_path / "llama", "llama")
    code, _, _ = run(["encode", model, "--mode", mode, "--cache-dir", tmp_path / "c", *ENC], capsys)
    assert code == 130 and f"mode {mode}:" in said[0] and "discarded" in said[0], said
    code, _, err = run(["encode", model, "--mode", mode, "--cache-dir", tmp_path / "c", "--dry-run", *ENC], capsys)
    assert code == 0 and f"mode {mode}:" in err and "discarded" in err
    code, _, err = run(["encode", model, "--cache-dir", tmp_path / "c", "--dry-run", *ENC], capsys)
    assert "discarded" not in err  # readwrite publishes


def test_cpu_worker_stats_carry_peak_cuda_mib_null():
    from exl3tool.operations.warm.distributed import DistributedContext, worker_stats

    stats = worker_stats(DistributedContext(0, 1, 0, False), torch.device("cpu"), 1.0)
    assert "peak_cuda_mib" in stats and stats["peak_cuda_mib"] is None
