"""`exl3tool encoder-source`: the fork loads the directory as it loads exllamav3, and gets exl3tool's bytes.

The directory is loaded with the fork's mechanism (``_fork_loader``), called with the fork's arguments and
compared with ``encode_linear`` (what ``exl3tool encode`` runs) for the same weight and seed; every call the
drop-in cannot answer exactly must raise an error naming the argument and the encoder to use instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import exl3tool
from exl3tool.encode import encode_linear
from exl3tool.errors import ConfigError
from exl3tool.serving.encoder_source import MARKER, quantize_py_text, read_marker, write_encoder_source
from exl3tool.serving.quantize_api import UnsupportedCallError, quantize_exl3

from goldens import golden_case
from helpers import viterbi_memo
from _fork_loader import fork_call, fork_seed, load_quantize_exl3, unload
from seeds import fresh_bytes, fresh_seed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_cli(capfd):
    """``exl3tool ARGS`` through the real entry point (error mapping, exit codes): exit_code, stdout, stderr."""
    from types import SimpleNamespace

    from exl3tool.cli import main

    def run(args):
        capfd.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(list(args))
            sys.exit(0)
        out, err = capfd.readouterr()
        return SimpleNamespace(exit_code=exited.value.code or 0, stdout=out, stderr=err)

    return run


def _layer_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A BF16 Linear weight (out, in) with fresh random values and uneven column scales."""
    gen = torch.Generator().manual_seed(seed)
    scale = 0.01 + 0.05 * torch.rand(1, in_features, generator=gen)
    return (torch.randn(out_features, in_features, generator=gen) * scale).to(torch.bfloat16)


@pytest.fixture
def export(tmp_path):
    root = tmp_path / "exl3tool-encoder"
    write_encoder_source(root)
    yield root
    unload()


@pytest.fixture(scope="module")
def cpu_pair(tmp_path_factory):
    """One (256 in, 128 out) K=4 layer through the fork's loader and call, and through encode_linear (the later two
    encodes' Viterbi reuse the first's states where their tiles are the same bits: helpers.viterbi_memo)."""
    with viterbi_memo():
        return _cpu_pair(tmp_path_factory)


def _cpu_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("src") / "enc"
    write_encoder_source(root)
    fn = load_quantize_exl3(root)
    prefix = "model.layers.3.self_attn.o_proj"
    weight = _layer_weight(128, 256, seed=fresh_seed(32))
    got = fork_call(fn, weight, 4, fork_seed(prefix), "cpu")
    want = encode_linear(weight.t().float().contiguous(), bits=4, seed=fork_seed(prefix), codebook="mcg")
    # the same call made directly, with the reference's spellings of 'same result' arguments
    qa = {"K": 4, "seed": fork_seed(prefix), "devices": [torch.device("cpu")], "apply_out_scales": None, "mcg": True,
          "sigma_reg": 0.1, "device_ratios": None, "buf_size_k": 64}
    direct = fn(weight.t().float().contiguous(), {"H": torch.empty(256, 256, device="meta"), "device": "cpu"}, qa,
                False, progress_str="<step>", verbose=True)
    unload()
    return got, want, direct, fn


@pytest.mark.slow
def test_fork_loads_the_export_and_gets_encode_linear_bytes(cpu_pair):
    (tensors, proxy, quant_args, h_data), want, _, _ = cpu_pair
    assert tensors["trellis"].dtype == torch.int16 and tuple(tensors["trellis"].shape) == (16, 8, 64)
    assert torch.equal(tensors["trellis"], want.trellis)
    assert torch.equal(tensors["suh"], want.suh) and torch.equal(tensors["svh"], want.svh)
    assert proxy == want.proxy_error and proxy > 0
    assert quant_args["q_fallback"] is True and quant_args["g_scale"] == want.g_scale
    assert quant_args["apply_out_scales"] is True and quant_args["zeros"] is False
    assert h_data["q_fallback"] is True and h_data["finalized"] is True and h_data["L"] is None
    # the input signs the reference keeps in H_data are the signs of -suh (su is divided by -codebook_scale)
    assert torch.equal(h_data["su"].flatten(), -torch.sign(want.suh.float()))


@pytest.mark.slow
def test_return_convention_and_arguments_that_change_nothing(cpu_pair):
    _, want, (weight_q, proxy, tensors), fn = cpu_pair
    assert fn is quantize_exl3  # the generated file re-exports the library function
    assert weight_q is None and isinstance(proxy, float) and proxy == want.proxy_error
    assert list(tensors) == ["suh", "svh", "trellis", "mcg"]
    assert tensors["mcg"].dtype == torch.int32 and tensors["mcg"].dim() == 0 and int(tensors["mcg"]) == -877912083
    assert all(torch.equal(tensors[n], getattr(want, n)) for n in ("trellis", "suh", "svh"))


