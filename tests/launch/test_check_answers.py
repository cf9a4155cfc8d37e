"""`cache check` answers what the server will do: a launch that makes no look-up is a finding (never "all hit"),
a predicted miss outside the plan fails the check, and a miss caused by the TP size is blamed on the TP size.

Hit or miss for the server is decided by ``tests/helpers.py``'s look-up and identities, written from the spec
without exl3tool's code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.checkpoint.tiny import QWEN38_OVERLAY, write_qwen35
from exl3tool.plan import ServerRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers
from helpers import BOTH, LAUNCH_ENC as ENC, LINEAR_WEIGHT as QC, TINY_1  # noqa: E402
from helpers import fake_warm, server_encoder_identity, server_lookup, server_model_identity  # noqa: E402
from seeds import fresh_seed



def _seed() -> int:
    seed = fresh_seed(16)
    print(f"checkpoint seed {seed}")
    return seed


def _server_env(tmp_path: Path, bits: str | None = "6") -> str:
    env = f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c"
    return env + (f" VLLM_EXL3_ONLINE_TRELLIS_BITS={bits}" if bits is not None else "")


@pytest.fixture()
def warmed_llama(tmp_path, monkeypatch):
    """A tiny Llama warmed (fake encoder, real plan and store) as a TP 1 server started with QC looks it up."""
    model = write_llama_checkpoint(tmp_path / "M", **TINY_1, seed=_seed())
    request = ServerRequest(model=str(model), tp_sizes=(1,), cache_dir=str(tmp_path / "c"), bits=6,
                          quantization_config=QC, encoder_root=ENC[0], encoder_revision=ENC[1])
    summary = fake_warm(request, monkeypatch)
    assert summary.counts["encoded"] > 0
    return model


@pytest.mark.parametrize("case", ["no_bits", "blank_bits", "no_overlay", "cache_off"])
def test_a_launch_without_look_ups_is_a_finding_never_all_hit(warmed_llama, tmp_path, cli, case):
    """Every entry the warm wrote is in place, yet this server looks none of them up: exit 1, 0 look-ups, why."""
    model = warmed_llama
    env, tail = _server_env(tmp_path), f" --quantization-config '{QC}'"
    if case == "no_bits":
        env = _server_env(tmp_path, bits=None)
    elif case == "blank_bits":
        env = _server_env(tmp_path, bits="' '")
    elif case == "no_overlay":
        tail = ""
    else:
        env += " VLLM_EXL3_ONLINE_CACHE_MODE=off"
    launch = f"{env} vllm serve {model}{tail}"
    # the same server with the online path on finds every entry: the cache is warm
    code, out, err = cli("cache", "check", "--json", "--launch", f"{_server_env(tmp_path)} vllm serve {model} "
                         f"--quantization-config '{QC}'")
    assert code == 0 and json.loads(out)["ok"], err
    code, out, err = cli("cache", "check", "--json", "--launch", launch)
    doc = json.loads(out)
    assert code == 1, err
    assert doc["ok"] is False and doc["server_lookup"] is False and doc["lookups"] == 0
    assert doc["launch"]["server_lookup"] is False and doc["lookup_off"]
    want = {"no_bits": "VLLM_EXL3_ONLINE_TRELLIS_BITS is not set", "blank_bits": "VLLM_EXL3_ONLINE_TRELLIS_BITS is not set",
            "no_overlay": "no --quantization-config", "cache_off": "never reads the cache"}[case]
    assert any(want in r for r in doc["lookup_off"]), doc["lookup_off"]
    code, out, err = cli("cache", "check", "--launch", launch)
    assert code == 1 and out.startswith("0 look-ups: this launch encodes nothing online, because ")
    # a warm or an encode for that launch would write entries nobody reads: a usage error
    for command in (["cache", "warm", "--dry-run"], ["encode", "--dry-run"]):
        code, _, err = cli(*command, "--launch", launch)
        assert code == 2 and "makes no cache look-up" in err and want in err, err


def test_no_look_up_without_an_encoder_is_still_reported(tmp_path, cli):
    """The server needs no encoder when it encodes nothing online: the check says why there are no look-ups
    instead of refusing the launch over the missing VLLM_EXL3_ENCODER_SOURCE."""
    model = write_llama_checkpoint(tmp_path / "M", **TINY_1, seed=_seed())
    code, out, err = cli("cache", "check", "--json", "--launch",
                         f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c vllm serve {model} --quantization-config '{QC}'")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["server_lookup"] is False and any("VLLM_EXL3_ENCODER_SOURCE" in w for w in doc["launch"]["warnings"])


def test_an_empty_launch_is_a_usage_error(tmp_path, cli):
    model = write_llama_checkpoint(tmp_path / "M", **TINY_1, seed=_seed())
    for command in (["cache", "check", "--cache-dir", tmp_path / "c"],
                    ["cache", "warm", "--dry-run", "--cache-dir", tmp_path / "c"], ["identity"]):
        code, _, err = cli(*command, str(model), "--encoder-root", ENC[0], "--encoder-revision", ENC[1],
                           "--launch", "  ")
        assert code == 2 and "the launch is empty" in err, err


def test_vision_tower_look_ups_outside_the_plan_fail_the_check(tmp_path, cli, monkeypatch):
    """An overlay that does not ignore Qwen3.5's vision tower: the server encodes (and looks up) those linears,
    which exl3tool cannot plan; every planned look-up hits, the check still fails naming the tower."""
    model = write_qwen35(tmp_path / "Q", seed=_seed())
    for overlay, ok in ((BOTH, False), (QWEN38_OVERLAY, True)):
        cache = tmp_path / ("c-ok" if ok else "c-vision")
        request = ServerRequest(model=str(model), tp_sizes=(2,), cache_dir=str(cache), bits=6,
                              quantization_config=overlay, encoder_root=ENC[0], encoder_revision=ENC[1])
        fake_warm(request, monkeypatch)
        code, out, err = cli("cache", "check", "--json", str(model), "--tp-size", "2", "--cache-dir", cache,
                             "--quantization-config", overlay, "--encoder-root", ENC[0], "--encoder-revision", ENC[1])
        doc = json.loads(out)
        assert doc["hit"] == doc["lookups"] > 0 and doc["miss"] == 0
        assert (code, doc["ok"]) == ((0, True) if ok else (1, False)), err
        unplanned = [c for c in doc["causes"] if c["kind"] == "unplanned"]
        assert bool(unplanned) is not ok
        if not ok:
            assert unplanned[0]["fields"] == ["not_modelled"] and "visual" in unplanned[0]["findings"][0]["text"]


def test_a_miss_from_the_tp_size_is_blamed_on_the_tp_size_not_the_overlay(tmp_path, cli, monkeypatch):
    """down_proj (K = 768) is 128-aligned at TP 2 (384 a rank) but not at TP 4 (192): a warm at TP 4 wrote no entry
    for it, and a TP 2 server misses it. The overlay is the same; the fix is the TP size."""
    model = write_llama_checkpoint(tmp_path / "M", hidden=512, heads=4, kv_heads=4, intermediate=768, layers=2,
                                   vocab=512, seed=_seed())
    cache = tmp_path / "c"
    request = ServerRequest(model=str(model), tp_sizes=(4,), cache_dir=str(cache), bits=6, quantization_config=QC,
                          encoder_root=ENC[0], encoder_revision=ENC[1])
    fake_warm(request, monkeypatch)
    code, out, err = cli("cache", "check", "--json", str(model), "--tp-size", "2", "--cache-dir", cache,
                         "--quantization-config", QC, "--encoder-root", ENC[0], "--encoder-revision", ENC[1])
    doc = json.loads(out)
    assert code == 1, err
    # the independent server decides which look-ups miss: exactly the ones the check calls misses
    mid = server_model_identity(str(Path(model).resolve()))
    eid = server_encoder_identity(ENC[0], ENC[1])
    server_miss = {(e["prefix"], e["tp_rank"]) for e in doc["entries"]
                   if server_lookup(cache, mid, eid, e["prefix"], 6, 2, e["tp_rank"], e["input_size"],
                                    e["output_size"]) is None}
    check_miss = {(e["prefix"], e["tp_rank"]) for e in doc["entries"] if e["state"] == "miss"}
    assert server_miss == check_miss and any(p.endswith("down_proj") for p, _ in check_miss)
    tp_causes = [c for c in doc["causes"] if "tp_layout" in c["fields"]]
    blamed = {(j["prefix"], j["tp_rank"]) for c in tp_causes for j in c["lookups"]}
    down = {(p, r) for p, r in check_miss if p.endswith("down_proj")}
    assert down and down <= blamed
    for c in doc["causes"]:
        if {(j["prefix"], j["tp_rank"]) for j in c["lookups"]} & down:
            assert "overlay" not in c["fields"], c
    [f] = [f for c in tp_causes for f in c["findings"] if "128-aligned" in f["text"]]
    assert "--tp-size 2" in f["fix"] and "TP 4" in f["text"]
