"""Layer plans: prefixes and parallel styles per family, rank sizes per TP size, 128-alignment skips, globs."""

from __future__ import annotations

import json
import shutil

import pytest

from exl3tool.checkpoint import (
    SUPPORTED_ARCHITECTURES, is_shared_expert_projection, open_checkpoint, plan_layers, write_checkpoint,
)
from exl3tool.checkpoint.synthetic import exl3_record, exl3_tensors, write_llama_checkpoint
from exl3tool.errors import ConfigError, InputError
from exl3tool.releases import newest

LLAMA_MODULES = [("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "row"),
                 ("mlp.gate_up_proj", "merged_column"), ("mlp.down_proj", "row")]

# (K_r, N_r) per module for hidden 256, 4 heads x 64, 2 KV heads, intermediate 512, worked out by hand.
EXPECTED_SIZES = {
    1: {"qkv_proj": (256, 512), "o_proj": (256, 256), "gate_up_proj": (256, 1024), "down_proj": (512, 256)},
    2: {"qkv_proj": (256, 256), "o_proj": (128, 256), "gate_up_proj": (256, 512), "down_proj": (256, 256)},
    4: {"qkv_proj": (256, 192), "o_proj": (64, 256), "gate_up_proj": (256, 256), "down_proj": (128, 256)},
}


@pytest.fixture
def tiny_plan(offline_hub):
    return plan_layers(open_checkpoint("test-org/tiny-llama", revision="main"), release=newest())


def test_llama_prefixes_styles_sources(tiny_plan):
    assert tiny_plan.architecture == "LlamaForCausalLM"
    got = [(x.prefix, x.parallel) for x in tiny_plan.layers]
    assert got == [(f"model.layers.{i}.{m}", p) for i in range(2) for m, p in LLAMA_MODULES]
    qkv, o, gate_up, down = tiny_plan.layers[:4]
    assert qkv.sources == tuple(f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
    assert qkv.part_sizes == (256, 128, 128)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.head_dim, qkv.v_head_dim) == (4, 2, 64, 64)
    assert gate_up.sources == ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert gate_up.part_sizes == (512, 512) and (gate_up.in_features, gate_up.out_features) == (256, 1024)
    assert (down.in_features, down.out_features) == (512, 256)
    assert not any("lm_head" in x.prefix or "embed" in x.prefix for x in tiny_plan.layers)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_sizes(tiny_plan, tp):
    jobs = tiny_plan.for_tp(tp, include_skipped=True)
    assert len(jobs) == len(tiny_plan.layers) * tp
    for job in jobs:
        assert (job.input_size, job.output_size) == EXPECTED_SIZES[tp][job.prefix.rsplit(".", 1)[1]]
        assert job.tp_size == tp
    for layer in tiny_plan.layers:
        assert [j.tp_rank for j in jobs if j.layer is layer] == list(range(tp))


def test_alignment_skips_at_tp4(tiny_plan):
    assert tiny_plan.skipped(1) == [] and tiny_plan.skipped(2) == []
    skipped = tiny_plan.skipped(4)
    prefixes = {p for p, _, _ in skipped}
    assert prefixes == {f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("o_proj", "qkv_proj")}
    assert sorted(r for p, r, _ in skipped if p == "model.layers.0.self_attn.o_proj") == [0, 1, 2, 3]
    reason = next(why for p, _, why in skipped if p == "model.layers.0.self_attn.o_proj")
    assert "K_r 64 is not a multiple of 128" in reason and "unencoded" in reason
    jobs = tiny_plan.for_tp(4)
    assert {j.prefix for j in jobs}.isdisjoint(prefixes)
    assert len(jobs) == 4 * 4 and all(j.aligned for j in jobs)


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_size_vllm_cannot_shard(tiny_plan, tp):
    with pytest.raises(ConfigError, match=rf"4 attention heads are not divisible by tensor-parallel size {tp}"):
        tiny_plan.for_tp(tp)
    with pytest.raises(ConfigError):
        tiny_plan.skipped(tp)
    with pytest.raises(ConfigError, match="positive integer"):
        tiny_plan.for_tp(0)


def test_layer_and_exclude_globs(offline_hub):
    ckpt = open_checkpoint("test-org/tiny-llama")
    plan = plan_layers(ckpt, layers=["model.layers.1.*"], exclude=["*.o_proj"], release=newest())
    assert [x.prefix for x in plan.layers] == [
        "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ConfigError, match="no eligible layer matches --layers 'model.layers.9.*'"):
        plan_layers(ckpt, layers=["model.layers.9.*"], release=newest())


def test_minilm_unknown_architecture(minilm_dir):
    ckpt = open_checkpoint(str(minilm_dir))
    with pytest.raises(ConfigError) as e:
        plan_layers(ckpt, release=newest())
    msg = str(e.value)
    assert "BertModel" in msg and "--layers 'GLOB'" in msg
    assert all(a in msg for a in SUPPORTED_ARCHITECTURES)


def test_minilm_layer_globs(minilm_dir):
    ckpt = open_checkpoint(str(minilm_dir))
    plan = plan_layers(ckpt, layers=["encoder.layer.0.*"], release=newest())
    shapes = {x.prefix: (x.in_features, x.out_features) for x in plan.layers}
    assert shapes == {
        "encoder.layer.0.attention.self.query": (384, 384),
        "encoder.layer.0.attention.self.key": (384, 384),
        "encoder.layer.0.attention.self.value": (384, 384),
        "encoder.layer.0.attention.output.dense": (384, 384),
        "encoder.layer.0.intermediate.dense": (384, 1536),
        "encoder.layer.0.output.dense": (1536, 384),
    }
    assert all(x.parallel == "replicated" and x.sources == (x.prefix + ".weight",) for x in plan.layers)
    jobs = plan.for_tp(2)
    assert len(jobs) == 12 and plan.skipped(2) == []
    assert {(j.prefix, j.tp_rank): (j.input_size, j.output_size) for j in jobs}[
        ("encoder.layer.0.output.dense", 1)] == (1536, 384)
    # embeddings never, even when a glob selects them
    with pytest.raises(ConfigError, match=r"no eligible layer matches --layers 'embeddings\.\*'"):
        plan_layers(ckpt, layers=["embeddings.*"], release=newest())


def _write_moe(path, arch: str, *, shared: bool) -> str:
    """A one-layer EXL3 MoE checkpoint (hidden 128, 4 experts stored as EXL3, the rest BF16); returns its directory."""
    h, e, inter = 128, 4, 256
    t = [("model.embed_tokens.weight", (64, h)),
         ("model.layers.0.self_attn.q_proj.weight", (4 * 32, h)),
         ("model.layers.0.self_attn.k_proj.weight", (2 * 32, h)),
         ("model.layers.0.self_attn.v_proj.weight", (2 * 32, h)),
         ("model.layers.0.self_attn.o_proj.weight", (h, 4 * 32)),
         ("model.layers.0.mlp.gate.weight", (e, h)),
         ("lm_head.weight", (64, h))]
    storage = {}
    for x in range(e):
        for m, (k, n) in (("gate_proj", (h, inter)), ("up_proj", (h, inter)), ("down_proj", (inter, h))):
            t += exl3_tensors(f"model.layers.0.mlp.experts.{x}.{m}", k, n)
            storage[f"model.layers.0.mlp.experts.{x}.{m}"] = exl3_record(f"model.layers.0.mlp.experts.{x}.{m}", k, n)
    if shared:
        t += [("model.layers.0.mlp.shared_expert.gate_proj.weight", (inter, h)),
              ("model.layers.0.mlp.shared_expert.up_proj.weight", (inter, h)),
              ("model.layers.0.mlp.shared_expert.down_proj.weight", (h, inter)),
              ("model.layers.0.mlp.shared_expert_gate.weight", (1, h))]
    qc = {"quant_method": "exl3", "bits": 4.0, "codebook": "mcg"}
    config = {"architectures": [arch], "hidden_size": h, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "num_hidden_layers": 1, "torch_dtype": "bfloat16", "quantization_config": qc}
    return str(write_checkpoint(path, config, t, quantization_config={**qc, "tensor_storage": storage}))


from helpers import BOTH  # noqa: E402


def test_qwen3_moe_router_and_shared_experts(tmp_path):
    ckpt = open_checkpoint(_write_moe(tmp_path / "q3", "Qwen3MoeForCausalLM", shared=True))
    default = plan_layers(ckpt, release=newest())  # the default overlay has no shared_experts spec
    plain = {x.prefix: x.parallel for x in default.layers}
    assert plain == {"model.layers.0.self_attn.qkv_proj": "qkv", "model.layers.0.self_attn.o_proj": "row",
                     "model.layers.0.mlp.gate": "replicated"}
    assert {(x.prefix, x.reason) for x in default.excluded} == {
        ("model.layers.0.mlp.shared_expert.gate_up_proj", "no_spec"),
        ("model.layers.0.mlp.shared_expert.down_proj", "no_spec")}
    with_shared = {x.prefix: x.parallel for x in plan_layers(ckpt, overlay=BOTH, release=newest()).layers}
    assert with_shared == {**plain, "model.layers.0.mlp.shared_expert.gate_up_proj": "merged_column",
                           "model.layers.0.mlp.shared_expert.down_proj": "row"}
    router = next(x for x in default.layers if x.prefix.endswith("mlp.gate"))
    assert (router.in_features, router.out_features) == (128, 4)


def test_qwen2_moe_router_never(tmp_path):
    ckpt = open_checkpoint(_write_moe(tmp_path / "q2", "Qwen2MoeForCausalLM", shared=True))
    prefixes = [x.prefix for x in plan_layers(ckpt, overlay=BOTH, release=newest()).layers]
    assert prefixes == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                        "model.layers.0.mlp.shared_expert.gate_up_proj", "model.layers.0.mlp.shared_expert.down_proj"]


def test_config_that_does_not_fit_the_weights(tiny_hub, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_hub[2], d)
    config = json.loads((d / "config.json").read_text())
    config["hidden_size"] = 512
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"q_proj.weight is \[256, 256\] but config.json gives \[256, 512\]"):
        plan_layers(open_checkpoint(str(d)), release=newest())
    config["hidden_size"], config["num_key_value_heads"] = 256, 1
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"k_proj.weight is \[128, 256\] but config.json gives \[64, 256\] .*"
                                         r"rows: 1 KV heads x head_dim 64"):
        plan_layers(open_checkpoint(str(d)), release=newest())


