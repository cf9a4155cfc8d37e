"""The fork's server releases as data (exl3tool.releases) and the per-release findings of issue 42.

Each false claim of the issue is a test that fails on the code before it: a 4304-wide shard (the server does not
start: fork issue #311), an r7 routed-expert checkpoint (the server serves it whatever its quant_method), a ``~`` in
VLLM_EXL3_ENCODER_SOURCE (the server's import does not expand it), and the variables newer launches set (known,
no key changes). Hit or miss is decided by the independent server of ``tests/helpers.py``.
"""

from __future__ import annotations

import json
import shlex

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.errors import ConfigError
from exl3tool.plan import ServerRequest, prepare
from exl3tool.releases import (
    CACHE_MODULES, NEWEST, RELEASES, default_release, release, release_from_labels, variable_note,
)

from helpers import (
    ENC, ENC_ARGS, LINEAR, TINY_1, fake_warm, run, server_cache_module, server_encoder_identity, server_lookup,
    server_model_identity,
)

CLEAN = ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ONLINE_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME",
         "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)


# --- the table ----------------------------------------------------------------------------------------------------

def test_the_table_names_every_release_and_its_cache_module():
    assert NEWEST == "infernal-invocation-r18" and default_release()[0].name == NEWEST
    for r in RELEASES:
        assert r.cache is None or r.cache in CACHE_MODULES
        line, _, n = r.name.rpartition("-r")
        if r.online_cache:  # the independent reading of which module each release ships
            assert r.cache == server_cache_module(r.name), r.name
        else:
            assert (line == "gilded-gnosis" and int(n) < 20) or (line == "infernal-invocation" and int(n) < 5)
    older, newer = CACHE_MODULES["older"], CACHE_MODULES["newer"]
    assert (older.xdg_cache_home, older.lock_timeout_s, older.nonfinite_checks) == (False, None, False)
    assert (newer.xdg_cache_home, newer.lock_timeout_s, newer.nonfinite_checks) == (True, 600.0, True)
    assert release("gilded-gnosis-r34").retry_nonfinite and not release("gilded-gnosis-r33").retry_nonfinite


@pytest.mark.parametrize("spelled, name", [
    ("gilded-gnosis-r33", "gilded-gnosis-r33"), ("gilded-gnosis-v20-r33", "gilded-gnosis-r33"),
    ("GG r34", "gilded-gnosis-r34"), ("ii-r5", "infernal-invocation-r5"),
    ("Infernal_Invocation_R18", "infernal-invocation-r18"),
])
def test_release_names_as_operators_write_them(spelled, name):
    assert release(spelled).name == name


def test_an_unknown_release_is_a_usage_error_listing_the_known(tiny_llama, tmp_path, capsys):
    with pytest.raises(ConfigError, match="gilded-gnosis-r5..r34"):
        release("gilded-gnosis-r99")
    code, _, err = run(["cache", "check", str(tiny_llama), "--server-release", "gg-r99", "--cache-dir",
                        str(tmp_path), *ENC_ARGS], capsys)
    assert code == 2 and "gg-r99" in err and "infernal-invocation-r2..r18" in err


def test_an_image_label_names_the_release():
    """The fork's images carry local-inference.vllm.integration.tree: the integration tree of their release."""
    r33 = release("gilded-gnosis-r33")
    assert release_from_labels({"local-inference.vllm.integration.tree": r33.tree}).cache == "older"
    assert release_from_labels({"local-inference.release.name": "infernal-invocation-r12"}).name == \
        "infernal-invocation-r12"
    assert release_from_labels({"local-inference.release.name": "infernal-invocation-cu133-torch213"}) is None
    rel, how = default_release(None, {"local-inference.vllm.integration.tree": r33.tree})
    assert rel.cache == "older" and "label" in how
    assert default_release("ii-r7", {"local-inference.vllm.integration.tree": r33.tree})[0].name == \
        "infernal-invocation-r7"  # --server-release wins


# --- a shard the server cannot build: K_r not a multiple of 32 (fork issue #311) ------------------------------------

