"""The fast row builders (models.from_slots) pass field values by position, in slot order: a reordered dataclass
would put a size where an mtime goes, silently. Each builder here is checked against the class called by keyword
with every field set to a distinct value, and the field order they rely on is pinned, so a reorder fails loudly."""

from __future__ import annotations

import dataclasses

import pytest

from ckpt_audit.catalog.manifest import facts_of_rows, findings_to_json
from ckpt_audit.catalog.verdicts import run_from_json, run_to_json
from ckpt_audit.layouts import shard_file
from ckpt_audit.models import (
    Checkpoint,
    Component,
    FileFacts,
    FileKind,
    Finding,
    Severity,
    ShardFile,
    Status,
    from_slots,
)
from ckpt_audit.models import Run as RunModel
from ckpt_audit.scan.verdicts import light_facts

# what the positional builders are written against: change one only with every builder named in the message
PINNED = {
    FileFacts: (
        ("path", "size_bytes", "mtime_ns", "inode", "hash", "crc_ok", "pt", "text", "findings", "reused")
        + ("verified_ns", "dcp", "tensors", "checksums")
    ),
    ShardFile: ("path", "kind", "size_bytes", "mtime_ns", "inode", "rank", "world_size", "hash", "crc_ok"),
    Finding: ("severity", "code", "path", "message", "rank", "tensor"),
    Component: ("role", "path", "layout", "world_size", "files", "findings"),
    Checkpoint: ("run_path", "step", "path", "status", "components", "files", "findings", "mtime_ns"),
    RunModel: ("path", "layout", "tracker_step", "checkpoints", "findings", "metrics_path"),
}


@pytest.mark.parametrize("cls", PINNED, ids=lambda c: c.__name__)
def test_the_field_order_the_row_builders_rely_on(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))
    assert names == PINNED[cls], (
        f"{cls.__name__}'s fields moved: update the positional builders (layouts.shard_file, "
        "catalog.manifest.facts_of_rows, catalog.verdicts, scan.verdicts.light_facts), then PINNED"
    )
    assert cls.__slots__ == names  # from_slots fills slots in this order


FINDING = Finding(severity=Severity.WARNING, code="missing-rank", path="/r/s/f", message="m", rank=3, tensor="w")
FACTS = FileFacts(path="/r/s/a/model_world_size_2_rank_1.pt", size_bytes=11, mtime_ns=22, inode=33, hash="h" * 32)


def test_shard_file_is_the_class_called_by_keyword() -> None:
    facts = dataclasses.replace(FACTS, crc_ok=False)
    got = shard_file(facts, FileKind.MODEL, 1, 2)
    want = ShardFile(
        path=facts.path, kind=FileKind.MODEL, size_bytes=11, mtime_ns=22, inode=33, rank=1, world_size=2,
        hash="h" * 32, crc_ok=False,
    )  # fmt: skip
    assert got == want and type(got) is ShardFile


def test_a_catalog_row_is_the_facts_called_by_keyword() -> None:
    row = ("/r/f.pt", 11, 22, 33, "h" * 32, 1, findings_to_json((FINDING,)), None, 44, None, "crc32c=AbCd")
    got = facts_of_rows([row])["/r/f.pt"]
    want = FileFacts(
        path="/r/f.pt", size_bytes=11, mtime_ns=22, inode=33, hash="h" * 32, crc_ok=True, findings=(FINDING,),
        verified_ns=44, checksums=(("crc32c", "AbCd"),),
    )  # fmt: skip
    assert got == want


def test_a_verdict_cache_row_is_the_facts_called_by_keyword() -> None:
    got = light_facts("/r/f.pt", (11, 22, 33, "h" * 32, 0, 44))
    want = FileFacts(
        path="/r/f.pt", size_bytes=11, mtime_ns=22, inode=33, hash="h" * 32, crc_ok=False, reused=True,
        verified_ns=44,
    )  # fmt: skip
    assert got == want


def test_a_cached_run_decodes_to_the_run_it_encoded() -> None:
    sf = ShardFile(
        path="/r/s/a/f", kind=FileKind.OPTIM, size_bytes=1, mtime_ns=2, inode=3, rank=4, world_size=5, hash="x",
        crc_ok=True,
    )  # fmt: skip
    comp = Component(role="actor", path="/r/s/a", layout="verl-fsdp", world_size=5, files=(sf,), findings=(FINDING,))
    ckpt = Checkpoint(
        run_path="/r", step=7, path="/r/s", status=Status.UNCOMMITTED, components=(comp,), files=(sf,),
        findings=(FINDING,), mtime_ns=8,
    )  # fmt: skip
    run = RunModel(path="/r", layout="verl-fsdp", tracker_step=6, checkpoints=(ckpt,), findings=(FINDING,))
    run = dataclasses.replace(run, metrics_path="/r/m.jsonl")
    back = run_from_json(run_to_json(run))
    assert back == run and type(back.checkpoints[0].components[0].files[0]) is ShardFile


def test_from_slots_refuses_a_class_it_cannot_rebuild() -> None:
    class Plain:
        pass

    with pytest.raises(TypeError):
        from_slots(Plain, ())
