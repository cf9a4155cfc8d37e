"""`exl3tool hydrate`'s plan: which TP sizes OUT is checked for, what stays BF16 and why, the record in OUT that
`identity` and `cache check` read, per-layer bits. The server's side is the tests' own model of the fork's loader
(``helpers.server_tp_load``: ``_shard_tensors_for_tensor_parallel`` written from exl3.py, and
``helpers.server_online_lookups``), never exl3tool's slicing code; encodes are ``helpers.fake_encode`` (instant)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from exl3tool.checkpoint.hydrate_record import read_hydrate_record
from exl3tool.checkpoint.tiny import TINY_FAMILIES, write_tiny
from exl3tool.operations.hydrate import hydrate, plan_hydrate
from exl3tool.plan import ServerRequest

from helpers import ENC, fake_encode, run, served_experts, served_linear, server_online_lookups, server_tp_load
from seeds import fresh_seed

Q = "language_model.model.layers"
QC = "model.language_model.layers"  # the checkpoint's spelling (the experts' records)
# What each tiny family's server builds and loads, with vLLM's sizes, written from the model files and the builders'
# configs (exl3tool.checkpoint.tiny), not from exl3tool's layer plan: the layers a TP 1 server encodes online, and
# the modules SOURCE itself stores as EXL3 (STORED_IN_SOURCE: every rank slices them too).
# Qwen3.5/3.8 hybrid: hidden 128; GDN 2 key heads x 128, 4 value heads x 64 (in_proj_qkv: q 256 | k 256 | v 256);
# gated attention 4 heads x 64 (q and its gate: 512 rows), 2 KV heads; MLP 256. SOURCE stores layers 0-1's GDN
# projections and layers 1-3's MLPs.
_QKVZ = dict(parts=(256, 256, 256, 256), leaves=("in_proj_qkv", "in_proj_z"), shards=((0, 1, 2), (3,)))
SERVED = {
    "qwen3.5": {
        **{f"{Q}.{i}.linear_attn.in_proj_qkvz": served_linear("column", 128, **_QKVZ) for i in (0, 1, 2)},
        **{f"{Q}.{i}.linear_attn.out_proj": served_linear("row", 256) for i in (0, 1, 2)},
        **{f"{Q}.{i}.mlp.gate_up_proj": served_linear("column", 128, (256, 256), ("gate_proj", "up_proj"))
           for i in range(4)},
        **{f"{Q}.{i}.mlp.down_proj": served_linear("row", 256) for i in range(4)},
        f"{Q}.3.self_attn.qkv_proj": served_linear("qkv", 128, (512, 128, 128), ("q_proj", "k_proj", "v_proj"),
                                                   kv_heads=2),
        f"{Q}.3.self_attn.o_proj": served_linear("row", 256),
    },
    # DeepSeek-V3 MLA: hidden 128, 4 heads, q/kv LoRA rank 128, nope 64 + rope 64, v 64; dense MLP 256 (layer 0);
    # layer 1's routed experts (intermediate 256) and q_b_proj ship stored as EXL3 in SOURCE.
    "deepseek-v3": {
        "model.layers.0.self_attn.q_b_proj": served_linear("column", 128, (512,)),
        "model.layers.0.self_attn.kv_b_proj": served_linear("column", 128, (512,)),
        "model.layers.0.self_attn.o_proj": served_linear("row", 256),
        "model.layers.0.mlp.gate_up_proj": served_linear("column", 128, (256, 256), ("gate_proj", "up_proj")),
        "model.layers.0.mlp.down_proj": served_linear("row", 256),
        "model.layers.1.self_attn.q_b_proj": served_linear("column", 128, (512,)),
        "model.layers.1.self_attn.kv_b_proj": served_linear("column", 128, (512,)),
        "model.layers.1.self_attn.o_proj": served_linear("row", 256),
        "model.layers.1.mlp.experts": served_experts(256),
    },
}
STORED_IN_SOURCE = {"model.layers.1.self_attn.q_b_proj", "model.layers.1.mlp.experts",
                    *(f"{Q}.{i}.linear_attn.{m}" for i in (0, 1) for m in ("in_proj_qkvz", "out_proj")),
                    *(f"{Q}.{i}.mlp.{m}" for i in (1, 2, 3) for m in ("gate_up_proj", "down_proj"))}
# The sizes a server of SOURCE starts at, up to 8: Qwen3.5's 2 linear key heads stop at 2; DeepSeek's 4 heads
# would allow 4, but its stored experts (256 rows) cannot be sliced in 128-blocks there.
DEFAULT_TP = {"qwen3.5": (1, 2), "deepseek-v3": (1, 2)}
SOURCE_FAILS = {"qwen3.5": {}, "deepseek-v3": {  # at the TP size of OLD_DEFAULT_FAILS
    "model.layers.1.mlp.experts": "EXL3 TP output slice must be 128-aligned, got start=0, size=64"}}
# The layer the old default (TP 1 only) stored that a server at that size cannot slice, with the fork's error.
OLD_DEFAULT_FAILS = {
    "qwen3.5": (2, f"{Q}.3.self_attn.qkv_proj", "EXL3 TP output slice must be 128-aligned, got start=0, size=64"),
    "deepseek-v3": (4, "model.layers.0.self_attn.o_proj", "EXL3 TP input slice must be 128-aligned, got start=0, size=64"),
}


def _request(src: Path, family: str, **kw) -> ServerRequest:
    return ServerRequest(model=str(src), quantization_config=TINY_FAMILIES[family].overlay, device="cpu", **kw)


@pytest.fixture(scope="module", params=sorted(SERVED))
def outs(request, tmp_path_factory):
    """A family's SOURCE, OUT hydrated with the default TP sizes, and OUT hydrated for TP 1 only (the old default)."""
    family = request.param
    base = tmp_path_factory.mktemp(family.replace(".", "_"))
    src = write_tiny(base / "src", family, seed=fresh_seed())
    plan = plan_hydrate(_request(src, family, tp_sizes=()), base / "out")
    hydrate(plan, device="cpu", encode=fake_encode)
    tp1 = plan_hydrate(_request(src, family, tp_sizes=(1,)), base / "out-tp1")
    hydrate(tp1, device="cpu", encode=fake_encode)
    return family, src, base / "out", plan, base / "out-tp1", tp1


