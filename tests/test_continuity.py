"""Continuity: synthetic logs with planted faults, noisy logs without a jump, reference-trainer resumes, the CLI."""

from __future__ import annotations

import inspect
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from click.testing import CliRunner

from ckpt_audit.cli.continuity import continuity_command
from ckpt_audit.continuity import judge_resume, read_metrics, sparkline
from ckpt_audit.continuity.audit import audit_log
from ckpt_audit.continuity.resume_points import CheckpointRef


def _loss(step: int, rng: random.Random, noise: float = 0.02) -> float:
    return 2.0 * 0.98**step + 0.5 + rng.gauss(0, noise)


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _codes(result) -> list[str]:
    return [f.code for f in result.findings]


def test_noisy_log_with_clean_restart_has_no_finding_but_a_jump_is_flagged(tmp_path):
    rng = random.Random(3)
    clean = [{"step": s, "loss": _loss(s, rng, 0.08)} for s in range(1, 41)]
    clean += [{"step": s, "loss": _loss(s, rng, 0.08)} for s in range(41, 80)]
    for seed in range(5):  # several noise draws: a noisy run must not cry wolf
        rng = random.Random(seed)
        rows = [{"step": s, "loss": _loss(s, rng, 0.08)} for s in range(1, 80)]
        res = audit_log(read_metrics([_write(tmp_path / f"n{seed}.jsonl", rows)]), resume_at=[40])
        assert [p.point.resume_step for p in res.points] == [40]
        assert res.points[0].judgement.sufficient and not res.points[0].judgement.jumped
        assert _codes(res) == []
    rows = [dict(r, loss=r["loss"] + (1.2 if r["step"] > 40 else 0)) for r in clean]
    res = audit_log(read_metrics([_write(tmp_path / "jump.jsonl", rows)]), resume_at=[40])
    assert _codes(res) == ["metric-jump"]
    assert res.points[0].judgement.score > res.threshold


def test_one_spike_after_resume_is_not_a_jump_unless_after_is_one():
    rng = random.Random(1)
    pairs = [(s, _loss(s, rng)) for s in range(1, 40)]
    pairs[20] = (21, pairs[20][1] + 1.0)  # a single spike on the first step after a resume from 20
    assert not judge_resume(pairs, 20).jumped
    assert judge_resume(pairs, 20, after=1).jumped


def test_planted_double_counted_step_at_resume_with_catalog_steps(tmp_path):
    rng = random.Random(2)
    rows = [{"step": s, "loss": _loss(s, rng)} for s in range(1, 21)]
    rows += [{"step": s, "loss": _loss(s, rng)} for s in range(20, 40)]  # resumed from 20, counted 20 again
    log = read_metrics([_write(tmp_path / "m.jsonl", rows)])
    res = audit_log(log, checkpoints=[CheckpointRef(step=10), CheckpointRef(step=20)])
    assert [p.point.resume_step for p in res.points] == [20]
    assert _codes(res) == ["step-duplicated"]


def test_planted_duplicate_line_and_skipped_steps_inside_one_attempt(tmp_path):
    rng = random.Random(4)
    rows = [{"step": s, "loss": _loss(s, rng)} for s in range(1, 31) if s not in (17, 18)]
    rows.insert(5, dict(rows[4]))  # step 5 logged twice in a row
    res = audit_log(read_metrics([_write(tmp_path / "m.jsonl", rows)]))
    assert res.points == ()
    assert _codes(res) == ["step-duplicated", "step-skipped"]
    assert "steps 17-18" in res.findings[1].message


