"""Saving exactly as verl's FSDPCheckpointManager and ray_trainer do, and loading back, re-sharding when the world
size changed (which verl itself cannot do, verl #2265).

Save order (docs/verl-format.md §1.2): per role, mkdir + barrier; every rank writes model_, optim_, extra_state_ (final
names, no temp files); rank 0 writes huggingface/ (generation config, config, tokenizer) then fsdp_config.json;
barrier. Then rank 0 writes global_step_N/data.pt and last the tracker (plain write; tmp + rename for SFT).
Loads use torch.load(weights_only=True, map_location="cpu") plus exactly numpy's RNG globals as safe globals.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
KINDS = ("model", "optim", "extra_state")


def shard_name(kind: str, world_size: int, rank: int) -> str:
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"global_step_{step}"


def role_dir(step_path: Path, role: str, *, sft: bool) -> Path:
    return step_path if sft else step_path / role


def fsdp_config_bytes(world_size: int) -> bytes:
    """json.dump(asdict(FSDPConfig(...)), f, indent=4): no trailing newline."""
    return json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4).encode()


# --------------------------------------------------------------------------------------------------- save


def save_role(role, path: Path, *, rank: int, world_size: int, write_hf: bool = True) -> None:
    import torch
    import torch.distributed as dist

    from harness.rng import get_rng_state

    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(role.model.state_dict(), path / shard_name("model", world_size, rank))
    torch.save(role.optimizer.state_dict(), path / shard_name("optim", world_size, rank))
    torch.save(
        {"lr_scheduler": role.scheduler.state_dict(), "rng": get_rng_state()},
        path / shard_name("extra_state", world_size, rank),
    )
    if rank == 0:
        if write_hf:
            write_huggingface(role, path / "huggingface")
        (path / "fsdp_config.json").write_bytes(fsdp_config_bytes(world_size))
    dist.barrier()


def write_huggingface(role, hf_dir: Path) -> None:
    from transformers import GenerationConfig

    hf_dir.mkdir(parents=True, exist_ok=True)
    config = role.model.config
    GenerationConfig.from_model_config(config).save_pretrained(hf_dir)
    config.save_pretrained(hf_dir)
    role.tokenizer.save_pretrained(hf_dir)


def save_checkpoint(roles, stream, *, run_dir: Path, step: int, rank: int, world_size: int, sft: bool) -> Path:
    import torch
    import torch.distributed as dist

    target = step_dir(run_dir, step)
    for role in roles:
        save_role(role, role_dir(target, role.name, sft=sft), rank=rank, world_size=world_size)
    if rank == 0:
        torch.save(stream.state_dict(), target / "data.pt")
        write_tracker(Path(run_dir), step, atomic=sft)
    dist.barrier()
    return target


def save_probe(roles, stream, *, probe_dir: Path, rank: int, world_size: int) -> None:
    """The live state right after a restore, in the same layout, for resume-test to compare with what was saved."""
    import torch
    import torch.distributed as dist

    for role in roles:
        save_role(role, probe_dir / role.name, rank=rank, world_size=world_size, write_hf=False)
    if rank == 0:
        torch.save(stream.state_dict(), probe_dir / "data.pt")
    dist.barrier()


def write_tracker(run_dir: Path, step: int, *, atomic: bool) -> None:
    path = run_dir / TRACKER
    if atomic:  # verl's SFT trainers: tmp + rename
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, path)
    else:  # verl's PPO trainer: plain truncate-and-write, last
        with open(path, "w") as f:
            f.write(str(step))


# --------------------------------------------------------------------------------------------------- find


def find_resume_dir(run_dir: Path, resume: str) -> Path | None:
    """verl's resume modes: "auto" reads the tracker (missing tracker or directory: None, i.e. from scratch);
    anything else is an explicit global_step_N path."""
    if resume == "auto":
        tracker = Path(run_dir) / TRACKER
        if not tracker.is_file():
            return None
        folder = step_dir(run_dir, int(tracker.read_bytes().decode()))
        return folder if folder.is_dir() else None
    folder = Path(resume)
    if not folder.is_dir():
        raise FileNotFoundError(f"resume path {folder} is not a directory")
    return folder


def step_of(folder: Path) -> int:
    m = re.fullmatch(r"global_step_(\d+)", Path(folder).name)
    if not m:
        raise ValueError(f"{folder}: not a global_step_N directory")
    return int(m.group(1))


def saved_world_size(path: Path) -> int:
    cfg = path / "fsdp_config.json"
    if cfg.is_file():
        return int(json.loads(cfg.read_text())["world_size"])
    sizes = {
        int(m.group(1))
        for p in path.glob("model_world_size_*_rank_*.pt")
        if (m := re.match(r"model_world_size_(\d+)_rank_\d+\.pt$", p.name))
    }
    if len(sizes) != 1:
        raise ValueError(f"{path}: cannot tell the saved world size (found {sorted(sizes)})")
    return sizes.pop()


# --------------------------------------------------------------------------------------------------- load


def load_file(path: Path):
    """weights_only=True with exactly the numpy RNG globals allowed; DTensors need torch.distributed.tensor imported."""
    import logging

    import torch
    import torch.distributed.tensor  # noqa: F401 - registers DTensor for the weights-only unpickler

    from harness.rng import numpy_safe_globals

    # Unpickling a DeviceMesh outside its process group only matters to torch.compile; say nothing.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    with torch.serialization.safe_globals(numpy_safe_globals()):
        return torch.load(path, weights_only=True, map_location="cpu")


def mesh_coordinate(dt, rank: int) -> tuple[int, ...]:
    mesh = dt.device_mesh.mesh
    hit = (mesh == rank).nonzero()
    if len(hit) != 1:
        raise ValueError(f"rank {rank} not in saved mesh {mesh.tolist()}")
    return tuple(int(i) for i in hit[0])


def assemble(pieces: dict, placements, mesh_shape) -> object:
    """The full tensor from local shards keyed by mesh coordinate: Replicate takes coordinate 0, Shard(d)
    concatenates along d in coordinate order (torch.chunk semantics, so uneven and empty shards work)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    def build(prefix: tuple[int, ...]):
        i = len(prefix)
        if i == len(placements):
            return pieces[prefix]
        p = placements[i]
        if isinstance(p, Replicate):
            return build(prefix + (0,))
        if isinstance(p, Shard):
            return torch.cat([build(prefix + (c,)) for c in range(mesh_shape[i])], dim=p.dim)
        raise ValueError(f"unsupported placement {p!r}")

    return build(())


