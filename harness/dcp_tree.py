"""Real torch.distributed.checkpoint trees for verify's tests and benchmark, from a multi-process gloo run.

`write_dcp_trees(root, world_size=2)` spawns `world_size` CPU processes; each builds the same tiny model, shards
it with FSDP2 (`fully_shard`) on a 1-D mesh, takes one AdamW + LambdaLR step, then writes:

- `root/megatron/exp/`: verl's Megatron layout (docs/verl-format.md §2.1): `global_step_1/actor/dist_ckpt/`
  from `dcp.save` with two writer threads per rank (`__R_0.distcp`, `__R_1.distcp`, `.metadata`), rank 0's
  `common.pt` (lr_scheduler) and `metadata.json` last; `actor/huggingface/` with config.json and the full model as
  safetensors (the mbridge variant); `data.pt` from a real StatefulDataLoader; the tracker.
- `root/dcp/checkpoint/step-1/`: the same state as a plain PyTorch DCP checkpoint (torchtitan-style naming).
- with `fsdp_run=True`, `root/verl/exp/`: a verl FSDP2 run (model/optim/extra_state shards per rank,
  fsdp_config.json, huggingface/config.json, data.pt, tracker); verify's tests use it only when the harness's
  `verl_run` fixtures are not available.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


def _dataloader_state(steps: int) -> dict:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(0)
    dl = StatefulDataLoader(list(range(64)), batch_size=4, shuffle=True, generator=g, num_workers=0)
    it = iter(dl)
    for _ in range(steps):
        next(it)
    return dl.state_dict()


def _rank(rank: int, world: int, root: str, port: int, fsdp_run: bool) -> None:
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

    def place(param):  # verl's rule: first dim divisible by the FSDP size, else dim 0
        return Shard(next((d for d, n in enumerate(param.shape) if n % world == 0), 0))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    torch.manual_seed(1)
    ids = torch.randint(0, 37, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    random.seed(rank)
    np.random.seed(rank)
    msd, osd = model.state_dict(), opt.state_dict()
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    data_state = _dataloader_state(1)
    base = Path(root)

    # -- verl Megatron layout ---------------------------------------------------------------------------------
    run = base / "megatron" / "exp"
    actor = run / "global_step_1" / "actor"
    ckpt_dir = actor / "dist_ckpt"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"lr_scheduler": sched.state_dict()}, ckpt_dir / "common.pt")
    dist.barrier()
    writer = dcp.FileSystemWriter(str(ckpt_dir), thread_count=2)
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=writer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        (ckpt_dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
        hf = actor / "huggingface"
        model.config.save_pretrained(hf)
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}  # tied: saved once
        save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
        torch.save(data_state, run / "global_step_1" / "data.pt")
        (run / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()

    # -- plain PyTorch DCP --------------------------------------------------------------------------------------
    plain = base / "dcp" / "checkpoint" / "step-1"
    dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, checkpoint_id=str(plain))
    dist.barrier()

    # -- verl FSDP2 (stand-in for the harness's trees) --------------------------------------------------------
    if fsdp_run:
        frun = base / "verl" / "exp"
        factor = frun / "global_step_1" / "actor"
        if rank == 0:
            factor.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        torch.save(msd, factor / f"model_world_size_{world}_rank_{rank}.pt")
        torch.save(osd, factor / f"optim_world_size_{world}_rank_{rank}.pt")
        torch.save(
            {"lr_scheduler": sched.state_dict(), "rng": rng}, factor / f"extra_state_world_size_{world}_rank_{rank}.pt"
        )
        dist.barrier()
        if rank == 0:
            model.config.save_pretrained(factor / "huggingface")
            (factor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
            torch.save(data_state, frun / "global_step_1" / "data.pt")
            (frun / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_dcp_trees(root: Path, *, world_size: int = 2, fsdp_run: bool = False) -> dict[str, Path]:
    """Write the trees (see module doc) under `root`; returns {"megatron": run, "dcp": ckpt dir, ["verl": run]}."""
    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _rank, args=(world_size, str(root), _free_port(), fsdp_run), nprocs=world_size, join=True, start_method="spawn"
    )
    out = {"megatron": root / "megatron" / "exp", "dcp": root / "dcp" / "checkpoint" / "step-1"}
    if fsdp_run:
        out["verl"] = root / "verl" / "exp"
    return out


if __name__ == "__main__":
    print(write_dcp_trees(Path(sys.argv[1]), world_size=int(sys.argv[2]) if len(sys.argv) > 2 else 2, fsdp_run=True))
