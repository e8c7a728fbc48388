"""The previous manifest, read with bare sqlite3 so a scan starts reading files before sqlite_utils is imported.

(`import sqlite_utils` alone costs 0.15-0.35 s here, the whole start-up budget: bench/README.md, bench_startup.)
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, fields, replace
from typing import Any

from ckpt_audit import models
from ckpt_audit.codes import CODES
from ckpt_audit.models import DcpFacts, FileKind, Finding, Severity, ShardFile, from_slots
from ckpt_audit.readers import RULES
from ckpt_audit.tree import FileFacts, PtFacts


class CatalogError(Exception):
    """The catalog cannot be opened or used: a one-line error, exit 3."""


def probe(path: str | os.PathLike[str]) -> None:
    """Raise CatalogError unless `path` is a usable (or creatable) SQLite catalog. Reads only."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CatalogError(f"catalog {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path):
        probe_dir = parent
        while not os.path.exists(probe_dir):
            probe_dir = os.path.dirname(probe_dir)
        if not os.path.isdir(probe_dir) or not os.access(probe_dir, os.W_OK):
            raise CatalogError(f"cannot create catalog {path}: {probe_dir} is not a writable directory")
        return
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise CatalogError(f"catalog {path} is not a usable SQLite database: {exc}") from None


def read_previous(conn_or_path: sqlite3.Connection | str | os.PathLike[str]) -> dict[str, FileFacts]:
    """path -> FileFacts of every present file the catalog knows, for reuse by (size, mtime_ns, inode): hash, CRC
    verdict, structure (PtFacts), every finding the readers made, and when the content was last verified. Several
    objects a file: a scan reads it with the cyclic GC paused (scan.pipeline.scan)."""
    own = not isinstance(conn_or_path, sqlite3.Connection)
    if isinstance(conn_or_path, sqlite3.Connection):
        conn = conn_or_path
    else:
        path = os.fspath(conn_or_path)
        if not os.path.exists(path):
            return {}
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        except sqlite3.Error as exc:
            raise CatalogError(f"catalog {path}: {exc}") from None
    try:
        rows = conn.execute(f"SELECT {fact_columns(conn)} FROM files WHERE present = 1").fetchall()
    except sqlite3.OperationalError:
        return {}  # a fresh catalog without tables yet
    except sqlite3.DatabaseError as exc:
        raise CatalogError(f"catalog is not a usable SQLite database: {exc}") from None
    finally:
        if own:
            conn.close()
    return facts_of_rows(rows)


class LazyManifest(Mapping):
    """read_previous, made on first use: a re-scan whose every run kept its cached verdict never needs it.
    `connect`: where to read it (a scan's one read-only connection: CatalogVerdicts.connection); default `path`."""

    def __init__(
        self, path: str | os.PathLike[str], connect: Callable[[], sqlite3.Connection | None] | None = None
    ) -> None:
        self.path, self.connect = path, connect
        self._facts: dict[str, FileFacts] | None = None

    def _all(self) -> dict[str, FileFacts]:
        if self._facts is None:
            conn = self.connect() if self.connect is not None else None
            self._facts = read_previous(conn if conn is not None else self.path)
        return self._facts

    def __getitem__(self, path: str) -> FileFacts:
        return self._all()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    @property
    def loaded(self) -> bool:
        return self._facts is not None


def connect_read_only(path: str | os.PathLike[str]) -> sqlite3.Connection | None:
    """The catalog at `path` opened read-only with bare sqlite3 (a WAL read beside a running writer); None when it
    does not exist yet. Raises CatalogError when it cannot be opened. Usable from any thread (SQLite serialises):
    a scan's lazy manifest may load on a reader thread."""
    if not os.path.exists(path):
        return None
    try:
        return sqlite3.connect(f"file:{os.fspath(path)}?mode=ro", uri=True, check_same_thread=False)
    except sqlite3.Error as exc:
        raise CatalogError(f"catalog {path}: {exc}") from None


def query_read_only(
    path: str | os.PathLike[str], sql: str, params: Iterable = (), *, conn: sqlite3.Connection | None = None
) -> list[tuple]:
    """Rows of `sql` from the catalog at `path`, opened read-only (connect_read_only), or over `conn`, a scan's one
    read-only connection to it (left open); [] when the catalog or the table does not exist yet. Raises
    CatalogError for an unusable file."""
    own = conn is None
    conn = connect_read_only(path) if own else conn
    if conn is None:
        return []
    try:
        return conn.execute(sql, list(params)).fetchall()
    except sqlite3.OperationalError:
        return []  # no such table (or column) yet
    except sqlite3.DatabaseError as exc:
        raise CatalogError(f"catalog {path} is not a usable SQLite database: {exc}") from None
    finally:
        if own:
            conn.close()


# a row's last content read, counted only if it was read under today's readers (readers.RULES): a row read under
# other rules reads as never verified, so its file is read again instead of vouched for
VERIFIED_UNDER_TODAYS_RULES = f"CASE WHEN read_rules = {RULES} THEN verified_ns END"