@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A one-layer tiny Llama with the intermediate width of Qwen3.8's vision MLP (4304): down_proj has K=4304."""
    return write_llama_checkpoint(tmp_path_factory.mktemp("wide") / "M", **{**TINY_1, "intermediate": 4304},
                                  shards=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_4304_wide_shard_means_the_server_does_not_start(wide, tmp_path, monkeypatch, capsys, tp):
    """Before: every planned look-up hit, so `cache check` said all hit (exit 0) for a server that fails at start-up
    (the MXFP8 fallback refuses K_r % 32 != 0). The hits are the independent server's."""
    cache = tmp_path / "cache"
    request = ServerRequest(model=str(wide), tp_sizes=(tp,), cache_dir=str(cache), quantization_config=LINEAR, **ENC)
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    mid = server_model_identity(str(wide))
    eid = server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])
    looked = [j for j in plan.jobs if j.state != "skipped"]
    assert looked and all(server_lookup(cache, mid, eid, j.prefix, 6, tp, j.tp_rank, j.input_size, j.output_size)
                          for j in looked)  # every look-up the server makes hits
    k_r = 4304 // tp
    assert k_r % 128 and k_r % 32  # 128-unaligned (not encoded online) and not a multiple of 32 (MXFP8 refuses it)
    code, out, err = run(["cache", "check", str(wide), "--tp-size", str(tp), "--cache-dir", str(cache),
                          "--quantization-config", LINEAR, *ENC_ARGS], capsys)
    assert code == 1, err
    assert "this server will not start" in err and "(fork issue #311)" in err and "down_proj" in err
    assert f"K_r={k_r}" in err
    code, _, err = run(["cache", "check", str(wide), "--tp-size", str(tp), "--cache-dir", str(cache),
                        "--quantization-config", LINEAR, "--layers", "*.o_proj", *ENC_ARGS], capsys)
    assert code == 1 and "(fork issue #311)" in err  # --layers selects look-ups; the server still builds down_proj
    code, out, _ = run(["cache", "check", str(wide), "--tp-size", str(tp), "--cache-dir", str(cache),
                        "--quantization-config", LINEAR, "--json", *ENC_ARGS], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["miss"] == 0 and doc["start_failures"][0]["field"] == "start"


def test_a_128_unaligned_shard_that_is_32_aligned_starts(tmp_path, monkeypatch, capsys):
    """4320 = 33.75 x 128 = 135 x 32: the server builds it with MXFP8 and starts (the rule is not 'unaligned')."""
    model = write_llama_checkpoint(tmp_path / "M", **{**TINY_1, "intermediate": 4320}, shards=1)
    request = ServerRequest(model=str(model), cache_dir=str(tmp_path / "c"), quantization_config=LINEAR, **ENC)
    fake_warm(request, monkeypatch)
    code, _, err = run(["cache", "check", str(model), "--cache-dir", str(tmp_path / "c"), "--quantization-config",
                        LINEAR, *ENC_ARGS], capsys)
    assert code == 0, err
    assert "will not start" not in err


# --- r7 routed-expert checkpoints ----------------------------------------------------------------------------------

R7 = {"schema": "r7-complete-v2-checkpoint-v1", "codebook": "mcg", "bits": "mixed_tensor", "moe_layers": [3, 77],
      "k_values": [3, 4, 5]}


def _r7_checkpoint(path, **r7):
    model = write_llama_checkpoint(path, layers=1, shards=1)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "config_groups": {},
                                     "r7_routed_experts": {**R7, **r7}}
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_an_r7_checkpoint_is_served_whatever_its_quant_method(tmp_path, monkeypatch):
    """Before: refused as 'not an EXL3 checkpoint' (quant_method modelopt); the server takes r7_routed_experts
    checkpoints as EXL3 from gilded-gnosis-r34 and infernal-invocation-r5 on, and warmed entries hit there."""
    model = _r7_checkpoint(tmp_path / "M")
    cache = tmp_path / "cache"
    request = ServerRequest(model=str(model), tp_sizes=(2,), cache_dir=str(cache), quantization_config=LINEAR, **ENC)
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    assert any("r7" in n for n in plan.layer_plan.notes)
    mid, eid = server_model_identity(str(model)), server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])
    looked = [j for j in plan.jobs if j.state != "skipped"]
    assert len(looked) == 8  # qkv, o, gate_up, down at 2 ranks
    assert all(server_lookup(cache, mid, eid, j.prefix, 6, 2, j.tp_rank, j.input_size, j.output_size) for j in looked)
    with pytest.raises(ConfigError, match="does not read r7_routed_experts"):
        prepare(ServerRequest(model=str(model), cache_dir=str(cache), quantization_config=LINEAR,
                            server_release="gilded-gnosis-r33", **ENC))


