"""JSON nested thousands deep (a few kB of brackets) is bad input like any other: one error, never a traceback.

``json.loads`` raises RecursionError for it, which ``except ValueError`` does not catch.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile

import pytest
from helpers import ENCODER_ID, MODEL_ID, CliRunner, make_encoded

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.cache.bundle import BundleError, import_bundle
from exl3tool.cache.scan import inspect_entry
from exl3tool.checkpoint import open_checkpoint, parse_overlay
from exl3tool.cli import _register, app
from exl3tool.errors import ConfigError, Exl3ToolError, InputError
from exl3tool.jsontext import loads_json


_register()
DEEP = "[" * 200_000 + "]" * 200_000


def test_loads_json_turns_deep_nesting_into_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        loads_json(DEEP)
    assert loads_json('{"a": [[1]]}') == {"a": [[1]]}


def test_deep_cache_key_is_a_value_error():
    with pytest.raises(ValueError):
        CacheKey.from_json(DEEP)


def test_deep_overlay_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_overlay('{"linear": ' + DEEP + "}")


def test_deep_config_json_is_an_input_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ' + DEEP + "}")
    with pytest.raises(InputError, match="config.json"):
        open_checkpoint(str(tmp_path))


def test_deep_bundle_manifest_is_refused_with_exit_2(tmp_path):
    buf = io.BytesIO()
    data = DEEP.encode()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="manifest.json is not JSON"):
        import_bundle(io.BytesIO(buf.getvalue()), CacheStore(tmp_path / "c"))
    (tmp_path / "deep.tar").write_bytes(buf.getvalue())
    res = CliRunner().invoke(app, ["cache", "import", str(tmp_path / "deep.tar"), "--cache-dir", str(tmp_path / "c")])
    assert isinstance(res.exception, Exl3ToolError) and res.exception.exit_code == 2
    assert not list((tmp_path / "c").rglob("*.safetensors"))


def test_entry_with_a_deep_header_is_invalid_not_a_crash(tmp_path):
    store = CacheStore(tmp_path)
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    path = store.publish(key, make_encoded(128, 256))
    header = json.dumps({"__metadata__": {"x": "y"}, "deep": json.loads("[" * 500 + "]" * 500)}).encode()
    header = header.replace(b'"deep": ' + b"[" * 500, b'"deep": ' + b"[" * 100_000).replace(b"]" * 500, b"]" * 100_000)
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    info = inspect_entry(path)
    assert info.status != "valid" and info.reason
