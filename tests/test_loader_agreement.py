"""The scan's verdict is what the framework's load does: safetensors headers against their files, a sharded index
against its shards, torchtitan steps without a model, and hostile JSON that must cost one finding, not the command.

Every attack is one change on a copy of a tree written by the library itself (transformers' Trainer, torchtitan's
checkpointer), judged through the real CLI; where the library can be asked, the test asks it what its load does.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cli_json import age, codes_of, findings_of, invoke, scan_json, statuses
from cli_proc import ckpt_audit
from test_hf_trainer import hf_run  # noqa: F401 - the session fixture: a real Trainer run, cached
from test_torchtitan import titan_dump  # noqa: F401 - the session fixture: torchtitan's checkpointer, cached

SHARD = "model-00001-of-00003.safetensors"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def out(hf_run, tmp_path) -> Path:  # noqa: F811 - hf_run is the imported session fixture
    dst = tmp_path / "runs" / "out"
    shutil.copytree(hf_run, dst)
    age(dst)
    return dst


def split(path: Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n], raw[8 + n :]


def write(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    age(path.parent.parent)


def safetensors_loads(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                f.get_tensor(k)
    except Exception:  # noqa: BLE001 - whatever safetensors raises, it did not load
        return False
    return True


def assert_latest_passes_over_6(out: Path, catalog: Path) -> None:
    res = invoke("latest", str(out), catalog=catalog)
    assert res.exit_code == 0 and res.stdout.strip() == str(out / "checkpoint-4"), res.output


# -- safetensors headers against the file ----------------------------------------------------------------------


@pytest.mark.slow
def test_one_offset_digit_flipped_is_corrupt_as_safetensors_refuses_it(out, tmp_path):
    shard = out / "checkpoint-6" / SHARD
    header, data = split(shard)
    doc = json.loads(header)
    name = sorted(k for k in doc if k != "__metadata__")[1]
    b, e = doc[name]["data_offsets"]
    flipped = header.replace(f"[{b},{e}]".encode(), f"[{b},{e + 1}]".encode(), 1)  # one digit, still JSON
    assert flipped != header
    write(shard, flipped, data)
    assert not safetensors_loads(shard)  # the library's own verdict
    doc = scan_json(out.parent, tmp_path / "c.db")
    assert statuses(doc)[6] == "corrupt"
    assert "safetensors-offsets" in codes_of(doc, 6)
    assert_latest_passes_over_6(out, tmp_path / "c.db")


@pytest.mark.slow
def test_header_nested_100k_deep_is_one_finding_for_scan_latest_and_prune(out, tmp_path):
    shard = out / "checkpoint-6" / SHARD
    _, data = split(shard)
    write(shard, b"[" * 100_000 + b"]" * 100_000, data)
    assert not safetensors_loads(shard)
    doc = scan_json(out.parent, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "corrupt"}
    [bad] = [f for f in findings_of(doc, 6) if f["code"] == "safetensors-header-invalid"]
    assert "nested" in bad["message"]
    assert_latest_passes_over_6(out, tmp_path / "c.db")
    res = invoke("prune", "--keep-last", "1", "--dry-run", str(out.parent), catalog=tmp_path / "c.db")
    assert res.exit_code in (0, 1) and "Traceback" not in res.output, res.output


# -- a sharded index against its shards ------------------------------------------------------------------------


def transformers_missing_keys(folder: Path) -> list[str]:
    """What transformers' own load of `folder` leaves at random init (its loading info's missing keys)."""
    from transformers import GPT2LMHeadModel

    _, info = GPT2LMHeadModel.from_pretrained(str(folder), output_loading_info=True)
    return info["missing_keys"]


@pytest.mark.slow
def test_an_index_that_no_longer_names_a_shard_is_corrupt_after_a_clean_scan(out, tmp_path):
    assert statuses(scan_json(out.parent, tmp_path / "c.db")) == {2: "complete", 4: "complete", 6: "complete"}
    index = out / "checkpoint-6" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    dropped = "model-00002-of-00003.safetensors"
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if v != dropped}
    index.write_text(json.dumps(doc, indent=2))
    age(out)
    assert transformers_missing_keys(out / "checkpoint-6")  # it loads the rest: those weights are random
    doc = scan_json(out.parent, tmp_path / "c.db")  # the shards' rows reused from the catalog, their headers re-read
    assert statuses(doc)[6] == "corrupt"
    [bad] = [f for f in findings_of(doc, 6) if f["code"] == "hf-index-mismatch"]
    assert bad["path"].endswith(dropped)
    assert_latest_passes_over_6(out, tmp_path / "c.db")


@pytest.mark.slow
def test_a_shard_rewritten_without_a_tensor_the_index_names_is_corrupt(out, tmp_path):
    shard = out / "checkpoint-6" / "model-00003-of-00003.safetensors"
    header, data = split(shard)
    doc = json.loads(header)
    last = max((k for k in doc if k != "__metadata__"), key=lambda k: doc[k]["data_offsets"][1])
    cut = doc.pop(last)["data_offsets"][0]
    write(shard, json.dumps(doc, separators=(",", ":")).encode(), data[:cut])  # a valid file, one tensor short
    assert safetensors_loads(shard)
    assert last in transformers_missing_keys(out / "checkpoint-6")
    doc = scan_json(out.parent, tmp_path / "c.db")
    assert statuses(doc)[6] == "corrupt"
    [bad] = [f for f in findings_of(doc, 6) if f["code"] == "hf-index-mismatch"]
    assert bad["path"].endswith("model.safetensors.index.json") and last in bad["message"]


# -- a torchtitan step without the model -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_torchtitan_step_saved_without_model_keys_is_incomplete(titan_dump, tmp_path):  # noqa: F811
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    dump = tmp_path / "runs" / "dump"
    shutil.copytree(titan_dump, dump)
    ckpts = dump / "checkpoint"
    # step-4: everything torchtitan saves but the model, written by DCP itself from step-2's own state
    rest = _load_state_dict_from_keys(
        keys={"optimizer", "lr_scheduler", "dataloader", "train_state"}, checkpoint_id=str(ckpts / "step-2")
    )
    dcp.save(rest, checkpoint_id=str(ckpts / "step-4"))
    model = _load_state_dict_from_keys(keys={"tok_embeddings.weight"}, checkpoint_id=str(ckpts / "step-2"))
    with pytest.raises(CheckpointException) as failed:  # what torchtitan's restart does with step-4
        dcp.load(model, checkpoint_id=str(ckpts / "step-4"))
    assert "Missing key" in repr(failed.value.failures)
    age(dump)
    doc = scan_json(ckpts, tmp_path / "c.db")
    assert statuses(doc)[4] == "incomplete"
    assert "dcp-no-model" in codes_of(doc, 4)
    [run] = doc["runs"]
    assert "torchtitan-resume-broken" in {f["code"] for f in run["findings"]}
    res = invoke("latest", str(ckpts), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(ckpts / "step-2"), res.output


# -- hostile JSON is one finding on its file -------------------------------------------------------------------

DEEP = "[" * 30_000 + "]" * 30_000  # 60 KB: within the scan's 64 KiB text read; RecursionError in json.loads


@pytest.mark.slow
def test_a_deeply_nested_fsdp_config_is_one_finding_not_the_end_of_the_scan(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    (run / "global_step_4" / "actor" / "fsdp_config.json").write_text(DEEP)
    doc = scan_json(run.parent.parent, tmp_path / "c.db")
    [bad] = [f for f in findings_of(doc, 4) if f["code"] == "fsdp-config-invalid"]
    assert "nested" in bad["message"]
    assert statuses(doc)[6] == "complete"  # the rest of the root judged as before
    res = invoke("latest", str(run), catalog=tmp_path / "c.db")
    assert res.exit_code == 0 and res.stdout.strip() == str(run / "global_step_6"), res.output


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "code"),
    [("trainer_state.json", "hf-trainer-state-invalid"), ("model.safetensors.index.json", "hf-index-invalid")],
)
def test_a_deeply_nested_trainer_json_is_invalid_not_the_end_of_the_scan(out, tmp_path, name, code):
    (out / "checkpoint-6" / name).write_text(DEEP)
    age(out)
    doc = scan_json(out.parent, tmp_path / "c.db")
    assert statuses(doc) == {2: "complete", 4: "complete", 6: "corrupt"}
    assert code in codes_of(doc, 6)
    assert_latest_passes_over_6(out, tmp_path / "c.db")


# -- a non-ASCII root in the C locale --------------------------------------------------------------------------


def cli_c_locale(*args: str, catalog: Path) -> subprocess.CompletedProcess:
    """The real CLI in a child whose locale is C and whose Python is told not to use UTF-8 mode (an ASCII file
    system encoding: every non-ASCII byte of a name decodes to an escape)."""
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONPATH": str(REPO)}
    return ckpt_audit(*args, "--catalog", catalog, env=env, text=False)


@pytest.mark.slow
def test_scan_ls_latest_and_prune_work_under_a_non_ascii_root_in_the_c_locale(hf_run, tmp_path):  # noqa: F811
    root = tmp_path / "läufe"
    shutil.copytree(hf_run, root / "out")
    age(root)
    cat = tmp_path / "c.db"
    for args in (("scan", str(root)), ("ls", str(root / "out")), ("prune", "--keep-last", "1", "--dry-run", str(root))):
        res = cli_c_locale(*args, catalog=cat)
        assert res.returncode == 0, res.stderr.decode(errors="replace")
        assert b"Traceback" not in res.stderr
    res = cli_c_locale("latest", str(root / "out"), catalog=cat)
    assert res.returncode == 0 and res.stdout.decode().strip() == str(root / "out" / "checkpoint-6")


@pytest.mark.slow
def test_a_root_whose_name_is_not_utf8_is_a_one_line_usage_error(hf_run, tmp_path):  # noqa: F811
    root = os.path.join(os.fsencode(tmp_path), b"r\xfcns")  # Latin-1 bytes: no UTF-8 text names it
    shutil.copytree(os.fsencode(hf_run), os.path.join(root, b"out"))
    cat = tmp_path / "c.db"
    for args in (("scan",), ("latest",), ("prune", "--keep-last", "1", "--dry-run")):
        res = cli_c_locale(*args, os.fsdecode(root), catalog=cat)
        assert res.returncode == 2 and b"Traceback" not in res.stderr
        assert b"r\\xfcns is not valid UTF-8" in res.stderr
    assert not cat.exists()


@pytest.mark.slow
def test_a_header_row_the_catalog_vouches_for_is_judged_by_todays_header_rules(out, tmp_path):
    """A shard catalogued clean (as under a release whose scan checked only the header's end) keeps its stat; the
    next scan that reuses its row reads and checks its header again, so the digit flipped in it is found."""
    cat = tmp_path / "c.db"
    assert statuses(scan_json(out.parent, cat))[6] == "complete"
    shard = out / "checkpoint-6" / SHARD
    st = shard.stat()
    header, data = split(shard)
    b, e = json.loads(header)[sorted(json.loads(header))[1]]["data_offsets"]
    flipped = header.replace(f"[{b},{e}]".encode(), f"[{b},{e + 1}]".encode(), 1)
    assert len(flipped) == len(header)
    with open(shard, "r+b") as f:  # in place: same inode, same size; the mtime put back
        f.write(struct.pack("<Q", len(flipped)) + flipped)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not safetensors_loads(shard)
    assert_latest_passes_over_6(out, cat)  # latest's scan reuses every row by stat
