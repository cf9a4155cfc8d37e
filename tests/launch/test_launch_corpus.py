"""The launch corpus (tests/data/launches/): launch forms modeled on the fork's users' public deployment material,
each run as written through ``identity``, ``cache warm --dry-run``, a real ``cache warm`` (fake encoder: plan,
pipeline and store are real) and ``cache check``.

Hit or miss is decided by the tests' independent server (``helpers.server_lookup``, ``server_model_identity``,
``server_encoder_identity``: written from the spec, no exl3tool code) run in the server's own filesystem
(``fake_server.in_server_view``: the case's volumes bind-mounted at their container paths, chrooted; a host
command runs in this filesystem). The check must agree with it on every look-up, after the warm (all hit) and
after each case's perturbation (a touched shard, a repointed link, an edited encoder file: all miss). The plan's
reference is exl3tool's own flags with the settings the case's header says the server derives.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from seeds import fresh_bytes, fresh_seed
import yaml
from huggingface_hub import snapshot_download  # imported here: the fake container has no Python library

import exl3tool.operations.warm.run as warm_request
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.checkpoint.tiny import write_qwen35

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_server
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers
from fake_server import in_server_view  # noqa: E402
from helpers import TINY, TINY_REPO as REPO  # noqa: E402
from helpers import (fake_encode, server_encoder_identity, server_lookup, server_model_identity,  # noqa: E402
                     transformers_commit_hash, tree)

DATA = Path(__file__).resolve().parents[1] / "data" / "launches"
FORMS = {".launch": "launch", ".argv": "argv", ".sh": "launch-file", ".yml": "compose", ".dryrun": "launch-file",
         ".service": "launch-file", ".mk": "launch-file"}
CASES = sorted(p for p in DATA.iterdir() if p.is_file() and p.suffix in FORMS)
DEFAULT_OVERLAY = '{"linear":{"weight":"mxfp8"}}'


def _header(path: Path) -> dict:
    """The ``#|`` lines of a case, read as YAML (``modeled_on:`` is free text, kept as written)."""
    lines = [line[3:] if line.startswith("#| ") else line[2:] for line in path.read_text().splitlines()
             if line.startswith("#|")]
    prose = [line for line in lines if line.startswith("modeled_on:")]
    header = yaml.safe_load("\n".join(line for line in lines if line not in prose))
    header["modeled_on"] = " ".join(line.split(":", 1)[1].strip() for line in prose)
    return header


def _seed() -> int:
    return fresh_seed(16)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """The checkpoints every case copies (fresh seeds, printed), an encoder package, and a docker/podman on PATH
    that answers ``image inspect`` with images.json (no engine here)."""
    root = tmp_path_factory.mktemp("corpus-sources")
    seeds = {name: _seed() for name in ("llama", "llama-v1", "qwen35", "hub", "llama-odd")}
    print(f"launch corpus seeds: {seeds}")
    src = dict(root=root, seeds=seeds)
    src["llama"] = write_llama_checkpoint(root / "tiny-llama", **TINY, seed=seeds["llama"])
    src["llama-v1"] = write_llama_checkpoint(root / "tiny-llama-v1", **TINY, seed=seeds["llama-v1"])
    src["qwen35"] = write_qwen35(root / "qwen3.5-tiny", seed=seeds["qwen35"])
    # one decoder layer whose MLP shard at TP 2 is 168 wide: neither 128-aligned nor a multiple of 32 (fork #311)
    src["llama-odd"] = write_llama_checkpoint(root / "odd-llama", **{**TINY, "intermediate": 336, "layers": 1},
                                              seed=seeds["llama-odd"])
    snapshot = write_llama_checkpoint(root / "hub-files", **TINY, seed=seeds["hub"], hub_cache=root / "hf" / "hub",
                                      repo_id=REPO)
    src["hf"], src["snapshot"] = root / "hf", snapshot.name
    enc = root / "encoder"
    (enc / "exllamav3" / "modules").mkdir(parents=True)
    for rel in ("exllamav3/__init__.py", "exllamav3/modules/quant.py", "exllamav3/modules/trellis.py"):
        (enc / rel).write_text(f"# {rel}\nTOKEN = {fresh_bytes(8).hex()!r}\n")
    src["encoder"] = enc
    images = json.loads((DATA / "images.json").read_text())  # image -> its Config.Env list, or its Config object
    cases = "".join(f"  {shlex.quote(image)}) printf '%s\\n' {shlex.quote(json.dumps(config))} ;;\n"
                    for image, config in images.items())
    bindir = root / "bin"
    bindir.mkdir()
    for tool in ("docker", "podman"):
        (bindir / tool).write_text(
            "#!/bin/sh\n[ \"$1 $2 $3\" = \"image inspect --format\" ] || { echo \"unexpected: $*\" >&2; exit 3; }\n"
            f"case \"$5\" in\n{cases}  *) echo \"Error: No such image: $5\" >&2; exit 1 ;;\nesac\n")
        (bindir / tool).chmod(0o755)
    src["bin"] = bindir
    return src


