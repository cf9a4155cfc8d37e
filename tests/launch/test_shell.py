"""The shell reader against the shell itself: the words exl3tool reads from a line are the words ``bash`` (and
``dash``, where present) passes to the command, for quoting, escapes, expansions and field splitting."""

from __future__ import annotations

import random
import shutil
import subprocess
from typing import Optional

import pytest

from exl3tool.errors import ConfigError
from exl3tool.launch.shell import Vars, expand, lex, run_script
from seeds import fresh_seed

ENV = {"QC": '{"linear": {"weight": "mxfp8"}}', "EXTRA": "  --max-model-len 8192   --port 8000 ", "EMPTY": "",
       "MODEL": "/models/My Model", "TP": "2", "HOME": "/home/vllm"}
LINES = [
    'vllm serve "$MODEL" -tp $TP --quantization-config "${QC}" $EXTRA',
    "vllm serve '$MODEL' \"$MODEL\" $MODEL",
    'x ${UNSET-a b} ${EMPTY-d} ${EMPTY:-e f} "${UNSET:-g h}" ${TP:+-tp $TP} ${UNSET:+no} ${TP:=3}',
    'x a\\ b "c\\"d" \'e\\f\' "\\$TP" \\$TP "a"b\'c\' "" \'\' $EMPTY "$EMPTY"',
    "x pre${TP}post pre$EXTRA\"post\" ${#TP} $'tab\\there'",
    'x --quantization-config.ignore+ lm_head,re:.*x$ "$" a$ "a$@" ""$@',
    'x "$@" $@ "${@}" y',
    'x a=b --flag="$QC" "--flag2=$EXTRA"',
]


def _bash_words(line: str, shell: str = "bash") -> list[str]:
    """What the shell passes as arguments for ``line`` (its first word replaced by printf)."""
    # a first fixed argument: printf with no argument at all still prints its format once (an empty word)
    script = "set --\nprintf '%s\\0' start " + line.split(" ", 1)[1]
    done = subprocess.run([shell, "-c", script], env=ENV, capture_output=True, check=True)
    return done.stdout.decode().split("\0")[1:-1]


def _ours(line: str) -> list[str]:
    vars = Vars(ENV)
    (cmd,) = lex(line)
    return [f for w in cmd.words[1:] for f in expand(w, vars, "t", cmd.line)]


@pytest.mark.parametrize("line", LINES)
def test_words_are_the_shells(line):
    if shutil.which("bash") is None:
        pytest.skip("no bash here to compare with")
    assert _ours(line) == _bash_words(line)
    if shutil.which("dash") is not None and "$'" not in line:  # dash has no $'...'
        assert _ours(line) == _bash_words(line, "dash")


def test_random_quoting_agrees_with_bash():
    """Fresh random words of quotes, escapes and expansions, each compared with bash."""
    if shutil.which("bash") is None:
        pytest.skip("no bash here to compare with")
    rng = random.Random(fresh_seed(63))
    pieces = ['"${MODEL}"', "${EXTRA}", "'$TP'", '"${QC}"', "${EMPTY:-z}", "a\\ b", '"x y"', "''", "${EMPTY}",
              "${TP}q",
              '"\\$TP"', "--k=${TP}", "p", '"a"\'b\'c']
    for _ in range(40):
        words = []
        for _ in range(rng.randint(1, 5)):
            words.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 3))))
        line = "x " + " ".join(words)
        assert _ours(line) == _bash_words(line), line


def test_commands_lines_and_redirections():
    cmds = lex("A=1 \\\n  vllm serve /m > /log 2>&1 &\n# note\necho 'a;b' && cd /x || exit 1 | tee y\n")
    assert [(c.line, c.after) for c in cmds] == [(1, ";"), (4, ";"), (4, "&&"), (4, "||"), (4, "|")]
    words = [[f for w in c.words for f in expand(w, Vars({}), "t", c.line)] for c in cmds]
    assert words[0] == ["A=1", "vllm", "serve", "/m"] and words[1] == ["echo", "a;b"]