def test_crash_redo_is_info_and_resume_from_older_checkpoint_is_flagged(tmp_path):
    rng = random.Random(5)
    rows = [{"step": s, "loss": _loss(s, rng)} for s in range(1, 31)]
    rows += [{"step": s, "loss": _loss(s, rng)} for s in range(21, 50)]  # resumed from 20 although 25 existed
    log = read_metrics([_write(tmp_path / "m.jsonl", rows)])
    plain = audit_log(log)
    assert _codes(plain) == ["steps-redone"]
    res = audit_log(log, checkpoints=[CheckpointRef(step=s) for s in (10, 20, 25)])
    assert _codes(res) == ["steps-redone", "resumed-from-older"]
    assert "step 25 was complete" in res.findings[1].message


def test_resume_counting_past_its_checkpoint_is_skipped(tmp_path):
    rng = random.Random(6)
    a = _write(tmp_path / "a.jsonl", [{"step": s, "loss": _loss(s, rng)} for s in range(1, 21)])
    b = _write(tmp_path / "b.jsonl", [{"step": s, "loss": _loss(s, rng)} for s in range(24, 40)])
    res = audit_log(read_metrics([a, b]), resume_at=[20])
    assert res.points[0].point.sources == ("file", "manual")
    assert _codes(res) == ["step-skipped"]


def test_readers_verl_data_console_csv_and_bad_lines(tmp_path):
    verl = tmp_path / "verl.jsonl"
    verl.write_text(
        '{"step": 1, "data": {"actor": {"pg_loss": 0.5}, "critic/score/mean": 0.1}}\n'
        "step:2 - actor/pg_loss:0.4 - critic/score/mean:0.2\n"
        '{"step": 3, "data": {"actor/pg_loss": 0.3}\n'
    )
    log = read_metrics([verl])
    assert [r.step for r in log.records] == [1, 2]
    assert log.choose_metric(None) == "actor/pg_loss"
    assert log.series("critic/score/mean").values == (0.1, 0.2)
    assert len(log.bad_lines) == 1
    csvf = tmp_path / "run.csv"
    csvf.write_text("step,loss,reward\n1,2.0,0.1\n2,1.5,\n")
    log = read_metrics([csvf])
    assert log.series("loss").values == (2.0, 1.5) and log.series("reward").steps == (1,)


def test_sparkline():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([1, None, float("nan"), 1]) == "▄  ▄"
    assert sparkline([]) == ""


# -- the reference trainer ------------------------------------------------------------------------------------


def _write_resumes(root: Path) -> None:
    """The reference trainer to step 12 (saves at 6 and 12), then two restarts from step 12 to 18: one clean, one
    with the optimizer state left out of the restore. One launcher: each phase in freshly forked ranks."""
    from harness.config import TrainConfig
    from harness.launch import run_phases

    clean, dropped = root / "demo" / "clean", root / "demo" / "dropped"
    run_phases(
        [
            TrainConfig(run_dir=str(clean), steps=12, save_every=6),
            TrainConfig(
                run_dir=str(dropped), copy_from=str(clean), steps=18, save_every=6, resume="auto", drop=("optimizer",)
            ),
            TrainConfig(run_dir=str(clean), steps=18, save_every=6, resume="auto"),
        ],
        timeout_s=900,
    )


@pytest.fixture(scope="session")
def trainer_logs(tmp_path_factory):
    """(clean, dropped) metrics.jsonl of `_write_resumes`, cached like the trees in conftest.py."""
    from conftest import _key, build_cached

    key = _key({"writer": inspect.getsource(_write_resumes)})  # the harness's sources and versions, and the phases
    root = build_cached(tmp_path_factory, "trainer_logs", _write_resumes, key=key)
    return root / "demo" / "clean" / "metrics.jsonl", root / "demo" / "dropped" / "metrics.jsonl"


