"""Shared fixtures: where the golden vectors live (tests/goldens.py), the printed test seed (tests/seeds.py), and the
GPU marker's skip rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import seeds
from goldens import golden_dir

REPO = Path(__file__).resolve().parent.parent

# Under `pytest -n N` (pytest-xdist) each worker gets its share of the cores for torch's and numba's pools, and so
# do the processes its tests start: N workers each running pools as wide as the machine spin against each other
# (two encodes at once on 2 cores took 35 % longer with 2 threads each than with 1). Set before torch is imported;
# an explicit setting is kept, and tests that are about thread counts set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    for _name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_name, str(_share))


@pytest.fixture(scope="session")
def golden() -> Path:
    return golden_dir()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """The tiny Llama (helpers.TINY, seed 0, 2 shards), written once a session: only for tests that just read it
    (a test that changes its checkpoint writes its own)."""
    from exl3tool.checkpoint import write_llama_checkpoint
    from helpers import TINY

    return write_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama") / "M", **TINY)


@pytest.fixture
def viterbi_memo():
    """helpers.viterbi_memo for one test: yields its counts {"hit": n, "miss": n}."""
    from helpers import viterbi_memo as memo

    with memo() as counts:
        yield counts


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput and "exl3tool_test_seed" in workerinput:  # an xdist worker: the controller's seed
        seeds.set_base_seed(workerinput["exl3tool_test_seed"])
    seeds.base_seed()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist controller: every worker draws from the same base seed
    node.workerinput["exl3tool_test_seed"] = seeds.base_seed()


def _seed_line() -> str:
    return f"test seed {seeds.base_seed()} (repeat with {seeds.ENV}={seeds.base_seed()})"


def pytest_report_header(config):
    return [_seed_line()]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_seed_line())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        mine = seeds.drawn.get(item.nodeid)
        report.sections.append(("exl3tool test seed", _seed_line() + (f"; this test drew {mine}" if mine else "")))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest files, longest first (CPU seconds each, 30-125 s, measured under -n 2 on 2 shared cores): a scheduling
# hint only. Under `--dist loadfile` a worker takes the next file as it finishes one, so the longest going first
# (then the other slow files, then the many short ones) lets the two workers finish together; one long file taken
# last would run alone at the end. A file missing here (renamed, new) is only scheduled with the other slow files.
LONGEST_FIRST = ("kernels/test_kernels_viterbi.py", "operations/test_warm.py", "serving/test_encoder_source.py",
                 "encode/test_online.py", "operations/test_hydrate.py", "checkpoint/test_shared_encodes.py",
                 "checkpoint/test_mla_warm.py", "test_deploy_shards.py", "test_deploy_example.py",
                 "operations/test_minilm.py")


def _schedule_rank(path: Path, slow_files: set) -> tuple[int, int]:
    rel = path.relative_to(Path(__file__).parent).as_posix() if path.is_relative_to(Path(__file__).parent) else ""
    if rel in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(rel)
    return (1 if path in slow_files else 2), 0


def pytest_collection_modifyitems(config, items):
    # The longest files first, then the other files holding a `slow` test, then the rest (order otherwise kept):
    # under `-n 2 --dist loadfile --no-loadscope-reorder` the long files start at once and the many short ones fill
    # in, so the two workers finish together.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: _schedule_rank(item.path, slow_files))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
