"""The run verdict cache (ckpt_audit/verdicts.py, catalog/verdicts.py, migration m007).

A re-scan may take a run's stored verdict only when the judgement would read the same inputs again. Each test below
scans through the real session (catalog, lock, record) and compares the cached result with a fresh judgement of the
same tree from the same catalog rows (scan.scan without the cache), field by field: the two must be equal, and
every change the judgement could see must make the run judged afresh.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_json import age, invoke
from scan_trees import flip_payload_byte, shard, steps_of, write_torch_tree
from test_hf_trainer import hf_run  # noqa: F401 - the session fixture: a real Trainer run, cached
from test_torchtitan import titan_dump  # noqa: F401 - the session fixture: torchtitan's checkpointer, cached

import ckpt_audit
from ckpt_audit.catalog.manifest import read_previous
from ckpt_audit.catalog.verdicts import run_from_json, run_to_json
from ckpt_audit.models import Checkpoint, Component, FileKind, Finding, Run, Severity, ShardFile, Status
from ckpt_audit.scan import scan, verdicts, walk
from ckpt_audit.scan.scrub import ScrubPolicy
from ckpt_audit.session import open_session

VOLATILE = {"scan_id", "started_ns", "finished_ns", "files_hashed", "files_reused", "runs_reused", "bytes_hashed"}
VOLATILE |= {"files_scrubbed", "bytes_scrubbed"}


def cached_scan(root: Path, db: Path, **options):
    """`ckpt-audit scan`'s path: the session with the verdict cache, recorded."""
    with open_session(db, roots=[root]) as s:
        return s.scan(cached_verdicts=True, **options).result


def fresh_scan(root: Path, db: Path, **options):
    """The same scan without the cache: every run judged from the catalog's rows (reused by stat), not recorded."""
    return scan([root], previous=read_previous(db), **options)


def verdict_rows(db: Path) -> dict[str, str]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT run_path, key FROM run_verdicts"))


@pytest.fixture
def tree(tmp_path) -> Path:
    """A verl tree by real torch.save calls (steps 2, 4, 6), step 4's rank-1 model shard corrupt, all of it
    older than the in-progress window."""
    run = write_torch_tree(tmp_path / "root")
    flip_payload_byte(shard(steps_of(run)[1], rank=1))
    age(tmp_path / "root")
    return run


def test_an_unchanged_run_keeps_its_verdict_and_it_equals_a_fresh_judgement(tree, tmp_path):
    db = tmp_path / "c.db"
    first = cached_scan(tree, db)
    assert first.runs_reused == frozenset()
    assert set(verdict_rows(db)) == {str(tree)}
    again = cached_scan(tree, db)
    assert again.runs_reused == {str(tree)}
    assert again.runs == fresh_scan(tree, db).runs == first.runs
    assert again.runs[0].checkpoints[1].status is Status.CORRUPT
    assert again.files_hashed == 1  # the tracker: the catalog keeps no row for it, so it is read every scan
    fresh = fresh_scan(tree, db).file_facts
    rowed = [f.path for c in again.runs[0].checkpoints for f in c.all_files]  # the tracker is read every scan

    def seen(facts):
        return [(facts[p].size_bytes, facts[p].mtime_ns, facts[p].inode, facts[p].hash, facts[p].crc_ok) for p in rowed]

    # what reports read of each file (verified_ns in --json, the metrics) is the catalog's, as without the cache
    assert seen(again.file_facts) == seen(fresh)
    assert [again.file_facts[p].verified_ns for p in rowed] == [fresh[p].verified_ns for p in rowed]
    assert again.file_facts[str(shard(steps_of(tree)[1], rank=1))].crc_ok is False


def test_the_cli_document_is_the_same_whether_the_verdict_was_cached(tree, tmp_path):
    db = tmp_path / "c.db"
    docs = []
    for _ in range(3):
        res = invoke("scan", "--json", "--no-scrub", str(tree), catalog=db)  # a scrub re-read moves verified_ns
        assert res.exit_code == 1, res.output  # the corrupt shard
        docs.append(json.loads(res.stdout))
    assert [d["runs_reused"] for d in docs] == [0, 1, 1]
    assert [{k: v for k, v in d.items() if k not in VOLATILE} for d in docs[1:]] == [
        {k: v for k, v in docs[0].items() if k not in VOLATILE}
    ] * 2


