"""Partial input never erases the whole; readers only read (issue 11, invariants 7 and 8).

Every test runs the real CLI in a subprocess on a copy of a trainer-written run, with a real catalog.
Permission cases run as root with the capabilities that bypass file permissions dropped (setpriv), not skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_proc import ckpt_audit, unprivileged
from scan_trees import flip_payload_byte


def cli(*args: str, catalog: Path, unprivileged: bool = False) -> subprocess.CompletedProcess:
    return ckpt_audit(*args, "--catalog", catalog, as_user=unprivileged)


def ls_run(run: Path, catalog: Path) -> dict:
    out = cli("ls", str(run), "--json", catalog=catalog)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    return Path(copy_run(verl_run))


def test_verify_of_one_step_keeps_the_runs_summary(run, tmp_path):
    cat = tmp_path / "cat.db"
    assert cli("scan", str(run), catalog=cat).returncode == 0
    before = ls_run(run, cat)
    assert before["run"]["n_checkpoints"] == 3 and before["run"]["latest_complete_step"] == 6

    assert cli("verify", str(run / "global_step_4"), catalog=cat).returncode == 0
    after = ls_run(run, cat)
    assert after["run"]["n_checkpoints"] == 3
    assert after["run"]["latest_complete_step"] == 6
    assert [c["step"] for c in after["checkpoints"]] == [2, 4, 6]


def test_scan_of_a_step_dir_checks_that_checkpoint_and_only_it(run, tmp_path):
    cat = tmp_path / "cat.db"
    assert cli("scan", str(run), catalog=cat).returncode == 0
    victim = run / "global_step_4" / "actor" / "model_world_size_2_rank_0.pt"
    flip_payload_byte(victim)
    os.utime(victim)  # a rewrite the stat shows: this test is about scope, not about the cache

    out = cli("scan", "--json", str(run / "global_step_4"), catalog=cat)
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    [scanned_run] = doc["runs"]
    assert [(c["step"], c["status"]) for c in scanned_run["checkpoints"]] == [(4, "corrupt")]
    # its own files and the run's (tracker, metrics log) were read or reused, not its neighbours'
    own = [p for p in (run / "global_step_4").rglob("*") if p.is_file()] + [p for p in run.iterdir() if p.is_file()]
    assert doc["files_hashed"] + doc["files_reused"] == len(own)

    listed = {c["step"]: c["status"] for c in ls_run(run, cat)["checkpoints"]}
    assert listed == {2: "complete", 4: "corrupt", 6: "complete"}


def test_scan_of_a_path_inside_a_step_dir_checks_its_checkpoint(run, tmp_path):
    cat = tmp_path / "cat.db"
    out = cli("scan", "--json", str(run / "global_step_2" / "actor"), catalog=cat)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [c["path"] for r in doc["runs"] for c in r["checkpoints"]] == [str(run.resolve() / "global_step_2")]
    assert "no-runs" not in {f["code"] for f in doc["findings"]}


def test_a_step_number_sqlite_cannot_hold_is_a_finding_not_an_error(run, tmp_path):
    cat = tmp_path / "cat.db"
    huge = run / "global_step_99999999999999999999999"
    shutil.copytree(run / "global_step_2", huge)
    actor = run / "global_step_4" / "actor"
    shutil.copy2(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_99999999999_rank_0.pt")

    out = cli("scan", "--json", str(run.parent.parent), catalog=cat)
    assert out.returncode == 0, out.stderr  # a warning: the rest of the root is judged and recorded
    doc = json.loads(out.stdout)
    [r] = doc["runs"]
    assert ("step-out-of-range", str(huge.resolve())) in {(f["code"], f["path"]) for f in r["findings"]}
    assert [c["step"] for c in ls_run(run, cat)["checkpoints"]] == [2, 4, 6]


def test_a_tracker_naming_a_step_sqlite_cannot_hold_is_invalid(run, tmp_path):
    cat = tmp_path / "cat.db"
    (run / "latest_checkpointed_iteration.txt").write_text("99999999999999999999999")
    out = cli("scan", "--json", str(run), catalog=cat)
    assert out.returncode == 1, out.stderr
    assert "tracker-invalid" in {f["code"] for r in json.loads(out.stdout)["runs"] for f in r["findings"]}


# -- readers read ----------------------------------------------------------------------------------------------


@pytest.fixture
def locked_down(run, tmp_path) -> tuple[Path, Path]:
    """(run, catalog): a catalog written by root's cron, in a directory nobody else may write."""
    cat_dir = tmp_path / "cron"
    cat_dir.mkdir()
    cat = cat_dir / "catalog.db"
    assert cli("scan", str(run), catalog=cat).returncode == 0
    cat.chmod(0o444)
    cat_dir.chmod(0o555)
    yield run, cat
    cat_dir.chmod(0o755)


def test_ls_and_show_read_a_catalog_they_cannot_write(locked_down):
    run, cat = locked_down
    before = sorted(os.listdir(cat.parent))
    out = cli("ls", "--json", catalog=cat, unprivileged=True)
    assert out.returncode == 0, out.stderr
    assert [r["n_checkpoints"] for r in json.loads(out.stdout)["runs"]] == [3]
    out = cli("show", str(run / "global_step_6"), catalog=cat, unprivileged=True)
    assert out.returncode == 0, out.stderr
    assert "complete" in out.stdout
    assert sorted(os.listdir(cat.parent)) == before  # nothing created beside it (no -wal, -shm, lock)