@pytest.mark.parametrize("flags, codebook, markers", [({"mul1": True}, "mul1", {"mul1": -2082680531}),
                                                      ({}, "3inst", {}), ({"mcg": False}, "3inst", {})])
def test_codebook_flags_select_the_codebook_and_marker(monkeypatch, flags, codebook, markers):
    """The flags reach the encoder as the reference reads them; the marker tensor follows the codebook."""
    seen = _fake_encoder(monkeypatch)
    qa = {"K": 3, "seed": 77, "devices": ["cpu"], "apply_out_scales": True, **flags}
    weight_q, proxy, tensors = quantize_exl3(torch.randn(128, 256), {"H": torch.empty(128, 128, device="meta"),
                                                                     "device": "cpu"}, qa, False)
    assert seen["codebook"] == codebook and seen["bits"] == 3 and seen["seed"] == 77 and proxy == 0.5
    assert weight_q is None and list(tensors) == ["suh", "svh", "trellis", *markers]
    assert {name: int(tensors[name]) for name in markers} == markers


def _fake_encoder(monkeypatch) -> dict:
    """Replace the encoder's two halves by a recorder that returns fixed tensors (argument plumbing tests)."""
    import exl3tool.encode.online as online
    from exl3tool.format.encoded import EncodedLinear

    seen: dict = {}

    def prepare(weight, *, bits, seed, codebook, sign_vectors, device, out_scales):
        seen.update(bits=bits, seed=seed, codebook=codebook, su=sign_vectors[0], device=device, out_scales=out_scales,
                    weight=weight)
        k, n = weight.shape
        from types import SimpleNamespace
        return SimpleNamespace(su=torch.ones(k), sv=torch.ones(n), zeros=False, k=k, n=n, bits=bits,
                               codebook=codebook)

    def finish(prepared):
        return EncodedLinear(torch.zeros(prepared.k // 16, prepared.n // 16, 16 * prepared.bits, dtype=torch.int16),
                             torch.ones(prepared.k, dtype=torch.float16), torch.ones(prepared.n, dtype=torch.float16),
                             0.5, 1.0, prepared.bits, prepared.codebook)

    monkeypatch.setattr(online, "prepare_encode", prepare)
    monkeypatch.setattr(online, "finish_encode", finish)
    return seen


@pytest.mark.parametrize("h_extra", [
    {"count": 4096},  # the reference's meta branch never reads count (spec 7.2)
    {"first_key": "vision.blocks.0.mlp.fc1", "num_total": 7, "inf_nan": torch.tensor([3, 1]), "finalized": True},
    {"L": None, "count": 0, "finalized": False},  # the round-trip tools' H_data
])
def test_h_data_fields_the_meta_path_does_not_read_change_nothing(monkeypatch, h_extra):
    seen = _fake_encoder(monkeypatch)
    h = {"H": torch.empty(128, 128, device="meta"), "device": torch.device("cpu"), **h_extra}
    qa = {"K": 5, "seed": 9, "devices": [torch.device("cpu")], "apply_out_scales": None, "mcg": True}
    _, _, tensors = quantize_exl3(torch.randn(128, 256), h, qa, False)
    assert seen["bits"] == 5 and seen["out_scales"] is True and tuple(tensors["trellis"].shape) == (8, 16, 80)
    assert h["q_fallback"] is True and h["finalized"] is True and h["L"] is None and h["diag"] is None
    assert qa["apply_out_scales"] is True and qa["q_fallback"] is True and qa["out_scales_hessian"] is False


def _call(weight=None, h=None, qa=None, **kw):
    weight = torch.randn(128, 256) * 0.02 if weight is None else weight
    base_h = {"H": torch.empty(weight.shape[0], weight.shape[0], device="meta"), "count": 0, "device": "cpu"}
    base_qa = {"K": 6, "seed": 1, "devices": ["cpu"], "apply_out_scales": True, "mcg": True}
    base_h.update(h or {})
    base_qa.update(qa or {})
    for key in [k for k, v in base_qa.items() if v is _DROP]:
        del base_qa[key]
    return quantize_exl3(weight, base_h, base_qa, kw.pop("return_weight_q", False), **kw)


_DROP = object()
_INSTEAD = "exllamav3's own quantize_exl3"


@pytest.mark.parametrize("kwargs, words", [
    (dict(h={"H": torch.zeros(128, 128)}), "H_data['H'] is a real Hessian"),
    (dict(qa={"K": 2.5}), "quant_args['K'] = 2.5 is a fractional bitrate"),
    (dict(qa={"seed": _DROP}), "quant_args has no 'seed'"),
    (dict(qa={"lambda_reg": 0.5}), "quant_args key(s) 'lambda_reg' are not ones exllamav3 1.6.5 reads"),
    (dict(qa={"devices": ["cuda:0"]}), "H_data['device'] cpu differs from quant_args['devices'][0] cuda:0"),
    (dict(save_reg="/tmp/r.png"), "save_reg="),
])
def test_unsupported_calls_name_the_argument_and_the_encoder_to_use(kwargs, words):
    with pytest.raises(UnsupportedCallError) as info:
        _call(**kwargs)
    assert words in str(info.value) and _INSTEAD in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    (dict(qa={"K": 9}), "K must be an integer from 1 to 8"),
    (dict(qa={"apply_out_scales": "yes"}), "quant_args['apply_out_scales'] = 'yes'"),
    (dict(qa={"mcg": True, "mul1": True}), "both the mcg and mul1 codebooks"),
    (dict(qa={"apply_out_scales": _DROP}), "quant_args has no 'apply_out_scales'"),
    (dict(qa={"devices": []}), "quant_args['devices']"),
    (dict(qa={"buf_size_k": 96}), "quant_args['buf_size_k'] = 96"),
    (dict(h={"H": torch.empty(64, 64, device="meta")}), "H_data['H'] has shape (64, 64), expected (128, 128)"),
    (dict(weight=torch.randn(128, 256, dtype=torch.float64)), "weight must be float32"),
    (dict(weight=torch.full((128, 256), float("nan"))), "non-finite values"),
    (dict(weight=torch.randn(128, 200)), "out_features 200 is not a positive multiple of 128"),
])
def test_calls_the_reference_fails_too_raise_value_errors(kwargs, words):
    with pytest.raises(ValueError, match=None) as info:
        _call(**kwargs)
    assert words in str(info.value)