def local_chunk(full, live):
    """This rank's local shard of `full` for the live DTensor's mesh and placements (an own, compact copy)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    t = full
    coords = live.device_mesh.get_coordinate()
    for i, p in enumerate(live.placements):
        if isinstance(p, Shard):
            chunks = t.chunk(live.device_mesh.size(i), dim=p.dim)
            if coords[i] < len(chunks):
                t = chunks[coords[i]]
            else:  # torch.chunk gives fewer chunks than ranks: trailing ranks hold an empty shard
                t = t.narrow(p.dim, t.shape[p.dim], 0)
        elif not isinstance(p, Replicate):
            raise ValueError(f"unsupported placement {p!r}")
    if tuple(t.shape) != tuple(live.to_local().shape):
        raise ValueError(
            f"re-shard produced local shape {tuple(t.shape)}, live shard is {tuple(live.to_local().shape)}"
        )
    return t.clone(memory_format=torch.contiguous_format)


def full_tensor(values_by_rank: dict, ranks: range):
    """Assemble one saved value across rank files (a DTensor per rank) into the full tensor; plain tensors pass."""
    from torch.distributed.tensor import DTensor

    first = values_by_rank[ranks[0]]
    if not isinstance(first, DTensor):
        return first
    pieces = {mesh_coordinate(values_by_rank[r], r): values_by_rank[r].to_local() for r in ranks}
    return assemble(pieces, first.placements, tuple(first.device_mesh.mesh.shape))


def rewrap(local, live):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(live.device),
        live.device_mesh,
        live.placements,
        run_check=False,
        shape=live.shape,
        stride=live.stride(),
    )


class RoleFiles:
    """The saved files of one role, read lazily: this rank's own file when the layout matches, else all ranks."""

    def __init__(self, path: Path, *, rank: int, world_size: int, mesh_shape: tuple[int, ...]) -> None:
        self.path, self.rank = path, rank
        self.saved_world_size = saved_world_size(path)
        self.world_size, self.mesh_shape = world_size, mesh_shape
        self._cache: dict[tuple[str, int], object] = {}

    def get(self, kind: str, rank: int):
        key = (kind, rank)
        if key not in self._cache:
            file = self.path / shard_name(kind, self.saved_world_size, rank)
            if not file.is_file():
                raise FileNotFoundError(f"missing shard {file}")
            self._cache[key] = load_file(file)
        return self._cache[key]

    def same_layout(self, sample) -> bool:
        from torch.distributed.tensor import DTensor

        return (
            self.saved_world_size == self.world_size
            and isinstance(sample, DTensor)
            and tuple(sample.device_mesh.mesh.shape) == self.mesh_shape
        )

    def resharded(self, kind: str, pick, live):
        """The value `pick(file_dict)` as this rank's shard of the live DTensor `live` (or as is if not a DTensor)."""
        from torch.distributed.tensor import DTensor

        own = pick(self.get(kind, min(self.rank, self.saved_world_size - 1)))
        if not isinstance(live, DTensor):
            return own.to(live.device) if hasattr(own, "to") else own
        if self.same_layout(own) and tuple(own.placements) == tuple(live.placements):
            return rewrap(own.to_local(), live)
        ranks = range(self.saved_world_size)
        full = full_tensor({r: pick(self.get(kind, r)) for r in ranks}, ranks)
        return rewrap(local_chunk(full, live), live)


