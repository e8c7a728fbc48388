"""verl's Megatron layout v2 on trees verl 0.9.1's own MegatronCheckpointManager wrote, judged against verl's own load.

tests/_verl_megatron_v2.py (one cached subprocess run: two gloo CPU processes, TP=2) saves steps 2 and 4 through
`MegatronCheckpointManager.save_checkpoint` (its ckpt_contents.json included), an old-layout step 8 with
megatron-core's dist_checkpointing, derives one run per case (the migrated one with verl's own migration script) and
loads each tracker's step back through verl's `load_checkpoint`. Stubbed there, each for a stated reason: the two CUDA
calls in megatron-core's save, megatron-core's optimizer wrapper (built on CUDA; a torch Adam whose sharded state
dict megatron-core's helpers make stands in), and the RNG restore (a CPU process has no CUDA RNG tracker states).
The table is docs/megatron.md's layout-v2 table.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from conftest import build_cached, writer_key

from ckpt_audit import scan
from ckpt_audit.lifecycle.latest import gate
from ckpt_audit.verify import verify

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        find_spec("megatron") is None or find_spec("verl") is None, reason="needs the 'megatron' and 'verl' extras"
    ),
]

HERE = Path(__file__).parent
WRITER = HERE / "_verl_megatron_v2.py"

# case -> (verl 0.9.1's load of the tracker's step, {step: (status, codes)}, the step `latest` names)
TABLE = {
    "clean": ("loads step 4", {2: ("complete", ()), 4: ("complete", ())}, 4),
    "manifest-missing": ("loads step 4", {4: ("incomplete", ("megatron-v2-manifest-missing",))}, 2),
    "content-missing": (
        "fails: CheckpointingException",
        {4: ("incomplete", ("megatron-v2-content-missing",))},
        2,
    ),
    "distcp-missing": ("fails: CheckpointException: FileNotFoundError", {4: ("incomplete", ("dcp-file-missing",))}, 2),
    "distcp-truncated": (
        "fails: CheckpointException",
        {4: ("corrupt", ("dcp-range-outside-file", "distcp-item-invalid"))},
        2,
    ),
    "distcp-bitflip": ("loads-changed", {4: ("corrupt", ("distcp-crc-mismatch",))}, 2),
    "step-mismatch": ("loads step 4", {4: ("complete", ()), 6: ("incomplete", ("megatron-v2-step-mismatch",))}, 4),
    "old-layout": (
        "fails: RuntimeError: Detected deprecated Megatron checkpoint layout",
        {8: ("complete", ("megatron-old-layout",))},
        4,
    ),
    "migrated": ("loads step 8", {8: ("complete", ("megatron-migrated",))}, 8),
    # the links verl's script made hold the absolute path the run had: renamed, they lead nowhere (verl's path
    # helper's makedirs then meets the dangling link)
    "symlink-moved": (
        "fails: FileExistsError",
        {8: ("incomplete", ("megatron-migrated", "megatron-link-dangling"))},
        4,
    ),
}
# the symlink-mode migration as verl loaded it where it was made (the cache's rename moved it since, so
# test_symlink_migration_in_place makes it again, with verl's script, where it is scanned)
IN_PLACE = {"migrated-symlink": "loads step 8"}


MIGRATE = "migrate_megatron_checkpoint_layout.py"


def _migrate(*args: str) -> None:
    """verl's own migration script, from where the verl extra installs it."""
    script = Path(find_spec("verl").submodule_search_locations[0]).parent / "scripts" / MIGRATE
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "migrated" in out.stdout, out.stdout + out.stderr


def _write(dst: Path) -> None:
    subprocess.run([sys.executable, str(WRITER), str(dst)], check=True, capture_output=True, timeout=900)


@pytest.fixture(scope="session")
def v2(tmp_path_factory) -> Path:
    """The root of the verl trees (cases/<case>/exp) and verdicts.json, cached across sessions."""
    key = writer_key(WRITER, ("torch", "megatron-core", "verl", "numpy"))
    return build_cached(tmp_path_factory, "verl_megatron_v2", _write, key=key)


