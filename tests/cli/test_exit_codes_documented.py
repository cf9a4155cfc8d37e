"""Every exit code the docs and `--help` state, run against the code.

``CLAIMS`` ties each line of README.md, docs/*.md and the commands' help that states an exit code to a scenario
that makes the command exit that way; ``test_every_stated_exit_code_has_a_scenario`` fails when a line states an
exit code that no scenario runs (a new claim, or a claim whose wording changed), and the scenario test fails when
the code disagrees with the doc.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.cache.paths import lock_path
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.cli import _register, app

from helpers import ENC_ARGS as ENC, ENCODER_ID, MODEL_ID, exit_code as run, make_encoded
from seeds import fresh_seed

REPO = Path(__file__).resolve().parents[2]
LAYER = "model.layers.0.self_attn.o_proj"  # 256 x 128 in the tiny Llama: 128 tiles, a few seconds to encode
EXIT_RE = re.compile(r"\bexit(s|ed)?\s+\*{0,2}\d|\bExit codes?:|\bExit \d", re.IGNORECASE)

# (where, a phrase of the line that states the code, scenario): every stated code must be one of these
CLAIMS = [
    ("README.md", "exits **0** ok, **1** findings", "general"),
    ("README.md", "One rule for nothing to do", "nothing_to_do"),
    ("README.md", "work already done is success (exit 0)", "already_done"),
    ("README.md", "prints its help and exits 0", "bare_group"),
    ("README.md", "values are usage errors (exit 2) before any work", "bad_values"),
    ("README.md", "is refused in one line naming it, exit 2, before any command runs", "bad_values"),
    ("README.md", "no spec at all are refused with the server's reason (exit 2)", "bad_overlay"),
    ("README.md", "is an error with the reason (exit 2)", "plain_bf16"),
    ("README.md", "Exit codes: export 1 when invalid entries were left out", "bundles"),
    ("docs/cache.md", "(`broken_locks`, exit 1)", "broken_lock"),
    ("docs/cache.md", "`cache ls`, `verify` and `prune` exit 2 when `--cache-dir`", "missing_cache_dir"),
    ("docs/cache.md", "A root not on a bind mount of a container launch is an error (exit 2)", "cache_launch"),
    ("docs/cache.md", "Beside `--cache-dir` the launch options and `--server-release` pick nothing and are refused (exit 2)",
     "cache_launch"),
    ("docs/cache.md", "Exit 1 when `invalid`, `broken_locks` or `links` is not empty", "invalid_entry"),
    ("docs/cache.md", "`cache import` refuses the entries (exit 1)", "symlinked_folder"),
    ("docs/cache.md", "each symlinked folder (`links`, status `invalid`, exit 1)", "symlinked_folder"),
    ("docs/cache.md", "could not be removed (exit 2", "prune_unremovable"),
    ("docs/cache.md", "Exit codes: 0 ok, 1 findings (`verify` found an invalid entry", "cache_commands"),
    ("docs/deploy.md", "a plain BF16 model is refused (exit 2)", "plain_bf16"),
    ("docs/deploy.md", "and exits 1 (the bundle holds the rest)", "bundles"),
    ("docs/deploy.md", "Exit 0: all", "bundles"),
    ("help: cache show", "(exit 1 if not)", "cache_commands"),
    ("help: cache verify", "exit 1 if any is invalid", "invalid_entry"),
    ("help: cache export", "Exit codes: 0 every selected entry exported", "bundles"),
    ("help: cache import", "Exit codes: 0 all imported or present", "bundles"),
    ("help: cache warm", "Exit codes: 0 all present, 1 some layers failed", "warm"),
    ("help: verify", "Exit codes: 0 every layer passes", "verify_model"),
    ("help: exl3tool", "Exit codes: 0 ok; 1 findings", "general"),
    ("help: cache ls", "Exit codes: 0 listed (an empty cache too), 2 no such cache directory", "missing_cache_dir"),
    ("help: cache show", "Exit codes: 0 the server loads it, 1 it would not", "cache_commands"),
    ("help: cache verify", "Exit codes: 0 every entry valid or unchecked, 1 invalid entries", "invalid_entry"),
    ("help: cache prune", "Exit codes: 0 removed, nothing to remove or declined, 2 nothing selected", "prune_unremovable"),
    ("help: encode", "Exit codes: 0 every layer present, 1 some layers failed", "small_commands"),
    ("help: identity", "Exit codes: 0 printed, 2 usage or configuration error", "small_commands"),
    ("help: synth", "Exit codes: 0 written, 2 usage or I/O error", "small_commands"),
    ("help: encoder-source", "Exit codes: 0 written or already current, 2 a directory", "small_commands"),
    ("README.md", "with the fix; exit 1 on any miss", "cache_check"),
    ("docs/cache.md", "Exit 0 when every look-up hits, 1 when", "cache_check"),
    ("docs/deploy.md", "exits 0 when every look-up hits, 1 when any misses", "cache_check"),
    ("help: cache check", "Exit codes: 0 every look-up hits, 1 some miss or are invalid, 2 usage error", "cache_check"),
    ("help: cache check", "or an assumed release (a label it does not know", "release_assumed"),
    ("docs/cache.md", "named with what was assumed, and the check exits 2 after its report", "release_assumed"),
    ("docs/cache.md", "the rule and the releases on each side are named, exit 2", "release_assumed"),
    ("docs/cache.md", "and the fix (exit 2: `--server-release NAME`, or `--cache-dir`)", "release_assumed"),
    ("README.md", "Refused, naming the flag (exit 2): `--hf-config-path`", "launch_refusals"),
    ("README.md", "**Errors** are one line, exit 2, naming the flag or file", "launch_refusals"),
    ("README.md", "and exits 1 (never \"all hit\": the cache cannot make that server start warm)", "launch_refusals"),
    ("README.md", "`encode` and `verify` exit 2 (nothing would read what they write)", "launch_refusals"),
    ("README.md", "A flag the fork's parser does not know is refused (exit 2)", "launch_refusals"),
    ("docs/cache.md", "| `start_failures` | why this server will not start", "start_failure"),
    ("docs/deploy.md", "missing stops the warm (exit 2: without it the server runs no online", "launch_refusals"),
    ("docs/deploy.md", "and `cache check` says \"0 look-ups\" and exits 1", "launch_refusals"),
    ("README.md", "is refused naming it and its line (exit 2)", "launch_forms"),
    ("docs/deploy.md", "stops the warm with exit 2 naming it", "launch_refusals"),
    ("README.md", "(exit 2 with both figures) before its first encode", "disk_full"),
    ("docs/cache.md", "exits 2 with both figures when they do not fit", "disk_full"),
    ("README.md", "A layer that `differs` fails (exit 1)", "exact"),
    ("docs/deploy.md", "cache as it was; the rest are imported (exit 1)", "bundles"),
    ("docs/cache.md", "Neither changes a hit or an exit code", "parity"),
    ("docs/deploy.md", "a difference refuses the warm (exit 2)", "parity"),
    ("docs/deploy.md", "* **Errors** are one line, exit 2, before any work: `--shard 3/2`", "shards"),
    ("docs/deploy.md", "* **A shard with no job** (N larger than the plan's encodes, up to its jobs) is success (exit 0)",
     "shards"),
    ("docs/deploy.md", "A plan with no work at all stays a usage error (exit 2), as unsharded.", "shards"),
    ("docs/deploy.md", "whole plan; it exits 0 only when every shard ran.", "shards"),
    ("help: hydrate", "Exit codes: 0 written (or nothing to do: already stored), 2 usage", "hydrate"),
    ("docs/hydrate.md", "Exit codes: 0 written or nothing to do", "hydrate"),
    ("docs/hydrate.md", "## Refusals (one line, exit 2, nothing written)", "hydrate"),
    ("docs/hydrate.md", "OUT is a no-op (exit 0", "hydrate"),
    ("docs/hydrate.md", "same OUT is refused at once (exit 2)", "hydrate"),
    ("docs/hydrate.md", "Ctrl-C always ends the run", "hydrate"),
    ("docs/hydrate.md", "every online layer is stored` and exits 0", "hydrate"),
    ("docs/hydrate.md", 'start=0, size=64")` (exit 1)', "hydrate_record"),
    ("docs/hydrate.md", "it says it cannot tell (exit 2)", "hydrate_record"),
    ("docs/hydrate.md", "`0 look-ups: every online layer is stored` (exit 0) at a TP size", "hydrate_record"),
    ("docs/hydrate.md", 'stored layer cannot be sliced at (exit 1, "TP sizes" above)', "hydrate_record"),
    ("docs/hydrate.md", "(`note (launch): ... drop ...`, exit 0), and a launch without them answers the same 0 look-ups, "
                        "exit 0", "hydrate_record"),
]


def _doc_lines(rel: str) -> list[str]:
    """Prose lines of a Markdown file (code blocks left out: a script's own `exit 2` states nothing about us)."""
    lines, fenced = [], False
    for line in (REPO / rel).read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _help_texts() -> dict[str, str]:
    """Each command's help text (its docstring) and the root epilog, keyed like ``CLAIMS``."""
    _register()
    import typer.main

    root = typer.main.get_command(app)
    texts = {"help: exl3tool": root.epilog or ""}

    def walk(group, path):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, path + [name])
            else:
                texts["help: " + " ".join(path + [name])] = " ".join((cmd.help or "").split())

    walk(root, [])
    return texts


