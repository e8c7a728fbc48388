"""`ckpt-audit demo` end to end, and catalog.db.example kept current: regenerated from the demo tree, it must have
the same schema and content shape as the committed file."""

from __future__ import annotations

import importlib.util
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_audit.cli import cli

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # `ckpt-audit demo` runs the reference trainer


def shape(db: Path) -> tuple:
    conn = sqlite3.connect(db)
    schema = sorted(r for r in conn.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    statuses = sorted(conn.execute("SELECT status, COUNT(*) FROM checkpoints GROUP BY status"))
    codes = sorted({r[0] for r in conn.execute("SELECT code FROM findings WHERE severity != 'info'")})
    kinds = sorted({r[0] for r in conn.execute("SELECT kind FROM files")})
    return schema, statuses, codes, kinds


def test_demo_then_example_catalog_matches(tmp_path):
    demo = tmp_path / "demo"
    res = CliRunner().invoke(cli, ["demo", str(demo)])
    assert res.exit_code == 0, res.output
    assert "crc-mismatch" in res.output and "corrupt" in res.output and "complete" in res.output
    assert (demo / "catalog.db").exists()
    spec = importlib.util.spec_from_file_location("make_catalog_example", REPO / "scripts" / "make_catalog_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fresh = mod.make(tmp_path / "fresh.db", demo_dir=demo)
    example = REPO / "catalog.db.example"
    assert example.exists(), "run: python scripts/make_catalog_example.py"
    assert shape(fresh) == shape(example)
    assert "crc-mismatch" in shape(example)[2]
