"""`exl3tool hydrate` against every fault it can meet: killed (SIGKILL) or stopped (Ctrl-C) at each step of a run,
then the same command: OUT is the bytes of an uninterrupted run and nothing else is left; a Ctrl-C a ctypes callback
swallows still ends the run (exit 130); a real full filesystem, a corrupt shard: one line naming the file and where
the results are kept, then a resume; links and special files in SOURCE: only SOURCE's files reach OUT; the results
stream to disk (no module's tensors outlive its step); and OUT's bytes are those of the code before this change."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import signal
import struct
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.operations.hydrate import STEPS, TEMP_SUFFIX, hydrate, lock_file, plan_hydrate, temp_dir
from exl3tool.plan import ServerRequest

from helpers import run, tree
from seeds import fresh_seed
from test_hydrate import NO_SPACE, _one_line, weight_encode
from test_warm_disk_full import small_tmpfs  # noqa: F401  (the fixture)


def _checkpoint(path: Path, seed: int) -> Path:
    """One Llama layer (7 modules) in two shards with an index: every step of a run, with a file to link."""
    return write_llama_checkpoint(path, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, layers=1,
                                  vocab=512, shards=2, seed=seed)


def _digests(root: Path) -> dict[str, str | None]:
    return {k: v[3] for k, v in tree(root).items()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if TEMP_SUFFIX in p.name or p.name.endswith(".hydrate.lock"))


@pytest.fixture
def fake_encoder(monkeypatch):
    monkeypatch.setattr("exl3tool.encode.encode_linear", lambda w, **k: weight_encode(w, k["bits"], k["seed"], "cpu"))
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is the kernel's; these tests kill processes only


# the library's TP sizes (ServerRequest's default, TP 1) on the command line, whose default is every size vLLM can
# split the model into: at TP 4 this model's layers slice in no 128-blocks, nothing would be hydrated
HYDRATE = ("hydrate", "--tp-size", "1")
LAYERS = ("*.o_proj", "*.down_proj")  # one module in each shard: every kind of step, few steps


def _request(src: Path) -> ServerRequest:
    return ServerRequest(model=str(src), layers=LAYERS)


@pytest.fixture
def job(tmp_path, fake_encoder):
    """SOURCE, an uninterrupted run's OUT (its bytes and its steps), and the command into a new OUT."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    steps: list[str] = []
    clean = tmp_path / "clean"
    hydrate(plan_hydrate(_request(src), clean), device="cpu", encode=weight_encode, on_step=steps.append)
    argv = [*HYDRATE, str(src), str(tmp_path / "out"), "--json", *(a for g in LAYERS for a in ("--layers", g))]
    return src, _digests(clean), steps, tmp_path / "out", argv


def test_a_run_reports_its_steps_in_order(job):
    """The steps the fault tests stop at: every one STEPS names, each module's save, each changed shard."""
    _, _, steps, _, _ = job
    kinds = [s.split(" ")[0] for s in steps]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == [s.split(" ")[0] for s in STEPS]
    assert kinds.count("saved") == 2 and kinds.count("shard") == 2 and len(steps) == 13


