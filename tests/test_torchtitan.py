"""torchtitan `step-N/` folders written by torchtitan's own CheckpointManager, judged through the real CLI.

The tree comes from tests/_write_torchtitan.py (2 gloo processes, FSDP2, torchtitan's optimizer, LR scheduler and
dataloader containers: step-0 seed, step-1 and step-2 full saves through dcp.async_save, step-3 the model-only last
save), cached between sessions like the harness trees, keyed by the writer's source and the library versions. One
defect per test, on a copy dated an hour back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_json import age, codes_of, findings_of, invoke, scan_json, statuses
from conftest import build_cached, writer_key

from ckpt_audit.layouts import load_layouts
from ckpt_audit.readers import dcp_metadata
from ckpt_audit.scan import read_file

WRITER = Path(__file__).with_name("_write_torchtitan.py")
pytestmark = pytest.mark.slow  # a 2-process torchtitan run on a cold cache


def _write(dump: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(WRITER), str(dump)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="session")
def titan_dump(tmp_path_factory) -> Path:
    """A torchtitan dump folder holding checkpoint/step-{0,1,2,3}, cached across sessions."""
    import torchtitan  # noqa: F401  the test extra installs it

    key = writer_key(WRITER, ("torch", "torchtitan", "torchdata"))
    return build_cached(tmp_path_factory, "torchtitan", lambda d: _write(d / "dump"), key=key) / "dump"


@pytest.fixture
def ckpts(titan_dump, tmp_path) -> Path:
    """A private copy of the checkpoint folder (<tmp>/runs/dump/checkpoint), every entry dated an hour back."""
    dst = tmp_path / "runs" / "dump"
    shutil.copytree(titan_dump, dst)
    age(dst)
    return dst / "checkpoint"


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# -- what torchtitan writes ------------------------------------------------------------------------------------


def test_the_writer_saves_what_torchtitans_checkpointer_saves(titan_dump):
    """The keys come from torchtitan's containers, so the layout is tested on its real format, not on our reading."""
    folder = titan_dump / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-0", "step-1", "step-2", "step-3"]
    for step in range(4):
        assert sorted(p.name for p in (folder / f"step-{step}").iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    full = dcp_metadata.read_metadata(str(folder / "step-2" / ".metadata"))
    roots = dcp_metadata.read_facts(str(folder / "step-2" / ".metadata")).key_roots
    assert {"optimizer", "lr_scheduler", "dataloader", "train_state", "tok_embeddings", "layers"} <= set(roots)
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1", "train_state.step"} <= full.byte_items
    seed = dcp_metadata.read_facts(str(folder / "step-0" / ".metadata"))
    assert "optimizer" not in seed.key_roots and "tok_embeddings" in seed.key_roots


def test_scan_reads_the_byte_ranges_metadata_needs(titan_dump):
    meta = titan_dump / "checkpoint" / "step-1" / ".metadata"
    kind = {layout.file_kind(str(meta)) for layout in load_layouts()} - {None}
    fact = read_file(str(meta), meta.stat(), None, kind=kind.pop())
    sizes = {p.name: p.stat().st_size for p in meta.parent.glob("*.distcp")}
    assert fact.dcp is not None and dict(fact.dcp.file_ends) == sizes  # each rank's file ends where its last item does


# -- real trees through the CLI --------------------------------------------------------------------------------


def test_recognised_with_no_configuration(ckpts, tmp_path):
    doc = scan_json(ckpts.parent.parent, tmp_path / "c.db")
    [run] = doc["runs"]
    assert run["layout"] == "torchtitan" and run["path"] == str(ckpts)
    assert statuses(doc) == {0: "complete", 1: "complete", 2: "complete", 3: "complete"}
    assert {c["world_size"] for c in run["checkpoints"]} == {2}
    assert run["tracker_step"] == 3  # what torchtitan's own resume would load
    assert "torchtitan-seed" in codes_of(doc, 0)
    assert codes_of(doc, 1) == codes_of(doc, 2) == set()
    [only] = findings_of(doc, 3)  # the default last save holds the model alone: torchtitan cannot resume from it
    assert only["code"] == "torchtitan-model-only" and only["severity"] == "warning"
    assert doc["exit_code"] == 0
    # the resume gate passes over the model-only last save: torchtitan's resume from it fails
    res = invoke("latest", str(ckpts), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(ckpts / "step-2")


def test_truncated_distcp_is_caught_by_scan_and_verify(ckpts, tmp_path):
    shard = ckpts / "step-2" / "__1_0.distcp"
    truncate(shard, shard.stat().st_size - 100)
    age(ckpts.parent)
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc) == {0: "complete", 1: "complete", 2: "corrupt", 3: "complete"}
    [f] = [f for f in findings_of(doc, 2) if f["code"] == "dcp-range-outside-file"]
    assert f["path"] == str(shard) and f["rank"] == 1 and "truncated" in f["message"]
    doc = scan_json(ckpts, tmp_path / "v.db", command="verify")
    assert statuses(doc)[2] == "corrupt" and "dcp-range-outside-file" in codes_of(doc, 2)
    assert doc["exit_code"] == 1


def test_a_flipped_byte_inside_a_tensor_is_named_by_verify_and_corrupt_at_scan(ckpts, tmp_path):
    """Same size, same mtime: only the item's CRC-32 tells. Scan names the .distcp, verify the tensor too."""
    step = ckpts / "step-2"
    meta = dcp_metadata.read_metadata(str(step / ".metadata"))
    items = [(length, start, fqn) for (fqn, _), (rel, start, length) in meta.storage.items() if rel == "__1_0.distcp"]
    length, start, fqn = max(i for i in items if i[2] in meta.tensors)  # the largest tensor item: its middle is payload
    shard = step / "__1_0.distcp"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(start + length // 2)
        byte = f.read(1)
        f.seek(start + length // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc) == {0: "complete", 1: "complete", 2: "corrupt", 3: "complete"}
    [f] = [f for f in findings_of(doc, 2) if f["code"] == "distcp-crc-mismatch"]
    assert f["path"] == str(shard) and f["tensor"] is None
    doc = scan_json(ckpts, tmp_path / "c.db", command="verify")
    named = [f for f in findings_of(doc, 2) if f["code"] == "distcp-crc-mismatch" and f["tensor"]]
    assert [(f["path"], f["rank"], f["tensor"]) for f in named] == [(str(shard), 1, fqn)]
    assert statuses(doc)[2] == "corrupt" and doc["exit_code"] == 1


def test_missing_distcp_is_caught_by_scan_and_verify(ckpts, tmp_path):
    (ckpts / "step-1" / "__0_0.distcp").unlink()
    age(ckpts.parent)
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc) == {0: "complete", 1: "incomplete", 2: "complete", 3: "complete"}
    [f] = [f for f in findings_of(doc, 1) if f["code"] == "dcp-file-missing"]
    assert f["path"] == str(ckpts / "step-1" / "__0_0.distcp") and f["rank"] == 0
    doc = scan_json(ckpts, tmp_path / "v.db", command="verify")
    assert statuses(doc)[1] == "incomplete" and "dcp-file-missing" in codes_of(doc, 1)


def test_missing_metadata_is_incomplete_and_torchtitan_resumes_elsewhere(ckpts, tmp_path):
    # DCP writes .metadata.tmp and renames it last: a save killed in between leaves the data and no commit
    os.rename(ckpts / "step-3" / ".metadata", ckpts / "step-3" / ".metadata.tmp")
    age(ckpts.parent)
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc) == {0: "complete", 1: "complete", 2: "complete", 3: "incomplete"}
    [f] = [f for f in findings_of(doc, 3) if f["code"] == "dcp-metadata-missing"]
    assert ".metadata.tmp" in f["message"]
    assert doc["runs"][0]["tracker_step"] == 2  # torchtitan skips a step-N without .metadata


def test_a_save_without_metadata_just_now_is_in_progress(ckpts, tmp_path):
    (ckpts / "step-3" / ".metadata").unlink()
    age(ckpts / "step-3", seconds=5)
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc)[3] == "in-progress"
    assert doc["exit_code"] == 0