def _run(v2: Path, case: str) -> Path:
    return v2 / "cases" / case / "exp"


@pytest.mark.parametrize(("case", "load", "steps", "latest"), [(c, *v) for c, v in TABLE.items()])
def test_verl_load_and_ckpt_audit_agree(v2, case, load, steps, latest):
    verdict = json.loads((v2 / "verdicts.json").read_text())[case]
    assert verdict.startswith(load), verdict
    run = scan.scan([_run(v2, case)], in_progress_window_s=0).runs[0]
    by_step = {c.step: c for c in run.checkpoints}
    for step, (status, codes) in steps.items():
        ckpt = by_step[step]
        found = {f.code for f in ckpt.all_findings}
        assert (ckpt.status.value, found) == (status, set(codes)), (step, sorted(found))
    chosen = gate(run).chosen
    assert chosen is not None and chosen.step == latest
    # the resume gate never names a step verl refuses, nor one whose content verl does not resume as that step
    if verdict != f"loads step {run.tracker_step}":
        assert chosen.step != run.tracker_step


def test_verify_clean_and_migrated_find_nothing_more(v2):
    """verify reads every dist_ckpt/ of a v2 role (item CRCs, chunk tiling, common.pt): nothing on verl's trees."""
    for case in ("clean", "migrated"):
        found = {f.code for f in verify([_run(v2, case)], in_progress_window_s=0).all_findings}
        assert found <= {"megatron-migrated"}, (case, sorted(found))


def test_migrated_hardlinks_counted_once(v2):
    """verl's migration script hardlinks dist_ckpt/ into model/, optimizer/ and extra/: the step's size is the old
    tree's, not four times it."""
    old = scan.scan([_run(v2, "old-layout")], in_progress_window_s=0).runs[0].checkpoints[-1]
    new = scan.scan([_run(v2, "migrated")], in_progress_window_s=0).runs[0].checkpoints[-1]
    assert new.step == old.step == 8
    assert os.stat(next(f.path for f in new.all_files if f.path.endswith("common.pt"))).st_nlink == 4
    assert sum(f.size_bytes for f in new.all_files) == 4 * old.size_bytes
    assert new.size_bytes == old.size_bytes


@pytest.fixture
def clean_copy(v2, tmp_path) -> Path:
    dst = tmp_path / "exp"
    shutil.copytree(_run(v2, "clean"), dst)
    return dst


def _manifest(run: Path, step: int = 4) -> Path:
    return run / f"global_step_{step}" / "actor" / "ckpt_contents.json"


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        ("path-escapes", "megatron-v2-manifest-invalid"),
        ("path-is-the-role", "megatron-v2-manifest-invalid"),
        ("schema-1", "megatron-v2-manifest-invalid"),
        ("not-json", "megatron-v2-manifest-invalid"),
        ("role", "megatron-v2-role-mismatch"),
        ("hf-listed", "megatron-v2-content-missing"),
        ("hf-config-only", "megatron-v2-content-missing"),
    ],
)
def test_manifest_problems(clean_copy, edit, code):
    path = _manifest(clean_copy)
    doc = json.loads(path.read_text())
    if edit == "path-escapes":
        doc["contents"]["model"]["path"] = "../../global_step_2/actor/model/dist_ckpt"
    elif edit == "path-is-the-role":
        doc["contents"]["optimizer"]["path"] = "optimizer/.."
    elif edit == "schema-1":
        doc["schema_version"] = 1
    elif edit == "role":
        doc["role"] = "critic"
    elif edit == "hf-listed":  # listed, but verl made model/huggingface/ empty (no bridge)
        doc["contents"]["hf_model"] = {"path": "model/huggingface", "format": "huggingface"}
    elif edit == "hf-config-only":  # a config and a tokenizer, no weights
        doc["contents"]["hf_model"] = {"path": "model/huggingface", "format": "huggingface"}
        (path.parent / "model" / "huggingface" / "config.json").write_text("{}")
    path.write_text("{" if edit == "not-json" else json.dumps(doc))
    run = scan.scan([clean_copy], in_progress_window_s=0).runs[0]
    step4 = run.checkpoints[-1]
    assert code in {f.code for f in step4.all_findings} and step4.status.value == "incomplete"
    assert gate(run).chosen.step == 2