@pytest.mark.slow
def test_calls_from_threads_give_the_sequential_bytes():
    """Two threads call at once (the CPU path serialises; numba's pool is not re-entrant): same bytes as one by one."""
    weights = [torch.randn(128, 128) * (0.01 + 0.01 * i) for i in range(2)]

    def one(i):
        qa = {"K": 6, "seed": 100 + i, "devices": ["cpu"], "apply_out_scales": True, "mcg": True}
        _, proxy, t = quantize_exl3(weights[i], {"H": torch.empty(128, 128, device="meta"), "device": "cpu"}, qa,
                                    False)
        return proxy, t["trellis"], t["suh"], t["svh"]

    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            results[i] = one(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        again = one(i)
        assert results[i][0] == again[0] and all(torch.equal(a, b) for a, b in zip(results[i][1:], again[1:]))


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_import_like_the_fork_is_light(export):
    """Loading the export as the fork does touches no CUDA, compiles nothing and leaves the CLI out."""
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from _fork_loader import load_quantize_exl3\n"
        f"fn = load_quantize_exl3({str(export)!r})\n"
        "heavy = [m for m in ('typer', 'rich', 'click', 'triton', 'numba', 'exl3tool.cli', 'exl3tool.encode.online',"
        " 'exl3tool.kernels.viterbi') if m in sys.modules]\n"
        "print(fn.__module__, heavy, torch.cuda.is_initialized())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exl3tool.serving.quantize_api", "[]", "False"]


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_generated_file_refuses_another_exl3tool_version(export):
    code = (
        "import exl3tool; exl3tool.__version__ = '9.9.9'\n"
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from _fork_loader import load_quantize_exl3\n"
        f"load_quantize_exl3({str(export)!r})\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert f"written by exl3tool {exl3tool.__version__} but exl3tool 9.9.9 is installed" in out.stderr
    assert f"exl3tool encoder-source {export} --force" in out.stderr


def _fork_identity(root: Path) -> str:
    """The server's files-mode encoder identity, computed here from the spec's rule (not exl3tool's code)."""
    real = os.path.realpath(root)
    files = sorted(p.relative_to(real).parts for p in Path(real).rglob("*.py") if p.is_file())
    listing = [["/".join(parts), hashlib.sha256(Path(real, *parts).read_bytes()).hexdigest()] for parts in files]
    payload = json.dumps({"root": real, "files": listing}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def test_cli_export_identity_and_rewrites(tmp_path, run_cli):
    root = tmp_path / "opt" / "exl3tool-encoder"
    first = run_cli(["encoder-source", str(root), "--json"])
    assert first.exit_code == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["replaced"] == "none" and doc["server_env"] == {"VLLM_EXL3_ENCODER_SOURCE": str(root)}
    assert doc["encoder"]["identity"] == _fork_identity(root)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        MARKER, "modules/quant/exl3_lib/quantize.py"]
    assert (root / "modules/quant/exl3_lib/quantize.py").stat().st_mode & 0o777 == 0o644
    # `exl3tool identity --encoder-root DIR` computes what the server computes
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ident = run_cli(["identity", str(model), "--encoder-root", str(root), "--json"])
    assert ident.exit_code == 0, ident.stderr
    assert json.loads(ident.stdout)["encoder"]["identity"] == doc["encoder"]["identity"]
    # the content depends only on the version: another directory hashes the same file bytes
    other = tmp_path / "elsewhere"
    write_encoder_source(other)
    assert (other / "modules/quant/exl3_lib/quantize.py").read_bytes() == (
        root / "modules/quant/exl3_lib/quantize.py").read_bytes()
    again = run_cli(["encoder-source", str(root), "--json"])
    assert json.loads(again.stdout)["replaced"] == "unchanged"
    # an earlier export (another version, a stray .py the identity would hash) is replaced whole
    (root / MARKER).write_text(json.dumps({"kind": "exl3tool-encoder-source", "exl3tool_version": "0.0.9"}))
    (root / "modules" / "stray.py").write_text("x = 1\n")
    replaced = run_cli(["encoder-source", str(root), "--json"])
    assert json.loads(replaced.stdout)["replaced"] == "export"
    assert json.loads(replaced.stdout)["previous_version"] == "0.0.9"
    assert not (root / "modules" / "stray.py").exists() and read_marker(root)["exl3tool_version"] == exl3tool.__version__
    assert json.loads(replaced.stdout)["encoder"]["identity"] == doc["encoder"]["identity"]
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".exl3tool-encoder.")]