def fact_columns(conn: sqlite3.Connection) -> str:
    """The files columns `facts_of_rows` reads (a catalog not yet migrated, read-only here, has no dcp_facts or
    read_rules: its rows are read again)."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(files)")}
    verified = VERIFIED_UNDER_TODAYS_RULES if "read_rules" in have else "NULL"
    dcp = "dcp_facts" if "dcp_facts" in have else "NULL"
    sums = "store_checksums" if "store_checksums" in have else "NULL"
    return f"path, size_bytes, mtime_ns, inode, hash, crc_ok, file_findings, pt_facts, {verified}, {dcp}, {sums}"


def facts_of_rows(rows: Iterable[tuple]) -> dict[str, FileFacts]:
    """path -> FileFacts of files rows read with `fact_columns`."""
    out: dict[str, FileFacts] = {}
    pts: dict[str | None, tuple[PtFacts | None, bool]] = {}  # many files share one document; PtFacts is frozen
    for path, size, mtime, inode, h, crc, ff, pt_doc, verified, dcp_doc, sums in rows:
        found = findings_from_json(ff, path)
        if (parsed := pts.get(pt_doc)) is None:
            parsed = pts[pt_doc] = pt_from_json(pt_doc)
        pt, pt_whole = parsed
        # slot order (FileFacts: path, size, mtime, inode, hash, crc_ok, pt, text, findings, reused, verified_ns,
        # dcp, tensors, checksums): one per catalogued file, so built without the frozen __init__ (models.from_slots).
        # A row missing a fact the readers now record cannot vouch for the file: no verified_ns, so it is read again
        crc_ok = None if crc is None else bool(crc)
        again = verified if pt_whole else None
        out[path] = from_slots(
            FileFacts,
            (path, size, mtime, inode, h, crc_ok, pt, None, found, False, again, dcp_from_json(dcp_doc), None,
             checksums_from_text(sums)),
        )  # fmt: skip
    return out


def checksums_to_text(sums: tuple[tuple[str, str], ...]) -> str | None:
    """`crc32c=bIkWNQ== crc64nvme=…`: the store checksums of one file (FileFacts.checksums); None: none computed."""
    return " ".join(f"{k}={v}" for k, v in sums) or None


def checksums_from_text(text: str | None) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(x.split("=", 1)) for x in text.split()) if text else ()  # type: ignore[misc]


def findings_to_json(found: tuple[Finding, ...]) -> str:
    """Every finding the readers attached to one file, whole (severity, rank and tensor included)."""
    return json.dumps([f.to_dict() for f in found]) if found else "[]"


def findings_from_json(doc: str | None, path: str) -> tuple[Finding, ...]:
    return () if not doc or doc == "[]" else tuple(_finding(x, path) for x in json.loads(doc))


def _finding(doc: dict | list, path: str) -> Finding:
    if isinstance(doc, list):  # rows written before m003: [code, message]
        code, message = doc[0], doc[1]
        sev = CODES[code].severity if code in CODES else Severity.ERROR
        return Finding(severity=sev, code=code, path=path, message=message)
    return Finding(
        severity=Severity[doc["severity"].upper()],
        code=doc["code"],
        path=doc.get("path", path),
        message=doc["message"],
        rank=doc.get("rank"),
        tensor=doc.get("tensor"),
    )


_PT_FIELDS = frozenset(f.name for f in fields(PtFacts))


def dcp_to_json(dcp: DcpFacts | None) -> str | None:
    return None if dcp is None else json.dumps(asdict(dcp))


def dcp_from_json(doc: str | None) -> DcpFacts | None:
    """The stored DcpFacts; None for no document (the scan then parses the .metadata again)."""
    if doc is None:
        return None
    d = json.loads(doc)
    return DcpFacts(file_ends=tuple((str(f), int(n)) for f, n in d["file_ends"]), key_roots=tuple(d["key_roots"]))


def pt_to_json(pt: PtFacts | None) -> str | None:
    return None if pt is None else json.dumps(asdict(pt))


def pt_from_json(doc: str | None) -> tuple[PtFacts | None, bool]:
    """(PtFacts, whether the stored document holds every field PtFacts has today)."""
    if doc is None:
        return None, True
    d = json.loads(doc)
    stored: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in _PT_FIELDS}
    pt = PtFacts(**stored)
    if pt.meta:  # JSON keeps its (key, value) pairs as lists
        pt = replace(pt, meta=tuple((str(k), v) for k, v in pt.meta))
    missing = _PT_FIELDS - set(d)
    # `meta` holds only what DeepSpeed's files (top-level ds_version) and Megatron's common.pt (content_metadata)
    # record: a row from before it, of any other file, lacks nothing, so an upgrade does not re-read every torch
    # file of every run; a common.pt read before its flags were kept is read again
    if "content_metadata" in pt.top_keys and not pt.meta:
        return pt, False
    # DeepSpeed model states read before their expert counts or parallel dimensions (pipeline) were kept: read again
    meta = dict(pt.meta)
    if ("num_experts" in pt.top_keys and "num_experts" not in meta) or (
        "checkpoint_parallel_dimensions" in pt.top_keys and "tp_degree" not in meta
    ):
        return pt, False
    return pt, not missing or (missing == {"meta"} and "ds_version" not in pt.top_keys)


def as_shard_files(
    facts: dict[str, FileFacts], kinds: dict[str, tuple[str, int | None, int | None]]
) -> dict[str, ShardFile]:
    return {
        p: models.ShardFile(
            path=p,
            kind=FileKind(kinds[p][0]),
            rank=kinds[p][1],
            world_size=kinds[p][2],
            size_bytes=f.size_bytes,
            mtime_ns=f.mtime_ns,
            inode=f.inode,
            hash=f.hash,
            crc_ok=f.crc_ok,
        )
        for p, f in facts.items()
        if p in kinds
    }
