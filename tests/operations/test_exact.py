"""Exact checks of entries against fresh encodes (exl3tool.operations.exact): `verify --exact`, `cache warm --check-unchecked`.

The platform rule: an entry recording this platform must be byte-identical; one written elsewhere (or without a
record, as the server's) may differ only where another Hadamard summation order makes tiles differ. "Another
platform" is simulated on the CPU by an encode whose Hadamard products are summed in float64 (rounded once), which
moves W_r by an ulp as cuBLAS does, and whose global scale is 1.1e-5 off (golden case0's CPU/H200 difference): 20-35
of 128 tiles then differ, each within 1 % of this platform's tile error (6 draws). Golden case0 (the reference's
encode on an H200) is the real other platform.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import exl3tool.encode.online as online
from exl3tool import __version__
from exl3tool.cache import CacheKey
from exl3tool.cache.entry import read_entry
from exl3tool.operations.exact import compare_exact, fresh_encode
from exl3tool.operations.verify import verify_plan
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import warm

from helpers import ENC, completed, viterbi_memo, warm_one_layer
from goldens import golden_case
from seeds import fresh_seed

# every test here shares a module fixture that encodes on the CPU (30-100 s on 2 shared cores, --durations):
# the full suite only (issue 44)
pytestmark = pytest.mark.slow

LAYER = "model.layers.1.self_attn.o_proj"


@pytest.fixture(scope="module", autouse=True)
def _memo():
    """The fresh encodes of verify --exact and warm --check-unchecked repeat the warm's encode of the same weight:
    their Viterbi reuses its states where the tiles are the same bits (helpers.viterbi_memo); where a fresh encode's
    tiles differ the kernel runs, so a wrong fresh encode still differs."""
    with viterbi_memo() as counts:
        yield counts


def _flip_bit(trellis: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy with one random bit of one random word flipped."""
    g = torch.Generator().manual_seed(seed)
    out = trellis.clone()
    flat = out.view(-1)
    i = int(torch.randint(0, flat.numel(), (1,), generator=g))
    bit = int(torch.randint(0, 16, (1,), generator=g))
    flat[i] = flat[i] ^ (1 << bit if bit < 15 else -32768)
    return out


def _server_style(path, tensors=None, proxy=None) -> None:
    """Rewrite ``path`` as the server writes entries: its two metadata keys only (no checksum, no platform)."""
    contents = read_entry(path)
    meta = {k: v for k, v in contents.metadata.items() if k in ("cache_key", "proxy_error")}
    if proxy is not None:
        meta["proxy_error"] = proxy
    save_file(tensors or contents.tensors, str(path), metadata=meta)


def _other_platform(monkeypatch) -> None:
    """Encodes from here on sum the Hadamard products in float64: the W_r of another platform's summation order."""
    plain = online.hadamard_right
    monkeypatch.setattr(online, "hadamard_right", lambda m: plain(m.double()).float())
    monkeypatch.setattr(online, "hadamard_left", lambda m: online.hadamard_right(m.t().contiguous()).t().contiguous())


# --------------------------------------------------------------- compare_exact on its own


@pytest.fixture(scope="module")
def layer():
    """A fresh recipe-like weight (128 x 256) with its key, this platform's encode and another platform's."""
    g = torch.Generator().manual_seed(fresh_seed(24))
    w = (torch.randn(128, 256, generator=g) * 0.02 * torch.exp(0.5 * torch.randn(128, 1, generator=g))).float()
    key = CacheKey.for_layer("m" * 64, "e" * 64, "model.layers.0.mlp.down_proj", 8, 1, 0, 128, 256)
    fresh, w_r = fresh_encode(w, key, torch.device("cpu"))
    mp = pytest.MonkeyPatch()
    _other_platform(mp)
    try:  # and a scale search that lands 1.1e-5 away, as the CPU's did from the H200's on golden case0
        other, _ = online.encode_linear_with_input(w, bits=8, seed=key.seed, g_scale=fresh.g_scale * (1 + 1.1e-5))
    finally:
        mp.undo()
    return fresh, w_r, other


def _entry(enc):
    return {"trellis": enc.trellis, "suh": enc.suh, "svh": enc.svh}


