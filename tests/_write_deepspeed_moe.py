"""Write a DeepSpeed engine tree of a model with DeepSpeed's own MoE layers, then resume it with DeepSpeed's own
`load_checkpoint`. Run as 2 processes by torch.distributed.run (CPU accelerator, gloo):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_write_deepspeed_moe.py DEST
    ... tests/_write_deepspeed_moe.py --probe DEST OUT


DEST/global_step2 and `latest`: ZeRO-0 (the stage at which the engine writes the per-expert-parallel-rank optimizer
files `expp_rank_R_mp_rank_MM_optim_states.pt`), expert-parallel size 2, two `deepspeed.moe.layer.MoE` layers of 2
and 4 experts (so `layer_L_expert_E_mp_rank_00_model_states.pt` for E < 2 and E < 4), torch's AdamW over DeepSpeed's
MoE parameter groups (the group of expert parameters is named `ep_size_2`). With --probe, each rank builds the same
engine, calls `load_checkpoint(DEST)` and writes OUT.<rank>.json (the path loaded, or the exception), the evidence
behind docs/layouts.md's MoE rows; it exits without a further collective, so a failed rank cannot hang its peer.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # see _write_deepspeed.py
import torch  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = torch.nn.ModuleList(
            MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=n, ep_size=2, k=1) for n in (2, 4)
        )
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.moe:
            x = layer(x)[0]
        return self.out(x)


def engine():
    torch.manual_seed(0)
    model = Net()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    opt = torch.optim.AdamW(groups, lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}, "steps_per_print": 1000}
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def main(dest: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    eng = engine()
    for _ in range(2):
        loss = eng(torch.randn(2, 4, 8)).pow(2).mean()
        eng.backward(loss)
        eng.step()
    eng.save_checkpoint(dest)
    again = engine()
    path, _ = again.load_checkpoint(dest)  # tag=None: the tag `latest` names, expert files and expp optimizer too
    assert path is not None and again.global_steps == 2, path
    torch.distributed.barrier()


def probe(dest: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    eng = engine()
    try:
        path, _ = eng.load_checkpoint(dest)
        res = {"loaded": path, "global_steps": eng.global_steps}
    except Exception as e:  # what the load raised is the evidence
        res = {"error": f"{type(e).__name__}: {e}"}
    with open(f"{out}.{torch.distributed.get_rank()}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    probe(*sys.argv[2:4]) if sys.argv[1] == "--probe" else main(sys.argv[1])