@dataclass
class Case:
    path: Path
    header: dict
    dir: Path
    args: list[str]
    subs: dict[str, str]

    @property
    def server(self) -> dict:
        return self.header["server"]

    @property
    def mounts(self) -> dict[str, Path] | None:
        """Container path -> host folder, or None for a host command (its view is this filesystem)."""
        mounts = self.header.get("mounts")
        return {self.sub(k): Path(self.sub(v)) for k, v in mounts.items()} if mounts else None

    @property
    def root(self) -> Path | None:
        """The host folder that is the server's ``/`` (a proot or chroot guest's root), or None (an empty one)."""
        root = self.header.get("root")
        return Path(self.sub(root)) if root else None

    def sub(self, text):
        if not isinstance(text, str):
            return text
        for name, value in self.subs.items():
            text = text.replace(name, value)
        return text

    def resolved(self) -> str:
        return self.sub(self.server["model_resolved"])

    def host_path(self, inside: str) -> Path:
        """Where a path of the server's view is on this host (the longest mount that holds it)."""
        if self.mounts is None:
            return Path(inside)
        for target in sorted(self.mounts, key=len, reverse=True):
            if inside == target or inside.startswith(target.rstrip("/") + "/"):
                return self.mounts[target] / os.path.relpath(inside, target)
        if self.root is not None:
            return self.root / inside.lstrip("/")
        raise AssertionError(f"{inside} is on no mount of {self.path.name}")


def _materialize(path: Path, sources: dict, root: Path) -> Case:
    """The case's host folders (a fresh copy of its checkpoint), its files with the placeholders filled in."""
    header = _header(path)
    d = root / "case"
    models, cache, jit, hf, enc = (d / n for n in ("models", "cache", "jit", "hf", "encoder"))
    models.mkdir(parents=True)
    for p in (cache, jit):
        p.mkdir()
    kind = header["model"]
    if kind == "llama":
        shutil.copytree(sources["llama"], models / "tiny-llama")
    elif kind == "linked":
        shutil.copytree(sources["llama"], models / "v2")
        shutil.copytree(sources["llama-v1"], models / "v1")
        os.symlink("v2", models / "current")
    elif kind == "qwen35":
        shutil.copytree(sources["qwen35"], models / "qwen3.5-tiny")
    elif kind == "llama-odd":
        shutil.copytree(sources["llama-odd"], models / "odd-llama")
    elif kind != "hub":
        raise AssertionError(f"{path.name}: unknown model {kind!r}")
    shutil.copytree(sources["hf"], hf, symlinks=True) if kind == "hub" else hf.mkdir()
    shutil.copytree(sources["encoder"] / "exllamav3", enc)
    subs = {"@MODELS@": str(models), "@CACHE@": str(cache), "@JIT@": str(jit), "@HF@": str(hf),
            "@ENCODER@": str(enc), "@SNAPSHOT@": sources["snapshot"], "@DIR@": str(d)}

    def fill(text: str) -> str:
        for name, value in subs.items():
            text = text.replace(name, value)
        return text

    folders = [path.with_suffix(".files")]
    if header.get("launchers") == "shared":  # the launcher scripts several cases run, kept once (launchers/)
        folders.insert(0, DATA / "launchers")
    for extra in folders:
        for f in sorted(extra.rglob("*")) if extra.is_dir() else ():
            if f.is_file():
                (d / f.relative_to(extra)).parent.mkdir(parents=True, exist_ok=True)
                (d / f.relative_to(extra)).write_text(fill(f.read_text()))
                (d / f.relative_to(extra)).chmod(f.stat().st_mode & 0o777)  # a launcher keeps its x bit
    text = fill(path.read_text())
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#|"))
    form = FORMS[path.suffix]
    if form == "launch":
        args = ["--launch", body]
    elif form == "argv":
        args = ["--", *shlex.split(body)]
    else:
        target = d / (path.name if form == "launch-file" else "docker-compose.yml")
        target.write_text(text)
        target.chmod(0o755)
        args = ["--launch-file" if form == "launch-file" else "--compose", str(target)]
    case = Case(path, header, d, args, subs)
    if case.root is not None:  # a guest root: the encoder package is inside it, where the server reads it
        case.root.mkdir(parents=True, exist_ok=True)
        inside = case.host_path(case.sub(header["server"]["encoder_root"]))
        if not inside.exists():
            shutil.copytree(enc, inside)
    return case


