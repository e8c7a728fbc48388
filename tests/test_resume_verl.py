"""resume-test --checkpointer verl: the reference trainer saves and loads through the installed verl's own
FSDPCheckpointManager (W=2, gloo), through the real CLI; a defect planted in what the trainer hands verl is named."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from click.testing import CliRunner

from ckpt_audit.cli import cli

SHORT = ["-w", "2", "--steps", "3", "--resume-step", "2"]  # restart mid-epoch (4 batches per epoch)


@pytest.mark.slow
def test_verl_manager_resumes_bit_exactly(tmp_path):
    # a skip, not an import: verl is not in the test extra (its metadata pins clash); the README installs it --no-deps
    pytest.importorskip("verl.utils.checkpoint.fsdp_checkpoint_manager")
    keep = tmp_path / "kept"
    result = CliRunner().invoke(cli, ["resume-test", *SHORT, "--checkpointer", "verl", "--json", "--keep", str(keep)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["equivalent"] is True and doc["culprit"] is None and doc["restore_difference_count"] == 0
    assert doc["checkpointer"] == "verl"
    assert doc["checkpointer_name"] == f"verl {version('verl')} FSDPCheckpointManager"
    actor = keep / "test0" / "resumed" / "demo" / "exp" / "global_step_2" / "actor"
    assert (actor / "extra_state_world_size_2_rank_1.pt").is_file() and (actor / "huggingface").is_dir()
    # verl writes generation_config.json only for a model loaded from a path; the reference writer always does:
    # the tree is verl's manager's own, not ours
    assert not (actor / "huggingface" / "generation_config.json").exists()


@pytest.mark.slow
def test_verl_data_position_withheld_is_caught_and_named(tmp_path):
    # a skip, not an import: verl is not in the test extra (its metadata pins clash); the README installs it --no-deps
    pytest.importorskip("verl.utils.checkpoint.fsdp_checkpoint_manager")
    from junit_read import failed, read_junit

    report = tmp_path / "resume-test.xml"
    resume_test = ("resume-test", *SHORT, "--checkpointer", "verl", "--drop", "data", "--junit-xml", report)
    proc = ckpt_audit(*resume_test, timeout=900)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert "through verl" in lines[0] and lines[1] == "DIVERGED (culprit: data)"
    assert any(line.strip().startswith("data: _snapshot.") and "samples_yielded: 24 vs 0" in line for line in lines)
    assert "Traceback" not in proc.stderr
    # the same verdict in the JUnit report (the text output above is what it is without one)
    step = re.search(r"first divergent step: (\d+) \((\w+):", proc.stdout)
    cases, props, _ = read_junit(report)
    bad = failed(cases)
    data = bad[("resume-test.restore", "data")]
    assert "samples_yielded: 24 vs 0" in data.message
    assert data.message.endswith(f"first divergent step {step[1]} ({step[2]})")
    assert all(cases[("resume-test.restore", i)].passed for i in ("model", "optimizer", "scheduler", "rng.cpu"))
    assert props["checkpointer"] == f"verl {version('verl')} FSDPCheckpointManager"


def test_verl_refuses_another_world_size_before_training():
    result = CliRunner().invoke(cli, ["resume-test", "--checkpointer", "verl", "--resume-world-size", "3"])
    assert result.exit_code == 2 and "verl #2265" in result.output and "training" not in result.output


def test_reference_stays_the_default():
    from harness.checkpointers import describe
    from harness.resume import ResumeTestSpec, plan_phases

    phases, _ = plan_phases([ResumeTestSpec()], Path("/nonexistent"))
    assert {cfg.checkpointer for cfg in phases} == {"reference"} and describe("reference") == "reference"
