"""FSDP2 the way verl applies it: a device mesh, fully_shard per decoder layer then the root, and verl's placement
rule (shard the first dimension divisible by the shard count, else dim 0), so Shard(1) and uneven shards occur."""

from __future__ import annotations

from harness.config import TrainConfig


def build_mesh(cfg: TrainConfig, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.replicas > 1:
        return init_device_mesh(device_type, (cfg.replicas, cfg.fsdp_size), mesh_dim_names=("ddp", "fsdp"))
    return init_device_mesh(device_type, (cfg.world_size,), mesh_dim_names=("fsdp",))


def placement_fn(fsdp_size: int):
    from torch.distributed.tensor import Shard

    def place(param):
        for dim, size in enumerate(param.shape):
            if size % fsdp_size == 0:
                return Shard(dim)
        return Shard(0)

    return place


def shard_model(model, layers, mesh, fsdp_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    place = placement_fn(fsdp_size)
    for layer in layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