def test_only_links_where_verl_loads_count(clean_copy):
    """A dangling link beside the contents (model/notes) is nothing verl's load reads: no finding of ours, step 4
    stays whole; the same link as a content (model/dist_ckpt) makes it incomplete."""
    model = clean_copy / "global_step_4" / "actor" / "model"
    (model / "notes").symlink_to("/nonexistent/notes")
    step4 = scan.scan([clean_copy], in_progress_window_s=0).runs[0].checkpoints[-1]
    assert step4.status.value == "complete" and not {f.code for f in step4.all_findings}
    shutil.rmtree(model / "dist_ckpt")
    (model / "dist_ckpt").symlink_to("/nonexistent/dist_ckpt")
    step4 = scan.scan([clean_copy], in_progress_window_s=0).runs[0].checkpoints[-1]
    assert step4.status.value == "incomplete"
    assert {f.code for f in step4.all_findings} == {"megatron-link-dangling"}


def test_young_step_without_manifest_is_in_progress(clean_copy):
    """A save still writing (no manifest yet, newer than the tracker) is in progress, not incomplete."""
    _manifest(clean_copy).unlink()
    (clean_copy / "latest_checkpointed_iteration.txt").write_text("2")
    now = time.time()
    os.utime(clean_copy / "global_step_4" / "actor" / "model" / "dist_ckpt" / "metadata.json", (now, now))
    run = scan.scan([clean_copy], in_progress_window_s=600).runs[0]
    assert [c.status.value for c in run.checkpoints] == ["complete", "in-progress"]


def test_cli_latest_passes_over_the_old_layout(v2, tmp_path):
    """The real CLI: the tracker names the old-layout step 8; `latest` answers step 4 and says why not 8."""
    out = ckpt_audit("latest", "--json", _run(v2, "old-layout"), catalog=tmp_path / "c.db")
    assert "Traceback" not in out.stderr, out.stderr[-800:]
    doc = json.loads(out.stdout)
    assert doc["step"] == 4 and doc["checkpoint"].endswith("global_step_4"), doc
    [passed] = [p for p in doc["passed_over"] if p["step"] == 8]
    assert "megatron-old-layout" in passed["reasons"]


def test_cli_latest_print_tag_names_a_megatron_run_as_megatron(v2, tmp_path):
    """--print tag is DeepSpeed's: refused for a verl Megatron run, which it called a verl-fsdp run (its run
    structure's name); it is named by what its checkpoints hold."""
    for case, kinds in (("old-layout", "verl-megatron + verl-megatron-v2"), ("clean", "verl-megatron-v2")):
        out = ckpt_audit("latest", "--print", "tag", _run(v2, case), catalog=tmp_path / "c.db")
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines()[-1] == (
            f"Error: --print tag: {_run(v2, case)} is a {kinds} run, not a DeepSpeed one"
        )


def test_prune_keeps_the_newest_step_verl_loads_beside_an_old_layout_one(v2, tmp_path):
    """keep-last 1 over v2 steps 2, 4 and the old-layout step 8 (the tracker's): 8 stays, and so does 4, the newest
    step verl 0.9.1 resumes as it is (8 needs the migration first)."""
    prune = ("prune", "--keep-last", "1", "--dry-run", "--json", _run(v2, "old-layout"))
    out = ckpt_audit(*prune, catalog=tmp_path / "c.db")
    assert out.returncode == 0, out.stdout + out.stderr
    plan = json.loads(out.stdout)["plan"]
    assert {i["step"]: i["reasons"] for i in plan["keep"]}[4] == ["newest-resumable"]
    assert [i["step"] for i in plan["delete"]] == [2]


def _findings(v2: Path, case: str):
    return scan.scan([_run(v2, case)], in_progress_window_s=0).all_findings


