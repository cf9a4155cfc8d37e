"""`cache export` / `cache import`: round trip to hits, deterministic bytes, idempotence, and one hostile bundle per
refusal (built here byte by byte; each must leave the cache as it was and write nothing outside it)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile

import pytest
from helpers import ENCODER_ID, MODEL_ID, CliRunner, make_encoded, server_lookup, tree

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.cache.bundle import BundleError, import_bundle, manifest_bytes, plan_export, write_bundle
from exl3tool.cache.entry import write_entry
from exl3tool.cli import _register, app
from exl3tool.errors import Exl3ToolError
from seeds import fresh_bytes


_register()
runner = CliRunner()
PREFIXES = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")
K, N = 128, 256


def cli(*args, stdin: bytes | None = None):
    """(exit code, stdout bytes, stderr text) as `exl3tool` would exit."""
    res = runner.invoke(app, list(args), input=stdin)
    code = res.exception.exit_code if isinstance(res.exception, Exl3ToolError) else res.exit_code
    if res.exception is not None and not isinstance(res.exception, (Exl3ToolError, SystemExit)):
        raise res.exception
    return code, res.stdout_bytes, res.stderr + (str(res.exception) if res.exception else "")


def keys():
    return [CacheKey.for_layer(MODEL_ID, ENCODER_ID, p, 6, w, r, K, N) for w in (1, 2) for r in range(w) for p in PREFIXES]


@pytest.fixture
def cache(tmp_path):
    """Six valid entries (two layers at TP 1 and 2), one non-finite entry and one truncated one."""
    root = tmp_path / "ci-cache"
    store = CacheStore(root)
    for i, key in enumerate(keys()):
        store.publish(key, make_encoded(K, N, seed=i))
    bad = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.1.mlp.down_proj", 6, 1, 0, K, N)
    t = make_encoded(K, N).tensors()
    t["svh"][3] = float("nan")
    write_entry(store.path(bad), bad, t, 0.1)  # bypasses the publish checks: what a broken writer leaves
    cut = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.1.self_attn.o_proj", 6, 1, 0, K, N)
    store.publish(cut, make_encoded(K, N, seed=9))
    with open(store.path(cut), "r+b") as fh:
        fh.truncate(1000)
    return root


def _lookup_all(root):
    return [server_lookup(root, MODEL_ID, ENCODER_ID, k.prefix, 6, k.tp_world_size, k.tp_rank, K, N) for k in keys()]


def test_round_trip_gives_server_hits_and_identical_bytes(cache, tmp_path):
    bundle = tmp_path / "b.tar"
    code, out, err = cli("cache", "export", str(bundle), "--cache-dir", str(cache), "--json")
    assert code == 1, err  # two invalid entries were left out; the bundle holds the rest
    doc = json.loads(out)
    assert doc["entries"] == 6 and len(doc["left_out"]) == 2
    assert {os.path.basename(os.path.dirname(p["path"])) for p in doc["left_out"]} == {"tp1-rank0"}
    assert any("non-finite" in p["reason"] for p in doc["left_out"])
    with tarfile.open(bundle) as tf:  # a plain tar: tar tf works, manifest first, fixed headers
        names = tf.getnames()
        assert names[0] == "manifest.json" and names[1:] == sorted(names[1:]) and len(names) == 7
        assert {(m.mtime, m.uid, m.gid, m.uname, m.mode) for m in tf.getmembers()} == {(0, 0, 0, "", 0o644)}
    server = tmp_path / "server-cache"
    assert all(hit is None for hit in _lookup_all(server))
    code, out, err = cli("cache", "import", str(bundle), "--cache-dir", str(server), "--file-mode", "0644", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["imported"], doc["present"], doc["refused"]) == (6, 0, 0)
    hits = _lookup_all(server)
    assert all(hit is not None for hit in hits)
    for key in keys():
        src = CacheStore(cache).path(key)
        dst = CacheStore(server).path(key)
        assert dst.read_bytes() == src.read_bytes() and (dst.stat().st_mode & 0o777) == 0o644
    assert not list(server.rglob("*.tmp"))


def test_same_cache_same_bytes(cache, tmp_path):
    first = tmp_path / "1.tar"
    cli("cache", "export", str(first), "--cache-dir", str(cache))
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)  # other mtimes on the directories, other inode order
    for p in copy.rglob("*.safetensors"):
        os.utime(p, (1, 1))
    code, out, _ = cli("cache", "export", "-", "--cache-dir", str(copy))
    assert code == 1 and out == first.read_bytes()


def test_selection_by_model_and_tp_size(cache, tmp_path):
    other = CacheKey.for_layer("ab" * 32, ENCODER_ID, PREFIXES[0], 6, 1, 0, K, N)
    CacheStore(cache).publish(other, make_encoded(K, N))
    plan = plan_export(cache, model=MODEL_ID[:12], tp_sizes=(2,))
    assert [e.path.split("/")[2] for e in plan.entries] == ["tp2-rank0"] * 2 + ["tp2-rank1"] * 2
    assert plan.left_out == ()
    assert len(plan_export(cache, model="ab").entries) == 1
    code, _, err = cli("cache", "export", str(tmp_path / "x.tar"), "--cache-dir", str(cache), "--model", "ffff")
    assert code == 2 and "no valid entries" in err and not (tmp_path / "x.tar").exists()


def test_import_twice_changes_nothing_and_replaces_invalid(cache, tmp_path):
    bundle = tmp_path / "b.tar"
    cli("cache", "export", str(bundle), "--cache-dir", str(cache))
    server = tmp_path / "server"
    assert cli("cache", "import", str(bundle), "--cache-dir", str(server))[0] == 0
    before = tree(server)
    code, out, err = cli("cache", "import", str(bundle), "--cache-dir", str(server), "--json")
    assert code == 0 and json.loads(out)["present"] == 6 and json.loads(out)["bytes_written"] == 0
    assert tree(server) == before
    # A present entry whose bytes changed (a flipped trellis byte fails the checksum) is replaced.
    victim = CacheStore(server).path(keys()[0])
    good = victim.read_bytes()
    data = bytearray(good)
    data[-(2 * K + 2 * N) - 1] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, _ = cli("cache", "import", str(bundle), "--cache-dir", str(server), "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["replaced"], doc["present"]) == (1, 5) and victim.read_bytes() == good


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_pipe_between_processes(cache, tmp_path):
    env = dict(os.environ)
    export = subprocess.Popen([sys.executable, "-m", "exl3tool", "cache", "export", "-", "--cache-dir", str(cache)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    imp = subprocess.run([sys.executable, "-m", "exl3tool", "cache", "import", "-", "--cache-dir",
                          str(tmp_path / "far"), "--json"], stdin=export.stdout, capture_output=True, env=env)
    export.stdout.close()
    assert export.wait() == 1 and b"left out" in export.stderr.read()
    assert imp.returncode == 0, imp.stderr
    assert json.loads(imp.stdout)["imported"] == 6
    assert all(hit is not None for hit in _lookup_all(tmp_path / "far"))


# --- hostile bundles ---------------------------------------------------------------------------------------------


def _entry_bytes(key: CacheKey, seed: int = 0, **change) -> bytes:
    """An entry file's bytes as our writer makes them (optionally with a broken tensor)."""
    import tempfile

    t = make_encoded(K, N, seed=seed).tensors()
    for name, value in change.items():
        t[name] = value
    with tempfile.TemporaryDirectory() as d:
        path = write_entry(os.path.join(d, "e.safetensors"), key, t, 0.25)
        return path.read_bytes()