def test_identity_of_an_encoder_source_needs_no_model(tmp_path, run_cli):
    """`exl3tool identity --encoder-root DIR` alone: the encoder identity the server computes, no model needed."""
    root = tmp_path / "enc"
    assert run_cli(["encoder-source", str(root)]).exit_code == 0
    (root / "modules" / "extra.py").write_text(f"x = {fresh_bytes(4).hex()!r}\n")  # hashed too, as the server does
    res = run_cli(["identity", "--encoder-root", str(root), "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model"] is None and doc["encoder"]["identity"] == _fork_identity(root)
    assert doc["encoder"]["mode"] == "files" and doc["encoder"]["root"] == str(root)
    shown = run_cli(["identity", "--encoder-root", str(root)])
    assert shown.exit_code == 0 and doc["encoder"]["identity"] in shown.stdout and "model: none given" in shown.stdout
    rev = json.loads(run_cli(["identity", "--encoder-root", str(root), "--encoder-revision", "r1", "--json"]).stdout)
    assert rev["encoder"]["mode"] == "revision" and rev["encoder"]["identity"] != doc["encoder"]["identity"]
    # without MODEL, launch or encoder root it is still a usage error
    bare = run_cli(["identity", "--json"])
    assert bare.exit_code == 2 and "give MODEL" in json.loads(bare.stdout)["error"]


def test_cli_refuses_a_foreign_directory_unless_forced(tmp_path, run_cli):
    foreign = tmp_path / "exllamav3"
    (foreign / "modules").mkdir(parents=True)
    (foreign / "modules" / "x.py").write_text("y = 2\n")
    refused = run_cli(["encoder-source", str(foreign)])
    assert refused.exit_code == 2
    assert "is not empty and is not an earlier `exl3tool encoder-source` export" in refused.stderr
    assert (foreign / "modules" / "x.py").exists()
    forced = run_cli(["encoder-source", str(foreign), "--force", "--json"])
    assert forced.exit_code == 0 and json.loads(forced.stdout)["replaced"] == "forced"
    assert not (foreign / "modules" / "x.py").exists()
    assert (foreign / "modules/quant/exl3_lib/quantize.py").read_text() == quantize_py_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_encoder_source(empty).replaced == "empty"
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        write_encoder_source(afile)


def test_unwritable_places_are_named_as_the_user_gave_them(tmp_path, monkeypatch, run_cli):
    """A DIR under a file names that file (not errno 17 'File exists'); a failed write names DIR and its parent,
    never the hidden staging folder beside it."""
    import errno

    import exl3tool.serving.encoder_source as es

    afile = tmp_path / "file"
    afile.write_text("")
    res = run_cli(["encoder-source", str(afile / "enc"), "--json"])
    assert res.exit_code == 2
    msg = json.loads(res.stdout)["error"]
    assert msg == f"{afile / 'enc'}: {afile} is a file, not a directory; name a directory under directories only"

    def read_only(path, **_):
        raise OSError(errno.EROFS, "Read-only file system", str(Path(path) / "modules"))

    monkeypatch.setattr(es, "_write_tree", read_only)
    root = tmp_path / "ro" / "enc"
    with pytest.raises(ConfigError) as err:
        write_encoder_source(root)
    assert str(err.value) == (f"{root}: cannot write the encoder source in {root.parent} (Read-only file system); "
                              "check the path and its permissions")
    assert not [p for p in root.parent.iterdir() if p.name.startswith(".enc.")]  # the staging folder is gone


@pytest.mark.gpu
@pytest.mark.parametrize("tag", ["case0", "case1", "case2"])
def test_drop_in_on_cuda_is_the_reference_bytes(golden, export, tag):
    """The fork's call on CUDA gives the golden reference encode's trellis, scales and proxy error exactly."""
    gold = golden_case(golden, "encode_e2e", tag)
    seed = gold["seed"]
    fn = load_quantize_exl3(export)
    tensors, proxy, quant_args, _ = fork_call(fn, gold["weight"].t().cuda(), 6, seed, "cuda:0")
    assert torch.equal(tensors["trellis"].cpu(), gold["trellis"])
    assert torch.equal(tensors["suh"].cpu(), gold["suh"]) and torch.equal(tensors["svh"].cpu(), gold["svh"])
    assert quant_args["g_scale"] == float(gold["g_scale"])
    assert proxy == float(gold["proxy_error"])
    enc = encode_linear(gold["weight"].cuda(), bits=6, seed=seed)
    assert enc.proxy_error == proxy and torch.equal(enc.trellis, tensors["trellis"])


# ---- weight_q, no_pack, apply_out_scales=False, padded shapes, K 1..8: real encodes on the CPU -------------------

def _fp32_scales(weight: torch.Tensor, bits: int, codebook: str, seed: int, g_scale: float, out_scales: bool):
    """The fp32 su (k,) and sv (n,) of the encode (fp16 suh/svh are their roundings): the regularisation again with
    the encode's g, no scale search."""
    from exl3tool.encode.online import prepare_encode

    prepared = prepare_encode(weight, bits=bits, seed=seed, codebook=codebook, g_scale=g_scale, out_scales=out_scales)
    return prepared.su, prepared.sv


def _padded_source(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, int, int]:
    """The round-trip tools' source: a Linear weight (out, in) zero-padded to multiples of 128, transposed."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.02
    pad = torch.zeros(-(-out_features // 128) * 128, -(-in_features // 128) * 128)
    pad[:out_features, :in_features] = w
    return pad.t().contiguous(), out_features, in_features


# (K, quant_args extras, device spelling in devices / H_data, source): each a real encode of a small layer. The fork's
# callers use K 4, 6 and 8; K 1 and 2 (9.8 s and 7 s here: the CPU Viterbi is slowest at small K) are left to the
# format tests of the packing at every K (tests/format/test_format.py), their codebook and device spellings moved
# onto K 3 and 5.
_SWEEP = [
    (3, {"no_pack": True, "mcg": True}, ("cpu", torch.device("cpu")), "plain"),
    (5, {"mul1": True}, (torch.device("cpu"), "cpu"), "plain"),
    (4, {"mcg": True, "apply_out_scales": False}, ("cpu", "cpu"), "plain"),
    (5, {}, ("cpu", "cpu"), "plain"),  # 3inst
    (6, {"mcg": True}, ("cpu", "cpu"), "padded"),
    (7, {"mcg": True, "apply_out_scales": False}, ("cpu", "cpu"), "zeros"),
    (8, {"mcg": True, "no_pack": True}, ("cpu", "cpu"), "padded"),
]


@pytest.mark.slow
@pytest.mark.parametrize("bits, extra, devices, source", _SWEEP, ids=[f"K{c[0]}-{c[3]}" for c in _SWEEP])
def test_weight_q_is_the_reference_dequantised_weight(bits, extra, devices, source):
    """return_weight_q=True: weight_q is diag(su) B_k Q B_n diag(sv) with the fp32 scales, within the stated fp32
    bound of the float64 product computed here from the spec (exl3tool's plain decode of the returned trellis, a
    Hadamard matrix built here); using the fp16 suh/svh instead breaks the bound (so the test can fail)."""
    from exl3tool.format.codebook import decode_states
    from exl3tool.format.trellis import pack_trellis, unpack_trellis
    from exl3tool.serving.quantize_api import WEIGHT_Q_ULPS

    seed = fresh_seed(31)
    if source == "padded":  # vision MLP-like (out 200, in 300) -> (384 in-pad, 256 out-pad) source
        weight, out_f, in_f = _padded_source(200, 300, seed)
    elif source == "zeros":
        weight, out_f, in_f = torch.zeros(128, 256), 256, 128
    else:
        weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed)) * 0.03  # 64 tiles: time
    original = weight.clone()
    k, n = weight.shape
    codebook = "mcg" if extra.get("mcg") else "mul1" if extra.get("mul1") else "3inst"
    qa = {"K": bits, "seed": seed, "devices": [devices[0]], "apply_out_scales": True, **extra}
    h = {"H": torch.zeros(k, k, device="meta"), "L": None, "device": devices[1], "count": 0, "finalized": False}
    weight_q, proxy, tensors = quantize_exl3(weight, h, qa, return_weight_q=True, verbose=False)
    assert torch.equal(weight, original)  # the caller's tensor is not overwritten
    assert weight_q.dtype == torch.float32 and tuple(weight_q.shape) == (k, n) and proxy >= 0
    out_scales = extra.get("apply_out_scales", True) is not False
    assert qa["q_fallback"] is True and qa["apply_out_scales"] is (out_scales or source == "zeros")
    assert qa["zeros"] is (source == "zeros") and qa["out_scales_hessian"] is False
    assert h["q_fallback"] is True and tuple(h["su"].shape) == (k, 1)
    trellis = tensors["trellis"]
    if extra.get("no_pack"):  # the unpacked states: full 16-bit states of a consistent tail-biting ring
        assert trellis.dtype == torch.int16 and tuple(trellis.shape) == (k // 16, n // 16, 256)
        packed = pack_trellis(trellis, bits)
        assert torch.equal(unpack_trellis(packed, bits), trellis)
        trellis = packed
    assert tuple(trellis.shape) == (k // 16, n // 16, 16 * bits)

    su, sv = _fp32_scales(weight, bits, codebook, seed, qa["g_scale"], out_scales)
    assert torch.equal(su.half(), tensors["suh"]) and torch.equal(sv.half(), tensors["svh"])
    # the float64 product from the spec: Q decoded from the states, Sylvester H built from its definition
    states = unpack_trellis(trellis, bits).to(torch.int64)
    tiles = decode_states(states, codebook).to(torch.float64)  # (tk, tn, 256) in trellis-position order
    perm = torch.tensor([(r0 + dr) * 16 + (t // 4) + dc for t in range(32) for dc in (0, 8)
                         for r0 in ((t % 4) * 2,) for dr in (0, 1, 8, 9)])
    q = torch.empty(k // 16, n // 16, 256, dtype=torch.float64)
    q[..., perm] = tiles  # trellis position p holds row-major element perm[p] (spec 5.2)
    q = q.reshape(k // 16, n // 16, 16, 16).permute(0, 2, 1, 3).reshape(k, n)
    i = torch.arange(128)
    h128 = torch.tensor([[(-1.0) ** bin(int(a) & int(b)).count("1") for b in i] for a in i], dtype=torch.float64)
    blk = torch.block_diag(*[h128] * (k // 128)) / 128 ** 0.5, torch.block_diag(*[h128] * (n // 128)) / 128 ** 0.5
    exact = su.double()[:, None] * (blk[0] @ q @ blk[1]) * sv.double()[None, :]
    unit = su.double().abs()[:, None] * (blk[0].abs() @ q.abs() @ blk[1].abs()) * sv.double().abs()[None, :]
    unit = unit * 2.0 ** -24 + 1e-300  # one unit of fp32 rounding of the sum of magnitudes (0 on zero columns)
    units = float(((weight_q.double() - exact).abs() / unit).max())
    assert units <= WEIGHT_Q_ULPS and units <= 8  # the worst-case bound, and what fp32 rounding really gives
    if source == "zeros":  # every column is zero: sv and the weight are exactly zero
        assert bool((tensors["svh"] == 0).all()) and bool((weight_q == 0).all())
        return
    loose = tensors["suh"].double()[:, None] * (blk[0] @ q @ blk[1]) * tensors["svh"].double()[None, :]
    assert float(((loose - exact).abs() / unit).max()) > 8  # the fp16 scales' weight is not within it
    if not out_scales:  # apply_out_scales=False: sv is the bare sign draw
        assert bool((tensors["svh"].abs() == 1).all())
    else:
        assert bool((tensors["svh"].abs() != 1).any())
    rel = float((weight_q - weight).norm() / weight.norm())
    assert rel < {1: 0.6, 2: 0.35, 3: 0.2}.get(bits, 0.12)  # a quantization of this weight, not another's
    if source == "padded":  # zero columns (padded outputs) stay zero; the crop is the round trip of the original
        assert bool((tensors["svh"][out_f:] == 0).all()) and bool((weight_q[:, out_f:] == 0).all())
        crop = weight_q[:in_f, :out_f]
        assert float((crop - weight[:in_f, :out_f]).norm() / weight[:in_f, :out_f].norm()) < 0.12


def test_triton_cache_folder_follows_the_cache_root(tmp_path, monkeypatch):
    """Unless TRITON_CACHE_DIR is set, the drop-in's calls cache Triton kernels in <cache root>/exl3tool-triton
    (created), restore the variable after, and leave Triton alone for a root that cannot be written."""
    from exl3tool.serving import triton_cache as tc

    root = tmp_path / "exl3-cache"
    env = {"VLLM_EXL3_ONLINE_CACHE_DIR": str(root)}
    assert tc.triton_cache_dir(env) == root / "exl3tool-triton" and (root / "exl3tool-triton").is_dir()
    assert tc.triton_cache_dir({**env, "TRITON_CACHE_DIR": "/elsewhere"}) is None
    assert tc.triton_cache_dir({"VLLM_CACHE_ROOT": str(tmp_path / "vc")}) == tmp_path / "vc" / "exl3_online" / \
        "exl3tool-triton"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert tc.triton_cache_dir({"VLLM_EXL3_ONLINE_CACHE_DIR": str(blocked / "sub")}) is None
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_EXL3_ONLINE_CACHE_DIR", str(root))
    with tc.drop_in_triton_cache() as outer:
        assert os.environ["TRITON_CACHE_DIR"] == str(root / "exl3tool-triton") == str(outer)
        with tc.drop_in_triton_cache() as inner:  # a second thread's call meanwhile: same folder, kept set
            assert inner == outer
        assert os.environ["TRITON_CACHE_DIR"] == str(outer)
    assert "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    with tc.drop_in_triton_cache() as folder:
        assert folder is None and os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


# ---- on a GPU: the callers' conventions against exllamav3 itself, and the Triton cache across processes ----------

@pytest.fixture(scope="module")
def reference():
    """exllamav3's quantize_exl3 loaded as the fork loads an encoder source: EXL3TOOL_REFERENCE_SOURCE names its
    package directory (e.g. /tmp/site/exllamav3 from the 1.6.5 wheel; its CUDA extension JIT-compiles on import)."""
    src = os.environ.get("EXL3TOOL_REFERENCE_SOURCE")
    if not src:
        pytest.skip("EXL3TOOL_REFERENCE_SOURCE is not set (the exllamav3 1.6.5 package directory)")
    try:
        fn = load_quantize_exl3(src, package="_exllamav3_reference")
    except Exception as exc:  # noqa: BLE001 - any import failure means: no reference here
        pytest.skip(f"exllamav3 at {src} does not load: {type(exc).__name__}: {exc}")
    yield fn
    unload("_exllamav3_reference")


def _gpu_cases() -> list[tuple[str, tuple[int, int], str, dict, str, bool]]:
    """(id, source shape (k, n), weight kind, quant_args, H_data style, return_weight_q): the three callers'
    conventions (online linear method, image-build gate, K8/K4 round-trip tools) and the rest of the K/flag space."""
    dev = "cuda:0"
    fork = {"apply_out_scales": True, "mcg": True}
    return [
        ("gate-K6-weight_q", (512, 1024), "fp32", {"K": 6, "seed": 0, "devices": [torch.device(dev)], **fork},
         "fork", True),
        ("online-K4", (256, 4096), "bf16", {"K": 4, "seed": fork_seed("m.layers.0.self_attn.f_b_proj"),
                                            "devices": [torch.device(dev)], **fork}, "fork", False),
        ("roundtrip-K8-padded", (384, 1024), "padded", {"K": 8, "seed": 0, "devices": [dev], **fork}, "tool", False),
        ("roundtrip-K4-padded", (384, 1024), "padded", {"K": 4, "seed": 0, "devices": [dev], **fork}, "tool", True),
        ("K1-mcg", (256, 512), "bf16", {"K": 1, "seed": 11, "devices": [0], **fork}, "fork", True),
        ("K2-mul1", (256, 512), "bf16", {"K": 2, "seed": 12, "devices": [dev], "apply_out_scales": True,
                                         "mul1": True}, "fork", True),
        ("K3-3inst-no_pack", (256, 512), "bf16", {"K": 3, "seed": 13, "devices": [dev], "apply_out_scales": None,
                                                  "no_pack": True}, "fork", False),
        ("K5-no-out-scales", (256, 512), "bf16", {"K": 5, "seed": 14, "devices": [dev], "apply_out_scales": False,
                                                  "mcg": True}, "tool", True),
        ("K7-mcg", (256, 512), "bf16", {"K": 7, "seed": 15, "devices": [torch.device(dev)], **fork}, "fork", True),
        ("K6-zeros-no-out-scales", (256, 512), "zeros", {"K": 6, "seed": 16, "devices": [dev],
                                                         "apply_out_scales": False, "mcg": True}, "fork", True),
    ]


def _gpu_source(kind: str, k: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(k, n)
    if kind == "fp32":  # the gate: an fp32 Linear weight (out, in) * 0.02, transposed
        return (torch.randn(n, k, generator=gen) * 0.02).t().contiguous()
    if kind == "padded":  # a (1000 out, 300 in) Linear zero-padded to (1024, 384), transposed: the tools' source
        w = torch.zeros(n, k)
        w[:1000, :300] = (torch.randn(1000, 300, generator=gen) * 0.02).to(torch.bfloat16).float()
        return w.t().contiguous()
    return _layer_weight(n, k, seed).t().float().contiguous()


def _h_data(style: str, k: int, device: torch.device) -> dict:
    if style == "tool":  # the round-trip tools: a bare torch.device("cuda"), L, no first_key
        return {"H": torch.empty(k, k, device="meta"), "L": None, "device": torch.device("cuda"), "count": 0,
                "finalized": False}
    return {"H": torch.zeros(k, k, dtype=torch.float32, device="meta"), "first_key": "gate-online", "count": 0,
            "finalized": False, "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
            "device": device}


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=[c[0] for c in _gpu_cases()])
def test_callers_get_the_reference_answer(reference, export, case):
    """Each convention through the fork's loader, the drop-in and exllamav3 side by side: the same tensors (every
    key, byte for byte), proxy error, quant_args and H_data keys, and the same weight_q (bit for bit where the fp32
    scales agree; within fp32 rounding where they do not)."""
    name, (k, n), kind, qa_in, style, want_q = case
    dev = torch.device("cuda:0")
    ours_fn = load_quantize_exl3(export)
    source = _gpu_source(kind, k, n, qa_in["seed"] + 1)
    results = []
    for fn in (reference, ours_fn):
        qa, h = dict(qa_in), _h_data(style, k, dev)
        wq, proxy, tensors = fn(source.to(dev).clone(), h, qa, return_weight_q=want_q, verbose=False)
        torch.cuda.synchronize()
        results.append((wq, proxy, {key: t.cpu() for key, t in tensors.items()}, qa, h))
    (rq, rp, rt, rqa, rh), (oq, op, ot, oqa, oh) = results
    assert list(ot) == list(rt)
    for key in rt:
        assert ot[key].dtype == rt[key].dtype and torch.equal(ot[key], rt[key]), f"{name}: {key} differs"
    assert op == rp
    assert {key: oqa[key] for key in rqa} == {key: rqa[key] for key in rqa}  # every key the reference has/wrote
    for key in ("L", "finalized", "diag", "q_fallback"):
        assert oh[key] == rh[key]
    assert torch.equal(oh["su"].cpu(), rh["su"].cpu()) and oh["su"].device == rh["su"].device
    if want_q:
        assert oq.dtype == rq.dtype == torch.float32 and oq.shape == rq.shape and oq.device == rq.device
        rel = float((oq - rq).norm() / max(float(rq.norm()), 1e-30))
        equal = torch.equal(oq, rq)
        print(f"{name}: weight_q bit-identical={equal} rel diff={rel:.3e}")
        assert equal or rel < 1e-6, f"{name}: weight_q differs from the reference's by {rel:.3e}"
    else:
        assert oq is None and rq is not None  # the reference computes it anyway; every False caller drops it


@pytest.mark.gpu
def test_triton_kernels_persist_across_processes(tmp_path):
    """A second server process finds the first one's compiled kernels under <cache root>/exl3tool-triton: it
    compiles nothing (no new cache files) and its first call is faster."""
    root = tmp_path / "exl3-cache"
    src = tmp_path / "enc"
    write_encoder_source(src)
    code = (
        "import sys, time, torch\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from _fork_loader import load_quantize_exl3, fork_call\n"
        f"fn = load_quantize_exl3({str(src)!r})\n"
        "w = (torch.randn(512, 256) * 0.02).to(torch.bfloat16).cuda()\n"
        "torch.cuda.synchronize(); t = time.perf_counter()\n"
        "fork_call(fn, w, 4, 5, 'cuda:0'); torch.cuda.synchronize()\n"
        "print(time.perf_counter() - t)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_CACHE_DIR"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               VLLM_EXL3_ONLINE_CACHE_DIR=str(root), HOME=str(tmp_path / "home"))
    times, counts = [], []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        times.append(float(out.stdout.split()[-1]))
        counts.append(sum(1 for p in (root / "exl3tool-triton").rglob("*") if p.is_file()))
    print(f"first call: cold {times[0]:.3f} s, from the on-disk cache {times[1]:.3f} s; files {counts}")
    assert counts[0] > 0 and counts[1] == counts[0]
    assert not (tmp_path / "home" / ".triton" / "cache").exists() or not any(
        (tmp_path / "home" / ".triton" / "cache").iterdir())
    assert times[1] < times[0]
