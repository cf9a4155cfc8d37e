"""Shell text read as ``sh``/``bash`` read it, for the straight-line scripts that start a server.

``lex`` splits text into simple commands whose words keep their quoting (single quotes and ``\\`` escapes are
literal; unquoted and double-quoted text expands); ``expand`` gives a word's fields with ``$V``, ``${V}``,
``${V:-default}``, ``${V-default}``, ``${V:=default}``, ``${V:+alt}``, ``${V:?msg}`` and field splitting of
unquoted expansions. ``run_script`` walks a straight-line script: assignments, ``export``, ``unset``, ``set -a``,
``cd``, ``exec``, ``source`` of a file it can read, until the command ``is_server`` accepts. What it cannot
follow (``if``/``for``/``while``/``case``, functions, subshells, here-documents, ``eval``, and command or
arithmetic substitution whose value is needed) is refused naming the line and the construct (ConfigError, exit 2);
an unset variable without a default is refused naming it, never guessed.
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
RESERVED = {"if": "a conditional (if ... fi)", "then": "a conditional (if ... fi)", "elif": "a conditional",
            "else": "a conditional", "fi": "a conditional", "for": "a loop (for ... done)",
            "while": "a loop (while ... done)", "until": "a loop (until ... done)", "do": "a loop", "done": "a loop",
            "case": "a case statement", "esac": "a case statement", "select": "a select loop",
            "function": "a function definition", "{": "a command group { ... }", "}": "a command group { ... }",
            "[[": "a [[ ... ]] test", "(": "a subshell ( ... )", ")": "a subshell ( ... )",
            "eval": "eval (its text is only known when it runs)", "trap": None, "wait": None}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_ARRAY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\+?=\(")
_IFS = " \t\n"


@dataclass(frozen=True)
class Seg:
    """A piece of a word: ``kind`` "lit" (taken as is), "exp" (expands), "sub" (a command or arithmetic
    substitution, which exl3tool cannot run); ``quoted`` inside double quotes (no field splitting)."""

    text: str
    kind: str
    quoted: bool = False


Word = tuple[Seg, ...]


@dataclass(frozen=True)
class RawCommand:
    """One simple command as written: its words, its first line, and the operator before it (";", "&&", "||")."""

    words: tuple[Word, ...]
    line: int
    after: str = ";"


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
        nonlocal after, cmd_line
        end_word()
        if words:
            commands.append(RawCommand(tuple(words), cmd_line, after))
            words.clear()
        after = op
        cmd_line = line

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
        if c in " \t\r":
            end_word()
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
    m = re.fullmatch(r"#([A-Za-z_][A-Za-z0-9_]*)", body)
    if m:
        return str(len(_lookup(m.group(1), vars, where, line, required=True) or ""))
    m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|\d+)(?:(:?)([-=+?])(.*))?", body, re.S)
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
            vars.values[name] = default
        return default
    if op == "+":
        return "" if unset else _expand_text(word, vars, where, line)
    if unset:  # ?
        raise ConfigError(f"{where} line {line}: ${name} is not set ({word or 'parameter null or not set'}); set it "
                          "in the launch (-e/--env, --env-file, an export) before the server line")
    return value  # type: ignore[return-value]


def _lookup(name: str, vars: Vars, where: str, line: int, *, required: bool) -> Optional[str]:
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
        value = _param(body, vars, where, line)
        if body == "@":  # "$@" with no arguments: no word at all, quoted or not
            continue
        if seg.quoted or not split:
            cur.append(value)
            present = True
            continue
        parts = re.split(f"[{_IFS}]+", value)
        if not value.strip(_IFS):
            continue
        if value[0] in _IFS and (cur or present):
            fields.append("".join(cur))
            cur, present = [], False
            parts = parts[1:] if parts and parts[0] == "" else parts
        elif parts and parts[0] == "":
            parts = parts[1:]
        trailing = bool(parts) and parts[-1] == ""
        parts = [p for p in parts if p != ""]
        for k, p in enumerate(parts):
            if k > 0:
                fields.append("".join(cur))
                cur = []
            cur.append(p)
            present = True
        if trailing:
            fields.append("".join(cur))
            cur, present = [], False
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
    """``set -a`` / ``set -o allexport`` on (True) or off; None when unchanged."""
    allexport = None
    it = iter(args)
    for a in it:
        if a in ("-o", "+o"):
            opt = next(it, "")
            if opt == "allexport":
                allexport = a == "-o"
        elif a.startswith(("-", "+")) and "a" in a[1:] and a[1:].isalpha():
            allexport = a[0] == "-"
    return allexport  # type: ignore[return-value]


def run_script(text: str, *, environ: Mapping[str, str], is_server: Callable[[list[str], Optional[str]], bool],
               where: str,
               workdir: Optional[str] = None, read_file: Optional[Callable[[str], Optional[str]]] = None,
               strict: bool = True, _vars: Optional[Vars] = None, _depth: int = 0) -> Optional[ScriptResult]:
    """Walk ``text`` as the shell runs it, line by line, to the first command ``is_server`` accepts.

    ``environ`` is what the shell starts with (exported); ``is_server(words, workdir)`` says whether a command
    starts the server (run from ``workdir``, after the script's ``cd``s); ``read_file`` reads a ``source``d file
    (None when it cannot be read). ``strict`` False (detection only): unset variables expand to nothing instead of being refused.
    Returns None when no command starts a server.
    """
    vars = _vars or Vars(environ, strict=strict)
    result_exports, unexported = vars.exports, vars.unexported
    ignored: list[str] = []
    notes: list[str] = []
    cwd = workdir

    def assign(name: str, value: str, line: int, export: bool, how: str) -> None:
        vars.values[name] = value
        vars.unknown.pop(name, None)
        if export or vars.allexport or name in vars.exported:
            vars.exported.add(name)
            result_exports[name] = (value, f"{how} in {where} line {line}")
            unexported.pop(name, None)
        else:
            unexported[name] = line

    for cmd in lex(text, where=where):
        line = cmd.line
        first = literal(cmd.words[0])
        head0 = cmd.words[0][0] if cmd.words[0] else None
        array = _ARRAY.match(head0.text) if head0 is not None and head0.kind == "lit" and not head0.quoted else None
        if array:  # NAME=(...): bash's array, not a NAME=VALUE word (nor a function definition)
            raise ConfigError(f"{where} line {line}: an array assignment {array.group(1)}=(...) is not followed "
                              "(exl3tool reads straight-line scripts with plain variables); write the server's "
                              "words out, or a plain variable")
        if first is not None and first in RESERVED or (first or "").endswith("()") or (
                len(cmd.words) > 1 and literal(cmd.words[1]) in ("()", "(")):
            what = RESERVED.get(first or "") if first in RESERVED else "a function definition"
            if what is None:  # trap, wait: no effect on the server's command
                ignored.append(f"line {line}: {first}")
                continue
            raise ConfigError(f"{where} line {line}: {what} is not followed (exl3tool reads straight-line scripts); "
                              "write the server's command and its variables out without it")
        # leading assignments: NAME=VALUE words
        assigns: list[tuple[str, str]] = []
        k = 0
        while k < len(cmd.words):
            w = cmd.words[k]
            head = w[0] if w else None
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
            continue
        head_words = expand(cmd.words[k], vars, where, line)
        if not head_words:
            continue
        name = head_words[0]
        if name in ("exec", "command", "builtin", "nohup", "time") and k + 1 < len(cmd.words) or name == "exec":
            k += 1
            while k < len(cmd.words) and (literal(cmd.words[k]) or "").startswith("-"):
                k += 2 if literal(cmd.words[k]) == "-a" else 1
            if k >= len(cmd.words):
                continue  # exec with redirections only
            head_words = expand(cmd.words[k], vars, where, line)
            name = head_words[0] if head_words else ""
        if name in ("export", "declare", "typeset", "readonly", "local"):
            flags = ""
            for w in cmd.words[k + 1:]:
                lit = literal(w)
                if lit is not None and lit.startswith("-"):
                    flags += lit[1:]
                    continue
                text_w = "".join(expand(w, vars, where, line, split=False))
                nm, eq, value = text_w.partition("=")
                if not _NAME.fullmatch(nm):
                    raise ConfigError(f"{where} line {line}: {name} {text_w!r}: not a variable name")
                exported = name == "export" or "x" in flags
                if eq:
                    assign(nm, value, line, exported, f"{name} {nm}=...")
                elif exported and nm in vars.values:
                    assign(nm, vars.values[nm], line, True, f"{name} {nm}")
                elif exported:
                    vars.exported.add(nm)
            continue
        if name == "unset":
            for w in cmd.words[k + 1:]:
                lit = literal(w) or ""
                if not lit.startswith("-"):
                    vars.values.pop(lit, None)
                    vars.exported.discard(lit)
                    result_exports.pop(lit, None)
            continue
        if name == "set":
            args = [a for w in cmd.words[k + 1:] for a in expand(w, vars, where, line)]
            changed = _set_options(args, vars)
            if changed is not None:
                vars.allexport = changed
            continue
        if name == "cd":
            args = [a for w in cmd.words[k + 1:] for a in expand(w, vars, where, line)]
            target = next((a for a in args if not a.startswith("-")), vars.values.get("HOME"))
            if target is None:
                raise ConfigError(f"{where} line {line}: cd without a directory goes to HOME, which is not known")
            base = cwd or "/"
            cwd = posixpath.normpath(posixpath.join(base, target)) if cwd or posixpath.isabs(target) else target
            continue
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
            if inner is not None:
                return inner
            continue
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
        if name == "exit" and cmd.after not in ("&&", "||"):
            return None
        ignored.append(f"line {line}: {name} (not the server)")
    return None