def stated_lines() -> list[tuple[str, str]]:
    """(where, text) of every line or help text that states an exit code."""
    found = [(rel, line) for rel in ("README.md", "docs/cache.md", "docs/deploy.md", "docs/hydrate.md") for line in _doc_lines(rel)
             if EXIT_RE.search(line)]
    return found + [(where, text) for where, text in _help_texts().items() if EXIT_RE.search(text)]


def test_every_stated_exit_code_has_a_scenario():
    uncovered = [f"{where}: {text.strip()}" for where, text in stated_lines()
                 if not any(w == where and phrase in text for w, phrase, _ in CLAIMS)]
    assert not uncovered, "exit codes stated without a scenario in CLAIMS:\n" + "\n".join(uncovered)
    stale = [(w, p) for w, p, _ in CLAIMS if not any(w == where and p in text for where, text in stated_lines())]
    assert not stale, f"CLAIMS whose line no longer states an exit code: {stale}"


# --- the scenarios -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny EXL3 Llama, a copy with a NaN in LAYER, a plain BF16 Llama, and a cache holding LAYER (real encode)."""
    base = tmp_path_factory.mktemp("exits")
    seed = fresh_seed()
    good = write_tiny(base / "llama", "llama", seed=seed)
    nan = write_tiny(base / "nan", "llama", seed=seed)
    tensors = load_file(nan / "model.safetensors")
    tensors[f"{LAYER}.weight"][3, 5] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    plain = write_llama_checkpoint(base / "plain", hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                                   layers=1, vocab=64, shards=1, exl3_lm_head=False)
    cache = base / "cache"
    assert run(["cache", "warm", good, "--layers", LAYER, "--cache-dir", cache, "--quiet", *ENC]) == 0
    return {"good": good, "nan": nan, "plain": plain, "cache": cache}


