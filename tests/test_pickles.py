"""read_pt_structure / restricted_load on real torch.save files (plain, optimizer, DTensor from a real gloo group,
DCP metadata), one defect per test, and hostile pickles that must not execute."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_audit.readers.problem import Problem
from ckpt_audit.readers.pt import read_pt_structure
from ckpt_audit.readers.unpickler import Stub, global_name, is_record, restricted_load, restricted_load_ex

WORLD = 2
HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def dtensor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real DTensor shards written by a 2-process gloo group, with the truth read from the live objects."""
    d = tmp_path_factory.mktemp("dtensor")
    subprocess.run(
        [sys.executable, str(HERE / "_write_dtensors.py"), str(d), str(WORLD)],
        check=True,
        timeout=240,
        capture_output=True,
    )
    return d


@pytest.fixture(scope="session")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plain")
    g = torch.Generator().manual_seed(1)
    base = torch.randn(10, 6, generator=g)
    torch.save(
        {
            "model.embed_tokens.weight": torch.randn(50, 8, generator=g),
            "model.norm.weight": torch.ones(8).bfloat16(),
            "view": base[2:5, 1:4],
            "transposed": base.t(),
            "ids": torch.arange(7, dtype=torch.int32),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
            "u16": torch.zeros(3, dtype=torch.uint16),
            "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        },
        d / "model_world_size_1_rank_0.pt",
    )
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 6, generator=g)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), d / "optim_world_size_1_rank_0.pt")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    torch.save(
        {
            "lr_scheduler": sched.state_dict(),
            "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
        },
        d / "extra_state_world_size_1_rank_0.pt",
    )
    torch.save({"w": torch.randn(5, generator=g)}, d / "small.pt")
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.randn(5, generator=g)}, d / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    return d