def _killed_at(step: str, src: Path, out: Path) -> None:
    """A forked child runs the hydrate and SIGKILLs itself once ``step`` is done."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            torch.set_num_threads(1)  # a forked child must not wait on the parent's OpenMP pool
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)

            def on_step(name: str) -> None:
                if name == step:
                    os.kill(os.getpid(), signal.SIGKILL)

            hydrate(plan_hydrate(_request(src), out), device="cpu", encode=weight_encode, on_step=on_step)
        finally:
            os._exit(3)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child stopping at {step!r} hung")
        time.sleep(0.005)
    assert os.WIFSIGNALED(done[1]) and os.WTERMSIG(done[1]) == signal.SIGKILL, (step, done[1])


def test_killed_at_every_step_then_the_same_command_gives_the_same_bytes(job, capsys):
    """SIGKILL after each step of a run (one forked child per step), then the same command: OUT is an uninterrupted
    run's bytes, no temporary folder or lock is left, and OUT never exists half-written. Once OUT is renamed into
    place it is complete: the same command then removes what the killed run left (exit 0), or, nothing left, says
    OUT exists."""
    src, clean, steps, out, argv = job
    for step in steps:
        _killed_at(step, src, out)
        renamed = steps.index(step) >= steps.index("renamed")
        assert out.exists() == renamed, step
        if renamed:
            assert _digests(out) == clean, step
        code, stdout, err = run(argv, capsys)
        if step == "cleaned":
            assert code == 2 and "exists" in _one_line(err), err
        else:
            assert code == 0, (step, err)
            doc = json.loads(stdout)
            saved = sum(s.startswith("saved ") for s in steps[: steps.index(step) + 1])
            assert (doc["encoded"], doc["reused"]) == (2 - saved, saved), (step, doc)
        assert _digests(out) == clean, step
        assert _leftovers(out.parent) == [], step
        _remove_tree(out)


def test_a_clean_up_stopped_half_way_is_finished_by_the_same_command(job, capsys):
    """Killed while removing the temporary folder (only its assembled record left): the same command finishes the
    clean-up and reports OUT written; another command into that OUT finishes it too, then is refused: OUT exists."""
    src, clean, steps, out, argv = job

    def stop(name: str) -> None:
        if name == "unlocked":
            raise KeyboardInterrupt

    for extra, want in (([], 0), (["--bits", "5"], 2)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("exl3tool.operations.hydrate._remove_temp", lambda temp: None)  # the kill: nothing removed
            with pytest.raises(KeyboardInterrupt):
                hydrate(plan_hydrate(_request(src), out), device="cpu", encode=weight_encode, on_step=stop)
        for p in temp_dir(out).iterdir():  # the clean-up's first half: all but the record
            if p.name != "assembled.json":
                _remove_tree(p) if p.is_dir() else p.unlink()
        code, stdout, err = run(argv + extra, capsys)
        assert code == want, err
        if want == 0:
            assert json.loads(stdout)["encoded"] == 0
        else:
            assert "exists (a hydrate with other settings wrote it)" in _one_line(err)
        assert _leftovers(out.parent) == [] and _digests(out) == clean
        _remove_tree(out)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the ctypes callback's own line
def test_ctrl_c_at_every_step_ends_the_run_and_the_same_command_resumes(job, capsys):
    """Ctrl-C at each step, swallowed there by a ctypes callback (so raised at the next step or, OUT in place, once
    the clean-up is done); and, from the rename on, a KeyboardInterrupt raised in the step itself: the run ends with
    KeyboardInterrupt, leaves no lock, keeps a temporary folder only with results in it, and the same command writes
    the bytes of an uninterrupted run."""
    src, clean, steps, out, argv = job
    renamed = steps.index("renamed")
    for step, how in [(s, "swallowed") for s in steps] + [(s, "raised") for s in steps[renamed:]]:
        def on_step(name: str) -> None:
            if name == step:
                if how == "raised":
                    raise KeyboardInterrupt
                _swallowed_ctrl_c()

        with pytest.raises(KeyboardInterrupt):
            hydrate(plan_hydrate(_request(src), out), device="cpu", encode=weight_encode, on_step=on_step)
        left = _leftovers(out.parent)
        done = steps.index(step) >= renamed
        kept = any(s.startswith("saved ") for s in steps[: steps.index(step) + 1])
        assert left == ([temp_dir(out).name] if kept and not done else []), (step, how, left)
        assert out.exists() == done, step
        if not done:
            code, _, err = run(argv, capsys)
            assert code == 0, (step, err)
        assert _digests(out) == clean and _leftovers(out.parent) == [], step
        _remove_tree(out)


def _swallowed_ctrl_c() -> None:
    """SIGINT delivered while Python code runs inside a ctypes callback: the KeyboardInterrupt is printed ("Exception
    ignored on calling ctypes callback") and dropped, as it is in llvmlite's object-cache hooks under numba."""
    def callback() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here
            pass

    ctypes.CFUNCTYPE(None)(callback)()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_swallowed_ctrl_c_still_exits_130(tmp_path, capsys, monkeypatch, fake_encoder):
    """Through the CLI: Ctrl-C lost in a ctypes callback inside the third encode ends the run with 130 (it used to
    run on and exit 0); the results are kept and named, the lock is gone, and the same command resumes. The error
    line is hydrate's own (where the results are kept, the same command resumes; not the cache commands' line about
    published entries), and the --json error document says it too."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    calls = []

    def encode(w, **k):
        calls.append(1)
        if len(calls) == 3:
            _swallowed_ctrl_c()
        return weight_encode(w, k["bits"], k["seed"], "cpu")

    monkeypatch.setattr("exl3tool.encode.encode_linear", encode)
    out = tmp_path / "out"
    code, stdout, err = run([*HYDRATE, str(src), str(out), "--json"], capsys)
    assert code == 130, err
    assert err.splitlines()[-1] == (f"error: interrupted: OUT was not written; the 3 modules encoded so far are kept "
                                    f"in {temp_dir(out)}: run the same command again to resume (or remove that folder "
                                    "to start over)"), err
    assert "published" not in err and not out.exists()
    doc = json.loads(stdout)
    assert (doc["exit_code"], doc["kept"], doc["kept_in"], doc["out_written"]) == (130, 3, str(temp_dir(out)), False)
    assert _leftovers(tmp_path) == [temp_dir(out).name]
    code, stdout, err = run([*HYDRATE, str(src), str(out), "--json"], capsys)
    assert code == 0 and json.loads(stdout)["reused"] == 3, err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_wrapped_in_another_error_is_an_interrupt(tmp_path, capsys, monkeypatch, fake_encoder):
    """Ctrl-C during an import becomes a RuntimeError ("Error calling __set_name__"); before the run (the CLI's
    imports, the plan) and inside it (an encode): exit 130, not an internal error."""
    import exl3tool.operations.hydrate as hy

    src = _checkpoint(tmp_path / "src", fresh_seed())

    def wrapped(*a, **k):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from exc

    with monkeypatch.context() as mp:
        mp.setattr(hy, "plan_hydrate", wrapped)
        code, _, err = run([*HYDRATE, str(src), str(tmp_path / "out")], capsys)
        assert code == 130 and "interrupted before any module was encoded: nothing was written" in err, err

    def encode(w, **k):
        _swallowed_ctrl_c()
        raise RuntimeError("Error calling __set_name__ on 'Field' instance")

    monkeypatch.setattr("exl3tool.encode.encode_linear", encode)
    code, _, err = run([*HYDRATE, str(src), str(tmp_path / "out")], capsys)
    assert code == 130 and "internal error" not in err, err
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("fill_at", ["saved", "linked"])
def test_a_real_full_filesystem_names_the_file_and_resumes(tmp_path, small_tmpfs, capsys, fake_encoder, fill_at):  # noqa: F811
    """OUT on a 2 MiB tmpfs that another writer fills during the run (after the second module is saved, or once the
    unchanged files are linked): exit 2, one line naming the file written, the free and needed bytes and where the
    results are kept, no `.part` file left; after the space is freed the same command writes the bytes of an uninterrupted run."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    clean = tmp_path / "clean"
    hydrate(plan_hydrate(ServerRequest(model=str(src)), clean), device="cpu", encode=weight_encode)
    out = small_tmpfs / "out"
    ballast = small_tmpfs / "ballast"
    seen = []

    def on_step(name: str) -> None:
        seen.append(name)
        if name.startswith(fill_at) and not ballast.exists() and (fill_at != "saved" or len(seen) == 4):
            with open(ballast, "wb") as fh:
                fh.write(b"\0" * (os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize - 8192))

    import exl3tool.operations.hydrate as hy

    real = hy.hydrate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hy, "hydrate", lambda plan, **k: real(plan, **k, on_step=on_step))
        code, _, err = run([*HYDRATE, str(src), str(out)], capsys)
    line = _one_line(err)
    assert code == 2 and re.search(NO_SPACE, line), err
    assert str(temp_dir(out)) in line.split(":", 2)[1] and "the rest of the run needs about" in line
    assert "kept in" in line and not out.exists() and not lock_file(out).exists()
    assert not (temp_dir(out) / "out").exists()  # the partial assembly is removed: its space is free again
    assert not [p.name for p in small_tmpfs.rglob("*.part")]  # nor is a file half-written left
    ballast.unlink()
    code, stdout, err = run([*HYDRATE, str(src), str(out), "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["reused"] >= 2
    assert _digests(out) == _digests(clean) and _leftovers(small_tmpfs) == []


def _corrupt(shard: Path, tensor: str, change) -> None:
    """Rewrite ``tensor``'s header record in place with ``change(record)`` (same header length: padded)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header[tensor] = change(header[tensor])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


@pytest.mark.parametrize("weight", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"])
def test_a_corrupt_shard_met_mid_run_is_named_and_the_same_command_resumes(tmp_path, capsys, fake_encoder, weight):
    """A weight whose data_offsets run past its bytes, in the first module's shard or a later one: exit 2 naming
    the shard; no lock, no partial OUT; a temporary folder only with the results before it, named in the message.
    The shard replaced, the same command writes the bytes of a clean run."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    clean = tmp_path / "clean"
    hydrate(plan_hydrate(ServerRequest(model=str(src)), clean), device="cpu", encode=weight_encode)
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][weight]
    good = shard.read_bytes()
    _corrupt(shard, weight, lambda rec: {**rec, "data_offsets": [rec["data_offsets"][0], rec["data_offsets"][1] + 2]})
    out = tmp_path / "out"
    code, _, err = run([*HYDRATE, str(src), str(out)], capsys)
    line = _one_line(err)
    assert code == 2 and line.startswith(f"error: {shard}: "), err
    assert not out.exists() and not lock_file(out).exists()
    if temp_dir(out).exists():
        assert f"kept in {temp_dir(out)}" in line and sorted(p.name for p in temp_dir(out).iterdir()) == ["job.json",
                                                                                                          "layers"]
    else:
        assert "kept" not in line
    if weight.endswith("q_proj.weight"):  # the first module: refused before any result, nothing is left
        assert not temp_dir(out).exists()
    shard.write_bytes(good)
    code, _, err = run([*HYDRATE, str(src), str(out)], capsys)
    assert code == 0, err
    assert _digests(out) == _digests(clean) and _leftovers(tmp_path) == []


def test_a_shard_cut_short_after_its_modules_are_encoded_is_named(tmp_path, capsys, fake_encoder):
    """A changed shard truncated while the run links the unchanged files: its copy refuses the kept tensor that no
    longer fits (naming shard and tensor) before writing it; the results are kept, and OUT is not written."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    shard = src / "model-00002-of-00002.safetensors"
    good = shard.read_bytes()

    def on_step(name: str) -> None:
        if name == "linked":
            shard.write_bytes(good[: len(good) - 100])

    out = tmp_path / "out"
    from exl3tool.errors import InputError

    with pytest.raises(InputError) as err:
        hydrate(plan_hydrate(ServerRequest(model=str(src)), out), device="cpu", encode=weight_encode,
                on_step=on_step)
    assert str(err.value).startswith(f"{shard}: tensor ") and "beyond the file's" in str(err.value)
    assert f"the 7 modules encoded so far are kept in {temp_dir(out)}" in str(err.value)
    assert not out.exists() and not lock_file(out).exists() and not (temp_dir(out) / "out").exists()


def test_a_refused_run_leaves_nothing(tmp_path, capsys, fake_encoder, monkeypatch):
    """A run that fails at its first module (the encoder raises an InputError, as a corrupt weight does): exit 2,
    and neither a temporary folder nor a lock is left."""
    from exl3tool.errors import InputError

    src = _checkpoint(tmp_path / "src", fresh_seed())

    def refuse(w, **k):
        raise InputError("model.layers.0.self_attn.q_proj.weight: refused by the test")

    monkeypatch.setattr("exl3tool.encode.encode_linear", refuse)
    code, _, err = run([*HYDRATE, str(src), str(tmp_path / "out")], capsys)
    assert code == 2 and "refused by the test" in _one_line(err) and "kept" not in err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_a_temporary_folder_without_results_is_reused_and_a_foreign_one_refused(tmp_path, capsys, fake_encoder):
    """Stopped while removing a temporary folder that kept nothing (its settings gone first): the same command reuses
    it; a folder of that name holding anything else is refused and left as it is."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    out = tmp_path / "out"
    (temp_dir(out) / "layers").mkdir(parents=True)
    (temp_dir(out) / "out").mkdir()
    code, _, err = run([*HYDRATE, str(src), str(out)], capsys)
    assert code == 0 and _leftovers(tmp_path) == [], err
    _remove_tree(out)
    temp_dir(out).mkdir()
    (temp_dir(out) / "notes.txt").write_text("mine")
    code, _, err = run([*HYDRATE, str(src), str(out)], capsys)
    assert code == 2 and "a partial hydrate with other settings (or not exl3tool's)" in _one_line(err)
    assert [p.name for p in temp_dir(out).iterdir()] == ["notes.txt"] and not lock_file(out).exists()


def test_results_stream_to_disk(tmp_path, fake_encoder, monkeypatch):
    """Host memory does not grow with the model: no module's EXL3 tensors (the encoder's, or the CPU copies that are
    saved) outlive the step that saved them; OUT is assembled from the kept files."""
    import exl3tool.operations.hydrate as hy

    src = _checkpoint(tmp_path / "src", fresh_seed())
    alive: list[weakref.ref] = []
    real = hy.exl3_tensors_of

    def tensors_of(module, trellis, suh, svh):
        got = real(module, trellis, suh, svh)
        alive.extend(weakref.ref(t) for t in (trellis, *got.values()))
        return got

    def on_step(name: str) -> None:
        if name.startswith("saved ") or name == "assembled":
            assert all(r() is None for r in alive), name  # the module just saved included

    monkeypatch.setattr(hy, "exl3_tensors_of", tensors_of)
    hydrate(plan_hydrate(ServerRequest(model=str(src)), tmp_path / "out"), device="cpu", encode=weight_encode,
            on_step=on_step)
    assert len(alive) == 7 * 5


def test_out_bytes_are_those_before_results_streamed(tmp_path):
    """The bytes of OUT, fixed by the code that kept every result in memory (this branch's base, commit 80549c3),
    for a fixed SOURCE and the tests' stand-in encoder; quantization_config.json's record has gained the sizes
    checked beyond those asked for since (hydrate-plan: ``tp_checked_up_to``, ``fails_at``), the rest unchanged.
    SOURCE's vocabulary is 512 (fix-check: the fork refuses a stored lm_head of 64 rows, N not 128-aligned, so the
    64 this test had made a SOURCE no server starts, which hydrate now refuses); the digests were recorded again by
    running commit 80549c3's own hydrate on this SOURCE."""
    src = write_llama_checkpoint(tmp_path / "src", hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                                 layers=2, vocab=512, shards=2, seed=1234)
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(src.iterdir())}
    assert sha == {"config.json": "fe2bac8f2c632c6a", "model-00001-of-00002.safetensors": "ffeed77ea6c384bc",
                   "model-00002-of-00002.safetensors": "621bc7960f0497e6",
                   "model.safetensors.index.json": "6c8f825ad0214e99",
                   "quantization_config.json": "b50b0f43383005c8"}, "the synthetic SOURCE changed: record again"
    hydrate(plan_hydrate(ServerRequest(model=str(src)), tmp_path / "out"), device="cpu", encode=weight_encode)
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted((tmp_path / "out").iterdir())}
    qc_sha = sha.pop("quantization_config.json")
    assert sha == {"config.json": "fe2bac8f2c632c6a", "model-00001-of-00002.safetensors": "3d69389b3b5300f0",
                   "model-00002-of-00002.safetensors": "67f50ccdfd1a74f3",
                   "model.safetensors.index.json": "c43c68eec646ad61"}
    qc = json.loads((tmp_path / "out" / "quantization_config.json").read_text())
    assert qc["exl3tool_hydrate"]["tp_checked_up_to"] == 8 and sorted(qc["exl3tool_hydrate"].pop("fails_at")) == ["2", "4"]
    del qc["exl3tool_hydrate"]["tp_checked_up_to"]
    assert hashlib.sha256((json.dumps(qc, indent=4) + "\n").encode()).hexdigest()[:16] == "4bc47cb5eee37421", qc_sha


