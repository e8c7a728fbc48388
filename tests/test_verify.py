"""verify: each deep check on a real tree (real gloo FSDP2 / DCP saves) broken in exactly that property.

Trees come from harness/dcp_tree.py (conftest's cached `dcp_trees`: one multi-process gloo run per session); the
FSDP2 run is the harness's `verl_run` from tests/conftest.py. Shards are broken by loading them with
weights_only=True, changing one thing and torch.save-ing them back under the same name.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from cli_proc import ckpt_audit
from forked_cli import ForkedCli

from ckpt_audit.deep import dcp_check, safe_load
from ckpt_audit.models import Status
from ckpt_audit.verify import verify


@pytest.fixture(scope="session")
def trees(dcp_trees) -> dict[str, Path]:
    return dcp_trees  # tests/conftest.py: one cached gloo run per session, shared with the scan and gate tests


@pytest.fixture(scope="session")
def fsdp_src(verl_run) -> Path:
    return Path(verl_run)


@pytest.fixture
def run(fsdp_src, tmp_path) -> Path:
    dst = tmp_path / "root" / "demo" / "exp"
    shutil.copytree(fsdp_src, dst)
    return dst


def latest(run: Path) -> Path:
    return max(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))


def actor(run: Path) -> Path:
    return latest(run) / "actor"


def shard(run: Path, kind: str, rank: int) -> Path:
    return next(actor(run).glob(f"{kind}_world_size_*_rank_{rank}.pt"))


def rewrite(path: Path, change) -> None:
    """Load with weights_only (the numpy RNG globals allowed), change, save back under the same stem."""
    value = safe_load._torch_load(str(path))
    value = change(value) or value
    tmp = path.parent / ".rewrite"
    tmp.mkdir(exist_ok=True)
    torch.save(value, tmp / path.name)
    os.replace(tmp / path.name, path)
    tmp.rmdir()


def findings(root: Path, code: str | None = None):
    result = verify([root])
    every = [f for r in result.runs for c in r.checkpoints for f in c.all_findings] + list(result.findings)
    return [f for f in every if code is None or f.code == code], result


def one(root: Path, code: str, *, rank=None, tensor=None):
    found, _ = findings(root, code)
    match = [f for f in found if (rank is None or f.rank == rank) and (tensor is None or f.tensor == tensor)]
    assert match, f"no {code} rank={rank} tensor={tensor}; got {[(f.code, f.rank, f.tensor) for f in found]}"
    return match[0]


def first_dtensor_key(path: Path) -> str:
    sd = safe_load._torch_load(str(path))
    return next(k for k, v in sd.items() if hasattr(v, "placements") and v.shape[0] > 2)


# -- clean trees ----------------------------------------------------------------------------------------------


def test_clean_trees_verify_clean(trees, fsdp_src):
    for root in (fsdp_src, trees["megatron"], trees["dcp"].parent):
        found, result = findings(root)
        # the Megatron tree is in the pre-v2 layout: whole, with verl >= 0.9.1's call to migrate it (its one word)
        old = {"megatron-old-layout"} if root == trees["megatron"] else set()
        assert {f.code for f in found if f.severity > 0} == old, root
        assert result.deep
        assert all(c.status is Status.COMPLETE for r in result.runs for c in r.checkpoints)


def test_step_directory_is_verified_alone(run):
    step = latest(run)
    result = verify([step])
    assert result.roots == (str(step.resolve()),)
    assert [c.path for r in result.runs for c in r.checkpoints] == [str(step.resolve())]


# -- model shards ---------------------------------------------------------------------------------------------


def test_key_set_differs(run):
    key = first_dtensor_key(shard(run, "model", 1))
    rewrite(shard(run, "model", 1), lambda sd: {k: v for k, v in sd.items() if k != key})
    f = one(run, "rank-keys-differ", rank=1, tensor=key)
    assert "lacks 1 key" in f.message


def test_placements_differ_across_ranks(run):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    key = first_dtensor_key(shard(run, "model", 1))

    def change(sd):
        s = sd[key]._spec
        other = 1 if s.placements[0].dim == 0 else 0
        sd[key]._spec = DTensorSpec(s.mesh, (Shard(other),), tensor_meta=s.tensor_meta)
        return dict(sd)

    rewrite(shard(run, "model", 1), change)
    one(run, "placement-mismatch", rank=1, tensor=key)


def test_local_shape_does_not_tile_global(run):
    key = first_dtensor_key(shard(run, "model", 0))

    def change(sd):
        t = sd[key]
        t._local_tensor = torch.zeros(1, *t._local_tensor.shape[1:])
        return dict(sd)

    rewrite(shard(run, "model", 0), change)
    f = one(run, "shard-shape-mismatch", rank=0, tensor=key)
    assert "gives this rank" in f.message
    assert verify([run]).runs[0].checkpoints[-1].status is Status.CORRUPT


def test_mesh_disagrees_with_fsdp_config(run):
    cfg = actor(run) / "fsdp_config.json"
    doc = json.loads(cfg.read_text())
    doc["world_size"] = 4
    cfg.write_text(json.dumps(doc, indent=4))
    f = one(run, "mesh-config-mismatch", rank=0)
    assert f.tensor and "world_size 4" in f.message


def test_tied_embedding_missing(trees, tmp_path):
    run = tmp_path / "tied" / "exp"
    shutil.copytree(trees["verl"], run)  # the stand-in model ties its embeddings (Qwen2, tie_word_embeddings)
    cfg = json.loads((actor(run) / "huggingface" / "config.json").read_text())
    assert cfg["tie_word_embeddings"]  # else this test checks nothing: the trainer's model must tie them
    for r in (0, 1):
        rewrite(shard(run, "model", r), lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"})
    one(run, "tied-embedding-missing", rank=0, tensor="lm_head.weight")


def test_hsdp_replicas_identical_then_differ(verl_run_hsdp, tmp_path):
    run = tmp_path / "hsdp"
    shutil.copytree(verl_run_hsdp, run)
    assert findings(run, "hsdp-replica-differs")[0] == []
    path = shard(run, "model", 2)  # replica of rank 0 on a (ddp=2, fsdp=2) mesh
    key = first_dtensor_key(path)

    def change(sd):
        sd[key]._local_tensor = sd[key]._local_tensor.clone() + 1
        return dict(sd)

    rewrite(path, change)
    one(run, "hsdp-replica-differs", rank=2, tensor=key)


def _loader_state() -> dict:
    """A real single-process StatefulDataLoader state (what verl's data.pt holds with num_workers=0)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(list(range(8)), batch_size=2)
    next(iter(dl))
    return dl.state_dict()


def test_world_size_one_plain_tensors(tmp_path):
    """A W=1 checkpoint (FSDP1 NO_SHARD) holds plain tensors: verified clean, and its checks still run."""
    import random

    import numpy as np

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    a = tmp_path / "p" / "e" / "global_step_1" / "actor"
    a.mkdir(parents=True)
    torch.save(model.state_dict(), a / "model_world_size_1_rank_0.pt")
    torch.save(opt.state_dict(), a / "optim_world_size_1_rank_0.pt")
    torch.save(
        {
            "lr_scheduler": sched.state_dict(),
            "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
        },
        a / "extra_state_world_size_1_rank_0.pt",
    )
    (a / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 1}, indent=4))
    torch.save(_loader_state(), a.parent / "data.pt")
    (a.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
    found, result = findings(tmp_path / "p")
    assert [f for f in found if f.severity > 0] == []
    assert result.runs[0].checkpoints[0].status is Status.COMPLETE
    rewrite(a / "optim_world_size_1_rank_0.pt", lambda o: o["state"][0].update(exp_avg=torch.zeros(7, 2)))
    one(tmp_path / "p", "optimizer-state-mismatch", rank=0, tensor="0.weight")


# -- optimizer ------------------------------------------------------------------------------------------------


def test_optimizer_state_shape_differs_from_param(run):
    def change(o):
        st = o["state"][0]
        st["exp_avg"] = st["exp_avg"].to_local().clone()  # a plain tensor where the parameter is a DTensor
        return o

    rewrite(shard(run, "optim", 0), change)
    f = one(run, "optimizer-state-mismatch", rank=0)
    assert f.tensor in safe_load._torch_load(str(shard(run, "model", 0)))


def test_optimizer_param_count(run):
    def change(o):
        o["param_groups"][0]["params"] = o["param_groups"][0]["params"][:-1]
        return o

    rewrite(shard(run, "optim", 1), change)
    one(run, "optimizer-param-count", rank=1)


def test_optimizer_step_differs_across_ranks(run):
    def change(o):
        for st in o["state"].values():
            st["step"] = st["step"] + 3
        return o

    rewrite(shard(run, "optim", 1), change)
    f = one(run, "optimizer-step-differs", rank=1)
    assert f.tensor is not None


def test_param_groups_differ(run):
    def change(o):
        o["param_groups"][0]["lr"] = 0.5
        return o

    rewrite(shard(run, "optim", 1), change)
    f = one(run, "param-groups-differ", rank=1)
    assert "'lr'" in f.message


# -- extra state ----------------------------------------------------------------------------------------------


def test_lr_scheduler_differs_across_ranks(run):
    rewrite(
        shard(run, "extra_state", 1), lambda e: e["lr_scheduler"].update(last_epoch=e["lr_scheduler"]["last_epoch"] + 2)
    )
    one(run, "lr-scheduler-differs", rank=1)


def test_lr_scheduler_ahead_of_step(run):
    step = int(latest(run).name.rsplit("_", 1)[1])
    for r in (0, 1):
        rewrite(shard(run, "extra_state", r), lambda e: e["lr_scheduler"].update(last_epoch=step + 5))
    f = one(run, "lr-scheduler-ahead", rank=0)
    assert str(step + 5) in f.message


def test_lr_scheduler_missing(run):
    rewrite(shard(run, "extra_state", 0), lambda e: {k: v for k, v in e.items() if k != "lr_scheduler"})
    one(run, "lr-scheduler-missing", rank=0)


def test_rng_stream_missing(run):
    """verl's load_rng_state reads rng["numpy"] unconditionally: KeyError, so an error (not a warning)."""
    rewrite(shard(run, "extra_state", 1), lambda e: e["rng"].pop("numpy") and None)
    one(run, "extra-state-invalid", rank=1, tensor="numpy")


def test_rng_absent(run):
    """No rng entry at all: verl skips it (old checkpoints), the resume is just not reproducible."""
    rewrite(shard(run, "extra_state", 1), lambda e: e.pop("rng") and None)
    f = one(run, "rng-missing", rank=1)
    assert f.severity.name == "WARNING"


def test_dataloader_state_unreadable(run):
    torch.save({"not": "a dataloader"}, latest(run) / "data.pt")
    one(run, "dataloader-state-invalid")


# -- unsafe pickles -------------------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unsafe_pickle_is_never_executed(run, tmp_path):
    marker = tmp_path / "PWNED"
    target = shard(run, "model", 0)
    tmp = tmp_path / "plant"
    tmp.mkdir()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": _Payload(str(marker))}, tmp / target.name)
    os.replace(tmp / target.name, target)
    assert not marker.exists()
    res = safe_load.load(target)
    assert not res.loaded and res.findings[0].code == "unsafe-pickle"
    assert "posix.system" in res.findings[0].message or "os.system" in res.findings[0].message
    f = one(run, "unsafe-pickle")
    assert f.path == str(target.resolve()) or f.path == str(target)
    env = {"CKPT_AUDIT_CATALOG": str(tmp_path / "c.db")}
    root = str(run.parent.parent)
    step = str(latest(run))
    # each command in its own process, forked from one interpreter that imported torch once (tests/forked_cli.py)
    forked = ForkedCli(tmp_path, preload=("torch", "ckpt_audit.verify", "ckpt_audit.cli.verify"))
    for args in (
        ["scan", root],
        ["verify", root],
        ["verify", "--json", step],
        ["ls"],
        ["show", step],
        ["export", step, "--to", str(tmp_path / "out")],
    ):
        proc = forked(*args, env=env)
        assert proc.returncode in (0, 1, 3), (args, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr, (args, proc.stderr[-800:])
        assert not marker.exists(), f"{args} executed the payload"
    forked.close()


# -- Megatron dist_ckpt and plain DCP ---------------------------------------------------------------------------


@pytest.fixture
def megatron(trees, tmp_path) -> Path:
    dst = tmp_path / "m" / "megatron" / "exp"
    shutil.copytree(trees["megatron"], dst)
    return dst


def dist_ckpt(m: Path) -> Path:
    return m / "global_step_1" / "actor" / "dist_ckpt"


def test_megatron_recognised_by_scan(megatron):
    from ckpt_audit.scan import scan

    result = scan([megatron], in_progress_window_s=0)
    comp = result.runs[0].checkpoints[0].components[0]
    assert comp.layout == "verl-megatron" and comp.world_size == 2
    assert result.runs[0].checkpoints[0].status is Status.COMPLETE
    kinds = {f.kind.value for f in comp.files}
    assert {"dcp_metadata", "distcp", "common", "megatron_metadata", "huggingface"} <= kinds


def test_megatron_distcp_missing(megatron):
    (dist_ckpt(megatron) / "__1_1.distcp").unlink()
    one(megatron, "dcp-file-missing", rank=1)


def test_megatron_distcp_truncated(megatron):
    p = dist_ckpt(megatron) / "__0_0.distcp"
    os.truncate(p, p.stat().st_size // 2)
    f = one(megatron, "dcp-range-outside-file", rank=0)
    assert "truncated" in f.message  # found by the scan now (byte ranges from .metadata, torch-free): no tensor named
    deep = [g for g in dcp_check.check_dir(str(dist_ckpt(megatron))) if g.code == "dcp-range-outside-file"]
    assert deep and all(g.tensor for g in deep)  # verify's own check still names each tensor cut short


def test_megatron_metadata_json_missing(megatron):
    (dist_ckpt(megatron) / "metadata.json").unlink()
    one(megatron, "megatron-metadata-missing")


def test_megatron_backend_unknown(megatron):
    (dist_ckpt(megatron) / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr2"}))
    one(megatron, "megatron-backend-unknown")


def _rewrite_metadata(path: Path, change) -> None:
    import torch.distributed.checkpoint  # noqa: F401 - the test (trusted) unpickles the real classes

    with open(path, "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - our own test file
    change(meta)
    with open(path, "wb") as f:
        pickle.dump(meta, f)


def test_dcp_chunk_gap(trees, tmp_path):
    d = tmp_path / "d" / "checkpoint" / "step-1"
    shutil.copytree(trees["dcp"], d)
    fqn = "model.model.embed_tokens.weight"
    _rewrite_metadata(d / ".metadata", lambda m: m.state_dict_metadata[fqn].chunks.pop())
    one(d.parent, "dcp-chunk-gap", tensor=fqn)


def test_dcp_chunk_overlap(trees, tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    d = tmp_path / "d" / "checkpoint" / "step-1"
    shutil.copytree(trees["dcp"], d)
    fqn = "model.model.embed_tokens.weight"

    def change(m):
        chunks = m.state_dict_metadata[fqn].chunks
        c = chunks[0]
        bigger = list(c.sizes)
        bigger[-1] += 1
        chunks[0] = ChunkStorageMetadata(offsets=c.offsets, sizes=torch.Size(bigger))

    _rewrite_metadata(d / ".metadata", change)
    one(d.parent, "dcp-chunk-overlap", tensor=fqn)


def test_plain_dcp_metadata_missing_and_garbage(trees, tmp_path):
    d = tmp_path / "d" / "checkpoint" / "step-1"
    shutil.copytree(trees["dcp"], d)
    (d / ".metadata").write_bytes(b"\x80\x04garbage")
    one(d.parent, "dcp-metadata-invalid")


def test_safetensors_truncated_and_bad_header(megatron):
    st = megatron / "global_step_1" / "actor" / "huggingface" / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:-10])
    f = one(megatron, "safetensors-offsets")
    assert "truncated" in f.message
    st.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    one(megatron, "safetensors-header-invalid")


def test_safetensors_offsets_disagree_with_shape():
    from ckpt_audit.readers.safetensors_header import check_header

    header = {
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 30]},
    }
    found = check_header(header, data_size=30)
    assert [(f.code, f.tensor) for f in found] == [("safetensors-offsets", "b")]
    assert check_header({"a": header["a"]}, data_size=24) == ()


# -- CLI ------------------------------------------------------------------------------------------------------


def test_cli_verify_exit_codes_and_json(run, megatron, tmp_path):
    catalog = tmp_path / "c.db"
    ok = ckpt_audit("verify", "--json", megatron, catalog=catalog)
    assert ok.returncode == 0, ok.stderr[-500:]
    doc = json.loads(ok.stdout)
    assert doc["schema_version"] == 1 and doc["command"] == "verify" and doc["deep"] is True
    assert doc["summary"]["errors"] == 0
    rewrite(shard(run, "extra_state", 1), lambda e: e["lr_scheduler"].update(last_epoch=99))
    bad = ckpt_audit("verify", latest(run), catalog=catalog)
    assert bad.returncode == 1, bad.stderr[-500:]
    assert "lr-scheduler-differs" in bad.stdout and "[rank 1]" in bad.stdout
    missing = ckpt_audit("verify", tmp_path / "nope", catalog=catalog)
    assert missing.returncode == 3 and missing.stderr.count("\n") == 1
    from ckpt_audit.catalog import open_catalog

    with open_catalog(tmp_path / "c.db") as cat:
        codes = {f["code"] for f in cat.findings()}
    assert "lr-scheduler-differs" in codes


def test_scan_deep_finds_what_verify_finds(run, tmp_path):
    """`scan --deep` is verify behind scan's options: a deep-only defect fails it, plain scan stays clean."""
    from click.testing import CliRunner

    from ckpt_audit.cli import cli

    def change(o):
        for st in o["state"].values():
            st["step"] = st["step"] + 3

    rewrite(shard(run, "optim", 1), change)
    cat = ["--catalog", str(tmp_path / "c.db")]
    shallow = CliRunner().invoke(cli, ["scan", "--json", *cat, str(run)])
    assert shallow.exit_code == 0, shallow.output
    assert json.loads(shallow.output)["deep"] is False
    deep = CliRunner().invoke(cli, ["scan", "--deep", "--json", *cat, str(run)])
    assert deep.exit_code == 1, deep.output
    doc = json.loads(deep.output)
    assert doc["command"] == "scan" and doc["deep"] is True
    codes = {
        f["code"]
        for r in doc["runs"]
        for c in r["checkpoints"]
        for comp in c["components"]
        for f in comp["findings"] + c["findings"]
    }
    assert "optimizer-step-differs" in codes


@pytest.mark.parametrize("name", ["verl_run_w3", "verl_run_hsdp", "verl_run_w1"])
def test_harness_trees_verify_clean(request, name):
    """Uneven W=3 shards (empty ones allowed), HSDP 2x2 replicas, W=1: no deep finding above info."""
    src = Path(request.getfixturevalue(name))
    found, result = findings(src)
    assert [(f.code, f.rank, f.tensor, f.message) for f in found if f.severity > 0] == []
    assert all(c.status is Status.COMPLETE for r in result.runs for c in r.checkpoints)