def test_script_walk_exports_and_scope():
    result = run_script("set -a\nA=1\nset +a\nB=2\nexport C=$B\nunset HOME\nD=4 exec vllm serve x\n",
                        environ={"HOME": "/h", "E": "5"}, is_server=lambda w, cwd: w[:1] == ["vllm"], where="s.sh")
    assert result.words == ["vllm", "serve", "x"] and result.prefix_env == [("D", "4")]
    assert set(result.exports) == {"A", "C"} and result.unexported == {"B": 4}
    assert result.environ == {"E": "5", "A": "1", "C": "2", "D": "4"}
    assert result.exports["C"] == ("2", "export C=... in s.sh line 5")


@pytest.mark.parametrize("text, match", [
    ("vllm serve $1", r"\$1 is the script's argument 1"),
    ("vllm serve ${X:?give X}", r"\$X is not set \(give X\)"),
    ("vllm serve ${X/a/b}", "a form exl3tool does not follow"),
    ("vllm serve 'open", "single quote is not closed"),
    ("vllm serve `hostname`", "command substitution"),
    ("vllm serve $((1+1))", "arithmetic expansion"),
])
def test_refusals_name_what(text, match):
    with pytest.raises(ConfigError, match=match):
        run_script(text, environ={}, is_server=lambda w, cwd: w[:1] == ["vllm"], where="t")


# --- arrays and if ... fi, against bash ----------------------------------------------------------------------------

_SERVER = {"is_server": lambda w, cwd: w[:1] == ["x"], "where": "t"}


@pytest.fixture(scope="module")
def bash_x(tmp_path_factory):
    """Runs a script with bash; the command ``x`` (on PATH, so ``exec x`` works) prints the words it gets."""
    if shutil.which("bash") is None:
        pytest.skip("no bash here to compare with")
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "x").write_text("#!/bin/sh\nprintf '%s\\0' start \"$@\"\n")
    (bin_dir / "x").chmod(0o755)

    def run(script: str, env: dict[str, str]) -> Optional[list[str]]:
        done = subprocess.run([shutil.which("bash"), "-c", script], env={**env, "PATH": str(bin_dir)},
                              capture_output=True)
        return done.stdout.decode().split("\0")[1:-1] if done.stdout else None  # None: exited before x
    return run


def _our_script_words(script: str, env: dict[str, str], **kw) -> list[str]:
    result = run_script(script, environ=env, **_SERVER, **kw)
    assert result is not None, script
    return result.words[1:]


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
    for _ in range(60):
        env = {"A": rng.choice(_VALUES), "B": rng.choice(_VALUES), "C": rng.choice(_VALUES),
               "N": str(rng.randint(-5, 20)), "M": str(rng.randint(-5, 20))}
        script = _random_script(rng)
        assert _our_script_words(script, env) == bash_x(script, env), (script, env)


@pytest.mark.parametrize("script", [
    'set -u\nA=()\nexec x "${A[@]}" y\n',
    'A=()\nV=v\nexec x "$A" "${A[2]}" "${#A[0]}" "${V[1]}" "${V[0]}"\n',  # a known array's missing element: ""
    'A=("" "")\nexec x x${A[@]}y ${A[@]} "${A[@]}"\n',
    "V=' '\nexec x x${V}y $V\"\" \"\"$V\n",
    'E=""\nif [ -n $E ]; then exec x taken; fi\nexec x not\n',  # [ -n ] is one argument: true
    'A=(a "b c")\nA=z\nexec x "${A[@]}" "${#A[1]}" "${A[0]}"\n',  # a scalar assignment sets element 0
    'S=s\nS+=(t u)\nexec x "${S[@]}"\n',
    'declare -a D=(1 "2 3")\nexport E=e\nexec x "${D[@]}" $E\n',
    'A=(a\n  # a comment\n  "b c"\n)\nexec x "${A[@]}"\n',
    'if [ 007 -eq 7 ] && [ " 5" -gt +4 ]; then exec x yes; else exec x no; fi\n',
    'if [[ -n "${U:-}" && $U = x ]]; then exec x a; elif [[ -z ${U:-} ]]; then exec x b; fi\n',
    'if [ "${N:-0}" = 1 ]; then if true; then exec x inner; fi; fi\nexec x outer\n',
    'false || exit 0\nexec x after-exit\n',
    'true && ARR=(t)\nfalse && ARR=(f)\n[ -z "" ] || ARR+=(no)\nexec x "${ARR[@]}"\n',
])
def test_script_forms_agree_with_bash(bash_x, script):
    want = bash_x(script, {})
    result = run_script(script, environ={}, **_SERVER)
    assert (result.words[1:] if result is not None else None) == want, script  # None: exited before x


