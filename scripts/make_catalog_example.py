"""Regenerate the top-level catalog.db.example from a demo tree (the reference trainer, one broken checkpoint).

    python scripts/make_catalog_example.py [OUT]      # default: catalog.db.example beside this repo's README

Paths inside are rewritten to /ckpts/... so the example does not leak the build machine's temp directories.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make(out: Path, *, demo_dir: Path | None = None) -> Path:
    """Write the example catalog to `out`; `demo_dir` reuses a demo tree already built there (`ckpt-audit demo`)."""
    from ckpt_audit.catalog import open_catalog
    from ckpt_audit.scan import scan
    from harness.commands.demo import build_demo_tree

    with tempfile.TemporaryDirectory() as tmp:
        run = build_demo_tree(demo_dir or Path(tmp))
        root = run.parent.parent
        result = scan([root], in_progress_window_s=0)
        db = Path(tmp) / "catalog.db"
        with open_catalog(db) as cat:
            cat.record_scan(result)
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA foreign_keys=OFF")
        prefix = str(root)
        for table, cols in (
            ("scans", ["roots"]),
            ("runs", ["path", "metrics_path"]),
            ("checkpoints", ["path", "run_path", "components"]),
            ("files", ["path", "run_path", "checkpoint_path"]),
            ("hash_history", ["path"]),
            ("findings", ["path", "message", "run_path", "checkpoint_path"]),
        ):
            for col in cols:
                conn.execute(f"UPDATE {table} SET {col} = replace({col}, ?, '/ckpts')", [prefix])
        conn.commit()
        conn.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
        out.unlink(missing_ok=True)
        conn.execute("VACUUM INTO ?", [str(out)])
        conn.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Write the example catalog from a fresh demo tree.")
    ap.add_argument("out", nargs="?", type=Path, default=REPO / "catalog.db.example", help="default: %(default)s")
    print(make(ap.parse_args().out))
