"""Launcher scripts run by the system's bash in the read-only sandbox (``launch.script``):
the words and environment exl3tool records for the server are the ones bash passes (quoting, escapes, expansions,
field splitting, arrays, ``if``/``case``/functions), and reading a launcher leaves no trace outside its temporary
folder: no file written, no network, no daemon socket, no GPU, no process left behind."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from exl3tool.errors import ConfigError
from exl3tool.launch.script import read_launcher, run_launcher, sandbox_problem, script_changes
from seeds import fresh_seed

pytestmark = pytest.mark.skipif(bool(shutil.which("bash") is None or sandbox_problem()),
                                reason=f"no sandbox here: {sandbox_problem() if shutil.which('bash') else 'no bash'}")

ENV = {"QC": '{"linear": {"weight": "mxfp8"}}', "EXTRA": "  --max-model-len 8192   --port 8000 ", "EMPTY": "",
       "MODEL": "/models/My Model", "TP": "2", "HOME": "/home/vllm"}
LINES = [
    'vllm serve "$MODEL" -tp $TP --quantization-config "${QC}" $EXTRA',
    "vllm serve '$MODEL' \"$MODEL\" $MODEL",
    'x ${UNSET-a b} ${EMPTY-d} ${EMPTY:-e f} "${UNSET:-g h}" ${TP:+-tp $TP} ${UNSET:+no} ${TP:=3}',
    'x a\\ b "c\\"d" \'e\\f\' "\\$TP" \\$TP "a"b\'c\' "" \'\' $EMPTY "$EMPTY"',
    "x pre${TP}post pre$EXTRA\"post\" ${#TP} $'tab\\there' $'nl\\nx' é",
    'x --quantization-config.ignore+ lm_head,re:.*x$ "$" a$ "a$@" ""$@',
    'x "$@" $@ "${@}" y',
    'x a=b --flag="$QC" "--flag2=$EXTRA"',
]
_SERVER = {"is_server": lambda w, cwd=None: w[:1] == ["vllm"], "where": "t"}


def run_script(text: str, *, environ: dict, is_server, where: str) -> Optional[SimpleNamespace]:
    """``bash -c TEXT`` in the sandbox: the server's words and environment, and what the script exported."""
    start = read_launcher(["bash", "-c", text], environ=environ, is_server=is_server, where=where)
    if start is None:
        return None
    exports, notes = script_changes(start, environ, where)
    return SimpleNamespace(words=list(start.argv), environ=dict(start.env), exports=exports,
                           notes=[*start.notes, *notes])


def _bash_words(line: str, shell: str = "bash") -> list[str]:
    """What the shell passes as arguments for ``line`` (its first word replaced by printf), outside any sandbox."""
    script = "set --\nprintf '%s\\0' start " + line.split(" ", 1)[1]
    done = subprocess.run([shell, "-c", script], env=ENV, capture_output=True, check=True)
    return done.stdout.decode().split("\0")[1:-1]


def _recorded(line: str, env: Optional[dict] = None) -> Optional[list[str]]:
    """The server's words exl3tool records for ``exec vllm ARGS`` (the line's first word replaced by vllm)."""
    result = run_script("exec vllm " + line.split(" ", 1)[1], environ=env if env is not None else ENV, **_SERVER)
    return None if result is None else result.words[1:]


@pytest.mark.parametrize("line", LINES)
def test_words_are_the_shells(line):
    assert _recorded(line) == _bash_words(line)


def test_random_quoting_agrees_with_bash():
    """Fresh random words of quotes, escapes and expansions, each compared with bash run directly."""
    rng = random.Random(fresh_seed(63))
    pieces = ['"${MODEL}"', "${EXTRA}", "'$TP'", '"${QC}"', "${EMPTY:-z}", "a\\ b", '"x y"', "''", "${EMPTY}",
              "${TP}q", '"\\$TP"', "--k=${TP}", "p", '"a"\'b\'c']
    lines = []
    for _ in range(12):
        words = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 5))]
        lines.append("x " + " ".join(words))
    # one bash for all; a function, not printf alone: printf with no arguments still prints its format once
    script = "w() { for a in \"$@\"; do printf '%s\\0' \"$a\"; done; printf '\\1'; }\n"
    script += "".join(f"w {line[2:]}\n" for line in lines)
    want = subprocess.run(["bash", "-c", script], env=ENV, capture_output=True, check=True).stdout.decode()
    ours = "".join("\0".join(_recorded(line) or []) + ("\0" if _recorded(line) else "") + "\1" for line in lines)
    assert ours == want, lines


