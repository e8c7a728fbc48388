"""Write a DeepSpeed engine tree of an expert- or pipeline-parallel model with DeepSpeed's own modules, then resume it
with DeepSpeed's own `load_checkpoint`. Run as 2 processes by torch.distributed.run (CPU accelerator, gloo):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_write_deepspeed_parallel.py DEST KIND
    ... tests/_write_deepspeed_parallel.py --probe DEST KIND OUT

DEST/global_step2 and `latest`, torch's AdamW, KIND one of
- `moe`: ZeRO-0 (the stage at which the engine writes the per-expert-parallel-rank optimizer files
  `expp_rank_R_mp_rank_MM_optim_states.pt`), expert-parallel size 2, two `deepspeed.moe.layer.MoE` layers of 2 and 4
  experts (`layer_L_expert_E_mp_rank_00_model_states.pt` for E < 2 and E < 4), AdamW over DeepSpeed's MoE parameter
  groups (the experts' group is named `ep_size_2`);
- `pipe`: a `deepspeed.pipe.PipelineModule` of 4 layers (Linear, ReLU | Linear, Linear) in 2 stages, ZeRO-1, so each
  stage's model states record its parameters in `param_shapes`; `layer_XX-model_states.pt` per layer.
With --probe, each rank builds the same engine, calls `load_checkpoint(DEST)` and writes OUT.<rank>.json (the path
loaded, or the exception), the evidence behind docs/layouts.md's rows; it exits without a further collective, so a
failed rank cannot hang its peer.
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
from deepspeed.pipe import PipelineModule  # noqa: E402


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


def mse(out, y):
    return (out - y).pow(2).mean()


def engine(kind: str):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 0}}
    if kind == "moe":
        model = Net()
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"}
        )
    else:
        layers = [torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=mse, partition_method="uniform")
        params = list(model.parameters())
        config |= {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=config)[0]


def main(dest: str, kind: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    eng = engine(kind)
    batches = iter([(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(2)])
    for _ in range(2):
        if kind == "pipe":
            eng.train_batch(data_iter=batches)
        else:
            eng.backward(eng(torch.randn(2, 4, 8)).pow(2).mean())
            eng.step()
    eng.save_checkpoint(dest)
    again = engine(kind)
    path, _ = again.load_checkpoint(dest)  # tag=None: the tag `latest` names, every file of it this rank needs
    assert path is not None and again.global_steps == 2, path
    torch.distributed.barrier()


def probe(dest: str, kind: str, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    eng = engine(kind)
    try:
        path, _ = eng.load_checkpoint(dest)
        res = {"loaded": path, "global_steps": eng.global_steps}
    except Exception as e:  # what the load raised is the evidence
        res = {"error": f"{type(e).__name__}: {e}"}
    with open(f"{out}.{torch.distributed.get_rank()}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    probe(*sys.argv[2:5]) if sys.argv[1] == "--probe" else main(*sys.argv[1:3])
