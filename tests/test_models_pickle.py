"""The frozen slotted dataclasses a Ray node sends back pickle as (class, field values) (models.reduce_as_tuple):
each round-trips with every field set, stays equal, hashable and frozen, and no longer goes through the standard
library's slotted-dataclass `__setstate__` (the driver's unpickle cost, bench/README)."""

from __future__ import annotations

import dataclasses
import pickle
import pickletools
import subprocess
import sys

import pytest

from ckpt_audit.models import Checkpoint, DcpFacts, FileFacts, Finding, PtFacts, Run, RunSummary, Severity, Status
from ckpt_audit.tree import Partial, Tree

FINDING = Finding(
    severity=Severity.ERROR, code="missing-rank", path="/c/s", message="rank 3 missing", rank=3, tensor="w"
)
PT = PtFacts(
    prefix="model_world_size_8_rank_0",
    n_tensors=4,
    n_dtensors=2,
    mesh_sizes=(8, 2),
    top_keys=("a", "b"),
    meta=(("ds_version", "0.19.8"), ("zero_stage", 2)),
)
DCP = DcpFacts(file_ends=(("__0_0.distcp", 128), ("__1_0.distcp", 64)), key_roots=("model", "optimizer"))
FACTS = FileFacts(
    path="/c/p/e/global_step_2/actor/model_world_size_8_rank_0.pt",
    size_bytes=1 << 20,
    mtime_ns=5,
    inode=7,
    hash="ab" * 16,
    crc_ok=False,
    pt=PT,
    text='{"a": 1}',
    findings=(FINDING, dataclasses.replace(FINDING, rank=None, tensor=None)),
    reused=True,
    verified_ns=9,
    dcp=DCP,
    tensors=("model.embed_tokens.weight", "lm_head.weight"),
    checksums=(("crc32c", "bIkWNQ=="), ("crc64nvme", "RXy0lWEYIi8=")),
)
TREE = Tree(
    dirs={"/c": ("p",), "/c/p": ()},
    files={"/c/p": ("x.pt", "y.pt")},
    dir_mtime_ns={"/c": 1, "/c/p": 2},
    links={"/c/p/l": "/c/p/x.pt"},
)
RUN = Run(path="/c/r", layout="verl-fsdp", findings=(FINDING,))
PARTIAL = Partial(
    root="/c",
    tree=TREE,
    facts={FACTS.path: FACTS},
    findings=(FINDING,),
    files_hashed=1,
    files_reused=2,
    bytes_hashed=3,
    reused_paths=frozenset({FACTS.path}),
    files_scrubbed=4,
    bytes_scrubbed=5,
    run_digests={"/c/r": "d" * 32},
    reused_runs={"/c/r": ("k" * 32, RunSummary.of(RUN))},
    kept_models={"/c/r": RUN},
    kept_reread=frozenset({FACTS.path}),
    reused_rows={FACTS.path: (1, 2, 3, "h" * 32, True, 4)},
    owners={"/c/r": "verl-fsdp"},
)
ALL = [FINDING, PT, DCP, FACTS, TREE, PARTIAL]


@pytest.mark.parametrize("obj", ALL, ids=lambda o: type(o).__name__)
def test_round_trip_with_every_field_set(obj: object) -> None:
    for f in dataclasses.fields(obj):  # a field left at its default would not show its slot is carried
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(obj, f.name) != default, f.name
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(obj, protocol=protocol))
        assert type(back) is type(obj)
        assert back == obj
        assert dataclasses.astuple(back) == dataclasses.astuple(obj)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(back, dataclasses.fields(back)[0].name, None)


def test_none_fields_round_trip() -> None:
    bare = FileFacts(path="/c/x", size_bytes=0, mtime_ns=0, inode=0)
    back = pickle.loads(pickle.dumps(bare))
    assert back == bare and back.pt is None and back.hash is None and back.findings == ()


def test_file_facts_pickle_is_class_and_values_and_hashes_equal() -> None:
    data = pickle.dumps(FACTS)
    back = pickle.loads(data)
    assert back == FACTS and hash(back) == hash(FACTS) and hash(back.pt) == hash(PT)
    ops = [op.name for op, _, _ in pickletools.genops(data)]
    # the stdlib form is NEWOBJ + BUILD (its __setstate__, fields() per object); ours is one REDUCE per object
    assert "BUILD" not in ops and "NEWOBJ" not in ops
    assert ops.count("REDUCE") == 6  # FileFacts, PtFacts, DcpFacts, two Findings, Severity
    assert b"from_slots" in data


def test_the_judged_model_pickles_by_name() -> None:
    ckpt = Checkpoint(run_path="/c/r", step=1, path="/c/r/global_step_1", status=Status.COMPLETE)
    run = Run(path="/c/r", layout="verl-fsdp", checkpoints=(ckpt,))
    data = pickle.dumps(run)
    assert b"ckpt_audit.models" in data and b"Run" in data
    back = pickle.loads(data)
    assert type(back) is Run and back == run and back.latest_complete == ckpt
