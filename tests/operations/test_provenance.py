"""Provenance records and `cache check`: every miss cause produced for real on a warmed cache (a touched shard, another
encoder revision, TP size, overlay and bits, entries the server wrote itself, an invalid entry), records carried by
bundles and checked as untrusted input, `cache ls` grouping and `cache prune` dropping records."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import CliRunner, fake_warm, server_key_json, server_path
from exl3tool.cache import server_identities
from exl3tool.cache.bundle import import_bundle, plan_export, write_bundle
from exl3tool.cache.records import RECORDS_DIR, parse_record, read_records, record_bytes
from exl3tool.cache.store import CacheStore
from exl3tool.cli import _register, app
from exl3tool.errors import Exl3ToolError
from exl3tool.plan import ServerRequest
from exl3tool.operations.check import check


from exl3tool.checkpoint.tiny import write_mla  # noqa: E402
from seeds import fresh_seed

_register()
# this file's own revision: a check with another (v0.0.19) must name both
ENC = dict(encoder_root="/encoders/exllamav3", encoder_revision="v0.0.18")
ENC_ARGS = ["--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]
SHARED = '{"linear": {"weight": "mxfp8"}, "shared_experts": "mxfp8"}'
# prefix, K, N at TP 1 of write_mla's model under the default overlay
TP1 = {"model.layers.0.self_attn.q_b_proj": (128, 512), "model.layers.0.self_attn.kv_b_proj": (128, 512),
       "model.layers.0.self_attn.o_proj": (256, 128), "model.layers.0.mlp.gate_up_proj": (128, 512),
       "model.layers.0.mlp.down_proj": (256, 128), "model.layers.1.self_attn.kv_b_proj": (128, 512),
       "model.layers.1.self_attn.o_proj": (256, 128)}


@pytest.fixture
def warmed(tmp_path, monkeypatch):
    """A tiny MLA checkpoint warmed at TP 1 (fake encoder), with its record; returns (request, model dir, summary)."""
    for name in ("VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "VLLM_EXL3_ONLINE_TRELLIS_BITS"):
        monkeypatch.delenv(name, raising=False)
    model = write_mla(tmp_path / "m", seed=fresh_seed(16))
    request = ServerRequest(model=str(model), tp_sizes=(1,), cache_dir=str(tmp_path / "cache"), **ENC)
    summary = fake_warm(request, monkeypatch)
    assert summary.counts["encoded"] == len(TP1) and summary.record and summary.record_written
    return request, model, summary


def run(*args):
    res = CliRunner().invoke(app, list(args))
    code = res.exception.exit_code if isinstance(res.exception, Exl3ToolError) else res.exit_code
    if res.exception is not None and not isinstance(res.exception, (Exl3ToolError, SystemExit)):
        raise res.exception
    return code, res.stdout, res.stderr + (str(res.exception) if res.exception else "")


def check_cli(request: ServerRequest, *extra: str):
    args = ["cache", "check", request.model, "--cache-dir", request.cache_dir, "--tp-size",
            ",".join(map(str, request.tp_sizes)), *ENC_ARGS, *extra]
    code, out, err = run(*args, "--json")
    return code, json.loads(out), err


def findings(doc, field):
    return [f for c in doc["causes"] for f in c["findings"] if f["field"] == field]


# --- records ------------------------------------------------------------------------------------------------------


def test_a_warm_records_the_payloads_as_hashed_and_a_rewarm_adds_nothing(warmed, monkeypatch):
    request, model, summary = warmed
    [stored] = read_records(request.cache_dir)
    r = stored.record
    ids = server_identities(str(model), **ENC)
    assert (r.model_payload, r.encoder_payload) == (ids.model.payload, ids.encoder.payload)
    assert hashlib.sha256(r.model_payload.encode()).hexdigest() == r.model_identity == summary.model_identity
    shards = json.loads(r.model_payload)["shards"]
    assert [s[0] for s in shards] == sorted(p.name for p in model.glob("*.safetensors"))
    assert r.settings.bits == 6 and r.settings.tp_sizes == (1,) and r.settings.dtype == "bfloat16"
    from exl3tool.plan import prepare

    assert r.settings.layers_planned == len(prepare(request)[1].layer_plan.layers)  # aligned or not
    assert r.command == "cache warm" and r.host
    written = {e.digest for e in summary.entries if e.status == "encoded"}  # not the skipped (unaligned) ones
    assert {e.digest for e in r.entries} == written and {e.status for e in r.entries} == {"written"}
    assert Path(stored.path).relative_to(Path(request.cache_dir) / RECORDS_DIR).parts[0] == r.model_identity[:20]
    assert parse_record(record_bytes(r)) == r
    again = fake_warm(request, monkeypatch)
    assert again.counts["hit"] == len(TP1) and again.record == summary.record and again.record_written is False
    assert len(read_records(request.cache_dir)) == 1  # deduplicated: the first warm's time stays


def test_encode_records_itself_as_encode(warmed, monkeypatch, tmp_path):
    """`encode` passes its name to warm(): the record says which command wrote the entries."""
    import exl3tool.operations.warm.run as req
    from helpers import fake_encode

    request, _, _ = warmed
    real = getattr(req.run_plan, "__wrapped__", req.run_plan)
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    summary = req.warm(replace(request, tp_sizes=(2,), cache_dir=str(tmp_path / "other")), command="encode")
    [stored] = read_records(tmp_path / "other")
    assert summary.record == str(stored.path) and stored.record.command == "encode"
    assert stored.record.settings.tp_sizes == (2,)


def test_no_record_without_a_writable_cache(warmed, monkeypatch, tmp_path):
    """A readonly encode writes nothing into the cache, so no record either."""
    import exl3tool.operations.warm.run as req
    from helpers import fake_encode

    request, _, _ = warmed
    real = getattr(req.run_plan, "__wrapped__", req.run_plan)
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    summary = req.warm(replace(request, mode="readonly", cache_dir=str(tmp_path / "ro")), command="encode")
    assert summary.record is None and not (tmp_path / "ro").exists()


# --- cache check: hits and every cause, each produced for real ----------------------------------------------------


def test_check_takes_the_options_of_cache_warm():
    """Every option of `cache warm` that can change a look-up is an option of `cache check`, spelled the same (the
    rest only change how a warm runs); both take them as rows of `options.ROWS`, in the same order."""
    import typer

    cache = typer.main.get_command(app).commands["cache"]
    run_only = {"device", "file_mode", "overlap", "dry_run", "lock_timeout", "progress", "gpu_memory", "check_unchecked",
                "trust_encoder_identity",
                "shard_option", "shard_count"}  # --shard splits the work; whether a warm may write (encoder parity), not where it looks
    warm_params = {p.name: p for p in cache.commands["warm"].params}
    check_params = {p.name: p for p in cache.commands["check"].params}
    check_only = {"nodes"}  # cache check --nodes: a fleet's identities compared, no look-up (tests/test_fleet.py)
    assert [n for n in check_params if n not in check_only] == [n for n in warm_params if n not in run_only]
    for name in set(check_params) - check_only:
        assert (check_params[name].opts, check_params[name].help) == (warm_params[name].opts, warm_params[name].help)


def test_check_of_a_missing_cache_root_says_so(warmed, tmp_path):
    request, _, _ = warmed
    code, doc, _ = check_cli(replace(request, cache_dir=str(tmp_path / "nowhere")))
    assert code == 1 and doc["miss"] == doc["lookups"]
    [f] = findings(doc, "absent")
    assert "does not exist here" in f["text"] and not (tmp_path / "nowhere").exists()
    assert [c["fields"] for c in doc["causes"]] == [["absent"]]


def test_check_of_a_file_as_cache_root_says_it_is_not_a_directory(warmed, tmp_path):
    request, _, _ = warmed
    (tmp_path / "a-file").write_text("not a cache")
    code, doc, _ = check_cli(replace(request, cache_dir=str(tmp_path / "a-file")))
    assert code == 1 and doc["miss"] == doc["lookups"]
    [f] = findings(doc, "absent")
    assert f["text"].endswith("a-file is not a directory") and "does not exist" not in f["text"]


def test_other_model_path_is_one_finding_not_a_second_about_shard_links(warmed):
    """A server mounting the checkpoint elsewhere: the path differs, and the shards' resolved paths only by it."""
    request, model, _ = warmed
    code, doc, _ = check_cli(request, "--server-path", "/models/m")
    assert code == 1 and doc["miss"] == len(TP1)
    [f] = findings(doc, "model_identity")
    assert f"model path /models/m here, {model} when warmed" in f["text"] and "--server-path /models/m" in f["fix"]


