"""Prune's blast radius and the filesystem's refusals, through the real CLI (a subprocess) on trainer-written trees.

1. A run warm-started from another run's step through a link (`B/global_step_4 -> ../exp/global_step_4`, which verl
   follows) loads that step: it is kept while the link exists, the plan says so, and a link made after the plan is
   found by the execution's own walk.
2. Every refusal the filesystem can give (immutable and append-only flags, mount points, read-only mounts) is found
   before the rename to trash, as root too; one found only after it renames the tree back; a half-done trash is
   finished when it can be, else left marked and reported without failing every later prune.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_proc import unprivileged
from test_prune_attacks import (
    EXECUTE,
    HOUR_NS,
    needs_setpriv,
    planned,
    prune,
    run,  # the trainer run three hours old, a private copy
    steps_left,
)

from ckpt_audit.lifecycle.prune import TRASH_RE

pytestmark = pytest.mark.slow


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


def test_a_sibling_run_outside_the_root_still_keeps_the_step_it_links_to(run, tmp_path):
    link = warm_start(run, "global_step_4")  # demo/B, beside demo/exp; prune is given demo/exp alone
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_audit", "prune", str(run), "--keep-last", "1", "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(tmp_path / "c.db")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _item(json.loads(proc.stdout), run / "global_step_4")["linked_from"] == [str(link)]
    assert steps_left(run) == [4, 6]


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


# ------------------------------------------------------------------------------------- 2. filesystem refusals


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


@contextlib.contextmanager
def _mounted(*args: str, below: Path):
    """`mount args...` for the body (skip where mounting is not allowed); then every mount below `below` is undone,
    wherever a prune moved it."""
    try:
        subprocess.run(["mount", *args], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot bind-mount here: {exc}")
    try:
        yield
    finally:
        from ckpt_audit.lifecycle.removable import mount_points

        for m in reversed(mount_points()):
            if m.startswith(f"{below}/"):
                subprocess.run(["umount", m], check=True)


def _chattr_works(tmp: Path) -> str | None:
    """Why chattr +i cannot be tried here (no chattr, a filesystem without inode flags, no CAP_LINUX_IMMUTABLE)."""
    probe = tmp / "chattr-probe"
    probe.write_text("x")
    try:
        _chattr("+i", probe)
        _chattr("-i", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"chattr +i refused here: {exc}"
    return None


@pytest.fixture
def flags_ok(tmp_path):
    if why := _chattr_works(tmp_path):
        pytest.skip(why)


def _tree(step: Path) -> dict[str, int]:
    return {str(p.relative_to(step)): p.lstat().st_size for p in sorted(step.rglob("*"))}


def _outcomes(doc: dict) -> dict:
    return {
        o["step"] if o["step"] is not None else o["path"]: (o["action"], o["detail"]) for o in doc["result"]["outcomes"]
    }


SHARD = "actor/model_world_size_2_rank_0.pt"


@pytest.mark.parametrize(
    ("flag", "where", "said"),
    [
        ("+i", SHARD, f"immutable (chattr +i): global_step_2/{SHARD}"),
        ("+a", SHARD, f"append-only (chattr +a): global_step_2/{SHARD}"),
        ("+a", "actor", "append-only (chattr +a): global_step_2/actor"),
        ("+i", ".", "immutable (chattr +i): global_step_2"),
    ],
    ids=["immutable-shard", "append-only-shard", "append-only-dir", "immutable-step"],
)
def test_an_inode_flag_is_found_before_the_rename_even_as_root(run, tmp_path, flags_ok, flag, where, said):
    step = run / "global_step_2"
    before = _tree(step)
    _chattr(flag, step / where)
    try:
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
        assert proc.returncode == 3, proc.stdout + proc.stderr  # a deletion failed
        got = _outcomes(json.loads(proc.stdout))
        assert got[2] == ("failed", f"left intact: {said}")
        assert got[4][0] == "deleted"
        assert _tree(step) == before and not [p for p in run.iterdir() if TRASH_RE.match(p.name)]
    finally:
        _chattr(flag.replace("+", "-"), step / where)
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert steps_left(run) == [6]


def test_a_mount_point_inside_is_found_before_the_rename(run, tmp_path):
    hf = run / "global_step_2" / "actor" / "huggingface"
    with _mounted("--bind", str(hf), str(hf), below=tmp_path):  # same device: stat alone cannot tell
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    got = _outcomes(json.loads(proc.stdout))
    assert got[2] == ("failed", "left intact: a mount point (rmdir says EBUSY): global_step_2/actor/huggingface")
    assert steps_left(run) == [2, 6] and (hf / "config.json").is_file()


def test_a_read_only_mount_is_named(run, tmp_path):
    with _mounted("--bind", "-o", "ro", str(run), str(run), below=tmp_path):
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    got = _outcomes(json.loads(proc.stdout))
    assert got[2] == ("failed", f"left intact: read-only filesystem at {run / 'global_step_2'}")
    assert steps_left(run) == [2, 4, 6]


def test_a_half_done_trash_is_left_marked_without_failing_later_prunes_then_finished(run, tmp_path, flags_ok):
    # what the old prune left: step 2 renamed to trash, then removed up to an immutable shard
    trash = run / ".ckpt-audit-trash-global_step_2-0123456789ab"
    (run / "global_step_2").rename(trash)
    (trash / "data.pt").unlink()
    _chattr("+i", trash / SHARD)
    try:
        proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
        assert proc.returncode == 0, proc.stdout + proc.stderr  # the leftover no longer fails every prune
        got = _outcomes(json.loads(proc.stdout))
        assert got[str(trash)] == (
            "skipped",
            "marked by execution 0123456789ab (global_step_2); cannot finish, left marked: "
            f"immutable (chattr +i): {trash.name}/{SHARD}",
        )
        assert got[4][0] == "deleted" and (trash / SHARD).is_file()  # nothing of the trash was touched
    finally:
        _chattr("-i", trash / SHARD)
    proc = prune(run, "--keep-last", "1", "--yes", "--json", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _outcomes(json.loads(proc.stdout))[str(trash)][0] == "reclaimed"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["global_step_6"]


@needs_setpriv
def test_a_refusal_found_only_after_the_rename_renames_the_tree_back(run, tmp_path, flags_ok):
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scanner import scan

    plan = plan_prune(scan([str(run)]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    step = run / "global_step_2"
    before = _tree(step)
    hf = sorted((step / "actor" / "huggingface").iterdir())  # removed first (the deepest directory)
    for f in hf:  # a file we may not open shows no flags: its refusal comes only at unlink, after the rename
        f.chmod(0)
    _chattr("+i", *hf)
    try:
        proc = subprocess.run(
            [*unprivileged(), sys.executable, "-c", EXECUTE, str(tmp_path / "plan.pkl")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        _chattr("-i", *(f for f in hf if f.exists()))
    assert proc.returncode == 0, proc.stderr
    outcomes = {s: (action, detail) for s, action, detail in json.loads(proc.stdout)}
    assert outcomes[2][0] == "failed" and outcomes[2][1].startswith("left intact (renamed back): PermissionError")
    assert _tree(step) == before and not [p for p in run.iterdir() if TRASH_RE.match(p.name)]
    assert outcomes[4][0] == "deleted"


def test_the_tui_plan_keeps_a_linked_step_and_its_prune_deletes_only_the_rest(run, tmp_path):
    from tui_pilot import drive, open_run, settle

    from ckpt_audit.lifecycle.retention import KeepLast, Policy, Reason
    from tui.app import AuditApp

    link = warm_start(run, "global_step_4")
    app = AuditApp(catalog_path=tmp_path / "c.db", roots=[str(run.parent.parent)])
    seen = {}

    async def script(pilot) -> None:
        await pilot.press("down")  # runs: demo/B (its tracker and the link), then demo/exp
        screen = await open_run(pilot)
        assert screen.run_path == str(run)
        screen.set_policy(Policy(rules=(KeepLast(n=1),)))
        seen["plan"] = screen.plan
        assert app.prune(screen.plan)
        await settle(pilot)

    drive(app, script)
    plan = seen["plan"]
    assert [i.step for i in plan.delete] == [2]
    [kept] = [i for i in plan.keep if i.step == 4]
    assert kept.reasons == (Reason.LINKED,) and kept.linked_from == (str(link),)
    assert steps_left(run) == [4, 6] and app.last_prune is not None and app.last_prune.ok


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop FOWNER")
def test_a_sticky_directory_holding_someone_elses_file_is_found_before_the_rename(run, tmp_path):
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.scanner import scan

    plan = plan_prune(scan([str(run)]).runs, Policy(rules=(KeepLast(n=1),)), now_ns=time.time_ns())
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    step = run / "global_step_2"
    before = _tree(step)
    actor = step / "actor"
    os.chown(actor, 65534, 65534)
    actor.chmod(0o1777)  # like /tmp: anyone may write, only an entry's owner (or the directory's) may unlink it
    os.chown(actor / "model_world_size_2_rank_0.pt", 65533, 65533)
    no_fowner = [shutil.which("setpriv"), "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    proc = subprocess.run(
        [*no_fowner, sys.executable, "-c", EXECUTE, str(tmp_path / "plan.pkl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    outcomes = {s: (action, detail) for s, action, detail in json.loads(proc.stdout)}
    assert outcomes[2] == (
        "failed",
        "left intact: sticky directory global_step_2/actor: "
        "global_step_2/actor/model_world_size_2_rank_0.pt belongs to uid 65533",
    )
    assert _tree(step) == before and outcomes[4][0] == "deleted"
