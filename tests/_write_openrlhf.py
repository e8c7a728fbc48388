"""Writes an OpenRLHF PPO checkpoint tree with real DeepSpeed engines, following OpenRLHF's own save sequence.

OpenRLHF (Ray, vLLM, CUDA) cannot run here, so its save sequence is reproduced from its source (OpenRLHF main,
openrlhf/utils/deepspeed/deepspeed.py `DeepspeedStrategy.save_ckpt` and `save_model`, openrlhf/trainer/ppo_trainer.py
`save_logs_and_checkpoints`/`save_best_checkpoint`, openrlhf/trainer/ray/ppo_actor.py and ppo_critic.py
`save_checkpoint`): the saving itself is DeepSpeed's `engine.save_checkpoint`, the rest is rank 0's bookkeeping.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 tests/_write_openrlhf.py CKPT_PATH

Two engines (actor and critic: a 2-layer GPT-2 each, ZeRO-2 bf16 as OpenRLHF's default, torch's AdamW since
DeepSpeed's fused Adam needs CUDA) train 6 steps. Each even step N saves tag global_stepN into CKPT_PATH/_actor and
CKPT_PATH/_critic (`latest` rewritten by DeepSpeed, then `metric.json` written by rank 0 after the save, as
OpenRLHF does, holding the last eval's value), and the actor's HF weights into CKPT_PATH/global_stepN_hf
(`--ckpt.save_hf`). An eval follows each save (0.2, 0.1, 0.3): at steps 2 and 6 it improves on the best, so
best_global_stepN is saved after global_stepN (the older best removed first) and `latest` ends naming
best_global_step6. Rotation keeps max_num=2 regular tags (the no-metric ones first, then the worst metric, then the
oldest; best tags neither counted nor evicted), so global_step2 goes: left are global_step4, global_step6 and
best_global_step6 in each save directory. Finally each save directory is resumed the way OpenRLHF resumes it,
`load_checkpoint(dir)` with no tag, to prove the tree real.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

# as tests/_write_deepspeed.py: skip the CPU accelerator's shared-memory op (a JIT build at init)
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

MAX_NUM = 2
EVALS = {2: 0.2, 4: 0.1, 6: 0.3}
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1000,
    "bf16": {"enabled": True},
}


def engine(seed: int):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return deepspeed.initialize(model=model, optimizer=opt, config=CONFIG)[0]


def rank0() -> bool:
    return torch.distributed.get_rank() == 0


def metric_of(tag_dir: str):
    try:
        with open(os.path.join(tag_dir, "metric.json")) as f:
            value = json.load(f).get("metric_value")
        return None if value is None else float(value)
    except (OSError, ValueError, AttributeError):
        return None


def save_ckpt(eng, save_dir: str, tag: str, metric_value, metric_key) -> None:
    """OpenRLHF's save_ckpt: rank 0 drops the older best (for a best tag) and rotates regular tags, then every rank
    saves through DeepSpeed, then rank 0 writes metric.json into the tag."""
    is_best = tag.startswith("best")
    if rank0():
        os.makedirs(save_dir, exist_ok=True)
        if is_best:
            for d in os.listdir(save_dir):
                if d.startswith("best") and d != tag and os.path.isdir(os.path.join(save_dir, d)):
                    shutil.rmtree(os.path.join(save_dir, d))
        while not is_best:
            regular = [
                os.path.join(save_dir, d)
                for d in os.listdir(save_dir)
                if os.path.isdir(os.path.join(save_dir, d)) and not d.startswith("best")
            ]
            if len(regular) - MAX_NUM + 1 <= 0:
                break
            m = {p: metric_of(p) for p in regular}
            worst = min(regular, key=lambda p: (m[p] is not None, m[p] or float("-inf"), os.path.getmtime(p)))
            shutil.rmtree(worst)
    torch.distributed.barrier()
    eng.save_checkpoint(save_dir, tag=tag, client_state={"tag": tag}, save_latest=True)
    if rank0():
        with open(os.path.join(save_dir, tag, "metric.json"), "w") as f:
            json.dump({"metric_key": metric_key, "metric_value": metric_value}, f, indent=2, sort_keys=True)


def save_hf(eng, out: str) -> None:
    """OpenRLHF's save_model under ZeRO-2: rank 0 writes save_pretrained's weights and config."""
    state = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    if rank0():
        eng.module.save_pretrained(out, state_dict=state)
    torch.distributed.barrier()


def main(ckpt: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    actor, critic = engine(0), engine(1)
    key, best, latest_eval = "eval_pass1", float("-inf"), None
    for step in range(1, 7):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        for eng in (actor, critic):
            loss = eng(input_ids=ids, labels=ids).loss
            eng.backward(loss)
            eng.step()
        if step % 2:
            continue
        tag = f"global_step{step}"  # save_logs_and_checkpoints: the last eval's value, before this step's eval
        save_ckpt(actor, f"{ckpt}/_actor", tag, latest_eval, key if latest_eval is not None else None)
        save_ckpt(critic, f"{ckpt}/_critic", tag, latest_eval, key if latest_eval is not None else None)
        save_hf(actor, f"{ckpt}/{tag}_hf")
        latest_eval = EVALS[step]  # eval, then save_best_checkpoint
        if latest_eval > best:
            best = latest_eval
            save_ckpt(actor, f"{ckpt}/_actor", f"best_{tag}", latest_eval, key)
            save_ckpt(critic, f"{ckpt}/_critic", f"best_{tag}", latest_eval, key)
    torch.distributed.barrier()
    for name, seed in (("_actor", 0), ("_critic", 1)):  # OpenRLHF's load_ckpt: tag=None, `latest` chooses
        again = engine(seed)
        path, states = again.load_checkpoint(f"{ckpt}/{name}")
        assert path is not None and states["tag"] == "best_global_step6", (name, path, states)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
