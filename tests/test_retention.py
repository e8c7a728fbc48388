"""plan_prune against literal expected plans built from literal models: no filesystem, no clock."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from ckpt_audit.codes import finding
from ckpt_audit.lifecycle.retention import (
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepWithin,
    PlanItem,
    Policy,
    PrunePlan,
    Refusal,
    plan_prune,
    read_metric,
)
from ckpt_audit.lifecycle.retention import (
    Reason as R,
)
from ckpt_audit.models import Checkpoint, FileKind, Run, ShardFile, Status
from ckpt_audit.units import format_duration, parse_duration

RUN = "/ck/proj/exp"
S = 1_000_000_000
NOW = 1_800_000_000 * S
C, N, X, H, U, P = (  # N for incomplete: an I reads as 1 or l
    Status.COMPLETE,
    Status.INCOMPLETE,
    Status.CORRUPT,
    Status.HUSK,
    Status.UNCOMMITTED,
    Status.IN_PROGRESS,
)


def ck(step: int, status: Status = C, *, run: str = RUN, age_s: int | None = None, size: int = 100) -> Checkpoint:
    """A checkpoint saved `age_s` seconds before NOW (default: one hour per step before step 1000)."""
    age = (1000 - step) * 3600 if age_s is None else age_s
    path = f"{run}/global_step_{step}"
    shard = ShardFile(
        path=f"{path}/actor/model_world_size_1_rank_0.pt",
        kind=FileKind.MODEL,
        size_bytes=size,
        mtime_ns=NOW - age * S,
        inode=step,
        rank=0,
        world_size=1,
    )
    return Checkpoint(run_path=run, step=step, path=path, status=status, files=(shard,), mtime_ns=NOW - age * S)


def run_of(*ckpts: Checkpoint, tracker: int | None = None, path: str = RUN) -> Run:
    return Run(path=path, layout="verl-fsdp", tracker_step=tracker, checkpoints=ckpts)


def keep(c: Checkpoint, *reasons: R) -> PlanItem:
    return PlanItem(checkpoint=c, reasons=reasons)


drop = keep  # same constructor; which list it sits in says what happens


def test_keep_last_counts_only_complete_and_deletes_broken_first():
    c10, c20, c30, c40, c50, c60 = ck(10), ck(20, N), ck(30), ck(40, X), ck(50, H), ck(60)
    policy = Policy(rules=(KeepLast(n=2),))
    plan = plan_prune([run_of(c10, c20, c30, c40, c50, c60, tracker=60)], policy, now_ns=NOW)
    assert plan == PrunePlan(
        policy=policy,
        now_ns=NOW,
        delete=(drop(c20, R.INCOMPLETE), drop(c40, R.CORRUPT), drop(c50, R.HUSK), drop(c10, R.NOT_KEPT)),
        keep=(keep(c30, R.KEEP_LAST), keep(c60, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.KEEP_LAST)),
    )
    assert plan.bytes_freed == 400 and plan.bytes_kept == 200


def test_a_model_only_newest_keeps_the_newest_resumable_too():
    """A finished torchtitan run ends with a model-only save: the step a resume continues from is protected."""
    last = ck(30)
    last = replace(last, findings=(finding("torchtitan-model-only", last.path, "model only"),))
    c10, c20 = ck(10), ck(20)
    policy = Policy(rules=(KeepLast(n=1),))
    plan = plan_prune([run_of(c10, c20, last)], policy, now_ns=NOW)
    assert plan == PrunePlan(
        policy=policy,
        now_ns=NOW,
        delete=(drop(c10, R.NOT_KEPT),),
        keep=(keep(c20, R.NEWEST_RESUMABLE), keep(last, R.NEWEST_COMPLETE, R.KEEP_LAST)),
    )


def test_rules_compose_as_a_union():
    cs = [ck(s) for s in (100, 200, 300, 400, 500, 600)]
    c100, c200, c300, c400, c500, c600 = cs
    metrics = {RUN: {100: 0.9, 200: 0.2, 300: 0.5, 400: 0.1, 500: 0.7, 600: float("nan")}}
    policy = Policy(
        rules=(
            KeepLast(n=1),
            KeepEvery(k=300),
            KeepWithin(duration_ns=parse_duration("450h")),  # steps saved within 450 h of NOW: 600 and 800+
            KeepBest(n=2, metric="loss", mode="min", values=metrics),
        )
    )
    plan = plan_prune([run_of(*cs, tracker=600)], policy, now_ns=NOW)
    assert plan == PrunePlan(
        policy=policy,
        now_ns=NOW,
        delete=(drop(c100, R.NOT_KEPT), drop(c500, R.NOT_KEPT)),
        keep=(
            keep(c200, R.KEEP_BEST),
            keep(c300, R.KEEP_EVERY),
            keep(c400, R.KEEP_BEST),
            keep(c600, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.KEEP_LAST, R.KEEP_EVERY, R.KEEP_WITHIN),
        ),
    )


def test_keep_best_max_mode_and_ties_prefer_newer():
    cs = [ck(s) for s in (1, 2, 3, 4)]
    values = {RUN: {1: 5.0, 2: 7.0, 3: 7.0, 4: 1.0}}
    policy = Policy(rules=(KeepBest(n=1, metric="reward", mode="max", values=values),))
    plan = plan_prune([run_of(*cs, tracker=4)], policy, now_ns=NOW)
    assert [i.step for i in plan.keep] == [3, 4]
    assert plan.keep[0].reasons == (R.KEEP_BEST,)


def test_uncommitted_is_deleted_only_when_stale():
    c1, u2_old, u3_new = ck(1), ck(2, U, age_s=2 * 3600), ck(3, U, age_s=60)
    policy = Policy(rules=(KeepLast(n=5),), stale_after_ns=3600 * S)
    plan = plan_prune([run_of(c1, u2_old, u3_new, tracker=1)], policy, now_ns=NOW)
    assert plan == PrunePlan(
        policy=policy,
        now_ns=NOW,
        delete=(drop(u2_old, R.UNCOMMITTED_STALE),),
        keep=(keep(c1, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.KEEP_LAST), keep(u3_new, R.UNCOMMITTED_RECENT)),
    )


def test_no_rules_keeps_every_complete_and_removes_only_broken():
    c1, i2, c3 = ck(1), ck(2, N), ck(3)
    plan = plan_prune([run_of(c1, i2, c3, tracker=3)], Policy(), now_ns=NOW)
    assert plan.delete == (drop(i2, R.INCOMPLETE),)
    assert plan.keep == (keep(c1, R.NO_RULES), keep(c3, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.NO_RULES))


def test_selection_overrides_rules_but_not_invariants():
    c1, c2, c3 = ck(1), ck(2), ck(3)
    policy = Policy(rules=(KeepLast(n=3),))
    plan = plan_prune(
        [run_of(c1, c2, c3, tracker=3)],
        policy,
        now_ns=NOW,
        select=frozenset({c2.path, c3.path, f"{RUN}/global_step_99"}),
    )
    assert plan == PrunePlan(
        policy=policy,
        now_ns=NOW,
        delete=(drop(c2, R.SELECTED),),
        keep=(keep(c1, R.KEEP_LAST), keep(c3, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.KEEP_LAST)),
        refused=(
            Refusal(path=c3.path, reasons=(R.NEWEST_COMPLETE, R.TRACKER_TARGET)),
            Refusal(path=f"{RUN}/global_step_99", reasons=(R.UNKNOWN_PATH,)),
        ),
    )


def test_runs_are_judged_independently():
    other = "/ck/proj/other"
    a1, a2 = ck(1), ck(2)
    b1, b2 = ck(1, run=other), ck(2, N, run=other)
    policy = Policy(rules=(KeepLast(n=1),))
    plan = plan_prune([run_of(b1, b2, tracker=1, path=other), run_of(a1, a2, tracker=2)], policy, now_ns=NOW)
    assert plan.delete == (drop(b2, R.INCOMPLETE), drop(a1, R.NOT_KEPT))
    assert plan.keep == (
        keep(a2, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.KEEP_LAST),
        keep(b1, R.NEWEST_COMPLETE, R.TRACKER_TARGET, R.KEEP_LAST),
    )


def test_run_with_nothing_complete_keeps_its_newest_partial():
    """One node's disk of a multi-node run holds only its own ranks: every step looks incomplete there."""
    i1, i2, i3 = ck(1, N), ck(2, N), ck(3, N)
    plan = plan_prune([run_of(i1, i2, i3)], Policy(rules=(KeepLast(n=1),)), now_ns=NOW)
    assert plan.delete == (drop(i1, R.INCOMPLETE), drop(i2, R.INCOMPLETE))
    assert plan.keep == (keep(i3, R.NEWEST_OF_PARTIAL_RUN, R.INCOMPLETE),)