def test_same_platform_must_be_byte_identical(layer):
    fresh, w_r, _ = layer
    here = {"exl3tool_platform": fresh.platform, "exl3tool_version": __version__}
    assert compare_exact(_entry(fresh), fresh.proxy_error, here, fresh, w_r).verdict == "identical"
    flipped = dict(_entry(fresh), trellis=_flip_bit(fresh.trellis, 1))
    check = compare_exact(flipped, fresh.proxy_error, here, fresh, w_r)
    assert check.verdict == "differs" and "1 of 128 tiles differ" in check.detail and "this platform" in check.detail
    check = compare_exact(_entry(fresh), fresh.proxy_error * (1 + 1e-12), here, fresh, w_r)
    assert check.verdict == "differs" and "proxy_error" in check.detail


def test_another_platform_is_equivalent_and_a_flipped_bit_still_differs(layer):
    fresh, w_r, other = layer
    differing = int((other.trellis != fresh.trellis).any(-1).sum())
    assert differing > 0  # the simulation moves some tiles (measured 22-36 of 128)
    for meta in ({}, {"exl3tool_platform": "cuda NVIDIA H200; torch 2.13.0", "exl3tool_version": __version__}):
        check = compare_exact(_entry(other), other.proxy_error, meta, fresh, w_r)
        assert check.verdict == "equivalent" and check.tiles_differing == differing, check
        bad = compare_exact(dict(_entry(other), trellis=_flip_bit(other.trellis, 2)), other.proxy_error, meta, fresh, w_r)
        assert bad.verdict == "differs" and "trellis tile" in bad.detail, bad
    swapped = dict(_entry(other), suh=other.suh.flip(0))
    assert compare_exact(swapped, other.proxy_error, {}, fresh, w_r).verdict == "differs"


def test_golden_reference_encode_is_not_called_different(golden):
    """The reference's own H200 bytes (no platform record, like the server's) pass; one flipped bit does not.

    The reference's global scale is given (the CPU's search finds it to 1e-5; skipping it halves the time)."""
    tag = "case0"
    gold = golden_case(golden, "encode_e2e", tag)
    meta = gold["meta"]
    key = CacheKey.for_layer("m" * 64, "e" * 64, meta[f"{tag}.prefix"], 6, 1, 0, *gold["weight"].shape)
    assert key.seed == int(meta[f"{tag}.seed"])
    fresh, w_r = online.encode_linear_with_input(gold["weight"], bits=6, seed=key.seed, g_scale=float(gold["g_scale"]))
    entry = {"trellis": gold["trellis"], "suh": gold["suh"], "svh": gold["svh"]}
    proxy = float(meta[f"{tag}.proxy_error"])
    assert compare_exact(entry, proxy, {}, fresh, w_r).verdict in ("identical", "equivalent")
    for seed in range(3):
        bad = compare_exact(dict(entry, trellis=_flip_bit(gold["trellis"], seed)), proxy, {}, fresh, w_r)
        assert bad.verdict == "differs", bad


# --------------------------------------------------------------- verify --exact and warm --check-unchecked


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    return warm_one_layer(tmp_path_factory.mktemp("exact"), LAYER, fresh_seed(24))


@pytest.fixture
def tampered(warmed, tmp_path):
    """A copy of the cache with both entries server-style: rank 0 with one flipped trellis bit, rank 1 as encoded."""
    model, cache = warmed
    dst = tmp_path / "cache"
    shutil.copytree(cache, dst)
    _, plan, _ = prepare(ServerRequest(model=str(model), tp_sizes=(2,), layers=(LAYER,), cache_dir=str(dst),
                                     mode="readonly", **ENC))
    jobs = sorted(plan.jobs, key=lambda j: j.tp_rank)
    originals = {j.tp_rank: j.path.read_bytes() for j in jobs}
    bad = read_entry(jobs[0].path).tensors
    _server_style(jobs[1].path)
    # a flipped bit the tolerance check cannot see: most are, but one that moves a large weight of this random
    # model can cross the bound, so take the first of a few random flips that stays within it
    checkpoint, plan, store = prepare(_request(model, dst, mode="readonly"))
    for seed in range(7, 47):
        _server_style(jobs[0].path, dict(bad, trellis=_flip_bit(bad["trellis"], seed)))
        if verify_plan(plan, checkpoint, store, rows=(1, 16), device=torch.device("cpu")).ok:
            break
    else:
        pytest.fail("every one of 40 flipped bits crossed the tolerance bound")
    return model, dst, jobs, originals


