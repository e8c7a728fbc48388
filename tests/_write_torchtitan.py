"""Writes a torchtitan checkpoint folder with torchtitan's own CheckpointManager, from a gloo group of 2 CPU processes.

Run as: python tests/_write_torchtitan.py DUMP_FOLDER. What it holds, under DUMP_FOLDER/checkpoint/:

    step-0/  the model-only seed checkpoint (torchtitan's create_seed_checkpoint path: save(0, last_step=True))
    step-1/  full training state, saved with async_mode="async" (dcp.async_save on a gloo group)
    step-2/  the same
    step-3/  the last step: model only (torchtitan's default last_save_model_only=True)

The model is FSDP2-sharded over both ranks; the optimizer, LR scheduler and dataloader containers are torchtitan's
own (OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader), so the state-dict keys are the ones
torchtitan saves (flattened model keys, `optimizer`, `lr_scheduler`, `dataloader` with `dp_rank_k`,
`train_state`). torchtitan's trainer itself is not run: importing it needs triton, a GPU package (docs/scan.md).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3
WORLD = 2


class Tokens(torch.utils.data.IterableDataset):
    """A deterministic stream of token rows (a dataset state the dataloader can checkpoint)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randint(0, 64, (9,), generator=g)


class TinyLM(torch.nn.Module):
    """Named like torchtitan's llama (tok_embeddings, layers.N, norm, output) so its keys read like a real run's."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(16, 16), "1": torch.nn.Linear(16, 16)})
        self.norm = torch.nn.LayerNorm(16)
        self.output = torch.nn.Linear(16, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = torch.relu(layer(h))
        return self.output(self.norm(h))


class TrainState:
    """What torchtitan's Trainer saves as `train_state` (its own state_dict: step and tokens seen)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _rank(rank: int, dump: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    torch.manual_seed(0)
    model = TinyLM()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",)))
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer(optimizers, lr_lambda=lambda s: 1.0 / (1 + s))
    loader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=WORLD, batch_size=2)
    state = TrainState()
    ckpt = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0, async_mode="async"),
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=dump,
    )
    ckpt.save(curr_step=0, last_step=True)  # the seed checkpoint: model only
    batches = iter(loader)
    for step in range(1, STEPS + 1):
        tokens = next(batches)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        state.step, state.ntokens_seen = step, state.ntokens_seen + tokens.numel() * WORLD
        ckpt.save(curr_step=step, last_step=step == STEPS)
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # torchtitan once, in the parent: the forked ranks share it (spawn imported it per rank: twice the CPU time)
    torch.set_num_threads(1)
    import torchtitan.components.checkpointer  # noqa: F401
    import torchtitan.components.dataloader  # noqa: F401
    import torchtitan.components.optimizer  # noqa: F401

    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(_rank, args=(out, free_port), nprocs=WORLD, join=True, start_method="fork")