# -------------------------------------------------------------------------- attempts to break each invariant

HOSTILE = Policy(rules=(KeepLast(n=0),))  # keeps nothing by itself


def everything(*runs: Run) -> frozenset[str]:
    return frozenset(c.path for r in runs for c in r.checkpoints)


def test_cannot_delete_newest_complete():
    c1, c2, i3 = ck(1), ck(2), ck(3, N)
    run = run_of(c1, c2, i3, tracker=None)
    plan = plan_prune([run], HOSTILE, now_ns=NOW, select=everything(run))
    assert [i.path for i in plan.keep] == [c2.path]
    assert plan.refused == (Refusal(path=c2.path, reasons=(R.NEWEST_COMPLETE,)),)


def test_cannot_delete_tracker_target_even_if_it_is_a_husk():
    """verl's crash window: register_checkpoint deleted actor/ of the tracker's step before the tracker moved."""
    h1, c2 = ck(1, H), ck(2, U, age_s=10 * 3600)
    run = run_of(h1, c2, tracker=1)
    plan = plan_prune([run], HOSTILE, now_ns=NOW, select=everything(run))
    assert plan.keep == (keep(h1, R.TRACKER_TARGET, R.HUSK),)
    assert plan.delete == (drop(c2, R.UNCOMMITTED_STALE, R.SELECTED),)


