"""Shell text read as ``sh``/``bash`` read it, for the scripts that start a server.

``lex`` splits text into simple commands whose words keep their quoting (single quotes and ``\\`` escapes are
literal; unquoted and double-quoted text expands); ``expand`` gives a word's fields with ``$V``, ``${V}``,
``${V:-default}``, ``${V-default}``, ``${V:=default}``, ``${V:+alt}``, ``${V:?msg}``, bash's indexed arrays
(``"${A[@]}"``, ``${#A[@]}``, ``${A[N]}``) and field splitting of unquoted expansions. ``run_script`` walks a
script as the shell runs it: assignments (arrays too), ``export``, ``unset``, ``set -a``/``-u``, ``cd``,
``exec``, ``source`` of a file it can read, ``if``/``elif``/``else`` with ``[ ]``/``[[ ]]``/``test`` conditions
evaluated on the known variables (only the branch taken is walked), until the command ``is_server`` accepts.
What it cannot follow (``case``, loops, functions, subshells, here-documents, ``eval``, a condition whose result
is only known when it runs, and command or arithmetic substitution whose value is needed) is refused naming the
line and the construct (ConfigError, exit 2); an unset variable without a default is refused naming it, never
guessed.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from exl3tool.errors import ConfigError

__all__ = ["Seg", "RawCommand", "lex", "expand", "ScriptResult", "run_script", "RESERVED", "SHELLS"]

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash"})
# the shell's compound commands: control flow exl3tool does not follow (the server line could run 0 or n times)
RESERVED = {"for": "a loop (for ... done)",
            "while": "a loop (while ... done)", "until": "a loop (until ... done)", "do": "a loop", "done": "a loop",
            "case": "a case statement", "esac": "a case statement", "select": "a select loop",
            "function": "a function definition", "{": "a command group { ... }", "}": "a command group { ... }",
            "(": "a subshell ( ... )", ")": "a subshell ( ... )",
            "eval": "eval (its text is only known when it runs)", "trap": None, "wait": None}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_ARRAY_HEAD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+?=")  # NAME=( / NAME+=( opens an indexed array's words
_ELEMENT_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\[[^\]]*\]\+?=")  # A[0]=x, A[k]+=x
_IFS = " \t\n"


@dataclass(frozen=True)
class Seg:
    """A piece of a word: ``kind`` "lit" (taken as is), "exp" (expands), "sub" (a command or arithmetic
    substitution, which exl3tool cannot run), "open"/"close" (a word of its own: ``NAME=(`` / ``NAME+=(`` and the
    ``)`` around an array's element words), "op" (``&&``/``||`` inside ``[[ ... ]]``); ``quoted`` inside double
    quotes (no field splitting)."""

    text: str
    kind: str
    quoted: bool = False


Word = tuple[Seg, ...]


@dataclass(frozen=True)
class RawCommand:
    """One simple command as written: its words, its first line, the operator before it (";", "&&", "||"), and how
    many redirections it had (dropped; inside ``[[ ]]`` a ``<``/``>`` is a comparison exl3tool does not read)."""

    words: tuple[Word, ...]
    line: int
    after: str = ";"
    redirects: int = 0


def _lex_error(where: str, line: int, what: str) -> ConfigError:
    return ConfigError(f"{where} line {line}: {what}")


def lex(text: str, *, where: str = "--launch") -> list[RawCommand]:
    """Simple commands of ``text`` with their words' quoting kept; redirections dropped (``> log 2>&1``).

    >>> [len(c.words) for c in lex("A=1 vllm serve '$M' > log 2>&1; echo ok")]
    [4, 2]
    """
    commands: list[RawCommand] = []
    words: list[Word] = []
    segs: list[Seg] = []
    buf: list[str] = []  # the current unquoted expandable text
    started = False  # the current word has begun (an empty "" is a word)
    line = 1
    cmd_line = 1
    after = ";"
    skip_next = False  # a redirection's target word
    in_array = 0  # the line an open NAME=( ... ) began on, 0 outside one
    redirects = 0
    i, n = 0, len(text)

    def flush_buf() -> None:
        if buf:
            segs.append(Seg("".join(buf), "lit"))
            buf.clear()

    def end_word() -> None:
        nonlocal started, skip_next
        flush_buf()
        if started:
            if skip_next:
                skip_next = False
            else:
                words.append(tuple(segs))
        segs.clear()
        started = False

    def end_command(op: str) -> None:
        nonlocal after, cmd_line, redirects
        end_word()
        if in_array:
            raise _lex_error(where, in_array, f"an array's ( ... ) holds words only ({op!r} inside it); close it with )")
        if words:
            commands.append(RawCommand(tuple(words), cmd_line, after, redirects))
            words.clear()
        after = op
        cmd_line = line
        redirects = 0

    def dollar(j: int, quoted: bool) -> int:
        """Read a ``$`` construct at ``text[j]``; append it as a seg; return the index after it."""
        nxt = text[j + 1:j + 2]
        if nxt == "(":
            kind = "arithmetic expansion $((...))" if text[j + 2:j + 3] == "(" else "command substitution $(...)"
            depth, k = 0, j + 1
            while k < n:
                if text[k] == "(":
                    depth += 1
                elif text[k] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            if k >= n:
                raise _lex_error(where, line, f"{kind} is not closed")
            segs.append(Seg(kind + f" {text[j:k + 1][:40]!r}", "sub", quoted))
            return k + 1
        if nxt == "{":
            k = text.find("}", j)
            depth_open = text.count("${", j, k)
            while k != -1 and depth_open > 1:  # ${A:-${B}}: the outer brace
                depth_open -= 1
                k = text.find("}", k + 1)
            if k == -1:
                raise _lex_error(where, line, "${ is not closed with }")
            segs.append(Seg(text[j:k + 1], "exp", quoted))
            return k + 1
        m = _NAME.match(text, j + 1)
        if m:
            segs.append(Seg(text[j:m.end()], "exp", quoted))
            return m.end()
        if nxt and (nxt.isdigit() or nxt in "@*#?$!-"):
            segs.append(Seg(text[j:j + 2], "exp", quoted))
            return j + 2
        segs.append(Seg("$", "lit", quoted))
        return j + 1

    while i < n:
        c = text[i]
        if c == "\\" and text[i + 1:i + 2] == "\n":
            line += 1
            i += 2
            continue
        if c in " \t\r" or c == "\n" and in_array:
            end_word()
            line += c == "\n"
            i += 1
        elif c == ")" and in_array:
            end_word()
            words.append((Seg(")", "close"),))
            in_array = 0
            i += 1
        elif c == "(" and started and not segs and not in_array and _ARRAY_HEAD.fullmatch("".join(buf)):
            words.append((Seg("".join(buf), "open"),))  # NAME=( : the element words follow, then )
            buf.clear()
            started, in_array = False, line
            i += 1
        elif c == "\n":
            end_command(";")
            line += 1
            cmd_line = line
            i += 1
        elif c == "#" and not started:
            while i < n and text[i] != "\n":
                i += 1
        elif c == "'":
            k = text.find("'", i + 1)
            if k == -1:
                raise _lex_error(where, line, "a single quote is not closed; quote it as the shell would")
            flush_buf()
            segs.append(Seg(text[i + 1:k], "lit", True))
            line += text.count("\n", i, k)
            started, i = True, k + 1
        elif c == "$" and text[i + 1:i + 2] == "'":  # $'...' (ANSI-C quoting)
            k = i + 2
            while k < n and text[k] != "'":
                k += 2 if text[k] == "\\" else 1
            if k >= n:
                raise _lex_error(where, line, "a $'...' quote is not closed")
            flush_buf()
            raw = text[i + 2:k]
            segs.append(Seg(raw.encode("utf-8").decode("unicode_escape") if "\\" in raw else raw, "lit", True))
            started, i = True, k + 1
        elif c == '"':
            flush_buf()
            started = True
            opened = len(segs)
            k = i + 1
            chunk: list[str] = []
            while True:
                if k >= n:
                    raise _lex_error(where, line, "a double quote is not closed; quote it as the shell would")
                d = text[k]
                if d == '"':
                    break
                if d == "\\" and text[k + 1:k + 2] in ('$', '`', '"', "\\", "\n"):
                    if chunk:
                        segs.append(Seg("".join(chunk), "lit", True))
                        chunk.clear()
                    if text[k + 1] != "\n":
                        segs.append(Seg(text[k + 1], "lit", True))
                    else:
                        line += 1
                    k += 2
                elif d == "$":
                    if chunk:
                        segs.append(Seg("".join(chunk), "lit", True))
                        chunk.clear()
                    k = dollar(k, True)
                elif d == "`":
                    raise _lex_error(where, line, "command substitution `...` is not followed; write the value out")
                else:
                    if d == "\n":
                        line += 1
                    chunk.append(d)
                    k += 1
            if chunk or len(segs) == opened:  # "" is a word of its own ("$@" is not)
                segs.append(Seg("".join(chunk), "lit", True))
            i = k + 1
        elif c == "\\":
            flush_buf()
            if i + 1 < n:
                segs.append(Seg(text[i + 1], "lit"))
            started, i = True, i + 2
        elif c == "$":
            flush_buf()
            started = True
            i = dollar(i, False)
        elif c == "`":
            raise _lex_error(where, line, "command substitution `...` is not followed; write the value out")
        elif c in ";&|":
            op = c
            if text[i:i + 2] in ("&&", "||", ";;", "|&"):
                op = text[i:i + 2]
            if text[i:i + 2] == "&>":  # &> FILE: both streams redirected
                redirects += 1
                end_word()
                skip_next = True
                i += 3 if text[i + 2:i + 3] == ">" else 2
                continue
            end_command(op)
            i += len(op)
        elif c in "<>":
            if c == "<" and text[i + 1:i + 2] == "<":
                raise _lex_error(where, line, "a here-document or here-string (<<) is not followed; write the "
                                 "command out")
            if c == "<" and text[i + 1:i + 2] == "(" or c == ">" and text[i + 1:i + 2] == "(":
                raise _lex_error(where, line, "process substitution <(...) is not followed")
            redirects += 1
            fd = "".join(buf) if not segs else ""
            if fd.isdigit():  # 2> log: the digits are the descriptor, not a word
                buf.clear()
                started = False
            end_word()
            k = i + 1
            while k < n and text[k] in ">|&":
                k += 1
            op = text[i:k]
            if op.endswith("&"):  # 2>&1, >&-: the target is a descriptor, part of the operator
                while k < n and (text[k].isdigit() or text[k] == "-"):
                    k += 1
            else:
                skip_next = True
            i = k
        elif c in "()" and not started:
            raise _lex_error(where, line, f"{RESERVED[c]} is not followed; write its commands on their own lines")
        else:
            buf.append(c)
            started = True
            i += 1
    if in_array:
        raise _lex_error(where, in_array, "an array's ( is not closed with )")
    end_command(";")
    return commands


def literal(word: Word) -> Optional[str]:
    """The word's text when it has no expansion in it (reserved words, command names), else None."""
    if any(s.kind != "lit" and "$" in s.text for s in word):
        return None
    return "".join(s.text for s in word)


class Vars:
    """The shell's variables: their values, which are exported, and which hold what exl3tool cannot know."""

    def __init__(self, environ: Mapping[str, str], *, strict: bool = True) -> None:
        self.values: dict[str, str] = dict(environ)
        self.exported: set[str] = set(environ)
        self.unknown: dict[str, str] = {}  # name -> why its value is unknown (a $(...) assignment)
        self.strict = strict
        self.positional_note = False
        self.allexport = False
        self.exports: dict[str, tuple[str, str]] = {}  # exported by the script: name -> (value, where)
        self.unexported: dict[str, int] = {}  # assigned, not exported: name -> line
        self.arrays: dict[str, list[str]] = {}  # indexed arrays (their element 0 is also in ``values``, as $A reads)
        self.nounset = False  # set -u

    def set_array(self, name: str, elements: list[str]) -> None:
        """``NAME=(...)``: the array's elements; ``$NAME`` is element 0 (unset when the array is empty)."""
        self.arrays[name] = elements
        self.unknown.pop(name, None)
        if elements:
            self.values[name] = elements[0]
        else:
            self.values.pop(name, None)

    def set_scalar(self, name: str, value: str) -> None:
        """``NAME=VALUE``: on an array it sets element 0, as bash does."""
        self.values[name] = value
        if name in self.arrays:
            self.arrays[name][:1] = [value]

    def elements(self, name: str, where: str, line: int) -> list[str]:
        """``${NAME[@]}``: an array's elements, a plain variable as one; unset refused (as ``set -u`` does)."""
        if name in self.arrays:
            return list(self.arrays[name])
        value = _lookup(name, self, where, line, required=True)
        return [] if value is None else [value]


_ARRAY_REF = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([^\]]*)\]")