def test_environment_exports_and_scope():
    """What the server's environment holds: exported and set -a variables, a NAME=VALUE prefix; not a plain
    assignment (noted), not an unset variable."""
    result = run_script("set -a\nA=1\nset +a\nB=2\nexport C=$B\nunset HOME\nVLLM_X=7\nD=4 exec vllm serve x\n",
                        environ={"HOME": "/h", "E": "5", "HF_HOME": "/hf"}, **_SERVER)
    assert result.words == ["vllm", "serve", "x"]
    assert {k: v for k, v in result.environ.items() if k != "PATH"} == {"E": "5", "A": "1", "C": "2", "D": "4",
                                                                      "HF_HOME": "/hf"}
    assert set(result.exports) == {"A", "C", "D"} and result.exports["C"] == ("2", "set by t (run by bash)")
    assert any("sets VLLM_X but does not export it" in n for n in result.notes), result.notes


# --- arrays, if ... fi, case, functions: bash itself --------------------------------------------------------------

@pytest.fixture(scope="module")
def bash_x(tmp_path_factory):
    """Runs a script with bash, outside the sandbox; ``x`` (on PATH, so ``exec x`` works) prints its words."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "x").write_text("#!/bin/sh\nprintf '%s\\0' start \"$@\"\n")
    (bin_dir / "x").chmod(0o755)

    def run(script: str, env: dict[str, str]) -> Optional[list[str]]:
        done = subprocess.run([shutil.which("bash"), "-c", script], env={**env, "PATH": str(bin_dir)},
                              capture_output=True)
        return done.stdout.decode().split("\0")[1:-1] if done.stdout else None  # None: exited before x
    return run


def _our_script_words(script: str, env: dict[str, str]) -> Optional[list[str]]:
    result = run_script(script.replace("exec x", "exec vllm"), environ=env, **_SERVER)
    return None if result is None else result.words[1:]


_VALUES = ["", "a b", " lead", "trail ", "x", "-n", "=", "!", "two  spaces", "1"]
_ELEMENTS = ['"$A"', "$A", "'lit eral'", "w", '""', '"${B}x"', "$B", "--flag=$C", '"$C"']
_CONDITIONS = ['[ -n "$A" ]', '[ -z "${B:-}" ]', '[ "$A" = "$B" ]', '[ "$A" != x ]', '[[ $A == "$B" ]]',
               '[ "$N" -lt "$M" ]', '[[ $N -ge 3 ]]', 'test -n "$C"', '! [ -n "$A" ]', '[ ! -z "$A" ]',
               '[ "$N" -eq "$M" ]', '[[ -n $A && $B != x ]]', '[[ ! -n $A || -z $B ]]', '[ "$A" ]', 'true', 'false',
               '[ "${#ARR[@]}" -gt 1 ]', '[[ ${ARR[0]:-} = "$A" ]]', '[ "$C" == "$A" ]', '[ "$N" -ne 0 ]']
_FINALS = ['"${ARR[@]}"', "${ARR[@]}", '"${#ARR[@]}"', '"${ARR[0]:-none}"', "x${ARR[@]}y", '"pre${ARR[@]}post"',
           "${#ARR[0]}", '"$ARR"', "${ARR:+set}", '"${ARR[1]-unset}"', '"$A"', "${OTHER[@]}", '"${OTHER[@]}"']


def _random_script(rng: random.Random) -> str:
    def elements() -> str:
        return " ".join(rng.choice(_ELEMENTS) for _ in range(rng.randint(0, 3)))

    def condition() -> str:
        parts = [rng.choice(_CONDITIONS)]
        for _ in range(rng.randint(0, 2)):
            parts += [rng.choice(["&&", "||"]), rng.choice(_CONDITIONS)]
        return " ".join(parts)

    lines = [f"ARR=({elements()})", f"OTHER=({elements()})"]
    for _ in range(rng.randint(1, 4)):
        form = rng.randrange(4)
        if form == 0:
            lines.append(f"if {condition()}; then ARR+=({elements()}); fi")
        elif form == 1:
            lines.append(f"if {condition()}\nthen\n  ARR+=({elements()})\nelif {condition()}; then\n"
                         f"  OTHER=({elements()})\n  if {condition()}; then ARR=(); fi\nelse\n"
                         f"  ARR+=(else {elements()})\nfi")
        elif form == 2:
            lines.append(f"{rng.choice(_CONDITIONS)} {rng.choice(['&&', '||'])} ARR+=({elements()})")
        else:
            lines.append(f"OTHER+=({elements()}); B=\"${{ARR[0]:-}}\"")
    finals = " ".join(rng.choice(_FINALS) for _ in range(rng.randint(1, 4)))
    lines.append(f"exec x {finals}")
    return "\n".join(lines) + "\n"


def test_random_arrays_and_ifs_agree_with_bash(bash_x):
    """Fresh random values, arrays and if/elif/else/&&/|| over them: the words the server line gets are bash's."""
    rng = random.Random(fresh_seed(64))
    for _ in range(15):
        env = {"A": rng.choice(_VALUES), "B": rng.choice(_VALUES), "C": rng.choice(_VALUES),
               "N": str(rng.randint(-5, 20)), "M": str(rng.randint(-5, 20))}
        script = _random_script(rng)
        assert _our_script_words(script, env) == bash_x(script, env), (script, env)


