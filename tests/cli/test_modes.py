"""Options a mode does not read are refused, never ignored (issue 49, goal 5).

Before: `cache import --bits 4` without `--against` imported every entry whatever its bits, `verify --against SRC
--exact` ran without the exact check, `cache check --nodes F --launch ...` never read the launch, and `cache warm
--dry-run --trust-encoder-identity` (or `--lock-timeout`, `--progress`, ...) planned as if it were not given, each
exit 0.
Each command with modes has its options walked: every option is either read in the mode (``READS``, written here
from what each mode's code reads) or refused there (the rules declared on the command, ``command.Rule``), never neither; each refusal is one usage
error (exit 2) naming the option and the mode, and a command line without it is not refused for that reason.
"""

from __future__ import annotations

import re

import pytest
import typer

from exl3tool.cli import _register, app

from helpers import run

_register()


def _modes() -> dict[tuple[str, str], tuple[str, ...]]:
    """Every command's modes, from the rules declared on it (``command.Rule``): (command, mode) -> the options
    refused there."""
    found: dict[tuple[str, str], tuple[str, ...]] = {}

    def walk(group, path):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, [*path, name])
                continue

            def spell(option, cmd=cmd):
                return max(next(p for p in cmd.params if p.name == option).opts, key=len)

            for rule in getattr(cmd.callback, "rules", ()):
                found[(" ".join([*path, name]), rule.mode(spell))] = rule.refused(tuple(p.name for p in cmd.params))

    walk(typer.main.get_command(app), [])
    return found


MODE_RULES = _modes()

_COMMON = {"json", "quiet"}
_LAUNCH = {"launch", "pid", "env_file", "launch_file", "compose", "service", "image", "image_inspect", "image_root",
           "server_release", "image_archive"}
# what a warm's dry run reads of the options cache warm and encode share: model, plan, encoder, cache, launch
_WARM_PLAN = {"model", "revision", "server_path", "bits", "layers", "exclude", "shared_experts", "quantization_config",
              "dtype", "dry_run", "encoder_root", "encoder_revision", "encoder_source", "cache_dir", "device",
              "file_mode", *_LAUNCH}
# what each mode reads (the rest of the command's options must be refused there)
READS: dict[tuple[str, str], set[str]] = {
    ("cache import", "without --against"): {"bundle", "cache_dir", "file_mode", "against", *_LAUNCH, *_COMMON},
    ("cache import", "with --cache-dir and without --against"): {"bundle", "cache_dir", "file_mode", "against",
                                                                 "exact", "revision", "bits", "layers", "exclude",
                                                                 "shared_experts", "quantization_config", "dtype",
                                                                 "device", "encoder_root", "encoder_revision",
                                                                 "encoder_source", "server_path", *_COMMON},
    ("verify", "with --against"): {"model", "against", "rows", "seed", "device", "max_kernel_err", "max_quant_err",
                                   "dtype", "report", *_COMMON},
    ("cache check", "with --nodes"): {"nodes", *_COMMON},
    ("cache ls", "with --cache-dir"): {"cache_dir", "model_id", *_COMMON},
    ("cache show", "with --cache-dir"): {"entry", "cache_dir", *_COMMON},
    ("cache verify", "with --cache-dir"): {"cache_dir", "model_id", *_COMMON},
    ("cache prune", "with --cache-dir"): {"invalid", "temp", "older_than", "records", "model_id", "plan_only", "yes",
                                          "cache_dir", *_COMMON},
    ("cache export", "with --cache-dir"): {"out_path", "model_id", "tp_filter", "cache_dir", *_COMMON},
    # a dry run plans and looks up; it checks --device and --file-mode as the run would (a bad one exits 2 there too)
    ("cache warm", "with --dry-run"): {*_WARM_PLAN, "tp_sizes", "shard_option", "shard_count", *_COMMON},
    ("encode", "with --dry-run"): {*_WARM_PLAN, "tp_size", "tp_rank", "mode", *_COMMON},
}
# a command line in the mode, without any refused option
BASE = {
    ("cache import", "without --against"): ["cache", "import", "{tmp}/b.tar"],
    ("cache import", "with --cache-dir and without --against"): ["cache", "import", "{tmp}/b.tar", "--cache-dir",
                                                                 "{tmp}"],
    ("verify", "with --against"): ["verify", "{tmp}/M", "--against", "{tmp}/S"],
    ("cache check", "with --nodes"): ["cache", "check", "--nodes", "{tmp}/node.json"],
    ("cache ls", "with --cache-dir"): ["cache", "ls", "--cache-dir", "{tmp}"],
    ("cache show", "with --cache-dir"): ["cache", "show", "abcdef12", "--cache-dir", "{tmp}"],
    ("cache verify", "with --cache-dir"): ["cache", "verify", "--cache-dir", "{tmp}"],
    ("cache prune", "with --cache-dir"): ["cache", "prune", "--temp", "--dry-run", "--cache-dir", "{tmp}"],
    ("cache export", "with --cache-dir"): ["cache", "export", "{tmp}/out.tar", "--cache-dir", "{tmp}"],
    ("cache warm", "with --dry-run"): ["cache", "warm", "{tmp}/M", "--dry-run"],
    ("encode", "with --dry-run"): ["encode", "{tmp}/M", "--dry-run"],
}
# a value each option accepts (flags take none)
VALUES = {"model": "{tmp}/M", "bits": "4", "revision": "main", "layers": "*", "exclude": "*.o_proj", "quantization_config": "{}",
          "dtype": "float16", "device": "cpu", "encoder_root": "/e", "encoder_revision": "r", "encoder_source": "/e",
          "server_path": "/s", "tp_size": "2", "tp_rank": "0", "tp_sizes": "2", "cache_dir": "{tmp}",
          "server_release": "gilded-gnosis-r33", "launch": "vllm serve m", "pid": "1", "env_file": "{tmp}/e.env",
          "launch_file": "{tmp}/run.sh", "compose": "{tmp}/c.yml", "service": "s", "image": "i:1",
          "image_inspect": "{tmp}/i.json", "image_root": "{tmp}", "image_archive": "{tmp}/i.tar", "gpu_memory": "8",
          "lock_timeout": "60", "progress": "lines"}