def _cache(root: Path, n: int = 2) -> list[Path]:
    """A cache of ``n`` valid synthetic entries (no encode)."""
    store = CacheStore(root)
    return [store.publish(CacheKey.for_layer(MODEL_ID, ENCODER_ID, f"model.layers.{i}.mlp.down_proj", 6, 1, 0, 128, 256),
                          make_encoded(128, 256, seed=fresh_seed())) for i in range(n)]


def _flip(path: Path) -> None:
    """Change the entry's last tensor byte: loadable by the server, caught by exl3tool's checksum."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def scenario_general(m, tmp, monkeypatch):
    _cache(tmp / "ok")
    bad = _cache(tmp / "bad")
    _flip(bad[0])
    assert run(["cache", "ls", "--cache-dir", tmp / "ok"]) == 0
    assert run(["cache", "verify", "--cache-dir", tmp / "bad"]) == 1
    assert run(["cache", "ls", "--no-such-option"]) == 2

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("exl3tool.operations.warm.warm", interrupted)  # `cache warm` imports it when it runs
    assert run(["cache", "warm", m["good"], "--cache-dir", tmp / "c", *ENC]) == 130


def scenario_nothing_to_do(m, tmp, monkeypatch):
    ignore_all = '{"linear": {"weight": "mxfp8"}, "ignore": ["re:.*"]}'
    for argv in (["--quantization-config", ignore_all], ["--exclude", "*"], ["--layers", "nope.*"],
                 ["--layers", "*.mlp.down_proj", "--tp-size", "4"]):
        assert run(["cache", "warm", m["good"], "--cache-dir", tmp / "c", "--dry-run", *ENC, *argv]) == 2, argv
    assert run(["verify", m["good"], "--cache-dir", m["cache"], "--quantization-config", ignore_all, *ENC]) == 2
    (tmp / "empty").mkdir()
    assert run(["cache", "export", tmp / "b.tar", "--cache-dir", tmp / "empty"]) == 2


def scenario_already_done(m, tmp, monkeypatch):
    assert run(["cache", "warm", m["good"], "--layers", LAYER, "--cache-dir", m["cache"], "--quiet", *ENC]) == 0
    _cache(tmp / "c")
    assert run(["cache", "prune", "--invalid", "--yes", "--cache-dir", tmp / "c"]) == 0


def scenario_small_commands(m, tmp, monkeypatch):
    """The exit codes of synth, identity, encoder-source and encode's findings (issue 44: every --help states them)."""
    assert run(["synth", tmp / "s", "--family", "llama", "-q"]) == 0
    assert run(["synth", tmp / "s", "--family", "llama", "-q"]) == 2  # not empty now
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    assert run(["identity", m["good"]]) == 2  # no encoder root
    assert run(["identity", m["good"], *ENC]) == 0
    assert run(["encoder-source", tmp / "e"]) == 0
    (tmp / "other").mkdir()
    (tmp / "other" / "x.py").write_text("")
    assert run(["encoder-source", tmp / "other"]) == 2  # another directory: only with --force
    from helpers import refuse_encodes

    refuse_encodes(monkeypatch)  # every encode fails: encode's findings exit
    assert run(["encode", m["good"], "--layers", LAYER, "--cache-dir", tmp / "c", "-q", *ENC]) == 1