def _array_form(body: str, where: str, line: int) -> Optional[tuple[str, str]]:
    """``(NAME, "@")`` for ``NAME[@]``, ``(NAME, "#")`` for ``#NAME[@]``; refuses the forms not followed."""
    m = _ARRAY_REF.match(body.lstrip("#"))
    if m is None:
        return None
    index = m.group(2)
    rest = body.lstrip("#")[m.end():]
    if index == "*":
        raise ConfigError(f"{where} line {line}: ${{{body}}} (the array joined with IFS) is not followed; write "
                          f"\"${{{m.group(1)}[@]}}\" (each element one word)")
    if index == "@" and body.startswith("#") and not rest:
        return m.group(1), "#"
    if index == "@" and not body.startswith("#") and not rest:
        return m.group(1), "@"
    if not index.isdigit():
        raise ConfigError(f"{where} line {line}: ${{{body}}} is an array form exl3tool does not follow (it takes "
                          "\"${A[@]}\", ${A[@]}, ${#A[@]} and ${A[N]} with a number N); write the value out")
    return None


def _param(body: str, vars: Vars, where: str, line: int) -> str:
    """The value of ``${body}`` or ``$body`` (without ``$``/braces)."""
    if body in ("@", "*", "#") or body.isdigit():
        if body == "#":
            return "0"
        if body == "0":
            return "sh"
        if body in ("@", "*"):
            vars.positional_note = True
            return ""
        if vars.strict:
            raise ConfigError(f"{where} line {line}: ${body} is the script's argument {body}, which exl3tool is not "
                              f"given; write the value out or give a default (${{{body}:-VALUE}})")
        return ""
    if body in ("?", "$", "!", "-"):
        if vars.strict:
            raise ConfigError(f"{where} line {line}: ${body} is only known when the script runs; write the value out")
        return ""
    array = _array_form(body, where, line)
    if array is not None:  # ${#A[@]}; ${A[@]} where one word is wanted (split=False): its elements joined by " "
        elements = vars.elements(array[0], where, line)
        return str(len(elements)) if array[1] == "#" else " ".join(elements)
    m = re.fullmatch(r"#([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?)", body)
    if m:
        return str(len(_lookup(m.group(1), vars, where, line, required=True) or ""))
    m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?|\d+)(?:(:?)([-=+?])(.*))?", body, re.S)
    if m is None:
        raise ConfigError(f"{where} line {line}: ${{{body}}} is a form exl3tool does not follow (it takes $V, ${{V}}, "
                          "${V:-default}, ${V-default}, ${V:=default}, ${V:+alt}, ${V:?message}); write the value out")
    name, colon, op, word = m.group(1), m.group(2), m.group(3), m.group(4)
    if op is None:
        if name.isdigit():
            return _param(name, vars, where, line)
        return _lookup(name, vars, where, line, required=True) or ""
    value = _lookup(name, vars, where, line, required=False)
    unset = value is None or (colon == ":" and value == "")
    if op in "-=":
        if not unset:
            return value  # type: ignore[return-value]
        default = _expand_text(word, vars, where, line)
        if op == "=":
            if "[" in name:
                raise ConfigError(f"{where} line {line}: ${{{body}}} assigns an array element; write the value out")
            vars.set_scalar(name, default)
        return default
    if op == "+":
        return "" if unset else _expand_text(word, vars, where, line)
    if unset:  # ?
        raise ConfigError(f"{where} line {line}: ${name} is not set ({word or 'parameter null or not set'}); set it "
                          "in the launch (-e/--env, --env-file, an export) before the server line")
    return value  # type: ignore[return-value]


