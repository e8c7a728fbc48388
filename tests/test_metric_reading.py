"""One metric reader: `prune --keep-best --metric M` ranks checkpoints by the values `continuity --metric M` reads.

Both go through the real CLI on a real run tree (torch-written shards, steps 2 4 6 8) whose metrics.jsonl is written
the ways verl writes it. The log tells of a resume: the first attempt logged steps 1-7, its last line cut by the
crash; the second resumed from step 4 and logged 5-8 again. Step 6's first value (0.9) is the run's best, but the
checkpoint on disk is the second attempt's (0.35): the last record of a step wins, so the best by max is step 4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from scan_trees import write_torch_tree

from ckpt_audit.cli import cli
from ckpt_audit.continuity.metrics import read_metrics
from ckpt_audit.lifecycle.retention import read_metric
from ckpt_audit.models import Run
from ckpt_audit.scan import scan

METRIC = "critic/score/mean"  # verl's name: slashes are part of it, not a path to walk
FIRST = [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5), (6, 0.9), (7, 0.7)]
SECOND = [(5, 0.25), (6, 0.35), (7, 0.3), (8, 0.3)]
ON_DISK = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.25, 6: 0.35, 7: 0.3, 8: 0.3}  # the last record of each step


def verl_file_logger(step: int, value: float) -> str:  # verl's file logger: {"step": N, "data": {...}}
    return json.dumps({"step": step, "data": {METRIC: value, "actor/pg_loss": -value}})


def nested(step: int, value: float) -> str:  # a logger that keeps the name's parts as nested dicts
    return json.dumps({"step": step, "critic": {"score": {"mean": value}}})


def flat(step: int, value: float) -> str:  # flat keys at the top: the only shape the old prune reader knew
    return json.dumps({"step": step, METRIC: value})


def console(step: int, value: float) -> str:  # verl's console logger, captured from stdout
    return f"(TaskRunner pid=1) step:{step} - {METRIC}:{value} - actor/pg_loss:{-value}"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return write_torch_tree(tmp_path_factory.mktemp("metric-reading"), steps=(2, 4, 6, 8)).parent.parent


@pytest.fixture(params=[verl_file_logger, nested, flat, console], ids=lambda f: f.__name__)
def tree(request, template, tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    shutil.copytree(template, root)
    log = root / "demo" / "exp" / "metrics.jsonl"
    fmt = request.param
    lines = [fmt(s, v) for s, v in FIRST] + [fmt(8, 0.8)[:20]] + [fmt(s, v) for s, v in SECOND]
    log.write_text("\n".join(lines) + "\n")
    return root, log


def test_prune_and_continuity_read_the_same_values(tree, tmp_path):
    root, log = tree
    runner = CliRunner()

    cont = runner.invoke(cli, ["continuity", str(log), "--metric", METRIC, "--json"])
    assert cont.exit_code in (0, 1), cont.output
    doc = json.loads(cont.stdout)
    assert doc["metric"] == METRIC
    assert (doc["points"], doc["first_step"], doc["last_step"]) == (len(FIRST) + len(SECOND), 1, 8)
    assert [p["resume_step"] for p in doc["resume_points"]] == [4]  # steps 5-7 logged again: resumed from 4
    if log.read_text().startswith("{"):  # a cut JSON line is skipped by both (a cut console line is chatter)
        assert "metrics-bad-line" in [f["code"] for f in doc["findings"]]

    def kept_best(mode: str) -> dict[int, list[str]]:
        res = runner.invoke(
            cli,
            ["prune", str(root), "--keep-best", "1", "--metric", METRIC, "--mode", mode, "--dry-run", "--json"]
            + ["--catalog", str(tmp_path / "c.db")],
        )
        assert res.exit_code == 0, res.output
        plan = json.loads(res.stdout)["plan"]
        return {d["step"]: d["reasons"] for d in plan["keep"]}

    # best by max among the checkpoints (2 4 6 8) is step 4 (0.4), not step 6 by its first attempt's 0.9
    assert kept_best("max") == {4: ["keep-best"], 8: ["newest-complete", "tracker-target"]}
    assert kept_best("min") == {2: ["keep-best"], 8: ["newest-complete", "tracker-target"]}

    # the values behind both: continuity's series, one per step, is what retention ranks
    [run] = scan([str(root)]).runs
    assert read_metric([run], METRIC) == {run.path: ON_DISK}
    assert read_metrics([log]).series(METRIC).by_step() == ON_DISK


def test_a_metric_no_record_has_is_refused_naming_what_the_log_holds(tree, tmp_path):
    root, _log = tree
    res = CliRunner().invoke(
        cli,
        [
            "prune",
            str(root),
            "--keep-best",
            "1",
            "--metric",
            "critic/score",
            "--dry-run",
            "--catalog",
            str(tmp_path / "c.db"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "'critic/score'" in res.stderr and METRIC in res.stderr.split("logs:")[-1]


def test_non_finite_values_rank_nothing_in_both(template, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(template, root)
    log = root / "demo" / "exp" / "metrics.jsonl"
    log.write_text("".join(f'{{"step": {s}, "data": {{"{METRIC}": NaN}}}}\n' for s in (2, 4, 6, 8)))
    assert read_metrics([log]).metric_names == (METRIC,)
    res = CliRunner().invoke(
        cli,
        ["prune", str(root), "--keep-best", "1", "--metric", METRIC, "--dry-run", "--catalog", str(tmp_path / "c.db")],
    )
    assert res.exit_code == 2, res.output
    assert "no complete checkpoint" in res.stderr


def test_records_the_old_prune_reader_misread_are_read_as_continuity_reads_them(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text(
        '{"step": 2.5, "loss": 1}\n'  # not an integer step: a bad line (the old reader ranked it as step 2)
        '{"step": 3, "loss": true}\n'  # a flag, not a value (the old reader ranked it as 1.0)
        '{"global_step": 4, "loss": 2}\n'  # another logger's step key (the old reader skipped it)
        '{"step": "5", "loss": "0.5"}\n'
    )
    runs = [Run(path=str(tmp_path), layout="verl-fsdp", metrics_path=str(log))]
    assert read_metric(runs, "loss") == {str(tmp_path): {4: 2.0, 5: 0.5}}
    assert [why for _p, _line, why in read_metrics([log]).bad_lines] == ["step 2.5 is not an integer"]


def test_a_hostile_metrics_line_is_one_bad_line_for_continuity_and_prune(template, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(template, root)
    log = root / "demo" / "exp" / "metrics.jsonl"
    deep = '{"step": 3, "data": ' + "[" * 100_000 + "]" * 100_000 + "}"  # RecursionError in json.loads
    long = '{"step": 5, "pad": "' + "x" * 3_000_000 + '"}'  # past the line bound: never held whole
    lines = [verl_file_logger(s, v) for s, v in FIRST[:2]] + [deep, long] + [verl_file_logger(s, v) for s, v in SECOND]
    log.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    cont = runner.invoke(cli, ["continuity", str(log), "--metric", METRIC, "--json"])
    assert cont.exit_code in (0, 1), cont.output
    bad = [f for f in json.loads(cont.stdout)["findings"] if f["code"] == "metrics-bad-line"]
    assert len(bad) == 2
    res = runner.invoke(
        cli,
        ["prune", str(root), "--keep-best", "1", "--metric", METRIC, "--mode", "max", "--dry-run", "--json"]
        + ["--catalog", str(tmp_path / "c.db")],
    )
    assert res.exit_code == 0, res.output
    assert {d["step"] for d in json.loads(res.stdout)["plan"]["keep"]} == {6, 8}  # 0.35, the best by max
