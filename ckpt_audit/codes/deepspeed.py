"""DeepSpeed engine trees and OpenRLHF's tags on them (layouts/deepspeed.py, rules/deepspeed.py).

One entry per code, in docs/codes.md's order.
"""

from __future__ import annotations

from ckpt_audit.codes.entry import INFO, Code, E, W

TABLE: tuple[Code, ...] = (
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
)