def _lookup(name: str, vars: Vars, where: str, line: int, *, required: bool) -> Optional[str]:
    ref = _ARRAY_REF.fullmatch(name)
    base, index = (ref.group(1), int(ref.group(2))) if ref is not None else (name, 0)
    if base in vars.arrays and base not in vars.unknown:  # the script's own array: what it holds is known
        elements = vars.arrays[base]
        if index < len(elements):
            return elements[index]
        if required and vars.strict and vars.nounset:
            raise ConfigError(f"{where} line {line}: ${{{name}}} is not set (the array {base} has no element {index}) "
                              f"and set -u stops the script there; give a default (${{{name}:-VALUE}})")
        return None
    if ref is not None:  # A[N] of a plain variable A: A itself for N = 0, unset past it
        value = _lookup(base, vars, where, line, required=required)
        if index == 0 or value is None:
            return value
        if required and vars.strict and vars.nounset:
            raise ConfigError(f"{where} line {line}: ${{{name}}} is not set ({base} is not an array) and set -u stops "
                              f"the script there; give a default (${{{name}:-VALUE}})")
        return None
    if name in vars.unknown:
        if vars.strict:
            raise ConfigError(f"{where} line {line}: ${name} is set by {vars.unknown[name]}, which exl3tool does "
                              "not run; write the value out")
        return ""
    if name in vars.values:
        return vars.values[name]
    if required and vars.strict:
        raise ConfigError(f"{where} line {line}: ${name} is not set (not in the launch's -e/--env/--env-file, the "
                          f"script's assignments, or the environment it runs in); set {name} there or give a "
                          f"default (${{{name}:-VALUE}})")
    return None


