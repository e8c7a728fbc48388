"""Write a bare DeepSpeed engine tree with DeepSpeed itself, then load every save back with DeepSpeed's own
`load_checkpoint` to prove the tree is real. Run as 2 processes by torch.distributed.run (CPU accelerator, gloo):

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_write_deepspeed.py DEST STAGE [bf16] \\
        [universal]

DEST/global_step2, global_step4, global_step6 and `latest` (naming global_step6), ZeRO stage STAGE (0 to 3),
torch's AdamW as the client optimizer (DeepSpeed's fused Adam needs CUDA), fp32 unless `bf16` is given. With
`universal`, the saves record the (empty) `universal_checkpoint_info` DeepSpeed's converter requires, global_step6
is converted by DeepSpeed's own `ds_to_universal` (DEST/global_step6_universal/ and DEST/latest_universal), and an
engine with `checkpoint.load_universal` resumes it through `latest_universal`.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

# DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce op at init (minutes on a cold machine, a C++
# compiler needed); it only speeds up collectives, and what save_checkpoint writes does not depend on it
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # (its attribute deepspeed.comm.torch is torch)
import torch  # noqa: E402


def main(dest: str, stage: int, bf16: bool = False, universal: bool = False) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "bf16": {"enabled": bf16},
    }

    def engine(load_universal: bool = False):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = {**config, "checkpoint": {"load_universal": True}} if load_universal else config
        return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]

    eng = engine()
    for step in range(1, 7):
        x = torch.randn(2, 8, dtype=torch.bfloat16 if bf16 else torch.float32)
        loss = eng(x).pow(2).mean()
        eng.backward(loss)
        eng.step()
        if step % 2 == 0:
            # tag global_step{N}; `latest` rewritten after each save
            eng.save_checkpoint(dest, client_state={"universal_checkpoint_info": {}} if universal else {})
    # every save loads back through DeepSpeed's own resume, optimizer included
    for tag in ("global_step2", "global_step4", "global_step6"):
        again = engine()
        path, _ = again.load_checkpoint(dest, tag=tag)
        assert path is not None and again.global_steps == int(tag.removeprefix("global_step")), (tag, path)
    torch.distributed.barrier()
    if universal:
        if torch.distributed.get_rank() == 0:
            convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--num_extract_workers", "1"]
            convert += ["--num_merge_workers", "1", "--input_folder", f"{dest}/global_step6"]
            subprocess.run([*convert, "--output_folder", f"{dest}/global_step6_universal"], check=True)
        torch.distributed.barrier()
        again = engine(load_universal=True)
        path, _ = again.load_checkpoint(dest)  # tag=None: the tag `latest_universal` names
        assert path == f"{dest}/global_step6_universal/mp_rank_00_model_states.pt" and again.global_steps == 6, path
        torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), bf16="bf16" in sys.argv[3:], universal="universal" in sys.argv[3:])