def test_check_all_hit_exits_0(warmed):
    request, _, _ = warmed
    code, doc, err = check_cli(request)
    assert code == 0, err
    assert doc["ok"] and doc["hit"] == doc["lookups"] == len(TP1) and doc["causes"] == []
    assert doc["hit_origins"] == {"record": len(TP1), "exl3tool": 0, "server": 0}


def test_touched_shard_names_the_shard_both_mtimes_and_the_fix(warmed):
    request, model, _ = warmed
    shard = sorted(model.glob("*.safetensors"))[-1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_123))  # a copy without -p
    code, doc, _ = check_cli(request)
    assert code == 1 and doc["miss"] == len(TP1) and not doc["ok"]
    [cause] = doc["causes"]
    assert cause["fields"] == ["model_identity"] and cause["nearest"]["origin"] == "record"
    [f] = findings(doc, "model_identity")
    assert f"{shard.name} mtime" in f["text"] and "when warmed" in f["text"] and "cp -p" in f["fix"]
    code, out, _ = run("cache", "check", request.model, "--cache-dir", request.cache_dir, *ENC_ARGS)
    assert code == 1 and shard.name in out and "rsync -t" in out


def test_changed_marker_file_is_named(warmed):
    request, model, _ = warmed
    cfg = json.loads((model / "config.json").read_text())
    cfg["comment"] = "edited"
    (model / "config.json").write_text(json.dumps(cfg))
    code, doc, _ = check_cli(request)
    assert code == 1
    assert any("config.json sha256" in f["text"] for f in findings(doc, "model_identity"))