def test_copied_step_and_missing_manifest_are_named(v2):
    """Step 6 copied from step 4 keeps step 4's manifest: named, with the state verl would resume under it."""
    [f] = [f for f in _findings(v2, "step-mismatch") if f.code == "megatron-v2-step-mismatch"]
    assert f.path.endswith("global_step_6/actor/ckpt_contents.json") and "resume step 4's state as step 6" in f.message
    [g] = [f for f in _findings(v2, "manifest-missing") if f.code == "megatron-v2-manifest-missing"]
    assert g.path.endswith("global_step_4/actor/ckpt_contents.json")


def test_fix_tracker_will_not_move_back_from_an_old_layout_step(v2, tmp_path):
    """The tracker names the whole old-layout step 8: fix-tracker refuses to point it back at step 4 (the way out is
    verl's migration, which keeps the progress) and leaves the tracker as it was."""
    run = tmp_path / "exp"
    shutil.copytree(_run(v2, "old-layout"), run)
    out = ckpt_audit("fix-tracker", "--yes", run, catalog=tmp_path / "c.db")
    assert (
        out.returncode == 1 and "names-old-layout" in out.stderr and "migrate_megatron_checkpoint_layout" in out.stderr
    )
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "8"


def test_tracker_target_needs_a_manifest_in_every_role(clean_copy):
    """Async saves finalize per role: a critic without its manifest leaves step 4 uncommitted as a whole."""
    actor = clean_copy / "global_step_4" / "actor"
    critic = actor.parent / "critic"
    shutil.copytree(actor, critic)
    doc = json.loads((critic / "ckpt_contents.json").read_text())
    (critic / "ckpt_contents.json").write_text(json.dumps({**doc, "role": "critic"}))
    run = scan.scan([clean_copy], in_progress_window_s=0).runs[0]
    assert run.checkpoints[-1].status.value == "complete"
    (critic / "ckpt_contents.json").unlink()
    run = scan.scan([clean_copy], in_progress_window_s=0).runs[0]
    [f] = [f for f in run.checkpoints[-1].all_findings if f.code == "megatron-v2-manifest-missing"]
    assert f.path == str(critic / "ckpt_contents.json") and run.checkpoints[-1].status.value == "incomplete"
    assert gate(run).chosen.step == 2


def test_symlink_migration_in_place(v2, tmp_path):
    """verl's script in symlink mode makes absolute directory links: verl loads step 8 through them (the writer's
    verdict); the scan follows them to the dist_ckpt/ they lead to, finds it whole, and warns that they break when
    the run moves."""
    assert json.loads((v2 / "verdicts.json").read_text())["migrated-symlink"] == IN_PLACE["migrated-symlink"]
    run = tmp_path / "exp"
    subprocess.run(["cp", "-a", str(_run(v2, "old-layout")), str(run)], check=True)
    _migrate("--checkpoint", str(run / "global_step_8" / "actor"), "--mode", "symlink")
    (run / "latest_checkpointed_iteration.txt").write_text("8")
    scanned = scan.scan([run], in_progress_window_s=0).runs[0]
    step8 = scanned.checkpoints[-1]
    codes = sorted(f.code for f in step8.all_findings)
    assert step8.status.value == "complete" and codes == ["megatron-link-absolute"] * 3 + ["megatron-migrated"]
    assert gate(scanned).chosen.step == 8
    # moved: the links now lead to a directory that is gone, as verl's load finds (case symlink-moved)
    moved = tmp_path / "moved"
    run.rename(moved)
    scanned = scan.scan([moved], in_progress_window_s=0).runs[0]
    step8 = scanned.checkpoints[-1]
    assert step8.status.value == "incomplete" and gate(scanned).chosen.step == 4
    assert {f.path for f in step8.all_findings if f.code == "megatron-link-dangling"} == {
        str(moved / "global_step_8" / "actor" / sub / "dist_ckpt") for sub in ("model", "optimizer", "extra")
    }


