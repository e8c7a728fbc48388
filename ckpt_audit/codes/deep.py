"""Verify's deep checks (ckpt_audit/deep/) and the deep verdict a later scan carries forward
(rules/deep_verdict.py).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
    # a recorded deep verdict (rules/deep_verdict.py): verify's findings bind later scans while its files are unchanged
    Code(
        code="deep-verdict-kept",
        severity=INFO,
        explanation=(
            "findings an earlier verify made are carried forward: the files it read are unchanged, so the status is the"
            " worse of the scan's and verify's"
        ),
    ),
    Code(
        code="deep-verdict-stale",
        severity=INFO,
        explanation="a file an earlier verify read has changed (or was added or removed): its findings no longer bind",
    ),
    # verify (deep checks: ckpt_audit/deep/, each layout's as Layout.deep_checks names them)
    Code(
        code="not-loadable",
        severity=E,
        explanation=(
            "torch.load(weights_only=True; mmap=True for zip files) refuses or fails on the file: resume cannot "
            "read it either"
        ),
    ),
    Code(
        code="rank-keys-differ",
        severity=E,
        explanation=(
            "a rank's model shard holds a different key set from rank 0's: the ranks did not save the same model"
        ),
    ),
    Code(
        code="dtensor-mismatch",
        severity=E,
        explanation="a tensor is a DTensor on one rank and a plain tensor on another",
    ),
    Code(
        code="placement-mismatch",
        severity=E,
        explanation="a DTensor's placements or DeviceMesh differ across ranks",
        corrupts=True,
    ),
    Code(
        code="global-shape-mismatch", severity=E, explanation="ranks disagree on a tensor's global shape", corrupts=True
    ),
    Code(
        code="shard-shape-mismatch",
        severity=E,
        explanation=(
            "a rank's local shard is not the torch.chunk piece its placement gives: the shards do not tile the "
            "global tensor"
        ),
        corrupts=True,
    ),
    Code(
        code="mesh-config-mismatch",
        severity=E,
        explanation="the DeviceMesh size in a shard differs from fsdp_config.json's world_size",
    ),
    Code(
        code="mesh-names-unknown",
        severity=INFO,
        explanation="DeviceMesh dimension names are not verl's ('fsdp',) or ('ddp', 'fsdp')",
    ),
    Code(
        code="hsdp-replica-differs",
        severity=E,
        explanation="HSDP: two ranks holding the same fsdp shard (replicas over ddp) hold different bytes",
        corrupts=True,
    ),
    Code(
        code="tied-embedding-missing",
        severity=E,
        explanation=(
            "config.json ties word embeddings but only one of lm_head.weight / model.embed_tokens.weight is saved"
        ),
    ),
    Code(
        code="optimizer-param-count",
        severity=E,
        explanation="the optimizer's param_groups list a different number of parameters than the model shard holds",
    ),
    Code(
        code="optimizer-state-mismatch",
        severity=E,
        explanation=(
            "an optimizer state tensor (exp_avg, exp_avg_sq) differs from its parameter in local shape, global "
            "shape or placements"
        ),
    ),
    Code(
        code="optimizer-step-differs",
        severity=E,
        explanation=(
            "the AdamW step differs across parameters or ranks: the ranks did not take the same optimizer steps"
        ),
    ),
    Code(
        code="param-groups-differ",
        severity=E,
        explanation="param_groups (lr, betas, weight decay, ...) differ across ranks",
    ),
    Code(
        code="lr-scheduler-missing",
        severity=E,
        explanation="extra_state has no lr_scheduler entry; verl's loader requires it",
    ),
    Code(code="lr-scheduler-differs", severity=E, explanation="lr_scheduler.last_epoch differs across ranks"),
    Code(
        code="lr-scheduler-ahead",
        severity=E,
        explanation="lr_scheduler.last_epoch is past the checkpoint's step: the schedule and the step counter disagree",
    ),
    Code(
        code="lr-scheduler-behind",
        severity=W,
        explanation=(
            "lr_scheduler.last_epoch is behind the checkpoint's step (expected only for an actor with critic_warmup)"
        ),
    ),
    Code(
        code="optimizer-step-behind",
        severity=W,
        explanation=(
            "the optimizer's step is below the scheduler's last_epoch (steps skipped on non-finite gradients, or "
            "mismatched files)"
        ),
    ),
    Code(
        code="rng-missing",
        severity=W,
        explanation=(
            "extra_state has no rng entry, or no cuda stream on a CUDA run (verl skips what is absent): a resume "
            "is not reproducible"
        ),
    ),
    Code(
        code="dataloader-state-invalid",
        severity=E,
        explanation=(
            "data.pt is not a StatefulDataLoader state_dict the loader can resume from (a key missing or of the "
            "wrong kind: the first batch raises; empty or foreign: the epoch restarts)"
        ),
    ),
    # verify: what verl's load does with each file and its values (deep/structure.py, identity.py, values.py)
    Code(
        code="shard-rank-mismatch",
        severity=E,
        corrupts=True,
        explanation=(
            "a rank's shard holds another rank's pieces (its DeviceMesh coordinate, or the same bytes as that rank's "
            "shard): verl loads them silently and resumes with the wrong slice of every parameter"
        ),
    ),
    Code(
        code="model-state-invalid",
        severity=E,
        explanation="a model shard that is not a state dict of tensors: verl's model.load_state_dict raises",
    ),
    Code(
        code="optimizer-state-invalid",
        severity=E,
        explanation=(
            "an optimizer shard without torch's state/param_groups structure or Adam's per-parameter entries: "
            "verl's optimizer.load_state_dict (or the first step after it) raises"
        ),
    ),
    Code(
        code="optimizer-state-partial",
        severity=W,
        explanation=(
            "some parameters have no optimizer state: a resume starts their moments from zero (right only for "
            "parameters that never had a gradient)"
        ),
    ),
    Code(
        code="extra-state-invalid",
        severity=E,
        explanation=(
            "extra_state is not the dict verl reads (lr_scheduler state with lr_lambdas and last_epoch; rng with "
            "cpu, numpy and random): verl's load raises or silently restarts the schedule"
        ),
    ),
    Code(
        code="nonfinite-values",
        severity=E,
        explanation="NaN or Inf in weights or optimizer moments: verl loads them and training goes on from NaN",
    ),
    Code(
        code="optimizer-moments-zero",
        severity=E,
        explanation=(
            "Adam's exp_avg_sq is all zero after optimizer steps (alone, or with every moment of the shard): the "
            "state is lost and the first update after a resume is about 3x a full step in every coordinate"
        ),
    ),
    Code(
        code="unchanged-since-previous",
        severity=E,
        explanation=(
            "weights or moments bit-identical to the previous checkpoint's although the optimizer stepped with "
            "lr > 0 in between: a stale or copied save that resumes from the older state"
        ),
    ),
    Code(
        code="dcp-no-model",
        severity=E,
        explanation="a DCP save (torchtitan step-N, plain DCP) whose .metadata names no model key, only optimizer, "
        "lr_scheduler, dataloader or train_state: loading the model fails (Missing key in checkpoint state_dict)",
    ),
    Code(
        code="dcp-metadata-missing",
        severity=E,
        explanation="a DCP directory without .metadata: torch.distributed.checkpoint cannot load it",
    ),
    Code(code="dcp-no-data", severity=E, explanation="a DCP directory without any __R_k.distcp data file"),
    Code(
        code="dcp-metadata-invalid", severity=E, explanation=".metadata does not parse as DCP Metadata", corrupts=True
    ),
    Code(
        code="dcp-file-missing", severity=E, explanation=".metadata stores data in a .distcp file that does not exist"
    ),
    Code(
        code="dcp-range-outside-file",
        severity=E,
        explanation="a .metadata byte range runs past the end of its .distcp file (truncated)",
        corrupts=True,
    ),
    Code(
        code="dcp-chunk-gap",
        severity=E,
        explanation="a tensor's chunks in .metadata leave part of it stored nowhere",
        corrupts=True,
    ),
    Code(
        code="dcp-chunk-overlap",
        severity=E,
        explanation="a tensor's chunks in .metadata overlap or lie outside the tensor",
        corrupts=True,
    ),
    Code(
        code="dcp-chunk-unstored",
        severity=E,
        explanation="a chunk or object listed in .metadata has no storage entry",
        corrupts=True,
    ),
    Code(
        code="dcp-unreferenced-file",
        severity=W,
        explanation="a .distcp file that no .metadata entry points into (a leftover of another save)",
    ),
    Code(
        code="torchtitan-model-only",
        severity=W,
        explanation=(
            "a torchtitan step-N save without optimizer state (last_save_model_only): weights for export or eval; "
            "torchtitan's resume from it fails"
        ),
    ),
    Code(
        code="torchtitan-resume-broken",
        severity=E,
        explanation=(
            "the step-N torchtitan's auto-resume picks (the highest with a .metadata) is not complete: the restart "
            "fails, or loads damaged state"
        ),
    ),
    Code(
        code="torchtitan-stray-step",
        severity=W,
        explanation=(
            "a folder in a torchtitan checkpoint folder whose name contains step-N but is not step-N (step-5.bak): "
            "torchtitan still counts it as step N when resuming and purging"
        ),
    ),
    Code(
        code="torchtitan-seed",
        severity=INFO,
        explanation="torchtitan's step-0 seed checkpoint: model only, which is what torchtitan loads from step 0",
    ),
    Code(
        code="megatron-metadata-missing",
        severity=E,
        explanation=(
            "dist_ckpt/ has no metadata.json (written last): the save did not finish, or this node is not rank 0's"
        ),
    ),
    Code(
        code="megatron-backend-unknown",
        severity=E,
        explanation=(
            "dist_ckpt/metadata.json names no known backend (sharded_backend torch_dist/zarr, common_backend torch)"
        ),
    ),
    Code(
        code="megatron-common-missing",
        severity=E,
        explanation="dist_ckpt/ has no common.pt (rank 0's non-sharded state)",
    ),
    Code(
        code="megatron-model-missing",
        severity=E,
        explanation="dist_ckpt holds no model state and huggingface/ holds no weights: the model was not saved",
    ),
)
