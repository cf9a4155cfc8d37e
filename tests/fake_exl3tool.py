"""``exl3tool ARGV`` with the tests' instant fake encoder (``helpers.fake_encode``) in place of the real one.

For tests that run exl3tool as separate processes (concurrent shards, the deploy examples' scripts) and need
planning, publishing and the cache to be real but the encode instant: ``python tests/fake_exl3tool.py cache warm ...``
(or as the ``exl3tool`` on PATH, see ``tests/operations/test_shards.py``). Same bytes for the same key in every process.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exl3tool.operations.warm.run as _run  # noqa: E402
from helpers import fake_encode  # noqa: E402

_real = _run.run_plan


def _run_plan(*args, **kwargs):
    kwargs["encode"] = fake_encode
    return _real(*args, **kwargs)


_run.run_plan = _run_plan

if __name__ == "__main__":
    from exl3tool.cli import main

    main(sys.argv[1:])
