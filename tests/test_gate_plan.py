"""The resume gate and the tracker-fix plan are pure: tested by equality on models, no filesystem."""

from __future__ import annotations

import dataclasses

import pytest

from ckpt_audit.codes import finding
from ckpt_audit.lifecycle.latest import Passed, gate
from ckpt_audit.lifecycle.tracker_fix import FixError, TrackerFix, TrackerState, apply_fix, content_for, plan_fix
from ckpt_audit.models import Checkpoint, Component, FileKind, Run, ShardFile, Status

RUN = "/ckpts/p/e"
T = f"{RUN}/latest_checkpointed_iteration.txt"
NOW = 10**18
WINDOW = 300 * 10**9
HOUR = 3600 * 10**9


def ckpt(step: int, status: Status = Status.COMPLETE, *found, husk: bool = False) -> Checkpoint:
    path = f"{RUN}/global_step_{step}"
    files = (
        ()
        if husk
        else (
            ShardFile(
                path=f"{path}/actor/model_world_size_1_rank_0.pt",
                kind=FileKind.MODEL,
                size_bytes=1,
                mtime_ns=NOW - HOUR,
                inode=step,
            ),
        )
    )
    comp = Component(role="actor", path=f"{path}/actor", layout="verl-fsdp", world_size=1, files=files)
    return Checkpoint(
        run_path=RUN,
        step=step,
        path=path,
        status=status,
        components=(comp,),
        findings=tuple(found),
        mtime_ns=NOW - HOUR,
    )


def run(*ckpts: Checkpoint, tracker: int | None = None, findings=()) -> Run:
    return Run(path=RUN, layout="verl-fsdp", tracker_step=tracker, checkpoints=ckpts, findings=tuple(findings))


def state(content: bytes | None, *, age_ns: int = HOUR, **kw) -> TrackerState:
    return TrackerState(
        path=T, exists=content is not None or kw.get("is_link", False), content=content, mtime_ns=NOW - age_ns, **kw
    )


def test_gate_skips_corrupt_and_in_progress_and_says_why():
    crc = finding("crc-mismatch", f"{RUN}/global_step_6/actor/x.pt", "bit flip")
    r = run(
        ckpt(2),
        ckpt(4),
        ckpt(6, Status.CORRUPT, crc),
        ckpt(8, Status.IN_PROGRESS, finding("in-progress", f"{RUN}/global_step_8", "now")),
        tracker=6,
    )
    g = gate(r)
    assert g.chosen.step == 4 and g.reason == ""
    assert g.passed_over == (
        Passed(
            step=8,
            path=f"{RUN}/global_step_8",
            status="in-progress",
            reasons=("in-progress",),
            detail="in-progress: in-progress: now",
        ),
        Passed(
            step=6,
            path=f"{RUN}/global_step_6",
            status="corrupt",
            reasons=("crc-mismatch",),
            detail="corrupt: crc-mismatch: bit flip",
        ),
    )


def test_gate_takes_a_whole_checkpoint_beyond_a_lagging_tracker_but_not_a_half_saved_one():
    assert gate(run(ckpt(4), ckpt(6, Status.UNCOMMITTED), tracker=4)).chosen.step == 6
    no_data = finding("missing-dataloader-state", f"{RUN}/global_step_6", "no data.pt")
    g = gate(run(ckpt(4), ckpt(6, Status.UNCOMMITTED, no_data), tracker=4))
    assert g.chosen.step == 4 and g.passed_over[0].reasons == ("missing-dataloader-state",)
    assert gate(run(ckpt(4), ckpt(6, Status.UNCOMMITTED, husk=True), tracker=4)).chosen.step == 4


def test_gate_verified_asks_for_a_reread_of_what_is_not_recently_read():
    r = run(ckpt(4), ckpt(6), tracker=6)
    shard = r.checkpoints[1].all_files[0].path
    old = gate(r, verified={shard: NOW - 8 * 24 * HOUR}, now_ns=NOW, max_age_ns=7 * 24 * HOUR)
    assert old.chosen is None and old.reread == r.checkpoints[1]
    fresh = gate(r, verified={shard: NOW - HOUR}, now_ns=NOW, max_age_ns=7 * 24 * HOUR)
    assert fresh.chosen.step == 6 and fresh.verified_ns == NOW - HOUR
    never = gate(r, verified={}, now_ns=NOW, max_age_ns=7 * 24 * HOUR, reread=frozenset({r.checkpoints[1].path}))
    assert never.chosen.step == 6  # read by content just now
    # max age 0 (latest --verified's default): only a read made by this call, at or after now_ns, stands
    assert gate(r, verified={shard: NOW - 1}, now_ns=NOW).reread == r.checkpoints[1]
    assert gate(r, verified={shard: NOW}, now_ns=NOW).chosen.step == 6


def test_gate_with_nothing_resumable_gives_one_reason():
    assert gate(run()).reason == f"no checkpoint in {RUN}"
    miss = finding("missing-rank", f"{RUN}/global_step_2/actor", "rank 1 missing")
    g = gate(run(ckpt(2, Status.INCOMPLETE, miss)))
    assert g.chosen is None
    assert g.reason == f"no complete checkpoint in {RUN} (newest, step 2: incomplete: missing-rank: rank 1 missing)"


