"""Encoder parity: may exl3tool write entries under the server's encoder identity?

The encoder identity in every cache key says *which encoder made the bytes*. exl3tool writes entries that the
server will load as its own encoder's output, so before it writes under an identity it did not make itself it
checks that claim:

* **identical by construction**, when the identity is exl3tool's own: files mode whose hashed files are this
  exl3tool's ``encoder-source`` export (the server then imports exl3tool's ``quantize_exl3``), or byte for byte the
  ``.py`` files of the exllamav3 release exl3tool is bit-exact with (1.6.5; ``OWN_LISTINGS``). Decided from the
  identity's payload, with no encode.
* **a probe** otherwise: one small layer (``PROBE_SHAPE``, a fixed bf16 weight) encoded by that encoder, loaded
  and called as the fork's loader does (``serving.parity_probe``), and by exl3tool's own, on one device; the
  tensors the server keeps (trellis, suh, svh) compared byte for byte: ``identical`` or ``differs``. The other
  encoder is a local copy (the files a files-mode identity hashes, ``--encoder-source DIR`` for a revision, or the
  server's root itself when it is on this host) run in a subprocess, or the image's own copy run with ``docker|podman run --rm`` (only when the runtime is on PATH;
  never pulled). Bytes from two platforms (a GPU in the image, the CPU here) are not compared.
* **unverified** when no copy of the other encoder can run here: said in one line, recorded, reported by
  ``cache check`` and ``verify``.

``differs`` refuses the write (exit 2) with the way forward (``exl3tool encoder-source`` into the image, so the
server runs exl3tool's encoder and the identity becomes exl3tool's), unless ``--trust-encoder-identity``; the
provenance record keeps the verdict either way.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from exl3tool.cache.records import PARITY_BASES, PARITY_STATUSES
from exl3tool.errors import ConfigError

__all__ = ["PARITY_STATUSES", "PARITY_BASES", "PROBE_SHAPE", "OWN_LISTINGS", "EncoderParity", "own_encoder",
           "encoder_parity", "refuse_message", "listing_digest", "probe_weight", "check_parity", "recorded_parity",
           "parity_line"]

PROBE_SHAPE = (128, 128)  # (out, in): the smallest shape the encoder takes (multiples of 128), 64 tiles
PROBE_PREFIX = "exl3tool.parity.probe"  # its seed is the fork's: crc32 of a prefix
# SHA-256 of the canonical file listing ([[path, sha256], ...], compact JSON, as the identity payload lists them) of
# encoder packages exl3tool is bit-exact with; computed from the release wheel (docs/images.md says how)
OWN_LISTINGS = {
    "f2680446e0faad5c8dd4ec71df543e1c053380ec75e1dab814abae0dcdca0ddf":
        "exllamav3 1.6.5 (the 265 .py files of exllamav3-1.6.5-py3-none-any.whl)",
}
_LOCAL_TIMEOUT_S = 600
_IMAGE_TIMEOUT_S = 600


@dataclass(frozen=True)
class EncoderParity:
    """The verdict on the claim "entries under this encoder identity are what the server's encoder would write"."""

    status: str  # identical | differs | unverified
    basis: str  # construction | probe | none
    detail: str  # one sentence: how it was decided, or why it could not be
    encoder_identity: str = ""
    probe: Optional[dict[str, Any]] = field(default=None)  # shape, bits, seed, device, theirs/ours digests

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "basis": self.basis, "detail": self.detail,
                "encoder_identity": self.encoder_identity, "probe": self.probe}

    @classmethod
    def from_json(cls, doc: dict) -> "EncoderParity":
        return cls(doc["status"], doc["basis"], doc["detail"], doc.get("encoder_identity", ""), doc.get("probe"))

    def line(self) -> str:
        """One line for stderr."""
        return f"encoder parity {self.status}: {self.detail}"


def listing_digest(files: list) -> str:
    """SHA-256 of a files-mode payload's listing, root left out (the same package anywhere gives the same digest)."""
    return hashlib.sha256(json.dumps(files, separators=(",", ":")).encode()).hexdigest()


