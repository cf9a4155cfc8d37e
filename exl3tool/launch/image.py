"""An image's ``ENV``: the lowest layer of a container's environment, read with ``docker|podman image inspect``.

An image often sets the server's variables (``VLLM_EXL3_ENCODER_SOURCE``) in its Dockerfile, not on the run line.
When the runner's CLI is on PATH and the image is present, ``Config.Env`` is read; otherwise the reason is kept so
that a variable the launch then lacks is named with the fix (``--env-file``), in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import lru_cache

from exl3tool.launch.env import EnvValue

__all__ = ["image_env"]

_TIMEOUT_S = 30


@lru_cache(maxsize=32)
def _inspect(path: str, image: str) -> tuple[tuple[tuple[str, str], ...], str]:
    tool = os.path.basename(path)
    try:
        done = subprocess.run([path, "image", "inspect", "--format", "{{json .Config.Env}}", image],
                              capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (), f"`{tool} image inspect {image}` did not run ({exc})"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0][:160]
        return (), f"`{tool} image inspect {image}` failed ({first})"
    try:
        items = json.loads(done.stdout.strip() or "null") or []
    except json.JSONDecodeError:
        return (), f"`{tool} image inspect {image}` printed no JSON list"
    if not isinstance(items, list):
        return (), f"`{tool} image inspect {image}` printed no JSON list"
    pairs = tuple((k, v) for item in items if isinstance(item, str) for k, eq, v in [item.partition("=")] if eq)
    return pairs, ""


def image_env(runner: str, image: str) -> tuple[dict[str, EnvValue], str]:
    """The image's ``ENV`` (name -> value) and "" when read; else an empty mapping and why it could not be read.

    The runner's own CLI is asked first (``podman`` for ``podman run``), then the other one on PATH.
    """
    if not image:
        return {}, "the launch names no image"
    order = ("podman", "docker") if runner == "podman" else ("docker", "podman")
    tools = [(t, p) for t in order if (p := shutil.which(t))]
    if not tools:
        return {}, f"neither docker nor podman is on PATH to read the ENV of the image {image}"
    reasons = []
    for tool, path in tools:
        pairs, why = _inspect(path, image)
        if not why:
            return {k: EnvValue(v, "launch env", f"ENV of the image {image} ({tool} image inspect)")
                    for k, v in pairs}, ""
        reasons.append(why)
    return {}, "; ".join(reasons)
