"""write_entry is deterministic: the same inputs give the same bytes (safetensors alone writes its metadata in hash order)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exl3tool.cache import CacheKey, validate_entry, write_entry

from helpers import ENCODER_ID, MODEL_ID, make_encoded

KEY = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)

_WRITE = """
import sys
sys.path[:0] = [{tests!r}, {here!r}]
from helpers import make_encoded
from exl3tool.cache import write_entry
from test_cache_write_bytes import KEY
e = make_encoded()
write_entry({path!r}, KEY, e.tensors(), e.proxy_error)
"""


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_same_inputs_same_bytes_across_calls_and_processes(tmp_path):
    e = make_encoded()
    blobs = {write_entry(tmp_path / f"{i}" / "e.safetensors", KEY, e.tensors(), e.proxy_error).read_bytes() for i in range(8)}
    here = Path(__file__).resolve().parent
    tests, here = str(here.parent), str(here)  # helpers.py, this module
    for i in range(2):
        path = str(tmp_path / f"p{i}.safetensors")
        subprocess.run([sys.executable, "-c", _WRITE.format(tests=tests, here=here, path=path)], check=True)
        blobs.add(open(path, "rb").read())
    assert len(blobs) == 1
    path = tmp_path / "0" / "e.safetensors"
    assert validate_entry(path, KEY).proxy_error == 0.125
    head = len(blobs.pop()) - (128 * 2 + 256 * 2 + 8 * 16 * 96 * 2)
    assert head % 8 == 0  # the data stays 8-byte aligned