def _server(case: Case, entries: list[tuple]) -> dict:
    """The independent server in its own view: the model folder it serves (vLLM's HF_HUB_OFFLINE rewrite through
    huggingface_hub's own snapshot_download), the identities it computes, and its look-up of each entry."""
    s = case.server
    model, hub_cache, root = case.sub(s["model"]), s.get("hf_hub_cache"), case.sub(s["cache_root"])
    enc_root, enc_rev, bits, tp = case.sub(s["encoder_root"]), s["encoder_revision"], s["bits"], s["tp"]
    revision = case.sub(s.get("revision"))  # a Hub repo served online: the revision the server is started with

    def answer():
        folder = snapshot_download(repo_id=model, cache_dir=hub_cache, local_files_only=True) if hub_cache else model
        mid = server_model_identity(folder, revision=revision, commit_hash=transformers_commit_hash(folder))
        eid = server_encoder_identity(enc_root, enc_rev)
        hits = [server_lookup(root, mid, eid, prefix, bits, tp, rank, k, n) is not None
                for prefix, rank, k, n in entries]
        return dict(resolved=os.path.realpath(folder), model=mid, encoder=eid, hits=hits)

    if case.mounts is not None:
        return in_server_view(case.root or case.dir.parent / "rootfs", case.mounts, answer)
    cwd = os.getcwd()
    os.chdir(case.sub(s.get("cwd")) or cwd)
    try:
        return answer()
    finally:
        os.chdir(cwd)


def _lookups(doc: dict) -> list[tuple]:
    return [(e["prefix"], e["tp_rank"], e["input_size"], e["output_size"]) for e in doc["entries"]]


def _reference_plan(cli, case: Case, tmp: Path) -> set[tuple]:
    """The look-ups from exl3tool's own flags with the header's settings (no launch read): the plan's reference."""
    s = case.server
    model = case.host_path(case.resolved())
    if s.get("hf_overrides"):  # the config the server builds: flat keys set (all the corpus uses)
        baked = tmp / "baked"
        shutil.copytree(model, baked)
        config = json.loads((baked / "config.json").read_text())
        config.update(s["hf_overrides"])
        (baked / "config.json").write_text(json.dumps(config))
        model = baked
    args = [model, "--tp-size", s["tp"], "--bits", s["bits"], "--quantization-config", s["overlay"],
            "--encoder-root", s["encoder_root"], "--cache-dir", tmp / "reference-cache"]
    args += (["--encoder-revision", s["encoder_revision"]] if s["encoder_revision"]
             else ["--encoder-source", case.host_path(case.sub(s["encoder_root"]))])
    code, out, err = cli("cache", "warm", "--dry-run", "--json", *args)
    assert code == 0, err
    return {(j["prefix"], j["tp_size"], j["tp_rank"], j["input_size"], j["output_size"])
            for j in json.loads(out)["jobs"]}


def _settings_agree(case: Case, settings: dict) -> None:
    """What exl3tool read from the launch is what the header says the server derives."""
    s = case.server
    value = {k: v["value"] for k, v in settings.items()}
    assert value["tp_size"] == s["tp"] and value["bits"] == s["bits"], value
    assert value["encoder_root"] == case.sub(s["encoder_root"]), value
    assert value["encoder_revision"] == s["encoder_revision"], value
    assert value["cache_dir"] == case.sub(s["cache_root"]), value
    assert json.loads(value["quantization_config"]) == json.loads(s["overlay"]), value
    if s.get("revision"):  # a Hub repo served online: named by its id, pinned to the commit
        assert (value["model"], value["revision"]) == (s["model"], case.sub(s["revision"])), value
        return
    served = value.get("server_path_resolved") or value.get("server_path") or value["model_here"]
    assert served == case.resolved(), value


