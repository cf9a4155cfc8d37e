"""The EXL3TOOL_* registry (exl3tool/knobs.py): every variable the package reads is registered and documented,
parsing refuses what a knob does not accept (one ConfigError naming it), and the CLI refuses a bad value in one
line with exit 2 before any command runs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from exl3tool.errors import ConfigError
from exl3tool.knobs import (DEFAULT_TUNING, KNOBS, PREFIX, Tuning, current_tuning, knob, knob_value, parse_knob,
                            read_knobs)

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"EXL3TOOL_[A-Z0-9_]*")


def _package_sources() -> dict[Path, str]:
    """The package's modules and benchmarks/quality.py (the tests' and benchmarks' quality check, which reads
    EXL3TOOL_MINILM_DIR through the registry)."""
    paths = sorted((REPO / "exl3tool").rglob("*.py")) + [REPO / "benchmarks" / "quality.py"]
    return {p: p.read_text() for p in paths}


def test_every_variable_the_package_names_is_registered_and_documented():
    """Every EXL3TOOL_* name in the package's source is a registered knob (no dynamic names: a name built at run
    time would escape this check), every knob is named somewhere outside the registry (none is dead), and
    docs/tuning.md lists each with its default."""
    registered = {k.name for k in KNOBS}
    used: set[str] = set()
    for path, text in _package_sources().items():
        for match in NAME.finditer(text):
            name, after = match.group(0), text[match.end():match.end() + 1]
            if path.name == "knobs.py" or (name == PREFIX and after == "*"):  # the registry; prose about them all
                continue
            assert name != PREFIX, f"{path}: a name built at run time: {text[match.start():match.end() + 20]!r}"
            used.add(name)
    assert used <= registered, f"read but not registered: {sorted(used - registered)}"
    # a tuning knob is read as its Tuning field (tuning.<field>), the others by name
    code = "\n".join(text for path, text in _package_sources().items() if path.name != "knobs.py")
    unread = [k.name for k in KNOBS if (f".{k.tuning}" not in code if k.tuning else k.name not in used)]
    assert not unread, f"registered but never read: {unread}"
    doc = (REPO / "docs" / "tuning.md").read_text()
    for k in KNOBS:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{k.name}`")), None)
        assert row is not None, f"{k.name} is not in docs/tuning.md's table"
        assert f"`{k.shown_default()}`" in row, (k.name, k.shown_default(), row)


def test_tuning_fields_are_the_tuning_knobs_with_their_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(Tuning)}
    assert fields == {k.tuning: k.default for k in KNOBS if k.tuning is not None}
    assert read_knobs({}) == DEFAULT_TUNING == Tuning()


@pytest.mark.parametrize("name, bad", [
    ("VITERBI_MODE", "9"), ("VITERBI_MODE", "2"), ("VITERBI_MODE", "3"), ("VITERBI_MODE", "four"), ("VITERBI_MODE", ""),
    ("VITERBI_SELFCHECK", "maybe"), ("RESIDENT_CAP", "3"), ("RESIDENT_CAP", "x"), ("EVEN_ROUNDS", "-1"),
    ("EDGE_MAJOR_TRACEBACK", "2"), ("HALF_ROW_BITS", "4,six"), ("COST_ROW_BITS", "9"), ("IN_PLACE_BITS", "0,6"),
    ("HALF_ROWS_BELOW_PER_SM", ""), ("HALF_ROWS_BELOW_PER_SM", "nan"), ("HALF_ROWS_BELOW_PER_SM", "-1"),
    ("CHUNK_ROUNDS", "0"), ("CHUNK_ROUNDS_IN_PLACE", "2.5"), ("IN_PLACE_MAX_TILES", "-4"),
    ("REFERENCE_SEARCH_TILE_KIB", "lots"), ("THREADS", "0"), ("THREADS", "zero"), ("DIST_TIMEOUT_S", "0"),
    ("DIST_TIMEOUT_S", "inf"), ("DIST_TIMEOUT_S", "soon"), ("DEBUG", "maybe"),
])
def test_parse_refuses_what_a_knob_does_not_accept(name, bad):
    """One ConfigError naming the variable, the value, what it accepts and the way out; read_knobs refuses it too."""
    k = knob(name)
    with pytest.raises(ConfigError) as exc:
        parse_knob(k, bad)
    message = str(exc.value)
    assert message.startswith(f"{k.name}={bad!r}: must be {k.accepts()}") and "unset it" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=re.escape(k.name)):
        read_knobs({k.name: bad})


@pytest.mark.parametrize("name, text, value", [
    ("VITERBI_MODE", "1", 1), ("VITERBI_MODE", " 5 ", 5), ("VITERBI_SELFCHECK", "0", 0), ("VITERBI_SELFCHECK", "", 1),
    ("COST_ROW_BITS", "6", frozenset({6})), ("HALF_ROW_BITS", "", frozenset()),
    ("IN_PLACE_BITS", "4, 6", frozenset({4, 6})),
    ("HALF_ROWS_BELOW_PER_SM", "2.5", 2.5), ("IN_PLACE_MAX_TILES", "0", 0), ("RESIDENT_CAP", "2", 2),
    ("THREADS", "3", 3), ("THREADS", "", None), ("DIST_TIMEOUT_S", "90", 90.0), ("DIST_TIMEOUT_S", " ", 86400.0),
    ("DEBUG", "Yes", True), ("DEBUG", "off", False), ("DEBUG", "", False), ("MINILM_DIR", "/m", "/m"),
    ("MINILM_DIR", "", None),
])
def test_parse_accepts_what_the_docs_say(name, text, value):
    k = knob(name)
    assert parse_knob(k, text) == value
    assert knob_value(name, {k.name: text}) == value and knob_value(name, {}) == k.default
    if k.tuning is not None:
        assert getattr(read_knobs({k.name: text}), k.tuning) == value


def test_current_tuning_follows_the_environment_at_each_call(monkeypatch):
    """Not frozen at import: the tuning a library call reads changes as soon as the variable does."""
    monkeypatch.delenv("EXL3TOOL_CHUNK_ROUNDS", raising=False)
    assert current_tuning().chunk_rounds == DEFAULT_TUNING.chunk_rounds
    monkeypatch.setenv("EXL3TOOL_CHUNK_ROUNDS", "7")
    assert current_tuning().chunk_rounds == 7
    monkeypatch.setenv("EXL3TOOL_CHUNK_ROUNDS", "many")
    with pytest.raises(ConfigError, match="EXL3TOOL_CHUNK_ROUNDS='many'"):
        current_tuning()


@pytest.mark.parametrize("name, value", [("VITERBI_MODE", "9"), ("DEBUG", "maybe"), ("THREADS", "-2")])
def test_the_cli_refuses_a_bad_knob_in_one_line_with_exit_2(name, value, monkeypatch, capsys):
    """Before any command runs (here one that reads none of these): one line naming the variable, exit 2, and the
    --json error document."""
    from exl3tool.cli import main

    monkeypatch.setenv(PREFIX + name, value)
    with pytest.raises(SystemExit) as exc:
        main(["identity", "--encoder-root", "/nonexistent", "--json"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"error: {PREFIX}{name}={value!r}: must be "), err
    assert "Traceback" not in err + out
    assert json.loads(out) == {"error": err[len("error: "):].strip(), "exit_code": 2}