def test_encoder_revision_string(warmed):
    request, _, _ = warmed
    code, out, _ = run("cache", "check", request.model, "--cache-dir", request.cache_dir, "--encoder-root",
                       ENC["encoder_root"], "--encoder-revision", "v0.0.19", "--json")
    doc = json.loads(out)
    assert code == 1 and [c["fields"] for c in doc["causes"]] == [["encoder_identity"]]
    [f] = findings(doc, "encoder_identity")
    assert "'v0.0.19' here, 'v0.0.18' when warmed" in f["text"] and "VLLM_EXL3_ENCODER_REVISION" in f["fix"]


def test_revision_string_of_a_local_folder(warmed):
    request, _, _ = warmed
    code, doc, _ = check_cli(request, "--revision", "main")
    assert code == 1
    [f] = findings(doc, "model_identity")
    assert f["text"] == "revision 'main' here, none when warmed" and "no --revision" not in f["fix"]


def test_hub_revision_resolved_differently():
    from exl3tool.cache.identity import resolve_model_identity
    from exl3tool.operations.check import model_differences

    a = resolve_model_identity("org/name", commit_hash="a" * 40).payload
    b = resolve_model_identity("org/name", commit_hash="b" * 40).payload
    [f] = model_differences(a, b)
    assert f"resolved to {'a' * 40} here, {'b' * 40} when warmed" in f.text and f"--revision {'a' * 40}" in f.fix