def scenario_bare_group(m, tmp, monkeypatch):
    assert run(["cache"]) == 0


def scenario_bad_values(m, tmp, monkeypatch):
    for argv in (["--dtype", "int8"], ["--bits", "9"], ["--tp-size", "0"]):
        assert run(["cache", "warm", m["good"], "--cache-dir", tmp, "--dry-run", *ENC, *argv]) == 2, argv
    monkeypatch.setenv("EXL3TOOL_VITERBI_MODE", "9")  # a knob out of its range: refused before any command
    assert run(["cache", "warm", m["good"], "--cache-dir", tmp, "--dry-run", *ENC]) == 2
    monkeypatch.delenv("EXL3TOOL_VITERBI_MODE")


def scenario_bad_overlay(m, tmp, monkeypatch):
    for overlay in ('{"linear": {"weight": "fp8"}}', '{"ignore": ["lm_head"]}', '{"lineer": "mxfp8"}'):
        assert run(["cache", "warm", m["good"], "--cache-dir", tmp, "--dry-run", "--quantization-config", overlay,
                    *ENC]) == 2, overlay


def scenario_plain_bf16(m, tmp, monkeypatch):
    assert run(["cache", "warm", m["plain"], "--cache-dir", tmp, "--dry-run", *ENC]) == 2


def scenario_bundles(m, tmp, monkeypatch):
    entries = _cache(tmp / "src", 3)
    assert run(["cache", "export", tmp / "ok.tar", "--cache-dir", tmp / "src"]) == 0
    assert run(["cache", "import", tmp / "ok.tar", "--cache-dir", tmp / "dst"]) == 0
    manifest_sha = json.loads(run_json(["cache", "export", tmp / "ok2.tar", "--cache-dir", tmp / "src"]))["exported"][0]["sha256"]
    forged = (tmp / "ok.tar").read_bytes().replace(manifest_sha.encode(), ("0" * 64).encode(), 1)
    (tmp / "forged.tar").write_bytes(forged)
    assert run(["cache", "import", tmp / "forged.tar", "--cache-dir", tmp / "dst2"]) == 1  # one refused, rest imported
    (tmp / "junk.tar").write_bytes(b"not a tar at all" * 64)
    assert run(["cache", "import", tmp / "junk.tar", "--cache-dir", tmp / "dst3"]) == 2
    _flip(entries[0])
    assert run(["cache", "export", tmp / "part.tar", "--cache-dir", tmp / "src"]) == 1  # invalid left out