def own_encoder(eid) -> str:
    """Why the encoder identity ``eid`` (``cache.identity.EncoderIdentity``) is exl3tool's own, or "" when not."""
    if eid.mode != "files":
        return ""  # a revision string says nothing about the bytes behind it
    from exl3tool.version import __version__
    from exl3tool.serving.encoder_source import is_current_export

    if eid.files_from and is_current_export(eid.files_from):
        return (f"the hashed files are this exl3tool's `encoder-source` export ({eid.files_from}, exl3tool "
                f"{__version__}): the server imports exl3tool's quantize_exl3, the encoder exl3tool writes with")
    known = OWN_LISTINGS.get(listing_digest(json.loads(eid.payload)["files"]))
    if known:
        return f"the hashed files are byte for byte {known}, with which exl3tool's encoder is bit-exact"
    return ""


def probe_weight(shape: tuple[int, int] = PROBE_SHAPE):
    """The probe layer's weight: fixed, Gaussian, bfloat16 (the dtype the server serves), never all zeros."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(PROBE_PREFIX.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def _request(bits: int, device: str) -> dict:
    """The probe request the child reads: the weight's bf16 bytes (base64), bits, the fork's seed, the device."""
    import torch

    w = probe_weight()
    raw = w.contiguous().view(torch.int16).numpy().tobytes()
    return {"shape": list(w.shape), "weight": base64.b64encode(raw).decode("ascii"), "bits": bits,
            "seed": zlib.crc32(PROBE_PREFIX.encode("utf-8")) & 0x7FFFFFFF, "device": device}


def _probe_source() -> str:
    from exl3tool.serving import parity_probe

    return Path(parity_probe.__file__).read_text(encoding="utf-8")


def _parse_child(done: subprocess.CompletedProcess, what: str) -> tuple[Optional[dict], str]:
    from exl3tool.serving.parity_probe import MARK

    for line in reversed((done.stdout or "").splitlines()):
        if line.startswith(MARK):
            try:
                result = json.loads(line[len(MARK):])
            except json.JSONDecodeError:
                break
            if result.get("ok"):
                return result, ""
            return None, f"{what} could not encode here ({result.get('error', 'no reason given')})"
    tail = ((done.stderr or "").strip().splitlines() or ["no output"])[-1][:200]
    return None, f"{what} did not run (exit {done.returncode}: {tail})"


def _run_local(root: str, request: dict) -> tuple[Optional[dict], str]:
    """The encoder at ``root`` (a directory here) in a fresh Python, as the server loads it."""
    what = f"the encoder at {root}"
    if not os.path.isfile(os.path.join(root, "modules", "quant", "exl3_lib", "quantize.py")):
        return None, f"{what} holds no modules/quant/exl3_lib/quantize.py, so it cannot be run"
    from exl3tool.serving import parity_probe

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EXL3_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # exl3tool itself, for an encoder-source export
    try:
        done = subprocess.run([sys.executable, parity_probe.__file__, root], input=json.dumps(request),
                              capture_output=True, text=True, timeout=_LOCAL_TIMEOUT_S, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{what} did not finish ({exc})"
    return _parse_child(done, what)


def _run_in_image(runner: str, image: str, root: str, request: dict, gpu: bool) -> tuple[Optional[dict], str]:
    """The image's own encoder at ``root`` (its path in the image), with ``runner run --rm``; never pulled."""
    what = f"the encoder {root} in the image {image} ({runner} run)"
    argv = [runner, "run", "--rm", "-i", "--pull=never", "--network=none"]
    if gpu:
        argv += ["--gpus", "all"] if os.path.basename(runner) == "docker" else ["--device", "nvidia.com/gpu=all"]
    argv += ["--entrypoint", "python", image, "-c", _probe_source(), root]
    try:
        done = subprocess.run(argv, input=json.dumps(request), capture_output=True, text=True,
                              timeout=_IMAGE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{what} did not finish ({exc})"
    return _parse_child(done, what)


def _ours(request: dict, device: str) -> dict:
    """exl3tool's own encoder on the probe, in this process, by the same convention (once per bits and device)."""
    return dict(_ours_cached(json.dumps(request, sort_keys=True), device))


@lru_cache(maxsize=8)
def _ours_cached(request_json: str, device: str) -> dict:
    from exl3tool.serving.parity_probe import call_like_server, device_name, weight_from
    from exl3tool.serving.quantize_api import quantize_exl3

    request = json.loads(request_json)
    out = call_like_server(quantize_exl3, weight_from(request), request["bits"], request["seed"], device)
    return {"ok": True, "device": device_name(device), **out}


def _other(eid, *, encoder_source: Optional[str], image: Optional[str], runner: Optional[str],
           root_here: Optional[str] = None, which=shutil.which) -> tuple[Optional[tuple[str, str, str]], str]:
    """Where the other encoder can run: ("local", dir, how) or ("image", runner path, how); else None and why."""
    root = json.loads(eid.payload)["root"]
    if encoder_source:
        return ("local", encoder_source, f"--encoder-source {encoder_source}"), ""
    if eid.mode == "files" and eid.files_from:
        return ("local", eid.files_from, f"the files the identity hashes ({eid.files_from})"), ""
    if root_here and os.path.isfile(os.path.join(root_here, "modules", "quant", "exl3_lib", "quantize.py")):
        return ("local", root_here, f"the server's encoder root {root} as found here ({root_here})"), ""
    if image:
        order = ("podman", "docker") if runner == "podman" else ("docker", "podman")
        path = next((p for t in order if (p := which(t))), None)
        if path is not None:
            return ("image", path, f"the image {image}'s own copy at {root}"), ""
        return None, (f"no copy of the encoder {root} at revision {json.loads(eid.payload).get('revision')} is "
                      f"here, and neither docker nor podman is on PATH to run the one in {image}")
    return None, (f"no copy of the encoder {root} at revision {json.loads(eid.payload).get('revision')} is here "
                  "and no image is known to run it in")


def encoder_parity(eid, *, bits: int, device: str = "cpu", encoder_source: Optional[str] = None,
                   image: Optional[str] = None, runner: Optional[str] = None,
                   root_here: Optional[str] = None) -> EncoderParity:
    """The parity of the encoder identity ``eid`` with exl3tool's encoder (see the module docstring).

    Args:
        eid: the server's encoder identity (``cache.identity.EncoderIdentity``).
        bits: the bits the probe encodes at (the warm's).
        device: where both encoders run the probe (``cpu``, ``cuda:N``).
        encoder_source: a local copy of the server's encoder (``--encoder-source``), for a revision identity.
        image, runner: the server's image and its runner, to run the image's own encoder in.
        root_here: where the server's encoder root is on this host (its own path for a server here, through a
            launch's mounts for a container; None when it is inside an image): run there when it holds an encoder.
    """
    why = own_encoder(eid)
    if why:
        return EncoderParity("identical", "construction", why, eid.identity)
    where, reason = _other(eid, encoder_source=encoder_source, image=image, runner=runner, root_here=root_here)
    fix = ("to compare, pass --encoder-source DIR (a copy of the server's encoder, the folder holding modules/) or "
           "run where docker/podman has the image; or make the server run exl3tool's encoder (`exl3tool "
           "encoder-source`, docs/images.md)")
    if where is None:
        return EncoderParity("unverified", "none", f"{reason}, so nothing shows it writes exl3tool's bytes; {fix}",
                             eid.identity)
    kind, target, how = where
    request = _request(bits, device)
    if kind == "local":
        theirs, error = _run_local(target, request)
    else:
        import torch

        theirs, error = _run_in_image(target, image or "", json.loads(eid.payload)["root"], request,
                                      gpu=torch.cuda.is_available())
    probe = {"shape": list(PROBE_SHAPE), "bits": bits, "seed": request["seed"], "encoder": how}
    if theirs is None:
        return EncoderParity("unverified", "none", f"{error}; {fix}", eid.identity, probe)
    run_on = device if kind == "local" or not theirs["device"].startswith("cuda") else "cuda:0"
    try:
        ours = _ours(request, run_on)
    except Exception as exc:  # exl3tool's encoder cannot run on the device the other one used
        return EncoderParity("unverified", "none", f"{how} ran on {theirs['device']}, where exl3tool's encoder "
                             f"cannot run here ({type(exc).__name__}: {str(exc)[:120]})", eid.identity, probe)
    probe.update(theirs={k: theirs[k] for k in ("device", "tensors", "proxy_error")},
                 ours={k: ours[k] for k in ("device", "tensors", "proxy_error")})
    if theirs["device"] != ours["device"]:
        return EncoderParity("unverified", "none", f"{how} ran on {theirs['device']} and exl3tool's on "
                             f"{ours['device']}: bytes of two platforms are not compared", eid.identity, probe)
    same = [n for n in ("trellis", "suh", "svh") if theirs["tensors"][n] == ours["tensors"][n]]
    shape = "x".join(map(str, PROBE_SHAPE))
    if len(same) == 3:
        return EncoderParity("identical", "probe", f"a {shape} probe layer at K={bits} encoded by {how} and by "
                             f"exl3tool on {ours['device']}: trellis, suh and svh byte for byte equal",
                             eid.identity, probe)
    differ = [n for n in ("trellis", "suh", "svh") if n not in same]
    return EncoderParity("differs", "probe", f"a {shape} probe layer at K={bits} encoded by {how} and by exl3tool "
                         f"on {ours['device']}: {', '.join(differ)} differ", eid.identity, probe)


def refuse_message(parity: EncoderParity) -> str:
    """The one line a ``differs`` verdict refuses a write with, and the way forward."""
    return (f"encoder parity differs: {parity.detail}; entries written under the encoder identity "
            f"{parity.encoder_identity[:16]} would be served as that encoder's output. Make the server run exl3tool's "
            "encoder (`exl3tool encoder-source DIR` into the image and VLLM_EXL3_ENCODER_SOURCE=DIR, docs/images.md), "
            "then warm for that identity; or pass --trust-encoder-identity to write anyway (recorded as differs)")


def check_parity(parity: EncoderParity, trust: bool) -> None:
    """Refuse (ConfigError, exit 2) a ``differs`` verdict unless trusted."""
    if parity.status == "differs" and not trust:
        raise ConfigError(refuse_message(parity))


def recorded_parity(records, model_identity: str, encoder_identity: str, digests) -> list[dict[str, Any]]:
    """What the provenance records say of the encoder parity of the entries ``digests`` (of these identities): one
    item per record that holds some of them and a verdict, newest first (``cache check`` and ``verify`` report
    them)."""
    digests = set(digests)
    out = []
    for sr in records:
        r = sr.record
        if r is None or r.encoder_parity is None or (r.model_identity, r.encoder_identity) != (model_identity,
                                                                                                 encoder_identity):
            continue
        n = len(digests & r.digests)
        if n:
            p = r.encoder_parity
            out.append({"status": p["status"], "basis": p["basis"], "detail": p["detail"], "entries": n,
                        "record": str(sr.path), "time": r.time, "host": r.host, "command": r.command})
    return sorted(out, key=lambda item: item["time"], reverse=True)


def parity_line(item: dict[str, Any]) -> tuple[str, str]:
    """(what, fix) for a recorded verdict that is not ``identical``: one report line and its way forward."""
    what = (f"{item['entries']} entr{'y' if item['entries'] == 1 else 'ies'} written under this encoder identity by "
            f"{item['command']} on {item['host']} at {item['time']} with encoder parity {item['status']}: "
            f"{item['detail']}")
    if item["status"] == "differs":
        fix = ("the server loads them as its own encoder's output, and a probe gave other bytes: make the server run "
               "exl3tool's encoder (`exl3tool encoder-source`, docs/images.md) and warm for that identity, or remove "
               "them (`exl3tool cache prune`)")
    else:
        fix = ("the server loads them as its own encoder's output, unchecked: warm again with --encoder-source DIR "
               "(a copy of the server's encoder) or --image NAME where docker/podman runs it, or make the server run "
               "exl3tool's encoder (`exl3tool encoder-source`)")
    return what, fix
