"""The `--json` documents are the library's: each command prints its report's ``as_json()`` (docs/cache.md), so a
caller of the library gets the same document as a caller of the CLI. Each test runs the command on a tiny case and
compares its stdout with ``as_json()`` of the very report the command got (or of the same scan, recomputed)."""

from __future__ import annotations

import importlib

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ENC, ENC_ARGS, CliRunner, fake_warm

from exl3tool.cache import CacheHealth, inspect_entry, plan_prune, scan
from exl3tool.cache.bundle import plan_export
from exl3tool.cache.listing import list_cache
from exl3tool.cache.prune_report import PruneReport
from exl3tool.cache.records import plan_record_prune, read_records
from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.cli import _register, app
from exl3tool.jsontext import to_jsonable
from exl3tool.plan import ServerRequest, prepare

_register()


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], prog_name="exl3tool")


def doc(res) -> dict:
    return json.loads(res.stdout)


def same(a: dict) -> dict:
    """A report's ``as_json()`` as the CLI prints it (JSON values, the same round trip)."""
    return json.loads(json.dumps(to_jsonable(a)))


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A tiny Llama warmed at TP 1 and 2 (fake encodes), one entry then broken by a flipped trellis bit."""
    root = tmp_path_factory.mktemp("reports")
    model = write_tiny(root / "llama", "llama")
    mp = pytest.MonkeyPatch()
    try:
        summary = fake_warm(ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=root / "cache", **ENC), mp)
    finally:
        mp.undo()
    return model, root / "cache", summary


def capture(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so that every value it returns is kept (the report a command renders)."""
    real, seen = getattr(module, name), []

    def wrapper(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(module, name, wrapper)
    return seen


def test_cache_check_prints_the_check_reports_document(warmed, monkeypatch):

    model, cache, _ = warmed
    seen = capture(monkeypatch, importlib.import_module("exl3tool.operations.check"), "check")  # the command imports it when run
    res = cli("cache", "check", model, "--tp-size", "1,2", "--cache-dir", cache, *ENC_ARGS, "--json")
    assert res.exit_code == 0, res.output
    [report] = seen
    assert doc(res) == same(report.as_json())
    assert doc(res)["hit"] == doc(res)["lookups"] > 0


def test_cache_check_of_a_launch_without_look_ups_prints_the_librarys_document(warmed):
    from exl3tool.operations.check import no_lookup_json

    model, cache, _ = warmed
    res = cli("cache", "check", "--cache-dir", cache, "--json", "--launch", f"vllm serve {model}")
    assert res.exit_code == 1, res.output
    expected = no_lookup_json(tuple(doc(res)["lookup_off"]))
    assert set(doc(res)) == set(expected) | {"settings", "launch"}
    assert {k: doc(res)[k] for k in expected} == same(expected) and doc(res)["lookup_off"]


def test_dry_run_prints_the_plans_document(warmed):
    model, cache, _ = warmed
    res = cli("cache", "warm", model, "--tp-size", "1,2,4", "--cache-dir", cache, *ENC_ARGS, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    _, plan, _ = prepare(ServerRequest(model=str(model), tp_sizes=(1, 2, 4), cache_dir=cache, **ENC))
    assert doc(res) == same(plan.as_json())
    assert {j["state"] for j in doc(res)["jobs"]} >= {"hit", "miss"}  # TP 4 is not warmed


def test_cache_warm_prints_the_summarys_document(warmed, monkeypatch):

    model, cache, _ = warmed
    seen = capture(monkeypatch, importlib.import_module("exl3tool.operations.warm"), "warm")  # the command imports it when run
    res = cli("cache", "warm", model, "--tp-size", "2", "--cache-dir", cache, *ENC_ARGS, "--json")
    assert res.exit_code == 0, res.output
    [summary] = seen
    assert doc(res) == same(summary.as_json())
    assert doc(res)["counts"]["hit"] == len(summary.entries) > 0


def test_verify_prints_the_verify_reports_document(warmed, monkeypatch, tmp_path):

    model, cache, _ = warmed
    seen = capture(monkeypatch, importlib.import_module("exl3tool.operations.verify"), "verify_plan")  # the command imports it when run
    report_file = tmp_path / "verify.json"
    res = cli("verify", model, "--cache-dir", cache, *ENC_ARGS, "--layers", "*o_proj", "--rows", "1", "--json",
              "--report", report_file)
    assert res.exit_code in (0, 1), res.output  # fake encodes: the quantization error may be over the bound
    [report] = seen
    assert doc(res) == same(report.as_json())
    assert json.loads(report_file.read_text()) == doc(res)
    assert doc(res)["counts"]["pass"] + doc(res)["counts"]["fail"] == len(report.layers) > 0


def test_cache_verify_show_and_prune_print_the_scans_documents(warmed, tmp_path):
    import shutil

    _, cache, summary = warmed
    root = tmp_path / "cache"

    shutil.copytree(cache, root)
    entry = root / Path(summary.entries[0].path).relative_to(cache)
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0x20  # our checksum fails: one invalid entry
    entry.write_bytes(bytes(data))
    (entry.parent / f".{entry.name}.1-x.tmp").write_bytes(b"half")  # a leftover temp file

    res = cli("cache", "verify", "--cache-dir", root, "--json")
    assert res.exit_code == 1, res.output
    health = CacheHealth.of(root, scan(root, deep=True))
    assert doc(res) == same(health.as_json())
    assert len(doc(res)["invalid"]) == 1 and len(doc(res)["temp_files"]) == 1 and not health.ok

    res = cli("cache", "show", entry, "--json")
    assert res.exit_code == 1, res.output
    info = inspect_entry(entry)
    assert doc(res) == same(info.show_json())
    assert doc(res)["status"] == "invalid" and doc(res)["tensors"]["trellis"]["dtype"] == "I16"

    res = cli("cache", "prune", "--invalid", "--temp", "--dry-run", "--cache-dir", root, "--json")
    assert res.exit_code == 0, res.output
    plan = plan_prune(scan(root, deep=True), invalid=True, temp=True)
    rplan = plan_record_prune(root, read_records(root), invalid=True,
                              removing={i.path for i, _ in plan.items if i.kind == "entry"})
    planned = PruneReport(root, plan, rplan, dry_run=True)
    assert doc(res) == same(planned.as_json())
    assert {p["kind"] for p in doc(res)["planned"]} >= {"entry", "temp"}

    res = cli("cache", "prune", "--invalid", "--temp", "--yes", "--cache-dir", root, "--json")
    assert res.exit_code == 0, res.output
    pruned = same(replace(planned, dry_run=False, freed=plan.bytes_freed).as_json())
    assert doc(res) == pruned and doc(res)["bytes_freed"] > 0
    assert not entry.exists()


def test_cache_ls_prints_the_listings_document(warmed):
    _, cache, summary = warmed
    res = cli("cache", "ls", "--cache-dir", cache, "--json")
    assert res.exit_code == 0, res.output
    assert doc(res) == same(list_cache(cache).as_json())
    assert {(g["tp_world_size"], tuple(g["ranks"])) for g in doc(res)["groups"]} == {(1, (0,)), (2, (0, 1))}
    assert doc(res)["entries"] == len(summary.entries)


def test_identity_prints_the_identities_document(warmed, monkeypatch):
    from exl3tool.checkpoint import resolve_overlay

    model, _, _ = warmed
    seen = capture(monkeypatch, importlib.import_module("exl3tool.cache.identity"), "server_identities")  # the command imports it when run
    res = cli("identity", model, *ENC_ARGS, "--json")
    assert res.exit_code == 0, res.output
    [ids] = seen
    source = doc(res)["encoder"]["source_detail"]
    assert doc(res) == same(ids.as_json(str(model), source_detail=source,
                                        quantization_config=resolve_overlay(None).as_json()))
    assert doc(res)["model"]["identity"] == ids.model.identity and doc(res)["encoder"]["root"] == ENC["encoder_root"]


def test_export_and_import_print_the_bundles_documents(warmed, tmp_path, monkeypatch):
    import exl3tool.cache.bundle as bundle_mod

    _, cache, _ = warmed
    bundle = tmp_path / "b.tar"
    res = cli("cache", "export", bundle, "--cache-dir", cache, "--json")
    assert res.exit_code == 0, res.output
    assert doc(res) == same(plan_export(cache).as_json(str(bundle), bundle.stat().st_size))

    seen = capture(monkeypatch, bundle_mod, "import_bundle")
    res = cli("cache", "import", bundle, "--cache-dir", tmp_path / "other", "--json")
    assert res.exit_code == 0, res.output
    [report] = seen
    assert doc(res) == same(report.as_json(str(bundle)))
    assert doc(res)["imported"] == len(doc(res)["entries"]) > 0


def test_encoder_source_prints_the_exports_document(tmp_path, monkeypatch):
    import exl3tool.serving.encoder_source as source_mod
    from exl3tool.cache import resolve_encoder_identity

    seen = capture(monkeypatch, source_mod, "write_encoder_source")
    res = cli("encoder-source", tmp_path / "enc", "--json")
    assert res.exit_code == 0, res.output
    [result] = seen
    assert doc(res) == same(result.as_json(resolve_encoder_identity(result.path)))
    assert doc(res)["encoder"]["mode"] == "files" and doc(res)["files"]


def test_synth_prints_the_checkpoints_document(tmp_path):
    from exl3tool.checkpoint.tiny import TINY_FAMILIES

    res = cli("synth", tmp_path / "tiny", "--family", "llama", "--seed", "3", "--json")
    assert res.exit_code == 0, res.output
    assert doc(res) == same(TINY_FAMILIES["llama"].checkpoint_json(tmp_path / "tiny", 3))
    assert "config.json" in doc(res)["files"] and doc(res)["bytes"] > 0
