"""Every command's output at a terminal of 60, 80 and 120 columns (issue 44): no word of the output is split across
lines (tables wrap at spaces or fold into label/value lines, notes wrap at spaces), and nothing is left out: the
words are the ones the same command prints on an unlimited terminal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.cli import _register, app

from helpers import ENC_ARGS, ENCODER_ID, MODEL_ID, CliRunner, make_encoded

_register()
LONG_PREFIX = "model.language_model.layers.12.self_attn.indexer.wq_b"  # a GLM-5.3-long layer name


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("widths")
    model = write_tiny(base / "model", "llama")
    store = CacheStore(base / "cache")
    entries = [store.publish(CacheKey.for_layer(MODEL_ID, ENCODER_ID, f"{LONG_PREFIX}.{i}", 6, 2, i % 2, 128, 256),
                             make_encoded(128, 256, seed=i)) for i in range(3)]
    data = bytearray(entries[0].read_bytes())
    data[-1] ^= 0x40  # loadable by the server, caught by our checksum: a finding row with a long reason
    entries[0].write_bytes(bytes(data))
    assert CliRunner().invoke(app, ["cache", "export", str(base / "b.tar"), "--cache-dir", str(base / "cache")]
                              ).exit_code == 1
    return {"model": model, "cache": base / "cache", "bundle": base / "b.tar", "base": base}


COMMANDS = {
    "cache ls": lambda p: ["cache", "ls", "--cache-dir", p["cache"]],
    "cache verify": lambda p: ["cache", "verify", "--cache-dir", p["cache"]],
    "cache prune": lambda p: ["cache", "prune", "--invalid", "--dry-run", "--cache-dir", p["cache"]],
    "cache import": lambda p: ["cache", "import", p["bundle"], "--cache-dir", p["base"] / "other", "--against",
                               p["model"], *ENC_ARGS],
    "cache check": lambda p: ["cache", "check", p["model"], "--tp-size", "2", "--cache-dir", p["cache"], *ENC_ARGS],
    "cache warm --dry-run": lambda p: ["cache", "warm", p["model"], "-tp", "1,2", "--dry-run", "--cache-dir",
                                       p["cache"], *ENC_ARGS],
    "identity": lambda p: ["identity", p["model"], *ENC_ARGS],
    "cache show": lambda p: ["cache", "show", sorted(p["cache"].rglob("*.safetensors"))[0]],
}


def _run(argv: list, columns: int) -> str:
    res = CliRunner().invoke(app, [str(a) for a in argv], env={"COLUMNS": str(columns), "FORCE_COLOR": "1",
                                                              "NO_COLOR": "1", "TTY_COMPATIBLE": "1"})
    assert res.exit_code in (0, 1), res.output
    return re.sub(r"\x1b\[[0-9;]*m", "", res.stdout + res.stderr)


@pytest.mark.parametrize("columns", [60, 80, 120])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_no_word_is_split_nor_left_out(place, name, columns):
    argv = COMMANDS[name](place)
    wide, text = _run(argv, 100000), _run(argv, columns)
    volatile = re.compile(r"\d+\.\d+ ?s\b|\d{4}-\d\d-\d\d|\d\d:\d\d")  # times differ between the two runs
    def frame(w: str) -> bool:  # a table's borders: drawn at one width, folded rows have none
        return all("\u2500" <= ch <= "\u257f" for ch in w)

    words = {w for w in wide.split() if not volatile.search(w) and not frame(w)}
    missing = sorted(w for w in words if w not in set(text.split()))
    assert not missing, (missing[:8], text)
    assert "…" not in text and "left out at this width" not in text
    # no line wider than the terminal (which would cut it anywhere), unless it holds a word that alone is
    too_wide = [ln for ln in text.splitlines() if len(ln) > columns and max(map(len, ln.split())) <= columns - 4]
    assert not too_wide, too_wide
