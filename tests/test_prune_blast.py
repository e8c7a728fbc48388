"""Prune's blast radius past one run, through the real CLI (a subprocess) on trainer-written trees.

A run warm-started from another run's step through a link (`B/global_step_4 -> ../exp/global_step_4`, which verl
follows) loads that step: it is kept while the link exists, the plan says so, and a link made after the plan is
found by the execution's own walk.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_prune_attacks import HOUR_NS, planned, prune, steps_left

pytestmark = pytest.mark.slow


@pytest.fixture
def run(verl_run, copy_run) -> Path:
    """A private copy of the trainer's run (steps 2, 4, 6; tracker 6) under <root>/demo/exp, three hours old."""
    run = Path(copy_run(verl_run))
    then = time.time_ns() - 3 * HOUR_NS
    for p in [*run.rglob("*"), run]:
        os.utime(p, ns=(then, then), follow_symlinks=False)
    return run


def warm_start(run: Path, link_to: str) -> Path:
    """Run B beside `run`, warm-started from its step 4 through a link (`B/global_step_4 -> ../exp/<link_to>`)."""
    b = run.parent / "B"
    b.mkdir()
    (b / "latest_checkpointed_iteration.txt").write_text("4")
    link = b / "global_step_4"
    link.symlink_to(f"../{run.name}/{link_to}")
    return link


def test_a_step_another_run_links_to_is_kept_while_the_link_exists(run, tmp_path):
    link = warm_start(run, "global_step_4")
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert planned(doc) == {
        2: ("delete", "complete", ["not-kept"]),
        4: ("keep", "complete", ["linked"]),
        6: ("keep", "complete", ["newest-complete", "tracker-target", "keep-last"]),
    }
    kept = next(i for i in doc["plan"]["keep"] if i["step"] == 4)
    assert kept["linked_from"] == [str(link)] and kept["protected"]
    assert steps_left(run) == [4, 6] and (link / "actor").is_dir()  # B still resumes

    link.unlink()  # once B lets go, step 4 is an ordinary old checkpoint again
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    assert steps_left(run) == [6]


def test_a_link_to_one_shard_keeps_the_step_it_lies_in(run, tmp_path):
    b = run.parent / "B" / "global_step_4" / "actor"
    b.mkdir(parents=True)
    name = "model_world_size_2_rank_0.pt"
    (b / name).symlink_to(run / "global_step_4" / "actor" / name)
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    item = _item(json.loads(proc.stdout), run / "global_step_4")
    assert (item["reasons"], item["linked_from"]) == (["linked"], [str(b / name)])  # the plan says why
    assert steps_left(run) == [4, 6] and (b / name).is_file()


def _item(doc: dict, path: Path) -> dict:
    return next(i for side in ("delete", "keep") for i in doc["plan"][side] if i["path"] == str(path))


def test_the_text_plan_names_the_link(run, tmp_path):
    link = warm_start(run, "global_step_4")
    proc = prune(run, "--keep-last", "1", "--dry-run", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "step        4" in ln)
    assert line.lstrip().startswith("keep") and f"linked <- {link}" in line


def test_a_link_made_after_the_plan_is_found_before_the_rename(run, tmp_path):
    from ckpt_audit.lifecycle.links import find_links
    from ckpt_audit.lifecycle.prune import Action, execute
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scanner import scan

    root = str(run.parent.parent)
    plan = plan_prune(
        scan([root]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns(), links=find_links([root])
    )
    assert [i.step for i in plan.delete] == [2, 4]
    link = warm_start(run, "global_step_4")  # B warm-starts while the plan waits for its confirmation
    result = execute(plan)
    got = {o.step: (o.action, o.detail) for o in result.outcomes}
    assert got[4] == (Action.SKIPPED, f"a link leads into it: {link}")
    assert got[2][0] is Action.DELETED and steps_left(run) == [4, 6]
