"""Where the golden vectors are, and one golden encode's tensors.

The full set (31 MB, outside the repository) wins when present: ``$EXL3TOOL_GOLDEN``, ``./golden`` (carried to the GPU
machine), ``../shared/golden``. Otherwise the subset in ``tests/data/golden`` (cut by benchmarks/make_golden_subset.py:
fewer tiles, one whole encode case, a column crop of the GEMM case), so a fresh clone runs the golden tests; a test
that needs a case or tensor the subset lacks skips, naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBSET = REPO / "tests" / "data" / "golden"


def full_golden_dirs() -> list[Path]:
    """The places a full golden folder may be, in order of preference."""
    env = os.environ.get("EXL3TOOL_GOLDEN")
    return ([Path(env)] if env else []) + [REPO / "golden", REPO.parent / "shared" / "golden"]


def golden_dir() -> Path:
    """The first folder holding tiles_golden.safetensors: a full set, else the repository's subset."""
    for path in full_golden_dirs() + [SUBSET]:
        if (path / "tiles_golden.safetensors").is_file():
            return path
    pytest.skip(f"golden vectors not found: {SUBSET} is missing (regenerate it with "
                "benchmarks/make_golden_subset.py FULL_GOLDEN_DIR) and no full set is at $EXL3TOOL_GOLDEN, "
                "./golden or ../shared/golden")


def golden_file(golden: Path, fname: str, *needs: str) -> Path:
    """``golden/fname.safetensors``, skipping if it is absent or lacks one of the tensors ``needs``."""
    from safetensors import safe_open

    path = golden / f"{fname}.safetensors"
    if not path.is_file():
        pytest.skip(f"{path} not found (a device run that carried only some golden files?)")
    if needs:
        with safe_open(str(path), "pt") as f:
            missing = [n for n in needs if n not in f.keys()]
        if missing:
            pytest.skip(f"{path} has no {missing[0]} (the golden subset keeps fewer cases and tensors; the full "
                        "set, at $EXL3TOOL_GOLDEN, runs this)")
    return path


def golden_case(golden: Path, fname: str, tag: str, *, whole: bool = True) -> dict:
    """The tensors of one golden encode, prefix ``tag.`` stripped, plus ``meta`` (the file's metadata) and ``seed``;
    skips if the file lacks the case, or (``whole``) holds only a crop of it (regularize needs every column)."""
    from safetensors import safe_open

    path = golden_file(golden, fname)
    with safe_open(str(path), "pt") as f:
        keys = [k for k in f.keys() if k.startswith(tag + ".")]
        meta = dict(f.metadata() or {})
        if not keys:
            pytest.skip(f"{path} has no {tag} (the golden subset keeps one encode case whole; the full set, at "
                        "$EXL3TOOL_GOLDEN, runs this)")
        if whole and f"{tag}.crop_in_out" in meta:
            pytest.skip(f"{path} holds {tag} cropped to (in, out) {json.loads(meta[f'{tag}.crop_in_out'])}; this "
                        "test needs the whole layer (the full set, at $EXL3TOOL_GOLDEN)")
        out = {k[len(tag) + 1:]: f.get_tensor(k) for k in keys}
    out["meta"] = meta
    out["seed"] = int(meta[f"{tag}.seed"])
    return out


def is_subset(golden: Path) -> bool:
    """Whether ``golden`` is a cut (its files carry the ``subset`` metadata key)."""
    from safetensors import safe_open

    with safe_open(str(golden / "tiles_golden.safetensors"), "pt") as f:
        return "subset" in (f.metadata() or {})