def _command(path: str):
    group = typer.main.get_command(app)
    for word in path.split():
        group = group.commands[word]
    return group


def _opt(command, name: str) -> tuple[list[str], str]:
    """How to give the option on a command line, and how the error names it."""
    param = next(p for p in command.params if p.name == name)
    if param.param_type_name == "argument":
        return [VALUES.get(name, "x")], param.metavar or name.upper()
    flag = max(param.opts, key=len)
    return ([flag] if getattr(param, "is_flag", False) else [flag, VALUES[name]]), flag


@pytest.mark.parametrize("mode", list(MODE_RULES), ids=lambda m: f"{m[0]} {m[1]}")
def test_every_option_is_read_or_refused_in_each_mode(mode):
    """A new option of these commands fails here until its mode rule says whether each mode reads it."""
    assert set(MODE_RULES) == set(READS), set(MODE_RULES) ^ set(READS)  # the commands declare these modes, no other
    names = {p.name.removesuffix("_old") for p in _command(mode[0]).params}  # an old spelling: its row's option
    refused = set(MODE_RULES[mode])
    assert refused <= names, refused - names  # the table names real options
    assert not refused & READS[mode], refused & READS[mode]
    assert names == READS[mode] | refused, f"unclassified in {mode}: {names - READS[mode] - refused}"


@pytest.mark.parametrize("mode", list(MODE_RULES), ids=lambda m: f"{m[0]} {m[1]}")
def test_each_option_a_mode_does_not_read_is_a_usage_error_naming_it(mode, tmp_path, capsys):
    command = _command(mode[0])
    base = [a.replace("{tmp}", str(tmp_path)) for a in BASE[mode]]
    code, _, err = run(base, capsys)
    assert "does nothing" not in err and "do nothing" not in err, err  # the mode itself is not refused
    given, named = [], []
    for name in MODE_RULES[mode]:  # every one at once: the error names each given (one command run per mode)
        if name in " ".join(BASE[mode]):
            continue
        words, flag = _opt(command, name)
        given += [w.replace("{tmp}", str(tmp_path)) for w in words]
        named.append(flag)
    code, _, err = run([*base, *given], capsys)
    errors = [line for line in err.splitlines() if line.startswith("Error")]
    assert code == 2 and len(errors) == 1, err
    said = errors[0].split(": ", 1)[1]
    assert f"nothing {mode[1]}" in said, err
    assert all(re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", said) for flag in named), (named, err)


def test_the_servers_argv_after_the_dashes_counts_as_a_launch(tmp_path, capsys):
    code, _, err = run(["cache", "check", "--nodes", str(tmp_path / "n.json"), "--", "vllm", "serve", "m"], capsys)
    assert code == 2 and "-- ARGV does nothing with --nodes" in err