def _perturb(case: Case) -> None:
    what = case.header["perturb"].split()
    if what[0] == "touch-shard":
        shard = sorted(case.host_path(case.resolved()).glob("*.safetensors"))[0]
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))  # a link's target, as the server stats
    elif what[0] == "relink":
        link = Path(case.subs["@MODELS@"]) / what[1]
        link.unlink()
        os.symlink(what[2], link)
    elif what[0] == "edit-encoder":
        f = case.host_path(case.sub(case.server["encoder_root"])) / "modules" / "quant.py"
        f.write_text(f.read_text() + "# patched\n")
    else:
        raise AssertionError(f"{case.path.name}: unknown perturbation {what}")


def _fake_encoder(monkeypatch) -> None:
    real = getattr(warm_request.run_plan, "__wrapped__", warm_request.run_plan)
    monkeypatch.setattr(warm_request, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))


@pytest.fixture()
def case_env(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{sources['bin']}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # exl3tool's own Hub cache and defaults: nothing there
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # a relative path in a launch is the launch's, not ours
    _fake_encoder(monkeypatch)


def test_corpus_is_large_enough():
    headers = {p.name: _header(p) for p in CASES}
    assert len(headers) >= 18
    assert sum(h["expect"] == "all-hit" for h in headers.values()) >= 15
    assert sum(isinstance(h["expect"], dict) for h in headers.values()) >= 3
    assert sum(bool(h.get("perturb")) for h in headers.values()) >= 3
    assert set(FORMS.values()) <= {FORMS[Path(n).suffix] for n in headers}
    for name, h in headers.items():
        assert h["modeled_on"] and h["server"]["model_resolved"], name


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_launch_case(path, sources, tmp_path, cli, case_env, monkeypatch):
    case = _materialize(path, sources, tmp_path)
    for name, value in (case.header.get("host_env") or {}).items():  # exl3tool's own environment (a CI host)
        monkeypatch.setenv(name, case.sub(value))
    cache_host = case.host_path(case.sub(case.server["cache_root"]))

    unnamed = case.header.get("release_unnamed")
    if unnamed:  # the answer depends on the release and nothing names it: no plan, no write, until it is named
        for command in (("cache", "warm", "--dry-run"), ("cache", "warm"), ("cache", "check")):
            code, _, err = cli(*command, *case.args)
            assert code == 2 and unnamed in err and "--server-release NAME" in err, (command, err)
        assert not tree(cache_host)
        case.args[:0] = ["--server-release", case.server["release"]]

    expect = case.header["expect"]
    if isinstance(expect, dict) and "refused" in expect:
        _refused(cli, case, expect["refused"], cache_host)
        return

    # identity: the server's identities, and the folder it serves is the one the header names
    code, out, err = cli("identity", "--json", *case.args)
    assert code == 0, err
    ident = json.loads(out)
    server = _server(case, [])
    if not case.server.get("revision"):  # a Hub repo served online has no folder; its identity names the repo
        assert server["resolved"] == case.resolved()
    assert (ident["model"]["identity"], ident["encoder"]["identity"]) == (server["model"], server["encoder"])

    if isinstance(expect, dict):
        _no_lookup(cli, case, expect["no_lookup"], cache_host, tmp_path)
        return
    assert expect in ("all-hit", "planned")

    # the plan: the header's settings, and the reference's look-ups
    code, out, err = cli("cache", "warm", "--dry-run", "--json", *case.args)
    assert code == 0, err
    plan = json.loads(out)
    _settings_agree(case, plan["settings"])
    jobs = {(j["prefix"], j["tp_size"], j["tp_rank"], j["input_size"], j["output_size"]) for j in plan["jobs"]}
    assert jobs and jobs == _reference_plan(cli, case, tmp_path)
    # every look-up misses before a warm; a shard the server keeps BF16 (llama-odd) is planned as skipped
    assert {j["state"] for j in plan["jobs"]} <= {"miss", "skipped"} and not tree(cache_host)
    assert any(j["state"] == "miss" for j in plan["jobs"])

    if expect == "planned":  # no warm (a cheap case): the check and the server agree that every look-up misses
        code, out, err = cli("cache", "check", "--json", *case.args)
        doc = json.loads(out)
        assert code == 1 and doc["server_lookup"] is True, err
        if case.header.get("starts"):  # the server starts: no start-up failure is claimed for it
            assert not doc["start_failures"], doc["start_failures"]
        server = _server(case, _lookups(doc))
        assert server["hits"] and not any(server["hits"]) and {e["state"] for e in doc["entries"]} == {"miss"}
        print(f"{path.stem} (seeds {sources['seeds']}): {len(server['hits'])} look-ups of {server['resolved']}, "
              "all miss for both before a warm")
        return

    # a real warm (fake encoder) writes where the server reads: every look-up hits for the server, and the check
    code, out, err = cli("cache", "warm", "--json", *case.args)
    assert code == 0, err
    warmed = json.loads(out)
    assert warmed["counts"] == {"encoded": len(jobs), "failed": 0, "hit": 0, "skipped": 0}, warmed["counts"]
    assert {Path(e["path"]).parent.parent.parent for e in warmed["entries"]} == {cache_host / "v1"}
    code, out, err = cli("cache", "check", "--json", *case.args)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["server_lookup"] is True, err
    lookups = _lookups(doc)
    assert {(p, case.server["tp"], r, k, n) for p, r, k, n in lookups} == jobs
    server = _server(case, lookups)
    assert all(server["hits"]) and [e["state"] for e in doc["entries"]] == ["hit"] * len(lookups)
    said = f"{path.stem} (seeds {sources['seeds']}): {len(lookups)} look-ups of {server['resolved']}, all hit"
    if not case.header.get("perturb"):
        print(said)  # after the last command: the cli fixture reads (and drops) what was printed before each one
        return
    _perturb(case)
    code, out, err = cli("cache", "check", "--json", *case.args)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False, err
    server = _server(case, _lookups(doc))
    assert not any(server["hits"]), "the perturbation must make the server miss"
    assert [e["state"] == "hit" for e in doc["entries"]] == server["hits"]
    assert doc["causes"], doc
    print(f"{said}; after {case.header['perturb']}: {len(server['hits'])} look-ups, all miss for both")


def _no_lookup(cli, case: Case, reason: str, cache_host: Path, tmp: Path) -> None:
    """The server encodes nothing online, so it looks nothing up: even with every entry of the header's settings in
    place, the check is a finding (exit 1, 0 look-ups, the reason), and a warm refuses (exit 2, nothing written)."""
    s = case.server
    model = case.host_path(case.resolved())
    args = [model, "--server-path", case.resolved(), "--tp-size", s["tp"], "--bits", s["bits"],
            "--quantization-config", s["overlay"] or DEFAULT_OVERLAY, "--encoder-root", s["encoder_root"],
            "--encoder-revision", s["encoder_revision"], "--cache-dir", cache_host]
    code, _, err = cli("cache", "warm", "--json", *args)  # the cache is warm for the same server with look-ups on
    assert code == 0, err
    before = tree(cache_host)
    code, out, err = cli("cache", "check", "--json", *case.args)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False, err
    assert doc["server_lookup"] is False and doc["lookups"] == 0 and any(reason in r for r in doc["lookup_off"]), doc
    code, out, err = cli("cache", "check", *case.args)
    assert code == 1 and out.startswith("0 look-ups: this launch encodes nothing online, because "), out
    for command in (("cache", "warm", "--dry-run"), ("cache", "warm")):
        code, _, err = cli(*command, *case.args)
        assert code == 2 and "makes no cache look-up" in err and reason in err, err
    assert tree(cache_host) == before


def _refused(cli, case: Case, said: str, cache_host: Path) -> None:
    """A launch exl3tool does not follow (a wrapper that runs the server elsewhere, an entrypoint it cannot read):
    every command stops with one line naming it (exit 2), and nothing is planned or written."""
    for command in (("identity",), ("cache", "check"), ("cache", "warm")):
        code, out, err = cli(*command, *case.args)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (command, err)
        assert "Traceback" not in err and not out.strip()
    assert not tree(cache_host)