def _expand_text(text: str, vars: Vars, where: str, line: int) -> str:
    """A default's text (inside ``${V:-...}``): quotes removed, ``$`` expanded, no field splitting."""
    fields = [f for c in lex(text, where=where) for w in c.words for f in [expand(w, vars, where, line, split=False)]]
    return " ".join(f[0] for f in fields if f)


def expand(word: Word, vars: Vars, where: str, line: int, *, split: bool = True) -> list[str]:
    """The fields of ``word``: expansions substituted, unquoted ones split at blanks (``split``), quotes gone."""
    fields: list[str] = []
    cur: list[str] = []
    present = False
    for seg in word:
        if seg.kind == "sub":
            if vars.strict:
                raise ConfigError(f"{where} line {line}: {seg.text} is not followed (exl3tool does not run commands); "
                                  "write the value out")
            present = True
            continue
        if seg.kind == "lit":
            cur.append(seg.text)
            present = present or seg.quoted or bool(seg.text)
            continue
        text = seg.text
        body = text[2:-1] if text.startswith("${") else text[1:]
        array = _array_form(body, where, line)
        if array is not None and array[1] == "@" and seg.quoted and split:  # "${A[@]}": each element one word
            elements = vars.elements(array[0], where, line)
            for k, element in enumerate(elements):
                if k > 0:
                    fields.append("".join(cur))
                    cur = []
                cur.append(element)
                present = True
            continue
        value = _param(body, vars, where, line)  # unquoted ${A[@]}: the elements joined by " ", then split
        if body == "@":  # "$@" with no arguments: no word at all, quoted or not
            continue
        if seg.quoted or not split:
            cur.append(value)
            present = True
            continue
        for k, part in enumerate(re.split(f"[{_IFS}]+", value) if value else []):
            if k > 0 and (cur or present):  # a run of blanks ends the field
                fields.append("".join(cur))
                cur, present = [], False
            if part:
                cur.append(part)
                present = True
    if cur or present:
        fields.append("".join(cur))
    return fields


@dataclass
class ScriptResult:
    """The server's command in a script, with what the script set up for it."""

    words: list[str]  # the server's command, expanded
    line: int
    prefix_env: list[tuple[str, str]]  # NAME=VALUE words before the command (its own environment)
    exports: dict[str, tuple[str, str]]  # exported variables the script set: name -> (value, where)
    unexported: dict[str, int]  # variables assigned but not exported: name -> line
    workdir: Optional[str]  # after the script's cd's (None: unchanged)
    environ: dict[str, str]  # the environment the command starts with (exports and its NAME=VALUE words)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _set_options(args: list[str], vars: Vars) -> bool:
    """``set -a`` / ``set -o allexport`` on (True) or off; None when unchanged. ``set -u`` / ``-o nounset`` is
    kept in ``vars.nounset`` (an array's missing element then stops bash, rather than being empty)."""
    allexport = None
    it = iter(args)
    for a in it:
        if not a.startswith(("-", "+")) or not a[1:].isalpha():
            continue
        on = a[0] == "-"
        if "a" in a[1:]:
            allexport = on
        if "u" in a[1:]:
            vars.nounset = on
        if "o" in a[1:]:
            opt = next(it, "")
            if opt == "allexport":
                allexport = on
            elif opt == "nounset":
                vars.nounset = on
    return allexport  # type: ignore[return-value]


_KEYWORDS = frozenset({"if", "then", "elif", "else", "fi"})
_UNARY = frozenset({"-n", "-z", "-f", "-d", "-e"})
_BINARY = frozenset({"=", "==", "!=", "-eq", "-ne", "-lt", "-le", "-gt", "-ge"})
_NUMERIC = {"-eq": lambda a, b: a == b, "-ne": lambda a, b: a != b, "-lt": lambda a, b: a < b,
            "-le": lambda a, b: a <= b, "-gt": lambda a, b: a > b, "-ge": lambda a, b: a >= b}
# commands that change nothing the server sees, whether they run or not (a test's unknown result may guard them)
_INERT = frozenset({"ln", "rm", "mkdir", "echo", "printf", "true", "false", ":", "sleep", "ulimit", "trap",
                    "nvidia-smi", "umask", "exit", "wait", "[", "[[", "test"})
_TEST_HELP = ("exl3tool evaluates [ ], [[ ]] and test with -n, -z, =, ==, !=, -eq, -ne, -lt, -le, -gt, -ge, ! and "
              "-f/-d/-e of a file it can read, joined by && and ||")


@dataclass(frozen=True)
class _If:
    """``if LIST; then ...; [elif LIST; then ...;] [else ...;] fi``: each branch's condition and commands."""

    branches: tuple[tuple[tuple[RawCommand, ...], tuple["_If | RawCommand", ...]], ...]
    otherwise: tuple["_If | RawCommand", ...]
    line: int
    after: str


