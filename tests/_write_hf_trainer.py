"""Writes an HF Trainer output directory with transformers' own Trainer: DDP over 2 CPU processes on gloo.

Run as: python -m torch.distributed.run --nproc_per_node 2 tests/_write_hf_trainer.py OUTPUT_DIR. A 2-layer GPT-2
from a config (no download) trains for 6 steps with save_steps=2, so Trainer itself writes checkpoint-2/,
checkpoint-4/ (model.safetensors) and checkpoint-6/, whose weights save_pretrained writes sharded (max_shard_size, as
a large model's are: model-0000i-of-0000n.safetensors and model.safetensors.index.json). Everything else in each
folder is what Trainer writes: optimizer.pt, scheduler.pt, one rng_state_R.pth per rank, trainer_state.json,
training_args.bin, config.json, generation_config.json.
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main(out: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=out,
        max_steps=6,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_backend="gloo",
    )
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    save = model.save_pretrained

    def save_pretrained(*a, **kw):  # the last checkpoint's weights sharded, as save_pretrained shards a big model
        if trainer.state.global_step >= 6:
            kw["max_shard_size"] = "50KB"
        return save(*a, **kw)

    model.save_pretrained = save_pretrained
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