def test_optimizer_format_flags_recorded_and_shown(v2, tmp_path):
    """Step 2 was saved with verl's dist_ckpt_optim_fully_reshardable off, step 4 with it on: each common.pt's
    content_metadata says so; the catalog keeps it and `show` (text and JSON) names it with what a resume may
    change. A catalog row read before the flags were kept is read again."""
    run = tmp_path / "exp"
    shutil.copytree(_run(v2, "clean"), run)
    db = tmp_path / "c.db"

    def cli(*args: object) -> subprocess.CompletedProcess:
        out = ckpt_audit(*args, catalog=db)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
        return out

    def formats(step: int) -> set:
        doc = json.loads(cli("show", "--json", str(run / f"global_step_{step}")).stdout)["checkpoint"]
        return {
            (o["distrib_optim_sharding_type"], o["dist_ckpt_optim_fully_reshardable"]) for o in doc["optimizer_format"]
        }

    cli("scan", str(run))
    assert formats(2) == {("dp_reshardable", False)} and formats(4) == {("fully_reshardable", True)}
    text = cli("show", str(run / "global_step_2")).stdout
    assert "optimizer format (actor): dp_reshardable: only the data-parallel size may change" in text
    # rows written before the flags were kept: the next scan reads those common.pt again
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE files SET pt_facts = json_set(pt_facts, '$.meta', json('[]')) WHERE kind = 'common'")
    assert formats(4) == set()
    cli("scan", str(run))
    assert formats(4) == {("fully_reshardable", True)}


def test_reclaimed_trash_of_a_migrated_step_counts_each_file_once(v2, tmp_path):
    """A prune killed after renaming a migrated step to its trash name: the next prune reclaims it and reports the
    step's own bytes, not its four hardlinked names' sum."""
    run = tmp_path / "exp"
    subprocess.run(["cp", "-a", str(_run(v2, "migrated")), str(run)], check=True)  # cp -a keeps the hardlinks
    step8 = scan.scan([run], in_progress_window_s=0).runs[0].checkpoints[-1]
    trash = run / ".ckpt-audit-trash-global_step_7-0123456789ab"
    subprocess.run(["cp", "-a", str(run / "global_step_8"), str(trash)], check=True)
    out = ckpt_audit("prune", "--keep-last", "1", "--yes", "--json", run, catalog=tmp_path / "c.db")
    assert out.returncode == 0, out.stdout + out.stderr
    [reclaimed] = [o for o in json.loads(out.stdout)["result"]["outcomes"] if o["action"] == "reclaimed"]
    assert reclaimed["size_bytes"] == step8.size_bytes and not trash.exists()


def test_fsdp_role_damaged_by_the_migration_script(verl_run, tmp_path):
    """verl's script over a whole run (--checkpoint-root --all-steps) takes an FSDP role's huggingface/ for the
    old Megatron layout and moves it to model/huggingface/. verl's FSDP load reads only the rank files, so the step
    still resumes (complete), but the HF config and tokenizer are no longer where verl's merger looks: a warning
    that says how to move it back."""
    run = tmp_path / "exp"
    shutil.copytree(verl_run, run)
    _migrate("--checkpoint-root", str(run), "--all-steps")
    scanned = scan.scan([run], in_progress_window_s=0).runs[0]
    for ckpt in scanned.checkpoints:
        [f] = [f for f in ckpt.all_findings if f.code == "fsdp-huggingface-moved"]
        assert ckpt.status.value == "complete" and f.path == f"{ckpt.path}/actor/model/huggingface"
        assert f"mv {ckpt.path}/actor/model/huggingface {ckpt.path}/actor/huggingface && rmdir" in f.message
    assert gate(scanned).chosen.step == scanned.tracker_step
    # verl's own merger of the damaged role fails: it reads the config from <local_dir>/huggingface
    actor = Path(scanned.checkpoints[-1].path) / "actor"
    merge = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor)]
    out = subprocess.run([*merge, "--target_dir", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and f"{actor}/huggingface" in out.stderr, out.stderr[-800:]
    # the finding's own way out puts it back
    (actor / "model" / "huggingface").rename(actor / "huggingface")
    (actor / "model").rmdir()
    again = scan.scan([run], in_progress_window_s=0).runs[0].checkpoints[-1]
    assert "fsdp-huggingface-moved" not in {f.code for f in again.all_findings}
