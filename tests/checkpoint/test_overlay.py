"""--quantization-config parsed and validated as the fork does; the CLI's refusals (exit 2) and dry-run JSON."""

from __future__ import annotations

import json

import pytest

from exl3tool.checkpoint import (
    DEFAULT_OVERLAY_JSON, QuantSpec, open_checkpoint, parse_overlay, resolve_overlay, should_ignore_layer,
    tensors_to_fetch, write_llama_checkpoint,
)
from exl3tool.cli import main
from exl3tool.errors import ConfigError

from exl3tool.checkpoint.tiny import QWEN38_OVERLAY, write_mla
from exl3tool.releases import newest
from helpers import ENC_ARGS as ENC, LINEAR

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}


def test_spec_forms():
    mx = QuantSpec("mxfp8")
    for text in ('{"linear": "mxfp8"}', '{"linear": {"weight": "mxfp8"}}', '{"linear": {"weight": "mxfp8", '
                 '"activation": null}, "shared_experts": null}', DEFAULT_OVERLAY_JSON):
        o = parse_overlay(text)
        assert o.linear == mx and o.shared_experts is None and o.ignore == ()
    o = parse_overlay('{"shared_experts": "mxfp8"}')
    assert o.linear is None and o.shared_experts == mx
    assert o.spec_for("model.layers.0.mlp.shared_experts.down_proj") == "shared_experts"
    assert o.spec_for("model.layers.0.mlp.down_proj") is None
    r = parse_overlay(QWEN38_OVERLAY)
    assert r.ignore == ("re:.*visual\\..*", "re:.*in_proj_a$", "re:.*in_proj_b$", "re:.*in_proj_ba$",
                        "re:.*mtp\\..*", "lm_head")
    default = resolve_overlay(None)
    assert default.default and default.text == DEFAULT_OVERLAY_JSON and default.linear == mx
    assert resolve_overlay(None, shared_experts=True).shared_experts == mx
    with pytest.raises(ConfigError, match="--shared-experts conflicts"):
        resolve_overlay('{"linear": "mxfp8"}', shared_experts=True)


@pytest.mark.parametrize("text, why", [
    ('{"linear": "mxfp8", "lienar": 1}', "unknown key 'lienar'"),
    ('{"linear": {"weight": "mxfp8", "scheme": "x"}}', "unknown key 'scheme'"),
    ('{"linear": "mxfp8", "moe": "mxfp8"}', "a 'moe' spec is not allowed"),
    ('{"linear": "fp8_per_block"}', "only supports weight='mxfp8'"),
    ('{"linear": {"weight": "mxfp8", "activation": "mxfp8"}}', "no activation override"),
    ('{"shared_experts": "mxfp8", "ignore": ["lm_head"]}', "'ignore' only filters the 'linear' overlay"),
    ("{}", "sets neither 'linear' nor 'shared_experts'"),
    ('{"linear": "int8_per_channel_weight_only"}', "does not define a linear spec"),
    ('{"linear": "fp9"}', "unknown quantization name 'fp9'"),
    ('{"linear": "mxfp8", "ignore": "lm_head"}', "expected a list of strings"),
    ('["linear"]', "must be a JSON object"),
    ("{'linear': 'mxfp8'}", "not valid JSON"),
    ('{"linear": "mxfp8", "ignore": ["re:.*visual\\\\.(", "lm_head"]}', "not a valid regular expression"),
    ('{"linear": "mxfp8", "ignore": ["re:[z-a]"]}', "'re:\\[z-a\\]' is not a valid regular expression"),
])
def test_refused_overlays(text, why):
    with pytest.raises(ConfigError, match=why):
        parse_overlay(text)


def test_should_ignore_layer_semantics():
    p = "model.layers.3.self_attn.qkv_proj"
    assert should_ignore_layer("model.layers.3.mlp.down_proj", ["model.layers.3.mlp.down_proj"], PACKED)
    assert not should_ignore_layer("model.layers.3.mlp.down_proj", ["down_proj"], PACKED)  # exact, not a suffix
    assert not should_ignore_layer("model.layers.3.mlp.down_proj", ["re:layers"], PACKED)  # re.match is anchored
    assert should_ignore_layer("model.layers.3.mlp.down_proj", ["re:.*down_proj$"], PACKED)
    assert should_ignore_layer(p, ["re:.*\\.[qkv]_proj$"], PACKED)  # fused: through its unfused names
    assert should_ignore_layer(p, [p], PACKED)  # listed exactly: matched directly
    with pytest.raises(ConfigError, match="different quantization schemes"):
        should_ignore_layer(p, ["re:.*q_proj$"], PACKED)
    f = "model.layers.0.self_attn.fused_qkv_a_proj"
    assert should_ignore_layer(f, ["re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$"], PACKED)


