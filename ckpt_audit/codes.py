"""The registry of finding codes: each stable slug with its severity and a one-line explanation.

`docs/codes.md` is generated from here (`python scripts/gen_codes_doc.py`; tests/test_docs.py fails while it is
stale) and the TUI reads explanations from here; rules construct findings through `finding()`, so a code that is
not registered fails loudly in tests instead of leaking an undocumented slug. Other parts of ckpt-audit
(verify's deep rules, lifecycle) add their codes to `CODES` below, one line each.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_audit.models import Finding, Severity

E, W, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO


@dataclass(frozen=True, slots=True, kw_only=True)
class Code:
    """One registered finding code: its slug, severity and the one-line explanation docs/codes.md shows."""

    code: str
    severity: Severity
    explanation: str
    corrupts: bool = False  # an ERROR of this code makes the checkpoint "corrupt" (not merely "incomplete")


_TABLE: tuple[Code, ...] = (
    # shard sets
    Code(
        code="missing-rank",
        severity=E,
        explanation="a rank's shard file is absent: resume dies with FileNotFoundError on that rank",
    ),
    Code(
        code="world-size-mismatch",
        severity=E,
        explanation="fsdp_config.json's world_size differs from the W in the shard file names",
    ),
    Code(
        code="stale-world-size",
        severity=W,
        explanation=(
            "a second shard set with another world size sits beside the current one; it misleads the merger and a "
            "resume at that W"
        ),
    ),
    Code(
        code="missing-model",
        severity=E,
        explanation="a role directory has optimizer or extra-state shards but no model shards",
    ),
    Code(
        code="missing-optimizer",
        severity=E,
        explanation="model shards without any optimizer shards: resume cannot restore the optimizer",
    ),
    Code(
        code="missing-extra-state",
        severity=E,
        explanation="model shards without extra_state shards: resume cannot restore the LR scheduler and RNG",
    ),
    Code(
        code="missing-dataloader-state",
        severity=W,
        explanation="no data.pt in the step directory: a resume restarts the epoch and repeats data",
    ),
    Code(
        code="missing-fsdp-config",
        severity=INFO,
        explanation="no fsdp_config.json (written since verl v0.4.1): the current model merger refuses the directory",
    ),
    Code(code="fsdp-config-invalid", severity=W, explanation="fsdp_config.json is not the JSON object verl writes"),
    Code(code="empty-role", severity=W, explanation="a role directory (actor/, critic/) holds no shard files"),
    Code(
        code="mesh-size-mismatch",
        severity=E,
        explanation=(
            "the DeviceMesh recorded in a shard has a size that matches neither the file name's W nor an HSDP split"
            " of it"
        ),
    ),
    # per file
    Code(
        code="truncated",
        severity=E,
        explanation="the file is cut short: its zip directory is missing or points past the end",
        corrupts=True,
    ),
    Code(code="zero-byte", severity=E, explanation="the file is empty (0 bytes)", corrupts=True),
    Code(
        code="crc-mismatch",
        severity=E,
        explanation="a zip entry's bytes do not match the CRC-32 torch recorded: silent corruption (bit flip)",
        corrupts=True,
    ),
    Code(
        code="hash-drift",
        severity=E,
        explanation=(
            "a re-read (scrub, verify, --rehash) found the content changed while size, mtime and inode did not (bit"
            " rot or an in-place rewrite)"
        ),
        corrupts=True,
    ),
    Code(
        code="scrub-overdue",
        severity=W,
        explanation=(
            "files last verified by content a scrub period or more ago were not re-read: --scrub-budget is too "
            "small for --scrub-period"
        ),
    ),
    Code(
        code="not-a-zip",
        severity=E,
        explanation="a .pt file that is not a torch zip archive (garbage or another format)",
        corrupts=True,
    ),
    Code(
        code="bad-zip",
        severity=E,
        explanation="the zip structure is damaged (inconsistent directory or local headers)",
        corrupts=True,
    ),
    Code(
        code="legacy-pickle-format",
        severity=INFO,
        explanation="a .pt saved in torch's legacy non-zip format: no CRCs to check",
    ),
    Code(
        code="raw-pickle",
        severity=E,
        explanation=(
            "a .pt that is a bare pickle stream, not a torch.save file: torch.load unpickles its first object and "
            "then refuses it"
        ),
    ),
    Code(
        code="not-a-torch-archive",
        severity=E,
        explanation="a zip without torch's data.pkl/version records",
        corrupts=True,
    ),
    Code(
        code="zip-local-header-mismatch",
        severity=W,
        explanation=(
            "a zip entry's local header disagrees with its central-directory record (name, method, size or CRC): "
            "torch.load reads the directory and loads it, but the headers were damaged or rewritten"
        ),
    ),
    Code(
        code="pickle-over-bounds",
        severity=E,
        explanation=(
            "a pickle asks for more than a checkpoint ever holds (a constructor with a huge size, nesting deeper than "
            "the bound): loading it would exhaust memory or crash the loader; the checkpoint is unsafe to resume"
        ),
    ),
    Code(
        code="zip-prefix-mismatch",
        severity=W,
        explanation=(
            "the folder inside the zip differs from the file stem: the shard was renamed or copied from elsewhere"
        ),
    ),
    Code(
        code="bad-pickle",
        severity=E,
        explanation="data.pkl cannot be parsed by the restricted unpickler",
        corrupts=True,
    ),
    Code(
        code="unsafe-pickle",
        severity=E,
        explanation=(
            "a pickle in the file (zip, legacy or raw) names a global outside the allowlist: loading it as verl "
            "loads extra_state and data.pt would run code; the checkpoint is unsafe to resume"
        ),
    ),
    Code(
        code="storage-size-mismatch",
        severity=E,
        explanation="a tensor storage's size in data.pkl disagrees with its zip entry, or an entry is missing",
        corrupts=True,
    ),
    Code(code="unreadable", severity=E, explanation="the file or directory cannot be read (permissions, I/O error)"),
    Code(
        code="file-changed-during-scan",
        severity=W,
        explanation="the file's size or mtime moved while it was being read: it is being written",
    ),
    Code(code="file-vanished", severity=W, explanation="the file was listed but disappeared before it could be read"),
    # tracker and step names
    Code(
        code="tracker-missing",
        severity=W,
        explanation="no latest_checkpointed_iteration.txt: resume_mode=auto starts training from scratch",
    ),
    Code(
        code="tracker-empty",
        severity=E,
        explanation="the tracker file is empty (crash while writing it): resume raises ValueError",
    ),
    Code(
        code="tracker-invalid",
        severity=E,
        explanation="the tracker does not hold a decimal step number: resume raises ValueError",
    ),
    Code(
        code="tracker-dangling",
        severity=E,
        explanation=(
            "the tracker names a step that is missing or not complete: verl silently trains from scratch or fails "
            "to load"
        ),
    ),
    Code(
        code="tracker-unread",
        severity=W,
        explanation=(
            "the tracker exists but could not be read (permission, I/O error, a link out of the root, past 64 KiB):"
            " which step resume loads is unknown, so prune keeps every checkpoint of the run"
        ),
    ),
    Code(
        code="tracker-behind",
        severity=W,
        explanation=(
            "whole checkpoints are newer than the tracker's step: resume loads an older one; prune keeps them "
            "(protected) until the tracker moves or a person decides"
        ),
    ),
    # saves that finish out of order (rules/save_order.py)
    Code(
        code="untracked-complete",
        severity=W,  # as tracker-missing: a job resuming with resume_path is unharmed
        explanation="complete checkpoints but no tracker (FSDP async_save never writes it, verl #7952): "
        "resume_mode=auto trains from step 0 and overwrites them; fix-tracker repairs it",
    ),
    Code(
        code="tracker-published-early",
        severity=W,
        explanation="the tracker names a checkpoint whose files were written after it and are still changing "
        "(async save, verl #8000): a crash now resumes from a half-written checkpoint",
    ),
    Code(
        code="remote-copy-unfinished",
        severity=E,
        explanation="the run's saved config copies every save to HDFS (default_hdfs_dir) but the checkpoint the "
        "tracker published is not complete locally: the remote copy was made from an unfinished save",
    ),
    Code(
        code="step-out-of-range",
        severity=W,
        explanation="a step directory's number is past 2^63-1: it cannot be a training step and is not catalogued",
    ),
    Code(
        code="misnamed-step",
        severity=W,
        explanation="a step directory named global_steps_N (the docs' typo) or similar: verl never reads it",
    ),
    Code(
        code="in-progress",
        severity=INFO,
        explanation=(
            "the checkpoint is being written now (recent and not yet committed by the tracker); judged on a later scan"
        ),
    ),
    Code(
        code="husk",
        severity=INFO,
        explanation="only data.pt (or nothing resumable) is left: the usual remains of retention",
    ),
    Code(code="no-complete-checkpoint", severity=E, explanation="the run has checkpoints but none is complete"),
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
    # verl's Megatron layout v2 (verl >= 0.9.1; rules/megatron_v2.py, docs/megatron.md)
    Code(
        code="megatron-v2-manifest-missing",
        severity=E,
        explanation="a v2 role directory (model/, optimizer/, extra/) without ckpt_contents.json, which verl writes "
        "last: the save did not finish (in progress while young)",
    ),
    Code(
        code="megatron-v2-manifest-invalid",
        severity=E,
        explanation="ckpt_contents.json is not JSON, not schema 2 of framework megatron, or names a path outside the "
        "role directory: what the save holds is unknown",
    ),
    Code(
        code="megatron-v2-content-missing",
        severity=E,
        explanation="a content ckpt_contents.json lists is absent or empty (or an HF content lacks its config or "
        "weights): verl's load of it fails",
    ),
    Code(
        code="megatron-v2-step-mismatch",
        severity=E,
        explanation="ckpt_contents.json names another global_step than its directory (a copied or renamed step): "
        "verl resumes that step's state under this step's number",
    ),
    Code(
        code="megatron-v2-role-mismatch",
        severity=E,
        explanation="ckpt_contents.json names another role than its directory",
    ),
    Code(
        code="megatron-old-layout",
        severity=W,
        explanation="the pre-v2 Megatron layout (dist_ckpt/ directly under the role): whole, but verl >= 0.9.1 "
        "refuses to load it until verl's migrate_megatron_checkpoint_layout.py has run; never the answer of `latest`",
    ),
    Code(
        code="megatron-migrated",
        severity=INFO,
        explanation="a role directory migrated by verl's script: model/, optimizer/, extra/ dist_ckpt mirror the old "
        "dist_ckpt/ (hardlinked files counted once), no ckpt_contents.json",
    ),
    Code(
        code="megatron-link-dangling",
        severity=E,
        explanation="a symbolic link in a Megatron v2 role (verl's migration script in symlink mode makes them) leads "
        "to nothing under the scanned roots: verl's load reads through it and fails (the run was moved or copied)",
    ),
    Code(
        code="megatron-link-absolute",
        severity=W,
        explanation="a symbolic link in a Megatron v2 role is absolute or leads out of its run (verl's migration "
        "script in symlink mode): it breaks when the run is moved, and a copy of the run reads the original's files",
    ),
    Code(
        code="fsdp-huggingface-moved",
        severity=W,
        explanation="verl's Megatron migration script (--checkpoint-root --all-steps) moved an FSDP role's "
        "huggingface/ to model/huggingface/: verl's FSDP resume does not read it, but its model merger and export do",
    ),
    Code(
        code="distcp-crc-mismatch",
        severity=E,
        explanation=(
            "an item of a .distcp (a torch.save zip) fails its CRC-32: DCP and megatron-core load it silently with"
            " changed values"
        ),
        corrupts=True,
    ),
    Code(
        code="distcp-item-invalid",
        severity=E,
        explanation="the bytes .metadata gives for an item of a .distcp are not the torch.save zip DCP wrote there",
        corrupts=True,
    ),
    Code(
        code="megatron-integrity-mismatch",
        severity=E,
        explanation="a file's SHA-256 differs from dist_ckpt/integrity.json (Megatron's verify_integrity load refuses)",
        corrupts=True,
    ),
    Code(
        code="megatron-integrity-file-missing",
        severity=E,
        explanation="a file dist_ckpt/integrity.json lists is gone",
    ),
    Code(
        code="megatron-integrity-invalid",
        severity=E,
        explanation="dist_ckpt/integrity.json is not JSON with 'files', or names a hash algorithm other than sha256",
    ),
    Code(
        code="safetensors-header-invalid",
        severity=E,
        explanation="a .safetensors header is unreadable (length past the file end, not JSON, malformed entry)",
        corrupts=True,
    ),
    Code(
        code="safetensors-offsets",
        severity=E,
        explanation=(
            "a .safetensors tensor's dtype x shape disagrees with its offsets, or offsets leave gaps/overlaps or do"
            " not end at the file size"
        ),
        corrupts=True,
    ),
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
    # DeepSpeed engine trees: <save_dir>/latest + tag directories (layouts/deepspeed.py, rules/deepspeed.py)
    Code(
        code="ds-missing-shard",
        severity=E,
        explanation="a file DeepSpeed's load_checkpoint opens for this tag (by the ZeRO stage and the data- and "
        "model-parallel degrees its own files record) is absent: that rank's resume raises FileNotFoundError",
    ),
    Code(
        code="ds-mixed-shards",
        severity=E,
        explanation="the tag's files disagree on what they record (global_steps against the tag's N, ds_version, "
        "zero_stage, dp_world_size, partition_count): files of two saves or two world sizes are mixed; DeepSpeed "
        "loads them without a word or fails on the world size",
        corrupts=True,
    ),
    Code(
        code="ds-mixed-names",
        severity=E,
        explanation="optimizer shards spelled both bf16_zero_pp_rank_* and zero_pp_rank_*: the engine opens one "
        "spelling for every rank, so one set is missing to it",
    ),
    Code(
        code="ds-degrees-unknown",
        severity=E,
        explanation="no file of the tag records its ZeRO stage or data-parallel degree: which files a resume needs "
        "cannot be told, so it is not called complete",
    ),
    Code(
        code="ds-extra-shard",
        severity=W,
        explanation="a shard for a rank beyond the degrees the checkpoint records (a save from a larger world left "
        "behind): load_checkpoint never opens it, zero_to_fp32 may trip over it",
    ),
    Code(
        code="ds-pipe-layer-gap",
        severity=W,
        explanation="a DeepSpeed pipeline tag has no layer_XX file for an index between others and nothing it "
        "records says whether that layer has state: a function layer has no file, a module's missing file makes its "
        "stage's load_checkpoint fail",
    ),
    Code(
        code="ds-moe-ep-unknown",
        severity=W,
        explanation="a ZeRO-0 MoE checkpoint whose files do not record the expert-parallel size (no optimizer "
        "group named ep_size_N): only expert-parallel rank 0's expp_rank optimizer file is required, so a "
        "missing one of another rank is not seen",
    ),
    Code(
        code="ds-tag-unplaced",
        severity=W,
        explanation="a tag with a custom name whose files record no single global_steps (its model states are "
        "missing or unreadable): no step to file it under, so it is not judged, and prune never touches it",
    ),
    Code(
        code="ds-optim-step-mismatch",
        severity=E,
        explanation="verify: the optimizer shards of one tag record different optimizer steps (AdamW's step): a "
        "shard from another save of the same world size; DeepSpeed loads it without a word",
        corrupts=True,
    ),
    Code(
        code="ds-partition-mismatch",
        severity=E,
        explanation="verify: the flat fp32 optimizer partitions do not cover the model states' param_shapes as "
        "DeepSpeed lays them out (equal per rank; ZeRO 1/2 sum aligned to 2 x dp, ZeRO-3 ceil(numel/dp) each): "
        "zero_to_fp32 raises and a resume loads the wrong slices",
        corrupts=True,
    ),
    Code(
        code="ds-replica-mismatch",
        severity=E,
        explanation="verify: a tensor every rank writes as a copy of one value (ZeRO-3's non-partitioned tensors, "
        "parameters the checkpoint names as tensor-parallel replicated) differs between ranks",
        corrupts=True,
    ),
    Code(
        code="openrlhf-pair-missing",
        severity=E,
        explanation="an OpenRLHF tag held by only one of _actor/ and _critic/: resuming it loads the actor and the "
        "critic from different steps",
    ),
    Code(
        code="openrlhf-latest-differs",
        severity=E,
        explanation="OpenRLHF's _actor/latest and _critic/latest name different tags: its resume (load_checkpoint "
        "with no tag, each) loads the actor and the critic from different steps",
    ),
    Code(
        code="openrlhf-metric-missing",
        severity=W,
        explanation="an OpenRLHF tag without the metric.json OpenRLHF writes after DeepSpeed's save: the save was cut "
        "in between (the tag loads), or an older OpenRLHF; its own rotation deletes such a tag first",
    ),
    Code(
        code="openrlhf-hf-export",
        severity=INFO,
        explanation="<tag>_hf/ directories beside OpenRLHF's _actor/: the actor's HF weights it exported, not "
        "checkpoints a resume loads",
    ),
    Code(
        code="ds-universal",
        severity=INFO,
        explanation="a DeepSpeed universal checkpoint (ds_to_universal's zero/ folder): only an engine with "
        "checkpoint.load_universal loads it, through latest_universal; `latest` never answers it and fix-tracker "
        "never writes it",
    ),
    Code(
        code="ds-latest-universal-target",
        severity=INFO,
        explanation="the tag DeepSpeed's latest_universal names: an engine with checkpoint.load_universal resumes it, "
        "so prune keeps it as a tracker target",
    ),
    Code(
        code="ds-latest-missing",
        severity=W,
        explanation="no `latest` file: load_checkpoint(tag=None) logs a warning and returns (None, None), so the "
        "engine trains from scratch unless a tag is passed",
    ),
    Code(
        code="ds-latest-dangling",
        severity=E,
        explanation="`latest` names a tag that is absent or not complete: load_checkpoint(tag=None) fails or "
        "loses state",
    ),
    Code(
        code="ds-latest-behind",
        severity=W,
        explanation="whole tags are newer than the one `latest` names: load_checkpoint(tag=None) resumes from the "
        "older one (a save that died before it rewrote `latest`)",
    ),
    # the walk
    Code(
        code="no-runs",
        severity=W,
        explanation="a root holds no checkpoint run that any layout recognises (wrong path, or an unmounted disk)",
    ),
    Code(
        code="symlink-outside-root",
        severity=W,
        explanation="a symbolic link points outside the scanned root; not followed",
    ),
    Code(
        code="symlink-loop",
        severity=W,
        explanation="a symbolic link leads back to a directory already being walked; not followed again",
    ),
    Code(code="broken-symlink", severity=W, explanation="a symbolic link whose target does not exist"),
    # object stores (ckpt_audit.remote, docs/remote.md)
    Code(
        code="remote-checksum-mismatch",
        severity=E,
        explanation="an object's size or store checksum differs from the catalogued local copy of the same file",
        corrupts=True,
    ),
    Code(
        code="remote-unverified",
        severity=W,
        explanation="an object judged by listing alone (no catalogued checksum, or only a composite one): its "
        "checkpoint is unknown until --read-data reads it",
    ),
    Code(
        code="upload-in-progress",
        severity=W,
        explanation="a multipart upload under the prefix was begun and not completed: its checkpoint is unknown",
    ),
    Code(
        code="prune-leftover",
        severity=INFO,
        explanation=(
            "an interrupted prune left an entry renamed to .ckpt-audit-trash-*: it is not a checkpoint any more, is"
            " not hashed, and the next prune deletes it"
        ),
    ),
    Code(
        code="non-utf8-name",
        severity=W,
        explanation="a file or directory name is not valid UTF-8; it is reported but not catalogued",
    ),
    # continuity of training metrics (ckpt-audit continuity)
    Code(
        code="metric-jump",
        severity=E,
        explanation=(
            "after a resume the watched metric left its recent trend by more than --threshold times its own noise "
            "(MAD): the resume did not restore the training state"
        ),
    ),
    Code(
        code="step-duplicated",
        severity=W,
        explanation="a step was logged twice: by a double log line, or a resume from step N that counted N again",
    ),
    Code(
        code="step-skipped",
        severity=W,
        explanation=(
            "steps are missing from the log: the counter jumped, or a resume started counting past the checkpoint "
            "it loaded"
        ),
    ),
    Code(
        code="resumed-from-older",
        severity=W,
        explanation=(
            "a resume loaded an older checkpoint than the newest complete one it had: the steps in between were "
            "silently thrown away"
        ),
    ),
    Code(
        code="steps-redone",
        severity=INFO,
        explanation=(
            "steps logged before a crash were trained again after resuming from the last checkpoint (expected after"
            " a crash between saves)"
        ),
    ),
    Code(
        code="resume-trained-nothing",
        severity=W,
        explanation="an attempt after a resume logged no training step: at an epoch boundary verl restores an "
        "exhausted dataloader and exits 0 having trained zero steps (verl #5725)",
    ),
    Code(
        code="metric-window-short", severity=INFO, explanation="too few points before or after a resume to judge a jump"
    ),
    Code(
        code="metrics-bad-line",
        severity=W,
        explanation="a metrics log line could not be parsed (cut by a crash, or not a step record); it was skipped",
    ),
    # export (ckpt_audit.lifecycle.export_model): is the export a model transformers loads as written?
    Code(
        code="export-no-config",
        severity=E,
        explanation="the export has no readable config.json (the step has no huggingface/): transformers cannot "
        "load it; export refuses unless --allow-unverified",
    ),
    Code(
        code="export-config-mismatch",
        severity=E,
        explanation="config.json disagrees with the exported tensors (names, shapes, dtype or tied embeddings): "
        "transformers would fail, or fill what is missing with random weights; export refuses unless "
        "--allow-unverified",
    ),
    Code(
        code="export-load-failed",
        severity=E,
        explanation="transformers' own load of the export failed, reported missing or unexpected weights, or "
        "gave tensors that differ from the exported ones; export refuses unless --allow-unverified",
    ),
    # scan --ray (ckpt_audit.cluster): node-local placement
    Code(
        code="ranks-spread-over-nodes",
        severity=INFO,
        explanation="no one node holds all of a checkpoint's ranks (normal for node-local saves); export and a "
        "single-node resume need them gathered first",
    ),
    Code(
        code="replica-differs",
        severity=E,
        explanation="the same file (or tracker) is on several nodes with different content: which one a resume loads "
        "is chance; a conflict, not corruption: the checkpoint is unknown when every file is whole on some node, and "
        "prune keeps it",
    ),
    Code(
        code="node-silent",
        severity=W,
        explanation="a Ray node did not answer the scan: checkpoints it may complete are unknown, not incomplete",
    ),
    Code(
        code="node-gone",
        severity=W,
        explanation=(
            "a Ray node silent for longer than --node-gone-after held the only catalogued copies of some of this "
            "checkpoint's files: unknown (prune keeps it) until the node answers or the files are found elsewhere"
        ),
    ),
)

CODES: dict[str, Code] = {c.code: c for c in _TABLE}

# What a code means beyond its severity, each set owned here beside the registry (tests/test_codes_asserted.py
# checks every name in them is registered); `Code.corrupts` is the one flag kept on the entries themselves.
# "this entry was not read", as opposed to "read and bad": a checkpoint holding one is unknown, never disposable
# (a broken link was read: its target is missing)
UNREAD_CODES = frozenset(
    {
        "unreadable",
        "symlink-outside-root",
        "symlink-loop",
        "file-vanished",
        "non-utf8-name",
        "remote-unverified",  # an object store's object judged by its listing alone (ckpt_audit.remote)
        "upload-in-progress",
    }
)
# "resuming from this would run code": a pickle naming a global outside the allowlist, or one whose load would
# exhaust memory or the stack
UNSAFE_CODES = frozenset({"unsafe-pickle", "pickle-over-bounds"})
# what the zip rules (a digest's zip error, CRCs, prefix) and the structure rules can say of a file
ZIP_RULE_CODES = frozenset(
    {
        "bad-zip",
        "truncated",
        "not-a-zip",
        "zip-prefix-mismatch",
        "not-a-torch-archive",
        "bad-pickle",
        "storage-size-mismatch",
        "crc-mismatch",
        "unsafe-pickle",
        "legacy-pickle-format",
        "raw-pickle",
    }
)
# what the scan says of a .distcp's items' pickles (read_item_pickles), which the zip rules never said of one
ITEM_PICKLE_CODES = frozenset({"unsafe-pickle", "pickle-over-bounds"})
# what the scan reports per file and verify again per tensor: both are kept (the scan's finding has no tensor)
NAMED_BY_VERIFY = frozenset({"distcp-crc-mismatch", "distcp-item-invalid"})
FLAG_SETS = {
    "UNREAD_CODES": UNREAD_CODES,
    "UNSAFE_CODES": UNSAFE_CODES,
    "ZIP_RULE_CODES": ZIP_RULE_CODES,
    "ITEM_PICKLE_CODES": ITEM_PICKLE_CODES,
    "NAMED_BY_VERIFY": NAMED_BY_VERIFY,
}


def finding(code: str, path: str, message: str, *, rank: int | None = None, tensor: str | None = None) -> Finding:
    """A Finding with the registered severity of `code` (KeyError for an unregistered code)."""
    return Finding(severity=CODES[code].severity, code=code, path=path, message=message, rank=rank, tensor=tensor)


def explain(code: str) -> str:
    entry = CODES.get(code)
    return entry.explanation if entry is not None else ""