@pytest.mark.parametrize(
    "content,problem,new",
    [
        (None, "missing", 6),
        (b"", "garbage", 6),
        (b"six", "garbage", 6),
        (b"-6", "garbage", 6),
        (b"8", "dangling", 6),
        (b"4\n", "behind", 6),
    ],
)
def test_plan_points_at_the_newest_complete(content, problem, new):
    fix = plan_fix(run(ckpt(2), ckpt(4), ckpt(6)), state(content), now_ns=NOW, in_progress_window_ns=WINDOW)
    old = None if content is None else (int(content) if content.strip().lstrip(b"-").isdigit() else None)
    assert fix == TrackerFix(
        run_path=RUN,
        tracker_path=T,
        problem=problem,
        old_content=content,
        old_step=old,
        new_step=new,
        new_path=f"{RUN}/global_step_{new}",
        detail=fix.detail,
    )
    assert fix.needed and not fix.refused and content_for(new) == b"6"


def test_plan_moves_back_from_a_corrupt_or_unsafe_target():
    for st, code in ((Status.CORRUPT, "crc-mismatch"), (Status.UNSAFE, "unsafe-pickle")):
        bad = ckpt(6, st, finding(code, f"{RUN}/global_step_6/x.pt", "x"))
        fix = plan_fix(run(ckpt(4), bad, tracker=6), state(b"6"), now_ns=NOW, in_progress_window_ns=WINDOW)
        assert (fix.problem, fix.new_step, fix.refused) == (f"names-{st.value}", 4, "")


def test_plan_ok_when_the_tracker_names_the_newest_complete():
    fix = plan_fix(run(ckpt(4), ckpt(6), tracker=6), state(b"6"), now_ns=NOW, in_progress_window_ns=WINDOW)
    assert fix.problem == "ok" and not fix.needed


def test_plan_never_names_nor_targets_a_step_directory_verl_does_not_open():
    """verl opens exactly global_step_6 for a tracker saying 6: a global_step_06 is neither its target nor ours."""
    padded = dataclasses.replace(ckpt(6), path=f"{RUN}/global_step_06")
    fix = plan_fix(run(ckpt(4), padded, tracker=6), state(b"6"), now_ns=NOW, in_progress_window_ns=WINDOW)
    assert (fix.problem, fix.new_step, fix.new_path) == ("dangling", 4, f"{RUN}/global_step_4")
    assert "global_step_06 is, but verl never resolves that name" in fix.detail
    fix = plan_fix(run(ckpt(4), padded, tracker=4), state(b"4"), now_ns=NOW, in_progress_window_ns=WINDOW)
    assert fix.problem == "ok"  # the newest whole checkpoint verl can open


@pytest.mark.parametrize(
    "r,st,why",
    [
        (run(ckpt(4), ckpt(6, Status.IN_PROGRESS), tracker=2), state(b"2"), "being written"),
        (run(ckpt(4), tracker=2), state(b"2", age_ns=10**9), "written 1s ago"),
        (run(ckpt(4), tracker=2), state(None, is_link=True), "symbolic link"),
        (run(ckpt(4), tracker=2), TrackerState(path=T, exists=True, error="Permission denied"), "could not be read"),
        (run(ckpt(4), ckpt(6, Status.UNKNOWN), tracker=2), state(b"2"), "not moving the tracker past"),
        (run(ckpt(2, Status.CORRUPT, finding("zero-byte", "x", "x"))), state(None), "no complete checkpoint"),
        (
            run(ckpt(4), ckpt(6), tracker=6, findings=(finding("tracker-published-early", T, "x"),)),
            state(b"6"),
            "still changing",
        ),
    ],
)
def test_plan_refuses(r, st, why):
    fix = plan_fix(r, st, now_ns=NOW, in_progress_window_ns=WINDOW)
    assert why in fix.refused
    if "changing" in why:
        assert fix.problem == "published-early" and fix.new_step == 4


def test_apply_refuses_when_a_save_began_since_the_scan(tmp_path):
    run_dir = tmp_path / "exp"
    (run_dir / "global_step_4").mkdir(parents=True)
    (run_dir / "latest_checkpointed_iteration.txt").write_text("2")
    fix = TrackerFix(
        run_path=str(run_dir),
        tracker_path=str(run_dir / "latest_checkpointed_iteration.txt"),
        problem="dangling",
        old_content=b"2",
        old_step=2,
        new_step=4,
        new_path=str(run_dir / "global_step_4"),
    )
    (run_dir / "global_step_6").mkdir()  # verl's next save, made after the scan
    with pytest.raises(FixError, match="gained or lost a step directory"):
        apply_fix(fix, step_names=frozenset({"global_step_4"}))
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "2" and len(list(run_dir.iterdir())) == 3
    backup = apply_fix(fix, step_names=frozenset({"global_step_4", "global_step_6"}))
    assert open(backup).read() == "2"
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "4"


@pytest.mark.parametrize("name", ["global_step8 ", "global_step8\n", "global_step8\udcff"])
def test_deepspeed_plan_never_points_latest_at_a_tag_its_load_cannot_open(name):
    """load_checkpoint(tag=None) opens `<save_dir>/<latest stripped>`, read as UTF-8: a tag whose name has
    surrounding whitespace or an undecodable byte cannot be named by `latest`; the newest whole one it can open is."""
    ds = f"{RUN}/latest"

    def tag(step: int, name: str) -> Checkpoint:
        return dataclasses.replace(ckpt(step), path=f"{RUN}/{name}")

    r = dataclasses.replace(run(tag(6, "global_step6"), tag(8, name)), layout="deepspeed")
    fix = plan_fix(r, dataclasses.replace(state(b"global_step4"), path=ds), now_ns=NOW, in_progress_window_ns=WINDOW)
    assert (fix.problem, fix.new_path, fix.new_content) == ("dangling", f"{RUN}/global_step6", b"global_step6")