def run_json(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run([*argv, "--json"]) == 0
    return buf.getvalue()


def scenario_broken_lock(m, tmp, monkeypatch):
    entry = _cache(tmp / "c", 1)[0]
    lock = lock_path(entry)
    lock.unlink(missing_ok=True)
    lock.mkdir()
    assert run(["cache", "verify", "--cache-dir", tmp / "c"]) == 1


def scenario_symlinked_folder(m, tmp, monkeypatch):
    _cache(tmp / "src", 2)
    assert run(["cache", "export", tmp / "b.tar", "--cache-dir", tmp / "src"]) == 0
    (tmp / "outside").mkdir()
    (tmp / "c" / "v1").mkdir(parents=True)
    (tmp / "c" / "v1" / MODEL_ID[:20]).symlink_to(tmp / "outside", target_is_directory=True)
    assert run(["cache", "import", tmp / "b.tar", "--cache-dir", tmp / "c"]) == 1
    assert run(["cache", "verify", "--cache-dir", tmp / "c"]) == 1
    assert run(["cache", "prune", "--invalid", "--yes", "--cache-dir", tmp / "c"]) == 0
    assert run(["cache", "verify", "--cache-dir", tmp / "c"]) == 0 and not list((tmp / "outside").iterdir())


def scenario_missing_cache_dir(m, tmp, monkeypatch):
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "prune", "--temp"]):
        assert run([*argv, "--cache-dir", tmp / "nope"]) == 2, argv


def scenario_cache_launch(m, tmp, monkeypatch):
    monkeypatch.delenv("VLLM_EXL3_ONLINE_CACHE_MODE", raising=False)
    (tmp / "c").mkdir()
    image = "vllm/vllm-openai:latest vllm serve /models/M"
    unmounted = f"docker run -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache -v {tmp}:/models {image}"
    mounted = f"docker run -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache -v {tmp / 'c'}:/cache {image}"
    off = f"docker run -e VLLM_EXL3_ONLINE_CACHE_MODE=off -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache -v {tmp / 'c'}:/cache {image}"
    assert run(["cache", "ls", "--launch", unmounted]) == 2
    assert run(["cache", "ls", "--launch", mounted]) == 0 and run(["cache", "ls", "--launch", off]) == 0
    assert run(["cache", "import", tmp / "b.tar", "--launch", off]) == 2
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "export", tmp / "o.tar"]):
        assert run([*argv, "--launch", mounted, "--cache-dir", tmp / "c"]) == 2, argv
        assert run([*argv, "--server-release", "gilded-gnosis-r33", "--cache-dir", tmp / "c"]) == 2, argv


def scenario_invalid_entry(m, tmp, monkeypatch):
    entries = _cache(tmp / "c")
    assert run(["cache", "verify", "--cache-dir", tmp / "c"]) == 0
    _flip(entries[1])
    assert run(["cache", "verify", "--cache-dir", tmp / "c"]) == 1


def scenario_prune_unremovable(m, tmp, monkeypatch):
    _cache(tmp / "c")

    def refuse(self, missing_ok=False):
        raise PermissionError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    assert run(["cache", "prune", "--older-than", "0", "--yes", "--cache-dir", tmp / "c"]) == 2


def scenario_cache_commands(m, tmp, monkeypatch):
    entries = _cache(tmp / "c")
    assert run(["cache", "show", entries[0], "--cache-dir", tmp / "c"]) == 0
    _flip(entries[0])
    assert run(["cache", "show", entries[0], "--cache-dir", tmp / "c"]) == 1
    assert run(["cache", "show", "abcdef0123", "--cache-dir", tmp / "c"]) == 2


def scenario_warm(m, tmp, monkeypatch):
    assert run(["cache", "warm", m["nan"], "--layers", LAYER, "--cache-dir", tmp / "c", "--quiet", *ENC]) == 1
    assert not list((tmp / "c").rglob("*.safetensors"))  # nothing published for the failed layer
    assert run(["cache", "warm", m["good"], "--cache-dir", tmp / "c", "--tp-size", "x", *ENC]) == 2


