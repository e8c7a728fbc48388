"""`prune s3://…` against a real S3 server (test_remote's moto server and upload of a scanned verl run): exactly the
planned objects go, a survivor overwritten after the scan or an object added under a planned step stops the
deletion, and a prune SIGKILLed after each deletion (killpoints) never leaves a step that looks complete."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from cli_proc import ckpt_audit
from click.testing import CliRunner
from forked_cli import ForkedCli
from test_remote import BUCKET, multipart, s3, statuses, upload, uploaded  # noqa: F401 - fixtures

from ckpt_audit.cli import cli
from ckpt_audit.killpoints import KILL_AFTER_ENV


def step_objects(local) -> int:
    return sum(1 for p in (local / "global_step_2").rglob("*") if p.is_file())


def keys(client, prefix: str) -> set[str]:
    out: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        out.update(o["Key"] for o in page.get("Contents", ()))
    return out


def under(found: set[str], prefix: str) -> set[str]:
    return {k for k in found if k.startswith(prefix + "/")}


def prune_cli(*args: str, catalog, kill_after: int | None = None) -> subprocess.CompletedProcess:
    env = {} if kill_after is None else {KILL_AFTER_ENV: str(kill_after)}
    return ckpt_audit("prune", *args, catalog=catalog, env=env, timeout=120)


def planned(catalog, root: str, *rules: str, read_data: bool = False):
    """A Session over `root` and its checked plan, as prune shows it before it acts: (session cm, session, preview)."""
    from ckpt_audit.lifecycle.retention import KeepLast, Policy
    from ckpt_audit.session import open_session
    from ckpt_audit.session.stores import plan_prune_remote

    cm = open_session(str(catalog), roots=[root])
    s = cm.__enter__()
    policy = Policy(rules=(KeepLast(n=int(rules[0])),), stale_after_ns=3600 * 10**9)
    preview = plan_prune_remote(s, policy, pins=(), now_ns=time.time_ns(), check=True, read_data=read_data)
    return cm, s, preview


@pytest.mark.slow
def test_prune_deletes_exactly_the_planned_objects(s3, uploaded):
    client, log = s3
    local, catalog, _ = uploaded
    prefix = "prune1/demo/exp"
    upload(client, local, prefix)
    client.put_object(Bucket=BUCKET, Key="prune1/demo/notes.txt", Body=b"not a checkpoint")
    before = keys(client, "prune1")
    dry = prune_cli(f"s3://{BUCKET}/prune1", "--keep-last", "1", "--dry-run", catalog=catalog)
    assert dry.returncode == 0 and keys(client, "prune1") == before, dry.stderr
    mark = len(log.lines)
    done = prune_cli(f"s3://{BUCKET}/prune1", "--keep-last", "1", "--yes", "--json", catalog=catalog)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [(d["step"], d["action"]) for d in doc["result"]["outcomes"] if d["action"] != "re-read"] == [
        (2, "deleted"),
        (4, "deleted"),
    ]
    gone = under(before, f"{prefix}/global_step_2") | under(before, f"{prefix}/global_step_4")
    assert len(gone) == 2 * step_objects(local)
    assert keys(client, "prune1") == before - gone
    # one DeleteObject per listed key, and no multi-object or prefix delete
    requests = log.lines[mark:]
    assert not [line for line in requests if "?delete" in line]
    deleted = [m.group(1) for line in requests if (m := re.search(r"DELETE /[^/]+/(\S+) HTTP", line))]
    assert sorted(deleted) == sorted(gone)


@pytest.mark.slow
@pytest.mark.parametrize("read_data", [False, True], ids=["by-store-checksum", "by-content"])
def test_survivor_overwritten_after_the_scan_stops_the_prune(s3, uploaded, read_data):
    client, _ = s3
    local, catalog, _ = uploaded
    top = f"prune2{'-read' if read_data else ''}"
    prefix = f"{top}/demo/exp"
    upload(client, local, prefix)
    before = keys(client, top)
    cm, s, preview = planned(catalog, f"s3://{BUCKET}/{top}", "1", read_data=read_data)
    try:
        assert [i.step for i in preview.plan.delete] == [2, 4]
        shard = "global_step_6/actor/model_world_size_2_rank_0.pt"
        data = bytearray((local / shard).read_bytes())
        data[len(data) // 2] ^= 0xFF  # other bytes, same size, after the scan and the person's look at the plan
        multipart(client, f"{prefix}/{shard}", bytes(data))
        after_edit = keys(client, top)
        done = s.prune(preview, confirmed=True)
    finally:
        cm.__exit__(None, None, None)
    assert done.result is None  # the confirmed plan counted on step 6: nothing deleted
    [failed] = done.check.failed
    assert failed.checkpoint.step == 6 and str(failed.status) == "corrupt"
    assert "remote-checksum-mismatch" in {f.code for f in failed.findings}  # by content: the zip CRC too
    assert keys(client, top) == after_edit == before


@pytest.mark.slow
def test_object_added_under_a_planned_step_after_the_scan_keeps_that_step(s3, uploaded):
    client, _ = s3
    local, catalog, _ = uploaded
    prefix = "prune3/demo/exp"
    upload(client, local, prefix)
    cm, s, preview = planned(catalog, f"s3://{BUCKET}/prune3", "1")
    try:
        assert [i.step for i in preview.plan.delete] == [2, 4]
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/global_step_2/actor/late_rank_2.pt", Body=b"late")
        before = keys(client, "prune3")
        done = s.prune(preview, confirmed=False)  # prune --yes
    finally:
        cm.__exit__(None, None, None)
    assert done.result is not None
    acts = {o.step: (str(o.action), o.detail) for o in done.result.outcomes if str(o.action) != "re-read"}
    assert acts[2] == ("skipped", "written since the scan: actor/late_rank_2.pt")
    assert acts[4][0] == "deleted"
    assert keys(client, "prune3") == before - under(before, f"{prefix}/global_step_4")


@pytest.mark.slow  # a prune process per deletion
def test_prune_killed_after_each_deletion_leaves_no_step_that_looks_complete(s3, uploaded, tmp_path):
    client, _ = s3
    local, catalog, _ = uploaded
    runner = CliRunner()
    forked = ForkedCli(tmp_path, preload=("s3fs", "ckpt_audit.remote.prune", "ckpt_audit.cli.prune"))
    for k in range(1, step_objects(local) + 1):  # --keep-last 2 deletes step 2: a kill after each of its deletions
        root = f"s3://{BUCKET}/kill{k}"
        prefix = f"kill{k}/demo/exp"
        upload(client, local, prefix)
        before = keys(client, f"kill{k}")
        args = ("prune", root, "--keep-last", "2", "--yes", "--catalog", str(catalog))
        proc = forked(*args, env={KILL_AFTER_ENV: str(k)})
        assert proc.returncode == -9, (k, proc.stderr[-2000:])
        left = keys(client, f"kill{k}")
        assert len(before - left) == k, k  # exactly k objects went, all of step 2
        assert before - left <= under(before, f"{prefix}/global_step_2"), k

        res = runner.invoke(cli, ["scan", "--json", "--in-progress-window", "0", root, "--catalog", str(catalog)])
        st = statuses(json.loads(res.stdout))
        for step in (2, 4, 6):
            whole = under(before, f"{prefix}/global_step_{step}") <= left
            assert whole or st.get(step) != "complete", (k, step, st)  # partly deleted: never complete
        assert st[4] == st[6] == "complete", (k, st)
        res = runner.invoke(
            cli, ["latest", "--verified", "--in-progress-window", "0", f"{root}/demo/exp", "--json"]
            + ["--catalog", str(catalog)],
        )  # fmt: skip
        assert res.exit_code == 0 and json.loads(res.stdout)["step"] == 6, (k, res.output)

        again = runner.invoke(cli, list(args))  # the next prune finishes it
        assert again.exit_code == 0, (k, again.output[-2000:])
        assert keys(client, f"kill{k}") == before - under(before, f"{prefix}/global_step_2"), k
    forked.close()


@pytest.mark.slow
def test_the_first_deletion_is_one_the_layout_misses_and_a_harmless_one_is_refused(s3, uploaded):
    """The order's guard: the layout's own judgement of the listing without the first object to go."""
    from ckpt_audit.remote.prune import complete_without, deletion_order, listed_under

    client, _ = s3
    local, catalog, _ = uploaded
    upload(client, local, "order/demo/exp")
    cm, _s, preview = planned(catalog, f"s3://{BUCKET}/order", "2")
    cm.__exit__(None, None, None)
    [item] = preview.plan.delete
    facts = preview.scanned.file_facts
    order = deletion_order(item.checkpoint, listed_under(facts, item.path))
    assert order[0].endswith("_world_size_2_rank_1.pt") and len(order) == len(set(order)) == step_objects(local)
    assert complete_without(item, facts, order[:1]) is None
    # data.pt is optional to the verl layout: deleting it first would leave a step that passes for whole
    assert "looking complete" in complete_without(item, facts, [f"{item.path}/data.pt"])
