"""HF Trainer's checkpoint-N/ directories (layouts/hf_trainer.py, rules/hf_trainer.py).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # HF Trainer checkpoint-N/ (layouts/hf_trainer.py, rules/hf_trainer.py)
    Code(
        code="hf-missing-model",
        severity=E,
        explanation="checkpoint-N holds no model weights (model.safetensors, sharded safetensors + index, "
        "pytorch_model.bin, adapter): Trainer refuses it (Can't find a valid checkpoint)",
    ),
    Code(
        code="hf-shard-missing",
        severity=E,
        explanation="a weight shard named by the index or by another shard's -of-N name is absent: loading fails",
    ),
    Code(
        code="hf-index-missing",
        severity=E,
        explanation="sharded weights (model-0000x-of-0000y) without their .index.json: transformers cannot load them",
    ),
    Code(
        code="hf-index-invalid",
        severity=E,
        explanation="the weights' .index.json is not the JSON object with a weight_map that transformers writes",
        corrupts=True,
    ),
    Code(
        code="hf-index-mismatch",
        severity=E,
        explanation="model.safetensors.index.json disagrees with the shards' headers: a shard it does not name, or "
        "a tensor it names that no shard holds; transformers loads the rest and trains those weights from random init",
        corrupts=True,
    ),
    Code(
        code="hf-model-only",
        severity=W,
        explanation="a committed checkpoint-N with weights but no optimizer, scheduler or RNG state (save_only_model, "
        "or stripped to save space): whole for retention, never the answer of `latest` (a resume restarts the "
        "optimizer)",
    ),
    Code(
        code="hf-missing-optimizer",
        severity=E,
        explanation="no optimizer.pt: Trainer resumes with a fresh optimizer without a word (it loads optimizer and "
        "scheduler only when both files exist)",
    ),
    Code(
        code="hf-missing-scheduler",
        severity=E,
        explanation="no scheduler.pt: Trainer then skips the optimizer too and restarts the LR schedule, silently",
    ),
    Code(
        code="hf-missing-rng-state",
        severity=E,
        explanation="no rng_state.pth (or a rank's rng_state_R.pth): Trainer logs at info level and resumes with "
        "fresh RNG streams, so the run is not reproduced",
    ),
    Code(
        code="hf-fewer-ranks",
        severity=W,
        explanation="RNG states for fewer ranks than the checkpoint before: the highest ranks' rng_state_R.pth are "
        "missing (Trainer resumes those ranks with fresh RNG), or the run was resumed on fewer processes",
    ),
    Code(
        code="hf-missing-trainer-state",
        severity=E,
        explanation="no trainer_state.json (Trainer writes it last): resume restarts at step 0 from these weights",
    ),
    Code(
        code="hf-trainer-state-invalid",
        severity=E,
        explanation="trainer_state.json is not JSON with an integer global_step: Trainer fails to resume from it",
        corrupts=True,
    ),
    Code(
        code="hf-step-mismatch",
        severity=E,
        explanation="trainer_state.json's global_step differs from the N of checkpoint-N: the files are not one save",
    ),
    Code(
        code="hf-last-checkpoint-unusable",
        severity=W,
        explanation="the highest-numbered checkpoint-N, which resume_from_checkpoint=True (get_last_checkpoint) "
        "loads, is not complete; `ckpt-audit latest` names the newest complete one",
    ),
    Code(
        code="hf-state-invalid",
        severity=E,
        explanation="verify: a Trainer state file loads but lacks what resume reads (rng_state: python/numpy/cpu; "
        "optimizer: state/param_groups)",
    ),
    Code(
        code="hf-deepspeed-latest",
        severity=E,
        explanation="checkpoint-N holds DeepSpeed state (global_stepK/) but no `latest` naming one of its tags: "
        "Trainer resumes with load_checkpoint(checkpoint-N, tag=None), which finds nothing, and raises ValueError",
    ),
    Code(
        code="hf-deepspeed-no-weights",
        severity=INFO,
        explanation="checkpoint-N holds DeepSpeed state but no HF weights (ZeRO-3 saved without "
        "stage3_gather_16bit_weights_on_model_save): Trainer resumes it, but from_pretrained cannot load the folder; "
        "the weights must be exported from the ZeRO partitions",
    ),
    Code(
        code="training-args-pickle",
        severity=INFO,
        explanation="training_args.bin is a pickled TrainingArguments object: unpickling it runs transformers' "
        "code, so ckpt-audit never does and Trainer never loads it on resume (any other global in it is unsafe-pickle)",
    ),
)