def test_the_catalog_after_a_cached_rescan_is_what_a_fresh_judgement_writes(tree, tmp_path):
    """The record leaves a kept run's rows alone but for the scan they now belong to: every row, every view and the
    findings of the latest scan must read as after a scan that judged the run afresh."""
    db, fresh = tmp_path / "c.db", tmp_path / "f.db"
    cached_scan(tree, db, scrub=None)
    shutil.copy(db, fresh)
    assert cached_scan(tree, db, scrub=None).runs_reused == {str(tree)}
    assert cached_scan(tree, fresh, scrub=None, rehash=True).runs_reused == frozenset()

    def catalog(path: Path) -> dict[str, list]:
        with sqlite3.connect(path) as conn:
            last = conn.execute("SELECT MAX(id) FROM scans").fetchone()[0]
            out = {
                table: sorted(conn.execute(f"SELECT * FROM {table}").fetchall())
                for table in ("runs", "checkpoints", "checkpoint_status", "latest_complete_checkpoint")
            }
            # (what --rehash read again carries its own verified_ns and scan id)
            cols = "path, run_path, checkpoint_path, role, kind, rank, world_size, size_bytes, hash, crc_ok, present"
            out["files"] = sorted(conn.execute(f"SELECT {cols}, file_findings, pt_facts FROM files").fetchall())
            out["findings"] = sorted(
                conn.execute(
                    "SELECT severity, code, path, message, run_path, checkpoint_path FROM findings WHERE scan_id = ?",
                    [last],
                ).fetchall()
            )
            assert {r[0] for r in conn.execute("SELECT last_scan_id FROM checkpoints WHERE present = 1")} == {last}
        return out

    kept, judged = catalog(db), catalog(fresh)
    assert kept.keys() == judged.keys()
    for name in kept:
        assert kept[name] == judged[name], name