def test_a_broken_step_that_torchtitan_would_resume_from_is_named(ckpts, tmp_path):
    shutil.rmtree(ckpts / "step-3")  # keep_latest_k purges from the oldest; here the newest is gone
    truncate(ckpts / "step-2" / "__0_0.distcp", 1000)
    age(ckpts.parent)
    doc = scan_json(ckpts, tmp_path / "c.db")
    [run] = doc["runs"]
    assert run["tracker_step"] == 2
    [f] = [f for f in run["findings"] if f["code"] == "torchtitan-resume-broken"]
    assert f["path"] == str(ckpts / "step-2") and "corrupt" in f["message"]


def test_latest_and_prune_dry_run_through_the_cli(ckpts, tmp_path):
    cat = tmp_path / "c.db"
    (ckpts / "step-2" / "__1_0.distcp").unlink()
    age(ckpts.parent)
    res = invoke("scan", str(ckpts), catalog=cat)
    assert res.exit_code == 1, res.output
    res = invoke("latest", "--json", str(ckpts), catalog=cat)
    assert res.exit_code == 0, res.output
    gate = json.loads(res.stdout)
    assert gate["checkpoint"] == str(ckpts / "step-1")
    assert {p["step"]: p["reasons"][0] for p in gate["passed_over"]} == {
        3: "torchtitan-model-only",
        2: "dcp-file-missing",
    }
    res = invoke("prune", "--dry-run", "--json", "--keep-last", "1", str(ckpts), catalog=cat)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)["plan"]
    assert {d["step"]: d["reasons"] for d in plan["delete"]} == {0: ["not-kept"], 2: ["incomplete"]}
    # step-3 is model only: step-1, the newest a resume continues from, is kept too
    assert {d["step"]: d["reasons"] for d in plan["keep"]} == {
        1: ["newest-resumable"],
        3: ["newest-complete", "tracker-target", "keep-last"],
    }
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0", "step-1", "step-2", "step-3"]  # a dry run


