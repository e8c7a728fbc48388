"""The few sqlite-utils Database calls the catalog makes, on plain sqlite3.

`import sqlite_utils` costs 0.2-0.35 s of a cron job's start-up: it imports numpy when numpy is installed and scans
pluggy entry points for plugins on every Database(). Only migrations need sqlite-utils (their bodies are written
against its Migrations API and are never edited once applied), so a catalog whose migrations are all applied is
opened and written here without it. Semantics follow sqlite-utils 4: execute() commits a write made outside a
transaction, atomic() nests with savepoints, upsert updates the given columns and keeps the others.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

MIGRATIONS_TABLE = "_sqlite_migrations"  # where sqlite-utils' Migrations records what it applied


class Db:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._savepoints = 0

    def execute(self, sql: str, parameters: Sequence | dict | None = None) -> sqlite3.Cursor:
        was_in_transaction = self.conn.in_transaction
        try:
            cur = self.conn.execute(sql, parameters) if parameters is not None else self.conn.execute(sql)
        except Exception:
            if not was_in_transaction and self.conn.in_transaction:
                self.conn.rollback()
            raise
        if not was_in_transaction and self.conn.in_transaction:
            self.conn.commit()
        return cur

    def query(self, sql: str, params: Sequence | dict | None = None) -> Iterator[dict]:
        cur = self.execute(sql, params)
        cols = [c[0] for c in cur.description]
        for row in cur:
            yield dict(zip(cols, row))

    @contextlib.contextmanager
    def atomic(self) -> Iterator[Db]:
        if self.conn.in_transaction:
            self._savepoints += 1
            name = f"ckpt_audit_{self._savepoints}"
            self.conn.execute(f"SAVEPOINT {name}")
            try:
                yield self
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
                    self.conn.execute(f"RELEASE SAVEPOINT {name}")
                raise
            else:
                self.conn.execute(f"RELEASE SAVEPOINT {name}")
            return
        self.conn.execute("BEGIN")
        try:
            yield self
        except BaseException:
            self.conn.rollback()
            raise
        else:
            try:
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.rollback()
                raise

    def __getitem__(self, name: str) -> Table:
        return Table(self, name)

    def enable_wal(self) -> None:
        if self.conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            self.conn.execute("PRAGMA journal_mode=wal")

    def close(self) -> None:
        self.conn.close()

    def table_names(self) -> list[str]:
        return [n for (n,) in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]

    def view_names(self) -> list[str]:
        return [n for (n,) in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'")]

    def applied_migrations(self, migration_set: str) -> set[str] | None:
        """Names sqlite-utils recorded as applied for `migration_set`; None when it never ran here."""
        if not self[MIGRATIONS_TABLE].exists():
            return None
        rows = self.conn.execute(f"SELECT name FROM {MIGRATIONS_TABLE} WHERE migration_set = ?", [migration_set])
        return {name for (name,) in rows}

    def sqlite_utils(self):
        """The same connection as a sqlite_utils.Database, for migrations (imports sqlite-utils: slow)."""
        import sqlite_utils

        return sqlite_utils.Database(self.conn)


class Table:
    def __init__(self, db: Db, name: str) -> None:
        self.db = db
        self.name = name
        self.last_pk: Any = None

    def exists(self) -> bool:
        row = self.db.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [self.name])
        return row.fetchone() is not None

    def insert(self, row: dict) -> Table:
        cols = list(row)
        cur = self.db.execute(
            f"INSERT INTO {_q(self.name)} ({', '.join(map(_q, cols))}) VALUES ({', '.join('?' * len(cols))})",
            [_value(row[c]) for c in cols],
        )
        self.last_pk = cur.lastrowid
        return self

    def insert_all(self, rows: Iterable[dict], *, batch_size: int = 100) -> Table:
        self._write(rows, "INSERT", batch_size)
        return self

    def upsert_all(self, rows: Iterable[dict], *, pk: str, batch_size: int = 100) -> Table:
        self._write(rows, "UPSERT", batch_size, pk=pk)
        return self

    def _write(self, rows: Iterable[dict], how: str, batch_size: int, pk: str | None = None) -> None:
        rows = list(rows)
        if not rows:
            return
        cols = list(dict.fromkeys(c for r in rows for c in r))  # every key of every row, first-seen order
        sql = f"INSERT INTO {_q(self.name)} ({', '.join(map(_q, cols))}) VALUES ({', '.join('?' * len(cols))})"
        if how == "UPSERT" and pk is not None:
            rest = [c for c in cols if c != pk]
            sets = ", ".join(f"{_q(c)} = excluded.{_q(c)}" for c in rest)
            sql += f" ON CONFLICT({_q(pk)}) DO " + (f"UPDATE SET {sets}" if rest else "NOTHING")
        values = [[_value(r.get(c)) for c in cols] for r in rows]
        with self.db.atomic():
            for i in range(0, len(values), max(1, batch_size)):
                self.db.conn.executemany(sql, values[i : i + batch_size])


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _value(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, (dict, list, tuple)) else v