def _rewrite_zip(src: Path, dst: Path, edit) -> Path:
    """Copy a .pt zip entry by entry (stored, as torch writes), letting `edit(name, data)` change or drop entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
    return dst


def _by_key(path: Path) -> dict:
    return {t.key: t for t in read_pt_structure(path).tensors}


def test_plain_shapes_dtypes_strides_match_torch_load(plain_dir: Path) -> None:
    p = plain_dir / "model_world_size_1_rank_0.pt"
    s = read_pt_structure(p)
    ref = torch.load(p, weights_only=True, map_location="cpu", mmap=True)
    got = {t.key: t for t in s.tensors}
    assert set(got) == set(ref)
    for k, v in ref.items():
        t = got[k]
        assert (t.dtype, t.shape, t.stride, t.storage_offset) == (
            str(v.dtype).removeprefix("torch."),
            tuple(v.shape),
            v.stride(),
            v.storage_offset(),
        ), k
        assert t.device == "cpu" and not t.is_dtensor
    assert got["param"].is_parameter and got["param"].requires_grad
    assert s.prefix == "model_world_size_1_rank_0"
    assert s.keys == tuple(ref)
    assert s.problems == () and s.unsafe_globals == frozenset()
    assert got["view"].storage_key == got["transposed"].storage_key  # one storage, two views


def test_optimizer_state_key_paths_match_torch_load(plain_dir: Path) -> None:
    p = plain_dir / "optim_world_size_1_rank_0.pt"
    s = read_pt_structure(p)
    ref = torch.load(p, weights_only=True, map_location="cpu")
    want = {
        ("state", i, n): (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for i, st in ref["state"].items()
        for n, t in st.items()
    }
    assert {t.key_path: (t.shape, t.dtype) for t in s.tensors} == want
    assert s.tensor("state.0.exp_avg") is not None
    assert s.keys == ("state", "param_groups")
    assert s.tree["param_groups"][0]["lr"] == ref["param_groups"][0]["lr"]
    assert s.tree["param_groups"][0]["params"] == ref["param_groups"][0]["params"]
    assert s.problems == ()


def test_extra_state_with_numpy_rng_reads_without_unsafe_globals(plain_dir: Path) -> None:
    s = read_pt_structure(plain_dir / "extra_state_world_size_1_rank_0.pt")
    assert s.tree["lr_scheduler"]["last_epoch"] == 0
    assert s.tensor("rng.cpu").dtype == "uint8" and s.tensor("rng.cpu").shape == (5056,)
    assert (
        "numpy._core.multiarray._reconstruct" in s.globals_seen
        or "numpy.core.multiarray._reconstruct" in s.globals_seen
    )
    assert s.unsafe_globals == frozenset() and s.problems == ()


def test_crc_disabled_file_reads_normally(plain_dir: Path) -> None:
    s = read_pt_structure(plain_dir / "nocrc.pt")
    assert [(t.key, t.shape) for t in s.tensors] == [("w", (5,))]


@pytest.mark.parametrize("rank", range(WORLD))
def test_dtensor_shards_match_the_live_dtensors(dtensor_dir: Path, rank: int) -> None:
    truth = json.loads((dtensor_dir / f"truth_rank_{rank}.json").read_text())
    assert len(truth) == 3
    for fname, want in truth.items():
        s = read_pt_structure(dtensor_dir / fname)
        assert s.problems == () and s.unsafe_globals == frozenset(), fname
        got = {t.key: t for t in s.tensors}
        assert set(got) == set(want), fname
        for key, w in want.items():
            t = got[key]
            assert (t.dtype, list(t.shape), t.device) == (w["dtype"], w["local"], w["device"]), (fname, key)
            assert t.is_dtensor == ("global" in w)
            if t.is_dtensor:
                assert list(t.global_shape) == w["global"]
                assert list(t.placements) == [p.replace("dim=", "") for p in w["placements"]]
                assert list(t.mesh_shape) == w["mesh_shape"]
                assert list(t.mesh_dim_names) == w["mesh_dim_names"]
                assert list(t.mesh_ranks) == w["mesh_ranks"]
                assert t.mesh_device_type == "cpu"


def test_dtensor_uneven_chunks_are_local_shapes(dtensor_dir: Path) -> None:
    # 37 rows over 2 ranks split 19/18 (torch.chunk), 12 columns 6/6: local != global, as verl's shards are.
    rows = [_by_key(dtensor_dir / f"model_world_size_{WORLD}_rank_{r}.pt")["rows.weight"] for r in range(WORLD)]
    assert [t.shape for t in rows] == [(19, 3), (18, 3)]
    assert {t.global_shape for t in rows} == {(37, 3)}
    hsdp = _by_key(dtensor_dir / f"model_world_size_{WORLD}_rank_0.pt")["hsdp.weight"]
    assert (hsdp.placements, hsdp.mesh_shape, hsdp.mesh_dim_names) == (
        ("Replicate()", "Shard(0)"),
        (1, 2),
        ("ddp", "fsdp"),
    )


def test_storage_larger_than_its_entry_is_a_problem(plain_dir: Path, tmp_path: Path) -> None:
    src = plain_dir / "model_world_size_1_rank_0.pt"
    key = _by_key(src)["model.embed_tokens.weight"].storage_key
    dst = _rewrite_zip(
        src, tmp_path / "model_world_size_1_rank_0.pt", lambda n, d: d[:100] if n.endswith(f"/data/{key}") else d
    )
    s = read_pt_structure(dst)
    assert any(
        p.code == "storage-size-mismatch"
        and p.message.startswith(f"storage {key} needs 1600 bytes")
        and p.message.endswith("holds 100")
        for p in s.problems
    ), s.problems


def test_missing_storage_entry_is_a_problem(plain_dir: Path, tmp_path: Path) -> None:
    src = plain_dir / "model_world_size_1_rank_0.pt"
    key = _by_key(src)["ids"].storage_key
    dst = _rewrite_zip(
        src, tmp_path / "model_world_size_1_rank_0.pt", lambda n, d: None if n.endswith(f"/data/{key}") else d
    )
    assert (
        Problem("storage-size-mismatch", f"storage {key} (7 x IntStorage) has no zip entry data/{key}")
        in read_pt_structure(dst).problems
    )


def test_missing_data_pkl_is_a_problem(plain_dir: Path, tmp_path: Path) -> None:
    dst = _rewrite_zip(
        plain_dir / "small.pt", tmp_path / "small.pt", lambda n, d: None if n.endswith("/data.pkl") else d
    )
    s = read_pt_structure(dst)
    assert any(p.code == "not-a-torch-archive" and "no data.pkl" in p.message for p in s.problems) and s.tensors == ()


def test_garbage_data_pkl_is_a_problem_not_a_crash(plain_dir: Path, tmp_path: Path) -> None:
    dst = _rewrite_zip(
        plain_dir / "small.pt", tmp_path / "small.pt", lambda n, d: os.urandom(200) if n.endswith("/data.pkl") else d
    )
    s = read_pt_structure(dst)
    assert len(s.problems) == 1 and s.problems[0].code == "bad-pickle"
    assert s.problems[0].message.startswith("data.pkl does not unpickle")


def test_truncated_and_not_a_zip_files_are_problems(plain_dir: Path, tmp_path: Path) -> None:
    raw = (plain_dir / "small.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "g.pt").write_bytes(b"garbage" * 50)
    truncated = read_pt_structure(tmp_path / "t.pt").problems[0]
    assert truncated.code == "truncated" and truncated.message.startswith("truncated")
    garbage = read_pt_structure(tmp_path / "g.pt").problems[0]
    assert garbage.code == "not-a-zip" and garbage.message.startswith("not a zip archive")


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvilExec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def _getattr_chain_pickle(marker: Path) -> bytes:
    # builtins.getattr(__import__('os'), 'system')('touch marker'), hand-assembled: a REDUCE on a REDUCE result.
    return (
        b"\x80\x02cbuiltins\ngetattr\n"
        b"cbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"  # __import__('os')
        b"X\x06\x00\x00\x00system\x86R"  # getattr(os, 'system')
        + b"X"
        + len(f"touch {marker}").to_bytes(4, "little")
        + f"touch {marker}".encode()
        + b"\x85R."
    )


@pytest.mark.parametrize("protocol", [2, 4])  # GLOBAL (2) and STACK_GLOBAL/memoize (4)
def test_malicious_pt_executes_nothing(plain_dir: Path, tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Evil(marker), "x": _EvilExec(marker)}, protocol=protocol)
    dst = _rewrite_zip(
        plain_dir / "small.pt", tmp_path / "small.pt", lambda n, d: payload if n.endswith("/data.pkl") else d
    )
    s = read_pt_structure(dst)
    assert not marker.exists()
    exec_name = "__builtin__.exec" if protocol < 3 else "builtins.exec"  # protocol 2 maps names to Python 2's
    assert {"posix.system", exec_name} <= s.unsafe_globals
    rec = s.tree["w"]
    assert is_record(rec, "posix.system") and rec.args == (f"touch {marker}",)


def test_restricted_load_does_not_follow_getattr_chains(tmp_path: Path) -> None:
    marker = tmp_path / "pwned2"
    out = restricted_load_ex(_getattr_chain_pickle(marker))
    assert not marker.exists()
    assert out.globals_seen == {"builtins.getattr", "builtins.__import__"}
    assert isinstance(out.root, Stub) and isinstance(out.root.state["callee"], Stub)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_restricted_load_reads_dcp_metadata_fields(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.randn(4, 3), "b": torch.zeros(2)}, "step": 5}, checkpoint_id=str(ckpt))
    with open(ckpt / ".metadata", "rb") as f:
        meta = restricted_load(f)
    assert is_record(meta, "torch.distributed.checkpoint.metadata.Metadata")
    md = meta.state_dict_metadata
    assert set(md) == {"model.w", "model.b", "step"}
    w = md["model.w"]
    assert w.qualname.endswith("TensorStorageMetadata") and w.size == (4, 3)
    assert [c.sizes for c in w.chunks] == [(4, 3)] and [c.offsets for c in w.chunks] == [(0, 0)]
    assert global_name(w.properties.state[0]) == "torch.float32"
    assert md["step"].qualname.endswith("BytesStorageMetadata")
    files = {info.relative_path for info in meta.storage_data.values()}
    assert files == {p.name for p in ckpt.glob("*.distcp")}


def test_deeply_nested_and_self_referencing_pickles_stay_finite(plain_dir: Path, tmp_path: Path) -> None:
    deep = b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b"."  # 5000 nested lists, hand-assembled
    loop: dict = {}
    loop["self"] = loop
    cyclic = pickle.dumps({"loop": loop, "w": [1, 2]}, protocol=2)
    for name, payload in (("deep.pt", deep), ("cyclic.pt", cyclic)):
        _rewrite_zip(
            plain_dir / "small.pt", tmp_path / name, lambda n, d, p=payload: p if n.endswith("/data.pkl") else d
        )
    deep_s = read_pt_structure(tmp_path / "deep.pt")
    assert any("nests deeper than" in n for n in deep_s.notes) and deep_s.problems == ()  # cut short, no defect
    s = read_pt_structure(tmp_path / "cyclic.pt")
    assert s.tree["loop"]["self"] is None and s.tree["w"] == [1, 2]  # the cycle is cut, not followed
