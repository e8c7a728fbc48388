"""`ckpt-audit prune` through CliRunner and through a real subprocess: plans, refusals, exit codes, JSON, kills."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from click.testing import CliRunner
from scan_trees import write_torch_tree

from ckpt_audit.cli import cli
from ckpt_audit.killpoints import KILL_AFTER_ENV
from ckpt_audit.lifecycle.prune import TRASH_RE

STEPS = (2, 4, 6, 8)


@pytest.fixture(scope="module")
def tree_template(tmp_path_factory) -> Path:
    return write_torch_tree(tmp_path_factory.mktemp("prune-cli"), steps=STEPS).parent.parent


@pytest.fixture
def tree(tree_template, tmp_path) -> tuple[Path, Path]:
    """(root, run) of a private copy."""
    root = tmp_path / "root"
    shutil.copytree(tree_template, root)
    return root, root / "demo" / "exp"


def steps_left(run: Path) -> list[int]:
    return sorted(int(p.name[12:]) for p in run.iterdir() if p.name.startswith("global_step_"))


def test_dry_run_json_shows_the_plan_and_deletes_nothing(tree, tmp_path):
    root, run = tree
    res = CliRunner().invoke(
        cli, ["prune", str(root), "--keep-last", "2", "--dry-run", "--json", "--catalog", str(tmp_path / "c.db")]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == 1 and doc["executed"] is False and doc["result"] is None
    assert [d["step"] for d in doc["plan"]["delete"]] == [2, 4]
    assert {d["step"]: d["reasons"] for d in doc["plan"]["keep"]} == {
        6: ["keep-last"],
        8: ["newest-complete", "tracker-target", "keep-last"],
    }
    assert steps_left(run) == list(STEPS)


def test_without_yes_and_without_a_tty_it_refuses_with_exit_2(tree, tmp_path):
    root, run = tree
    res = CliRunner().invoke(cli, ["prune", str(root), "--keep-last", "1", "--catalog", str(tmp_path / "c.db")])
    assert res.exit_code == 2
    assert "refusing to prompt" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "DELETE" in res.stdout  # the plan is still shown
    assert steps_left(run) == list(STEPS)


def test_yes_deletes_logs_the_plan_and_marks_the_catalog(tree, tmp_path):
    root, run = tree
    catalog = tmp_path / "c.db"
    proc = ckpt_audit("prune", str(root), "--keep-last", "1", "--keep-every", "4", "--yes", "--json", catalog=catalog)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["executed"] is True
    assert sorted(o["step"] for o in doc["result"]["outcomes"] if o["action"] == "deleted") == [2, 6]
    assert steps_left(run) == [4, 8]

    db = sqlite3.connect(catalog)
    [(status, planned)] = db.execute("SELECT status, planned_delete FROM prunes").fetchall()
    assert (status, planned) == ("finished", 2)
    kept = dict(db.execute("SELECT step, reasons FROM prune_items WHERE action = 'kept'").fetchall())
    assert json.loads(kept[4]) == ["keep-every"]
    gone = {p for (p,) in db.execute("SELECT path FROM checkpoints WHERE present = 0")}
    assert gone == {str(run / "global_step_2"), str(run / "global_step_6")}

    again = ckpt_audit("prune", str(root), "--keep-last", "1", "--keep-every", "4", "--yes", catalog=catalog)
    assert again.returncode == 0 and "frees 0 B in 0 checkpoint(s)" in again.stdout


def test_pin_protects_and_unknown_pin_is_a_usage_error(tree, tmp_path):
    root, run = tree
    catalog = tmp_path / "c.db"
    proc = ckpt_audit(
        "prune", str(root), "--keep-last", "1", "--pin", str(run / "global_step_2"), "--yes", catalog=catalog
    )
    assert proc.returncode == 0, proc.stderr
    assert steps_left(run) == [2, 8]
    bad = ckpt_audit(
        "prune", str(root), "--keep-last", "1", "--pin", str(run / "global_step_3"), "--yes", catalog=catalog
    )
    assert bad.returncode == 2 and "matches no scanned checkpoint" in bad.stderr
    assert steps_left(run) == [2, 8]


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["/definitely/not/here", "--keep-last", "1"], 3, "does not exist"),
        (["{root}", "--keep-within", "soon"], 2, "not a duration"),
        (["{root}", "--keep-last", "-1"], 2, "--keep-last"),
    ],
)
def test_bad_input_is_one_line_and_a_documented_exit_code(tree, tmp_path, args, code, text):
    root, run = tree
    proc = ckpt_audit("prune", *(a.format(root=root) for a in args), catalog=tmp_path / "c.db")
    assert proc.returncode == code, proc.stderr
    assert text in proc.stderr and "Traceback" not in proc.stderr
    assert steps_left(run) == list(STEPS)


def test_a_second_prune_or_a_bad_catalog_touches_nothing(tree, tmp_path):
    from ckpt_audit import lock

    root, run = tree
    db = tmp_path / "c.db"
    with lock.hold(lock.lock_path_for(db)):  # a scan or prune already running on this catalog
        proc = ckpt_audit("prune", str(root), "--keep-last", "1", "--yes", catalog=db)
    assert proc.returncode == 4 and "another ckpt-audit run" in proc.stderr and proc.stderr.count("\n") == 1
    assert steps_left(run) == list(STEPS)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    proc = ckpt_audit("prune", str(root), "--keep-last", "1", "--yes", catalog=garbage)
    assert proc.returncode == 3 and proc.stderr.startswith("ckpt-audit: error:") and "Traceback" not in proc.stderr
    assert steps_left(run) == list(STEPS) and garbage.read_bytes() == b"this is not sqlite" * 100


@pytest.mark.parametrize("kill_after", [1, 4, 9])
def test_killed_cli_prune_leaves_marked_trash_and_the_next_run_finishes(tree, tmp_path, kill_after):
    root, run = tree
    catalog = tmp_path / "c.db"
    prune = ("prune", root, "--keep-last", "1", "--yes")
    proc = ckpt_audit(*prune, catalog=catalog, env={KILL_AFTER_ENV: str(kill_after)}, text=False, timeout=120)
    assert proc.returncode == -9
    assert 8 in steps_left(run)
    assert all(p.name.startswith("global_step_") or TRASH_RE.match(p.name) or p.is_file() for p in run.iterdir())
    [(status,)] = sqlite3.connect(catalog).execute("SELECT status FROM prunes").fetchall()
    assert status == "started"  # the log says a prune was cut short

    done = ckpt_audit("prune", str(root), "--keep-last", "1", "--yes", "--json", catalog=catalog)
    assert done.returncode == 0, done.stderr
    assert steps_left(run) == [8]
    assert not [p for p in run.iterdir() if TRASH_RE.match(p.name)]


def test_multi_node_leftover_is_reclaimed_even_without_rules(tree, tmp_path):
    """verl's rank-0-only retention deleted step 2 on rank 0's side; the other rank's shards stayed behind."""
    root, run = tree
    for f in (run / "global_step_2" / "actor").glob("*_rank_0.pt"):
        f.unlink()
    proc = ckpt_audit("prune", str(root), "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [(d["step"], d["status"], d["reasons"]) for d in doc["plan"]["delete"]] == [
        (2, "incomplete", ["incomplete"])
    ]
    assert steps_left(run) == [4, 6, 8]


def test_real_trainer_tree_keep_best_by_logged_loss_then_keep_last(copy_run, verl_run, tmp_path):
    run = Path(copy_run(verl_run))
    root = run.parent.parent
    steps = steps_left(run)
    assert len(steps) >= 2
    loss = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        loss[int(rec["step"])] = float(rec["loss"])
    best = min((s for s in steps if s in loss), key=lambda s: (loss[s], -s))

    proc = ckpt_audit(
        "prune", root, "--keep-best", "1", "--metric", "loss", "--dry-run", "--json", catalog=tmp_path / "c.db"
    )
    assert proc.returncode == 0, proc.stderr
    keep = {d["step"]: d["reasons"] for d in json.loads(proc.stdout)["plan"]["keep"]}
    assert "keep-best" in keep[best]

    proc = ckpt_audit("prune", str(root), "--keep-last", "1", "--yes", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert steps_left(run) == [max(steps)]