def test_a_changed_tracker_is_judged_afresh(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    tracker = tree / "latest_checkpointed_iteration.txt"
    st = tracker.stat()
    tracker.write_text("2")  # same size, the mtime put back: the text is read every scan and keyed
    os.utime(tracker, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = cached_scan(tree, db)
    assert again.runs_reused == frozenset()
    assert again.runs[0].tracker_step == 2
    assert again.runs == fresh_scan(tree, db).runs


def test_a_new_step_directory_is_judged_afresh(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    (tree / "global_step_8").mkdir()  # a trainer starting its next save a second ago
    again = cached_scan(tree, db)
    assert again.runs_reused == frozenset()
    assert {c.step: c.status for c in again.runs[0].checkpoints}[8] is Status.IN_PROGRESS
    assert verdict_rows(db) == {}  # young: time alone will change that verdict, so none is kept


def test_a_young_run_is_cached_only_once_the_window_has_passed(tmp_path):
    run = write_torch_tree(tmp_path / "root")  # written just now
    db = tmp_path / "c.db"
    cached_scan(run, db, in_progress_window_s=600)
    assert verdict_rows(db) == {}
    later = time.time_ns() + 700 * 10**9
    cached_scan(run, db, in_progress_window_s=600, now_ns=later)
    assert set(verdict_rows(db)) == {str(run)}
    assert cached_scan(run, db, in_progress_window_s=600, now_ns=later + 1).runs_reused == {str(run)}
    # a different window is a different verdict: judged afresh
    assert cached_scan(run, db, in_progress_window_s=60, now_ns=later + 2).runs_reused == frozenset()


def test_a_touched_shard_is_judged_afresh(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    os.chmod(shard(steps_of(tree)[2]), 0o600)  # moves the ctime only: permissions are part of what was read
    assert cached_scan(tree, db).runs_reused == frozenset()


def test_bytes_that_changed_under_a_kept_verdict_are_found_by_the_scrub(tree, tmp_path):
    """Bit rot keeps size, mtime, inode and ctime: only a content read sees it. Made here by giving the catalog a
    different recorded hash for one shard while its verdict row is put back, as if the disk had rotted."""
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    victim = str(shard(steps_of(tree)[2]))
    with sqlite3.connect(db) as conn:
        saved = conn.execute("SELECT run_path, key, judged_ns, run_doc, summary FROM run_verdicts").fetchall()
        conn.execute("UPDATE files SET hash = ? WHERE path = ?", ["0" * 32, victim])
        assert conn.execute("SELECT count(*) FROM run_verdicts").fetchone() == (0,)  # the trigger
        conn.executemany("INSERT INTO run_verdicts VALUES (?, ?, ?, ?, ?)", saved)
    # without a content read, the stat cache and the verdict both stand (as for any stat-keyed cache)
    assert cached_scan(tree, db, scrub=None).runs_reused == {str(tree)}
    every = cached_scan(tree, db, scrub=ScrubPolicy(period_ns=0))  # re-read every file by content
    assert every.runs_reused == frozenset()
    step6 = every.runs[0].checkpoints[2]
    assert step6.status is Status.CORRUPT
    assert "hash-drift" in {f.code for f in step6.all_findings}


def test_a_shard_rewritten_in_place_with_its_size_is_read_again(tree, tmp_path):
    """Same size, same inode, a new mtime: neither the kept verdict nor the stat cache may vouch for it."""
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    victim = shard(steps_of(tree)[2])
    size, inode, mtime = victim.stat().st_size, victim.stat().st_ino, victim.stat().st_mtime_ns
    flip_payload_byte(victim)
    os.utime(victim, ns=(mtime, mtime + 10**9))  # a second later, still far outside the in-progress window
    assert (victim.stat().st_size, victim.stat().st_ino) == (size, inode)
    again = cached_scan(tree, db, scrub=None)  # no content re-read by the scrub: the stat alone must send it
    assert again.runs_reused == frozenset() and str(victim) not in again.reused_paths
    assert again.runs[0].checkpoints[2].status is Status.CORRUPT
    assert again.runs == fresh_scan(tree, db).runs


def test_bit_rot_under_one_of_two_kept_runs_judges_that_run_alone_afresh(tmp_path):
    """The scrub's re-reads are matched to their own run: the other run's verdict stands."""
    root = tmp_path / "root"
    a, b = write_torch_tree(root / "a"), write_torch_tree(root / "b")
    age(root)
    db = tmp_path / "c.db"
    cached_scan(root, db)
    victim = str(shard(steps_of(b)[2]))
    with sqlite3.connect(db) as conn:  # bit rot under a kept stat, as in the test above: the row says other bytes
        saved = conn.execute("SELECT run_path, key, judged_ns, run_doc, summary FROM run_verdicts").fetchall()
        conn.execute("UPDATE files SET hash = ? WHERE path = ?", ["0" * 32, victim])
        conn.execute("DELETE FROM run_verdicts")
        conn.executemany("INSERT INTO run_verdicts VALUES (?, ?, ?, ?, ?)", saved)
    again = cached_scan(root, db, scrub=ScrubPolicy(period_ns=0))  # every file re-read by content
    assert again.runs_reused == {str(a)}
    by_path = {r.path: r for r in again.runs}
    assert "hash-drift" in {f.code for f in by_path[str(b)].checkpoints[2].all_findings}
    assert by_path[str(a)] == fresh_scan(root, db).runs[0]


def test_the_scrub_under_a_kept_verdict_moves_on_and_keeps_every_fact(tree, tmp_path):
    """The scrub re-reads files of a run whose verdict stands: their rows must record the new read (or the same
    files would be re-read every night), and the facts taken from the catalog for bytes that read back the same
    (structure, findings) must be exactly what a full parse writes."""
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    columns = "path, size_bytes, mtime_ns, inode, hash, crc_ok, file_findings, pt_facts, dcp_facts, kind, rank"

    def rows() -> tuple[dict[str, tuple], dict[str, int]]:
        with sqlite3.connect(db) as conn:
            facts = {r[0]: r for r in conn.execute(f"SELECT {columns} FROM files WHERE present = 1")}
            verified = dict(conn.execute("SELECT path, verified_ns FROM files WHERE present = 1"))
        return facts, verified

    before, verified_before = rows()
    every = cached_scan(tree, db, scrub=ScrubPolicy(period_ns=0))  # re-read every file by content
    assert every.runs_reused == {str(tree)} and every.files_scrubbed == len(before)
    after, verified_after = rows()
    assert after == before
    assert all(verified_after[p] > verified_before[p] for p in before)
    assert every.runs == fresh_scan(tree, db).runs
    rehashed = tmp_path / "r.db"  # the same tree judged by --rehash: every pickle parsed again
    shutil.copy(db, rehashed)
    cached_scan(tree, rehashed, rehash=True)
    with sqlite3.connect(rehashed) as conn:
        assert {r[0]: r for r in conn.execute(f"SELECT {columns} FROM files WHERE present = 1")} == before


def test_the_scrub_share_under_a_kept_verdict_counts_the_catalogued_bytes_alone(tree, tmp_path):
    """The share is of the bytes a cache would reuse: a kept run's files with a row, not a big run-level file the
    catalog keeps no row for (read every scan anyway). Half a period since the last content read: half those bytes."""
    (tree / "notes.bin").write_bytes(os.urandom(4 << 20))
    age(tree.parent)
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    period = 10 * 86_400 * 10**9
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE files SET verified_ns = ?", [time.time_ns() - period // 2])  # keeps the verdict
        rowed = [s for (s,) in conn.execute("SELECT size_bytes FROM files WHERE present = 1 AND hash IS NOT NULL")]
        assert str(tree / "notes.bin") not in {p for (p,) in conn.execute("SELECT path FROM files")}
    again = cached_scan(tree, db, scrub=ScrubPolicy(period_ns=period))
    assert again.runs_reused == {str(tree)}
    share = sum(rowed) / 2
    assert share <= again.bytes_scrubbed < share + max(rowed)  # oldest first until the share is taken


def test_a_rewritten_catalog_row_or_status_deletes_the_verdict(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    step2 = str(steps_of(tree)[0])
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE files SET verified_ns = verified_ns + 1")  # a scrub's read of the same content
        assert set(dict(conn.execute("SELECT run_path, key FROM run_verdicts"))) == {str(tree)}
        conn.execute("UPDATE checkpoints SET status = 'corrupt' WHERE path = ?", [step2])  # a survivor check
        assert conn.execute("SELECT count(*) FROM run_verdicts").fetchone() == (0,)
    again = cached_scan(tree, db)
    assert again.runs_reused == frozenset()
    assert again.runs[0].checkpoints[0].status is Status.COMPLETE  # judged from the tree again
    assert set(verdict_rows(db)) == {str(tree)}


def test_a_damaged_verdict_row_is_judged_afresh_and_replaced(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    for doc in ("not json", "[1, 2]", json.dumps(["/elsewhere", "verl-fsdp", None, [], [], None])):
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE run_verdicts SET run_doc = ?", [doc])
        again = cached_scan(tree, db)
        assert again.runs_reused == frozenset()
        assert again.runs == fresh_scan(tree, db).runs
    assert cached_scan(tree, db).runs_reused == {str(tree)}


def test_a_run_with_something_unread_inside_is_never_cached(tree, tmp_path):
    db = tmp_path / "c.db"
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"x")
    (tree / "global_step_6" / "stray.pt").symlink_to(outside)  # a link out of the root: not followed
    age(tree.parent.parent)
    cached_scan(tree, db)
    assert verdict_rows(db) == {}
    assert cached_scan(tree, db).runs_reused == frozenset()


def test_rehash_and_a_step_directory_judge_afresh(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    assert cached_scan(tree, db, rehash=True).runs_reused == frozenset()
    assert cached_scan(tree, db).runs_reused == {str(tree)}  # the rehash judged it afresh and kept that
    with open_session(db, roots=[steps_of(tree)[0]]) as s:  # one checkpoint alone: not the whole run's verdict
        assert s.scan(cached_verdicts=True).result.runs_reused == frozenset()
    assert verdict_rows(db) == {}
    assert cached_scan(tree, db).runs_reused == frozenset()
    assert cached_scan(tree, db).runs_reused == {str(tree)}


def test_two_runs_one_changed(tmp_path):
    root = tmp_path / "root"
    a = write_torch_tree(root / "a")
    b = write_torch_tree(root / "b")
    age(root)
    db = tmp_path / "c.db"
    cached_scan(root, db)
    (b / "latest_checkpointed_iteration.txt").write_text("4")
    again = cached_scan(root, db)
    assert again.runs_reused == {str(a)}
    assert again.runs == fresh_scan(root, db).runs
    assert {r.path: r.tracker_step for r in again.runs} == {str(a): 6, str(b): 4}


def test_the_run_document_round_trips_every_field():
    f = Finding(severity=Severity.WARNING, code="missing-rank", path="/r/s/a", message="m", rank=3, tensor="w")
    sf = ShardFile(
        path="/r/s/a/model_world_size_2_rank_1.pt",
        kind=FileKind.MODEL,
        size_bytes=10,
        mtime_ns=2**62,
        inode=7,
        rank=1,
        world_size=2,
        hash="ab" * 16,
        crc_ok=False,
    )
    comp = Component(role="actor", path="/r/s/a", layout="verl-fsdp", world_size=2, files=(sf,), findings=(f,))
    ckpt = Checkpoint(
        run_path="/r",
        step=2**63 - 1,
        path="/r/s",
        status=Status.UNKNOWN,
        components=(comp,),
        files=(sf,),
        findings=(f, f),
        mtime_ns=5,
    )
    run = Run(path="/r", layout="verl-fsdp", tracker_step=4, checkpoints=(ckpt,), findings=(f,), metrics_path="/r/m")
    back = run_from_json(run_to_json(run))
    assert back == run
    assert type(back.checkpoints[0].status) is Status and type(back.findings[0].severity) is Severity
    assert isinstance(back.checkpoints, tuple) and isinstance(back.checkpoints[0].components[0].files, tuple)


def _real_tree(name: str, request) -> Path:
    if name in ("megatron", "dcp"):
        return Path(request.getfixturevalue("dcp_trees")[name])
    if name == "torchtitan":
        return Path(request.getfixturevalue("titan_dump")) / "checkpoint"
    return Path(request.getfixturevalue(name))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["verl_run", "verl_run_critic", "verl_run_sft", "megatron", "dcp", "hf_run", "torchtitan"]
)
def test_real_trees_judged_the_same_from_the_cache(name, request, tmp_path):
    """Trees written by real runs (multi-process FSDP, a critic, SFT, Megatron dist_ckpt, plain DCP, a transformers
    Trainer, torchtitan's checkpointer): the cached verdict equals a fresh judgement, and one truncated file makes
    the run judged afresh and caught."""
    src = _real_tree(name, request)
    root = tmp_path / "root"
    run = root / src.parent.name / src.name
    shutil.copytree(src, run, symlinks=True)
    age(root)
    db = tmp_path / "c.db"
    first = cached_scan(root, db)
    again = cached_scan(root, db)
    assert again.runs_reused == {r.path for r in first.runs} != frozenset()
    assert again.runs == fresh_scan(root, db).runs == first.runs
    victim = max((p for p in run.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    after = cached_scan(root, db)
    assert after.runs_reused == frozenset()
    assert after.runs == fresh_scan(root, db).runs
    assert any(str(victim) == f.path or str(victim).startswith(f.path) for f in after.all_findings)


def test_nested_directories_are_found_by_their_ancestors():
    assert verdicts.nested(["/a/b", "/a/b/c", "/x", "/a/bc"]) == {"/a/b", "/a/b/c"}
    assert verdicts.nested(["/", "/x"]) == {"/", "/x"}
    assert verdicts.nested(["/a", "/ab", "/b/a"]) == set()


def test_a_finding_inside_a_run_keeps_it_uncached_whatever_sorts_between(tmp_path):
    """`exp-2/...` sorts between `exp` and `exp/...`: the lookup of a run's walk findings must not stop there."""
    root = tmp_path / "root"
    for run in ("exp", "exp-2"):
        (root / run / "global_step_1").mkdir(parents=True)
        (root / run / "global_step_1" / "data.pt").write_bytes(b"x")
        (root / run / "gone.pt").symlink_to(root / "missing")  # a broken link: a walk finding inside the run
    tree, stats, found = walk(str(root))
    assert {f.path for f in found} == {str(root / r / "gone.pt") for r in ("exp", "exp-2")}
    runs = {str(root / r): sorted(tree.files_below(str(root / r))) for r in ("exp", "exp-2")}
    later = time.time_ns() + 10**9  # everything is older than that: only the findings keep a run from the cache
    assert set(verdicts.settled_runs(runs, tree, stats, [], now_ns=later, window_ns=0)) == set(runs)
    assert verdicts.settled_runs(runs, tree, stats, found, now_ns=later, window_ns=0) == {}
    only_exp = [f for f in found if "/exp/" in f.path]
    assert set(verdicts.settled_runs(runs, tree, stats, only_exp, now_ns=later, window_ns=0)) == {str(root / "exp-2")}


def test_nested_roots_judge_afresh(tree, tmp_path):
    db = tmp_path / "c.db"
    cached_scan(tree, db)
    with open_session(db, roots=[tree.parent.parent, tree]) as s:  # the run seen under both roots
        result = s.scan(cached_verdicts=True).result
    assert result.runs_reused == frozenset()
    assert result.runs == fresh_scan(tree, db).runs


CHILD_COUNTING_CONNECTIONS = r"""
import sys
catalog = sys.argv[1]
opened = []
def hook(event, args):
    if event == "sqlite3.connect" and str(args[0]).startswith(f"file:{catalog}?mode=ro"):
        opened.append(args[0])
sys.addaudithook(hook)
from ckpt_audit.cli import cli
try:
    cli.main(["scan", "-q", "--catalog", catalog, sys.argv[2]], standalone_mode=False)
except SystemExit:
    pass
print(len(opened))
"""


def test_a_cron_rescan_reads_the_catalog_over_one_connection(tmp_path):
    """The kept verdicts, the rows they need and the kept deep verdicts: one read-only connection per scan (and
    the lock's probe before it), not one per query or per run."""
    import subprocess
    import sys

    root = tmp_path / "root"
    runs = {str(write_torch_tree(root / name)) for name in ("a", "b", "c")}
    age(root)
    db = tmp_path / "c.db"
    cached_scan(root, db)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", CHILD_COUNTING_CONNECTIONS, str(db), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 2  # probe, then the scan's own
    assert cached_scan(root, db).runs_reused == runs


def test_a_damaged_verdict_of_one_run_leaves_the_other_runs_kept(tmp_path):
    """The kept runs' models come in one query: a row that cannot be read back makes its run judged afresh alone."""
    root = tmp_path / "root"
    a = write_torch_tree(root / "a")
    b = write_torch_tree(root / "b")
    age(root)
    db = tmp_path / "c.db"
    cached_scan(root, db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE run_verdicts SET run_doc = '[1, 2]' WHERE run_path = ?", [str(b)])
    again = cached_scan(root, db)
    assert again.runs_reused == {str(a)}
    assert again.runs == fresh_scan(root, db).runs


def test_the_code_stamp_covers_the_judging_subpackages(tmp_path):
    """A kept verdict is keyed by the judging code: an edit to a reader in a subpackage (readers/pt/) must change
    the key as an edit to readers/ itself does, or a fixed reader would never re-judge the runs it misjudged."""
    copy = tmp_path / "pkg"
    shutil.copytree(Path(ckpt_audit.__file__).parent, copy / "ckpt_audit", ignore=shutil.ignore_patterns("__pycache__"))

    def stamp() -> str:
        code = "from ckpt_audit.scan.verdicts import code_stamp; print(code_stamp())"
        env = {**os.environ, "PYTHONPATH": str(copy)}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=copy, check=True, capture_output=True, text=True
        )
        return run.stdout

    before = stamp()
    reader = copy / "ckpt_audit" / "readers" / "pt" / "read.py"
    os.utime(reader, ns=(reader.stat().st_atime_ns, reader.stat().st_mtime_ns + 1))
    assert stamp() != before
