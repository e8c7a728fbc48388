"""The catalog's side of the run verdict cache (ckpt_audit.scan.verdicts): reading cached verdicts for a scan, and
the run model as JSON (never pickle: the catalog is a file anyone with write access could have edited).

Table `run_verdicts` (migration m007): one row per run, its key, when it was judged, and the run model; its summary
and the files of the run without a files row (m011), which a re-scan decides and answers the run from without
decoding the model. Triggers delete a run's row whenever a files row under it changes or stops vouching by content,
or one of its checkpoints' status changes, by any other path (a prune survivor check, a verify, a focused scan), so a
row only ever describes what the catalog still holds.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from ckpt_audit import models
from ckpt_audit.catalog.manifest import VERIFIED_UNDER_TODAYS_RULES as VERIFIED
from ckpt_audit.catalog.manifest import CatalogError, connect_read_only, fact_columns, facts_of_rows, query_read_only
from ckpt_audit.models import (
    Checkpoint,
    Component,
    FileKind,
    Finding,
    Run,
    RunSummary,
    Severity,
    ShardFile,
    Status,
    from_slots,
    many_from_slots,
)
from ckpt_audit.readers import RULES
from ckpt_audit.tree import FileFacts

if TYPE_CHECKING:
    from ckpt_audit.scan.verdicts import Row, Stored


def run_to_json(run: Run) -> str:
    """The run model, whole, as nested lists in slot order (models.from_slots puts them back; a list of the wrong
    length is a TypeError there, so a damaged row is judged afresh, never half-read)."""
    return json.dumps(_run(run), separators=(",", ":"))


def summary_to_json(s: RunSummary, unrowed: Iterable[str]) -> str:
    """A kept run's summary (models.RunSummary) and the files of the run the catalog keeps no row for (read every
    scan): what a re-scan needs of a kept run, small beside its model."""
    checkpoints = [[p, step, st.value] for p, step, st in s.checkpoints]
    found = [[ckpt, *_finding(f)] for ckpt, f in s.findings]
    fields = [s.path, s.layout, s.tracker_step, s.metrics_path, s.size_bytes, checkpoints, found, sorted(unrowed)]
    return json.dumps(fields, separators=(",", ":"))


def summary_from_json(doc: str) -> tuple[RunSummary, tuple[str, ...]]:
    """(summary, unrowed files); ValueError, TypeError, KeyError or AttributeError for a damaged one."""
    path, layout, tracker, metrics, size, checkpoints, found, unrowed = json.loads(doc)
    summary = RunSummary(
        path=str(path),
        layout=str(layout),
        tracker_step=tracker,
        metrics_path=metrics,
        size_bytes=int(size),
        checkpoints=tuple((str(p), int(step), _STATUSES[st]) for p, step, st in checkpoints),
        findings=tuple((ckpt, _unfinding(f)) for ckpt, *f in found),
    )
    return summary, tuple(map(str, unrowed))


def run_from_json(doc: str) -> Run:
    values = json.loads(doc)
    if not isinstance(values, list) or len(values) != len(models.Run.__slots__):
        raise ValueError("not a run")
    return _unrun(values)


# one encoder and decoder per class, positional: a generic walk over fields() cost ~1 s per 10k files
def _finding(f: Finding) -> list:
    return [int(f.severity), f.code, f.path, f.message, f.rank, f.tensor]


def _file(f: ShardFile) -> list:
    return [f.path, f.kind.value, f.size_bytes, f.mtime_ns, f.inode, f.rank, f.world_size, f.hash, f.crc_ok]


def _component(c: Component) -> list:
    return [c.role, c.path, c.layout, c.world_size, [_file(f) for f in c.files], [_finding(f) for f in c.findings]]


def _checkpoint(c: Checkpoint) -> list:
    return [
        c.run_path,
        c.step,
        c.path,
        c.status.value,
        [_component(x) for x in c.components],
        [_file(f) for f in c.files],
        [_finding(f) for f in c.findings],
        c.mtime_ns,
    ]


def _run(r: Run) -> list:
    return [
        r.path,
        r.layout,
        r.tracker_step,
        [_checkpoint(c) for c in r.checkpoints],
        [_finding(f) for f in r.findings],
        r.metrics_path,
    ]


# enum members by value: a dict lookup, where calling the Enum costs ~1 us a file
_KINDS = {k.value: k for k in FileKind}
_STATUSES = {s.value: s for s in Status}
_SEVERITIES = {int(s): s for s in Severity}


def _unfinding(v: list) -> Finding:
    return from_slots(Finding, (_SEVERITIES[v[0]], *v[1:]))


def _unfiles(vs: list[list]) -> tuple[ShardFile, ...]:
    for v in vs:
        v[1] = _KINDS[v[1]]
    return many_from_slots(ShardFile, vs)


def _uncomponent(v: list) -> Component:
    return from_slots(Component, (*v[:4], _unfiles(v[4]), tuple(map(_unfinding, v[5]))))


def _uncheckpoint(v: list) -> Checkpoint:
    components, files, found = tuple(map(_uncomponent, v[4])), _unfiles(v[5]), tuple(map(_unfinding, v[6]))
    return from_slots(Checkpoint, (v[0], v[1], v[2], _STATUSES[v[3]], components, files, found, v[7]))


def _unrun(v: list) -> Run:
    checkpoints, found = tuple(map(_uncheckpoint, v[3])), tuple(map(_unfinding, v[4]))
    return from_slots(Run, (v[0], v[1], v[2], checkpoints, found, v[5]))


class CatalogVerdicts:
    """scan.verdicts.Source over a catalog file: one read-only bare sqlite3 connection for the whole scan (a WAL read
    beside a running writer), opened on the first query; close() it when the scan is done (or use `with`). A
    catalog that does not exist yet, or predates m007, holds no verdicts: every run is judged."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._conn: sqlite3.Connection | None = None

    def __enter__(self) -> CatalogVerdicts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def connection(self) -> sqlite3.Connection | None:
        """The scan's read-only connection (None: no catalog yet); reopened if asked for after close()."""
        if self._conn is None:
            self._conn = connect_read_only(self.path)
        return self._conn

    def _query(self, sql: str, params: Iterable = ()) -> list[tuple]:
        conn = self.connection()
        return [] if conn is None else query_read_only(self.path, sql, params, conn=conn)  # no table yet: nothing

    def stored(self) -> Mapping[str, Stored]:
        # the scan's own type, imported when a scan asks: ls and show open the catalog without the scan package
        from ckpt_audit.scan.verdicts import Stored

        out: dict[str, Stored] = {}
        for run_path, key, doc in self._query(
            "SELECT run_path, key, summary FROM run_verdicts WHERE summary IS NOT NULL"
        ):
            try:
                summary, unrowed = summary_from_json(doc)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # an edited or damaged row: judged afresh, and the scan's record replaces it
            if summary.path == run_path:
                out[run_path] = Stored(key, summary, unrowed)
        return out

    def rows(self, root: str) -> Mapping[str, Row]:
        rows = self._present_under(root, f"path, size_bytes, mtime_ns, inode, hash, crc_ok, {VERIFIED}")
        return {r[0]: r[1:] for r in rows}  # crc_ok stays 0/1/NULL here: light_facts makes it a bool

    def verified_order(self, runs: Iterable[str], *, newest_first: bool = False) -> Iterator[tuple[str, int, int]]:
        # files_verified (m011) walks them in order: a scrub takes a few of a million without loading the rest
        conn, order = self.connection(), "DESC" if newest_first else "ASC"
        if conn is None:
            return
        try:
            yield from conn.execute(
                "SELECT path, verified_ns, size_bytes FROM files INDEXED BY files_verified"
                f" WHERE present = 1 AND hash IS NOT NULL AND read_rules = {RULES} AND verified_ns IS NOT NULL"
                f" AND run_path IN (SELECT value FROM json_each(?)) ORDER BY verified_ns {order}, path {order}",
                [json.dumps(sorted(runs))],
            )
        except sqlite3.DatabaseError as exc:
            raise CatalogError(f"catalog {self.path} is not a usable SQLite database: {exc}") from None

    def _present_under(self, root: str, columns: str, where: str = "1") -> list[tuple]:
        below = root.rstrip("/") + "/"
        return self._query(
            f"SELECT {columns} FROM files WHERE present = 1 AND {where} AND (path = ? OR substr(path, 1, ?) = ?)",
            [root, len(below), below],
        )

    def facts(self, paths: Iterable[str]) -> dict[str, FileFacts]:
        wanted = list(paths)
        conn = self.connection() if wanted else None
        if conn is None:
            return {}
        try:
            cols = fact_columns(conn)
            out: dict[str, FileFacts] = {}
            for i in range(0, len(wanted), 500):  # SQLite's bound-parameter limit
                part = wanted[i : i + 500]
                rows = conn.execute(
                    f"SELECT {cols} FROM files WHERE present = 1 AND path IN ({','.join('?' * len(part))})", part
                ).fetchall()
                out.update(facts_of_rows(rows))
            return out
        except sqlite3.DatabaseError as exc:
            raise CatalogError(f"catalog {self.path} is not a usable SQLite database: {exc}") from None

    def runs(self, keys: Mapping[str, str]) -> dict[str, Run]:
        out: dict[str, Run] = {}
        for run_path, key, doc in self._query("SELECT run_path, key, run_doc FROM run_verdicts"):
            if keys.get(run_path) != key:
                continue
            try:
                run = run_from_json(doc)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # an edited or damaged row: judged afresh, and the scan's record replaces it
            if run.path == run_path:
                out[run_path] = run
        return out


def record_verdicts(
    conn: sqlite3.Connection,
    runs: Iterable[Run],
    keys: Mapping[str, str],
    unrowed: Mapping[str, Iterable[str]],
    *,
    judged_ns: int,
) -> None:
    """Keep the verdict of each run judged now (`runs`) under its key, with its summary and the files the catalog
    keeps no row for (`unrowed`), after the scan's files and checkpoints rows are written (their triggers have
    cleared what no longer holds); a run without a key (not settled, or not read cleanly) keeps none. A kept run's
    row is left as it is: nothing this scan wrote moved it, and were it gone the next scan would judge afresh."""
    for run in runs:
        key = keys.get(run.path)
        if key is None or run.path not in unrowed:
            conn.execute("DELETE FROM run_verdicts WHERE run_path = ?", [run.path])
        else:
            conn.execute(
                "INSERT OR REPLACE INTO run_verdicts (run_path, key, judged_ns, run_doc, summary)"
                " VALUES (?, ?, ?, ?, ?)",
                [run.path, key, judged_ns, run_to_json(run), summary_to_json(RunSummary.of(run), unrowed[run.path])],
            )
