"""The catalog's memory of a cluster's nodes (scan --ray): which copies each node held, and when it last answered.

One module per catalog table family, as deep_verdicts, tracker_log and verdicts are: this one reads the `nodes`
and `file_nodes` tables (migration m005), which only scan --ray and prune --ray use.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field

from ckpt_audit.catalog.manifest import CatalogError, dcp_from_json, findings_from_json, pt_from_json
from ckpt_audit.tree import FileFacts


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeMemory:
    """What the catalog knows of a cluster's nodes (scan --ray): each node's present copies as FileFacts keyed by
    logical path (its own stat; the readers' findings and structure from the files row when the hashes agree,
    else never verified, so that copy is read again), when each node last answered a scan (None: never), and when a
    scan first asked it."""

    facts: dict[str, dict[str, FileFacts]]
    last_answered_ns: dict[str, int | None]
    first_seen_ns: dict[str, int] = field(default_factory=dict)  # the first scan that asked it (answered or not)


def read_nodes(path: str | os.PathLike[str]) -> NodeMemory:
    """The catalog's node memory (bare sqlite3, read-only); empty without a catalog or before any scan --ray."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return NodeMemory(facts={}, last_answered_ns={})
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise CatalogError(f"catalog {path}: {exc}") from None
    try:
        seen = conn.execute("SELECT node_id, last_answered_ns, first_seen_ns FROM nodes").fetchall()
        has_dcp = any(r[1] == "dcp_facts" for r in conn.execute("PRAGMA table_info(files)"))  # m006, as above
        rows = conn.execute(
            "SELECT n.node_id, n.path, n.size_bytes, n.mtime_ns, n.inode, n.hash, n.verified_ns,"
            " f.hash, f.crc_ok, f.file_findings, f.pt_facts, "
            + ("f.dcp_facts" if has_dcp else "NULL")
            + " FROM file_nodes n LEFT JOIN files f ON f.path = n.path WHERE n.present = 1"
        ).fetchall()
    except sqlite3.OperationalError:
        return NodeMemory(facts={}, last_answered_ns={})  # a catalog from before m005, or a fresh one
    except sqlite3.DatabaseError as exc:
        raise CatalogError(f"catalog is not a usable SQLite database: {exc}") from None
    finally:
        conn.close()
    facts: dict[str, dict[str, FileFacts]] = {}
    for node, p, size, mtime, inode, h, verified, file_hash, crc, ff, pt_doc, dcp_doc in rows:
        same = h is not None and h == file_hash  # the files row speaks of this very content
        pt, pt_whole = pt_from_json(pt_doc) if same else (None, False)
        facts.setdefault(node, {})[p] = FileFacts(
            path=p,
            size_bytes=size,
            mtime_ns=mtime,
            inode=inode,
            hash=h,
            crc_ok=None if not same or crc is None else bool(crc),
            findings=findings_from_json(ff, p) if same else (),
            pt=pt,
            verified_ns=verified if same and pt_whole else None,
            dcp=dcp_from_json(dcp_doc) if same else None,  # else the .metadata is read again (scan.read.vouched)
        )
    return NodeMemory(
        facts=facts,
        last_answered_ns={n: a for n, a, _ in seen},
        first_seen_ns={n: f for n, _, f in seen},
    )
