"""The scalars a DeepSpeed checkpoint file says about itself, from the restricted unpickler's tree (no torch).

model states (`mp_rank_MM_model_states.pt`, ZeRO-3's `zero_pp_rank_D_mp_rank_MM_model_states.pt`): top-level
`global_steps`, `dp_world_size`, `mp_world_size`, `ds_version`, and the ZeRO stage of its `ds_config`.
optimizer states (`[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`): `ds_version`, and in `optimizer_state_dict`
the `zero_stage` (a ZeroStageEnum record) and `partition_count` (an int, or one per parameter group).
MoE model states (engine._save_moe_checkpoint): `num_experts`, one per DeepSpeed MoE layer in module order (an int in
the old one-layer format), `ds_autoep_layers` when AutoEP layers wrote them, and, at ZeRO-0 where the optimizer is in
the model states, the expert-parallel size in the name DeepSpeed gives the experts' parameter group (`ep_size_N`).
Pipeline model states (a PipelineEngine's; its layers are in `layer_XX-*model_states.pt`): `module` is None, the
tensor-slice degree is `checkpoint_parallel_dimensions`' `tp_degree`, and at ZeRO >= 1 `param_shapes` names the
stage's parameters `<layer index>.<name>`: the layers with parameters that stage owns.
The layout judges the checkpoint's degrees and its consistency by these, never by file indices.
"""

from __future__ import annotations

import re
from typing import Any, TypeGuard

from ckpt_audit.readers.unpickler import is_record

ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
_TOP_INTS = ("global_steps", "dp_world_size", "mp_world_size")
EP_GROUP = re.compile(r"ep_size_(\d{1,9})")  # deepspeed.moe.utils' name of an expert parameter group


def read_meta(tree: Any) -> tuple[tuple[str, int | str], ...]:
    """(key, value) pairs for what the file holds of the keys above; () for anything that is not DeepSpeed's."""
    if not isinstance(tree, dict) or not isinstance(tree.get("ds_version"), str):
        return ()
    out: dict[str, int | str] = {"ds_version": tree["ds_version"][:40]}
    for key in _TOP_INTS:
        if _is_int(v := tree.get(key)):
            out[key] = v
    cfg = tree.get("ds_config")
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    if isinstance(cfg, dict) and _is_int(stage := (zero if isinstance(zero, dict) else {}).get("stage", 0)):
        out["zero_stage"] = stage  # DeepSpeed's default is stage 0 when the config names none
    experts = tree.get("num_experts")
    if _is_int(experts):
        out["num_experts"] = experts
    elif isinstance(experts, list) and experts and all(_is_int(n) for n in experts):
        out["num_experts"] = f"[{','.join(map(str, experts))}]"  # layer L has the L-th count
    if isinstance(autoep := tree.get("ds_autoep_layers"), list) and autoep:
        out["autoep"] = 1
    groups = tree["optimizer"].get("param_groups") if isinstance(tree.get("optimizer"), dict) else None
    eps = [
        int(m.group(1))
        for g in (groups if isinstance(groups, list) else ())
        if isinstance(g, dict) and isinstance(g.get("name"), str) and (m := EP_GROUP.fullmatch(g["name"]))
    ]
    if eps:
        out["ep_size"] = max(eps)  # the load reads the expert-parallel rank of the largest group
    if "module" in tree and tree["module"] is None:
        out["pipeline"] = 1
        shapes = tree.get("param_shapes")
        layers = {
            int(head)
            for g in (shapes if isinstance(shapes, list) else ())
            if isinstance(g, dict)
            for k in g
            if isinstance(k, str) and (head := k.split(".", 1)[0]).isdigit() and len(head) < 10
        }
        if layers:
            out["pipe_layers"] = f"[{','.join(map(str, sorted(layers)))}]"
    dims = tree.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and _is_int(tp := dims.get("tp_degree")):
        out["tp_degree"] = tp
    osd = tree.get("optimizer_state_dict")
    if isinstance(osd, dict):
        rec: Any = osd.get("zero_stage")
        if is_record(rec, ZERO_STAGE) and len(rec.args) == 1 and _is_int(rec.args[0]):
            out["zero_stage"] = rec.args[0]
        pc = osd.get("partition_count")
        counts: set[Any] = set(pc) if isinstance(pc, (list, tuple)) else {pc}
        if counts and all(_is_int(c) for c in counts):
            # one per parameter group, all equal when saved by one world; a mix is reported as it is
            out["partition_count"] = counts.pop() if len(counts) == 1 else ",".join(map(str, sorted(counts)))
    return tuple(out.items())


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)