def test_file_tests_use_the_files_exl3tool_can_read():
    """``[ -f PATH ]`` is known when exl3tool reads the file (true, and -d false); otherwise refused."""
    files = {"/srv/env.sh": "A=1\n"}
    script = ('if [ -f /srv/env.sh ] && ! [ -d /srv/env.sh ]; then . /srv/env.sh; fi\n'
              'if [ -e "" ]; then A=2; fi\nexec x "$A"\n')
    assert _our_script_words(script, {}, read_file=files.get) == ["1"]
    with pytest.raises(ConfigError, match=r"t line 1: \[ -f /srv/other \] asks about a file in the server's"):
        run_script("if [ -f /srv/other ]; then A=1; fi\nexec x\n", environ={}, read_file=files.get, **_SERVER)
    # a test whose result is unknown may guard what changes nothing; not what does
    assert _our_script_words("[ -d /cache ] || mkdir -p /cache\n[ -f /x ] || exit 1\nexec x a\n", {}) == ["a"]
    with pytest.raises(ConfigError, match=r"t line 2: this command runs by the result of the test before &&"):
        run_script("A=0\n[ -f /x ] && A=1\nexec x $A\n", environ={}, **_SERVER)


@pytest.mark.parametrize("text, line, match", [
    ('A=1\ncase "$A" in\n  1) exec x ;;\nesac\n', 2, "a case statement"),
    ("while true; do\n  exec x\ndone\n", 1, r"a loop \(while"),
    ("A=(a b)\nexec x ${A[*]}\n", 2, r"\$\{A\[\*\]\} \(the array joined with IFS\)"),
    ('A=(a b)\nexec x "${#A[*]}"\n', 2, r"the array joined with IFS"),
    ('A=(a b)\nexec x "${A[@]:1}"\n', 2, "an array form exl3tool does not follow"),
    ("A=(a b)\nexec x ${A[-1]}\n", 2, "an array form"),
    ("declare -A M=([k]=v)\nexec x\n", 1, r"associative array \(declare -A\)"),
    ("A=()\nA[0]=x\nexec x\n", 2, r"an array element assignment A\[0\]"),
    ("A=([1]=x)\nexec x\n", 1, r"an array element with its index"),
    ("A=(a\nexec x\n", 1, r"an array's \( is not closed"),
    ('set -euo pipefail\nA=()\nexec x "${A[0]}"\n', 3, r"the array A has no element 0\) and set -u stops"),
    ("\n\nif [ -f /models/m/config.json ]; then A=1; fi\nexec x\n", 3, "asks about a file in the server's"),
    ("if grep -q a /etc/x; then A=1; fi\nexec x\n", 1, "the condition 'grep -q a /etc/x' is only known"),
    ('if [ -n "$UNSET" ]; then A=1; fi\nexec x\n', 1, r"\$UNSET is not set"),
    ('if [ -n "$(hostname)" ]; then A=1; fi\nexec x\n', 1, "command substitution"),
    ('if [[ $HOSTNAME == gpu* ]]; then A=1; fi\nexec x\n', 1, "glob match is not followed"),
    ("if [ a -a b ]; then A=1; fi\nexec x\n", 1, r"\[ a -a b \] is a test exl3tool does not follow"),
    ('if [ "x" -eq 1 ]; then A=1; fi\nexec x\n', 1, r"-eq compares integers and 'x'"),
    ("if [[ 010 -eq 8 ]]; then A=1; fi\nexec x\n", 1, "compares integers"),  # octal in [[ ]]
    ("if [[ a < b ]]; then A=1; fi\nexec x\n", 1, "a redirection in a test"),
    ("if true; then\n  A=1\nexec x\n", 1, "the if is not closed with fi"),
    ("A=1\nfi\nexec x\n", 2, "'fi' outside an if"),
    ("f() { exec x; }\nf\n", 1, "a function definition"),
])
def test_refusals_name_the_line(text, line, match):
    with pytest.raises(ConfigError, match=rf"^t line {line}: .*{match}"):
        run_script(text, environ={"HOSTNAME": "gpu1"}, **_SERVER)
