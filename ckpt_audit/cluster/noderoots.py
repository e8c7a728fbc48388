"""Which directory on a node stands for a logical root, and how a node's partial is rebased onto that root.

Mechanism (docs/ray.md): on each worker, CKPT_AUDIT_NODE_ROOTS holds `LOGICAL=LOCAL[:LOGICAL=LOCAL...]`, or
`@PATH` naming a JSON file `{node_id_or_"*": {logical: local}}`. A node scans LOCAL and reports paths under
LOGICAL, so the driver reduces partials that all speak of the same logical tree with exactly the local scan code.
No entry: the node's copy of a root is the root itself (a real node-local disk mounted at the same path).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ckpt_audit.tree import FileFacts, Partial, Tree

ENV = "CKPT_AUDIT_NODE_ROOTS"


@dataclass(frozen=True, slots=True)
class NodePartials:
    """What one node returned: its id and one partial per logical root (already rebased)."""

    node_id: str
    partials: tuple[Partial, ...]


class NodeRootsError(ValueError):
    """CKPT_AUDIT_NODE_ROOTS could not be read: a one-line message for the user."""


def parse_node_roots(value: str | None, *, node_id: str = "*") -> dict[str, str]:
    """The logical -> local mapping for `node_id` from the env var's value (pure except for an @file read)."""
    if not value:
        return {}
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as fh:
                table = json.load(fh)
        except (OSError, ValueError) as exc:
            raise NodeRootsError(f"{ENV}: cannot read {value[1:]}: {exc}") from None
        if not isinstance(table, dict):
            raise NodeRootsError(f"{ENV}: {value[1:]} must hold a JSON object")
        entry = table.get(node_id, table.get("*", {}))
        if not isinstance(entry, dict):
            raise NodeRootsError(f"{ENV}: {value[1:]}: the entry for {node_id!r} must be a JSON object")
        return {str(k).rstrip("/"): str(v).rstrip("/") for k, v in entry.items()}
    out: dict[str, str] = {}
    for pair in value.split(":"):
        logical, sep, local = pair.partition("=")
        if not sep or not logical or not local:
            raise NodeRootsError(f"{ENV}: expected LOGICAL=LOCAL, got {pair!r}")
        out[logical.rstrip("/")] = local.rstrip("/")
    return out


def local_path(mapping: Mapping[str, str], path: str) -> str:
    """Where logical `path` lies on this node: under the LOCAL of the longest LOGICAL above it; else itself."""
    above = [k for k in mapping if path == k or path.startswith(k + "/")]
    return _swap(path, k, mapping[k]) if (k := max(above, key=len, default=None)) is not None else path


def _swap(path: str, old: str, new: str) -> str:
    return new + path[len(old) :] if path == old or path.startswith(old + "/") else path


def rebase_facts(facts: Mapping[str, FileFacts], *, old: str, new: str) -> dict[str, FileFacts]:
    """The facts under root `old` (others dropped) with their paths moved under `new`: the catalog's facts for a
    node, keyed by logical path, become the previous facts of its scan of its own directory."""
    below = old.rstrip("/") + "/"
    return {
        _swap(p, old, new): replace(
            f,
            path=_swap(f.path, old, new),
            findings=tuple(replace(x, path=_swap(x.path, old, new)) for x in f.findings),
        )
        for p, f in facts.items()
        if p == old or p.startswith(below)
    }


def rebase(part: Partial, *, local: str, logical: str) -> Partial:
    """`part` as if its files had been found under `logical` instead of `local` (every path it holds)."""
    if local == logical:
        return part

    def s(p: str) -> str:
        return _swap(p, local, logical)

    tree = Tree(
        dirs={s(d): v for d, v in part.tree.dirs.items()},
        files={s(d): v for d, v in part.tree.files.items()},
        dir_mtime_ns={s(d): v for d, v in part.tree.dir_mtime_ns.items()},
    )
    facts: Mapping[str, FileFacts] = {
        s(p): replace(f, path=s(f.path), findings=tuple(replace(x, path=s(x.path)) for x in f.findings))
        for p, f in part.facts.items()
    }
    return replace(
        part,
        root=s(part.root),
        tree=tree,
        facts=facts,
        findings=tuple(replace(f, path=s(f.path)) for f in part.findings),
        reused_paths=frozenset(s(p) for p in part.reused_paths),
    )