def _request(model, cache, **kw):
    return ServerRequest(model=str(model), tp_sizes=(2,), layers=(LAYER,), cache_dir=str(cache), device="cpu", **ENC, **kw)


@pytest.mark.slow
def test_verify_exact_names_the_flipped_bit_the_tolerance_check_passes(tampered, tmp_path):
    model, cache, jobs, _ = tampered
    checkpoint, plan, store = prepare(_request(model, cache, mode="readonly"))
    loose = verify_plan(plan, checkpoint, store, rows=(1, 16), device=torch.device("cpu"))
    assert loose.ok, [c.reason for c in loose.layers]  # within the bound: only exactness can tell
    report = tmp_path / "r.md"
    r = completed(["verify", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir", str(cache), "--rows", "1",
                   "--device", "cpu", "--encoder-root", ENC["encoder_root"], "--encoder-revision",
                   ENC["encoder_revision"], "--exact", "--json", "--report", str(report)])
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"]["exact"] == {"identical": 1, "equivalent": 0, "differs": 1, "unproved": 0}
    assert [(d["prefix"], d["tp_rank"], d["path"]) for d in doc["differs"]] == [(LAYER, 0, str(jobs[0].path))]
    assert "trellis tile" in doc["differs"][0]["detail"]
    assert {layer["tp_rank"]: layer["exact"]["verdict"] for layer in doc["layers"]} == {0: "differs", 1: "identical"}
    assert [layer["status"] for layer in sorted(doc["layers"], key=lambda x: x["tp_rank"])] == ["fail", "pass"]
    assert f"differ from a fresh encode: {LAYER} rank 0" in r.stderr
    rows = [line for line in report.read_text().splitlines() if line.startswith(f"| {LAYER} |")]
    assert len(rows) == 2 and "| differs | FAIL" in rows[0] + rows[1] and "| identical | pass |" in rows[0] + rows[1]


def test_warm_names_unchecked_hits_and_check_unchecked_replaces_only_the_wrong_one(tampered):
    model, cache, jobs, originals = tampered
    plain = warm(_request(model, cache))
    assert plain.counts == {"hit": 2, "encoded": 0, "skipped": 0, "failed": 0}
    assert plain.unchecked_hits == 2
    assert {(u.prefix, u.tp_rank, u.path, u.verdict) for u in plain.unchecked} == {
        (LAYER, 0, str(jobs[0].path), None), (LAYER, 1, str(jobs[1].path), None)}
    kept_bytes = jobs[1].path.read_bytes()

    checked = warm(_request(model, cache, check_unchecked=True))
    assert checked.counts == {"hit": 1, "encoded": 1, "skipped": 0, "failed": 0}
    by_rank = {u.tp_rank: u for u in checked.unchecked}
    assert (by_rank[0].verdict, by_rank[0].action) == ("differs", "replaced")
    assert (by_rank[1].verdict, by_rank[1].action) == ("identical", "kept")
    assert jobs[0].path.read_bytes() == originals[0]  # the fresh encode is the warm's own bytes again
    assert jobs[1].path.read_bytes() == kept_bytes  # the right server-style entry is left as it was
    again = warm(_request(model, cache))
    assert again.unchecked_hits == 1 and again.unchecked[0].tp_rank == 1


def test_warm_json_lists_unchecked_hits(tampered):
    model, cache, jobs, _ = tampered
    r = completed(["cache", "warm", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir", str(cache),
                   "--device", "cpu", "--encoder-root", ENC["encoder_root"], "--encoder-revision",
                   ENC["encoder_revision"], "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["unchecked_hits"] == 2
    assert sorted((u["prefix"], u["tp_rank"], u["path"]) for u in doc["unchecked"]) == [
        (LAYER, 0, str(jobs[0].path)), (LAYER, 1, str(jobs[1].path))]
    assert all(u["verdict"] is None and u["action"] is None for u in doc["unchecked"])
    assert str(jobs[0].path) in r.stderr and str(jobs[1].path) in r.stderr