@pytest.mark.parametrize("module, expected", [
    ("self_attn.k_proj", "[128, 256]"),  # columns: hidden_size
    ("mlp.down_proj", "[256, *]"),  # a row-parallel layer writes hidden_size rows
])
def test_a_weight_stored_transposed_is_refused_naming_file_and_shapes(tmp_path, module, expected):
    """A weight whose header shape contradicts config.json (here: stored transposed) is refused before anything is
    planned from it: the tensor, its file, the shape found and the shape the config gives; never planned (and
    encoded) in the wrong orientation."""
    from safetensors.torch import load_file, save_file

    d = write_llama_checkpoint(tmp_path / "ck", layers=1, shards=1, intermediate=384)
    shard = d / "model.safetensors"
    tensors = load_file(str(shard))
    name = f"model.layers.0.{module}.weight"
    found = list(tensors[name].shape)[::-1]
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(InputError) as err:
        plan_layers(open_checkpoint(str(d)), release=newest())
    text = str(err.value)
    assert text.startswith(f"{shard}: {name} is [{found[0]}, {found[1]}] but config.json gives {expected}"), text
    assert "\n" not in text


def _with_storage(tiny_hub, tmp_path, exl3_modules):
    d = tmp_path / "ck"
    shutil.copytree(tiny_hub[2], d)
    path = d / "quantization_config.json"
    quant = json.loads(path.read_text())
    storage = quant["tensor_storage"]
    storage.update({m: exl3_record(m, 256, 256) for m in exl3_modules})
    storage["model.layers.1.self_attn.o_proj"] = {"quant_format": "bf16"}
    path.write_text(json.dumps(quant))
    return open_checkpoint(str(d))


