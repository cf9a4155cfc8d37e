"""Model and encoder identities: docs/cache-format.md's vectors (§2.4, §2.5) and the filesystem rules behind them."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from exl3tool.cache import encoder_settings, resolve_encoder_identity, resolve_model_identity
from exl3tool.cache.identity import _compact_json, _default_json
from exl3tool.errors import ConfigError, InputError

DIR_VECTOR = (
    '{"kind":"directory","markers":[["config.json","1111111111111111111111111111111111111111111111111111111111111111"],'
    '["quantization_config.json","2222222222222222222222222222222222222222222222222222222222222222"]],'
    '"path":"/models/Example-8B","revision":null,"shards":[["model-00001-of-00002.safetensors",'
    '"/models/Example-8B/model-00001-of-00002.safetensors",4976698672,1717000000123456789],'
    '["model-00002-of-00002.safetensors","/blobs/abc",1168138808,1717000000987654321]]}'
)
ENC_VECTOR = (
    '{"files":[["__init__.py","3333333333333333333333333333333333333333333333333333333333333333"],'
    '["modules/quant/exl3_lib/quantize.py","4444444444444444444444444444444444444444444444444444444444444444"]],'
    '"root":"/encoders/exllamav3"}'
)


def sha(s: str | bytes) -> str:
    return hashlib.sha256(s.encode() if isinstance(s, str) else s).hexdigest()


def test_directory_vector_serialisation():
    payload = {
        "kind": "directory",
        "path": "/models/Example-8B",
        "revision": None,
        "markers": [["config.json", "1" * 64], ["quantization_config.json", "2" * 64]],
        "shards": [
            ["model-00001-of-00002.safetensors", "/models/Example-8B/model-00001-of-00002.safetensors", 4976698672, 1717000000123456789],
            ["model-00002-of-00002.safetensors", "/blobs/abc", 1168138808, 1717000000987654321],
        ],
    }
    assert _compact_json(payload) == DIR_VECTOR
    assert sha(DIR_VECTOR) == "2de5a83ef81b753b416cfb4e349fdf81a50b668652614e6c90e398a4307d9fee"


def test_encoder_vector_serialisation():
    payload = {"root": "/encoders/exllamav3", "files": [["__init__.py", "3" * 64], ["modules/quant/exl3_lib/quantize.py", "4" * 64]]}
    assert _compact_json(payload) == ENC_VECTOR
    assert sha(ENC_VECTOR) == "74d77c575fadcb6d470f4a0b1ab6ef7c92f92b69158a8893bdd24b63beed9093"


def test_file_vector_end_to_end(tmp_path):
    # A sparse 8.54 GB file with the vector's mtime, identified with the server's path string.
    f = tmp_path / "example-q8.gguf"
    with open(f, "wb") as fh:
        fh.truncate(8540000000)
    os.utime(f, ns=(1717000000000000000, 1717000000000000000))
    mid = resolve_model_identity(str(f), server_path="/models/example-q8.gguf")
    assert mid.kind == "file"
    assert mid.payload == '{"kind": "file", "mtime_ns": 1717000000000000000, "path": "/models/example-q8.gguf", "size": 8540000000}'
    assert mid.identity == "46c5b8b214c1daef294a950095d88e6b1e61a75a4e71b39b80deae7f02919f0b"


def test_small_file_is_content_hashed_up_to_16_mib(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 100)
    mid = resolve_model_identity(str(f))
    assert json.loads(mid.payload)["sha256"] == sha(b"x" * 100)
    assert mid.payload == _default_json(json.loads(mid.payload))
    with open(f, "wb") as fh:
        fh.truncate(16 * 1024 * 1024)
    assert "sha256" in json.loads(resolve_model_identity(str(f)).payload)
    with open(f, "wb") as fh:
        fh.truncate(16 * 1024 * 1024 + 1)
    assert "sha256" not in json.loads(resolve_model_identity(str(f)).payload)


def test_directory_rules(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "tier_bitmap.json").write_text("[]")
    (d / "b.safetensors").write_bytes(b"bb")
    (d / "a.safetensors").write_bytes(b"a")
    (d / ".hidden.safetensors").write_bytes(b"h")
    (d / "dir.bin").mkdir()  # directories matching the glob count too
    (d / "Z.SAFETENSORS").write_bytes(b"z")  # case-sensitive: ignored
    (d / "sub").mkdir()
    (d / "sub" / "nested.safetensors").write_bytes(b"n")  # non-recursive: ignored
    blob = tmp_path / "blobs" / "xyz"
    blob.parent.mkdir()
    blob.write_bytes(b"blob")
    os.symlink(blob, d / "c.gguf")
    os.utime(d / "a.safetensors", ns=(5, 123))
    mid = resolve_model_identity(str(d))
    p = json.loads(mid.payload)
    real = os.path.realpath(d)
    assert mid.kind == "directory" and mid.payload == _compact_json(p)
    assert list(json.loads(mid.payload)) == ["kind", "markers", "path", "revision", "shards"]
    assert p["path"] == real and p["revision"] is None
    assert [m[0] for m in p["markers"]] == ["config.json", "tier_bitmap.json"]
    assert p["markers"][0][1] == sha('{"a": 1}')
    assert [s[0] for s in p["shards"]] == [".hidden.safetensors", "a.safetensors", "b.safetensors", "dir.bin", "c.gguf"]
    assert p["shards"][1] == ["a.safetensors", f"{real}/a.safetensors", 1, 123]
    assert p["shards"][4][1] == os.path.realpath(blob)
    # Re-rooted for the server: paths inside the model dir move, targets outside stay.
    srv = json.loads(resolve_model_identity(str(d), server_path="/srv/model/").payload)
    assert srv["path"] == "/srv/model"
    assert srv["shards"][1][1] == "/srv/model/a.safetensors"
    assert srv["shards"][4][1] == os.path.realpath(blob)
    # Markers change the identity; shard bytes of equal size and mtime do not.
    before = mid.identity
    st = os.stat(d / "b.safetensors")
    (d / "b.safetensors").write_bytes(b"BB")
    os.utime(d / "b.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert resolve_model_identity(str(d)).identity == before
    (d / "config.json").write_text('{"a": 2}')
    assert resolve_model_identity(str(d)).identity != before
    assert resolve_model_identity(str(d), revision="abc").revision == "abc"
    assert resolve_model_identity(str(d), revision="abc", commit_hash="f" * 40).revision == "f" * 40


def test_broken_shard_link_fails(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(tmp_path / "missing", d / "x.safetensors")
    with pytest.raises(InputError, match="x.safetensors"):
        resolve_model_identity(str(d))


def test_snapshot_directory_takes_the_folder_hash(tmp_path):
    h = "ab" * 20
    d = tmp_path / "models--o--n" / "snapshots" / h
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    mid = resolve_model_identity(str(d), revision="main")
    assert mid.revision == h and json.loads(mid.payload)["revision"] == h


def test_encoder_files_mode_ordering_and_traversal(tmp_path):
    root = tmp_path / "enc"
    (root / "a").mkdir(parents=True)
    (root / "a" / "b.py").write_text("1")
    (root / "a-b.py").write_text("2")
    (root / "a.py").write_text("3")
    (root / ".hid").mkdir()
    (root / ".hid" / ".x.py").write_text("4")
    (root / "d.py").mkdir()  # a directory named *.py: skipped, contents walked
    (root / "d.py" / "e.py").write_text("5")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.py").write_text("6")
    os.symlink(outside, root / "linked")  # not descended
    os.symlink(root / "a.py", root / "l.py")  # symlinked file: included
    (root / "notes.txt").write_text("x")
    link_root = tmp_path / "enc-link"
    os.symlink(root, link_root)
    eid = resolve_encoder_identity(str(link_root))
    p = json.loads(eid.payload)
    assert eid.mode == "files" and eid.payload == _compact_json(p)
    assert p["root"] == os.path.realpath(root)
    assert [f[0] for f in p["files"]] == [".hid/.x.py", "a/b.py", "a-b.py", "a.py", "d.py/e.py", "l.py"]
    assert p["files"][3][1] == sha("3") == p["files"][5][1]
    (root / "a" / "b.py").write_text("changed")
    assert resolve_encoder_identity(str(root)).identity != eid.identity


def test_encoder_revision_mode_and_errors(tmp_path):
    e1 = resolve_encoder_identity("/encoders/exllamav3", "  fedcba9876543210fedcba9876543210fedcba98 \n")
    assert e1.payload == '{"revision":"fedcba9876543210fedcba9876543210fedcba98","root":"/encoders/exllamav3"}'
    assert e1.identity == "fe5e6fead00d1b22502edfa1da021d26132cb231d96346f10e51ead3eedc8326"
    with pytest.raises(ConfigError, match="contains no Python files"):
        resolve_encoder_identity(str(tmp_path), "   ")
    with pytest.raises(ConfigError, match="--encoder-root.*--encoder-revision"):
        encoder_settings(environ={})
    s = encoder_settings(environ={"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r"})
    assert (s.root, s.revision) == ("/e", "r")
    assert encoder_settings("/x", None, environ={"VLLM_EXL3_ENCODER_REVISION": "r"}).revision == "r"