def test_fix_tracker_writes_no_verl_tracker_into_a_torchtitan_folder(ckpts, tmp_path):
    (ckpts / "step-3" / ".metadata").unlink()
    age(ckpts.parent)
    res = invoke("fix-tracker", "--yes", str(ckpts), catalog=tmp_path / "c.db")
    assert res.exit_code == 1 and "torchtitan run has no tracker" in res.output
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0", "step-1", "step-2", "step-3"]


def test_a_rescan_checks_a_truncated_distcp_against_the_catalogued_metadata(ckpts, tmp_path):
    """The catalog keeps what .metadata said (files.dcp_facts): an unchanged .metadata is not read again, and the
    byte ranges it gave still judge a data file truncated since."""
    cat = tmp_path / "c.db"
    first = scan_json(ckpts, cat)
    assert first["files_hashed"] == 12 and first["summary"]["errors"] == 0
    shard = ckpts / "step-1" / "__0_0.distcp"
    truncate(shard, 10)
    age(shard)  # the others keep the stat the catalog recorded
    doc = scan_json(ckpts, cat)
    # only the truncated file was read for a reason (the scrub re-reads a share of the rest by content, on purpose)
    assert doc["files_hashed"] - doc["files_scrubbed"] == 1
    assert statuses(doc)[1] == "corrupt" and "dcp-range-outside-file" in codes_of(doc, 1)


def test_a_step_set_aside_in_the_folder_is_still_a_step_to_torchtitan(ckpts, tmp_path):
    os.rename(ckpts / "step-3", ckpts / "step-3.bak")  # torchtitan's re.search still reads step 3 from it
    age(ckpts.parent)
    doc = scan_json(ckpts, tmp_path / "c.db")
    [run] = doc["runs"]
    assert statuses(doc) == {0: "complete", 1: "complete", 2: "complete"}
    [f] = [f for f in run["findings"] if f["code"] == "torchtitan-stray-step"]
    assert f["path"] == str(ckpts / "step-3.bak") and f["severity"] == "warning"


def test_verify_of_one_step_judges_it_with_its_run_and_export_refuses_dcp(ckpts, tmp_path):
    doc = scan_json(ckpts / "step-3", tmp_path / "c.db", command="verify")
    [run] = doc["runs"]
    assert run["layout"] == "torchtitan" and run["path"] == str(ckpts)
    assert statuses(doc) == {3: "complete"} and "torchtitan-model-only" in codes_of(doc, 3)
    res = invoke("export", str(ckpts / "step-2"), "--to", str(tmp_path / "hf"), catalog=tmp_path / "c.db")
    assert res.exit_code == 3 and "dcp_to_torch_save" in res.output
    assert not (tmp_path / "hf").exists()


def test_a_metadata_that_does_not_parse_is_corrupt_at_scan(ckpts, tmp_path):
    (ckpts / "step-1" / ".metadata").write_bytes(b"\x80\x04not a pickle")
    age(ckpts.parent)
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc) == {0: "complete", 1: "corrupt", 2: "complete", 3: "complete"}
    [f] = [f for f in findings_of(doc, 1) if f["code"] == "dcp-metadata-invalid"]
    assert f["path"] == str(ckpts / "step-1" / ".metadata")
    again = scan_json(ckpts, tmp_path / "c.db")  # reused from the catalog, still corrupt
    assert statuses(again)[1] == "corrupt"