def _cli(args, capsys) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_refusals_exit_2(tmp_path, capsys):
    plain = write_llama_checkpoint(tmp_path / "plain", layers=1, shards=1, exl3_lm_head=False)
    cache = ["--cache-dir", str(tmp_path / "c"), *ENC]
    code, _, err = _cli(["cache", "warm", str(plain), "--dry-run", *cache], capsys)
    assert code == 2 and "not an EXL3 checkpoint" in err and "--layers" in err and "Traceback" not in err
    code, _, err = _cli(["encode", str(plain), "--quantization-config", '{"linear": "mxfp8", "lienar": 1}',
                         "--dry-run", *cache], capsys)
    assert code == 2 and "unknown key 'lienar'" in err
    code, _, err = _cli(["identity", str(plain), "--quantization-config", '{"moe": "mxfp8"}', *ENC], capsys)
    assert code == 2 and "a 'moe' spec is not allowed" in err
    code, _, err = _cli(["encode", str(plain), "--layers", "*.o_proj", "--quantization-config",
                         '{"linear": "mxfp8", "ignore": ["re:(unclosed"]}', "--dry-run", *cache], capsys)
    assert code == 2 and "'re:(unclosed' is not a valid regular expression" in err and "Traceback" not in err
    mixed = write_mla(tmp_path / "mixed")
    quant = json.loads((mixed / "quantization_config.json").read_text())
    quant["tensor_storage"]["model.layers.0.self_attn.q_a_proj"] = quant["tensor_storage"][
        "layers.1.self_attn.q_b_proj"]
    (mixed / "quantization_config.json").write_text(json.dumps(quant))
    code, _, err = _cli(["encode", str(mixed), "--tp-size", "2", "--dry-run", *cache], capsys)
    assert code == 2 and "'model.layers.0.self_attn.fused_qkv_a_proj' mixes EXL3 and BF16 source shards" in err
    assert not (tmp_path / "c").exists()


def test_generic_layers_mode_says_the_server_will_not_look_up(tmp_path, capsys):
    plain = write_llama_checkpoint(tmp_path / "plain", layers=1, shards=1, exl3_lm_head=False)
    code, out, err = _cli(["cache", "warm", str(plain), "--layers", "*.o_proj", "--dry-run", "--json",
                           "--cache-dir", str(tmp_path / "c"), *ENC], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["server_lookup"] is False and doc["checkpoint_kind"] is None
    assert "the server will not look these entries up" in err and "not an EXL3 checkpoint" in err
    assert [j["prefix"] for j in doc["jobs"]] == ["model.layers.0.self_attn.o_proj"]


def test_dry_run_json_lists_every_job_and_why(tmp_path, capsys):
    d = write_mla(tmp_path / "m")
    overlay = LINEAR
    code, out, err = _cli(["encode", str(d), "--tp-size", "2", "--quantization-config", overlay, "--dry-run",
                           "--json", "--cache-dir", str(tmp_path / "c"), *ENC], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["quantization_config"]["given"] == overlay and doc["quantization_config"]["default"] is False
    assert doc["checkpoint_kind"] == "exl3" and doc["server_lookup"] is True
    why = {(j["prefix"], j["tp_rank"]): (j["state"], j["why"]) for j in doc["jobs"]}
    assert why[("model.layers.0.self_attn.q_b_proj", 1)] == ("miss", "planned (linear spec)")
    state, text = why[("model.layers.0.self_attn.fused_qkv_a_proj", 0)]
    assert state == "skipped" and "N_r 320 is not a multiple of 128" in text
    not_planned = {e["prefix"]: e["reason"] for e in doc["not_planned"]}
    assert not_planned == {"model.layers.1.self_attn.q_b_proj": "stored_exl3",
                           "model.layers.1.mlp.shared_experts.gate_up_proj": "no_spec",
                           "model.layers.1.mlp.shared_experts.down_proj": "no_spec"}
    assert len(doc["jobs"]) == 2 * 9  # 9 planned modules (2 unaligned) x 2 ranks
    assert "quantization config: " + overlay in err


def test_tensors_to_fetch_reads_only_planned_sources(tmp_path):
    d = write_mla(tmp_path / "m")
    names = open_checkpoint(str(d)).tensor_names()
    config = json.loads((d / "config.json").read_text())
    wanted = tensors_to_fetch(d, config, names, LINEAR, release=newest())
    assert wanted == {
        f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in (
            "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj")
    } | {"model.layers.0.self_attn.q_b_proj.weight"} | {
        f"model.layers.0.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    # the same checkpoint without the EXL3 marker is refused anyway: nothing to fetch
    config.pop("quantization_config")
    assert tensors_to_fetch(d, config, names, None, release=newest()) == set()


def test_unknown_architecture_generic_mode(tmp_path):
    from exl3tool.checkpoint import plan_layers, write_checkpoint

    d = write_checkpoint(tmp_path / "bert", {"architectures": ["BertModel"], "hidden_size": 128},
                         [("embeddings.word_embeddings.weight", (64, 128)),
                          ("encoder.layer.0.attention.self.query.weight", (128, 128)),
                          ("encoder.layer.0.output.dense.weight", (128, 256))])
    with pytest.raises(ConfigError, match="BertModel has no known layer plan"):
        plan_layers(open_checkpoint(str(d)), release=newest())
    plan = plan_layers(open_checkpoint(str(d)), layers=["encoder.layer.0.*"], release=newest())
    assert [x.prefix for x in plan.layers] == ["encoder.layer.0.attention.self.query", "encoder.layer.0.output.dense"]
    assert not plan.server_lookup and "the server will not look them up" in plan.notes[0]
