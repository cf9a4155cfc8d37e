"""``cache check --nodes``: do the servers of a fleet compute the same identities, before a rollout?

Each node contributes one document gathered there: ``exl3tool identity ... --json`` (run on the node, with the
server's launch) or a provenance record a warm wrote on it (``<cache>/exl3tool-records/...json``). Both hold the
model and encoder identity payloads exactly as hashed, so two nodes that differ are told apart field by field with
``check.model_differences`` (the rule ``cache check`` uses against a record): a shard's mtime (per-node
``hf download --local-dir``), its size, the folder path, a marker file, the revision. Entries warmed on one node
hit on another only where every identity is equal.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from exl3tool.errors import InputError
from exl3tool.operations.check import Finding, encoder_differences, model_differences

__all__ = ["NodeIdentity", "FleetReport", "read_node", "compare_nodes"]

_MTIME_FIX = ("per-node downloads (hf download --local-dir) give every node its own mtimes: serve the Hub id with a "
              "pinned --revision from a shared Hugging Face cache (the identity is then the repo and commit, the same "
              "on every node), or copy one download to every node with mtimes kept (rsync -t, cp -p)")


@dataclass(frozen=True)
class NodeIdentity:
    """One node's identities as gathered there."""

    name: str
    source: str  # the file read
    model_identity: str
    model_payload: str
    encoder_identity: str
    encoder_payload: str

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "model_identity": self.model_identity,
                "encoder_identity": self.encoder_identity}


@dataclass(frozen=True)
class FleetReport:
    """Every node against the first one: the identity fields that differ, each with the fix."""

    nodes: tuple[NodeIdentity, ...]
    differences: tuple[tuple[str, Finding], ...]  # (node name, finding)

    @property
    def ok(self) -> bool:
        return not self.differences

    def as_json(self) -> dict[str, Any]:
        """The ``cache check --nodes --json`` document (docs/deploy.md)."""
        return {"ok": self.ok, "reference": self.nodes[0].name, "nodes": [n.as_json() for n in self.nodes],
                "differences": [{"node": name, **f.as_json()} for name, f in self.differences]}


def _payload(block: Any, what: str, path: str) -> tuple[str, str]:
    if not isinstance(block, dict) or not isinstance(block.get("identity"), str) \
            or not isinstance(block.get("payload"), str):
        raise InputError(f"{path}: no {what} identity and payload: give an `exl3tool identity --json` document "
                         "or a provenance record (exl3tool-records/*.json) gathered on the node")
    return block["identity"], block["payload"]


def read_node(spec: str) -> NodeIdentity:
    """``NAME=FILE`` or ``FILE`` (the node is then the record's host, else the file name)."""
    name, eq, path = spec.partition("=")
    if not eq:
        name, path = "", spec
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise InputError(f"--nodes {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise InputError(f"--nodes {path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InputError(f"--nodes {path}: not a JSON object")
    mid, mpay = _payload(doc.get("model"), "model", path)
    eid, epay = _payload(doc.get("encoder"), "encoder", path)
    host = doc.get("host") if isinstance(doc.get("host"), str) else None
    return NodeIdentity(name or host or os.path.basename(path), path, mid, mpay, eid, epay)


def _relabel(f: Finding, here: str, there: str) -> Finding:
    """``model_differences`` speaks of "here" and "when warmed": name the two nodes instead."""
    text = f.text.replace(" here", f" on {here}").replace("when warmed", f"on {there}")
    fix = _MTIME_FIX if " mtime " in f" {f.text}" else f.fix.replace("warm again here", f"warm again on {here}")
    return Finding(f.field, text, fix)


def compare_nodes(specs: list[str], reference: Optional[str] = None) -> FleetReport:
    """Read each node's document and compare its identities with the reference node's (the first by default)."""
    if len(specs) < 2:
        raise InputError("--nodes needs the documents of at least two nodes (one --nodes FILE per node)")
    nodes = [read_node(s) for s in specs]
    if reference is not None:
        nodes.sort(key=lambda n: n.name != reference)
    ref = nodes[0]
    out: list[tuple[str, Finding]] = []
    for node in nodes[1:]:
        if node.model_identity != ref.model_identity:
            found = model_differences(node.model_payload, ref.model_payload) or [Finding(
                "model_identity", f"model identity {node.model_identity[:16]} on {node.name}, "
                                  f"{ref.model_identity[:16]} on {ref.name}", "compare the two documents' payloads")]
            out += [(node.name, _relabel(f, node.name, ref.name)) for f in found]
        if node.encoder_identity != ref.encoder_identity:
            found = encoder_differences(node.encoder_payload, ref.encoder_payload) or [Finding(
                "encoder_identity", f"encoder identity {node.encoder_identity[:16]} on {node.name}, "
                                    f"{ref.encoder_identity[:16]} on {ref.name}", "start every node with the same "
                                    "VLLM_EXL3_ENCODER_SOURCE and VLLM_EXL3_ENCODER_REVISION")]
            out += [(node.name, _relabel(f, node.name, ref.name)) for f in found]
    return FleetReport(tuple(nodes), tuple(out))
