"""`exl3tool synth`: tiny EXL3 checkpoints of the served families that plan as the server would, deterministic."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from exl3tool.checkpoint.tiny import TINY_FAMILIES, write_tiny

from helpers import ENC_ARGS as ENC, run
from seeds import fresh_seed



def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


# The TP size `synth`'s next command warms for: 2, except where a module the tiny checkpoint stores as EXL3 cannot
# be sliced there (GLM-4.5's stored layer-1 routed experts, 128 rows: 64 a rank, and its layer-2 attention: 2 KV
# heads of 64; the fork slices stored matrices in 128-blocks) and the server would not start.
NEXT_TP = {"glm4.5": 1}


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_every_family_plans_server_lookups_at_tp2(family, tmp_path, capsys):
    seed = fresh_seed()
    rc, out, _ = run(["synth", str(tmp_path / "m"), "--family", family, "--seed", str(seed)], capsys)
    assert rc == 0 and f" --tp-size {NEXT_TP.get(family, 2)} " in out.splitlines()[-1], out
    made = TINY_FAMILIES[family].checkpoint_json(tmp_path / "m", seed)
    assert made["family"] == family and made["architecture"] == TINY_FAMILIES[family].architecture
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == [made["architecture"]]
    argv = ["cache", "warm", made["path"], "--tp-size", "2", "--cache-dir", str(tmp_path / "c"), "--dry-run", "--json",
            *ENC]
    if made["quantization_config"]:
        argv += ["--quantization-config", made["quantization_config"]]
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    plan = json.loads(out)
    assert plan["architecture"] == made["architecture"] and plan["server_lookup"] is True
    assert plan["checkpoint_kind"] is not None  # an EXL3 checkpoint, not a plain BF16 one
    assert sum(j["state"] == "miss" for j in plan["jobs"]) >= 8


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    seed = fresh_seed()
    a, b, c = (write_tiny(tmp_path / n, "deepseek-v3", seed=s) for n, s in (("a", seed), ("b", seed), ("c", seed + 1)))
    assert _digest(a) == _digest(b) != _digest(c)


def test_refuses_a_non_empty_folder_and_an_unknown_family(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"x")
    rc, out, err = run(["synth", str(tmp_path / "full"), "--family", "glm5.3"], capsys)
    assert rc == 2 and "not an empty directory" in err and "Traceback" not in err
    assert (tmp_path / "full" / "model.safetensors").read_bytes() == b"x"
    rc, _, err = run(["synth", str(tmp_path / "new"), "--family", "qwen9"], capsys)
    assert rc == 2 and "qwen3.5" in err and not (tmp_path / "new").exists()