def load_role(role, path: Path, *, rank: int, world_size: int, mesh_shape, drop: tuple[str, ...]) -> None:
    """Restore model, optimizer, scheduler and RNG of one role, dropping the named pieces (resume-test sabotage)."""
    from harness.rng import set_rng_state

    files = RoleFiles(path, rank=rank, world_size=world_size, mesh_shape=tuple(mesh_shape))
    live = role.model.state_dict()
    saved_keys = set(files.get("model", 0))
    if saved_keys != set(live):
        raise ValueError(
            f"{path}: model keys differ from the live model "
            f"(missing {sorted(set(live) - saved_keys)[:3]}, extra {sorted(saved_keys - set(live))[:3]})"
        )
    role.model.load_state_dict({k: files.resharded("model", lambda d, k=k: d[k], v) for k, v in live.items()})

    if "optimizer" not in drop:
        saved = files.get("optim", 0)
        params = [p for group in role.optimizer.param_groups for p in group["params"]]
        state = {}
        for idx, entry in saved["state"].items():
            state[idx] = {
                name: files.resharded("optim", lambda d, i=idx, n=name: d["state"][i][n], _like(value, params[idx]))
                for name, value in entry.items()
            }
        role.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    extra = files.get("extra_state", min(rank, files.saved_world_size - 1))
    if "scheduler" not in drop:
        role.scheduler.load_state_dict(extra["lr_scheduler"])
    # A rank that did not exist in the saved run keeps its fresh (seed, rank) streams.
    if "rng" not in drop and rank < files.saved_world_size and extra.get("rng") is not None:
        set_rng_state(extra["rng"])


def _like(value, param):
    """The live counterpart of a saved optimizer value: the param itself for sharded moments, else the value."""
    from torch.distributed.tensor import DTensor

    return param.data if isinstance(value, DTensor) else value
