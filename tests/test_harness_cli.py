"""The resume-test and train commands through CliRunner and a real subprocess; failures never leave processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from click.testing import CliRunner

from ckpt_audit.cli import cli

pytestmark = pytest.mark.slow  # most of these run the reference trainer in subprocesses


def _group_members(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_resume_test_cli_equivalent_json_and_kept_tree(tmp_path):
    keep = tmp_path / "kept"
    result = CliRunner().invoke(
        cli, ["resume-test", "-w", "1", "--steps", "3", "--resume-step", "2", "--json", "--keep", str(keep)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1 and doc["equivalent"] is True and doc["mode"] == "exact"
    assert doc["resume_step"] == 2 and doc["culprit"] is None and doc["first_divergent_step"] is None
    resumed = Path(doc["tree"]) / "test0" / "resumed" / "demo" / "exp"
    assert (resumed / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (resumed / "global_step_2" / "actor" / "model_world_size_1_rank_0.pt").is_file()


def test_resume_test_subprocess_exit_1_names_dropped_data():
    proc = ckpt_audit(
        "resume-test", "-w", "1", "--steps", "3", "--resume-step", "2", "--drop", "data", "--json", timeout=900
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["equivalent"] is False and doc["culprit"] == "data"
    assert doc["restore_differences"][0]["component"] == "data"
    assert "Traceback" not in proc.stderr


def test_resume_test_to_another_world_size_judges_continuity_and_plots_it(tmp_path):
    svg = tmp_path / "resume.svg"
    result = CliRunner().invoke(
        cli, ["resume-test", "-w", "1", "--resume-world-size", "2", "--plot", str(svg), "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["mode"] == "continuity" and doc["steps"] == 24 and doc["resume_step"] == 13  # past the warmup
    assert set(doc["continuity"]) == {"loss", "lr", "grad_norm"}
    assert doc["continuity"]["loss"]["judgement"]["jumped"] is False
    text = svg.read_text()
    assert text.startswith("<svg") and "resume from step 13" in text and "JUMP" not in text


def test_resume_test_plot_needs_another_world_size_and_a_writable_place(tmp_path):
    result = CliRunner().invoke(cli, ["resume-test", "--plot", "x.svg"])
    assert result.exit_code == 2 and "--plot needs --resume-world-size" in result.output
    missing = tmp_path / "no-such-dir" / "x.svg"
    result = CliRunner().invoke(cli, ["resume-test", "--resume-world-size", "3", "--plot", str(missing)])
    assert result.exit_code == 3 and "not a writable directory" in result.stderr  # refused before any training
    assert "training" not in result.stderr


@pytest.mark.parametrize(
    "args", [["--steps", "3", "--resume-step", "5"], ["-w", "3", "--hsdp"], ["--model-config", "{cfg}"]]
)
def test_resume_test_bad_settings_exit_3_in_one_line(tmp_path, args):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 8}')  # no model_type
    args = [a.replace("{cfg}", str(bad)) for a in args]
    result = CliRunner().invoke(cli, ["resume-test", *args])
    assert result.exit_code == 3, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("ckpt-audit: error:")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]) and "Traceback" not in result.stderr


def test_train_cli_writes_a_tree(tmp_path):
    result = CliRunner().invoke(cli, ["train", str(tmp_path), "-w", "1", "--steps", "2", "--save-every", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["checkpoints"] == [1, 2] and [m["step"] for m in doc["metrics"]] == [1, 2]
    assert (tmp_path / "demo/exp/latest_checkpointed_iteration.txt").read_text() == "2"
    again = CliRunner().invoke(cli, ["train", str(tmp_path), "-w", "1", "--steps", "2"])
    assert again.exit_code == 3 and "--resume" in again.stderr  # never overwrites an existing run
    assert (tmp_path / "demo/exp/latest_checkpointed_iteration.txt").read_text() == "2"


def test_a_failing_rank_takes_every_process_down(verl_run, copy_run):
    from harness.config import TrainConfig
    from harness.launch import HarnessError, run_training

    run = copy_run(verl_run)
    (run / "global_step_6/actor/model_world_size_2_rank_1.pt").unlink()  # rank 1 cannot load; rank 0 would wait
    with pytest.raises(HarnessError) as err:
        run_training(TrainConfig(run_dir=str(run), world_size=2, steps=8, resume="auto"), timeout_s=600)
    assert "missing shard" in str(err.value) and "rank 1" in str(err.value)
    assert _group_members(err.value.pgid) == []
    assert not (run / "global_step_8").exists()
