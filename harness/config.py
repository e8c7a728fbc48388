"""The one frozen configuration of a reference-trainer run, shared by the caller, the launcher and every rank."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

DROPPABLE = ("optimizer", "scheduler", "rng", "data")
CHECKPOINTERS = ("reference", "verl")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    run_dir: str
    """`<root>/<project>/<experiment>`: checkpoints, tracker and metrics.jsonl go here (verl's default_local_dir)."""
    world_size: int = 2
    """Number of ranks (processes)."""
    replicas: int = 1
    """HSDP replica groups: 1 = plain FSDP over all ranks; 2 with world_size 4 = a 2x2 ("ddp", "fsdp") mesh."""
    steps: int = 4
    """Train until this global step (inclusive). Steps are numbered from 1, as in verl."""
    save_every: int = 2
    """Save a checkpoint after every step divisible by this, and after the last step; 0 = never save."""
    seed: int = 0
    """Seeds the model init (same on every rank), the data order, and each rank's RNG streams (seed, rank)."""
    critic: bool = False
    """Also train a value model (TokenClassification, num_labels=1) and save it under critic/ (PPO layout)."""
    sft: bool = False
    """verl's SFT layout: shards directly in global_step_N/, tracker written atomically (tmp + rename)."""
    # model
    model_config: str | None = None
    """A local transformers config.json of any causal-LM architecture; None = a tiny Qwen2."""
    layers: int = 2
    """Decoder layers (overrides the config's num_hidden_layers)."""
    hidden: int = 32
    """Hidden size (overrides the config's; intermediate size becomes 2x, heads keep head_dim >= 8)."""
    vocab: int = 131
    """Vocabulary size. 131 is prime, so embeddings get Shard(1) whenever hidden divides by the shard count."""
    dropout: float = 0.1
    """Attention dropout, so the torch RNG stream matters to the loss."""
    # data
    seq_len: int = 16
    """Tokens per training sequence."""
    batch_size: int = 12
    """Global batch (sequences per step), split evenly across all data-parallel ranks: 12 divides by 1, 2, 3, 4, 6."""
    dataset_size: int = 48
    """Synthetic sequences per epoch (48 / 12 = 4 steps per epoch, so fixtures cross an epoch boundary)."""
    num_workers: int = 1
    """StatefulDataLoader workers (verl default 8). >0 gives data.pt the multi-worker key layout verl writes."""
    # optimisation
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 3
    """Linear warmup from 0, then cosine decay to 0 over `schedule_steps`."""
    schedule_steps: int = 100
    """Length of the LR schedule, independent of `steps` so a split run sees the same LRs."""
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (verl's actor.grad_clip)."""
    # resume
    resume: str | None = None
    """None = from scratch; "auto" = from the tracker (verl resume_mode=auto); else a global_step_N directory."""
    drop: tuple[str, ...] = ()
    """Sabotage for resume-test: state pieces NOT restored on resume (subset of DROPPABLE)."""
    copy_from: str | None = None
    """Start by copying this run directory (e.g. a first half to resume from) to run_dir, which must not exist."""
    probe_dir: str | None = None
    """If set with a resume, every rank writes its live state right after restoring, in verl's layout, here."""
    checkpointer: str = "reference"
    """Who saves and loads: "reference" (harness.checkpoint) or "verl" (the installed verl's FSDPCheckpointManager)."""
    metrics_name: str = "metrics.jsonl"
    device: str = "auto"
    """"auto" = CUDA/NCCL when enough GPUs for world_size, else CPU/gloo; or "cpu"."""

    @property
    def fsdp_size(self) -> int:
        return self.world_size // self.replicas

    def validate(self) -> None:
        if self.world_size < 1 or self.replicas < 1 or self.world_size % self.replicas:
            raise ValueError(f"world_size {self.world_size} is not a multiple of replicas {self.replicas}")
        if self.batch_size % self.world_size:
            raise ValueError(f"batch_size {self.batch_size} does not divide evenly over {self.world_size} ranks")
        if self.steps < 1 or self.save_every < 0:
            raise ValueError("steps must be >= 1 and save_every >= 0")
        if bad := set(self.drop) - set(DROPPABLE):
            raise ValueError(f"unknown --drop {sorted(bad)}; choose from {', '.join(DROPPABLE)}")
        if self.checkpointer not in CHECKPOINTERS:
            raise ValueError(f"unknown checkpointer {self.checkpointer!r}; choose from {', '.join(CHECKPOINTERS)}")
        if self.sft and self.critic:
            raise ValueError("sft and critic are different trainers; pick one")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        raw = json.loads(text)
        raw["drop"] = tuple(raw.get("drop", ()))
        return cls(**raw)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)
