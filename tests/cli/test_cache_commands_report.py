"""`cache ls|show|verify|prune` say what is true (issue 14): a missing cache directory, a truncated entry, a
checksum mismatch the server would still load, one `ls` row per (model, TP size), every JSON field documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ENCODER_ID, MODEL_ID, CliRunner, make_encoded

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.cli import _register, app
from exl3tool.errors import FindingsError, InputError


_register()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cache.md"
PREFIXES = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")


def cli(*args):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "cache"
    store = CacheStore(root)
    paths = {}
    for world in (1, 2):
        for rank in range(world):
            for prefix in PREFIXES:
                key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, prefix, 6, world, rank, 128, 256)
                paths[(prefix, world, rank)] = store.publish(key, make_encoded(128, 256, seed=rank))
    return root, paths


@pytest.mark.parametrize("command", [["cache", "ls"], ["cache", "verify"], ["cache", "prune", "--temp", "--dry-run"]],
                         ids=lambda c: " ".join(c[:2]))
def test_missing_or_non_directory_cache_dir_is_an_io_error(tmp_path, command):
    """Before: "0 entries", exit 0, for a typo in --cache-dir."""
    res = cli(*command, "--cache-dir", str(tmp_path / "nope"))
    assert isinstance(res.exception, InputError) and res.exception.exit_code == 2, res.output
    assert "does not exist" in str(res.exception) and str(tmp_path / "nope") in str(res.exception)
    (tmp_path / "file").write_text("x")
    res = cli(*command, "--cache-dir", str(tmp_path / "file"))
    assert isinstance(res.exception, InputError) and "is not a directory" in str(res.exception)
    (tmp_path / "empty").mkdir()
    assert cli(*command, "--cache-dir", str(tmp_path / "empty")).exit_code == 0  # exists, holds nothing yet


def test_truncated_entry_is_shorter_than_its_header_promises(cache):
    root, paths = cache
    path = paths[(PREFIXES[0], 1, 0)]
    full = path.read_bytes()
    for cut in (len(full) - 10, 300, 20, 5):
        path.write_bytes(full[:cut])
        res = cli("cache", "verify", "--cache-dir", str(root), "--json")
        reason = json.loads(res.stdout)["invalid"][0]["reason"]
        assert "shorter than" in reason and f"file is {cut} bytes" in reason, reason
        assert "deserializ" not in reason and "corrupt" not in reason
        key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, PREFIXES[0], 6, 1, 0, 128, 256)
        assert "shorter than" in CacheStore(root).lookup(key).reason
    path.write_bytes(full[:len(full) - 10])
    res = cli("cache", "show", str(path))
    assert isinstance(res.exception, FindingsError) and "shorter than the" in str(res.exception)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!")
    res = cli("cache", "verify", "--cache-dir", str(root), "--json")
    assert "not valid safetensors JSON" in json.loads(res.stdout)["invalid"][0]["reason"]


def test_show_on_a_checksum_mismatch_says_the_server_would_load_it(cache):
    """Before: "the server would not load this entry" next to "(the server would still load it)"."""
    root, paths = cache
    path = paths[(PREFIXES[1], 2, 1)]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # a trellis bit: the server's checks pass, exl3tool's checksum does not
    path.write_bytes(bytes(data))
    res = cli("cache", "show", str(path))
    text = " ".join((res.output + str(res.exception)).split())
    assert isinstance(res.exception, FindingsError) and res.exception.exit_code == 1
    assert "would not load" not in text
    assert "the server would load this entry" in text and "checksum" in text and "cache prune --invalid" in text
    doc = json.loads(cli("cache", "show", str(path), "--json").stdout)
    assert doc["status"] == "invalid" and doc["server_loads"] is True and doc["sha256_ok"] is False

    path.write_bytes(b"junk")  # one the server would not load keeps that sentence
    res = cli("cache", "show", str(path))
    assert "the server would not load this entry" in str(res.exception)


def test_ls_shows_one_row_per_model_and_tp_size_with_an_unreadable_entry(cache):
    """Before: the unreadable entry's row split off (identity unknown) and JSON carried an undocumented `bad`."""
    root, paths = cache
    paths[(PREFIXES[2], 2, 1)].write_bytes(b"truncated")
    res = cli("cache", "ls", "--cache-dir", str(root), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = [(g["model_identity"], g["tp_world_size"]) for g in doc["groups"]]
    assert rows == [(MODEL_ID, 1), (MODEL_ID, 2)]
    tp2 = doc["groups"][1]
    assert tp2["entries"] == 6 and tp2["malformed"] == 1 and tp2["ranks"] == [0, 1]
    assert "bad" not in tp2 and set(tp2) == {"model_identity", "tp_world_size", "ranks", "entries", "malformed", "bytes",
                                             "newest", "newest_utc"}
    human = cli("cache", "ls", "--cache-dir", str(root))
    # two rows by TP size, and one in the table by model and encoder identity
    assert human.exit_code == 0 and human.output.count(MODEL_ID[:20]) == 3


def _documented(section: str) -> set[str]:
    text = DOCS.read_text()
    return set(re.findall(r"`([a-z_0-9]+)`", text[text.index(section):]))


def test_every_json_field_is_documented(cache):
    root, paths = cache
    documented = _documented("## JSON output")
    ls_doc = json.loads(cli("cache", "ls", "--cache-dir", str(root), "--json").stdout)
    verify_doc = json.loads(cli("cache", "verify", "--cache-dir", str(root), "--json").stdout)
    show_doc = json.loads(cli("cache", "show", str(paths[(PREFIXES[0], 1, 0)]), "--json").stdout)
    prune_doc = json.loads(cli("cache", "prune", "--temp", "--dry-run", "--cache-dir", str(root), "--json").stdout)
    fields = set(ls_doc) | set(ls_doc["groups"][0]) | set(verify_doc) | set(show_doc) | set(prune_doc)
    missing = sorted(f for f in fields if f not in documented)
    assert not missing, f"fields missing from docs/cache.md: {missing}"


def test_model_filter_must_be_hex_and_a_declined_prune_removes_nothing(cache):
    """--model that no identity can start with is a usage error, not a silent 0 entries; answering no at the prune
    prompt removes nothing and is not an error."""
    root, paths = cache
    res = cli("cache", "ls", "--cache-dir", str(root), "--model", "zzzz")
    assert res.exit_code == 2 and "--model" in res.output
    res = cli("cache", "ls", "--cache-dir", str(root), "--model", MODEL_ID[:8].upper(), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["entries"] == len(paths)
    entry = next(iter(paths.values()))
    temp = entry.with_name(f".{entry.stem}.safetensors.12345.tmp")  # a killed writer's leftover
    temp.write_bytes(b"partial")
    res = CliRunner().invoke(app, ["cache", "prune", "--cache-dir", str(root), "--temp"], input="n\n")
    assert res.exit_code == 0 and "nothing removed" in res.output and temp.exists()
    res = CliRunner().invoke(app, ["cache", "prune", "--cache-dir", str(root), "--temp"], input="y\n")
    assert res.exit_code == 0 and not temp.exists()
