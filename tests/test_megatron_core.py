"""ckpt-audit on trees written by megatron-core's own dist_checkpointing.save, judged against megatron-core's own load.

The trees and megatron-core's verdicts come from tests/_megatron_trees.py (a GPTModel with TP=2 over gloo, saved the
way verl's Megatron manager saves, one copy per defect, each loaded back by both ranks), run once in a subprocess
and cached like the harness trees, keyed by that file and the torch / megatron-core versions. The table below is
docs/megatron.md's: for each case what megatron-core's load did and what scan and verify say. Agreement: the
checkpoint verl would resume from loads with the saved values exactly when verify finds no error in the run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from conftest import build_cached, writer_key

from ckpt_audit import scan
from ckpt_audit.export.guard import ExportError
from ckpt_audit.export.orchestrator import export_checkpoint
from ckpt_audit.models import Severity
from ckpt_audit.verify import verify

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("megatron") is None, reason="needs the 'megatron' extra (megatron-core, psutil)"),
]

HERE = Path(__file__).parent
WRITER = HERE / "_megatron_trees.py"
STEP = "global_step_1"

# case -> (megatron-core's load, scan status, verify status, codes verify must report)
TABLE = {
    "intact": ("loads", "complete", "complete", ()),
    "distcp-missing": (
        "fails: CheckpointException: FileNotFoundError",
        "incomplete",
        "incomplete",
        ("dcp-file-missing",),
    ),
    "distcp-truncated": ("fails: CheckpointException", "corrupt", "corrupt", ("dcp-range-outside-file",)),
    "distcp-bitflip": ("loads-changed", "corrupt", "corrupt", ("distcp-crc-mismatch",)),
    "distcp-zip-damaged": ("fails", "corrupt", "corrupt", ("distcp-item-invalid",)),
    "metadata-missing": ("fails: CheckpointException", "incomplete", "incomplete", ("dcp-metadata-missing",)),
    "metadata-garbage": ("fails: CheckpointException", "corrupt", "corrupt", ("dcp-metadata-invalid",)),
    "metadata-json-missing": (
        "fails: CheckpointingException",
        "incomplete",
        "incomplete",
        ("megatron-metadata-missing",),
    ),
    "common-missing": ("fails", "incomplete", "incomplete", ("megatron-common-missing",)),
    "tracker-dangling": ("fails: CheckpointingException", "complete", "complete", ("tracker-dangling",)),
    "integrity-ok": ("loads", "complete", "complete", ()),
    "integrity-mismatch": (
        "loads-changed",
        "corrupt",
        "corrupt",
        ("megatron-integrity-mismatch", "distcp-crc-mismatch"),
    ),
}


def _write(dst: Path) -> None:
    subprocess.run([sys.executable, str(WRITER), str(dst)], check=True, capture_output=True, timeout=900)


@pytest.fixture(scope="session")
def mcore(tmp_path_factory) -> Path:
    """The root of the megatron-core trees (cases/<case>/exp) and verdicts.json, cached across sessions."""
    key = writer_key(WRITER, ("torch", "megatron-core", "numpy"))
    return build_cached(tmp_path_factory, "megatron_core", _write, key=key)


def _run(mcore: Path, case: str) -> Path:
    return mcore / "cases" / case / "exp"


def _resumable(result) -> bool:
    """What verify says of resuming this run: no error anywhere, and the tracker's checkpoint complete."""
    run = result.runs[0]
    return not any(f.severity is Severity.ERROR for f in result.all_findings) and any(
        c.step == run.tracker_step and c.status.value == "complete" for c in run.checkpoints
    )


@pytest.mark.parametrize(
    ("case", "loads", "scan_status", "verify_status", "codes"), [(c, *v) for c, v in TABLE.items()]
)
def test_megatron_core_load_and_ckpt_audit_agree(mcore, case, loads, scan_status, verify_status, codes):
    verdict = json.loads((mcore / "verdicts.json").read_text())[case]
    assert verdict.startswith(loads), verdict
    run = _run(mcore, case)
    scanned = scan.scan([run], in_progress_window_s=0)
    verified = verify([run], in_progress_window_s=0)
    assert [c.status.value for c in scanned.runs[0].checkpoints] == [scan_status]
    assert [c.status.value for c in verified.runs[0].checkpoints] == [verify_status]
    found = {f.code for f in verified.all_findings}
    assert set(codes) <= found, sorted(found)
    # the agreement: megatron-core restores exactly what was saved iff verify calls the run resumable
    assert _resumable(verified) == (verdict == "loads"), (verdict, sorted(found))


