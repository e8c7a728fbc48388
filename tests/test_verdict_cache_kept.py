"""A kept run answered without its model (scan.reuse, models.LazyRuns, migration m011).

`scan -q` takes a kept run's statuses, findings and tracker step from the summary stored with its verdict and never
decodes the run document; whoever walks the result's runs gets the model, equal to a fresh judgement. The kept
runs' files the catalog holds no row for are listed with the verdict, and the scrub picks the rest from the catalog
in verified order: the same plan plan_scrub makes from the same rows.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from cli_json import age, invoke
from scan_trees import shard, steps_of, write_torch_tree
from test_verdict_cache import cached_scan, fresh_scan, tree  # tree: the fixture, shared

from ckpt_audit.catalog.verdicts import CatalogVerdicts
from ckpt_audit.models import KeptVerdictError, LazyRuns
from ckpt_audit.readers import RULES
from ckpt_audit.report import summary
from ckpt_audit.scan import reuse
from ckpt_audit.scan.scrub import DAY_NS, ScrubPolicy, plan_ordered, plan_scrub


def last_findings(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return sorted(
            conn.execute(
                "SELECT severity, code, path, message, run_path, checkpoint_path FROM findings"
                " WHERE scan_id = (SELECT MAX(id) FROM scans)"
            )
        )


def test_scan_q_decodes_no_run_document_and_answers_as_a_judgement(tree, tmp_path):
    """The stored document is made unreadable: `scan -q` must still keep the verdict (it never reads the document),
    print and exit as the judging scan did, and record the same findings."""
    db = tmp_path / "c.db"
    first = invoke("scan", "-q", str(tree), catalog=db)
    assert first.exit_code == 1, first.output  # the corrupt shard
    judged = last_findings(db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE run_verdicts SET run_doc = 'not a run'")
    again = invoke("scan", "-q", str(tree), catalog=db)
    assert (again.exit_code, again.output) == (first.exit_code, first.output)
    assert last_findings(db) == judged
    with sqlite3.connect(db) as conn:  # kept, not judged afresh (that would have written a readable document)
        assert conn.execute("SELECT run_doc FROM run_verdicts").fetchall() == [("not a run",)]
        assert conn.execute("SELECT files_hashed FROM scans ORDER BY id DESC LIMIT 1").fetchone()[0] < 4


def test_a_lazy_result_walks_to_the_fresh_judgement(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    lazy = cached_scan(tree, db, kept_models=False)
    assert lazy.runs_reused == {str(tree)} and isinstance(lazy.runs, LazyRuns)
    fresh = fresh_scan(tree, db)
    assert summary(lazy) == summary(fresh) and lazy.all_findings == fresh.all_findings  # from the summary alone
    assert lazy.runs._models is None  # nothing above decoded the model
    assert list(lazy.runs) == list(fresh.runs)
    assert lazy.runs == fresh.runs


def test_a_summary_that_disagrees_with_its_document(tree, tmp_path):
    """An edited summary: a scan that decodes the models judges the run afresh; a lazy result refuses to walk."""
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    with sqlite3.connect(db) as conn:
        [(doc,)] = conn.execute("SELECT summary FROM run_verdicts").fetchall()
        fields = json.loads(doc)
        fields[5][1][2] = "complete"  # step 4 is corrupt
        conn.execute("UPDATE run_verdicts SET summary = ?", [json.dumps(fields)])
        saved = conn.execute("SELECT * FROM run_verdicts").fetchall()
    lazy = cached_scan(tree, db, kept_models=False, scrub=None)
    assert lazy.runs_reused == {str(tree)}
    with pytest.raises(KeptVerdictError, match="does not match its summary"):
        list(lazy.runs)
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM run_verdicts")
        conn.executemany("INSERT INTO run_verdicts VALUES (?, ?, ?, ?, ?)", saved)
    eager = cached_scan(tree, db)
    assert eager.runs_reused == frozenset()
    assert eager.runs == fresh_scan(tree, db).runs


@pytest.mark.parametrize(
    "change",
    ["verified_ns = NULL", f"read_rules = {RULES + 1}"],
    ids=["verified_ns emptied", "other read rules"],
)
def test_a_row_that_stops_vouching_drops_the_verdict_and_its_file_is_read(tree, tmp_path, change):
    """The summary lists the files read every scan; a rowed file whose row no longer vouches by content must not
    stay off that list: the verdict goes with it (m011's triggers) and the file is read again."""
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    victim = str(shard(steps_of(tree)[2]))
    with sqlite3.connect(db) as conn:
        conn.execute(f"UPDATE files SET {change} WHERE path = ?", [victim])
        assert conn.execute("SELECT count(*) FROM run_verdicts").fetchone() == (0,)
    again = cached_scan(tree, db, kept_models=False, scrub=None)
    assert again.runs_reused == frozenset()
    assert victim not in again.reused_paths
    assert again.runs == fresh_scan(tree, db).runs


def test_the_scrub_pick_from_the_catalog_is_plan_scrubs(tmp_path):
    """The kept runs' files in the catalog's verified order (files_verified) through plan_ordered make the plan
    plan_scrub makes from the same rows, for shares, dues, ties and budgets alike."""
    root = tmp_path / "root"
    runs = [write_torch_tree(root / "a"), write_torch_tree(root / "b")]
    age(root)
    db = tmp_path / "c.db"
    cached_scan(root, db)
    with sqlite3.connect(db) as conn:  # three ages, many ties (ordered by path), one row under other rules
        conn.execute("UPDATE files SET verified_ns = (rowid % 3) * ? + 1", [DAY_NS])
        conn.execute(f"UPDATE files SET read_rules = {RULES + 1} WHERE rowid = 1")
        rows = conn.execute(
            f"SELECT path, verified_ns, size_bytes FROM files WHERE read_rules = {RULES} AND hash IS NOT NULL"
        ).fetchall()
    verified = {p: v for p, v, _s in rows}
    sizes = {p: s for p, _v, s in rows}
    total = sum(sizes.values())
    with CatalogVerdicts(db) as source:
        for now in (3 * DAY_NS, 9 * DAY_NS):
            for period in (0, 4 * DAY_NS, 7 * DAY_NS):
                for budget in (None, 0, 3000, 10**9):
                    policy = ScrubPolicy(period_ns=period, budget_bytes=budget)
                    options = dict(total_bytes=total, now_ns=now, policy=policy, budget_bytes=budget)
                    newest = next(source.verified_order(map(str, runs), newest_first=True))[1]
                    picked = plan_ordered(source.verified_order(map(str, runs)), newest_ns=newest, **options)
                    assert picked == plan_scrub(verified, sizes.__getitem__, **options), (now, period, budget)
                    assert picked.paths or picked.overdue_files or period > now


def test_the_kept_runs_files_are_cut_from_the_sorted_paths_by_slices():
    """The stat cache looks only at files of no kept run; each kept run's files are one slice of the sorted paths,
    also when a neighbour's name sorts between the run and its files ("/r/a-b/" before "/r/a/")."""
    runs = {"/r/a": ["/r/a/1.pt", "/r/a/s/2.pt"], "/r/c": ["/r/c/x"]}
    paths = sorted(["/r/a-b/1.pt", "/r/a.x", "/r/b/1.pt", "/r/c0/y", "/r/cc/z", *runs["/r/a"], *runs["/r/c"]])
    kept = reuse._Kept(runs=runs)
    every = {p for files in runs.values() for p in files}
    assert kept.outside(paths) == [p for p in paths if p not in every]
    assert kept.outside([]) == [] and reuse._Kept().outside(paths) == paths
    assert [kept.rowed(p) for p in ("/r/a/s/2.pt", "/r/a-b/1.pt", "/r/c/gone")] == [True, False, False]