def _bare(word: Word) -> Optional[str]:
    """The word's text when it is one unquoted literal (a reserved word or an operator is only one unquoted)."""
    if len(word) == 1 and word[0].kind in ("lit", "op") and not word[0].quoted:
        return word[0].text
    return None


def _tokens(cmds: list[RawCommand], where: str) -> list[RawCommand]:
    """The commands with ``if``/``then``/``elif``/``else``/``fi`` each a command of its own (``then A=1`` is
    ``then`` and ``A=1``) and a ``[[ a && b ]]`` that the lexer split at ``&&``/``||`` joined again."""
    out: list[RawCommand] = []
    i = 0
    while i < len(cmds):
        cmd = cmds[i]
        i += 1
        words, after = cmd.words, cmd.after
        while words and _bare(words[0]) in _KEYWORDS:
            out.append(RawCommand(words[:1], cmd.line, after))
            words, after = words[1:], ";"
        if not words:
            continue
        redirects = cmd.redirects
        skip = 1 if _bare(words[0]) == "!" else 0
        if len(words) > skip and _bare(words[skip]) == "[[":
            while _bare(words[-1]) != "]]":
                if i >= len(cmds) or cmds[i].after not in ("&&", "||"):
                    raise ConfigError(f"{where} line {cmd.line}: a [[ ... ]] test is not closed with ]] on its "
                                      f"command; {_TEST_HELP}")
                nxt = cmds[i]
                i += 1
                words = (*words, (Seg(nxt.after, "op"),), *nxt.words)
                redirects += nxt.redirects
        out.append(RawCommand(words, cmd.line, after, redirects))
    return out


def _tree(tokens: list[RawCommand], where: str) -> list["_If | RawCommand"]:
    """The script's commands with each ``if ... fi`` one node holding its conditions and branches."""
    pos = 0

    def kw(k: int) -> Optional[str]:
        words = tokens[k].words
        return _bare(words[0]) if len(words) == 1 and _bare(words[0]) in _KEYWORDS else None

    def block(stops: frozenset[str]) -> list["_If | RawCommand"]:
        nonlocal pos
        nodes: list[_If | RawCommand] = []
        while pos < len(tokens):
            k = kw(pos)
            if k in stops:
                return nodes
            if k == "if":
                nodes.append(parse_if())
                continue
            if k is not None:
                raise ConfigError(f"{where} line {tokens[pos].line}: {k!r} outside an if ... fi")
            nodes.append(tokens[pos])
            pos += 1
        return nodes

    def parse_if() -> _If:
        nonlocal pos
        start = tokens[pos]
        pos += 1
        branches: list[tuple[tuple[RawCommand, ...], tuple[_If | RawCommand, ...]]] = []
        otherwise: tuple[_If | RawCommand, ...] = ()
        while True:
            cond: list[RawCommand] = []
            while pos < len(tokens) and kw(pos) != "then":
                if kw(pos) is not None:
                    raise ConfigError(f"{where} line {tokens[pos].line}: {kw(pos)!r} in the condition of the if on "
                                      f"line {start.line}; {_TEST_HELP}")
                cond.append(tokens[pos])
                pos += 1
            if pos >= len(tokens) or not cond:
                raise ConfigError(f"{where} line {start.line}: the if has no condition and then; write it as "
                                  "if TEST; then ...; fi")
            pos += 1
            branches.append((tuple(cond), tuple(block(frozenset({"elif", "else", "fi"})))))
            k = kw(pos) if pos < len(tokens) else None
            pos += 1
            if k == "elif":
                continue
            if k == "else":
                otherwise = tuple(block(frozenset({"elif", "else", "fi"})))
                k = kw(pos) if pos < len(tokens) else None
                pos += 1
            if k != "fi":
                raise ConfigError(f"{where} line {start.line}: the if is not closed with fi")
            return _If(tuple(branches), otherwise, start.line, start.after)

    return block(frozenset())


def _integer(text: str, op: str, arithmetic: bool, where: str, line: int) -> int:
    """An operand of ``-eq`` etc.: decimal for ``[``; in ``[[ ]]`` (arithmetic) only a plain decimal number."""
    pattern = r"[ \t\n]*[+-]?(0|[1-9][0-9]*)[ \t\n]*" if arithmetic else r"[ \t\n]*[+-]?[0-9]+[ \t\n]*"
    if re.fullmatch(pattern, text) is None:
        raise ConfigError(f"{where} line {line}: {op} compares integers and {text!r} is not one exl3tool reads "
                          "(a decimal number); write the value out")
    return int(text)