def scenario_shards(m, tmp, monkeypatch):
    base = ["cache", "warm", m["good"], "--cache-dir", tmp / "c", "--quiet", *ENC]
    for argv in (["--shard", "3/2"], ["--shard", "0/0"], ["--shard", "x/y"], ["--shard-count", "2"]):
        assert run([*base, "--dry-run", *argv]) == 2, argv
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")  # an index variable without a count
    assert run([*base, "--dry-run"]) == 2
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    ignore_all = '{"linear": {"weight": "mxfp8"}, "ignore": ["re:.*"]}'
    assert run([*base, "--dry-run", "--shard", "0/2", "--quantization-config", ignore_all]) == 2
    assert run([*base, "--layers", LAYER, "--shard", "1/2"]) == 2  # one job, two shards: a count beyond its jobs
    # 5 jobs (TP 1, and TP 4's 4 ranks the server keeps MXFP8: K_r 64), 1 encode: shard 1 of 2 has none
    assert run([*base, "--layers", LAYER, "--tp-size", "1,4", "--shard", "1/2"]) == 0
    assert not (tmp / "c" / "v1").exists()

    import exl3tool.operations.warm.run as warm_run
    from helpers import fake_encode

    real = warm_run.run_plan
    monkeypatch.setattr(warm_run, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    two = ["--layers", LAYER, "--layers", "model.layers.1.self_attn.o_proj"]
    check = ["cache", "check", m["good"], "--cache-dir", tmp / "c", "--quiet", *ENC, *two]
    assert run([*base, *two, "--shard", "0/2"]) == 0 and run(check) == 1  # one shard ran: the other's entry misses
    assert run([*base, *two, "--shard", "1/2"]) == 0 and run(check) == 0


def scenario_parity(m, tmp, monkeypatch):
    """An encoder copy that writes other bytes refuses the warm (2); trusted, it writes (0); the recorded verdict is
    a note of cache check, not a miss (0)."""
    import textwrap

    import exl3tool.operations.warm.run as warm_run
    from helpers import fake_encode

    lib = tmp / "fork-encoder" / "modules" / "quant" / "exl3_lib"
    lib.mkdir(parents=True)
    (lib / "quantize.py").write_text(textwrap.dedent('''
        import torch

        def quantize_exl3(weight, H_data, quant_args, return_weight_q=False, verbose=False):
            k, n = weight.shape
            g = torch.Generator().manual_seed(quant_args["seed"] + 1)
            t = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * quant_args["K"]), generator=g, dtype=torch.int32)
            quant_args["q_fallback"] = True
            return None, 0.5, {"trellis": t.to(torch.int16), "suh": torch.ones(k, dtype=torch.float16),
                               "svh": torch.ones(n, dtype=torch.float16), "mcg": torch.tensor(1)}
    '''))
    real = warm_run.run_plan
    monkeypatch.setattr(warm_run, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    enc = ["--encoder-root", "/opt/exllamav3-python/exllamav3", "--encoder-revision", "704aefd",
           "--encoder-source", tmp / "fork-encoder"]
    base = ["cache", "warm", m["good"], "--layers", LAYER, "--cache-dir", tmp / "c", "--device", "cpu", "--quiet", *enc]
    assert run(base) == 2 and not (tmp / "c" / "v1").exists()
    assert run([*base, "--trust-encoder-identity"]) == 0
    assert run(["cache", "check", m["good"], "--layers", LAYER, "--cache-dir", tmp / "c", "--quiet", *enc]) == 0


def scenario_verify_model(m, tmp, monkeypatch):
    assert run(["verify", m["good"], "--layers", LAYER, "--cache-dir", m["cache"], "--quiet", *ENC]) == 0
    missing = "model.layers.1.self_attn.o_proj"  # never warmed
    assert run(["verify", m["good"], "--layers", missing, "--cache-dir", m["cache"], "--quiet", *ENC]) == 1
    assert run(["verify", m["good"], "--cache-dir", tmp / "nope", *ENC]) == 2


def scenario_start_failure(m, tmp, monkeypatch):
    """A 128-unaligned shard whose K_r is not a multiple of 32 (4304, fork issue #311): the server does not start."""
    from exl3tool.checkpoint import write_llama_checkpoint

    wide = write_llama_checkpoint(tmp / "wide", hidden=256, heads=4, kv_heads=2, intermediate=4304, layers=1,
                                  vocab=512, shards=1)
    argv = ["cache", "check", wide, "--cache-dir", tmp / "c", "--quantization-config", '{"linear": "mxfp8"}', *ENC]
    assert run(argv) == 1  # a miss or not: the server does not start
    assert run([*argv, "--layers", "model.layers.0.self_attn.o_proj"]) == 1  # it builds every layer, not those


def scenario_cache_check(m, tmp, monkeypatch):
    argv = ["cache", "check", m["good"], "--cache-dir", m["cache"], *ENC]
    assert run([*argv, "--layers", LAYER]) == 0
    assert run([*argv, "--layers", "model.layers.1.self_attn.o_proj"]) == 1  # never warmed: the server would miss
    assert run([*argv, "--tp-size", "two"]) == 2


def scenario_release_assumed(m, tmp, monkeypatch):
    """An image label naming a release exl3tool does not know: the look-ups hit, and still no answer (exit 2)."""
    import json as _json

    inspect = tmp / "inspect.json"
    inspect.write_text(_json.dumps([{"RepoTags": ["example.org/v:1"], "Config": {
        "Env": [], "Labels": {"local-inference.release.name": "karmic-kraken-r3"}}}]))
    argv = ["cache", "check", m["good"], "--cache-dir", m["cache"], "--layers", LAYER, *ENC, "--image", "example.org/v:1",
            "--image-inspect", inspect]
    assert run(argv) == 2
    assert run([*argv, "--server-release", "infernal-invocation-r18"]) == 0  # named: answered
    warm = ["cache", "warm", m["good"], "--cache-dir", tmp / "w", "--layers", LAYER, "--dry-run", *ENC]
    assert run([*warm, "--image", "example.org/v:1", "--image-inspect", inspect]) == 0  # written alike by every one
    # no release named, and XDG_CACHE_HOME gives the root: the older cache module's is ~/.cache/vllm/exl3_online
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp / "xdg"))
    monkeypatch.setenv("HOME", str(tmp / "home"))
    unnamed = ["cache", "check", m["good"], "--layers", LAYER, *ENC]
    assert run(unnamed) == 2 and run(["cache", "warm", *unnamed[2:], "--dry-run"]) == 2
    assert run([*unnamed, "--server-release", "gilded-gnosis-r33"]) == 1  # named: its root, where nothing is yet
    # the cache commands' root likewise: refused unnamed, answered where --cache-dir gives it
    assert run(["cache", "ls"]) == 2 and run(["cache", "ls", "--cache-dir", m["cache"]]) == 0


