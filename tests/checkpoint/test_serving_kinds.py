"""Checkpoint kinds as the fork's ``Exl3Config`` reads them, and the refusals it starts with (issue 11).

The expected messages are the server's reasons (``exl3.py``: ``_validate_storage_metadata``,
``_configure_rank_sliced``), so that a user who diffs our error against the server's log sees the same cause.
"""

from __future__ import annotations

import copy
import json

import pytest

from exl3tool.checkpoint.routing import NO_STORAGE_REASON, NotServable, serving_kind
from exl3tool.checkpoint.synthetic import exl3_record

from test_overlay import _cli
from exl3tool.checkpoint.tiny import EXL3_SUMMARY, write_mla
from exl3tool.releases import newest
from helpers import ENC_ARGS as ENC

SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
SHARED_H = "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}"
RANK_SLICED = {"format": "exl3-trellis", "bits": 4, "codebook": "mcg", "experts_per_layer": 4, "moe_layers": [1, 1],
               "tensor_schema": SCHEMA, "tp": 2}
TEXT = {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 4}


def _config(storage=None, **qc) -> dict:
    return dict(TEXT, quantization_config=dict(EXL3_SUMMARY, **({"tensor_storage": storage} if storage is not None
                                                                  else {}), **qc))


def test_standard_kind_reads_inline_storage_then_the_file():
    rec = {"model.layers.0.mlp.down_proj": exl3_record("model.layers.0.mlp.down_proj", 256, 128)}
    inline = serving_kind(_config(rec), None, release=newest())
    from_file = serving_kind(_config(), {"tensor_storage": rec}, release=newest())
    assert inline.kind == from_file.kind == "exl3" and inline.required_tp is None
    assert from_file.storage.is_exl3("model.layers.0.mlp.down_proj")
    assert not from_file.storage.is_exl3("model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("config_storage, file", [(None, None), ({}, None), (None, {}), (None, {"tensor_storage": {}}),
                                                  ({}, {"tensor_storage": []})],
                         ids=["no-file", "empty-inline", "file-without-map", "empty-map", "map-not-a-dict"])
def test_missing_or_empty_tensor_storage_is_the_servers_refusal(config_storage, file):
    with pytest.raises(NotServable) as err:
        serving_kind(_config(config_storage), file, release=newest())
    assert str(err.value) == NO_STORAGE_REASON


def _bad_records() -> list[tuple[dict, str]]:
    good = exl3_record("model.layers.0.mlp.down_proj", 256, 128)

    def without(*suffixes):
        rec = copy.deepcopy(good)
        rec["stored_tensors"] = {k: v for k, v in rec["stored_tensors"].items() if k.rsplit(".", 1)[-1] not in suffixes}
        return rec

    both = copy.deepcopy(good)
    both["stored_tensors"]["model.layers.0.mlp.down_proj.mul1"] = {"shape": [1], "torch_dtype": "int32"}
    p = "model.layers.0.mlp.down_proj"
    return [
        ({p: {"quant_format": "fp8"}}, "quantization_config.json has no EXL3 tensor records"),
        ({p: without("trellis")}, f"{p}: missing trellis"),
        ({p: without("suh", "svh")}, f"{p}: missing suh|su,svh|sv"),
        ({p: both}, f"{p}: both mcg and mul1 are present"),
    ]


@pytest.mark.parametrize("storage, why", _bad_records(),
                         ids=["no-exl3-record", "no-trellis", "no-scales", "two-codebooks"])
def test_invalid_exl3_records_are_refused_naming_the_module(storage, why):
    with pytest.raises(NotServable) as err:
        serving_kind(_config(storage), None, release=newest())
    assert why in str(err.value)


def test_su_sv_spellings_are_valid_records():
    rec = copy.deepcopy(exl3_record("model.layers.0.mlp.down_proj", 256, 128))
    rec["stored_tensors"] = {k.replace(".suh", ".su").replace(".svh", ".sv"): v
                             for k, v in rec["stored_tensors"].items()}
    assert serving_kind(_config({"model.layers.0.mlp.down_proj": rec}), None, release=newest()).kind == "exl3"


def _hybrid(**changes) -> dict:
    meta = dict(RANK_SLICED, **changes)
    return {k: v for k, v in meta.items() if v is not None}


def test_rank_sliced_kind_skips_the_storage_map_and_pins_the_tp_size():
    kind = serving_kind(dict(TEXT, hybrid_tr3_tail=_hybrid()), None, release=newest())  # no quant_method, no tensor_storage anywhere
    assert kind.kind == "rank_sliced" and kind.required_tp == 2
    assert kind.tp_refusal(2) is None
    assert "checkpoint=2, runtime=4" in kind.tp_refusal(4)
    mixed = serving_kind(dict(TEXT, hybrid_tr3_tail=_hybrid(bits="mixed", k_values=[3, 6],
                                                            bits_per_expert="bits.json")), None, release=newest())
    shared = serving_kind(dict(TEXT, hybrid_tr3_tail=_hybrid(rotation_layout="shared_h_v1",
                                                             shared_h_tensor_schema=SHARED_H)), None, release=newest())
    assert mixed.kind == shared.kind == "rank_sliced"


