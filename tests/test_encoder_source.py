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
from _fork_loader import fork_call, fork_seed, load_quantize_exl3, unload
from seeds import fresh_bytes, fresh_seed

REPO = Path(__file__).resolve().parent.parent


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
    """One (256 in, 128 out) K=4 layer through the fork's loader and call, and through encode_linear."""
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
    import exl3tool.encode.online as online
    from exl3tool.encode.encoded import EncodedLinear

    seen = {}

    def fake(weight, *, bits, seed, codebook, sign_vectors, device):
        seen.update(bits=bits, seed=seed, codebook=codebook, su=sign_vectors[0])
        k, n = weight.shape
        return EncodedLinear(torch.zeros(k // 16, n // 16, 16 * bits, dtype=torch.int16),
                             torch.ones(k, dtype=torch.float16), torch.ones(n, dtype=torch.float16), 0.5, 1.0, bits,
                             codebook)

    monkeypatch.setattr(online, "encode_linear", fake)
    qa = {"K": 3, "seed": 77, "devices": ["cpu"], "apply_out_scales": True, **flags}
    _, proxy, tensors = quantize_exl3(torch.randn(128, 256), {"H": torch.empty(128, 128, device="meta"),
                                                              "device": "cpu"}, qa, False)
    assert seen["codebook"] == codebook and seen["bits"] == 3 and seen["seed"] == 77 and proxy == 0.5
    assert list(tensors) == ["suh", "svh", "trellis", *markers]
    assert {name: int(tensors[name]) for name in markers} == markers


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
    (dict(h={"count": 4096}), "H_data['count'] = 4096"),
    (dict(qa={"K": 2.5}), "quant_args['K'] = 2.5 is a fractional bitrate"),
    (dict(qa={"apply_out_scales": False}), "quant_args['apply_out_scales'] = False"),
    (dict(qa={"no_pack": True}), "quant_args['no_pack']"),
    (dict(qa={"seed": _DROP}), "quant_args has no 'seed'"),
    (dict(qa={"lambda_reg": 0.5}), "quant_args key(s) 'lambda_reg' are not ones exllamav3 1.6.5 reads"),
    (dict(qa={"devices": ["cuda:0"]}), "H_data['device'] cpu differs from quant_args['devices'][0] cuda:0"),
    (dict(return_weight_q=True), "return_weight_q=True"),
    (dict(save_reg="/tmp/r.png"), "save_reg="),
])
def test_unsupported_calls_name_the_argument_and_the_encoder_to_use(kwargs, words):
    with pytest.raises(UnsupportedCallError) as info:
        _call(**kwargs)
    assert words in str(info.value) and _INSTEAD in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    (dict(qa={"K": 9}), "K must be an integer from 1 to 8"),
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
    """Three threads call at once (the CPU path serialises; numba's pool is not re-entrant): same bytes as one by one."""
    weights = [torch.randn(128, 128) * (0.01 + 0.01 * i) for i in range(3)]

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

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(3):
        again = one(i)
        assert results[i][0] == again[0] and all(torch.equal(a, b) for a, b in zip(results[i][1:], again[1:]))


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