def scenario_launch_refusals(m, tmp, monkeypatch):
    base = ["cache", "warm", "--cache-dir", tmp / "c", "--dry-run", *ENC]
    assert run([*base, "--launch", f"vllm serve {m['good']} --hf-config-path /cfg"]) == 2
    assert run([*base, "--launch", f"vllm serve {m['good']} --quantization-config '{{not json'"]) == 2
    assert run([*base, "--env-file", tmp / "missing.env", "--launch", f"vllm serve {m['good']}"]) == 2
    assert run([*base, "--launch", "vllm serve"]) == 2  # no model in the launch
    assert run([*base, "--launch", ""]) == 2  # what `--launch "$(cat missing.txt)"` gives
    serving = f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 vllm serve {m['good']} --quantization-config '{{\"linear\": \"mxfp8\"}}'"
    assert run([*base, "--launch", serving + " --tensor-paralel-size 2"]) == 2  # vLLM refuses an unknown flag
    assert run([*base, "--launch", f"vllm serve {m['good']}"]) == 2  # it encodes nothing online: nothing to warm
    assert run([*base, "--launch", serving]) == 0  # the same launch without them plans
    check = ["cache", "check", "--cache-dir", tmp / "c", *ENC]
    assert run([*check, "--launch", f"vllm serve {m['good']}"]) == 1  # no look-up is a finding, never "all hit"


def scenario_launch_forms(m, tmp, monkeypatch):
    base = ["cache", "warm", "--cache-dir", tmp / "c", "--dry-run", *ENC]
    script = tmp / "run.sh"
    script.write_text(f"#!/bin/bash\nif true; then\n  vllm serve {m['good']}\nfi\n")
    assert run([*base, "--launch-file", script]) == 2  # a conditional: not followed
    monkeypatch.delenv("EXL3TOOL_TEST_MODEL", raising=False)
    assert run([*base, "--launch", "vllm serve \"$EXL3TOOL_TEST_MODEL\""]) == 2  # unset, no default
    script.write_text(f"#!/bin/bash\nset -e\nM={m['good']}\nexport VLLM_EXL3_ONLINE_TRELLIS_BITS=6\n"
                      "exec vllm serve \"${M:-/nowhere}\" --quantization-config '{\"linear\": \"mxfp8\"}'\n")
    assert run([*base, "--launch-file", script]) == 0  # the same straight-line script plans