@pytest.mark.parametrize("bad, why", [({"k_values": [3, 6]}, "unsupported k_values: \\[6\\]"),
                                      ({"bits": 3}, "mixed_tensor"), ({"moe_layers": [5, 2]}, "last >= first")])
def test_an_r7_block_the_server_refuses_is_refused_with_its_reason(tmp_path, bad, why):
    model = _r7_checkpoint(tmp_path / "M", **bad)
    with pytest.raises(ConfigError, match=why):
        prepare(ServerRequest(model=str(model), cache_dir=str(tmp_path / "c"), quantization_config=LINEAR, **ENC))


# --- a ~ in VLLM_EXL3_ENCODER_SOURCE ------------------------------------------------------------------------------

def test_a_tilde_encoder_root_with_a_miss_means_the_server_does_not_start(tiny_llama, tmp_path, monkeypatch, capsys):
    """The identity expands ~ (so entries keyed with it hit), the server's import of the encoder does not: all hits
    start, a miss fails the start. Before: reported as N misses the server would encode."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cache = tmp_path / "cache"
    args = ["cache", "check", str(tiny_llama), "--cache-dir", str(cache), "--quantization-config", LINEAR,
            "--encoder-root", "~/exllamav3", "--encoder-revision", "r"]
    code, _, err = run(args, capsys)
    assert code == 1 and "this server will not start" in err and "~/exllamav3" in err and "absolute" in err
    request = ServerRequest(model=str(tiny_llama), cache_dir=str(cache), quantization_config=LINEAR,
                          encoder_root="~/exllamav3", encoder_revision="r")
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    eid = server_encoder_identity(str(tmp_path / "home" / "exllamav3"), "r")  # the server expands ~ for its identity
    mid = server_model_identity(str(tiny_llama))
    assert all(server_lookup(cache, mid, eid, j.prefix, 6, 1, j.tp_rank, j.input_size, j.output_size)
               for j in plan.jobs if j.state != "skipped")
    code, _, err = run(args, capsys)
    assert code == 0 and "will not start" not in err  # every look-up hits: the encoder is never imported
    code, out, _ = run(["identity", str(tiny_llama), "--encoder-root", "~/exllamav3", "--encoder-revision", "r",
                        "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["encoder"]["identity"] == eid  # reported, and the identity is the server's
    assert any("starts with ~" in w and "import does not" in w for w in doc["warnings"])


# --- variables of newer launches ----------------------------------------------------------------------------------

NEWER_VARS = {"VLLM_EXL3_MULTIPRECISION": "1", "VLLM_EXL3_EMBED_ONLINE_BITS": "6", "VLLM_EXL3_FP4_LAYERS": ",",
              "VLLM_EXL3_FP6_LAYERS": "mlp.gate_up_proj", "VLLM_EXL3_GRAPH_DECODE": "1",
              "VLLM_EXL3_PREFILL_CAPACITY": "8192", "VLLM_EXL3_FP8DG_PREFILL_M": "0"}


def test_newer_variables_are_known_and_change_no_key(tiny_llama, tmp_path, capsys):
    base = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r "
            f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c")
    serve = f"vllm serve {tiny_llama} --quantization-config {shlex.quote(LINEAR)}"
    extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in NEWER_VARS.items())
    code, plain, err = run(["cache", "warm", "--dry-run", "--json", "--launch", f"env {base} {serve}"], capsys)
    assert code == 0, err
    code, newer, err = run(["cache", "warm", "--dry-run", "--json", "--launch", f"env {base} {extra} "
                            "VLLM_EXL3_NOT_A_REAL_KNOB=1 " + serve], capsys)
    assert code == 0, err
    digests = [sorted(j["digest"] for j in json.loads(doc)["jobs"]) for doc in (plain, newer)]
    assert digests[0] == digests[1] and digests[0]  # no key changes
    for name in NEWER_VARS:
        assert f"{name}={NEWER_VARS[name]}: known" in err and "changes no cache key" in err
    assert "VLLM_EXL3_NOT_A_REAL_KNOB=1: not a variable exl3tool knows" in err
    assert variable_note("VLLM_EXL3_ONLINE_TRELLIS_BITS", "6") is None  # a key variable is a setting, not a note


def test_a_release_without_the_online_cache_looks_nothing_up(tiny_llama, tmp_path, capsys):
    launch = (f"env VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r "
              f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c vllm serve {tiny_llama} --quantization-config "
              f"{shlex.quote(LINEAR)}")
    code, out, err = run(["cache", "check", "--json", "--server-release", "gilded-gnosis-r15", "--launch", launch],
                         capsys)
    doc = json.loads(out)
    assert code == 1 and doc["server_lookup"] is False and "no online EXL3 cache" in doc["lookup_off"][0]


def test_the_images_label_selects_the_release_of_a_launch(tiny_llama, tmp_path, monkeypatch):
    """An image labelled with gilded-gnosis-r33's integration tree gets the older cache module's root: its server
    ignores XDG_CACHE_HOME. (The image reader sets ``image_labels`` on the launch's settings.)"""
    import exl3tool.launch.request as req
    from exl3tool.launch import LaunchInput, apply_launch

    from helpers import server_cache_root

    real = req.resolve_launch
    tree = release("gilded-gnosis-r33").tree

    def labelled(*args, **kwargs):
        settings = real(*args, **kwargs)
        object.__setattr__(settings, "image_labels", {"local-inference.vllm.integration.tree": tree})
        return settings

    monkeypatch.setattr(req, "resolve_launch", labelled)
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    launch = (f"env HOME={env['HOME']} XDG_CACHE_HOME={env['XDG_CACHE_HOME']} VLLM_EXL3_ONLINE_TRELLIS_BITS=6 "
              f"VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r vllm serve {tiny_llama} "
              f"--quantization-config {shlex.quote(LINEAR)}")
    request, settings, _ = apply_launch(ServerRequest(model=""), set(), LaunchInput(text=launch), environ={})
    assert request.server_release == settings.server_release == "gilded-gnosis-r33"
    assert settings.settings["server_release"].source == "image label"
    assert request.cache_dir == str(server_cache_root(env, "older"))
    request, settings, _ = apply_launch(ServerRequest(model="", server_release="ii-r18"), {"server_release"},
                                        LaunchInput(text=launch), environ={})
    assert request.cache_dir == str(server_cache_root(env, "newer"))  # --server-release wins over the label


def test_a_release_without_the_online_cache_checked_without_a_launch(tiny_llama, tmp_path, capsys):
    code, out, err = run(["cache", "check", str(tiny_llama), "--server-release", "ii-r3", "--cache-dir",
                          str(tmp_path), "--json", *ENC_ARGS], capsys)
    assert code == 1 and json.loads(out)["server_lookup"] is False and "ships no online EXL3 cache" in out


def test_nothing_to_warm_for_a_release_without_the_online_cache(tiny_llama, tmp_path, capsys):
    code, _, err = run(["cache", "warm", str(tiny_llama), "--server-release", "gilded-gnosis-r19", "--dry-run",
                        "--cache-dir", str(tmp_path), *ENC_ARGS], capsys)
    assert code == 2 and "gilded-gnosis-r19 ships no online EXL3 cache" in err