def test_real_megatron_tree_has_model_state(mcore):
    """megatron-core names model state decoder.* / embedding.* / output_layer.*, never model.*: not 'missing'."""
    found = verify([_run(mcore, "intact")], in_progress_window_s=0).all_findings
    assert [f for f in found if f.code == "megatron-model-missing"] == []
    # the one word on it: verl >= 0.9.1 wants it migrated first (this is the pre-v2 layout; test_megatron_v2.py)
    assert [f.code for f in found] == ["megatron-old-layout"]


@pytest.fixture
def intact_copy(mcore, tmp_path) -> Path:
    dst = tmp_path / "exp"
    shutil.copytree(_run(mcore, "integrity-ok"), dst)
    return dst


def _integrity(run: Path) -> Path:
    return run / STEP / "actor" / "dist_ckpt" / "integrity.json"


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        ("listed-file-gone", "megatron-integrity-file-missing"),
        ("not-json", "megatron-integrity-invalid"),
        ("md5", "megatron-integrity-invalid"),
    ],
)
def test_integrity_manifest_problems(intact_copy, edit, code):
    path = _integrity(intact_copy)
    doc = json.loads(path.read_text())
    if edit == "listed-file-gone":
        doc["files"]["__7_0.distcp"] = "0" * 64
        path.write_text(json.dumps(doc))
    elif edit == "not-json":
        path.write_text("{")
    else:
        doc["algorithm"] = "md5"
        path.write_text(json.dumps(doc))
    result = verify([intact_copy], in_progress_window_s=0)
    [f] = [f for f in result.all_findings if f.code == code]
    assert f.path.startswith(str(path.parent))
    assert result.runs[0].checkpoints[0].status.value != "complete"


def test_export_refusal_says_what_is_needed(mcore, tmp_path):
    """The real tree's config names no HF architecture (model_type "gpt"): export refuses and names the ones it
    maps (tests/test_export_megatron.py exports real HF-shaped models)."""
    with pytest.raises(ExportError) as err:
        export_checkpoint(_run(mcore, "intact") / STEP, tmp_path / "hf", allow_unverified=True)
    msg = str(err.value)
    assert "model_type 'gpt' is not supported" in msg and "qwen3_moe" in msg
    assert not (tmp_path / "hf").exists()


def _verified(mcore: Path, case: str):
    return verify([_run(mcore, case)], in_progress_window_s=0).all_findings


def test_bitflip_named_by_file_rank_and_tensor(mcore):
    """The flipped bit lies in the largest embedding chunk: the finding names its .distcp, rank and tensor."""
    [f] = [f for f in _verified(mcore, "distcp-bitflip") if f.code == "distcp-crc-mismatch" and f.tensor]
    assert f.tensor == "embedding.word_embeddings.weight" and f.path.endswith(".distcp") and f.rank in (0, 1)


def test_damaged_item_directory(mcore):
    found = [f for f in _verified(mcore, "distcp-zip-damaged") if f.code == "distcp-item-invalid"]
    [f] = [f for f in found if f.tensor is not None]  # verify names the item; the scan named the file (tensor None)
    assert f.tensor.startswith("optimizer.") and "end-of-central-directory" in f.message
    assert [g.tensor for g in found if g is not f] == [None]


def test_integrity_mismatch_names_the_changed_file(mcore):
    [f] = [f for f in _verified(mcore, "integrity-mismatch") if f.code == "megatron-integrity-mismatch"]
    assert f.path.endswith(".distcp")


def test_cli_scan_then_verify_on_a_flipped_bit(mcore, tmp_path):
    """The cron scan finds a bit flipped inside a .distcp (each item's zip CRCs, walked in its one read of the file)
    and names the file and item; verify, through the real CLI, names the tensor too. Both exit 1."""
    run = tmp_path / "exp"
    shutil.copytree(_run(mcore, "distcp-bitflip"), run)
    found = {}
    for command in ("scan", "verify"):
        out = ckpt_audit(command, "--json", run, catalog=tmp_path / "c.db")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-500:]
        [comp] = json.loads(out.stdout)["runs"][0]["checkpoints"][0]["components"]
        found[command] = [f for f in comp["findings"] if f["code"] == "distcp-crc-mismatch"]
    [f] = found["scan"]
    assert f["path"].endswith(".distcp") and "item(s) at byte" in f["message"] and f["tensor"] is None
    assert {g["tensor"] for g in found["verify"]} == {None, "embedding.word_embeddings.weight"}
