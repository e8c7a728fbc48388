"""Save and restore through the installed verl's own FSDPCheckpointManager (verl.utils.checkpoint).

One manager per role and rank, built as verl's FSDP workers build theirs: the FSDP2 module, its optimizer and
LR scheduler, the tokenizer as processing_class, and verl's own CheckpointConfig. Everything the manager owns
(model, optimizer, extra_state = lr_scheduler + RNG, huggingface/, fsdp_config.json) is written and read by verl's
code. The data position is not the manager's: verl's PPO trainer saves the driver's StatefulDataLoader.state_dict()
to global_step_N/data.pt after the roles and then writes the tracker; this module does the same, with our loader.

`--drop` (resume-test's sabotage) becomes a defect in what the trainer hands verl at load, each one a mistake a
real trainer can make (docs/harness.md):
  optimizer  the load manager's CheckpointConfig.load_contents leaves out "optimizer" (a real verl option);
  scheduler  the load manager is given lr_scheduler=None (verl then skips the saved scheduler without a word);
  rng        the trainer re-seeds its RNG streams after verl's load (as one that seeds after resuming would);
  data       the trainer does not restore data.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness import checkpoint, rng

# Training engines verl imports when they are installed (verl.workers.engine, reached from verl.utils.checkpoint);
# the FSDP checkpoint manager uses none of them, and importing them doubles the cost of importing verl.
UNUSED_ENGINES = ("megatron", "torchtitan", "veomni", "mindspeed")


def import_manager():
    """verl's manager class. Importing verl imports tensordict, ray, datasets and peft (about 7 s of CPU here), so
    the launcher does it once before forking the ranks. The engines above are hidden first (None in sys.modules
    makes their import raise ImportError), so verl takes its own "engine is not available" path for them."""
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")  # its per-file "Saved model to ..." lines
    if "verl" not in sys.modules:
        for name in UNUSED_ENGINES:
            sys.modules.setdefault(name, None)
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    return FSDPCheckpointManager


def _manager(role, *, drop: tuple[str, ...] = ()):
    from verl.trainer.config import CheckpointConfig

    contents = ["model", "optimizer", "extra"]
    config = CheckpointConfig(
        save_contents=list(contents),
        load_contents=[c for c in contents if not (c == "optimizer" and "optimizer" in drop)],
    )
    return import_manager()(
        model=role.model,
        optimizer=role.optimizer,
        lr_scheduler=None if "scheduler" in drop else role.scheduler,
        processing_class=role.tokenizer,
        checkpoint_config=config,
    )


class VerlCheckpointer:
    def __init__(self, cfg, roles, *, rank: int) -> None:
        self.cfg, self.roles, self.rank = cfg, roles, rank
        self.savers = [_manager(role) for role in roles]

    def save(self, stream, *, step: int) -> Path:
        import torch
        import torch.distributed as dist

        cfg = self.cfg
        target = checkpoint.step_dir(cfg.run_path, step)
        for role, manager in zip(self.roles, self.savers):
            manager.save_checkpoint(str(checkpoint.role_dir(target, role.name, sft=cfg.sft)), global_step=step)
        if self.rank == 0:  # verl's trainer: data.pt after the roles, then the tracker
            torch.save(stream.state_dict(), target / "data.pt")
            checkpoint.write_tracker(cfg.run_path, step, atomic=cfg.sft)
        dist.barrier()
        return target

    def restore(self, folder: Path, stream) -> None:
        cfg = self.cfg
        for role in self.roles:
            _manager(role, drop=cfg.drop).load_checkpoint(str(checkpoint.role_dir(folder, role.name, sft=cfg.sft)))
        if "rng" in cfg.drop:
            rng.seed_rank(cfg.seed, self.rank)
        data_file = folder / "data.pt"
        if "data" not in cfg.drop and data_file.is_file():
            stream.load_state_dict(checkpoint.load_file(data_file))