def test_exl3_serialized_layers_are_not_planned(tiny_hub, tmp_path):
    ckpt = _with_storage(tiny_hub, tmp_path, [f"model.layers.0.self_attn.{x}_proj" for x in "qkv"]
                         + ["layers.1.mlp.down_proj"])  # a name without "model." matches too
    plan = plan_layers(ckpt, release=newest())
    assert plan.serialized == ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj")
    assert [(x.prefix, x.reason) for x in plan.excluded] == [
        ("model.layers.0.self_attn.qkv_proj", "stored_exl3"), ("model.layers.1.mlp.down_proj", "stored_exl3")]
    prefixes = {x.prefix for x in plan.layers}
    assert len(prefixes) == 6 and not prefixes & set(plan.serialized)
    assert "model.layers.1.self_attn.o_proj" in prefixes  # a bf16 record is not EXL3


def test_mixed_exl3_and_bf16_sources(tiny_hub, tmp_path):
    ckpt = _with_storage(tiny_hub, tmp_path, ["model.layers.0.mlp.gate_proj"])
    with pytest.raises(ConfigError, match="'model.layers.0.mlp.gate_up_proj' mixes EXL3 and BF16 source shards"):
        plan_layers(ckpt, release=newest())


def _ov(ignore=None, linear=True, shared=False) -> str:
    doc = {"linear": "mxfp8"} if linear else {}
    if shared:
        doc["shared_experts"] = {"weight": "mxfp8"}
    if ignore is not None:
        doc["ignore"] = ignore
    return json.dumps(doc)


