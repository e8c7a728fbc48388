"""Resume a ZeRO-2 bf16 save directory written by tests/_write_deepspeed.py the way a training script does:
DeepSpeed's own `load_checkpoint(save_dir)` with no tag, so DeepSpeed reads `latest` to choose the tag. Run as 2
processes by torch.distributed.run (CPU accelerator, gloo); rank 0 prints `loaded <path> global_steps=<N>`:

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_load_deepspeed.py SAVE_DIR
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # as in _write_deepspeed.py: no JIT build
import torch  # noqa: E402


def main(save_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    config = {  # the writer's ZeRO-2 bf16 engine: the same model, optimizer and config
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
    }
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = deepspeed.initialize(model=model, optimizer=opt, config=config)[0]
    path, _ = engine.load_checkpoint(save_dir)  # tag=None: the tag `latest` names
    if torch.distributed.get_rank() == 0:
        print(f"loaded {path} global_steps={engine.global_steps}", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
