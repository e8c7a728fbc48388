"""Writes real DTensor .pt files from a gloo group of WORLD CPU processes, plus the truth read from the live
DTensor objects (truth_rank_R.json). Run as: python tests/_write_dtensors.py OUT_DIR WORLD"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _truth(d: dict) -> dict:
    from torch.distributed.tensor import DTensor

    res = {}
    for k, v in d.items():
        if isinstance(v, DTensor):
            m = v.device_mesh
            res[k] = {
                "dtype": str(v.dtype).removeprefix("torch."),
                "local": list(v.to_local().shape),
                "global": list(v.shape),
                "placements": [repr(p) for p in v.placements],
                "mesh_shape": list(m.shape),
                "mesh_dim_names": list(m.mesh_dim_names or ()),
                "mesh_ranks": m.mesh.flatten().tolist(),
                "device": str(v.to_local().device),
            }
        else:
            res[k] = {"dtype": str(v.dtype).removeprefix("torch."), "local": list(v.shape), "device": str(v.device)}
    return res


def _rank(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("ddp", "fsdp"))
    torch.manual_seed(0)
    sd = {
        "embed.weight": distribute_tensor(torch.randn(37, 12), mesh1, [Shard(1)]),
        "rows.weight": distribute_tensor(torch.randn(37, 3), mesh1, [Shard(0)]),
        "hsdp.weight": distribute_tensor(torch.randn(5, 2).bfloat16(), mesh2, [Replicate(), Shard(0)]),
        "plain": torch.arange(6),
    }
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=mesh1)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    msd = model.state_dict()
    osd = opt.state_dict()
    flat_opt = {f"state.{i}.{n}": t for i, st in osd["state"].items() for n, t in st.items()}
    torch.save(sd, os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(msd, os.path.join(out, f"fsdp2_model_rank_{rank}.pt"))
    torch.save(osd, os.path.join(out, f"fsdp2_optim_rank_{rank}.pt"))
    truth = {
        f"model_world_size_{world}_rank_{rank}.pt": _truth(sd),
        f"fsdp2_model_rank_{rank}.pt": _truth(msd),
        f"fsdp2_optim_rank_{rank}.pt": _truth(flat_opt),
    }
    with open(os.path.join(out, f"truth_rank_{rank}.json"), "w") as f:
        json.dump(truth, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, world = sys.argv[1], int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(_rank, args=(world, out_dir, free_port), nprocs=world, join=True, start_method="spawn")