@pytest.mark.parametrize("script", [
    'set -u\nA=()\nexec x "${A[@]}" y\n',
    'A=(a "b c")\nA=z\nexec x "${A[@]}" "${#A[1]}" "${A[0]}"\n',
    'declare -a D=(1 "2 3")\nexport E=e\nexec x "${D[@]}" $E\n',
    'if [ "${N:-0}" = 1 ]; then if true; then exec x inner; fi; fi\nexec x outer\n',
    'A=1\ncase "$A" in\n  1) exec x one ;;\nesac\n',
    'f() { exec x "$@" f; }\nf a "b c"\n',
    'for i in 1 2; do A+=("$i"); done\nexec x "${A[@]}" "$(echo sub)" $((1+2))\n',
    'declare -A M=([k]=v)\nexec x "${M[k]}"\n',
    'A=(a b)\nexec x ${A[*]} "${A[@]:1}" ${A[-1]}\n',
    '(exec x in-subshell)\n',
    'false || exit 0\nexec x after-exit\n',
])
def test_script_forms_agree_with_bash(bash_x, script):
    assert _our_script_words(script, {}) == bash_x(script, {}), script  # None: exited before x


# --- the sandbox: no trace outside its temporary folder ------------------------------------------------------------

HOSTILE = """#!/bin/bash
# what a launcher may do on its way to the server: none of it may reach this machine
mkdir -p /cache/x "$WATCH/made-by-mkdir" 2>/dev/null
/bin/mkdir -p "$WATCH/made-by-bin-mkdir" 2>/dev/null
touch "$WATCH/touched" 2>/dev/null
echo written > "$WATCH/redirected" 2>/dev/null
echo appended >> "$WATCH/existing" 2>/dev/null
/bin/rm -f "$WATCH/existing" 2>/dev/null
rm -rf "$WATCH" 2>/dev/null
/usr/bin/env rm -rf "$WATCH" 2>/dev/null
ln -s / "$WATCH/link" 2>/dev/null
curl -fsS https://huggingface.co/api/models -o "$WATCH/curl.json" 2>/dev/null
/usr/bin/curl -fsS https://huggingface.co -o "$WATCH/curl2.json" 2>/dev/null
python3 -c "open('$WATCH/py', 'w').write('x')" 2>/dev/null
hf download some/model --local-dir "$WATCH/hf" 2>/dev/null
docker pull vllm/vllm-openai:latest 2>/dev/null
(sleep 300 &) 2>/dev/null
/bin/sleep 300 &
[ -e /dev/nvidia0 ] && echo "gpu visible" >&2
[ -S /run/docker.sock ] || [ -S /var/run/docker.sock ] && echo "docker socket visible" >&2
nvidia-smi -L
exec vllm serve /models/M --tensor-parallel-size 2
"""


