"""HF Trainer `checkpoint-N/` folders written by transformers' own Trainer, judged through the real CLI.

The tree comes from tests/_write_hf_trainer.py (a real `Trainer.train()`, DDP over 2 CPU processes on gloo:
checkpoint-2, -4 with model.safetensors, checkpoint-6 with sharded weights and an index, rng_state_0/1.pth in each),
cached between sessions like the harness trees, keyed by the writer's source and the library versions. One defect per
test, on a copy.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from cli_json import age, codes_of, findings_of, invoke, scan_json, statuses
from conftest import build_cached, writer_key
from ranks import run_ranks

from ckpt_audit.deep import safe_load
from ckpt_audit.rules import files as file_rules
from ckpt_audit.rules import hf_trainer as rules
from ckpt_audit.rules.status import ScanContext

WRITER = Path(__file__).with_name("_write_hf_trainer.py")


def _write(dest: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    res = run_ranks(WRITER, str(dest), env=env, timeout=600)  # 2 ranks, as torchrun starts them
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="session")
def hf_run(tmp_path_factory) -> Path:
    """The output directory of a real 2-process Trainer run (checkpoint-2, -4, -6), cached across sessions."""
    import accelerate  # noqa: F401  Trainer needs it; the test extra installs it

    key = writer_key(WRITER, ("torch", "transformers", "accelerate", "safetensors", "numpy"))
    return build_cached(tmp_path_factory, "hf_trainer", lambda d: _write(d / "out"), key=key) / "out"


@pytest.fixture
def out(hf_run, tmp_path) -> Path:
    """A private copy of the Trainer output, every entry dated an hour back (so nothing counts as being written)."""
    dst = tmp_path / "runs" / "out"
    shutil.copytree(hf_run, dst)
    age(dst)
    return dst


# -- real trees through the CLI --------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_output_is_recognised_with_no_configuration_and_complete(out, tmp_path):
    doc = scan_json(out.parent, tmp_path / "c.db")
    [run] = doc["runs"]
    assert run["layout"] == "hf-trainer" and run["path"] == str(out)
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"}
    assert {c["world_size"] for c in run["checkpoints"]} == {2}  # one rng_state_R.pth per rank
    assert doc["exit_code"] == 0
    # training_args.bin is read by the restricted unpickler, reported as the object it is, never unpickled
    assert "training-args-pickle" in codes_of(doc, 2)
    res = invoke("latest", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(out / "checkpoint-6")


@pytest.mark.slow
def test_truncated_model_safetensors_is_corrupt_and_latest_passes_over_it(out, tmp_path):
    shard = out / "checkpoint-6" / "model-00002-of-00003.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "corrupt"}
    [f] = [f for f in findings_of(doc, 6) if f["code"] == "safetensors-offsets"]
    assert "truncated" in f["message"] and f["path"] == str(shard)
    # get_last_checkpoint would hand Trainer checkpoint-6; the run says so, and the gate answers checkpoint-4
    assert "hf-last-checkpoint-unusable" in {f["code"] for f in doc["runs"][0]["findings"]}
    res = invoke("latest", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(out / "checkpoint-4")
    # pruning the corrupt one is what makes transformers' own pick a good checkpoint again
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-6")
    res = invoke("prune", "--yes", "--keep-last", "5", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0, res.output
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.slow
def test_missing_optimizer_is_incomplete_in_verify_and_prune_deletes_it_first(out, tmp_path):
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    age(out)
    res = invoke("verify", "--json", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert statuses(doc) == {2: "complete", 4: "incomplete", 6: "complete"}
    assert "hf-missing-optimizer" in codes_of(doc, 4)
    res = invoke("prune", "--dry-run", "--json", "--keep-last", "1", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert {d["step"]: d["reasons"] for d in plan["delete"]} == {2: ["not-kept"], 4: ["incomplete"]}
    assert {d["step"]: d["reasons"] for d in plan["keep"]} == {6: ["newest-complete", "keep-last"]}
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


@pytest.mark.slow
def test_fix_tracker_writes_no_verl_tracker_into_a_trainer_output(out, tmp_path):
    (out / "checkpoint-6" / "scheduler.pt").unlink()
    age(out)
    res = invoke("fix-tracker", "--yes", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 1 and "has no tracker" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


@pytest.mark.slow
def test_the_highest_rank_s_rng_state_missing_is_a_warning_against_the_checkpoint_before(out, tmp_path):
    (out / "checkpoint-6" / "rng_state_1.pth").unlink()  # rank 1 of 2: the names alone say W=1
    age(out)
    doc = scan_json(out, tmp_path / "c.db", "--fail-on", "warning")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"}
    [f] = [f for f in findings_of(doc, 6) if f["code"] == "hf-fewer-ranks"]
    assert f["rank"] == 1 and "checkpoint-4 has 2" in f["message"]
    assert doc["exit_code"] == 1


@pytest.mark.slow
def test_a_model_only_save_is_kept_by_prune_but_never_the_answer_of_latest(out, tmp_path):
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):  # save_only_model=True
        (out / "checkpoint-6" / name).unlink()
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "complete"}
    assert "hf-model-only" in codes_of(doc, 6) and "hf-missing-optimizer" not in codes_of(doc, 6)
    res = invoke("latest", "--json", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0, res.output
    gate = json.loads(res.stdout)
    assert gate["checkpoint"] == str(out / "checkpoint-4")
    assert [p["reasons"] for p in gate["passed_over"]] == [["hf-model-only"]]
    res = invoke("prune", "--dry-run", "--json", str(out), catalog=tmp_path / "c.db")
    assert json.loads(res.stdout)["plan"]["delete"] == []


@pytest.mark.slow
def test_missing_rng_state_of_one_rank_is_incomplete(out, tmp_path):
    (out / "checkpoint-2" / "rng_state_0.pth").unlink()
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "incomplete", 4: "complete", 6: "complete"}
    [f] = [f for f in findings_of(doc, 2) if f["code"] == "hf-missing-rng-state"]
    assert f["rank"] == 0 and f["path"] == str(out / "checkpoint-2" / "rng_state_0.pth")
    assert doc["exit_code"] == 1


@pytest.mark.slow
def test_missing_shard_and_missing_trainer_state(out, tmp_path):
    (out / "checkpoint-6" / "model-00003-of-00003.safetensors").unlink()
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "incomplete", 6: "incomplete"}
    assert "hf-shard-missing" in codes_of(doc, 6)
    assert "hf-missing-trainer-state" in codes_of(doc, 4)
    res = invoke("latest", str(out), catalog=tmp_path / "c.db")
    assert res.stdout.strip() == str(out / "checkpoint-2")


@pytest.mark.slow
def test_trainer_state_of_another_step_and_a_fresh_uncommitted_save(out, tmp_path):
    state = out / "checkpoint-4" / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 4,', '"global_step": 2,'))
    (out / "checkpoint-6" / "trainer_state.json").unlink()  # Trainer writes it last: a save still running
    os.utime(out / "checkpoint-6")  # touched now
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "incomplete", 6: "in-progress"}
    assert "hf-step-mismatch" in codes_of(doc, 4)


@pytest.mark.slow
def test_a_long_trainer_state_is_judged_from_its_first_64_kib(out, tmp_path):
    from ckpt_audit.layouts import text_files

    assert text_files()["trainer_state.json"] == (rules.TEXT_LIMIT, True)  # the scan reads a prefix of this much
    for step, written in ((4, 4), (6, 5)):
        path = out / f"checkpoint-{step}" / "trainer_state.json"
        doc = json.loads(path.read_text())
        doc["log_history"] *= 2000  # a long run's log: megabytes, as Trainer dumps it (indent 2, sorted keys)
        doc["global_step"] = written
        path.write_text(json.dumps(doc, indent=2, sort_keys=True))
        assert path.stat().st_size > 4 * rules.TEXT_LIMIT
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "incomplete"}
    [f] = [f for f in findings_of(doc, 6) if f["code"] == "hf-step-mismatch"]
    assert "global_step is 5" in f["message"]


@pytest.mark.slow
def test_a_foreign_global_in_rng_state_makes_it_unsafe(out, tmp_path):
    import torch

    torch.save({"python": os.system}, out / "checkpoint-4" / "rng_state_1.pth")  # names posix.system
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc)[4] == "unsafe"
    assert "unsafe-pickle" in codes_of(doc, 4)


@pytest.mark.slow
def test_verify_loads_the_resume_pickles_safely_and_reads_them_as_trainer_does(out, tmp_path):
    import torch

    res = invoke("verify", "--json", str(out), catalog=tmp_path / "c.db")
    assert res.exit_code == 0, res.output
    assert statuses(json.loads(res.stdout)) == {2: "complete", 4: "complete", 6: "complete"}
    rng = out / "checkpoint-4" / "rng_state_1.pth"
    state = safe_load.load(str(rng)).value  # weights_only, with the allowlist's numpy RNG names
    del state["cpu"]  # Trainer's resume indexes it: KeyError
    torch.save(state, rng)
    age(out)
    doc = scan_json(out, tmp_path / "c.db")
    assert statuses(doc)[4] == "complete"  # a well-formed pickle of allowed globals: only a load shows it
    res = invoke("verify", "--json", str(out / "checkpoint-4"), catalog=tmp_path / "c.db")
    assert res.exit_code == 1, res.output
    [f] = [f for f in findings_of(json.loads(res.stdout), 4) if f["code"] == "hf-state-invalid"]
    assert f["path"] == str(rng) and "'cpu'" in f["message"]


@pytest.mark.slow
def test_export_passes_the_weights_through_and_leaves_the_resume_state(out, tmp_path):
    from safetensors.numpy import load_file

    cat = tmp_path / "c.db"
    scan_json(out, cat)
    res = invoke("export", str(out / "checkpoint-6"), "--to", str(tmp_path / "hf"), catalog=cat)
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in names and "model.safetensors" in names
    assert not {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", "trainer_state.json", "training_args.bin"} & set(
        names
    )
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    source: dict = {}
    for shard in sorted((out / "checkpoint-6").glob("model-*.safetensors")):
        source.update(load_file(str(shard)))
    assert exported.keys() == source.keys()
    assert all((exported[k] == source[k]).all() for k in source)
    # a corrupt source is refused (exit 1) and nothing is written
    shard = out / "checkpoint-4" / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)
    age(out)
    scan_json(out, cat)
    res = invoke("export", str(out / "checkpoint-4"), "--to", str(tmp_path / "hf4"), catalog=cat)
    assert res.exit_code == 1 and not (tmp_path / "hf4").exists()


# -- the rules on names and texts (no tree) -------------------------------------------------------------------

STATE = frozenset({"optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin", "model.safetensors"})


def check(names, texts=None, **kw):
    return rules.check_checkpoint("/o/checkpoint-8", 8, frozenset(names), frozenset(), texts or {}, **kw)


def test_rng_state_of_a_middle_rank_missing_and_the_world_size():
    names = STATE | {"rng_state_0.pth", "rng_state_2.pth"}
    [f] = [f for f in check(names) if f.code == "hf-missing-rng-state"]
    assert f.rank == 1 and f.path.endswith("rng_state_1.pth")
    assert rules.world_size(frozenset(names)) == 3


def test_missing_model_scheduler_and_an_index_without_shards():
    found = {f.code for f in check({"optimizer.pt", "rng_state.pth", "trainer_state.json"})}
    assert {"hf-missing-model", "hf-missing-scheduler"} <= found
    shards = STATE - {"model.safetensors"} | {"rng_state.pth", "model-00001-of-00002.safetensors"}
    found = {(f.code, f.path.rsplit("/", 1)[-1]) for f in check(shards)}
    assert ("hf-shard-missing", "model-00002-of-00002.safetensors") in found
    assert ("hf-index-missing", "model.safetensors.index.json") in found


def test_model_only_save_is_one_warning_but_a_crash_before_trainer_state_is_not():
    weights = {"model.safetensors", "config.json", "training_args.bin"}
    assert [f.code for f in check(weights | {"trainer_state.json"})] == ["hf-model-only"]
    found = {f.code for f in check(weights)}
    assert {"hf-missing-optimizer", "hf-missing-trainer-state"} <= found and "hf-model-only" not in found


def test_index_and_trainer_state_that_are_not_json():
    names = STATE | {"rng_state.pth", "model.safetensors.index.json"}
    texts = {"model.safetensors.index.json": ("{", True), "trainer_state.json": ("[]", True)}
    found = {f.code for f in check(names, texts)}
    assert {"hf-index-invalid", "hf-trainer-state-invalid"} <= found


def test_global_step_read_from_a_prefix_of_a_long_trainer_state():
    prefix = '{\n  "best_global_step": 7,\n  "epoch": 1.0,\n  "global_step": 9,\n  "log_history": [\n    {"step": 1'
    assert rules.trainer_step(prefix, whole=False) == 9
    found = {f.code for f in check(STATE | {"rng_state.pth"}, {"trainer_state.json": (prefix, False)})}
    assert "hf-step-mismatch" in found


def test_training_args_pickle_is_reported_as_what_it_is_and_a_foreign_global_stays_unsafe():
    path = "/o/checkpoint-8/training_args.bin"
    own = frozenset({"transformers.training_args.TrainingArguments", "accelerate.state.PartialState"})
    [f] = file_rules.structure_findings(path, problems=(), unsafe_globals=own)
    assert f.code == "training-args-pickle" and "TrainingArguments" in f.message
    found = file_rules.structure_findings(path, problems=(), unsafe_globals=own | {"posix.system"})
    assert [f.code for f in found] == ["training-args-pickle", "unsafe-pickle"]
    assert "posix.system" in found[1].message
    # the same classes in any other pickle are unsafe
    [g] = file_rules.structure_findings("/o/checkpoint-8/optimizer.pt", problems=(), unsafe_globals=own)
    assert g.code == "unsafe-pickle"


def test_a_deepspeed_checkpoint_is_one_hf_run_not_a_verl_run_too():
    """Trainer under DeepSpeed keeps model and optimizer states in checkpoint-N/global_stepK/: that name reads like a
    misnamed verl step, so without care the verl layout would take checkpoint-N for a run of its own."""
    from ckpt_audit.scan import reduce
    from ckpt_audit.tree import FileFacts, Partial, Tree

    ck, ds = "/o/checkpoint-6", "/o/checkpoint-6/global_step6"
    files = {
        ck: ("config.json", "latest", "model.safetensors", "rng_state_0.pth", "scheduler.pt", "trainer_state.json"),
        ds: ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"),
    }
    tree = Tree(dirs={"/o": ("checkpoint-6",), ck: ("global_step6",), ds: ()}, files={"/o": (), **files})
    paths = [f"{d}/{n}" for d, names in files.items() for n in names]
    facts = {p: FileFacts(path=p, size_bytes=1, mtime_ns=1, inode=i, hash="0" * 32) for i, p in enumerate(paths)}
    state = '{\n  "global_step": 6,\n  "log_history": []\n}'
    facts[f"{ck}/trainer_state.json"] = replace(facts[f"{ck}/trainer_state.json"], text=state)
    result = reduce([Partial(root="/o", tree=tree, facts=facts)], ctx=ScanContext(now_ns=10**18))
    assert [(r.path, r.layout) for r in result.runs] == [("/o", "hf-trainer")]
    [c] = result.runs[0].checkpoints
    assert c.status.value == "complete", c.all_findings