@pytest.mark.parametrize("changes, why", [
    ({"tp": None, "codebook": None}, "rank-sliced EXL3 metadata is missing: codebook, tp"),
    ({"codebook": "mul1"}, "rank-sliced EXL3 currently requires the MCG codebook, got 'mul1'"),
    ({"moe_layers": [3, 1]}, "rank-sliced EXL3 moe_layers must be [first, last]"),
    ({"moe_layers": ["a", 1]}, "rank-sliced EXL3 moe_layers must be [first, last]"),
    ({"tensor_schema": "experts.{E}"}, "unsupported rank-sliced EXL3 tensor schema: 'experts.{E}'"),
    ({"rotation_layout": "per_row"}, "unsupported rank-sliced EXL3 rotation_layout: 'per_row'"),
    ({"rotation_layout": "shared_h_v1"}, "shared_h_v1 rank-sliced EXL3 requires shared_h_tensor_schema="),
    ({"shared_h_tensor_schema": SHARED_H}, "shared_h_tensor_schema is only valid with rotation_layout='shared_h_v1'"),
    ({"bits": "mixed", "k_values": [4, 8], "bits_per_expert": "b.json"}, "requires k_values within 3..6"),
    ({"bits": "mixed", "k_values": [4]}, "mixed rank-sliced EXL3 requires a bits_per_expert JSON reference"),
    ({"experts_per_layer": 8}, "expert count does not match the model: checkpoint=8, model=4"),
], ids=["missing", "codebook", "layers-order", "layers-type", "schema", "layout", "shared-h-schema", "shared-h-alone",
        "k-values", "bits-per-expert", "experts"])
def test_rank_sliced_refusals_are_the_servers(changes, why):
    with pytest.raises(NotServable) as err:
        serving_kind(dict(TEXT, hybrid_tr3_tail=_hybrid(**changes)), None, release=newest())
    assert why in str(err.value)


def test_rank_sliced_checkpoint_plans_at_its_tp_only(tmp_path, capsys):
    """An MLA checkpoint marked rank-sliced for TP 2: the dense layers plan at TP 2, TP 4 is the server's refusal."""
    model = write_mla(tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["hybrid_tr3_tail"] = _hybrid(moe_layers=[1, 1])
    (model / "config.json").write_text(json.dumps(cfg))
    cache = ["--cache-dir", str(tmp_path / "c"), *ENC]
    # the rank-sliced kind reads only config.json's inline map: q_b_proj, stored as EXL3 per the file's map, counts
    # as BF16 and its BF16 weight is missing, as it would be for the server
    code, _, err = _cli(["cache", "warm", str(model), "--tp-size", "2", "--dry-run", *cache], capsys)
    assert code == 2 and "no tensor 'model.layers.1.self_attn.q_b_proj.weight'" in err, err
    cfg["quantization_config"]["tensor_storage"] = json.loads((model / "quantization_config.json").read_text())[
        "tensor_storage"]
    (model / "config.json").write_text(json.dumps(cfg))
    code, out, err = _cli(["cache", "warm", str(model), "--tp-size", "2", "--dry-run", "--json", *cache], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["checkpoint_kind"] == "rank_sliced" and doc["server_lookup"] is True
    planned = {j["prefix"] for j in doc["jobs"]}
    assert planned >= {"model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"}
    assert "model.layers.1.self_attn.q_b_proj" not in planned
    code, _, err = _cli(["cache", "warm", str(model), "--tp-size", "4", "--dry-run", *cache], capsys)
    assert code == 2 and "rank-sliced EXL3 checkpoint TP does not match runtime: checkpoint=2, runtime=4" in err
    assert "Traceback" not in err and not (tmp_path / "c").exists()


def test_invalid_records_exit_2_with_the_servers_reason(tmp_path, capsys):
    model = write_mla(tmp_path / "m")
    quant = json.loads((model / "quantization_config.json").read_text())
    record = next(iter(quant["tensor_storage"].values()))
    record["stored_tensors"] = {k: v for k, v in record["stored_tensors"].items() if not k.endswith(".trellis")}
    (model / "quantization_config.json").write_text(json.dumps(quant))
    code, _, err = _cli(["encode", str(model), "--dry-run", "--cache-dir", str(tmp_path / "c"), *ENC], capsys)
    assert code == 2 and "Invalid EXL3 tensor metadata" in err and "missing trellis" in err and "Traceback" not in err