def test_continuity_reads_checkpoint_steps_from_a_catalog_it_cannot_write(locked_down):
    run, cat = locked_down
    out = cli(
        "continuity",
        str(run / "metrics.jsonl"),
        "--json",
        "--at-checkpoints",
        "--fail-on",
        "error",
        catalog=cat,
        unprivileged=True,
    )
    assert out.returncode == 0, out.stderr
    # the checkpoint steps came from the catalog (6 is the last logged step: nothing after it to judge)
    assert [p["resume_step"] for p in json.loads(out.stdout)["resume_points"]] == [2, 4]


def test_tui_browses_a_catalog_it_cannot_write(locked_down):
    run, cat = locked_down
    script = textwrap.dedent("""
        import asyncio, sys
        from pathlib import Path
        from tui.app import AuditApp

        app = AuditApp(catalog_path=Path(sys.argv[1]))

        async def main():
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.pause()
                await app.workers.wait_for_complete()
                await pilot.pause()
                print(app.last_error, [r.path for r in app.snapshot.runs], app.snapshot.unrecorded, sep="|")

        asyncio.run(main())
    """)
    out = subprocess.run(
        [*(unprivileged() or []), sys.executable, "-c", script, str(cat)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr
    error, runs, unrecorded = out.stdout.strip().splitlines()[-1].split("|")
    assert error == "None"
    assert runs == str([str(run.resolve())])
    assert unrecorded.startswith("catalog not writable")


def test_a_writer_leaves_no_wal_a_reader_would_need_to_create(run, tmp_path):
    cat = tmp_path / "cat.db"
    assert cli("scan", str(run), catalog=cat).returncode == 0
    assert not (tmp_path / "cat.db-wal").exists() and not (tmp_path / "cat.db-shm").exists()
    conn = sqlite3.connect(f"file:{cat}?mode=ro", uri=True)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()


# -- file rules run once the layout knows the file's kind ----------------------------------------------------


def _distcps(run: Path) -> list[Path]:
    found = sorted(run.rglob("*.distcp"))
    assert found and all(p.read_bytes()[:4] == b"PK\x03\x04" for p in found)  # they start like a zip
    return found


def test_a_distcp_is_read_as_its_chain_of_zips_and_no_zip_rule_judges_it(dcp_trees, tmp_path):
    from ckpt_audit.layouts import file_kind
    from ckpt_audit.models import FileKind, Status
    from ckpt_audit.readers.hashing import digest_file
    from ckpt_audit.rules import files as file_rules
    from ckpt_audit.scan import scan

    run = tmp_path / "megatron" / "exp"
    shutil.copytree(dcp_trees["megatron"], run)
    distcps = _distcps(run)
    p = str(distcps[0])
    d = digest_file(p)
    facts = dict(size=d.size_bytes, zip_error=d.zip_error, crc_bad=d.crc_bad_entries, prefix=d.prefix, changed=False)
    # the reader walks the items (each a torch.save zip) back to byte 0 and checks every entry's CRC-32 ...
    assert d.zip_error is None and d.crc_bad_entries == () and d.entries_checked > 1
    # ... so the rules, asked about what the layout calls it, find nothing
    assert file_kind(p) is FileKind.DISTCP
    assert file_rules.digest_findings(p, kind=FileKind.DISTCP, **facts) == ()
    result = scan([run], in_progress_window_s=0)
    assert all(result.file_facts[str(x)].findings == () for x in distcps)
    assert result.runs[0].checkpoints[0].status is Status.COMPLETE


def test_a_cached_distcp_row_with_zip_findings_is_read_again(dcp_trees, tmp_path):
    """A catalog written before the zip rules knew a .distcp is no zip holds zip findings for it: such a row is not
    reused (it would now reach the report unfiltered); the file is read again and judged as what it is."""
    from dataclasses import replace

    from ckpt_audit.codes import finding
    from ckpt_audit.models import Status
    from ckpt_audit.scan import scan

    run = tmp_path / "megatron" / "exp"
    shutil.copytree(dcp_trees["megatron"], run)
    target = str(_distcps(run)[0])
    first = scan([run], in_progress_window_s=0)
    stale = replace(first.file_facts[target], findings=(finding("bad-zip", target, "damaged: old rules"),))
    again = scan([run], in_progress_window_s=0, previous={**first.file_facts, target: stale})
    assert target not in again.reused_paths and len(again.reused_paths) == len(first.file_facts) - 1
    assert again.file_facts[target].findings == ()
    assert again.runs[0].checkpoints[0].status is Status.COMPLETE


def test_each_layout_names_its_own_step_directories():
    """A path inside a checkpoint scans it alone: which directories are checkpoints is each layout's fact
    (Layout.is_step_dir), asked of them all."""
    from ckpt_audit.layouts import enclosing_step_dir

    for step in ("global_step_3", "global_steps_3", "checkpoint-5", "step-10", "global_step7", "best_global_step7"):
        assert enclosing_step_dir(f"/r/run/{step}/actor/model.pt") == f"/r/run/{step}", step
    assert enclosing_step_dir("/r/run/actor") is None
    assert enclosing_step_dir("/r/run/my-tag/mp_rank_00_model_states.pt") is None  # a custom tag says nothing