def test_cannot_delete_pinned():
    c1, c2, x3 = ck(1), ck(2), ck(3, X)
    run = run_of(c1, c2, x3, tracker=2)
    plan = plan_prune([run], HOSTILE, now_ns=NOW, pins=frozenset({c1.path, x3.path}), select=everything(run))
    assert plan.keep == (
        keep(c1, R.PINNED),
        keep(c2, R.NEWEST_COMPLETE, R.TRACKER_TARGET),
        keep(x3, R.PINNED, R.CORRUPT),
    )
    assert plan.delete == ()


def test_cannot_delete_in_progress():
    c1, p2 = ck(1), ck(2, P, age_s=10 * 86400)  # even an old-looking one: the scanner said it is being written
    run = run_of(c1, p2, tracker=1)
    plan = plan_prune([run], HOSTILE, now_ns=NOW, select=everything(run))
    assert plan.keep == (keep(c1, R.NEWEST_COMPLETE, R.TRACKER_TARGET), keep(p2, R.IN_PROGRESS))


def test_random_runs_policies_and_selections_never_break_an_invariant():
    rng = random.Random(7)
    statuses = list(Status)
    for trial in range(400):
        runs = []
        for r in range(rng.randint(1, 3)):
            path = f"/ck/p/run{r}"
            steps = sorted(rng.sample(range(1, 60), rng.randint(0, 8)))
            cks = tuple(ck(s, rng.choice(statuses), run=path, age_s=rng.randint(0, 20 * 86400)) for s in steps)
            tracker = rng.choice([None, *steps]) if steps else None
            runs.append(run_of(*cks, tracker=tracker, path=path))
        rules = tuple(
            rng.sample(
                [
                    KeepLast(n=rng.randint(0, 3)),
                    KeepEvery(k=rng.randint(0, 7)),
                    KeepWithin(duration_ns=rng.randint(0, 10 * 86400) * S),
                    KeepBest(
                        n=rng.randint(0, 2),
                        metric="loss",
                        values={r.path: {c.step: rng.random() for c in r.checkpoints} for r in runs},
                    ),
                ],
                rng.randint(0, 4),
            )
        )
        every = everything(*runs)
        pins = frozenset(p for p in every if rng.random() < 0.1)
        select = frozenset(p for p in every if rng.random() < 0.7)
        plan = plan_prune(runs, Policy(rules=rules), now_ns=NOW, pins=pins, select=select)

        deleted = {i.path for i in plan.delete}
        assert deleted | {i.path for i in plan.keep} == every and not deleted & {i.path for i in plan.keep}
        for run in runs:
            if run.latest_complete:
                assert run.latest_complete.path not in deleted, trial
            complete = sorted((c for c in run.checkpoints if c.status is Status.COMPLETE), key=lambda c: -c.step)
            kept_by_rules = set().union(*(rule.keeps(run, complete, NOW) for rule in rules)) if rules else set()
            for c in run.checkpoints:
                if c.step == run.tracker_step or c.path in pins or c.status is Status.IN_PROGRESS:
                    assert c.path not in deleted, trial
                if c.status is Status.COMPLETE and c.path not in select and (c.path in kept_by_rules or not rules):
                    assert c.path not in deleted, trial