def test_out_loads_at_every_tp_size_source_starts_at(outs):
    """By default OUT is checked for every size a server of SOURCE starts at: the fork's loader (the tests' model)
    slices every stored layer at each, SOURCE's own stored modules included (its routed experts too); the layers
    some size cannot slice stay BF16 (as in SOURCE: a server encodes or keeps them as it does for SOURCE) and are
    listed with that size; a size vLLM splits the model into but SOURCE does not start at is not among them."""
    family, src, out, plan, _, _ = outs
    assert plan.tp_sizes == DEFAULT_TP[family] and plan.tp_default
    for tp in plan.tp_sizes:
        assert server_tp_load(src, SERVED[family], tp) == {}, tp  # SOURCE starts there
        assert server_tp_load(out, SERVED[family], tp) == {}, tp
    leaves = {p: m["leaves"] for p, m in SERVED[family].items() if p not in STORED_IN_SOURCE}
    online = server_online_lookups(out, leaves)  # what a TP 1 server of OUT still encodes: the layers left BF16
    assert online == [p for p, _ in plan.left_bf16]
    assert all(plan.left_tp[p] and max(plan.tp_sizes) in plan.left_tp[p] for p in online)
    assert plan.modules and set(plan.fails_at) == {tp for tp, _, _ in [OLD_DEFAULT_FAILS[family]]
                                                   if tp not in plan.tp_sizes}
    for tp, why in plan.fails_at.items():  # DeepSeek at TP 4: SOURCE's experts fail there, and OUT's o_proj
        assert server_tp_load(src, SERVED[family], tp) == SOURCE_FAILS[family]
        assert why.startswith(OLD_DEFAULT_FAILS[family][1] + ": ")


