"""Which launcher reader accepts the fork's public launchers as operators run them: the home-made shell reader
(exl3tool 0.x ``launch/shell.py``, walked in Python) or the system's bash in the read-only sandbox
(``launch/script.py``). docs/launch.md quotes the figures.

    git clone https://github.com/local-inference-lab/blackwell-llm-docker
    git show 51229ee:exl3tool/launch/shell.py > /tmp/home_made_shell.py   # the deleted reader, from history
    python benchmarks/launcher_evidence.py blackwell-llm-docker/launchers --home-made /tmp/home_made_shell.py

Each case is an operator's invocation (the variables compose passes, then the script); "accepted" means the reader
found the vllm server's command, and the encoder variables it prints are what the server would get.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

CASES = [  # (script, the operator's variables)
    ("serve-glm52-v16.sh", "ONLINE_QUANT=exl3-b6 QUANTIZATION=exl3 MODEL=/models/GLM-5.2-EXL3 TP=4"),
    ("serve-glm52-v18.sh", "ONLINE_QUANT=exl3-b6 QUANTIZATION=exl3 MODEL=/models/GLM-5.2-EXL3 TP=4"),
    ("serve-glm52-v19.sh", "ONLINE_QUANT=exl3-b6 QUANTIZATION=exl3 MODEL=/models/GLM-5.2-EXL3 TP=4"),
    ("serve-glm52-hybrid-v17.sh", "MODEL=/models/GLM-5.2-Hybrid TP=4"),
    ("serve-glm52-hybrid-v18.sh", "MODEL=/models/GLM-5.2-Hybrid TP=4"),
    ("serve-glm52-hybrid-v19.sh", "MODEL=/models/GLM-5.2-Hybrid TP=4"),
    ("serve-gilded-gnosis.sh", "MODEL_FAMILY=glm52-exl3 ONLINE_QUANT=exl3-b6 MODEL=/models/GLM-5.2-EXL3 TP=4"),
    ("serve-infernal-invocation.sh", "MODEL_FAMILY=glm52-exl3 ONLINE_QUANT=exl3-b6 MODEL=/models/GLM-5.2-EXL3 TP=4"),
    ("serve-fathomless-firmament.sh", "MODEL_FAMILY=glm52 MODEL=/models/GLM-5.2 TP=4"),
    ("serve-kimi-k3-qsrt-nospec", ""),
]


HOME_MADE = ""  # the deleted reader's file (--home-made)


def home_made(directory: str, script: str, variables: str) -> str:
    import importlib.util

    from exl3tool.launch.parse import find_server
    spec = importlib.util.spec_from_file_location("home_made_shell", HOME_MADE)
    module = sys.modules.get("home_made_shell")
    if module is None:
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["home_made_shell"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    run_script = module.run_script
    text = f"{variables} ./{script}".strip()
    with open(os.path.join(directory, script), encoding="utf-8") as fh:
        body = fh.read()
    env = dict(os.environ)
    env.update(v.split("=", 1) for v in variables.split())
    try:
        result = run_script(body, environ=env, where=script, workdir=directory,
                            is_server=lambda w, _cwd=None: find_server(w) is not None)
    except Exception as exc:  # noqa: BLE001 - the figure is what it says
        return f"refused: {str(exc)[:110]}"
    if result is None:
        return f"refused: {text}: no server found"
    bits = result.environ.get("VLLM_EXL3_ONLINE_TRELLIS_BITS", "-")
    return f"accepted: {' '.join(result.words[:3])} ... (bits {bits})"


def real_bash(directory: str, script: str, variables: str) -> str:
    from exl3tool.launch.parse import find_server
    from exl3tool.errors import ConfigError
    from exl3tool.launch.script import read_launcher
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/root"}
    try:
        r = read_launcher(["bash", "-c", f"{variables} ./{script}".strip()], environ=env, cwd=directory,
                          launcher_dirs=[directory], is_server=lambda w: find_server(w) is not None, where=script)
    except ConfigError as exc:
        return f"refused: {str(exc)[:140]}"
    if r is None:
        return "refused: no server started"
    bits = r.env.get("VLLM_EXL3_ONLINE_TRELLIS_BITS", "-")
    return f"accepted: {' '.join(r.argv[:3])} ... (bits {bits}, {len(r.argv)} words, {r.how})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--home-made", metavar="FILE", default="",
                    help="the deleted home-made reader (git show 51229ee:exl3tool/launch/shell.py); without it only "
                    "bash is measured")
    a = ap.parse_args()
    global HOME_MADE
    HOME_MADE = a.home_made
    readers = {"home-made": home_made, "bash": real_bash}
    chosen = list(readers) if HOME_MADE else ["bash"]
    counts = dict.fromkeys(chosen, 0)
    for script, variables in CASES:
        if not os.path.exists(os.path.join(a.directory, script)):
            continue
        for name in chosen:
            t = time.perf_counter()
            said = readers[name](a.directory, script, variables)
            counts[name] += said.startswith("accepted")
            print(f"{script:32} {name:9} {time.perf_counter() - t:5.2f}s {said}")
    n = sum(os.path.exists(os.path.join(a.directory, s)) for s, _ in CASES)
    for name, c in counts.items():
        print(f"{name}: {c} of {n} accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
