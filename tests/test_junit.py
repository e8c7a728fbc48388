"""--junit-xml: each command's result as JUnit test cases, read back with junitparser and checked against Jenkins'
junit-10.xsd. Exit codes and output are those of the same command without it; a case fails exactly when the exit
code counts it. resume-test's cases are read back from real failing resumes in test_harness_resume.py (every
--drop) and test_resume_verl.py (--drop data through verl's manager), and from passing ones in test_ci_recipes.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from junit_read import assert_schema_valid, failed, read_junit
from scan_trees import base_run, flip_payload_byte, run_copy, shard

from ckpt_audit.report_junit import Case, Suite, render, write_junit


def test_report_escapes_what_xml_cannot_carry_and_is_schema_valid(tmp_path):
    garbage = "bad\x01name\udcff\ufffe"  # a control character, a surrogate-escaped byte, a non-character
    suite = Suite(
        name="scan",
        cases=(
            Case(classname="demo/exp", name="global_step_2", detail="status complete"),
            Case(classname="demo/exp", name=garbage, failure=f"crc-mismatch: {garbage}", kind="crc-mismatch"),
        ),
        properties=(("command", f"ckpt-audit scan {garbage}"),),
        seconds=1.23456,
    )
    out = tmp_path / "r.xml"
    write_junit(str(out), [suite])
    cases, props, suites = read_junit(out)
    assert props["command"] == "ckpt-audit scan bad\\x01name\\xff\\xfffe"
    bad = cases[("demo/exp", "bad\\x01name\\xff\\xfffe")]
    assert not bad.passed and bad.kind == "crc-mismatch" and bad.message.startswith("crc-mismatch: bad\\x01")
    assert cases[("demo/exp", "global_step_2")].passed
    assert (suites[0].tests, suites[0].failures, suites[0].errors) == (2, 1, 0)
    assert_schema_valid(out)
    assert [p.name for p in tmp_path.iterdir()] == ["r.xml"]  # written through a temporary file, renamed
    # the schema check can fail: a testsuite without its required failures count is refused
    broken = tmp_path / "broken.xml"
    broken.write_bytes(render([suite]).replace(b' failures="1" errors="0" skipped', b' errors="0" skipped'))
    with pytest.raises(Exception, match="failures"):
        assert_schema_valid(broken)


def _without_volatile(doc):
    """A scan document without what differs between two runs over the same tree: times, scan id, catalog."""
    if isinstance(doc, list):
        return [_without_volatile(x) for x in doc]
    if isinstance(doc, dict):
        return {
            k: _without_volatile(v) for k, v in doc.items() if not k.endswith("_ns") and k not in ("scan_id", "catalog")
        }
    return doc


@pytest.mark.slow
@pytest.mark.parametrize("command", ["scan", "verify"])
def test_scan_and_verify_one_case_per_checkpoint_failing_on_the_corrupt_one(run_copy, tmp_path, command):
    """The harness's verl tree (W=2, steps 2/4/6) with one flipped byte in step 4: that case alone fails."""
    flip_payload_byte(shard(run_copy / "global_step_4", "model", rank=1))
    root = run_copy.parent.parent
    report = tmp_path / "out" / "report.xml"
    report.parent.mkdir()
    both = ckpt_audit(command, "--json", "--catalog", tmp_path / "both.db", "--junit-xml", report, root)
    assert both.returncode == 1, both.stderr
    if command == "scan":  # the same document and exit code as without the report (verify: the same code path)
        plain = ckpt_audit(command, "--json", "--catalog", tmp_path / "plain.db", root)
        assert plain.returncode == 1
        assert _without_volatile(json.loads(both.stdout)) == _without_volatile(json.loads(plain.stdout))
    cases, props, _ = read_junit(report)
    assert sorted(cases) == [("demo/exp", f"global_step_{s}") for s in (2, 4, 6)]
    bad = failed(cases)
    assert list(bad) == [("demo/exp", "global_step_4")]
    assert bad[("demo/exp", "global_step_4")].kind == "crc-mismatch"
    assert bad[("demo/exp", "global_step_4")].message.startswith("corrupt: crc-mismatch: ")
    assert "model_world_size_2_rank_1.pt" in bad[("demo/exp", "global_step_4")].text
    assert props["command"].startswith(f"ckpt-audit {command} --json") and props["command"].endswith(str(root))
    assert props["version.ckpt-audit"] == "0.1.0" and props["version.torch"].startswith("2.")
    assert "version.verl" in props
    assert_schema_valid(report)
    if command == "verify":
        return
    # -q prints nothing when clean, and the report then has only passing cases
    quiet = ckpt_audit(command, "-q", "--catalog", tmp_path / "q.db", "--junit-xml", report, run_copy / "global_step_2")
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout
    cases, _, _ = read_junit(report)
    assert list(cases) == [("demo/exp", "global_step_2")] and not failed(cases)


