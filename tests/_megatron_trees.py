"""Trees written by megatron-core's own `dist_checkpointing.save`, and what megatron-core's own load makes of them.

`write_cases(root)` spawns two CPU processes (gloo). Each builds the same tiny `GPTModel` with tensor parallelism 2
(megatron-core's local layer spec: no Transformer Engine, no apex), takes one Adam step on fixed gradients, and saves
what verl's Megatron checkpoint manager saves (docs/verl-format.md §2.1) with the strategy verl uses (torch_dist
wrapped in FullyParallelSaveStrategyWrapper over the data-parallel group): the model's sharded state dict, the
optimizer state as ShardedTensors shaped like their parameters, `lr_scheduler` (a plain dict: common.pt) and the
`rng_state` ShardedObject. The run is `<root>/base/exp/global_step_1/actor/{dist_ckpt/, huggingface/config.json,
transformer_config.json}` plus the tracker.

Rank 0 then derives one run per case of CASES (a copy with one defect), and both ranks load every case the way
verl resumes (tracker -> global_step_N/actor/dist_ckpt -> `dist_checkpointing.load`) into freshly zeroed state,
comparing what came back with what was saved. `<root>/verdicts.json` records, per case, "loads", "loads-changed"
(no error, other values: megatron-core does not check the CRC-32 torch.save stores) or "fails: <exception>".

CPU-only torch: megatron-core 0.16 calls `torch.cuda.synchronize()` / `torch.cuda.current_device()` in its save
finalize; both are stubbed in the writer processes only (never in ckpt-audit, never in the test process).
`integrity.json` is written in the format of Megatron-LM's `save(..., verify_integrity=True)` (newer than 0.16, which
has no such option; see docs/megatron.md), so ckpt-audit's check of it is tested against the format it reads.

Run as: python tests/_megatron_trees.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import zipfile
from pathlib import Path

TP = 2
STEP = 1
TRACKER = "latest_checkpointed_iteration.txt"
# case name -> what is done to the copy (see _derive)
CASES = (
    "intact",
    "distcp-missing",
    "distcp-truncated",
    "distcp-bitflip",
    "distcp-zip-damaged",
    "metadata-missing",
    "metadata-garbage",
    "metadata-json-missing",
    "common-missing",
    "tracker-dangling",
    "integrity-ok",
    "integrity-mismatch",
)


def dist_ckpt(run: Path) -> Path:
    return run / f"global_step_{STEP}" / "actor" / "dist_ckpt"


def _stub_cuda() -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _build():
    """(model, optimizer) identical on every call in a rank: fixed seeds, one Adam step on fixed gradients."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, use_cpu_initialization=True
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=32
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)  # same on every rank: TP-replicated parameters must stay replicas
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return model, opt


