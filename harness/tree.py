"""`write_tree`: the public fixture API. A real multi-process FSDP2 run that leaves a verl checkpoint tree."""

from __future__ import annotations

from pathlib import Path

from harness.config import TrainConfig
from harness.launch import run_training


def write_tree(
    root: Path,
    *,
    project: str = "demo",
    experiment: str = "exp",
    world_size: int = 2,
    steps: int = 4,
    save_every: int = 2,
    hsdp: bool = False,
    critic: bool = False,
    sft: bool = False,
    seed: int = 0,
    timeout_s: float = 300,
    **overrides,
) -> Path:
    """Train `steps` steps on `world_size` ranks (gloo on CPU, NCCL on CUDA), saving every `save_every` steps and
    at the end, and return the run directory `root/project/experiment` (tracker, global_step_N/..., metrics.jsonl).

    hsdp=True uses a 2-replica ("ddp", "fsdp") mesh (world_size must be even; 4 gives verl's 2x2 HSDP).
    `overrides` are further TrainConfig fields (layers, hidden, vocab, num_workers, ...).
    """
    run_dir = Path(root) / project / experiment
    cfg = TrainConfig(
        run_dir=str(run_dir),
        world_size=world_size,
        replicas=2 if hsdp else 1,
        steps=steps,
        save_every=save_every,
        critic=critic,
        sft=sft,
        seed=seed,
        **overrides,
    )
    run_training(cfg, timeout_s=timeout_s)
    return run_dir