def test_plan_serialises_to_json():
    c1, i2, c3 = ck(1), ck(2, N), ck(3)
    plan = plan_prune([run_of(c1, i2, c3, tracker=3)], Policy(rules=(KeepLast(n=1),)), now_ns=NOW)
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["bytes_freed"] == 200
    assert [d["step"] for d in doc["delete"]] == [2, 1]
    assert doc["delete"][0]["reasons"] == ["incomplete"]
    assert doc["keep"][0] == {
        "path": c3.path,
        "run": RUN,
        "step": 3,
        "status": "complete",
        "size_bytes": 100,
        "reasons": ["newest-complete", "tracker-target", "keep-last"],
        "protected": True,
    }


def test_read_metric_takes_last_record_per_step_and_skips_junk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\nnot json\n{"step": 3}\n{"step": 2, "loss": 1.25}\n'
    )
    runs = [Run(path=RUN, layout="verl-fsdp", metrics_path=str(path)), Run(path="/none", layout="verl-fsdp")]
    assert read_metric(runs, "loss") == {RUN: {1: 2.0, 2: 1.25}}


@pytest.mark.parametrize(
    ("text", "ns"),
    [("90m", 5400 * S), ("36h", 36 * 3600 * S), ("7d", 7 * 86400 * S), ("2w", 14 * 86400 * S), ("45", 45 * S)],
)
def test_durations(text, ns):
    assert parse_duration(text) == ns
    assert parse_duration(format_duration(ns)) == ns


def test_bad_duration_is_a_value_error():
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


# ---------------------------------------------------------------------------------------------------- links


def test_links_keep_what_they_lead_into_unless_they_go_too():
    from ckpt_audit.lifecycle.links import Links

    a, b, c, d = ck(1), ck(2), ck(3), ck(4)
    b_shard, c_shard = (f"{x.path}/actor/model_world_size_1_rank_0.pt" for x in (b, c))
    warm = ("/ck/proj/B/global_step_1", a.path)  # another run's warm start: keeps step 1
    above = ("/ck/proj/all", "/ck")  # a link to a directory above checkpoints pins none
    policy = Policy(rules=(KeepLast(n=1),))
    links = Links(found=(warm, above, (f"{c.path}/actor/shared.pt", b_shard)))  # inside step 3, which goes too
    plan = plan_prune([run_of(a, b, c, d, tracker=4)], policy, now_ns=NOW, links=links)
    assert [(i.step, i.reasons) for i in plan.delete] == [(3, (R.NOT_KEPT,)), (2, (R.NOT_KEPT,))]  # 3 first
    assert [(i.step, i.reasons, i.linked_from) for i in plan.keep if i.step == 1] == [(1, (R.LINKED,), (warm[0],))]

    chain = (f"{a.path}/actor/x.pt", c_shard)  # inside step 1, which the warm start keeps: keeps step 3
    links = Links(found=(warm, chain))
    plan = plan_prune([run_of(a, b, c, d, tracker=4)], policy, now_ns=NOW, links=links)
    assert [i.step for i in plan.delete] == [2]
    assert [(i.step, i.linked_from) for i in plan.keep if R.LINKED in i.reasons] == [(1, (warm[0],)), (3, (chain[0],))]


def test_a_checkpoint_goes_after_those_that_link_into_it():
    from ckpt_audit.lifecycle.links import Links

    a, b, c = ck(1), ck(2), ck(3)
    links = Links(found=((f"{a.path}/actor/x.pt", f"{b.path}/actor/model_world_size_1_rank_0.pt"),))
    plan = plan_prune([run_of(a, b, c)], Policy(rules=(KeepLast(n=1),)), now_ns=NOW, links=links, select=frozenset())
    assert [i.step for i in plan.delete] == [1, 2]  # oldest first anyway
    links = Links(found=((f"{b.path}/actor/x.pt", f"{a.path}/actor/model_world_size_1_rank_0.pt"),))
    plan = plan_prune([run_of(a, b, c)], Policy(rules=(KeepLast(n=1),)), now_ns=NOW, links=links)
    assert [i.step for i in plan.delete] == [2, 1]  # step 2 holds a link into step 1: it goes first


def test_a_hand_selected_checkpoint_a_link_leads_into_is_refused():
    from ckpt_audit.lifecycle.links import Links

    a, b = ck(1), ck(2)
    links = Links(found=(("/elsewhere/run/global_step_1", a.path),))
    plan = plan_prune([run_of(a, b)], Policy(), now_ns=NOW, links=links, select=frozenset({a.path}))
    assert plan.delete == () and plan.refused == (Refusal(path=a.path, reasons=(R.LINKED,)),)