def _sharded_state(model, opt) -> dict:
    """What verl's manager hands to dist_checkpointing.save, minus what needs CUDA (docs/verl-format.md §2.1)."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = model.sharded_state_dict(prefix="")
    osd = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, (p for g in opt.param_groups for p in g["params"]))
    optim_state_to_sharding_state(
        osd, id_map, exclude_keys=("step",)
    )  # exp_avg / exp_avg_sq as ShardedTensors keyed optimizer.state.*
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rng_obj = ShardedObject(
        "rng_state",
        [rng],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (pp, tp),
        replica_id=ps.get_data_parallel_rank(),
    )
    sched = {"max_lr": 1e-3, "num_steps": STEP, "decay_style": "constant"}
    return {"model": model_sd, "optimizer": osd, "lr_scheduler": sched, "rng_state": rng_obj}


def _save(run: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    model, opt = _build()
    target = dist_ckpt(run)
    if dist.get_rank() == 0:
        target.mkdir(parents=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), ps.get_data_parallel_group(with_context_parallel=True)
    )
    dist_checkpointing.save(_sharded_state(model, opt), str(target), sharded_strategy=strategy)
    if dist.get_rank() == 0:
        actor = target.parent
        (actor / "huggingface").mkdir()
        (actor / "huggingface" / "config.json").write_text(json.dumps({"model_type": "gpt", "hidden_size": 16}))
        (actor / "transformer_config.json").write_text(json.dumps({"num_layers": 2, "hidden_size": 16}, indent=2))
        (run / TRACKER).write_text(str(STEP))
    del torch


def _load(run: Path) -> str:
    """Resume as verl does: tracker -> dist_ckpt -> dist_checkpointing.load; compare with what was saved."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    model, opt = _build()
    sharded = _sharded_state(model, opt)
    expected = {}
    for leaf in _leaves(sharded):
        if isinstance(leaf, ShardedTensor):
            expected[(leaf.key, leaf.global_offset)] = leaf.data.detach().clone()
            with torch.no_grad():
                leaf.data.zero_()  # a load that silently skipped a tensor would leave zeros
    sharded.pop("lr_scheduler")
    try:
        step = int((run / TRACKER).read_text())
        loaded = dist_checkpointing.load(sharded, str(run / f"global_step_{step}" / "actor" / "dist_ckpt"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the verdict is the exception (DCP's CheckpointException is one)
        return f"fails: {type(exc).__name__}: {_cause(exc)}"
    got = {}
    for path, sh in _paths(sharded):
        value = loaded
        for k in path:
            value = value[k] if isinstance(value, (dict, list)) and _has(value, k) else None
        if isinstance(sh, ShardedTensor):
            got[(sh.key, sh.global_offset)] = value
        elif isinstance(sh, ShardedObject) and sh.key == "rng_state" and value is None:
            return f"fails: {sh.key} did not come back"
    same = all(isinstance(got.get(k), torch.Tensor) and torch.equal(v, got[k]) for k, v in expected.items())
    return "loads" if same else "loads-changed"


def _cause(exc: BaseException) -> str:
    """The first line of the innermost error a rank reported (DCP wraps every rank's traceback)."""
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
    return (lines[-1] if lines else text)[:240]


def _has(container, k) -> bool:
    return k in container if isinstance(container, dict) else 0 <= k < len(container)


def _paths(d, path=()):
    """(key path, leaf) of a sharded state dict; ShardedTensor / ShardedObject are leaves."""
    if isinstance(d, dict):
        for k in d:
            yield from _paths(d[k], (*path, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _paths(v, (*path, i))
    else:
        yield path, d


def _leaves(d):
    if isinstance(d, dict):
        for k in sorted(d, key=str):
            yield from _leaves(d[k])
    elif isinstance(d, list):
        for v in d:
            yield from _leaves(v)
    else:
        yield d


def _flip_model_byte(dist_dir: Path) -> None:
    """Flip one bit inside the stored bytes of a model tensor (not a zip header: torch.load would notice that)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dist_dir)).read_metadata()
    # the word embeddings' chunk at the smallest (file, offset): the same item whichever rank's thread wrote first
    info = min(
        (s for i, s in meta.storage_data.items() if i.fqn == "embedding.word_embeddings.weight"),
        key=lambda s: (s.relative_path, s.offset),
    )
    path = dist_dir / info.relative_path
    raw = bytearray(path.read_bytes())
    item = bytes(raw[info.offset : info.offset + info.length])
    with zipfile.ZipFile(_io(item)) as z:
        entry = next(e for e in z.infolist() if e.filename.endswith("/data/0"))
    hdr = entry.header_offset
    name_len, extra_len = (
        int.from_bytes(item[hdr + 26 : hdr + 28], "little"),
        int.from_bytes(item[hdr + 28 : hdr + 30], "little"),
    )
    at = info.offset + hdr + 30 + name_len + extra_len + entry.file_size // 2
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def _break_item_directory(dist_dir: Path) -> None:
    """Zero the end-of-central-directory record of one optimizer item: the bytes are there, the zip is not."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dist_dir)).read_metadata()
    info = next(
        s
        for i, s in sorted(meta.storage_data.items(), key=lambda kv: (kv[0].fqn, kv[1].relative_path, kv[1].offset))
        if i.fqn.startswith("optimizer.")
    )
    path = dist_dir / info.relative_path
    raw = bytearray(path.read_bytes())
    end = info.offset + info.length
    eocd = raw.rfind(b"PK\x05\x06", info.offset, end)
    raw[eocd : eocd + 4] = b"\0\0\0\0"
    path.write_bytes(bytes(raw))


def _io(b: bytes):
    import io

    return io.BytesIO(b)


def write_integrity(dist_dir: Path) -> None:
    """integrity.json as Megatron-LM's save(verify_integrity=True) writes it: sha256 of every other top file."""
    files = {}
    for p in sorted(dist_dir.iterdir()):
        if p.is_file() and p.name != "integrity.json":
            files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    (dist_dir / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))


def _derive(base: Path, case: str, root: Path) -> Path:
    run = root / case / "exp"
    shutil.copytree(base, run)
    d = dist_ckpt(run)
    if case == "distcp-missing":
        (d / "__1_0.distcp").unlink()
    elif case == "distcp-truncated":
        p = d / "__0_1.distcp"
        os.truncate(p, p.stat().st_size // 2)
    elif case == "distcp-bitflip":
        _flip_model_byte(d)
    elif case == "distcp-zip-damaged":
        _break_item_directory(d)
    elif case == "metadata-missing":
        (d / ".metadata").unlink()
    elif case == "metadata-garbage":
        (d / ".metadata").write_bytes(bytes(range(256)) * 8)
    elif case == "metadata-json-missing":
        (d / "metadata.json").unlink()
    elif case == "common-missing":
        (d / "common.pt").unlink()
    elif case == "tracker-dangling":
        (run / TRACKER).write_text(str(STEP + 1))
    elif case == "integrity-ok":
        write_integrity(d)
    elif case == "integrity-mismatch":
        write_integrity(d)
        _flip_model_byte(d)
    return run


def _rank(rank: int, world: int, root: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import warnings

    warnings.filterwarnings("ignore")  # apex / Transformer Engine absent: megatron-core warns on every import
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _stub_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    base = Path(root) / "base" / "exp"
    _save(base)
    dist.barrier()
    if rank == 0:
        for case in CASES:
            _derive(base, case, Path(root) / "cases")
    dist.barrier()
    verdicts = {case: _load(Path(root) / "cases" / case / "exp") for case in CASES}
    everyone = [None] * world
    dist.all_gather_object(everyone, verdicts)
    if rank == 0:
        # a case fails when any rank fails (the job dies); otherwise it is changed when any rank saw changes
        merged = {}
        for case in CASES:
            seen = [v[case] for v in everyone]
            merged[case] = next((s for s in seen if s.startswith("fails")), None) or (
                "loads-changed" if "loads-changed" in seen else "loads"
            )
        (Path(root) / "verdicts.json").write_text(json.dumps(merged, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_cases(root: Path) -> dict:
    """Write the base run and every case under `root`; returns megatron-core's verdict per case."""
    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(TP, str(root), _free_port()), nprocs=TP, join=True, start_method="spawn")
    return json.loads((root / "verdicts.json").read_text())


if __name__ == "__main__":
    print(json.dumps(write_cases(Path(sys.argv[1])), indent=2))
