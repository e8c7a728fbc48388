"""Write the DeepSpeed save directories the ZeRO export is tested on, with DeepSpeed itself, in one 2-process run
(CPU accelerator, gloo, torch's AdamW since DeepSpeed's fused Adam needs CUDA):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_write_deepspeed_export.py DEST

DEST/<case>/global_step2 and `latest` for each case in CASES (ZeRO stage, bf16). The model has what
zero_to_fp32 treats specially: a persistent float buffer and an int buffer (taken from the model states), a frozen
parameter (frozen_param_fragments), a weight tied to another (shared_params) and sizes that leave ZeRO-2 alignment
and ZeRO-3 partition padding. Each save is loaded back by DeepSpeed's own load_checkpoint to prove it real.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

# as in _write_deepspeed.py: DeepSpeed's CPU accelerator would JIT-compile a shared-memory op it does not need here
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import torch  # noqa: E402

CASES = {"z1": (1, False), "z2": (2, False), "z2bf16": (2, True), "z3": (3, False), "z3bf16": (3, True)}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.up = torch.nn.Linear(6, 7)
        self.down = torch.nn.Linear(7, 6)
        self.head = torch.nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: DeepSpeed records it in shared_params
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("shift", torch.tensor([1.5, -2.25], dtype=torch.bfloat16))  # zero_to_fp32: float32

    def forward(self, ids):
        h = self.frozen(self.emb(ids)).relu()
        return self.head(self.down(self.up(h).relu())) * self.scale[0]


def engine(stage: int, bf16: bool):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "bf16": {"enabled": bf16},
    }
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def main(dest: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    for case, (stage, bf16) in CASES.items():
        eng = engine(stage, bf16)
        for _ in range(2):
            ids = torch.randint(0, 13, (2, 5))
            loss = eng(ids).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
        eng.module.seen += 3  # a buffer that differs from its initial value
        eng.save_checkpoint(f"{dest}/{case}")
        again = engine(stage, bf16)
        path, _ = again.load_checkpoint(f"{dest}/{case}")
        assert path is not None and again.global_steps == 2, (case, path)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
