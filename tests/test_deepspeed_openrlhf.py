"""OpenRLHF PPO checkpoints: `_actor/` and `_critic/` DeepSpeed save directories judged as a pair, `metric.json`,
`best_` tags named by `latest`, and the `<tag>_hf/` exports beside them.

OpenRLHF itself (Ray, vLLM, CUDA) cannot run here: tests/_write_openrlhf.py reproduces its save sequence from its
source (DeepspeedStrategy.save_ckpt and save_model, the PPO trainer's regular and best saves, its rotation) on two real
DeepSpeed 0.19.8 engines (2 CPU ranks, gloo, ZeRO-2 bf16), and resumes each save directory the way OpenRLHF does
(`load_checkpoint(dir)`, no tag) at build time. The tree: global_step4, global_step6, best_global_step6 in each of
_actor/ and _critic/, `latest` naming best_global_step6, metric.json in every tag, global_step{2,4,6}_hf/.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_json import age, invoke, scan_json
from conftest import build_cached, writer_key
from test_deepspeed import _write

WRITER = Path(__file__).with_name("_write_openrlhf.py")


@pytest.fixture(scope="session")
def openrlhf_tree(tmp_path_factory) -> Path:
    import deepspeed  # noqa: F401  the test extra installs it

    key = writer_key(WRITER, ("torch", "deepspeed", "transformers"))
    return build_cached(tmp_path_factory, "openrlhf", lambda d: _write(WRITER, d / "ckpt"), key=key) / "ckpt"


@pytest.fixture
def ckpt(openrlhf_tree, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(openrlhf_tree, dst)
    age(dst)
    return dst


def _runs(doc) -> dict[str, dict]:
    return {Path(r["path"]).name: r for r in doc["runs"]}


def _tags(run) -> dict[str, tuple[str, list[str]]]:
    return {Path(c["path"]).name: (c["status"], [f["code"] for f in c["findings"]]) for c in run["checkpoints"]}


@pytest.mark.slow
def test_actor_and_critic_are_recognised_and_latest_names_the_best_tag(ckpt, tmp_path):
    doc = scan_json(ckpt, tmp_path / "c.db")
    runs = _runs(doc)
    assert sorted(runs) == ["_actor", "_critic"] and doc["exit_code"] == 0
    for run in runs.values():
        assert run["layout"] == "deepspeed" and run["tracker_step"] == 6
        assert _tags(run) == {t: ("complete", []) for t in ("global_step4", "global_step6", "best_global_step6")}
    # the HF exports are named on the actor's run as what they are, never taken for checkpoints or runs
    [told] = runs["_actor"]["findings"]
    assert (
        told["code"] == "openrlhf-hf-export"
        and "global_step2_hf/, global_step4_hf/, global_step6_hf/" in told["message"]
    )
    res = invoke("latest", "--print", "tag", str(ckpt / "_actor"), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout == "best_global_step6\n", res.output
    res = invoke("latest", "--verified", str(ckpt / "_critic"), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(ckpt / "_critic" / "best_global_step6"), res.output


@pytest.mark.slow
def test_a_tag_only_one_of_the_pair_holds_is_incomplete_and_latests_that_differ_are_said(ckpt, tmp_path):
    # the critic's save of global_step6 died (its rank 0 removed it, or the disk did): resuming the actor at 6 would
    # pair it with a critic from another step
    shutil.rmtree(ckpt / "_critic" / "global_step6")
    (ckpt / "_critic" / "latest").write_text("global_step4")
    age(ckpt)
    runs = _runs(scan_json(ckpt, tmp_path / "c.db"))
    actor = _tags(runs["_actor"])
    assert actor["global_step6"] == ("incomplete", ["openrlhf-pair-missing"])
    assert actor["best_global_step6"] == ("complete", []) and actor["global_step4"] == ("complete", [])
    for name, other in (("_actor", "'global_step4'"), ("_critic", "'best_global_step6'")):
        [f] = [f for f in runs[name]["findings"] if f["code"] == "openrlhf-latest-differs"]
        assert f["path"] == str(ckpt / name / "latest") and other in f["message"]


@pytest.mark.slow
def test_a_tag_without_metric_json_is_said_and_still_loads(ckpt, tmp_path):
    # OpenRLHF writes metric.json after DeepSpeed's save and `latest`: cut in between, the tag still loads
    (ckpt / "_actor" / "global_step4" / "metric.json").unlink()
    age(ckpt)
    doc = scan_json(ckpt, tmp_path / "c.db")
    assert _tags(_runs(doc)["_actor"])["global_step4"] == ("complete", ["openrlhf-metric-missing"])


@pytest.mark.slow
def test_keep_best_ranks_by_each_tags_metric_json(ckpt, tmp_path):
    """metric.json: global_step4 0.2 (the eval before it), global_step6 0.1, best_global_step6 0.3 (step 6's own
    eval, which is the value of step 6). Highest is best: step 6, kept anyway (`latest`), so step 4 goes in both."""
    assert json.loads((ckpt / "_actor" / "best_global_step6" / "metric.json").read_text())["metric_value"] == 0.3
    db = tmp_path / "c.db"
    keep = ["--keep-best", "1", "--metric", "eval_pass1", "--keep-last", "1"]
    res = invoke("prune", *keep, "--mode", "min", "--yes", str(ckpt), catalog=db)
    assert res.exit_code == 0, res.output  # lowest is best: step 4 (0.2) stays
    assert (ckpt / "_actor" / "global_step4").is_dir() and (ckpt / "_critic" / "global_step4").is_dir()
    res = invoke("prune", *keep, "--mode", "max", "--yes", str(ckpt), catalog=db)
    assert res.exit_code == 0, res.output
    for name in ("_actor", "_critic"):
        assert sorted(p.name for p in (ckpt / name).iterdir() if p.is_dir()) == ["best_global_step6", "global_step6"]
    assert sorted(p.name for p in ckpt.glob("*_hf")) == ["global_step2_hf", "global_step4_hf", "global_step6_hf"]
    res = invoke("prune", "--keep-best", "1", "--metric", "eval_typo", "--yes", str(ckpt), catalog=db)
    assert res.exit_code == 2 and "no metric.json" in res.output
    # a FIFO in metric.json's place is no metric, and never blocks prune waiting for a writer
    best = ckpt / "_actor" / "best_global_step6" / "metric.json"
    best.unlink()
    os.mkfifo(best)
    res = invoke("prune", *keep, "--mode", "max", "--yes", str(ckpt), catalog=db)
    assert res.exit_code == 0, res.output


@pytest.mark.slow
def test_prometheus_catalog_and_tui_show_each_tag_of_a_step_saved_twice(ckpt, tmp_path):
    """global_step6 and best_global_step6 are one step under two tags: every surface keeps both."""
    from prometheus_client.parser import text_string_to_metric_families
    from textual.widgets import DataTable
    from tui_pilot import drive, open_run

    from tui.app import AuditApp
    from tui.screens.details import DetailsScreen

    db, prom = tmp_path / "c.db", tmp_path / "m.prom"
    res = invoke("scan", "-q", "--metrics-file", str(prom), str(ckpt), catalog=db)
    assert res.exit_code == 0, res.output
    got = {
        (s.name, s.labels.get("run"), s.labels.get("status")): s.value
        for fam in text_string_to_metric_families(prom.read_text())
        for s in fam.samples
    }
    for name in ("_actor", "_critic"):
        run = str(ckpt / name)
        assert got[("ckpt_audit_checkpoints", run, "complete")] == 3
        assert got[("ckpt_audit_latest_complete_step", run, None)] == 6
    ls = json.loads(invoke("ls", "--json", str(ckpt / "_actor"), catalog=db).output)
    assert sorted(Path(c["path"]).name for c in ls["checkpoints"]) == [
        "best_global_step6",
        "global_step4",
        "global_step6",
    ]
    show = json.loads(invoke("show", "--json", str(ckpt / "_actor" / "best_global_step6"), catalog=db).output)
    assert show["checkpoint"]["path"] == str(ckpt / "_actor" / "best_global_step6")
    assert {Path(f["path"]).name for f in show["checkpoint"]["files"]} >= {"metric.json", "mp_rank_00_model_states.pt"}

    app = AuditApp(catalog_path=db, roots=[str(ckpt)])

    async def script(pilot):
        assert app.last_error is None and app.screen.query_one("#runs", DataTable).row_count == 2
        screen = await open_run(pilot)
        table = screen.query_one("#checkpoints", DataTable)
        assert table.row_count == 3 and sorted(int(table.get_row_at(i)[1]) for i in range(3)) == [4, 6, 6]
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailsScreen) and app.screen.checkpoint.step == 6

    drive(app, script)