def test_the_old_default_fails_at_a_size_source_serves_and_its_record_says_so(outs):
    """Hydrated for TP 1 only, OUT fails where the fork's loader (the tests' model) cannot slice a layer it stored:
    for Qwen3.5 at TP 2, a size SOURCE starts at (the model can fail); the plan and OUT's record name that layer
    and that error, for `cache check` to say."""
    family, src, _, _, out1, tp1 = outs
    tp, layer, error = OLD_DEFAULT_FAILS[family]
    assert server_tp_load(src, SERVED[family], tp) == SOURCE_FAILS[family]
    failed = server_tp_load(out1, SERVED[family], tp)
    assert failed[layer] == error
    assert tp1.fails_at[tp].startswith(f"{layer}: ") and f'"{error}"' in tp1.fails_at[tp]
    record = read_hydrate_record(out1)
    assert record.tp_sizes == (1,) and record.fails_at == tp1.fails_at and record.loads_at(tp) is False
    assert record.loads_at(1) is True and record.loads_at(16) is None and record.checked_up_to == 8
    assert set(record.modules) == {m.module for m in tp1.modules}


def test_record_is_read_by_identity_and_cache_check(outs, tmp_path, capsys):
    """`identity` and `cache check` on OUT print the TP sizes it was hydrated for; `cache check` at a size where a
    stored layer cannot be sliced is a start failure naming the layer and the server's error (exit 1), the first
    line of its report on stdout (not only in --json or on stderr); the record
    is not the only source: at a size an earlier exl3tool's record never checked, the fork's rule over every stored
    module answers the same."""
    family, _, _, _, out1, _ = outs
    tp, layer, error = OLD_DEFAULT_FAILS[family]
    quant = ["--quantization-config", TINY_FAMILIES[family].overlay] if TINY_FAMILIES[family].overlay else []
    code, stdout, err = run(["identity", out1, "--json", "--encoder-root", ENC["encoder_root"],
                             "--encoder-revision", ENC["encoder_revision"]], capsys)
    assert code == 0, err
    assert json.loads(stdout)["hydrated"]["tp_sizes"] == [1]
    code, stdout, err = run(["identity", out1, "--encoder-root", ENC["encoder_root"], "--encoder-revision",
                             ENC["encoder_revision"]], capsys)
    assert "hydrated for TP 1 (K6" in stdout, stdout
    code, stdout, err = run(["identity", out1, *quant], capsys)  # nothing encoded online: no encoder to name
    assert code == 0 and "encoder identity  none needed: every online layer is stored" in stdout, err
    check = ["cache", "check", out1, "--cache-dir", tmp_path, "--encoder-root", ENC["encoder_root"],
             "--encoder-revision", ENC["encoder_revision"], *quant]
    code, stdout, err = run([*check, "--tp-size", str(tp), "--json"], capsys)
    assert code == 1, err
    doc = json.loads(stdout)
    assert doc["hydrated"]["tp_sizes"] == [1] and not doc["ok"]
    [failure] = [f for f in doc["start_failures"] if f["field"] == "hydrated"]
    assert layer in failure["text"] and error in failure["text"] and f"at TP {tp}" in failure["text"]
    # the fix: hydrating again helps only where SOURCE itself starts (DeepSeek's own experts fail at TP 4)
    again = f"hydrate SOURCE again with --tp-size {tp}"
    assert (again in failure["fix"]) is not bool(SOURCE_FAILS[family]), failure["fix"]
    assert all(p in failure["fix"] and "SOURCE itself" in failure["fix"] for p in SOURCE_FAILS[family])
    code, stdout, err = run([*check, "--tp-size", str(tp)], capsys)  # the report (stdout) says it first
    first = stdout.splitlines()[0]
    assert code == 1 and first.startswith("this server will not start") and layer in first and error in first, stdout
    old = tmp_path / "old"  # a record of an earlier exl3tool: only the sizes asked for were checked
    shutil.copytree(out1, old)
    qc = json.loads((old / "quantization_config.json").read_text())
    for key in ("tp_checked_up_to", "fails_at"):
        del qc["exl3tool_hydrate"][key]
    (old / "quantization_config.json").write_text(json.dumps(qc))
    code, _, err = run([*check, "--tp-size", "2"], capsys)
    assert code == (1 if tp == 2 else 0), err  # the new record says TP 2 fails (Qwen3.5) or loads (DeepSeek)
    check[2] = old
    code, stdout, err = run([*check, "--tp-size", "2"], capsys)
    assert code == (1 if tp == 2 else 0), err  # before: exit 2, "TP 2 was not checked"
    if tp == 2:  # the line on stdout names the layer, the server's error and that a hydrate for TP 2 helps
        assert layer in stdout and error in stdout and "hydrate SOURCE again with --tp-size 2" in stdout, stdout
        # where every module the hydrate stored fails at TP 2, a hydrate for TP 2 stores nothing (it refuses):
        # the advice is SOURCE itself, never a hydrate that cannot help
        qc = json.loads((old / "quantization_config.json").read_text())
        qc["exl3tool_hydrate"]["modules"] = {k: v for k, v in qc["exl3tool_hydrate"]["modules"].items()
                                             if k.startswith(f"{QC}.3.self_attn.") and not k.endswith("o_proj")}
        (old / "quantization_config.json").write_text(json.dumps(qc))
        code, stdout, err = run([*check, "--tp-size", "2"], capsys)
        assert code == 1 and "serve SOURCE itself at TP 2" in stdout and "hydrate SOURCE again" not in stdout, stdout


