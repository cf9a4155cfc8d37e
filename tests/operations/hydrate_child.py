"""The encoder a killed `exl3tool hydrate` child runs (tests/operations/test_hydrate.py): test_hydrate's weight-keyed
stand-in, slowed so the kill lands between and inside layers."""

from __future__ import annotations

import time

from test_hydrate import weight_encode


def slow_encode(weight, *, bits, seed, device, name=None, **_):
    time.sleep(0.15)
    return weight_encode(weight.cpu(), bits, seed, device)


if __name__ == "__main__":  # `python hydrate_child.py hydrate ...` (torchrun's script form): the CLI with slow_encode
    import sys

    import exl3tool.encode as enc
    from exl3tool.cli import main

    enc.encode_linear = slow_encode
    main(sys.argv[1:])
