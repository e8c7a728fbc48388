"""Writes an HF Trainer output directory with DeepSpeed on: transformers' own Trainer, ZeRO-2, 2 CPU processes.

Run as: DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_write_hf_deepspeed.py OUT.
A 2-layer GPT-2 from a config trains 4 steps with save_steps=2 and a ZeRO-2 config as TRL users write it ("auto"
values, torch's AdamW since DeepSpeed's fused Adam needs CUDA), so Trainer writes checkpoint-2/ and checkpoint-4/,
each with DeepSpeed's global_stepN/ (model and optimizer states), its `latest`, and Trainer's own files. Both are
then resumed by Trainer itself (resume_from_checkpoint, which runs DeepSpeed's load_checkpoint) to prove them real.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm.torch  # noqa: E402
import torch  # noqa: E402

# DeepSpeed's CPU accelerator JIT-compiles a shared-memory allreduce op at init (minutes on a cold machine, a C++
# compiler needed); it only speeds up collectives, and what save_checkpoint writes does not depend on it
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # (its attribute deepspeed.comm.torch is torch)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main(out: str) -> None:
    trainer(out, max_steps=4, save_steps=2).train()
    for step in (2, 4):  # resumed into a scratch directory, one step further, saving nothing
        t = trainer(f"{out}-resumed", max_steps=step + 1, save_steps=0)
        steps = Steps()
        t.add_callback(steps)
        t.train(resume_from_checkpoint=f"{out}/checkpoint-{step}")
        assert t.state.global_step == step + 1 and steps.n == 1, (t.state.global_step, steps.n)  # not from scratch


class Steps(TrainerCallback):
    n = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.n += 1


def trainer(out: str, *, max_steps: int, save_steps: int) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    ds = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
    }
    args = TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        save_steps=save_steps or 1,
        save_strategy="steps" if save_steps else "no",
        per_device_train_batch_size=4,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_backend="gloo",
        deepspeed=ds,
        optim="adamw_torch",
    )
    return Trainer(model=model, args=args, train_dataset=Rows())


if __name__ == "__main__":
    main(sys.argv[1])