def test_trainer_clean_resume_passes_and_dropped_optimizer_is_flagged(trainer_logs, tmp_path):
    clean, dropped = trainer_logs
    args = ["--resume-at", "12", "--window", "10", "--after", "1"]
    runner = CliRunner()
    for metric in ("loss", "lr", "grad_norm"):
        res = runner.invoke(continuity_command, [str(clean), "--metric", metric, *args])
        assert res.exit_code == 0, res.output
    svg = tmp_path / "clean.svg"
    res = runner.invoke(continuity_command, [str(dropped), "--metric", "lr", "--plot", str(svg), *args])
    assert res.exit_code == 1, res.output
    assert "metric-jump" in res.output and "resume from step 12" in res.output
    assert svg.read_text().startswith("<svg") and "JUMP" in svg.read_text()


def test_cli_subprocess_json_and_errors(tmp_path):
    rng = random.Random(7)
    rows = [{"step": s, "loss": _loss(s, rng)} for s in range(1, 21)] + [
        {"step": s, "loss": _loss(s, rng) + 1.0} for s in range(21, 35)
    ]
    path = _write(tmp_path / "m.jsonl", rows)
    proc = ckpt_audit("continuity", path, "--resume-at", "20", "--json", timeout=60)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == 1 and doc["exit_code"] == 1
    assert [f["code"] for f in doc["findings"]] == ["metric-jump"]
    assert doc["resume_points"][0]["judgement"]["jumped"] is True
    runner = CliRunner()
    res = runner.invoke(continuity_command, [path, "--metric", "nope"])
    assert res.exit_code == 3 and "not in" in res.output
    res = runner.invoke(continuity_command, [str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 3
    tb = tmp_path / "events.out.tfevents.1.host"
    tb.write_bytes(b"\0" * 16)
    res = runner.invoke(continuity_command, [str(tb)])
    assert res.exit_code == 3 and len(res.output.strip().splitlines()) == 1


def test_trainer_resume_points_from_the_catalog(trainer_logs, tmp_path):
    from ckpt_audit.cli.scan import scan_command

    clean, dropped = trainer_logs
    db = tmp_path / "catalog.db"
    runner = CliRunner()
    assert runner.invoke(scan_command, ["--catalog", str(db), str(dropped.parent)]).exit_code == 0
    res = runner.invoke(
        continuity_command,
        [
            str(dropped),
            "--catalog",
            str(db),
            "--at-checkpoints",
            "--metric",
            "lr",
            "--after",
            "1",
            "--window",
            "10",
            "--json",
        ],
    )
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    by_step = {p["resume_step"]: p for p in doc["resume_points"]}
    assert sorted(by_step) == [6, 12] and by_step[6]["sources"] == ["checkpoint"]
    assert by_step[12]["findings"] == ["metric-jump"] and by_step[6]["findings"] == []
    res = runner.invoke(continuity_command, [str(clean), "--catalog", str(db)])
    assert res.exit_code == 3 and "no run in catalog" in res.output


# -- TensorBoard event files, written as verl's tensorboard logger writes them --------------------------------


def _as_tensorboard(metrics_jsonl, directory, *, attempts: tuple[slice, ...]) -> list:
    """verl's tensorboard logger: torch's SummaryWriter in tensorboard_log/<project>/<experiment>, one add_scalar per
    key and step, and a new writer (a new event file) each time the trainer process starts."""
    from torch.utils.tensorboard import SummaryWriter

    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines()]
    for attempt in attempts:
        writer = SummaryWriter(str(directory))
        for row in rows[attempt]:
            for key in ("loss", "lr", "grad_norm"):
                writer.add_scalar(f"actor/{key}", row[key], row["step"])
        writer.close()
    return rows


def test_tensorboard_event_files_of_a_clean_and_a_dropped_resume(trainer_logs, tmp_path):
    clean, dropped = trainer_logs
    tb = tmp_path / "tensorboard_log" / "demo"
    rows = _as_tensorboard(clean, tb / "clean", attempts=(slice(0, 12), slice(12, None)))
    _as_tensorboard(dropped, tb / "dropped", attempts=(slice(0, 12), slice(12, None)))
    log = read_metrics([tb / "clean"])  # the directory: its event files, oldest writer first
    assert len(log.paths) == 2 and log.file_starts == (0, 12)
    series = log.series("actor/loss")
    assert series.steps == tuple(range(1, 19))
    assert series.values == pytest.approx([r["loss"] for r in rows], rel=1e-6)  # float32 in the event file
    args = ["--metric", "actor/lr", "--window", "10", "--after", "1", "--json"]
    runner = CliRunner()
    res = runner.invoke(continuity_command, [str(tb / "clean"), *args])
    assert res.exit_code == 0, res.output
    point = json.loads(res.output)["resume_points"][0]
    assert point["sources"] == ["file"] and point["resume_step"] == 12 and point["findings"] == []
    res = runner.invoke(continuity_command, [str(tb / "dropped"), *args])
    assert res.exit_code == 1, res.output
    assert json.loads(res.output)["resume_points"][0]["findings"] == ["metric-jump"]


def test_tensorboard_event_file_cut_by_a_crash_is_a_finding_and_garbage_an_error(trainer_logs, tmp_path):
    clean, _ = trainer_logs
    tb = tmp_path / "tb"
    _as_tensorboard(clean, tb, attempts=(slice(0, 12),))
    event = next(tb.iterdir())
    whole = event.read_bytes()
    event.write_bytes(whole[:-9])  # the writer died inside its last record
    log = read_metrics([event])
    assert log.series("actor/loss").steps == tuple(range(1, 13))
    assert set(log.records[-1].values) == {"actor/loss", "actor/lr"}  # step 12's grad_norm event was the cut one
    [(path, _, why)] = log.bad_lines
    kept = int(why.split("cut after ")[1].split()[0])
    assert path == str(event) and f"of {len(whole) - 9} bytes" in why
    assert len(whole) - 9 - 100 < kept < len(whole) - 9  # whole frames end where the last scalar's frame began
    res = CliRunner().invoke(continuity_command, [str(tb), "--metric", "actor/loss"])
    assert res.exit_code == 1 and "metrics-bad-line" in res.output and "crash mid-write" in res.output
    event.write_bytes(b"\x07" * 40)  # not an event file at all
    res = CliRunner().invoke(continuity_command, [str(event)])
    assert res.exit_code == 3 and len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    empty = tmp_path / "no-events"
    empty.mkdir()
    res = CliRunner().invoke(continuity_command, [str(empty)])
    assert res.exit_code == 3 and "no TensorBoard event files" in res.output


def test_tensorboard_missing_is_one_line_naming_the_extra(trainer_logs, tmp_path):
    clean, _ = trainer_logs
    _as_tensorboard(clean, tmp_path, attempts=(slice(0, 6),))
    # a Python without the optional package: the import is blocked, the real file is still read by our code path
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from ckpt_audit.cli import main; sys.argv = ['ckpt-audit', 'continuity', sys.argv[1]]; main()"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "pip install 'ckpt-audit[tensorboard]'" in proc.stderr and "Traceback" not in proc.stderr


def test_tensorboard_tf2_tensor_scalars_are_read(tmp_path):
    """TF2's tf.summary.scalar stores a scalar tensor, not simple_value: float_val or raw tensor_content."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 4):
        value = (
            TensorProto(dtype=1, float_val=[0.5 * step])
            if step < 3
            else TensorProto(dtype=2, tensor_content=struct.pack("<d", 0.25))
        )
        writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag="eval/loss", tensor=value)]), step)
        histogram = TensorProto(dtype=2, tensor_shape={"dim": [{"size": 2}]}, double_val=[1.0, 2.0])
        writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag="eval/hist", tensor=histogram)]), step)
    writer.close()
    assert "eval/hist" not in read_metrics([tmp_path]).metric_names  # not a scalar: no metric
    series = read_metrics([tmp_path]).series("eval/loss")
    assert series.steps == (1, 2, 3) and series.values == (0.5, 1.0, 0.25)