def test_continuity_one_case_per_resume_point_failing_on_the_jump(tmp_path):
    rng = random.Random(0)
    rows = [{"step": s, "loss": 2.0 * 0.98**s + 0.5 + rng.gauss(0, 0.02)} for s in range(1, 90)]
    rows = [dict(r, loss=r["loss"] + (1.0 if r["step"] > 60 else 0)) for r in rows]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "continuity.xml"
    plain = ckpt_audit("continuity", log, "--resume-at", 30, "--resume-at", 60, "--json")
    both = ckpt_audit("continuity", log, "--resume-at", 30, "--resume-at", 60, "--json", "--junit-xml", report)
    assert plain.returncode == both.returncode == 1, both.stderr
    assert json.loads(both.stdout) == json.loads(plain.stdout)
    cases, _, _ = read_junit(report)
    assert sorted(cases) == [("continuity.loss", "resume from step 30"), ("continuity.loss", "resume from step 60")]
    bad = failed(cases)
    assert list(bad) == [("continuity.loss", "resume from step 60")]
    assert bad[("continuity.loss", "resume from step 60")].kind == "metric-jump"
    assert_schema_valid(report)


def test_an_unwritable_report_is_refused_before_any_work(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    for args in (
        ["scan", "--catalog", tmp_path / "c.db", "--junit-xml", tmp_path / "missing" / "r.xml", root],
        ["continuity", tmp_path, "--junit-xml", tmp_path / "missing" / "r.xml"],
        ["resume-test", "--junit-xml", tmp_path / "missing" / "r.xml"],
    ):
        proc = ckpt_audit(*args)
        assert proc.returncode == 3, (args, proc.stderr)
        assert proc.stderr.startswith("ckpt-audit: error: ") and "--junit-xml" in proc.stderr
        assert "Traceback" not in proc.stderr and "training" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]  # no catalog, no report, nothing trained
    # a file that is not a report (a shard named by a typo) is never replaced, nor a link's target
    shard = root / "model_world_size_2_rank_0.pt"
    shard.write_bytes(b"PK\x03\x04 a checkpoint")
    (tmp_path / "link.xml").symlink_to(shard)
    for target in (shard, tmp_path / "link.xml"):
        proc = ckpt_audit("scan", "--catalog", tmp_path / "c.db", "--junit-xml", target, root)
        assert proc.returncode == 3 and "is not an XML report: refusing to replace it" in proc.stderr, proc.stderr
    assert shard.read_bytes() == b"PK\x03\x04 a checkpoint" and not (tmp_path / "c.db").exists()


def test_model_config_names_nothing_is_a_usage_error_before_training(tmp_path):
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    for value, says in (
        (empty, "a directory without config.json"),
        (tmp_path / "nope" / "config.json", "no such file or directory"),
        ("acme/not-cached", "neither a path nor a model in the local Hugging Face cache"),
    ):
        proc = ckpt_audit("resume-test", "--model-config", value, env=env)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert "training" not in proc.stderr and "Traceback" not in proc.stderr