def test_reading_a_launcher_leaves_no_trace(tmp_path, monkeypatch):
    own_tmp = tmp_path / "tmp"  # this test's own temporary folder: other workers' launcher runs come and go in /tmp
    own_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    watch = tmp_path / "watch"
    watch.mkdir()
    (watch / "existing").write_text("kept\n")
    script = tmp_path / "hostile.sh"
    script.write_text(HOSTILE)
    script.chmod(0o755)
    before = {p: p.read_bytes() for p in watch.rglob("*")}
    start = read_launcher(["bash", str(script)], environ={"WATCH": str(watch), "PATH": os.environ["PATH"]},
                          cwd=str(tmp_path), is_server=lambda w, cwd=None: w[:2] == ["vllm", "serve"],
                          where="hostile.sh")
    assert start is not None and start.argv == ("vllm", "serve", "/models/M", "--tensor-parallel-size", "2")
    assert {p: p.read_bytes() for p in watch.rglob("*")} == before  # nothing written, removed or linked
    assert not Path("/cache/x").exists()
    assert os.listdir(own_tmp) == []  # the run's own folder is gone too
    # every process of the sandbox ends with it: killed with its pid namespace, reaped within moments, though on
    # 2 loaded cores CI saw one still listed after 5 s; a leaked one would stay for 300 s
    deadline = time.monotonic() + 30
    while True:
        ps = subprocess.run(["ps", "-eo", "pid,ppid,etimes,stat,args"], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if "sleep 300" in line or "/dev/fd/" in line]
        if not any("sleep 300" in line for line in left) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any("sleep 300" in line for line in left), left
    assert any("curl" in n and "docker pull" in n for n in start.notes), start.notes  # recorded, not run


def test_the_sandbox_has_no_network_no_gpu_no_daemon_socket(tmp_path):
    probe = ("[ -e /dev/nvidia0 ] && echo gpu; [ -e /run/docker.sock ] && echo docker; "
             "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ' '; echo; cat /dev/null && echo devnull; ( : > /etc/x ) 2>/dev/null "
             "&& echo etc-writable; echo scratch > /tmp/exl3tool-probe && echo tmp-scratch; exec vllm serve /m")
    run = run_launcher(["bash", "-c", probe], environ={"PATH": os.environ["PATH"]}, cwd=str(tmp_path))
    lines = run.stdout.split("\n")
    assert "gpu" not in lines and "docker" not in lines and "etc-writable" not in lines
    assert lines[0].split() == ["lo"]  # a network namespace of its own: loopback only, down
    assert "devnull" in lines and "tmp-scratch" in lines  # /tmp is writable, in memory
    assert not Path("/tmp/exl3tool-probe").exists()


def test_a_launcher_that_never_starts_a_server_is_stopped(tmp_path):
    import exl3tool.launch.script as script

    with pytest.raises(ConfigError, match="more than 2 s"):
        script.run_launcher(["bash", "-c", "while :; do :; done"], environ={}, cwd=str(tmp_path), timeout=2)


def test_without_user_namespaces_a_launcher_is_not_run(tmp_path, monkeypatch, cli):
    """No sandbox, no run: one line saying to give the launcher's DRY_RUN output instead."""
    import exl3tool.launch.script as script

    monkeypatch.setattr(script, "_problem", "user namespaces are not allowed here (unshare -Urmn: Operation not "
                                            "permitted)")
    (tmp_path / "run.sh").write_text("touch marker\nexec vllm serve /m\n")
    code, _, err = cli("identity", "--launch-file", tmp_path / "run.sh")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "user namespaces are not allowed" in lines[0], err
    assert "DRY_RUN=1" in lines[0] and "--launch-file dryrun.txt" in lines[0]
    assert not (tmp_path / "marker").exists()
