"""The flags a Megatron `dist_ckpt/common.pt` records of its own content, from the restricted unpickler's tree (no
torch).

megatron-core's `dist_checkpointing.save(..., content_metadata=...)` keeps that dict in `common.pt` under
`content_metadata` (serialization._CONTENT_METADATA_KEY), and its `load_content_metadata` reads it back. verl
passes `_build_sharded_state_dict_metadata()` on every save and, at load, builds the sharded state dicts from the
checkpoint's own copy: `distrib_optim_sharding_type` (the distributed optimizer's format: `dp_reshardable`, or
`fully_reshardable` when verl's `dist_ckpt_optim_fully_reshardable` is set), `singleton_local_shards`, ...
"""

from __future__ import annotations

from typing import Any

KEY = "content_metadata"
_MAX_ITEMS = 16  # a handful in megatron-core 0.16 / verl 0.9.1; a bound, not a schema


def read_meta(tree: Any) -> tuple[tuple[str, int | str], ...]:
    """(flag, value) for each scalar entry of `content_metadata`, sorted; () for a file without one."""
    doc = tree.get(KEY) if isinstance(tree, dict) else None
    if not isinstance(doc, dict):
        return ()
    out = [
        (k, v[:40] if isinstance(v, str) else v)
        for k, v in doc.items()
        if isinstance(k, str) and len(k) <= 64 and isinstance(v, (bool, int, str))
    ]
    return tuple(sorted(out)[:_MAX_ITEMS])