def _record(key: CacheKey, data: bytes, **override) -> dict:
    rec = {"path": f"v1/{key.model_identity[:20]}/tp{key.tp_world_size}-rank{key.tp_rank}/{key.digest()}.safetensors",
           "digest": key.digest(), "key": key.canonical_json(), "size": len(data),
           "sha256": hashlib.sha256(data).hexdigest()}
    rec.update(override)
    return rec


def _tar(members, fmt=tarfile.USTAR_FORMAT) -> bytes:
    """members: (name, bytes or None, dict of TarInfo fields); the manifest is whatever the caller puts first."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data, fields in members:
            info = tarfile.TarInfo(name)
            info.size = len(data) if data is not None else 0
            tf.format = fields.get("_format", fmt)  # a pax member among ustar ones
            for k, v in fields.items():
                if k != "_format":
                    setattr(info, k, v)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _manifest(records) -> bytes:
    return json.dumps({"format": "exl3tool-cache-bundle", "format_version": 1, "tool_version": "test",
                       "entries": records}).encode()


GOOD = CacheKey.for_layer(MODEL_ID, ENCODER_ID, PREFIXES[0], 6, 1, 0, K, N)
OTHER = CacheKey.for_layer(MODEL_ID, ENCODER_ID, PREFIXES[1], 6, 1, 0, K, N)


def _hostile(case: str, tmp_path) -> tuple[bytes, str]:
    """A bundle with one good entry and one hostile member; returns (bytes, expected reason fragment)."""
    good = _entry_bytes(GOOD)
    other = _entry_bytes(OTHER, seed=1)
    rg, ro = _record(GOOD, good), _record(OTHER, other)
    outside = str(tmp_path / "outside.safetensors")
    if case == "absolute":
        members, why = [(outside, other, {})], "an absolute path"
    elif case == "dotdot":
        members, why = [("v1/../../outside.safetensors", other, {})], "'..'"
    elif case == "symlink":
        members, why = [(ro["path"], None, {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"})], "a symbolic link"
    elif case == "hardlink":
        members, why = [(ro["path"], None, {"type": tarfile.LNKTYPE, "linkname": "/etc/shadow"})], "a hard link"
    elif case == "device":
        members, why = [(ro["path"], None, {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3})], "character device"
    elif case == "fifo":
        members, why = [(ro["path"], None, {"type": tarfile.FIFOTYPE})], "a FIFO"
    elif case == "directory":  # a directory where the entry should be: the server would find no file there
        members, why = [(ro["path"], None, {"type": tarfile.DIRTYPE})], "a directory"
    elif case == "gnu-longname":  # the GNU header that renames the next member (the entry path is over 100 bytes)
        members, why = [(ro["path"], other, {"_format": tarfile.GNU_FORMAT})], "a GNU long-name header"
    elif case == "gnu-longlink":
        members, why = [(ro["path"][:90], None, {"type": tarfile.SYMTYPE, "linkname": "/" + "x" * 120,
                                                 "_format": tarfile.GNU_FORMAT})], "a GNU long-link header"
    elif case == "unlisted":
        return _tar([("manifest.json", _manifest([rg]), {}), (rg["path"], good, {}), (ro["path"], other, {})]), \
            "not in the manifest"
    elif case == "duplicate":
        return _tar([("manifest.json", _manifest([rg]), {}), (rg["path"], good, {}), (rg["path"], good, {})]), \
            "appears twice"
    elif case == "wrong-path":  # the member sits at another digest's path than its key's
        bad = dict(ro, path=rg["path"].replace(GOOD.digest(), "0" * 64))
        return _tar([("manifest.json", _manifest([rg, bad]), {}), (rg["path"], good, {}), (bad["path"], other, {})]), \
            "path does not match its key"
    elif case == "key-in-file":  # manifest consistent, but the file's own cache_key is another layer's
        return _tar([("manifest.json", _manifest([rg, _record(OTHER, good)]), {}), (rg["path"], good, {}),
                     (ro["path"], good, {})]), "would not load it"
    elif case == "oversize-header":
        evil = struct.pack("<Q", 1 << 40) + other[8:]
        return _tar([("manifest.json", _manifest([rg, _record(OTHER, evil)]), {}), (rg["path"], good, {}),
                     (ro["path"], evil, {})]), "oversize safetensors header"
    elif case == "pax":
        return _tar([("manifest.json", _manifest([rg, ro]), {}), (rg["path"], good, {}),
                     (ro["path"], other, {"pax_headers": {"path": "../../outside.safetensors"},
                                          "_format": tarfile.PAX_FORMAT})]), "pax extended header"
    elif case == "sha":
        flipped = bytearray(other)
        flipped[-1] ^= 1
        return _tar([("manifest.json", _manifest([rg, ro]), {}), (rg["path"], good, {}),
                     (ro["path"], bytes(flipped), {})]), "differ from the manifest's sha256"
    elif case == "non-finite":
        t = make_encoded(K, N).tensors()["suh"].clone()
        t[0] = float("inf")
        evil = _entry_bytes(OTHER, suh=t)
        return _tar([("manifest.json", _manifest([rg, _record(OTHER, evil)]), {}), (rg["path"], good, {}),
                     (ro["path"], evil, {})]), "non-finite"
    elif case == "size":
        return _tar([("manifest.json", _manifest([rg, dict(ro, size=len(other) + 512)]), {}), (rg["path"], good, {}),
                     (ro["path"], other, {})]), "but the manifest says"
    elif case in UNPRODUCIBLE:  # consistent in manifest and file, but a key the server never builds
        key = dataclasses.replace(OTHER, **UNPRODUCIBLE[case])
        evil = _entry_bytes(key)
        return _tar([("manifest.json", _manifest([rg, _record(key, evil)]), {}), (rg["path"], good, {}),
                     (_record(key, evil)["path"], evil, {})]), "the server never builds this key"
    elif case == "missing":
        return _tar([("manifest.json", _manifest([rg, ro]), {}), (rg["path"], good, {})]), "missing from the bundle"
    else:
        raise AssertionError(case)
    return _tar([("manifest.json", _manifest([rg, ro]), {}), (rg["path"], good, {}), *members]), why


UNPRODUCIBLE = {"seed": dict(seed=12345), "rank": dict(tp_rank=2, tp_world_size=2),
                "identity": dict(model_identity="../" + "a" * 61), "codebook": dict(codebook="3inst"),
                "schema": dict(schema=2), "bits": dict(bits=12)}
CASES = ["absolute", "dotdot", "symlink", "hardlink", "device", "fifo", "directory", "gnu-longname", "gnu-longlink",
         "unlisted", "duplicate", "wrong-path",
         "key-in-file", "oversize-header", "pax", "sha", "non-finite", "size", "missing", *UNPRODUCIBLE]


@pytest.mark.parametrize("case", CASES)
def test_hostile_bundle_is_refused_and_the_rest_imported(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative names would land here
    data, why = _hostile(case, tmp_path)
    root = tmp_path / "cache"
    around = {p for p in tree(tmp_path) if not p.startswith("cache")}
    report = import_bundle(io.BytesIO(data), CacheStore(root))
    refused = [i for i in report.items if i.status == "refused"]
    assert refused and all(why in i.reason for i in refused[:1]), [(i.path, i.reason) for i in refused]
    assert [i.path for i in report.items if i.status == "imported"] == [_record(GOOD, b"")["path"]]
    assert server_lookup(root, MODEL_ID, ENCODER_ID, GOOD.prefix, 6, 1, 0, K, N) is not None
    assert server_lookup(root, MODEL_ID, ENCODER_ID, OTHER.prefix, 6, 1, 0, K, N) is None
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())
    good = _record(GOOD, b"")["path"]
    assert set(files) <= {good, good + ".lock", good.replace(GOOD.digest(), OTHER.digest()) + ".lock"}, files
    assert {p for p in tree(tmp_path) if not p.startswith("cache")} == around, "something was written outside the cache"


def test_cli_exit_code_one_names_the_refusal(tmp_path):
    data, _ = _hostile("symlink", tmp_path)
    (tmp_path / "h.tar").write_bytes(data)
    code, out, err = cli("cache", "import", str(tmp_path / "h.tar"), "--cache-dir", str(tmp_path / "c"), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["imported"] == 1 and doc["refused"] == 2
    assert "symbolic link to /etc/passwd" in json.dumps(doc["entries"])


@pytest.mark.parametrize("case", ["garbage", "empty", "no-manifest", "not-json", "version", "truncated"])
def test_unreadable_bundles_exit_2(case, tmp_path):
    good = _entry_bytes(GOOD)
    rg = _record(GOOD, good)
    data = {
        "garbage": fresh_bytes(4096),
        "empty": b"",
        "no-manifest": _tar([(rg["path"], good, {})]),
        "not-json": _tar([("manifest.json", b"{nope", {})]),
        "version": _tar([("manifest.json", json.dumps({"format": "exl3tool-cache-bundle", "format_version": 9,
                                                       "entries": []}).encode(), {})]),
    }.get(case)
    if case == "truncated":  # the good entry arrives whole, the second is cut off mid-data
        ro = _record(OTHER, _entry_bytes(OTHER, seed=1))
        full = _tar([("manifest.json", _manifest([rg, ro]), {}), (rg["path"], good, {}),
                     (ro["path"], _entry_bytes(OTHER, seed=1), {})])
        data = full[: len(full) - 30000]
    (tmp_path / "b.tar").write_bytes(data)
    root = tmp_path / "c"
    code, _, err = cli("cache", "import", str(tmp_path / "b.tar"), "--cache-dir", str(root))
    assert code == 2, err
    if case == "truncated":
        assert "cut short" in err and "1 entry imported" in err
        assert server_lookup(root, MODEL_ID, ENCODER_ID, GOOD.prefix, 6, 1, 0, K, N) is not None
        assert not list(root.rglob("*.tmp"))
    else:
        assert not root.exists() or not any(p.is_file() for p in root.rglob("*"))
    with pytest.raises(BundleError):
        import_bundle(io.BytesIO(data), CacheStore(tmp_path / "c2"))


def test_manifest_is_deterministic_and_lists_what_was_written(cache):
    plan = plan_export(cache)
    assert manifest_bytes(plan.entries) == manifest_bytes(plan_export(cache).entries)
    buf = io.BytesIO()
    size = write_bundle(plan, buf)
    assert size == len(buf.getvalue()) and size % 10240 == 0
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        doc = json.loads(tf.extractfile("manifest.json").read())
        for rec in doc["entries"]:
            data = tf.extractfile(rec["path"]).read()
            assert hashlib.sha256(data).hexdigest() == rec["sha256"] and len(data) == rec["size"]
            assert json.loads(rec["key"]) == CacheKey.from_json(rec["key"]).as_dict()


def test_an_entry_the_cache_cannot_take_is_refused_and_the_rest_imported(cache, tmp_path):
    bundle = tmp_path / "b.tar"
    cli("cache", "export", str(bundle), "--cache-dir", str(cache))
    server = tmp_path / "server"
    blocked = CacheStore(server).path(keys()[0])
    blocked.mkdir(parents=True)  # a directory where the entry file goes: no rename can replace it
    code, out, _ = cli("cache", "import", str(bundle), "--cache-dir", str(server), "--json")
    doc = json.loads(out)
    assert code == 1 and (doc["imported"], doc["refused"]) == (5, 1)
    assert "is a directory" in next(e["reason"] for e in doc["entries"] if e["status"] == "refused")
    assert blocked.is_dir() and not list(server.rglob("*.tmp"))



@pytest.mark.parametrize("where", ["missing-folder", "a-directory"])
def test_export_to_an_unwritable_place_names_the_bundle_and_leaves_nothing(cache, tmp_path, where):
    root = cache
    out = tmp_path / "no-such-folder" / "b.tar" if where == "missing-folder" else tmp_path
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = cli("cache", "export", str(out), "--cache-dir", str(root))
    assert code == 2
    assert f"cannot write the bundle {out}" in err
    assert ".tmp" not in err  # the user's path, not our temp file
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_every_entry_refused_says_so_and_leaves_no_lock_or_folder(cache, tmp_path, monkeypatch):
    """Issue 44: an import that refuses every entry says that nothing was imported (not "the rest were imported")
    and leaves no lock file and no empty folder for the entries it refused."""
    import exl3tool.cache.bundle as bundle_mod

    bundle = tmp_path / "b.tar"
    assert cli("cache", "export", str(bundle), "--cache-dir", str(cache))[0] == 1  # the two broken ones left out

    def refuse(path, key):
        raise ValueError("refused for the test")

    monkeypatch.setattr(bundle_mod, "judge_entry", refuse)
    root = tmp_path / "target"
    code, _, err = cli("cache", "import", str(bundle), "--cache-dir", str(root))
    assert code == 1 and "6 bundle members refused" in err and "no entry was imported" in err
    assert "the rest" not in err
    assert [p for p in root.rglob("*")] == []  # no lock, no v1/<model>/tp<N>-rank<R> folder, no temp file


def test_quiet_export_to_stdout_writes_only_the_bundle(cache):
    """`cache export - -q`: the bundle on stdout and nothing on stderr but the one line of its findings exit."""
    code, out, err = cli("cache", "export", "-", "--cache-dir", str(cache), "-q")
    assert code == 1 and out[:512].rstrip(b"\0").startswith(b"manifest.json")
    assert "exported" not in err and "left out (invalid)" not in err
    code, out, err = cli("cache", "export", "-", "--cache-dir", str(cache))
    assert "exported 6 entries" in err  # without -q the report goes to stderr