class _Tester:
    """Evaluates one test command (``[ ]``, ``[[ ]]``, ``test``, ``true``, ``false``) with the variables known
    at that point; what cannot be known (a file in the server's filesystem, a command's result) is refused."""

    def __init__(self, vars: Vars, where: str, line: int, cwd: Optional[str],
                 read_file: Optional[Callable[[str], Optional[str]]]) -> None:
        self.vars, self.where, self.line, self.cwd, self.read_file = vars, where, line, cwd, read_file

    def refuse(self, what: str) -> ConfigError:
        return ConfigError(f"{self.where} line {self.line}: {what}")

    def command(self, cmd: RawCommand) -> bool:
        words = list(cmd.words)
        negate = False
        while words and _bare(words[0]) == "!":
            negate, words = not negate, words[1:]
        name = literal(words[0]) if words else None
        if cmd.redirects and name in ("[", "[[", "test"):
            raise self.refuse("a redirection in a test (in [[ ]], < and > compare strings) is not followed; "
                              + _TEST_HELP)
        if name in ("true", ":", "false"):
            result = name != "false"
        elif name == "[[":
            if len(words) < 3 or _bare(words[-1]) != "]]":
                raise self.refuse(f"a [[ ... ]] test is not closed with ]]; {_TEST_HELP}")
            result = self.double(words[1:-1])
        elif name in ("[", "test"):
            args = [f for w in words[1:] for f in expand(w, self.vars, self.where, self.line)]
            if name == "[":
                if not args or args[-1] != "]":
                    raise self.refuse("a [ test is not closed with ]")
                args = args[:-1]
            result = self.single(args)
        else:
            raise self.refuse(f"the condition {' '.join(filter(None, map(literal, words)))!r} is only known when "
                              f"the script runs; {_TEST_HELP}")
        return result != negate

    def unary(self, op: str, operand: str) -> bool:
        if op == "-n":
            return operand != ""
        if op == "-z":
            return operand == ""
        if operand == "":
            return False  # no file is named ""
        path = operand if posixpath.isabs(operand) else (posixpath.join(self.cwd, operand) if self.cwd else None)
        text = self.read_file(path) if self.read_file is not None and path is not None else None
        if text is None:
            raise self.refuse(f"[ {op} {operand} ] asks about a file in the server's filesystem, which exl3tool "
                              "cannot see from here; write the server's command out for the branch it takes")
        return op != "-d"  # a file exl3tool reads is there, and not a directory

    def binary(self, left: str, op: str, right: str, arithmetic: bool) -> bool:
        if op in ("=", "=="):
            return left == right
        if op == "!=":
            return left != right
        return _NUMERIC[op](_integer(left, op, arithmetic, self.where, self.line),
                            _integer(right, op, arithmetic, self.where, self.line))

    def single(self, args: list[str]) -> bool:
        """``[``/``test`` as POSIX decides by the number of arguments."""
        n = len(args)
        if n == 0:
            return False
        if n == 1:
            return args[0] != ""
        if n == 2 and args[0] == "!":
            return args[1] == ""
        if n == 2 and args[0] in _UNARY:
            return self.unary(args[0], args[1])
        if n == 3 and args[1] in _BINARY:
            return self.binary(args[0], args[1], args[2], False)
        if n in (3, 4) and args[0] == "!":
            return not self.single(args[1:])
        raise self.refuse(f"[ {' '.join(args)} ] is a test exl3tool does not follow; {_TEST_HELP}")

    def double(self, words: list[Word]) -> bool:
        """``[[ ... ]]``: ``!``, ``&&``, ``||`` between primaries, each expanded only when it is needed."""
        pos = 0

        def value(word: Word) -> str:
            return "".join(expand(word, self.vars, self.where, self.line, split=False))

        def pattern(word: Word) -> str:  # the right of == in [[ ]]: a glob pattern where unquoted
            for seg in word:
                if not seg.quoted and any(ch in (seg.text if seg.kind == "lit" else value((seg,))) for ch in "*?["):
                    raise self.refuse("a [[ ... == PATTERN ]] glob match is not followed; quote the right side "
                                      "for a plain comparison")
            return value(word)

        def primary() -> Callable[[], bool]:
            nonlocal pos
            if pos >= len(words) or words[pos][0].kind == "op":
                raise self.refuse(f"a [[ ... ]] test is missing an operand; {_TEST_HELP}")
            w = words[pos]
            if _bare(w) == "!":
                pos += 1
                inner = primary()
                return lambda: not inner()
            nxt = _bare(words[pos + 1]) if pos + 1 < len(words) and words[pos + 1][0].kind != "op" else None
            if _bare(w) in _UNARY and pos + 1 < len(words) and words[pos + 1][0].kind != "op":
                op, arg = _bare(w), words[pos + 1]
                pos += 2
                return lambda: self.unary(op, value(arg))  # type: ignore[arg-type]
            if nxt is not None and nxt not in _BINARY and nxt.startswith(("-", "=", "!", "<", ">")):
                raise self.refuse(f"[[ ... {nxt} ... ]] is not followed; {_TEST_HELP}")
            if nxt in _BINARY and pos + 2 < len(words):
                left, right = w, words[pos + 2]
                pos += 3
                if nxt in ("=", "==", "!="):
                    return lambda: (value(left) == pattern(right)) == (nxt != "!=")
                return lambda: self.binary(value(left), nxt, value(right), True)  # type: ignore[arg-type]
            pos += 1
            return lambda: value(w) != ""

        def joined(op: str, part: Callable[[], Callable[[], bool]]) -> Callable[[], bool]:
            nonlocal pos
            terms = [part()]
            while pos < len(words) and words[pos][0].kind == "op" and words[pos][0].text == op:
                pos += 1
                terms.append(part())
            if op == "&&":
                return lambda: all(t() for t in terms)
            return lambda: any(t() for t in terms)

        expr = joined("||", lambda: joined("&&", primary))
        if pos != len(words):
            raise self.refuse(f"a [[ ... ]] test exl3tool does not follow; {_TEST_HELP}")
        return expr()


def _head_name(node: "_If | RawCommand") -> Optional[str]:
    if isinstance(node, _If):
        return None
    words = [w for w in node.words if _bare(w) != "!"]
    return literal(words[0]) if words else None