def scenario_disk_full(m, tmp, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    assert run(["cache", "warm", m["good"], "--layers", LAYER, "--cache-dir", tmp / "c", "--quiet", *ENC]) == 2
    assert not list((tmp / "c").rglob("*.safetensors"))  # refused before the first encode


def scenario_exact(m, tmp, monkeypatch):
    shutil_copy = __import__("shutil").copytree
    cache = shutil_copy(m["cache"], tmp / "c")
    argv = ["verify", m["good"], "--layers", LAYER, "--cache-dir", cache, "--exact", "--device", "cpu", "--quiet", *ENC]
    assert run(argv) == 0
    _flip(next(Path(cache).rglob("*.safetensors")))
    assert run(argv) == 1


def scenario_hydrate(m, tmp, monkeypatch):
    tp1 = ["--tp-size", "1"]  # the tiny Llama: no layer slices in 128-blocks at TP 4, one of the default sizes
    assert run(["hydrate", m["good"], tmp / "out", "--dry-run", *tp1]) == 0
    assert run(["hydrate", m["good"], tmp / "out", "--dry-run"]) == 2  # nothing to hydrate for TP 1,2,4
    assert run(["hydrate", m["good"], m["good"] / "out", "--dry-run"]) == 2  # OUT inside SOURCE
    assert run(["hydrate", m["plain"], tmp / "out"]) == 2  # a BF16 model: nothing the server encodes online
    import exl3tool.operations.hydrate as hy

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hy, "hydrate", interrupted)
    assert run(["hydrate", m["good"], tmp / "out", *tp1]) == 130
    monkeypatch.undo()
    real_plan = hy.plan_hydrate  # a checkpoint whose online layers are stored already: nothing to do, exit 0
    monkeypatch.setattr(hy, "plan_hydrate", lambda *a, **k: replace(real_plan(*a, **k), already_stored="stored"))
    assert run(["hydrate", m["good"], tmp / "out", *tp1]) == 0 and not (tmp / "out").exists()
    monkeypatch.undo()
    from filelock import FileLock

    with FileLock(str(hy.lock_file(tmp / "out"))):  # another hydrate into the same OUT is running
        assert run(["hydrate", m["good"], tmp / "out", *tp1]) == 2 and not (tmp / "out").exists()


def scenario_hydrate_record(m, tmp, monkeypatch):
    """cache check on an OUT hydrated for TP 1: 0 look-ups (0) there, also from a launch with or without the
    online-encode variables; at TP 2, where its stored qkv cannot be sliced, a start failure (1), also with an
    earlier record that checked only TP 1 (the fork's rule answers); a stored module whose layout exl3tool does not
    model cannot be told (2)."""
    import exl3tool.operations.hydrate as hy
    from helpers import fake_encode

    real = hy.hydrate
    monkeypatch.setattr(hy, "hydrate", lambda plan, **k: real(plan, **{**k, "encode": fake_encode}))
    out = tmp / "out"
    assert run(["hydrate", m["good"], out, "--tp-size", "1", "--quiet"]) == 0
    check = ["cache", "check", out, "--cache-dir", tmp / "c", "--quiet", *ENC]
    assert run(check) == 0 and run([*check, "--tp-size", "2"]) == 1
    env = f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ONLINE_CACHE_DIR={tmp / 'c'} "
    launch = f"vllm serve {out} --quantization-config '{{\"linear\": \"mxfp8\"}}'"
    assert run(["cache", "check", "--quiet", "--launch", env + launch]) == 0
    assert run(["cache", "check", "--quiet", "--launch", launch]) == 0
    qc = json.loads((out / "quantization_config.json").read_text())
    for key in ("tp_checked_up_to", "fails_at"):
        del qc["exl3tool_hydrate"][key]
    (out / "quantization_config.json").write_text(json.dumps(qc))
    assert run([*check, "--tp-size", "2"]) == 1  # the fork's rule over every stored module answers for it
    ts = qc["tensor_storage"]  # a stored module whose matrix is not found: its layout is not modelled
    stored = ts[sorted(ts)[0]]["stored_tensors"]
    trellis = next(n for n in stored if n.endswith(".trellis"))
    stored["elsewhere.trellis"] = {**stored.pop(trellis), "shape": [8, 8]}
    (out / "quantization_config.json").write_text(json.dumps(qc))
    assert run(check) == 2


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


def test_every_claim_names_a_scenario():
    assert {s for _, _, s in CLAIMS} == set(SCENARIOS)


SLOW = {"already_done", "exact"}  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(SCENARIOS)])
def test_scenario_exits_as_documented(name, models, tmp_path, monkeypatch):
    SCENARIOS[name](models, tmp_path, monkeypatch)