def test_dry_run_json_and_lines_say_the_sizes(tmp_path, capsys):
    """The CLI's default is every size SOURCE starts at (not TP 1), the report and --json say so, each layer left
    BF16 comes with its sizes; --tp-size narrows it on purpose, and the other sizes where OUT would fail are named;
    modules the server encodes that exl3tool does not model (a vision tower not ignored) are named, never dropped;
    a size SOURCE itself does not start at (its stored experts cannot be sliced there) is refused, naming them, and
    so is a launch that serves another model than SOURCE."""
    src = write_tiny(tmp_path / "src", "qwen3.5", seed=fresh_seed())
    for tool in (".store/x/blob", ".git/HEAD", ".gitattributes"):  # a tool's hidden folders: not the model
        (src / tool).parent.mkdir(parents=True, exist_ok=True)
        (src / tool).write_text("x")
    quant = ["--quantization-config", TINY_FAMILIES["qwen3.5"].overlay]
    code, stdout, err = run(["hydrate", src, tmp_path / "out", *quant, "--dry-run", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["left_out"] == [".git", ".store"] and "left out of OUT: .git/, .store/" in err, err
    assert doc["tp_sizes"] == [1, 2] and doc["tp_default"] is True and doc["fails_at"] == {}
    assert {d["prefix"]: d["tp_sizes"] for d in doc["left_bf16"]} == {f"{Q}.3.self_attn.qkv_proj": [2]}
    assert f"left BF16 (as in SOURCE): {Q}.3.self_attn.qkv_proj: {QC}.3.self_attn.k_proj: at TP 2" in err
    code, stdout, err = run(["hydrate", src, tmp_path / "out", *quant, "--dry-run", "--tp-size", "1"], capsys)
    assert code == 0, err
    assert "for TP 1;" in stdout and f"not for TP 2 (not asked for): {Q}.3.self_attn.qkv_proj" in err
    # An overlay that does not ignore the vision tower: the server encodes it online, exl3tool does not model it,
    # so OUT cannot store it: the plan's line (stdout), --json, the warning and OUT's record say so.
    vision = json.loads(TINY_FAMILIES["qwen3.5"].overlay)
    vision["ignore"] = [g for g in vision["ignore"] if "visual" not in g]
    vision = json.dumps(vision)
    code, stdout, err = run(["hydrate", src, tmp_path / "out", "--quantization-config", vision, "--tp-size", "1",
                             "--dry-run"], capsys)
    assert code == 0 and "visual.* still encoded online (not modelled)" in stdout, stdout
    assert "not stored: visual.*: the vision tower" in err and "a server of OUT still encodes it" in err, err
    plan = plan_hydrate(ServerRequest(model=str(src), quantization_config=vision, tp_sizes=(1,)), tmp_path / "v")
    assert [p for p, _ in plan.not_modelled] == ["visual.*"]
    assert plan.as_json()["not_modelled"][0]["prefix"] == "visual.*"
    hydrate(plan, device="cpu", encode=fake_encode)
    assert (tmp_path / "v" / ".gitattributes").is_file() and not list(tmp_path.glob("v/.store*"))
    assert not (tmp_path / "v" / ".git").exists()
    record = read_hydrate_record(tmp_path / "v")
    assert record.not_modelled == ("visual.*",) and "visual.* still encoded online" in record.line()
    mla = write_tiny(tmp_path / "mla", "deepseek-v3", seed=fresh_seed())
    code, stdout, err = run(["hydrate", mla, tmp_path / "out", "--dry-run", "--tp-size", "4"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not start at TP 4" in err and "model.layers.1.mlp.experts" in err and "TP 1,2" in err, err
    # a launch that serves another model: its settings are not SOURCE's server's (one line naming both, exit 2)
    for launch, shown in ((f"vllm serve {mla} -tp 2", str(mla)), ("vllm serve /nowhere/m -tp 2", "/nowhere/m")):
        code, stdout, err = run(["hydrate", "--launch", launch, src, tmp_path / "out", "--dry-run"], capsys)
        [line] = [x for x in err.splitlines() if x.startswith("error:")]  # after the launch's settings (stderr)
        assert code == 2 and f"the launch serves {shown}" in line and f"not SOURCE {src}" in line, err
    assert not (tmp_path / "out").exists()


def test_cache_check_says_which_launch_variables_a_stored_checkpoint_no_longer_needs(outs, tmp_path, capsys):
    """Every online layer stored (OUT hydrated for TP 1, served at TP 1): a launch that still sets
    VLLM_EXL3_ONLINE_TRELLIS_BITS gets a note naming the variables to drop (exit 0: it starts); the launch without
    them is 0 look-ups and exit 0 too, never 'a warm cache changes nothing' (exit 1)."""
    family, _, _, _, out1, _ = outs
    from exl3tool.checkpoint import DEFAULT_OVERLAY_JSON

    quant = f" --quantization-config '{TINY_FAMILIES[family].overlay or DEFAULT_OVERLAY_JSON}'"
    env = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE={ENC['encoder_root']} "
           f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path / 'cache'} ")
    code, stdout, err = run(["cache", "check", "--launch", f"{env}vllm serve {out1} -tp 1{quant}", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["lookups"] == 0 and doc["ok"] and doc["stored_only"].startswith("every online layer is stored")
    [note] = [n for n in doc["notes"] if n["field"] == "launch"]
    assert "requires VLLM_EXL3_ENCODER_SOURCE" in note["text"]
    assert note["fix"].startswith("drop VLLM_EXL3_ONLINE_TRELLIS_BITS, VLLM_EXL3_ENCODER_SOURCE, "
                                  "VLLM_EXL3_ONLINE_CACHE_DIR from the launch; keep --quantization-config")
    code, stdout, err = run(["cache", "check", "--launch", f"vllm serve {out1} -tp 1{quant}"], capsys)
    assert code == 0, err
    assert "0 look-ups: every online layer is stored" in stdout and "which is right for this checkpoint" in err
    assert "note (launch)" not in err


def test_per_layer_bits(tmp_path, capsys):
    """--bits 6 with --bits-for rules (the last matching rule wins): each module's trellis holds its own K (what the
    fork reads: last dimension / 16), its tensor_storage record says it, OUT's record lists the exceptions; a rule
    that matches nothing and a K out of range are one-line usage errors."""
    from safetensors import safe_open

    src = write_tiny(tmp_path / "src", "deepseek-v3", seed=fresh_seed())
    rules = ["model.layers.*.self_attn.*=5", "*.o_proj=4", "*.mlp.down_proj=8"]
    plan = plan_hydrate(_request(src, "deepseek-v3", tp_sizes=(1,), bits=6), tmp_path / "out", bits_for=rules)
    want = {m.module: (4 if m.module.endswith("o_proj") else 5 if ".self_attn." in m.module else
                       8 if m.module.endswith("down_proj") else 6) for m in plan.modules}
    assert {m.module: m.bits for m in plan.modules} == want and set(want.values()) == {4, 5, 6, 8}
    hydrate(plan, device="cpu", encode=fake_encode)
    out = tmp_path / "out"
    qc = json.loads((out / "quantization_config.json").read_text())
    for module, k in want.items():
        with safe_open(str(out / plan.modules[0].shard), framework="np") as fh:
            assert fh.get_slice(f"{module}.trellis").get_shape()[-1] == 16 * k
        assert qc["tensor_storage"][module]["bits_per_weight"] == k
    record = read_hydrate_record(out)
    assert record.bits == 6 and record.bits_by_module == {m: k for m, k in want.items() if k != 6}
    assert record.line().startswith("hydrated for TP 1 (K4/K5/K6/K8, 8 modules stored")
    assert server_online_lookups(out, {p: m["leaves"] for p, m in SERVED["deepseek-v3"].items()
                                       if p not in STORED_IN_SOURCE}) == []
    form = "the accepted form is GLOB=K, GLOB a shell glob over module names (ASCII) and K from 1 to 8"
    for argv, words in ((["--bits-for", "*.nothing=5"], "matches no module hydrate stores"),
                        (["--bits-for", "*.o_proj=9"], "--bits-for '*.o_proj=9': K '9' is not a whole number"),
                        (["--bits-for", "*.o_proj"], "--bits-for '*.o_proj': not GLOB=K; " + form),
                        (["--bits-for", "*.o_proj=\u0665"], "--bits-for '*.o_proj=\\u0665': non-ASCII"),
                        ([""], "OUT is empty")):
        out_arg = [] if argv == [""] else [tmp_path / "again"]
        code, _, err = run(["hydrate", src, *out_arg, "--tp-size", "1", "--dry-run", *argv], capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and err.isascii(), err
    code, _, err = run(["hydrate", src, tmp_path / "again", "--tp-size", "1", "--dry-run", "--bits-for", "*.o_proj=2"],
                       capsys)
    assert code == 0, err  # K 1 and 2 are stored K the fork loads (1 to 8 from the trellis)


# The first stored module a server fails to slice, in the order vLLM processes the model's modules (layer by layer;
# the lm_head last), with the fork's error: the tiny GLM-4.5 stores layer 1's routed experts and layer 2's attention,
# both unsliceable at TP 2; the server raises on layer 1's experts first (exl3tool named the attention: linears
# were judged before every experts module).
FIRST_FAILURE = {("glm4.5", 2): ("model.layers.1.mlp.experts",
                                 "EXL3 TP output slice must be 128-aligned, got start=0, size=64"),
                 ("deepseek-v3", 4): ("model.layers.1.mlp.experts",
                                      "EXL3 TP output slice must be 128-aligned, got start=0, size=64")}


@pytest.mark.parametrize("family,tp", sorted(FIRST_FAILURE))
def test_cache_check_names_the_first_module_the_server_fails_to_slice(family, tp, tmp_path, capsys):
    src = write_tiny(tmp_path / "src", family, seed=fresh_seed())
    quant = ["--quantization-config", TINY_FAMILIES[family].overlay] if TINY_FAMILIES[family].overlay else []
    code, stdout, err = run(["cache", "check", src, "--tp-size", str(tp), "--cache-dir", tmp_path / "c",
                             "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"],
                             *quant], capsys)
    layer, error = FIRST_FAILURE[family, tp]
    first = stdout.splitlines()[0]
    assert code == 1 and first.startswith(f"this server will not start: at TP {tp} {layer},") and error in first, stdout
