"""catalog.db.example stays current: regenerated from a demo tree, it has the same schema and content shape."""

from __future__ import annotations

import importlib.util
import sqlite3
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def shape(db: Path) -> tuple:
    conn = sqlite3.connect(db)
    schema = sorted(r for r in conn.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    statuses = sorted(conn.execute("SELECT status, COUNT(*) FROM checkpoints GROUP BY status"))
    codes = sorted({r[0] for r in conn.execute("SELECT code FROM findings")})
    kinds = sorted({r[0] for r in conn.execute("SELECT kind FROM files")})
    return schema, statuses, codes, kinds


@pytest.mark.skipif(importlib.util.find_spec("harness.tree") is None, reason="reference trainer (harness.tree) not present")
def test_catalog_example_matches_a_fresh_demo(tmp_path):
    spec = importlib.util.spec_from_file_location("make_catalog_example", REPO / "scripts" / "make_catalog_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fresh = mod.make(tmp_path / "fresh.db")
    example = REPO / "catalog.db.example"
    assert example.exists(), "run: python scripts/make_catalog_example.py"
    assert shape(fresh) == shape(example)
    assert "crc-mismatch" in shape(example)[2]
