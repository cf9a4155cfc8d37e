"""One verdict per entry, whatever the command (issue 38).

A tiny model is warmed, then each entry is mutated one way (a table of mutations, random choices seeded per run)
and every command that judges entries is asked: ``judge_entry`` itself, ``cache verify``, ``cache prune --invalid``,
``cache export``, ``cache check``, ``cache warm --dry-run``, a warm run, and ``cache import`` of a bundle carrying every
mutated file. All must agree (valid / unchecked / invalid where a command tells them apart, kept / refused where it
only tells invalid), the verdict must be the one expected for the mutation, and "the server would load it" must match
``helpers.server_lookup`` (an independent re-implementation of the server's loader).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import struct
from pathlib import Path

import pytest
import torch
from helpers import ENC, TINY, CliRunner, fake_warm, server_lookup
from safetensors.torch import save_file

from exl3tool.cache import CacheStore
from exl3tool.cache.bundle import BundleEntry, ExportPlan, import_bundle, plan_export, write_bundle
from exl3tool.cache.entry import META_SHA_FIELD, judge_entry, metadata_sha256, read_entry
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import _register, app
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.check import check
from seeds import fresh_seed

_register()
SEED = fresh_seed(32)


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _meta(edit):
    """A mutation that edits the metadata dict in place (header rewritten, tensors untouched)."""
    def apply(path: Path, rng: random.Random, other: Path) -> None:
        header, data = _split(path.read_bytes())
        edit(header["__metadata__"], rng)
        path.write_bytes(_join(header, data))
    return apply


def _legacy(meta: dict, rng: random.Random) -> None:
    """As exl3tool wrote entries before the metadata checksum."""
    del meta[META_SHA_FIELD]


def _legacy_then(edit):
    def both(meta: dict, rng: random.Random) -> None:
        _legacy(meta, rng)
        edit(meta, rng)
    return both


def _resealed(edit):
    """Edit, then recompute exl3tool_meta_sha256 as a writer would: only the other checks can catch it."""
    def both(meta: dict, rng: random.Random) -> None:
        edit(meta, rng)
        meta[META_SHA_FIELD] = metadata_sha256(meta)
    return both


def _tensors(edit):
    """A mutation that rewrites the file through safetensors with changed tensors, metadata kept."""
    def apply(path: Path, rng: random.Random, other: Path) -> None:
        contents = read_entry(path)
        tensors = dict(contents.tensors)
        edit(tensors, rng)
        save_file(tensors, str(path), metadata=contents.metadata)
    return apply


def _flip_trellis_bit(path: Path, rng: random.Random, other: Path) -> None:
    header, data = _split(path.read_bytes())
    t0, t1 = header["trellis"]["data_offsets"]
    data = bytearray(data)
    data[rng.randrange(t0, t1)] ^= 1 << rng.randrange(8)
    path.write_bytes(_join(header, bytes(data)))


def _truncate(path: Path, rng: random.Random, other: Path) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[:len(blob) - rng.randint(1, 200)])


def _other_file(path: Path, rng: random.Random, other: Path) -> None:
    path.write_bytes(other.read_bytes())  # another layer's valid entry under this key's name


def _server_written(meta: dict, rng: random.Random) -> None:
    for k in [k for k in meta if k.startswith("exl3tool_")]:
        del meta[k]


def _pop(name):
    return lambda meta, rng: meta.pop(name)


def _set(name, value):
    def edit(meta, rng):
        meta[name] = value
    return edit


def _proxy_other_number(meta, rng):
    meta["proxy_error"] = repr(float(meta["proxy_error"]) * rng.choice([0.5, 2.0, 10.0]))


def _pretty_key(meta, rng):
    meta["cache_key"] = json.dumps(json.loads(meta["cache_key"]), indent=1)


def _extra_tensor(tensors, rng):
    tensors["extra"] = torch.randn(rng.randint(1, 64))


def _reshape_trellis(tensors, rng):
    t = tensors["trellis"]
    tensors["trellis"] = t.reshape(t.shape[0] * t.shape[1], t.shape[2]).contiguous()


def _nan_suh(tensors, rng):
    tensors["suh"] = tensors["suh"].clone()
    tensors["suh"][rng.randrange(tensors["suh"].numel())] = float("nan")


def _suh_as_f32(tensors, rng):
    tensors["suh"] = tensors["suh"].float()


# mutation -> expected verdict (valid | unchecked | invalid)
MUTATIONS = {
    "untouched": (lambda path, rng, other: None, "valid"),
    "key checksum without file checksum": (_meta(_pop("exl3tool_sha256")), "invalid"),
    "both tensor checksums removed": (_meta(lambda m, r: (m.pop("exl3tool_sha256"), m.pop("exl3tool_key_sha256"))), "invalid"),
    "metadata checksum removed too (legacy form)": (_meta(_legacy), "valid"),
    "server-written (no exl3tool field)": (_meta(_server_written), "unchecked"),
    "proxy_error removed": (_meta(_pop("proxy_error")), "invalid"),
    "proxy_error empty": (_meta(_set("proxy_error", "")), "invalid"),
    "proxy_error '1_0'": (_meta(_set("proxy_error", "1_0")), "invalid"),
    "proxy_error ' 1e-3 '": (_meta(_set("proxy_error", " 1e-3 ")), "invalid"),
    "proxy_error another number": (_meta(_proxy_other_number), "invalid"),
    "proxy_error 'nan'": (_meta(_set("proxy_error", "nan")), "invalid"),
    "proxy_error 'abc'": (_meta(_set("proxy_error", "abc")), "invalid"),
    "legacy entry, proxy_error '1_0'": (_meta(_legacy_then(_set("proxy_error", "1_0"))), "invalid"),
    "legacy entry, proxy_error removed": (_meta(_legacy_then(_pop("proxy_error"))), "invalid"),
    "legacy entry, proxy_error empty": (_meta(_legacy_then(_set("proxy_error", ""))), "invalid"),
    "extra metadata field": (_meta(_set("note", "x")), "invalid"),
    "metadata checksum wrong": (_meta(_set(META_SHA_FIELD, "0" * 64)), "invalid"),
    "exl3tool_version edited": (_meta(_set("exl3tool_version", "9.9.9")), "invalid"),
    "resealed, key checksum wrong": (_meta(_resealed(_set("exl3tool_key_sha256", "1" * 64))), "invalid"),
    "cache_key pretty-printed": (_meta(_pretty_key), "invalid"),
    "another layer's file": (_other_file, "invalid"),
    "truncated file": (_truncate, "invalid"),
    "one trellis bit flipped": (_flip_trellis_bit, "invalid"),
    "extra tensor": (_tensors(_extra_tensor), "invalid"),
    "trellis wrong shape": (_tensors(_reshape_trellis), "invalid"),
    "suh F32": (_tensors(_suh_as_f32), "invalid"),
    "NaN in suh": (_tensors(_nan_suh), "invalid"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("verdicts") / "m", **{**TINY, "layers": 3}, seed=SEED % 2**31,
                                  shards=1)  # 36 entries: one per mutation, and others


def _request(model, cache, **kw) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=str(cache), device="cpu", **ENC, **kw)


def _bundle_of(root: Path, jobs) -> bytes:
    """A bundle carrying every file as it is (no check): what a hostile or careless exporter could ship."""
    entries = []
    for j in jobs:
        rel = j.path.relative_to(root).as_posix()
        blob = j.path.read_bytes()
        entries.append(BundleEntry(rel, j.key.digest(), j.key.canonical_json(), len(blob), hashlib.sha256(blob).hexdigest()))
    buf = io.BytesIO()
    write_bundle(ExportPlan(root, tuple(sorted(entries, key=lambda e: e.path)), ()), buf)
    return buf.getvalue()


def test_every_command_gives_the_same_verdict(model, tmp_path, monkeypatch):
    rng = random.Random(SEED)
    cache = tmp_path / "cache"
    first = fake_warm(_request(model, cache), monkeypatch)
    assert first.counts["encoded"] > len(MUTATIONS)
    _, plan, _ = prepare(_request(model, cache))
    jobs = sorted(plan.jobs, key=lambda j: j.digest)
    rng.shuffle(jobs)
    chosen = dict(zip(MUTATIONS, jobs))
    others = [j for j in jobs if j not in chosen.values()]
    for name, job in chosen.items():
        MUTATIONS[name][0](job.path, rng, others[0].path)
    by_digest = {job.digest: name for name, job in chosen.items()}
    where = f"(seed {SEED})"

    verdicts: dict[str, dict[str, str]] = {name: {} for name in MUTATIONS}

    def note(command: str, digest: str, status: str) -> None:
        if digest in by_digest:
            verdicts[by_digest[digest]][command] = status

    for name, job in chosen.items():
        note("judge_entry", job.digest, judge_entry(job.path).status)
        note("judge_entry(key)", job.digest, judge_entry(job.path, job.key, load_trellis=False).status)

    runner = CliRunner()
    verify = json.loads(runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache), "--json"]).stdout)
    flagged = {i["digest"]: "invalid" for i in verify["invalid"]} | {i["digest"]: "unchecked" for i in verify["unchecked"]}
    for job in chosen.values():
        note("cache verify", job.digest, flagged.get(job.digest, "valid"))

    prune = json.loads(runner.invoke(app, ["cache", "prune", "--invalid", "--dry-run", "--cache-dir", str(cache),
                                           "--json"]).stdout)
    pruned = {i["digest"] for i in prune["planned"] if i["kind"] == "entry"}
    for job in chosen.values():
        note("cache prune --invalid", job.digest, "invalid" if job.digest in pruned else "kept")

    export = plan_export(cache)
    shipped = {e.digest for e in export.entries}
    for job in chosen.values():
        note("cache export", job.digest, "kept" if job.digest in shipped else "invalid")

    report = check(_request(model, cache))
    for j in report.plan.jobs:
        note("cache check", j.digest, {"hit": "kept", "invalid": "invalid"}.get(j.state, j.state))

    _, dry, _ = prepare(_request(model, cache, mode="readonly"))
    for j in dry.jobs:
        state = j.state if j.state != "hit" else ("unchecked" if "unchecked" in j.reason else "valid")
        note("cache warm --dry-run", j.digest, state)

    store = CacheStore(tmp_path / "imported")
    report_i = import_bundle(io.BytesIO(_bundle_of(cache, chosen.values())), store)
    for item in report_i.items:
        digest = Path(item.path).name.removesuffix(".safetensors")
        note("cache import", digest, "invalid" if item.status == "refused" else "kept")

    summary = fake_warm(_request(model, cache), monkeypatch)
    for e in summary.entries:
        note("cache warm", e.digest, {"hit": "kept", "encoded": "invalid"}.get(e.status, e.status))

    coarse = {"valid": "kept", "unchecked": "kept", "invalid": "invalid"}
    problems = []
    for name, got in verdicts.items():
        want = MUTATIONS[name][1]
        for command, status in got.items():
            if status not in (want, coarse[want]):
                problems.append(f"{name}: {command} says {status}, expected {want}")
        assert len(got) == 9, f"{name}: not every command judged it {got}"
    assert not problems, f"{where}\n" + "\n".join(problems)

    # the server's own view (independent loader) matches "loadable" for every mutation
    for name, job in chosen.items():
        k = job.key
        loads = server_lookup(tmp_path / "imported", k.model_identity, k.encoder_identity, k.prefix, k.bits,
                              k.tp_world_size, k.tp_rank, k.input_size, k.output_size)  # imported: kept ones only
        assert (loads is not None) == (MUTATIONS[name][1] != "invalid"), f"{name} {where}"

    # after the warm every entry is valid again, but the server-written one (unchecked, kept as the server loads it)
    after = json.loads(runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache), "--json"]).stdout)
    assert after["invalid"] == [] and len(after["unchecked"]) == 1, where
    assert after["valid"] == after["entries"] - 1


def test_loadable_matches_the_servers_loader(model, tmp_path, monkeypatch):
    """``judge_entry``'s "the server would load it" is the independent loader's answer, for every mutation."""
    rng = random.Random(SEED + 1)
    cache = tmp_path / "cache"
    fake_warm(_request(model, cache), monkeypatch)
    _, plan, _ = prepare(_request(model, cache))
    jobs = list(plan.jobs)
    rng.shuffle(jobs)
    for (name, (mutate, want)), job in zip(MUTATIONS.items(), jobs):
        mutate(job.path, rng, jobs[-1].path)
        k = job.key
        loads = server_lookup(cache, k.model_identity, k.encoder_identity, k.prefix, k.bits, k.tp_world_size, k.tp_rank,
                              k.input_size, k.output_size) is not None
        verdict = judge_entry(job.path)
        assert verdict.status == want, f"{name}: {verdict.status} ({verdict.reason}) (seed {SEED})"
        assert verdict.loadable == loads, f"{name}: loadable {verdict.loadable}, the server loads it: {loads}"
        if want == "invalid":
            assert verdict.reason, name


def test_same_inputs_give_the_same_bytes_and_cover_the_metadata(tmp_path):
    from helpers import ENCODER_ID, MODEL_ID, make_encoded

    from exl3tool.cache import CacheKey, write_entry

    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    enc = make_encoded(128, 256, seed=random.Random(SEED).randrange(2**31))
    a = write_entry(tmp_path / "a" / "e.safetensors", key, enc.tensors(), enc.proxy_error, platform="cpu")
    b = write_entry(tmp_path / "b" / "e.safetensors", key, enc.tensors(), enc.proxy_error, platform="cpu")
    assert a.read_bytes() == b.read_bytes()
    meta = read_entry(a).metadata
    assert meta[META_SHA_FIELD] == metadata_sha256(meta)
    assert set(meta) == {"cache_key", "proxy_error", "exl3tool_version", "exl3tool_sha256", "exl3tool_key_sha256",
                         "exl3tool_platform", META_SHA_FIELD}
    from exl3tool.cache.entry import entry_bytes

    assert a.stat().st_size <= entry_bytes(key, "cpu")