def run_script(text: str, *, environ: Mapping[str, str], is_server: Callable[[list[str], Optional[str]], bool],
               where: str,
               workdir: Optional[str] = None, read_file: Optional[Callable[[str], Optional[str]]] = None,
               strict: bool = True, _vars: Optional[Vars] = None, _depth: int = 0) -> Optional[ScriptResult]:
    """Walk ``text`` as the shell runs it, command by command, to the first command ``is_server`` accepts.

    ``environ`` is what the shell starts with (exported); ``is_server(words, workdir)`` says whether a command
    starts the server (run from ``workdir``, after the script's ``cd``s); ``read_file`` reads a ``source``d file,
    or a file a test asks about (None when it cannot be read). ``strict`` False (detection only): unset variables
    expand to nothing instead of being refused. An ``if``'s conditions are evaluated and only the branch taken is
    walked; ``A && B`` / ``A || B`` run B by A's status when A is a test, and as before (B runs) when A is another
    command. Returns None when no command starts a server.
    """
    vars = _vars or Vars(environ, strict=strict)
    result_exports, unexported = vars.exports, vars.unexported
    ignored: list[str] = []
    notes: list[str] = []
    cwd = workdir
    status: Optional[bool] = True  # the last command's exit status; None: only known when the script runs
    status_why = ""
    assumed = False  # the status is a command's assumed success (not a test's result)

    def assign(name: str, value: str, line: int, export: bool, how: str) -> None:
        vars.set_scalar(name, value)
        vars.unknown.pop(name, None)
        if export or vars.allexport or name in vars.exported:
            vars.exported.add(name)
            result_exports[name] = (value, f"{how} in {where} line {line}")
            unexported.pop(name, None)
        else:
            unexported[name] = line

    def array_words(words: tuple[Word, ...], k: int, line: int) -> tuple[list[str], int]:
        """The elements of the array whose ``NAME=(`` is ``words[k]``, and the index after its ``)``."""
        elements: list[str] = []
        j = k + 1
        while words[j][0].kind != "close":
            text_j = literal(words[j]) or ""
            if re.match(r"\[[^\]]*\]\+?=", text_j):
                raise ConfigError(f"{where} line {line}: an array element with its index ({text_j}) is not "
                                  "followed; list the elements in order")
            elements += expand(words[j], vars, where, line)
            j += 1
        return elements, j + 1

    def set_array(head: str, elements: list[str], line: int) -> None:
        name, append = head.rstrip("+="), head.endswith("+=")
        if append:
            before = vars.arrays.get(name) or ([vars.values[name]] if name in vars.values else [])
            elements = [*before, *elements]
        vars.set_array(name, elements)
        unexported.pop(name, None)

    def first_fields(words: tuple[Word, ...], k: int, line: int) -> tuple[int, list[str]]:
        """From ``words[k]``, the first word that expands to something (``"${EMPTY[@]}" vllm``: ``vllm``)."""
        while k < len(words):
            fields = expand(words[k], vars, where, line)
            if fields:
                return k, fields
            k += 1
        return k, []

    def simple(cmd: RawCommand) -> "ScriptResult | str | None":
        """Run one simple command: its effect on the variables, the directory, or the server's command."""
        nonlocal cwd, status, status_why, assumed
        line = cmd.line
        status, assumed = True, False
        first = literal(cmd.words[0])
        if first in ("[", "[[", "test", "!", "true", "false", ":"):
            try:
                status = _Tester(vars, where, line, cwd, read_file).command(cmd)
            except ConfigError as e:
                status, status_why = None, str(e).split(": ", 1)[-1]
            ignored.append(f"line {line}: {first} (a test)")
            return None
        if first is not None and first in RESERVED or (first or "").endswith("()") or (
                len(cmd.words) > 1 and literal(cmd.words[1]) in ("()", "(")):
            what = RESERVED.get(first or "") if first in RESERVED else "a function definition"
            if what is None:  # trap, wait: no effect on the server's command
                ignored.append(f"line {line}: {first}")
                return None
            raise ConfigError(f"{where} line {line}: {what} is not followed (exl3tool reads scripts of commands, "
                              "variables, arrays and if ... fi); write the server's command and its variables out "
                              "without it")
        if _ELEMENT_ASSIGN.match(first or ""):
            raise ConfigError(f"{where} line {line}: an array element assignment {first.split('=')[0]}=... is not "
                              "followed; assign the whole array: NAME=(...)")  # type: ignore[union-attr]
        # leading assignments: NAME=VALUE words, NAME=(...) arrays
        assigns: list[tuple[str, str]] = []
        arrays = 0
        k = 0
        while k < len(cmd.words):
            w = cmd.words[k]
            head = w[0] if w else None
            if head is not None and head.kind == "open":
                elements, k = array_words(cmd.words, k, line)
                set_array(head.text, elements, line)
                arrays += 1
                continue
            m = _ASSIGN.match(head.text) if head is not None and head.kind == "exp" else None
            if m is None:
                m0 = _ASSIGN.match(head.text) if head is not None and head.kind == "lit" and not head.quoted else None
                if m0 is None:
                    break
                m = m0
            rest = (Seg(head.text[m.end():], head.kind, head.quoted), *w[1:])  # type: ignore[union-attr]
            try:
                value = "".join(expand(rest, vars, where, line, split=False))
            except ConfigError:
                if any(s.kind == "sub" for s in rest) and k + 1 == len(cmd.words):
                    vars.unknown[m.group(1)] = next(s.text for s in rest if s.kind == "sub")
                    vars.values.pop(m.group(1), None)
                    k += 1
                    assigns.append((m.group(1), "\0"))
                    continue
                raise
            if m.group(2):
                value = vars.values.get(m.group(1), "") + value
            assigns.append((m.group(1), value))
            k += 1
        if k == len(cmd.words):  # only assignments: shell variables
            for name, value in assigns:
                if value != "\0":
                    assign(name, value, line, False, f"{name}=...")
            return None
        if arrays:
            raise ConfigError(f"{where} line {line}: an array assignment before a command is not followed; assign "
                              "it on its own line")
        k, head_words = first_fields(cmd.words, k, line)
        if not head_words:
            return None
        name = head_words[0]
        if name in ("exec", "command", "builtin", "nohup", "time") and k + 1 < len(cmd.words) or name == "exec":
            k += 1
            while k < len(cmd.words) and (literal(cmd.words[k]) or "").startswith("-"):
                k += 2 if literal(cmd.words[k]) == "-a" else 1
            k, head_words = first_fields(cmd.words, k, line)
            if not head_words:
                return None  # exec with redirections only
            name = head_words[0]
        if name in ("export", "declare", "typeset", "readonly", "local"):
            flags = ""
            j = k + 1
            while j < len(cmd.words):
                w = cmd.words[j]
                lit = literal(w)
                if w[0].kind == "open":
                    if "A" in flags:
                        raise ConfigError(f"{where} line {line}: an associative array ({name} -A) is not followed; "
                                          "write the server's words out")
                    elements, j = array_words(cmd.words, j, line)
                    set_array(w[0].text, elements, line)
                    continue
                j += 1
                if lit is not None and lit.startswith("-"):
                    flags += lit[1:]
                    if "A" in flags:
                        raise ConfigError(f"{where} line {line}: an associative array ({name} -A) is not followed; "
                                          "write the server's words out")
                    continue
                text_w = "".join(expand(w, vars, where, line, split=False))
                nm, eq, value = text_w.partition("=")
                if not _NAME.fullmatch(nm):
                    raise ConfigError(f"{where} line {line}: {name} {text_w!r}: not a variable name")
                exported = name == "export" or "x" in flags
                if eq:
                    assign(nm, value, line, exported, f"{name} {nm}=...")
                elif "a" in flags and nm not in vars.arrays:
                    vars.set_array(nm, [vars.values[nm]] if nm in vars.values else [])
                elif exported and nm in vars.values:
                    assign(nm, vars.values[nm], line, True, f"{name} {nm}")
                elif exported:
                    vars.exported.add(nm)
            return None
        if name == "unset":
            for w in cmd.words[k + 1:]:
                lit = literal(w) or ""
                if not lit.startswith("-"):
                    vars.values.pop(lit, None)
                    vars.arrays.pop(lit, None)
                    vars.exported.discard(lit)
                    result_exports.pop(lit, None)
            return None
        if name == "set":
            args = [a for w in cmd.words[k + 1:] for a in expand(w, vars, where, line)]
            changed = _set_options(args, vars)
            if changed is not None:
                vars.allexport = changed
            return None
        if name == "cd":
            args = [a for w in cmd.words[k + 1:] for a in expand(w, vars, where, line)]
            target = next((a for a in args if not a.startswith("-")), vars.values.get("HOME"))
            if target is None:
                raise ConfigError(f"{where} line {line}: cd without a directory goes to HOME, which is not known")
            base = cwd or "/"
            cwd = posixpath.normpath(posixpath.join(base, target)) if cwd or posixpath.isabs(target) else target
            return None
        if name in ("source", "."):
            args = [a for w in cmd.words[k + 1:] for a in expand(w, vars, where, line)]
            if not args:
                raise ConfigError(f"{where} line {line}: {name} without a file")
            path = args[0] if posixpath.isabs(args[0]) or cwd is None else posixpath.join(cwd, args[0])
            body = read_file(path) if read_file is not None else None
            if body is None:
                raise ConfigError(f"{where} line {line}: {name} {args[0]}: exl3tool cannot read that file, so what it "
                                  "sets is unknown; put its variables in the launch (or an --env-file)")
            if _depth > 8:
                raise ConfigError(f"{where} line {line}: {name} {args[0]}: sourced files nest too deep")
            inner = run_script(body, environ={}, is_server=is_server, where=path, workdir=cwd, read_file=read_file,
                               strict=strict, _vars=vars, _depth=_depth + 1)
            return inner
        strict_was, vars.strict = vars.strict, False  # is it the server? (its words are refused only if it is)
        try:
            words = [head_words[0], *head_words[1:],
                     *(f for w in cmd.words[k + 1:] for f in expand(w, vars, where, line))]
        finally:
            vars.strict = strict_was
        if is_server(words, cwd):
            words = [*head_words, *(f for w in cmd.words[k + 1:] for f in expand(w, vars, where, line))]
            env_here = [(a, v) for a, v in assigns if v != "\0"]
            if vars.positional_note:
                notes.append(f"{where}: \"$@\"/$* taken as no arguments (the script is read as run without any)")
            environ_now = {n: vars.values[n] for n in vars.exported if n in vars.values}
            environ_now.update(env_here)
            return ScriptResult(words, line, env_here, dict(result_exports), dict(unexported), cwd, environ_now,
                                ignored, notes)
        if name == "exit":
            return "exit"
        ignored.append(f"line {line}: {name} (not the server)")
        assumed = True  # another command's status: assumed success, as before
        return None

    def walk(nodes: "list[_If | RawCommand] | tuple[_If | RawCommand, ...]") -> "ScriptResult | str | None":
        nonlocal status, assumed
        for node in nodes:
            if node.after in ("&&", "||"):
                if status is None or assumed:
                    if _head_name(node) in _INERT:
                        ignored.append(f"line {node.line}: {_head_name(node)} (after {node.after})")
                        continue
                    if status is None:
                        raise ConfigError(f"{where} line {node.line}: this command runs by the result of the test "
                                          f"before {node.after}, which exl3tool cannot know: {status_why}")
                elif status != (node.after == "&&"):
                    continue  # not run; the status stays
            if isinstance(node, _If):
                status, assumed = True, False  # an if whose conditions are all false
                for cond, body in [*node.branches, ((), node.otherwise)]:
                    if cond and not _condition(cond):
                        continue
                    out = walk(body)
                    if out is not None:
                        return out
                    break
                continue
            out = simple(node)
            if out is not None:
                return out
        return None

    def _condition(cond: tuple[RawCommand, ...]) -> bool:
        """An if's condition: its tests joined by && and || (and ;), short-circuit as the shell runs them."""
        result = True
        for c in cond:
            if c.after == "&&" and not result or c.after == "||" and result:
                continue
            result = _Tester(vars, where, c.line, cwd, read_file).command(c)
        return result

    out = walk(_tree(_tokens(lex(text, where=where), where), where))
    return out if isinstance(out, ScriptResult) else None
