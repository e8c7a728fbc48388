"""One rank of the reference trainer: build, shard, (resume,) train, save like verl. Runs inside a forked process."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.config import TrainConfig


@dataclass(slots=True, kw_only=True)
class Role:
    """One trained model with everything resumable about it (each has state_dict()/load_state_dict())."""

    name: str
    model: object
    optimizer: object
    scheduler: object
    tokenizer: object


def lr_lambda(cfg: TrainConfig):
    """verl's cosine schedule with linear warmup, as a plain function (LambdaLR then saves lr_lambdas=[None])."""
    warmup, total = cfg.warmup_steps, cfg.schedule_steps

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))

    return factor


def make_role(name: str, model, tokenizer, cfg: TrainConfig) -> Role:
    import torch

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return Role(name=name, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer)


def pick_device(cfg: TrainConfig) -> str:
    import torch

    if cfg.device == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world_size else "cpu"


def run_rank(cfg: TrainConfig, rank: int, init_file: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from harness import checkpoint, data, rng, sharding
    from harness import model as models
    from harness.checkpointers import open_checkpointer

    device_type = pick_device(cfg)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=cfg.world_size,
    )
    try:
        mesh = sharding.build_mesh(cfg, device_type)
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        hf_config = models.build_hf_config(cfg)
        tokenizer = models.build_tokenizer(cfg.vocab)
        torch.manual_seed(cfg.seed)  # identical init on every rank before sharding
        roles = [models.build_actor(hf_config)]
        if cfg.critic:
            roles.append(models.build_critic(hf_config))
        names = ["actor", "critic"]
        built = []
        for name, module in zip(names, roles):
            module.to(device)
            sharding.shard_model(module, models.decoder_layers(module), mesh, cfg.fsdp_size)
            module.train()
            built.append(make_role(name, module, tokenizer, cfg))
        rng.seed_rank(cfg.seed, rank)
        stream = data.BatchStream(cfg, rank, device)
        ckpt = open_checkpointer(cfg, built, rank=rank, mesh_shape=tuple(mesh.mesh.shape))

        start = 0
        if cfg.resume is not None:
            folder = checkpoint.find_resume_dir(cfg.run_path, cfg.resume)
            if folder is None:
                if rank == 0:
                    print("harness: no checkpoint to resume from; training from scratch", file=sys.stderr)
            else:
                start = checkpoint.step_of(folder)
                ckpt.restore(folder, stream)
                dist.barrier()
                if cfg.probe_dir:
                    checkpoint.save_probe(
                        built, stream, probe_dir=Path(cfg.probe_dir), rank=rank, world_size=cfg.world_size
                    )

        metrics = open(cfg.run_path / cfg.metrics_name, "a") if rank == 0 else None
        local_rows = cfg.batch_size // cfg.world_size
        try:
            for step in range(start + 1, cfg.steps + 1):
                t0 = time.perf_counter()
                batch = stream.next_global()[rank * local_rows : (rank + 1) * local_rows]
                # Each rank's numpy and python streams pick its window, so both streams shape the loss.
                offset = int(np.random.randint(0, data.WINDOW_SLACK - 1)) + random.randint(0, 1)
                tokens = batch[:, offset : offset + cfg.seq_len]
                row = {"step": step}
                for role in built:
                    row |= train_step(role, tokens, cfg, prefix="" if role.name == "actor" else "critic_")
                if metrics is not None:
                    row |= {"world_size": cfg.world_size, "time_s": round(time.perf_counter() - t0, 4)}
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                    ckpt.save(stream, step=step)
        finally:
            if metrics is not None:
                metrics.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_step(role: Role, tokens, cfg: TrainConfig, *, prefix: str) -> dict:
    """One optimizer step: forward, backward, clip, AdamW, scheduler; the loss is averaged over all ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    lr = role.optimizer.param_groups[0]["lr"]
    if prefix:  # critic: regress a per-token value target (the normalised next-token id)
        values = role.model(input_ids=tokens).logits.squeeze(-1)
        target = tokens.roll(-1, dims=1).float() / cfg.vocab
        loss = torch.nn.functional.mse_loss(values, target)
    else:
        loss = role.model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(role.model.parameters(), cfg.max_grad_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    role.optimizer.step()
    role.scheduler.step()
    role.optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return {f"{prefix}loss": mean.item(), f"{prefix}lr": lr, f"{prefix}grad_norm": norm.item()}
