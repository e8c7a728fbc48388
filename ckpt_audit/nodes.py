"""What a `scan --ray` adds to a ScanResult: which node holds which copy of each file (`ScanResult.cluster`).

Kept apart from `ckpt_audit.models` so that every other command (a local scan, ls, prune, ...) does not build these
two frozen dataclasses at start-up (about 1.7 ms each; bench/README.md, issue 16's fourth round).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCopy:
    """One node's copy of a file, as a `scan --ray` saw it (the stat is that node's own; the path is logical)."""

    node_id: str
    size_bytes: int
    mtime_ns: int
    inode: int
    hash: str | None = None
    verified_ns: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterView:
    """Which node holds what, for a scan made on a Ray cluster (`scan --ray`): what the catalog records per node."""

    answered: tuple[str, ...] = ()  # nodes whose scan came back
    silent: tuple[str, ...] = ()  # nodes that did not answer (or that held files before and are gone now)
    copies: Mapping[str, tuple[NodeCopy, ...]] = field(default_factory=dict)  # logical path -> copy per node
