"""Cross-rank rules on the model shards of a verl FSDP component: key sets, DTensor placements and shapes, HSDP
replicas, tied embeddings. Pure over `views`: findings name the rank and the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckpt_audit.codes import finding
from ckpt_audit.deep.views import ComponentView, RankView, TensorView, expected_local_shape
from ckpt_audit.models import Finding
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS

KNOWN_MESH_NAMES = (("fsdp",), ("ddp", "fsdp"))


def check_key_sets(ranks: Sequence[RankView]) -> list[Finding]:
    if len(ranks) < 2:
        return []
    ref = ranks[0]
    ref_keys = set(ref.model or {})
    out = []
    for r in ranks[1:]:
        keys = set(r.model or {})
        missing, extra = sorted(ref_keys - keys), sorted(keys - ref_keys)
        if missing or extra:
            key = (missing or extra)[0]
            what = (
                (f"lacks {len(missing)} key(s) rank {ref.rank} has" if missing else "")
                + ("; " if missing and extra else "")
                + (f"has {len(extra)} key(s) rank {ref.rank} lacks" if extra else "")
            )
            out.append(
                finding("rank-keys-differ", r.model_path or "", f"{what} (first: {key})", rank=r.rank, tensor=key)
            )
    return out


def check_dtensors(c: ComponentView, ranks: Sequence[RankView]) -> list[Finding]:
    out: list[Finding] = []
    if not ranks:
        return out
    keys = list(ranks[0].model or {})
    for key in keys:
        views = [(r, r.model[key]) for r in ranks if r.model is not None and key in r.model]
        first_r, first = views[0]
        kinds = {v.is_dtensor for _, v in views}
        if len(kinds) > 1:
            odd = next(r for r, v in views if v.is_dtensor != first.is_dtensor)
            out.append(
                finding(
                    "dtensor-mismatch",
                    odd.model_path or "",
                    f"{key} is "
                    f"{'a DTensor' if not first.is_dtensor else 'a plain tensor'} on rank {first_r.rank} "
                    f"but not on rank {odd.rank}",
                    rank=odd.rank,
                    tensor=key,
                )
            )
            continue
        if not first.is_dtensor:
            for r, v in views[1:]:
                if v.local_shape != first.local_shape and (c.world_size or 1) > 1:
                    out.append(
                        finding(
                            "global-shape-mismatch",
                            r.model_path or "",
                            f"{key}: plain tensor of shape "
                            f"{list(v.local_shape)} here, {list(first.local_shape)} on rank {first_r.rank}",
                            rank=r.rank,
                            tensor=key,
                        )
                    )
            continue
        for r, v in views:
            size = math.prod(v.mesh_shape) if v.mesh_shape else None
            if size is not None and c.config_world_size is not None and size != c.config_world_size:
                out.append(
                    finding(
                        "mesh-config-mismatch",
                        r.model_path or "",
                        f"{key}: DeviceMesh of {size} rank(s) "
                        f"{list(v.mesh_shape or ())}, fsdp_config.json says world_size "
                        f"{c.config_world_size}",
                        rank=r.rank,
                        tensor=key,
                    )
                )
            if v.mesh_names is not None and v.mesh_names not in KNOWN_MESH_NAMES:
                out.append(
                    finding(
                        "mesh-names-unknown",
                        r.model_path or "",
                        f"{key}: mesh dims {v.mesh_names} are not verl's ('fsdp',) or ('ddp', 'fsdp')",
                        rank=r.rank,
                        tensor=key,
                    )
                )
        for r, v in views[1:]:
            if v.placements != first.placements:
                out.append(
                    finding(
                        "placement-mismatch",
                        r.model_path or "",
                        f"{key}: placements {list(v.placements)} here, {list(first.placements)} on rank {first_r.rank}",
                        rank=r.rank,
                        tensor=key,
                    )
                )
            elif (v.mesh_shape, v.mesh_ranks) != (first.mesh_shape, first.mesh_ranks):
                out.append(
                    finding(
                        "placement-mismatch",
                        r.model_path or "",
                        f"{key}: mesh {list(v.mesh_shape or ())} "
                        f"ranks {list(v.mesh_ranks or ())} here, {list(first.mesh_shape or ())} ranks "
                        f"{list(first.mesh_ranks or ())} on rank {first_r.rank}",
                        rank=r.rank,
                        tensor=key,
                    )
                )
            if v.global_shape != first.global_shape:
                out.append(
                    finding(
                        "global-shape-mismatch",
                        r.model_path or "",
                        f"{key}: global shape "
                        f"{list(v.global_shape or ())} here, {list(first.global_shape or ())} on rank "
                        f"{first_r.rank}",
                        rank=r.rank,
                        tensor=key,
                    )
                )
        for r, v in views:
            want = expected_local_shape(v, r.rank)
            if want is not None and want != v.local_shape:
                out.append(
                    finding(
                        "shard-shape-mismatch",
                        r.model_path or "",
                        f"{key}: local shape "
                        f"{list(v.local_shape)}, but {list(v.placements)} of global "
                        f"{list(v.global_shape or ())} on mesh {list(v.mesh_shape or ())} gives this rank "
                        f"{list(want)}",
                        rank=r.rank,
                        tensor=key,
                    )
                )
        out += _check_replicas(key, views)
    return out


def _check_replicas(key: str, views: Sequence[tuple[RankView, TensorView]]) -> list[Finding]:
    """HSDP (Replicate on the ddp dim): ranks at the same fsdp coordinate must hold identical shards."""
    _, first = views[0]
    if not first.mesh_shape or len(first.mesh_shape) != 2 or first.placements[:1] != ("Replicate()",):
        return []
    if first.mesh_ranks is None:
        return []
    f = first.mesh_shape[1]
    by_rank = {r.rank: (r, v) for r, v in views}
    out = []
    for i, rank in enumerate(first.mesh_ranks):
        if i < f:
            continue
        twin = first.mesh_ranks[i % f]
        if rank not in by_rank or twin not in by_rank:
            continue
        (r, v), (_, t) = by_rank[rank], by_rank[twin]
        same = v.local_shape == t.local_shape and v.dtype == t.dtype
        if same:
            exact = r.equal_to.get((twin, key))
            if exact is not None:
                same = exact
            elif v.crc and t.crc:
                same = v.crc == t.crc and v.storage_offset == t.storage_offset
        if not same:
            out.append(
                finding(
                    "hsdp-replica-differs",
                    r.model_path or "",
                    f"{key}: this replica differs from rank {twin}'s (same fsdp shard, replicated over ddp)",
                    rank=r.rank,
                    tensor=key,
                )
            )
    return out


def check_tied(c: ComponentView, ranks: Sequence[RankView]) -> list[Finding]:
    if c.tie_word_embeddings is not True:
        return []
    a, b = TIED_EMBEDDINGS
    out = []
    for r in ranks:
        m = r.model or {}
        if (a in m) != (b in m):
            gone = a if b in m else b
            out.append(
                finding(
                    "tied-embedding-missing",
                    r.model_path or "",
                    f"config ties word embeddings but {gone} is absent (only {b if gone == a else a} is saved)",
                    rank=r.rank,
                    tensor=gone,
                )
            )
    return out