def test_server_ignore_rules(offline_hub):
    ckpt = open_checkpoint("test-org/tiny-llama")
    plan = plan_layers(ckpt, overlay=_ov(["re:.*layers\\.1\\.self_attn\\.[qkv]_proj$", "model.layers.0.mlp.down_proj"]), release=newest())
    prefixes = [x.prefix for x in plan.layers]
    assert "model.layers.1.self_attn.qkv_proj" not in prefixes and "model.layers.0.mlp.down_proj" not in prefixes
    assert len(prefixes) == 6
    assert {x.prefix for x in plan.excluded if x.reason == "ignored"} == {
        "model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"}
    # the fused name listed exactly is matched directly
    assert "model.layers.0.mlp.gate_up_proj" not in [
        x.prefix for x in plan_layers(ckpt, overlay=_ov(["model.layers.0.mlp.gate_up_proj"]), release=newest()).layers]
    with pytest.raises(ConfigError, match="ignore covers only q_proj"):
        plan_layers(ckpt, overlay=_ov(["model.layers.0.self_attn.q_proj"]), release=newest())
    assert plan_layers(ckpt, overlay=_ov(linear=False, shared=True), release=newest()).layers == ()


def test_shared_experts_follow_their_own_spec(tmp_path):
    assert is_shared_expert_projection("model.layers.3.mlp.shared_experts.down_proj")
    assert not is_shared_expert_projection("model.layers.3.mlp.down_proj")
    ckpt = open_checkpoint(_write_moe(tmp_path / "q2", "Qwen2MoeForCausalLM", shared=True))
    plan = plan_layers(ckpt, overlay=_ov(["re:.*"], shared=True), release=newest())  # ignore never applies to shared experts
    assert [x.prefix for x in plan.layers] == [
        "model.layers.0.mlp.shared_expert.gate_up_proj", "model.layers.0.mlp.shared_expert.down_proj"]
    assert {x.spec for x in plan.layers} == {"shared_experts"}