def test_encoder_source_files_that_changed_are_named(tmp_path, monkeypatch):
    """Files mode (no revision): the warm hashed every .py file; one changed since, one was added."""
    for name in ("VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "VLLM_EXL3_ONLINE_TRELLIS_BITS"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "exllamav3"
    (root / "modules" / "quant" / "exl3_lib").mkdir(parents=True)
    (root / "__init__.py").write_text("__version__ = '1'\n")
    quantize = root / "modules" / "quant" / "exl3_lib" / "quantize.py"
    quantize.write_text("def quantize_exl3(): ...\n")
    model = write_mla(tmp_path / "m")
    request = ServerRequest(model=str(model), tp_sizes=(1,), cache_dir=str(tmp_path / "cache"), encoder_root=str(root))
    fake_warm(request, monkeypatch)
    quantize.write_text("def quantize_exl3(): return 2\n")
    (root / "extra.py").write_text("")
    code, out, _ = run("cache", "check", str(model), "--cache-dir", request.cache_dir, "--encoder-root", str(root),
                       "--json")
    doc = json.loads(out)
    assert code == 1
    [f] = findings(doc, "encoder_identity")
    assert f["text"] == ("encoder source files differ: modules/quant/exl3_lib/quantize.py changed; extra.py here only")


def test_another_tp_size(warmed):
    request, _, _ = warmed
    code, doc, _ = check_cli(replace(request, tp_sizes=(2,)))
    assert code == 1 and doc["miss"] == doc["lookups"] > 0
    [f] = findings(doc, "tp_layout")
    assert "warmed at TP 1 only; these look-ups are at TP 2" in f["text"] and "--tp-size 2" in f["fix"]
    assert [c["fields"] for c in doc["causes"]] == [["tp_layout"]]  # same identities, bits: TP is the only cause


def test_another_bits(warmed):
    request, _, _ = warmed
    code, doc, _ = check_cli(request, "--bits", "4")
    assert code == 1 and [c["fields"] for c in doc["causes"]] == [["bits"]]
    [f] = findings(doc, "bits")
    assert f["text"] == "bits 4 here, 6 in the cache" and "VLLM_EXL3_ONLINE_TRELLIS_BITS=6" in f["fix"]


def test_another_overlay_both_ways(warmed, monkeypatch):
    request, _, _ = warmed
    code, doc, _ = check_cli(request, "--quantization-config", SHARED)
    assert code == 1 and doc["hit"] == len(TP1) and doc["miss"] == 2
    [cause] = doc["causes"]
    assert cause["fields"] == ["overlay"] and {j["prefix"] for j in cause["lookups"]} == {
        "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj"}
    [f] = findings(doc, "overlay")
    assert "2 layer(s) planned here that the warm did not" in f["text"] and "the default overlay" in f["text"]
    # the other way round: warmed with the shared experts, checked with the default overlay (all hit, a note)
    fake_warm(replace(request, quantization_config=SHARED), monkeypatch)
    code, doc, _ = check_cli(request)
    assert code == 0 and any(n["field"] == "overlay" and "2 layer(s) warmed that this launch does not plan" in n["text"]
                             for n in doc["notes"])


def _server_writes(root: Path, mid: str, eid: str, prefix: str, k: int, n: int, bits: int = 6) -> Path:
    """An entry as the server's _save writes it: its three tensors, cache_key and proxy_error, no exl3tool_sha256."""
    key_json = server_key_json(mid, eid, prefix, bits, 1, 0, k, n)
    path = server_path(root, mid, 1, 0, key_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"trellis": torch.randint(-100, 100, (k // 16, n // 16, 16 * bits), dtype=torch.int16),
               "suh": torch.rand(k).half() + 0.5, "svh": torch.rand(n).half() + 0.5}, str(path),
              metadata={"cache_key": key_json, "proxy_error": "0.01"})
    return path


def test_server_written_entries_are_named_with_what_separates_them_from_the_warm(warmed):
    """The warmed copy was touched, the server missed and wrote two layers itself with its own identity: the check
    (run with the server's view) hits those two, says the server wrote them and why its keys differ from the warm's."""
    request, model, _ = warmed
    shard = sorted(model.glob("*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))
    ids = server_identities(str(model), **ENC)
    written = list(TP1)[:2]
    for prefix in written:
        _server_writes(Path(request.cache_dir), ids.model.identity, ids.encoder.identity, prefix, *TP1[prefix])
    code, doc, _ = check_cli(request)
    assert code == 1 and doc["hit"] == 2 and doc["hit_origins"]["server"] == 2 and doc["miss"] == len(TP1) - 2
    server = [c for c in doc["causes"] if c["kind"] == "server_written"]
    assert len(server) == 1 and server[0]["fields"] == ["server_written", "model_identity"]
    assert {j["prefix"] for j in server[0]["lookups"]} == set(written)
    texts = [f["text"] for f in server[0]["findings"]]
    assert "the server wrote these entries itself" in texts[0] and "model identity" in texts[0]
    assert any(f"{shard.name} mtime" in t for t in texts[1:])
    # cache ls: the two groups, one from the warm's record, one written by the server itself
    code, out, _ = run("cache", "ls", "--cache-dir", request.cache_dir, "--json")
    groups = {g["model_identity"]: g for g in json.loads(out)["identities"]}
    assert groups[ids.model.identity]["origins"] == {"record": 0, "exl3tool": 0, "server": 2}
    assert groups[ids.model.identity]["records"] == []
    warm = groups[doc["causes"][0]["nearest"]["key"]["model_identity"]]
    assert warm["origins"] == {"record": len(TP1), "exl3tool": 0, "server": 0} and len(warm["records"]) == 1
    code, out, _ = run("cache", "ls", "--cache-dir", request.cache_dir)
    assert "written by the server itself" in out and "cache warm on" in out


def test_invalid_entry(warmed):
    request, _, summary = warmed
    path = Path(next(e.path for e in summary.entries if e.path))
    path.write_bytes(path.read_bytes()[:100])
    code, doc, _ = check_cli(request)
    assert code == 1 and doc["invalid"] == 1 and doc["miss"] == 0
    [f] = findings(doc, "invalid")
    assert "prune --invalid" in f["fix"]


def test_check_never_writes(warmed):
    request, model, _ = warmed
    before = sorted((p, p.stat().st_mtime_ns) for p in Path(request.cache_dir).rglob("*"))
    os.utime(sorted(model.glob("*.safetensors"))[0], ns=(1, 1))
    check(request)
    assert sorted((p, p.stat().st_mtime_ns) for p in Path(request.cache_dir).rglob("*")) == before


# --- prune --------------------------------------------------------------------------------------------------------


def test_prune_drops_records_whose_entries_are_gone(warmed):
    request, _, summary = warmed
    root = request.cache_dir
    paths = [Path(e.path) for e in summary.entries if e.path]
    for p in paths[:-1]:
        p.unlink()
    code, out, _ = run("cache", "prune", "--records", "--cache-dir", root, "--yes", "--json")
    assert code == 0 and json.loads(out)["records_removed"] == 0 and len(read_records(root)) == 1  # one entry left
    code, out, _ = run("cache", "prune", "--older-than", "0", "--cache-dir", root, "--dry-run", "--json")
    doc = json.loads(out)
    assert [r["path"] for r in doc["records_planned"]] == [summary.record] and read_records(root)
    code, out, _ = run("cache", "prune", "--older-than", "0", "--cache-dir", root, "--yes", "--json")
    assert code == 0 and json.loads(out)["records_removed"] == 1 and read_records(root) == []


# --- bundles carry records; hostile records are refused -----------------------------------------------------------


def _export(root: str) -> bytes:
    buf = io.BytesIO()
    write_bundle(plan_export(root), buf)
    return buf.getvalue()


def test_bundle_carries_the_record_and_check_explains_on_the_node(warmed, tmp_path):
    request, model, _ = warmed
    data = _export(request.cache_dir)
    node = tmp_path / "node"
    report = import_bundle(io.BytesIO(data), CacheStore(node), source="b.tar")
    assert report.count("imported") == len(TP1) and report.count("imported", "record") == 1 and report.ok
    [stored] = read_records(node)
    assert stored.record.imported["bundle"] == "b.tar" and stored.record.command == "cache warm"
    again = import_bundle(io.BytesIO(data), CacheStore(node))
    assert again.count("present", "record") == 1 and len(read_records(node)) == 1
    shard = sorted(model.glob("*.safetensors"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 5_000_000_000))
    code, doc, _ = check_cli(replace(request, cache_dir=str(node)))
    assert code == 1 and any(f"{shard.name} mtime" in f["text"] for f in findings(doc, "model_identity"))


def _members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]


def _rebuild(members: list[tuple[str, bytes]], record_sizes: dict[str, int] | None = None) -> bytes:
    """A bundle from members; the manifest's records list is rewritten to the record members given."""
    manifest = json.loads(members[0][1])
    manifest["records"] = [{"path": n, "size": (record_sizes or {}).get(n, len(b)), "sha256": hashlib.sha256(b).hexdigest()}
                           for n, b in members[1:] if n.startswith(RECORDS_DIR)]
    members = [("manifest.json", json.dumps(manifest).encode())] + members[1:]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _hostile(case: str, members: list[tuple[str, bytes]]) -> tuple[list[tuple[str, bytes]], dict]:
    name, body = members[-1]
    doc = json.loads(body)
    sizes: dict[str, int] = {}
    if case == "identity_not_payload_hash":
        doc["model"]["payload"] = doc["model"]["payload"].replace('"revision":null', '"revision":"x"')
    elif case == "deep_json":
        body = b'{"format": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        return members[:-1] + [(name, body)], sizes
    elif case == "oversize":
        sizes[name] = 64 * 1024 * 1024
        return members, sizes
    elif case == "control_characters":
        doc["host"] = "evil\x1b[2Jhost"
    elif case == "digest_not_in_bundle":
        doc["entries"][0]["digest"] = "0" * 64
    elif case == "entry_key_differs":
        doc["settings"]["bits"] = 4
    elif case == "unknown_member":
        doc["extra"] = "x"
    elif case == "path_traversal":
        return members[:-1] + [(f"{RECORDS_DIR}/../v1/x.json", body)], sizes
    elif case == "name_not_content":
        parts = name.split("/")
        return members[:-1] + [("/".join(parts[:-1] + ["0" * 20 + "-" + "0" * 24 + ".json"]), body)], sizes
    body = json.dumps(doc).encode()
    if case in ("entry_key_differs", "digest_not_in_bundle"):  # named as its (changed) content names it
        name = f"{RECORDS_DIR}/{parse_record(body).relative_path}"
    return members[:-1] + [(name, body)], sizes


WHY = {"identity_not_payload_hash": "model.identity is not the SHA-256 of its payload",
       "deep_json": "nested too deeply", "oversize": "size is not from 1 to", "control_characters": "control characters",
       "digest_not_in_bundle": "is not in the bundle's manifest", "entry_key_differs": "does not carry the record's",
       "unknown_member": "extra ['extra']", "path_traversal": "a path with '..'", "name_not_content": "its content names it"}


@pytest.mark.parametrize("case", ["identity_not_payload_hash", "deep_json", "oversize", "control_characters",
                                  "digest_not_in_bundle", "entry_key_differs", "unknown_member", "path_traversal",
                                  "name_not_content"])
def test_hostile_record_is_refused_and_the_entries_imported(warmed, tmp_path, case):
    request, _, _ = warmed
    members = _members(_export(request.cache_dir))
    assert members[-1][0].startswith(RECORDS_DIR + "/")
    bad, sizes = _hostile(case, members)
    node = tmp_path / "node"
    report = import_bundle(io.BytesIO(_rebuild(bad, sizes)), CacheStore(node))
    assert report.count("imported") == len(TP1), case
    refused = [i for i in report.items if i.status == "refused"]
    assert refused and {i.path for i in refused} == {bad[-1][0]} and all(i.reason for i in refused), case
    assert any(i.kind == "record" for i in refused), case
    assert any(WHY[case] in i.reason for i in refused), (case, [i.reason for i in refused])
    assert not (node / RECORDS_DIR).exists() or read_records(node) == []
    assert {p.relative_to(node).parts[0] for p in node.rglob("*") if p.is_file()} == {"v1"}  # nothing else written
    assert all("\x1b" not in i.reason for i in refused)
