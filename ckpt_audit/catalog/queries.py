"""The catalog's reads: what `ls`, `show`, the TUI, `latest`, continuity and the session ask of the recorded scans.

`CatalogQueries` is the read half of `store.Catalog` (which holds the connection and records scans): a catalog opened
read-only (`read_catalog`) answers every one of these.
"""

from __future__ import annotations

import json
import os

from ckpt_audit.catalog.manifest import as_shard_files, pt_from_json, read_previous
from ckpt_audit.catalog.sqlite import Db
from ckpt_audit.models import ShardFile
from ckpt_audit.rules.megatron_v2 import optimizer_format
from ckpt_audit.tree import FileFacts


class CatalogQueries:
    """The reads of an open catalog, over its connection `db`."""

    db: Db

    def previous_facts(self) -> dict[str, FileFacts]:
        return read_previous(self.db.conn)

    def previous_manifest(self) -> dict[str, ShardFile]:
        kinds = {
            p: (k, r, w)
            for p, k, r, w in self.db.execute(
                "SELECT path, kind, rank, world_size FROM files WHERE present = 1"
            ).fetchall()
        }
        return as_shard_files(self.previous_facts(), kinds)

    def _rows(self, sql: str, params: list | tuple = ()) -> list[dict]:
        cur = self.db.execute(sql, params)
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    def scans(self, limit: int = 20) -> list[dict]:
        rows = self._rows("SELECT * FROM scans ORDER BY id DESC LIMIT ?", [limit])
        for r in rows:
            r["roots"] = json.loads(r["roots"])
        return rows

    def runs(self, *, include_absent: bool = False) -> list[dict]:
        """Runs: path, name, layout, tracker_step, n_checkpoints, latest_complete_step, size_bytes, statuses."""
        rows = self._rows(
            "SELECT path, name, layout, tracker_step, metrics_path, n_checkpoints, latest_complete_step, size_bytes,"
            " last_scan_id, present FROM runs" + ("" if include_absent else " WHERE present = 1") + " ORDER BY path"
        )
        counts: dict[str, dict[str, int]] = {}
        for run_path, status, n in self.db.execute(
            "SELECT run_path, status, COUNT(*) FROM checkpoints WHERE present = 1 GROUP BY run_path, status"
        ):
            counts.setdefault(run_path, {})[status] = n
        for r in rows:
            r["statuses"] = counts.get(r["path"], {})
        return rows

    def checkpoints(self, run_path: str | None = None) -> list[dict]:
        """Present checkpoints (of one run, or all): run_path, step, path, status, world_size, size_bytes,
        mtime_ns, errors, warnings — from the checkpoint_status view — and verified_ns (its files' oldest last
        verification by content; None when one never was)."""
        where, params = ("WHERE run_path = ?", [run_path]) if run_path is not None else ("", [])
        rows = self._rows(
            f"SELECT *, {_OLDEST_VERIFIED.format(ckpt='checkpoint_status.path')} AS verified_ns,"
            f" {_NODES.format(ckpt='checkpoint_status.path')} AS nodes"
            f" FROM checkpoint_status {where} ORDER BY run_path, step",
            params,
        )
        for r in rows:
            r["nodes"] = sorted(r["nodes"].split(",")) if r["nodes"] else []
        return rows

    def latest_complete(self) -> list[dict]:
        return self._rows("SELECT * FROM latest_complete_checkpoint ORDER BY run_path")

    def checkpoint_detail(self, path: str) -> dict | None:
        """One checkpoint with its files and the findings of its latest scan; None if unknown."""
        path = path.rstrip("/") or "/"
        rows = self._rows("SELECT * FROM checkpoints WHERE path = ?", [path])
        if not rows:
            return None
        ckpt = rows[0]
        ckpt["components"] = json.loads(ckpt["components"])
        ckpt["verified_ns"] = self.db.execute(f"SELECT {_OLDEST_VERIFIED.format(ckpt='?')}", [path]).fetchone()[0]
        ckpt["files"] = self._rows(
            "SELECT path, role, kind, rank, world_size, size_bytes, mtime_ns, inode, hash, crc_ok, verified_ns, present"
            " FROM files WHERE checkpoint_path = ? ORDER BY path",
            [path],
        )
        held: dict[str, list[str]] = {}
        for p, node in self.db.execute(
            "SELECT n.path, n.node_id FROM file_nodes n JOIN files f ON f.path = n.path"
            " WHERE f.checkpoint_path = ? AND n.present = 1 ORDER BY n.node_id",
            [path],
        ):
            held.setdefault(p, []).append(node)
        for f in ckpt["files"]:
            f["crc_ok"] = None if f["crc_ok"] is None else bool(f["crc_ok"])
            f["nodes"] = held.get(f["path"], [])  # scan --ray: the nodes holding a copy; [] for a local scan
        ckpt["nodes"] = sorted({n for ns in held.values() for n in ns})
        ckpt["findings"] = self._rows(
            "SELECT severity, code, path, message, rank, tensor FROM findings"
            " WHERE checkpoint_path = ? AND scan_id = ? ORDER BY id",
            [path, ckpt["last_scan_id"]],
        )
        ckpt["optimizer_format"] = self._optimizer_format(path)
        return ckpt

    def _optimizer_format(self, ckpt_path: str) -> list[dict]:
        """Each Megatron dist_ckpt's optimizer format flags, as its common.pt records them (rules.megatron_v2)."""
        out = []
        for p, role, doc in self.db.execute(
            "SELECT path, role, pt_facts FROM files WHERE checkpoint_path = ? AND kind = 'common' AND present = 1"
            " ORDER BY path",
            [ckpt_path],
        ):
            pt, _whole = pt_from_json(doc)
            if pt is not None and pt.meta:
                out.append({"path": os.path.dirname(p), "role": role, **optimizer_format(dict(pt.meta))})
        return out

    def file_nodes(self) -> dict[str, tuple[str, ...]]:
        """Logical file path -> the nodes holding a present copy (scan --ray); {} when no scan --ray was recorded."""
        out: dict[str, list[str]] = {}
        for p, node in self.db.execute("SELECT path, node_id FROM file_nodes WHERE present = 1 ORDER BY node_id"):
            out.setdefault(p, []).append(node)
        return {p: tuple(ns) for p, ns in out.items()}

    def file_history(self, path: str) -> list[dict]:
        """Each recorded hash of one file: scan_id, started_ns, hash, size_bytes, mtime_ns (oldest first)."""
        return self._rows(
            "SELECT h.scan_id, s.started_ns, h.hash, h.size_bytes, h.mtime_ns FROM hash_history h"
            " JOIN scans s ON s.id = h.scan_id WHERE h.path = ? ORDER BY h.scan_id",
            [path],
        )

    def findings(self, scan_id: int | None = None) -> list[dict]:
        if scan_id is None:
            row = self.db.execute("SELECT MAX(id) FROM scans").fetchone()
            scan_id = row[0] if row else None
        return self._rows("SELECT * FROM findings WHERE scan_id = ? ORDER BY id", [scan_id])


# the nodes (scan --ray) holding a present copy of a checkpoint's present files, comma-joined; NULL: none known
_NODES = (
    "(SELECT GROUP_CONCAT(DISTINCT n.node_id) FROM file_nodes n JOIN files f ON f.path = n.path"
    " WHERE f.checkpoint_path = {ckpt} AND f.present = 1 AND n.present = 1)"
)

# a checkpoint was last verified by content when its least recently verified present file was; never (NULL) if one
# of them never was
_OLDEST_VERIFIED = (
    "(SELECT CASE WHEN COUNT(*) = 0 OR COUNT(verified_ns) < COUNT(*) THEN NULL ELSE MIN(verified_ns) END"
    " FROM files WHERE checkpoint_path = {ckpt} AND present = 1)"
)
