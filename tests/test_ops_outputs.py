"""What operations read: the Prometheus textfile of a scan (parsed with prometheus_client's own parser), the
sample alert rules against it, the Datasette canned queries on catalog.db.example, and continuity's zero-step
resume. Real trainer trees and the real CLI throughout."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from cli_proc import ckpt_audit
from prometheus_client.parser import text_string_to_metric_families
from scan_trees import flip_payload_byte, shard
from test_resume_gate import age

REPO = Path(__file__).resolve().parent.parent


def samples(path: Path) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed the way Prometheus parses a textfile."""
    out = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_file_describes_the_scan(verl_run, copy_run, tmp_path):
    run = Path(copy_run(verl_run))
    flip_payload_byte(shard(run / "global_step_6", "model", 0))
    age(run)
    prom, db = tmp_path / "textfile" / "ckpt_audit.prom", tmp_path / "c.db"
    started = time.time()
    prom.parent.mkdir()
    out = ckpt_audit("scan", "-q", "--metrics-file", prom, run, catalog=db)
    assert out.returncode == 1, out.stderr  # the corrupt checkpoint is an error finding
    got = samples(prom)
    lv = (("name", "demo/exp"), ("run", str(run)))

    def one(name: str, **labels) -> float:
        return got[(f"ckpt_audit_{name}", tuple(sorted({**dict(lv), **labels}.items())))]

    assert one("checkpoints", status="complete") == 2 and one("checkpoints", status="corrupt") == 1
    assert one("latest_complete_step") == 4
    assert 3 * 3600 - 60 < one("latest_complete_age_seconds") < 4 * 3600
    assert one("findings", severity="error", code="crc-mismatch") == 1
    assert one("run_bytes") == sum(p.stat().st_size for p in run.glob("global_step_*/**/*") if p.is_file())
    assert one("unverified_files") == 0  # every file was read by content by this scan
    assert one("oldest_verification_timestamp_seconds") >= started
    assert got[("ckpt_audit_scan_files_reused", ())] == 0 and got[("ckpt_audit_scan_bytes_hashed", ())] > 0
    assert got[("ckpt_audit_scrub_period_seconds", ())] == 7 * 86400
    assert not list(prom.parent.glob("*.prom.*"))  # the temporary file was renamed over the target
    ckpt_audit("scan", "-q", "--metrics-file", prom, run, catalog=db)
    again = samples(prom)
    assert again[("ckpt_audit_scan_files_reused", ())] > 0  # the second scan reused what the first read


def test_alert_rules_name_metrics_the_textfile_has(verl_run, copy_run, tmp_path):
    run = Path(copy_run(verl_run))
    prom = tmp_path / "m.prom"
    ckpt_audit("scan", "-q", "--metrics-file", prom, run, catalog=tmp_path / "c.db")
    written = {fam.name for fam in text_string_to_metric_families(prom.read_text())}
    rules = (REPO / "docs" / "alerts.yml").read_text()
    named = set(re.findall(r"\bckpt_audit_[a-z_]+\b", rules))
    assert named and named <= written, named - written
    assert {"CheckpointStale", "CheckpointErrorFinding", "ScrubOverdue"} <= set(re.findall(r"alert: (\w+)", rules))


def test_metrics_file_unwritable_is_one_line_exit_3(verl_run, tmp_path):
    out = ckpt_audit(
        "scan", "--metrics-file", tmp_path / "no" / "such" / "dir" / "m.prom", verl_run, catalog=tmp_path / "c"
    )
    assert out.returncode == 3 and out.stderr.count("\n") == 1 and "metrics file" in out.stderr


def test_datasette_canned_queries_run_on_the_example_catalog():
    meta = json.loads((REPO / "datasette" / "metadata.json").read_text())
    queries = meta["databases"]["catalog"]["queries"]
    assert {"latest_complete_per_run", "findings_by_code", "hash_drift_history", "prune_log"} <= set(queries)
    conn = sqlite3.connect(f"file:{REPO / 'catalog.db.example'}?mode=ro", uri=True)
    rows = {name: conn.execute(q["sql"]).fetchall() for name, q in queries.items()}
    assert rows["latest_complete_per_run"][0][:3] == ("demo/exp", 6, "/ckpts/demo/exp/global_step_6")
    assert ("error", "crc-mismatch") in {r[:2] for r in rows["findings_by_code"]}


def test_datasette_queries_show_drift_prunes_and_tracker_fixes(verl_run, copy_run, tmp_path):
    """The example catalog holds no drift, prune or repair: build one that does, through the CLI."""
    run = Path(copy_run(verl_run))
    age(run)
    db = tmp_path / "c.db"
    assert ckpt_audit("scan", "-q", run, catalog=db).returncode == 0
    victim = str(shard(run / "global_step_2", "model", 0))
    flip_payload_byte(Path(victim))
    ckpt_audit("scan", "-q", "--rehash", run, catalog=db)
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    age(run / "latest_checkpointed_iteration.txt")
    assert ckpt_audit("fix-tracker", "--yes", run, catalog=db).returncode == 0
    assert ckpt_audit("prune", "--keep-last", "1", "--yes", run.parent.parent, catalog=db).returncode == 0
    queries = json.loads((REPO / "datasette" / "metadata.json").read_text())["databases"]["catalog"]["queries"]
    conn = sqlite3.connect(db)
    drift = conn.execute(queries["hash_drift_history"]["sql"]).fetchall()
    assert [(r[0], r[-1]) for r in drift] == [(victim, 0), (victim, 1)]  # as first read, then the drifted read
    assert conn.execute(queries["tracker_fixes"]["sql"]).fetchall()[0][2:6] == ("behind", "4", 4, 6)
    assert {r[6] for r in conn.execute(queries["prune_log"]["sql"]).fetchall()} >= {"deleted"}


def test_continuity_reports_a_resume_that_trained_nothing(verl_run, tmp_path):
    """Attempt one trains to the epoch boundary (step 4); attempt two resumes there, logs its validation at step 4
    and exits 0 having trained nothing (verl #5725)."""
    lines = (Path(verl_run) / "metrics.jsonl").read_text().splitlines()
    first = tmp_path / "attempt1.jsonl"
    first.write_text("\n".join(lines[:4]) + "\n")
    second = tmp_path / "attempt2.jsonl"
    second.write_text(json.dumps({"step": 4, "val/score": 0.5}) + "\n")
    out = ckpt_audit("continuity", "--json", first, second, catalog=tmp_path / "c.db")
    doc = json.loads(out.stdout)
    [zero] = [f for f in doc["findings"] if f["code"] == "resume-trained-nothing"]
    assert zero["path"] == str(second) and "trained zero steps" in zero["message"]
    whole = ckpt_audit("continuity", "--json", Path(verl_run) / "metrics.jsonl", catalog=tmp_path / "c.db")
    assert "resume-trained-nothing" not in {f["code"] for f in json.loads(whole.stdout)["findings"]}