# --------------------------------------------------------------------------------------------------------------
# only SOURCE's files reach OUT


def _no_out(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["file", "folder", "dangling", "loop", "fifo", "hub-escape"])
def test_what_is_not_sources_own_is_refused_by_name(tmp_path, capsys, case):
    """A link resolving outside SOURCE (a file: /etc/passwd; a folder), a dangling link, a link to a folder holding
    it, a fifo, and a Hub snapshot's link out of its repository: exit 2 before anything is written (the dry run
    too), naming the entry."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "token.txt").write_text("secret")
    if case == "hub-escape":
        src = write_llama_checkpoint(tmp_path / "plain", hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                                     layers=1, vocab=512, shards=2, hub_cache=tmp_path / "hub", seed=fresh_seed())
    entry = src / {"file": "notes.txt", "folder": "extra", "dangling": "gone.txt", "loop": "sub/up",
                   "fifo": "pipe", "hub-escape": "notes.txt"}[case]
    if case == "file":
        entry.symlink_to("/etc/passwd")
    elif case == "folder":
        entry.symlink_to(secret)
    elif case == "dangling":
        entry.symlink_to(tmp_path / "nothing")
    elif case == "loop":
        entry.parent.mkdir()
        entry.symlink_to("..")
    elif case == "fifo":
        os.mkfifo(entry)
    else:
        entry.symlink_to(secret / "token.txt")
    for extra in (["--dry-run"], []):
        code, _, err = run([*HYDRATE, str(src), str(tmp_path / "out"), *extra], capsys)
        line = _one_line(err)
        assert code == 2 and f"{entry}:" in line, (case, err)
        assert {"file": "outside SOURCE", "folder": "outside SOURCE", "dangling": "does not exist",
                "loop": "a folder that holds it", "fifo": "a fifo",
                "hub-escape": "outside its Hub repository"}[case] in line, line
        _no_out(tmp_path)


def test_links_inside_source_are_followed(tmp_path, fake_encoder):
    """A link to a file and a link to a folder, both inside SOURCE: OUT holds their files (hard links to SOURCE's
    own), none as a link; a Hub snapshot's files (links into its repository's blobs/) are followed likewise."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    (src / "docs").mkdir()
    (src / "docs" / "README.md").write_text("model card")
    (src / "README.md").symlink_to("docs/README.md")
    (src / "more").symlink_to("docs")
    hydrate(plan_hydrate(ServerRequest(model=str(src)), tmp_path / "out"), device="cpu", encode=weight_encode)
    out = tmp_path / "out"
    for rel in ("README.md", "more/README.md", "docs/README.md"):
        assert not (out / rel).is_symlink() and (out / rel).read_text() == "model card"
        assert os.stat(out / rel).st_ino == os.stat(src / "docs" / "README.md").st_ino
    assert not [p for p in out.rglob("*") if p.is_symlink()]


def test_a_file_swapped_for_a_link_after_the_plan_is_refused(tmp_path, capsys, fake_encoder):
    """SOURCE changed between the plan and the copy (a file replaced by a link out): refused naming it, not linked."""
    src = _checkpoint(tmp_path / "src", fresh_seed())
    plan = plan_hydrate(ServerRequest(model=str(src)), tmp_path / "out")
    (src / "config.json").rename(tmp_path / "config.json")
    (src / "config.json").symlink_to(tmp_path / "config.json")
    from exl3tool.errors import InputError

    with pytest.raises(InputError, match=r"config.json: now a link to .*not a file inside"):
        hydrate(plan, device="cpu", encode=weight_encode)
    assert not (tmp_path / "out").exists() and not lock_file(tmp_path / "out").exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
