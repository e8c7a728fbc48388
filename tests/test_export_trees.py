"""Hand-made trees for the export tests that the harness fixtures do not cover.

`write_raw`: bare DTensor shards saved by W gloo CPU processes, with empty trailing shards on purpose (run as a
script: python tests/test_export_trees.py OUT W PORT). `write_plain`: a W=1 run of plain tensors from a tiny
transformers Qwen2 model, as FSDP1 NO_SHARD saves them.
(No tests here; the module name only keeps it inside this project's lifecycle test files.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


# (name, global shape, shard dim): with W=3, 4 rows chunk 2/2/0 and 7 columns 3/3/1, as torch.chunk does.
RAW = (("model.norm.weight", (4,), 0), ("model.embed_tokens.weight", (5, 7), 1), ("lm_head.weight", (4, 6), 0))


def _raw_rank(rank: int, world: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    sd = {}
    for i, (name, shape, dim) in enumerate(RAW):
        full = torch.Generator().manual_seed(i)
        whole = torch.randn(shape, generator=full)
        local = torch.chunk(whole, world, dim=dim)
        piece = local[rank] if rank < len(local) else whole.narrow(dim, 0, 0)
        sd[name] = DTensor.from_local(
            piece.clone(), mesh, [Shard(dim)], run_check=False, shape=whole.shape, stride=whole.stride()
        )
    torch.save(sd, Path(out) / f"model_world_size_{world}_rank_{rank}.pt")
    dist.destroy_process_group()


def write_raw(out: Path, world: int = 3) -> Path:
    """A step dir of bare DTensor shards (no model, no transformers): empty trailing shards on purpose."""
    actor = Path(out) / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    (actor / "huggingface").mkdir()
    (actor / "huggingface" / "config.json").write_text('{"model_type": "llama", "tie_word_embeddings": false}')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(
        [sys.executable, __file__, str(actor), str(world), str(port)], check=True, timeout=300, capture_output=True
    )
    return actor.parent


def write_plain(out: Path) -> Path:
    """A W=1 run of plain tensors, as FSDP1 NO_SHARD saves them: `out/global_step_1/actor/...` (+ tracker)."""
    import torch
    from transformers import AutoModelForCausalLM

    run = Path(out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    actor = run / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    model.config.save_pretrained(actor / "huggingface")
    torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    return run


if __name__ == "__main__":
    import torch.multiprocessing as mp

    out, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(_raw_rank, args=(world, out, port), nprocs=world)
