"""The shell reader against the shell itself: the words exl3tool reads from a line are the words ``bash`` (and
``dash``, where present) passes to the command, for quoting, escapes, expansions and field splitting."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from exl3tool.errors import ConfigError
from exl3tool.launch.shell import Vars, expand, lex, run_script
from seeds import fresh_seed

ENV = {"QC": '{"linear": {"weight": "mxfp8"}}', "EXTRA": "  --max-model-len 8192   --port 8000 ", "EMPTY": "",
       "MODEL": "/models/My Model", "TP": "2", "HOME": "/root"}
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


@pytest.mark.parametrize("text, line", [
    ("SPEC_ARGS=()\nvllm serve /m\n", 1),  # was "a function definition"
    ("set -e\nEXTRA=(--max-model-len 4096 -tp 2)\nvllm serve /m\n", 2),  # was read as EXTRA='(--max-model-len'
    ("EXTRA=\nEXTRA+=(-tp 2); vllm serve /m $EXTRA\n", 2),
])
def test_array_assignment_is_refused_by_name(text, line):
    """A wrapper's ``ARGS=(...)`` is bash's array: refused naming it and its line, never split into an assignment
    and a command."""
    with pytest.raises(ConfigError, match=rf"t line {line}: an array assignment (SPEC_ARGS|EXTRA)=\(\.\.\.\)"):
        run_script(text, environ={}, is_server=lambda w, cwd: w[:1] == ["vllm"], where="t")
