"""A re-warm never keeps an entry whose bytes fail exl3tool's checksum (issue 14).

A fuzz campaign found files the server loads (structure intact) with wrong weights: trellis zeroed or random,
flipped data bits, another entry's data section swapped in, finite edits of suh/svh. The warm's plan used to
check headers only and kept them as hits. Here every entry of a tiny model is corrupted in one of those ways
(random positions; the seed is in every failure message), then warmed again: every corrupted entry must be
re-encoded, none kept, and the cache must end byte-identical to the first warm. Entries without
``exl3tool_sha256`` (the server writes none) are `unchecked` in ``cache verify``, never `valid`.
"""

from __future__ import annotations

import json
import random
import struct

import pytest
from safetensors.torch import save_file
from helpers import ENC, TINY, CliRunner, fake_warm

from exl3tool.cache import CacheStore
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import _register, app
from exl3tool.plan import ServerRequest, prepare
from seeds import fresh_seed


_register()
CORRUPTIONS = ("trellis zeroed", "trellis random", "data bits flipped", "one trellis bit", "other entry's data",
               "suh finite edit", "svh finite edit")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("rewarm") / "m", **TINY, seed=11, shards=1)


def _request(model, cache) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=str(cache), device="cpu", **ENC)


def _split(blob: bytes) -> tuple[bytes, bytearray, dict]:
    """(8-byte length + header, data section, header dict) of a safetensors file."""
    n = struct.unpack("<Q", blob[:8])[0]
    return blob[:8 + n], bytearray(blob[8 + n:]), json.loads(blob[8:8 + n])


def _span(header: dict, name: str) -> tuple[int, int]:
    start, stop = header[name]["data_offsets"]
    return start, stop


def _edit_fp16(data: bytearray, header: dict, name: str, rng: random.Random) -> None:
    """Change one element of an F16 tensor to another finite value (the server's checks still pass)."""
    start, stop = _span(header, name)
    i = start + 2 * rng.randrange((stop - start) // 2)
    old = struct.unpack("<e", bytes(data[i:i + 2]))[0]
    new = old * 0.5 if old not in (0.0, -0.0) else 0.25
    data[i:i + 2] = struct.pack("<e", new)


def corrupt(blob: bytes, kind: str, rng: random.Random, other: bytes) -> bytes:
    head, data, header = _split(blob)
    t0, t1 = _span(header, "trellis")
    if kind == "trellis zeroed":
        data[t0:t1] = bytes(t1 - t0)
    elif kind == "trellis random":
        data[t0:t1] = rng.randbytes(t1 - t0)
    elif kind == "data bits flipped":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "one trellis bit":
        data[rng.randrange(t0, t1)] ^= 1 << rng.randrange(8)
    elif kind == "other entry's data":
        data = _split(other)[1]
    elif kind == "suh finite edit":
        _edit_fp16(data, header, "suh", rng)
    elif kind == "svh finite edit":
        _edit_fp16(data, header, "svh", rng)
    out = head + bytes(data)
    assert out != blob and len(out) == len(blob)
    return out


@pytest.mark.parametrize("round_", range(3))
def test_rewarm_re_encodes_every_entry_that_fails_the_checksum(model, tmp_path, monkeypatch, round_):
    seed = fresh_seed(32)
    rng = random.Random(seed)
    cache = tmp_path / "cache"
    first = fake_warm(_request(model, cache), monkeypatch)
    assert first.ok and first.counts["encoded"] == len(first.entries) == 24
    paths = {e.digest: cache.joinpath(e.path) for e in first.entries}
    original = {d: p.read_bytes() for d, p in paths.items()}
    by_shape: dict[tuple, list] = {}
    for e in first.entries:
        by_shape.setdefault((e.input_size, e.output_size), []).append(e)

    kinds = {}
    for e in first.entries:
        partner = rng.choice([o for o in by_shape[(e.input_size, e.output_size)] if o.prefix != e.prefix])
        kinds[e.digest] = kind = rng.choice(CORRUPTIONS)
        paths[e.digest].write_bytes(corrupt(original[e.digest], kind, rng, original[partner.digest]))
    note = f"seed {seed}"

    _, plan, _ = prepare(_request(model, cache))
    kept = [(j.prefix, j.tp_size, j.tp_rank, kinds[j.digest]) for j in plan.jobs if j.state == "hit"]
    assert not kept, f"{note}: planned as hits: {kept}"

    calls: list = []
    again = fake_warm(_request(model, cache), monkeypatch, calls)
    assert again.ok, note
    assert again.counts == {"hit": 0, "encoded": 24, "skipped": 0, "failed": 0}, note
    assert len(calls) == 24
    changed = [(kinds[d], p.name) for d, p in paths.items() if p.read_bytes() != original[d]]
    assert not changed, f"{note}: entries not restored: {changed}"
    res = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", str(cache), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["valid"] == 24, res.output


def test_entries_without_our_checksum_are_unchecked_not_valid(model, tmp_path, monkeypatch):
    """Server-written entries (no exl3tool_sha256): `cache verify` counts them apart with the hint; a warm keeps them."""
    cache = tmp_path / "cache"
    first = fake_warm(_request(model, cache), monkeypatch)
    server_written = [e for e in first.entries if e.tp_size == 2][:5]
    store = CacheStore(cache, "readonly")
    for e in server_written:
        path = cache.joinpath(e.path)
        from exl3tool.cache.entry import read_entry

        contents = read_entry(path)
        meta = {k: v for k, v in contents.metadata.items() if k in ("cache_key", "proxy_error")}  # what the server writes
        save_file(contents.tensors, str(path), metadata=meta)

    res = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", str(cache), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["entries"] == 24 and doc["valid"] == 19 and len(doc["unchecked"]) == 5 and doc["invalid"] == []
    assert {u["digest"] for u in doc["unchecked"]} == {e.digest for e in server_written}
    assert all(u["status"] == "unchecked" and u["server_loads"] is True and u["sha256_ok"] is None for u in doc["unchecked"])
    human = CliRunner().invoke(app, ["cache", "verify", "--cache-dir", str(cache)])
    text = " ".join((human.stdout + human.stderr).split())  # the hint may go to either stream
    assert "19 valid, 5 unchecked, 0 invalid" in text and "exl3tool verify MODEL" in text

    _, plan, _ = prepare(_request(model, cache))
    unchecked = {j.digest: j for j in plan.jobs if "unchecked" in j.reason}
    assert set(unchecked) == {e.digest for e in server_written}
    assert {j.state for j in unchecked.values()} == {"hit"}  # the server would load them: kept
    for e in server_written:
        found = store.lookup(next(j.key for j in plan.jobs if j.digest == e.digest))
        assert found.hit and found.checked is False
    again = fake_warm(_request(model, cache), monkeypatch)  # the summary counts them apart
    assert again.counts["hit"] == 24 and again.unchecked_hits == 5
