"""The scan/ls/show CLI: CliRunner for output, subprocesses for exit codes, JSON and import hygiene."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

from cli_proc import ckpt_audit
from click.testing import CliRunner
from scan_trees import base_run, run_copy, shard, steps_of  # noqa: F401

from ckpt_audit import lock
from ckpt_audit.cli import cli


def test_scan_json_document_and_catalog(run_copy, tmp_path):
    db = tmp_path / "c.db"
    res = CliRunner().invoke(cli, ["scan", "--json", "--catalog", str(db), str(run_copy)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == 1 and doc["command"] == "scan" and doc["exit_code"] == 0
    assert doc["summary"]["statuses"] == {"complete": len(steps_of(run_copy))}
    (run,) = doc["runs"]
    ck = run["checkpoints"][-1]
    assert ck["status"] == "complete" and ck["components"][0]["role"] == "actor"
    assert {
        "path",
        "kind",
        "rank",
        "world_size",
        "size_bytes",
        "mtime_ns",
        "inode",
        "hash",
        "crc_ok",
        "verified_ns",
    } == set(ck["components"][0]["files"][0])
    again = json.loads(CliRunner().invoke(cli, ["scan", "--json", "--catalog", str(db), str(run_copy)]).stdout)
    assert again["files_reused"] >= len(ck["components"][0]["files"]) and again["scan_id"] == doc["scan_id"] + 1


def test_ls_and_show_answer_from_the_catalog(run_copy, tmp_path):
    db = str(tmp_path / "c.db")
    step = steps_of(run_copy)[0]
    shard(step, "model", 1).unlink()
    runner = CliRunner()
    assert runner.invoke(cli, ["scan", "-q", "--catalog", db, str(run_copy)]).exit_code == 1
    out = runner.invoke(cli, ["ls", "--catalog", db])
    assert out.exit_code == 0, out.output
    assert "demo/exp" in out.output and "incomplete 1" in out.output  # the run, named under its scan root
    runs = json.loads(runner.invoke(cli, ["ls", "--json", "--catalog", db]).stdout)["runs"]
    ckpts = json.loads(runner.invoke(cli, ["ls", runs[0]["path"], "--json", "--catalog", db]).stdout)["checkpoints"]
    assert [c["status"] for c in ckpts][0] == "incomplete" and ckpts[0]["errors"] >= 1
    detail = json.loads(runner.invoke(cli, ["show", str(step), "--json", "--catalog", db]).stdout)["checkpoint"]
    assert "missing-rank" in {f["code"] for f in detail["findings"]}
    text = runner.invoke(cli, ["show", str(step), "--catalog", db]).output
    assert "missing-rank" in text and "model" in text
    hist = json.loads(runner.invoke(cli, ["show", str(shard(step, "model", 0)), "--json", "--catalog", db]).stdout)
    assert len(hist["history"]) == 1 and len(hist["history"][0]["hash"]) == 32
    assert runner.invoke(cli, ["show", "/no/such/thing", "--catalog", db]).exit_code == 3


def test_exit_codes_through_a_subprocess(run_copy, tmp_path):
    db = tmp_path / "c.db"
    clean = ckpt_audit("scan", "-q", "--catalog", db, run_copy)
    assert clean.returncode == 0 and clean.stdout == "" and clean.stderr == ""
    (run_copy / "latest_checkpointed_iteration.txt").unlink()
    assert ckpt_audit("scan", "-q", "--catalog", db, run_copy).returncode == 0  # a warning, below --fail-on error
    warn = ckpt_audit("scan", "-q", "--fail-on", "warning", "--catalog", db, run_copy)
    assert warn.returncode == 1 and "tracker-missing" in warn.stdout
    doc = json.loads(ckpt_audit("scan", "--json", "--fail-on", "warning", "--catalog", db, run_copy).stdout)
    assert doc["exit_code"] == 1 and doc["summary"]["warnings"] >= 1
    missing = ckpt_audit("scan", "--catalog", db, tmp_path / "nope")
    assert missing.returncode == 3 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    bad = ckpt_audit("scan", "--catalog", garbage, run_copy)
    assert bad.returncode == 3 and bad.stderr.startswith("ckpt-audit: error:") and "Traceback" not in bad.stderr
    assert ckpt_audit("scan", "--workers", "0", run_copy).returncode == 2


def test_an_empty_or_directory_catalog_is_a_usage_error_that_writes_nothing(run_copy, tmp_path):
    # sqlite3 opens "" as a private temporary database: a scan into it would report success and keep nothing
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for command in (["scan", "-q", run_copy], ["ls"]):
        for catalog in ("", tmp_path):
            out = ckpt_audit(*command, "--catalog", catalog, cwd=cwd)
            assert out.returncode == 2 and "--catalog" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert list(cwd.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "root"]


def test_overlapping_run_exits_at_once_with_code_4(run_copy, tmp_path):
    db = tmp_path / "c.db"
    with lock.hold(lock.lock_path_for(db)):
        out = ckpt_audit("scan", "--catalog", db, run_copy)
    assert out.returncode == 4 and "another ckpt-audit run" in out.stderr


def test_catalog_env_var_is_the_default(run_copy, tmp_path):
    db = tmp_path / "env.db"
    assert ckpt_audit("scan", "-q", run_copy, env={"CKPT_AUDIT_CATALOG": str(db)}).returncode == 0
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM scans").fetchone() == (1,)
