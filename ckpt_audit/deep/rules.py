"""Deep rules (verify): cross-rank consistency of a verl FSDP component, as pure functions over per-rank views.

`verify.py` loads each rank's files (through `safe_load`, the only torch.load) and boils them down to the plain
views below; these functions compare the views and return findings naming rank and tensor. No IO, no torch here,
so every rule is testable on literal views too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS

KNOWN_MESH_NAMES = (("fsdp",), ("ddp", "fsdp"))


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorView:
    dtype: str
    local_shape: tuple[int, ...]
    is_dtensor: bool = False
    global_shape: tuple[int, ...] | None = None
    placements: tuple[str, ...] = ()  # "Shard(0)", "Replicate()", ...
    mesh_shape: tuple[int, ...] | None = None
    mesh_ranks: tuple[int, ...] | None = None  # row-major
    mesh_names: tuple[str, ...] | None = None
    device: str = "cpu"  # storage location as saved
    storage: str | None = None  # storage key in the zip (tied tensors share one)
    storage_offset: int = 0
    crc: int | None = None  # CRC-32 of the storage's zip entry (None/0: unknown)
    writer_rank: int | None = None  # the global rank the pickled DeviceMesh says saved it (None: not recorded)
    nonfinite: int = 0  # NaN and Inf elements of the local tensor (deep/values.py counts them while loading)
    nan: int = 0
    zero: bool | None = None  # every element of the local tensor is 0; None: not judged (not a float tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.global_shape if self.is_dtensor and self.global_shape is not None else self.local_shape


@dataclass(frozen=True, slots=True, kw_only=True)
class RankView:
    rank: int
    model_path: str | None = None
    model: Mapping[str, TensorView] | None = None  # None: not loaded
    optim_path: str | None = None
    optim_state: Mapping[int, Mapping[str, Any]] | None = None  # idx -> {"step": float, "exp_avg": TensorView}
    param_groups: Sequence[Mapping[str, Any]] | None = None
    extra_path: str | None = None
    extra_keys: frozenset[str] | None = None  # top-level keys of extra_state
    lr_scheduler: Mapping[str, Any] | None = None
    rng_keys: frozenset[str] | None = None  # None: no "rng" entry
    equal_to: Mapping[tuple[int, str], bool] = field(default_factory=dict)  # exact compare results (HSDP fallback)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentView:
    path: str
    step: int
    world_size: int | None
    config_world_size: int | None  # fsdp_config.json
    tie_word_embeddings: bool | None  # huggingface/config.json
    ranks: tuple[RankView, ...]


def check_component(c: ComponentView) -> tuple[Finding, ...]:
    out: list[Finding] = []
    models = [r for r in c.ranks if r.model is not None]
    out += check_key_sets(models)
    out += check_dtensors(c, models)
    out += check_tied(c, models)
    out += check_optimizer(c.ranks)
    out += check_extra(c)
    return tuple(out)


# -- model ----------------------------------------------------------------------------------------------------


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


def chunk_size(length: int, parts: int, index: int) -> int:
    """torch.chunk-style split (what DTensor Shard and FSDP use): ceil-sized chunks, trailing ones short or empty."""
    if parts <= 0:
        return length
    size = math.ceil(length / parts) if length else 0
    return max(0, min(size, length - index * size))


def mesh_coords(t: TensorView, rank: int) -> tuple[int, ...] | None:
    """`rank`'s coordinate on the tensor's mesh (row-major), or None when the mesh does not list it."""
    if t.mesh_shape is None or t.mesh_ranks is None or rank not in t.mesh_ranks:
        return None
    flat, out = t.mesh_ranks.index(rank), []
    for n in reversed(t.mesh_shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def expected_local_shape(t: TensorView, rank: int) -> tuple[int, ...] | None:
    """The local shape DTensor gives `rank`, or None when the mesh does not say where the rank sits."""
    coords = mesh_coords(t, rank)
    if t.global_shape is None or t.mesh_shape is None or coords is None:
        return None
    shape = list(t.global_shape)
    for p, n, c in zip(t.placements, t.mesh_shape, coords):
        if p.startswith("Shard("):
            d = int(p[6:-1])
            if d >= len(shape):
                return None
            shape[d] = chunk_size(shape[d], n, c)
        elif p.startswith("_StridedShard") or p.startswith("Partial"):
            return None  # not what verl saves; its layout is not modelled here
    return tuple(shape)


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


# -- optimizer ------------------------------------------------------------------------------------------------


def unique_params(model: Mapping[str, TensorView]) -> list[str]:
    """Floating-point model keys in state-dict order, tied duplicates (one storage) counted once: the order
    `model.parameters()` gave the optimizer."""
    seen: set[tuple[str, int]] = set()
    out = []
    for k, v in model.items():
        if not (v.dtype.startswith("float") or v.dtype.startswith("bfloat")):
            continue
        ident = (v.storage, v.storage_offset) if v.storage is not None else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out.append(k)
    return out


def check_optimizer(ranks: Sequence[RankView]) -> list[Finding]:
    out: list[Finding] = []
    loaded = [r for r in ranks if r.optim_state is not None and r.param_groups is not None]
    steps: dict[int, tuple[float | None, str | None]] = {}
    for r in loaded:
        indices = [i for g in r.param_groups or () for i in g.get("params", ())]
        params = unique_params(r.model) if r.model is not None else None
        path = r.optim_path or ""
        if params is not None and len(indices) != len(params):
            out.append(
                finding(
                    "optimizer-param-count",
                    path,
                    f"param_groups list {len(indices)} parameter(s), the model shard has {len(params)}",
                    rank=r.rank,
                )
            )
            params = None
        stray = sorted(set(r.optim_state or {}) - set(indices))
        if stray:
            out.append(
                finding(
                    "optimizer-param-count", path, f"state has entries {stray[:5]} no param group lists", rank=r.rank
                )
            )
        rank_steps = set()
        first_key = None
        for pos, idx in enumerate(indices):
            st = (r.optim_state or {}).get(idx)
            if st is None:
                continue  # a parameter that never had a gradient has no state (torch keeps its index)
            name = params[pos] if params is not None else f"state.{idx}"
            if "step" in st:
                rank_steps.add(st["step"])
                first_key = first_key or name
            if params is None or r.model is None:  # params come from r.model: both or neither
                continue
            p = r.model[name]
            for sname, sv in st.items():
                if not isinstance(sv, TensorView) or sname == "step":
                    continue
                if not p.is_dtensor and not sv.is_dtensor and len(sv.local_shape) == 1 and len(p.local_shape) != 1:
                    continue  # FSDP1 flat-parameter state: not per original parameter
                if (sv.local_shape, sv.shape, sv.placements) != (p.local_shape, p.shape, p.placements):
                    out.append(
                        finding(
                            "optimizer-state-mismatch",
                            path,
                            f"{sname} of {name}: local "
                            f"{list(sv.local_shape)} global {list(sv.shape)} {list(sv.placements)}, the "
                            f"parameter is local {list(p.local_shape)} global {list(p.shape)} "
                            f"{list(p.placements)}",
                            rank=r.rank,
                            tensor=name,
                        )
                    )
        if len(rank_steps) > 1:
            out.append(
                finding(
                    "optimizer-step-differs",
                    path,
                    f"parameters disagree on step: {sorted(rank_steps)}",
                    rank=r.rank,
                    tensor=first_key,
                )
            )
        steps[r.rank] = (max(rank_steps) if rank_steps else None, first_key)
    if loaded:
        ref = loaded[0]
        ref_step = steps[ref.rank][0]
        for r in loaded[1:]:
            s, key = steps[r.rank]
            if s != ref_step:
                out.append(
                    finding(
                        "optimizer-step-differs",
                        r.optim_path or "",
                        f"step {s} here, {ref_step} on rank {ref.rank}",
                        rank=r.rank,
                        tensor=key,
                    )
                )
            if _groups(r.param_groups) != _groups(ref.param_groups):
                out.append(
                    finding(
                        "param-groups-differ",
                        r.optim_path or "",
                        _groups_diff(r.param_groups, ref.param_groups, ref.rank),
                        rank=r.rank,
                    )
                )
    return out


def _groups(groups: Sequence[Mapping[str, Any]] | None) -> list[dict]:
    return [dict(g) for g in groups or ()]


def _groups_diff(a: Sequence[Mapping[str, Any]] | None, b: Sequence[Mapping[str, Any]] | None, ref: int) -> str:
    a, b = _groups(a), _groups(b)
    if len(a) != len(b):
        return f"{len(a)} param group(s) here, {len(b)} on rank {ref}"
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted(set(x) | set(y), key=str):
            if x.get(k) != y.get(k):
                return f"param_groups[{i}][{k!r}] is {x.get(k)!r} here, {y.get(k)!r} on rank {ref}"
    return "param_groups differ"


def optimizer_step(ranks: Sequence[RankView]) -> float | None:
    for r in ranks:
        for st in (r.optim_state or {}).values():
            if "step" in st and st["step"] is not None:
                return st["step"]
    return None


# -- extra state ----------------------------------------------------------------------------------------------


def check_extra(c: ComponentView) -> list[Finding]:
    out: list[Finding] = []
    loaded = [r for r in c.ranks if r.extra_keys is not None]
    epochs: dict[int, Any] = {}
    for r in loaded:
        path = r.extra_path or ""
        if "lr_scheduler" not in (r.extra_keys or ()):
            out.append(
                finding(
                    "lr-scheduler-missing",
                    path,
                    "extra_state has no 'lr_scheduler' entry; verl's loader requires it",
                    rank=r.rank,
                )
            )
        elif r.lr_scheduler is not None:
            epochs[r.rank] = r.lr_scheduler.get("last_epoch")
        if r.rng_keys is None:
            out.append(
                finding(
                    "rng-missing",
                    path,
                    "extra_state has no 'rng' entry: a resume cannot restore the random streams",
                    rank=r.rank,
                )
            )
        elif any(v.device.startswith("cuda") for v in (r.model or {}).values()) and "cuda" not in r.rng_keys:
            # verl restores the device stream only when present; cpu/numpy/random missing: deep/structure.py
            out.append(finding("rng-missing", path, "rng has no 'cuda' stream", rank=r.rank, tensor="cuda"))
    if epochs:
        ref_rank = min(epochs)
        ref = epochs[ref_rank]
        by = {r.rank: r for r in loaded}
        for rank, e in sorted(epochs.items()):
            if e != ref:
                out.append(
                    finding(
                        "lr-scheduler-differs",
                        by[rank].extra_path or "",
                        f"last_epoch {e} here, {ref} on rank {ref_rank}",
                        rank=rank,
                    )
                )
        if isinstance(ref, int):
            path = by[ref_rank].extra_path or ""
            if ref > c.step:
                out.append(
                    finding(
                        "lr-scheduler-ahead",
                        path,
                        f"last_epoch {ref} is past the checkpoint's step "
                        f"{c.step}: the schedule stepped more often than training did",
                        rank=ref_rank,
                    )
                )
            elif ref < c.step:
                out.append(
                    finding(
                        "lr-scheduler-behind",
                        path,
                        f"last_epoch {ref} is behind the checkpoint's step {c.step} (expected only with critic_warmup)",
                        rank=ref_rank,
                    )
                )
            opt = optimizer_step(c.ranks)
            if opt is not None and opt < ref:
                out.append(
                    finding(
                        "optimizer-step-behind",
                        path,
                        f"optimizer step {opt:g} is behind the scheduler's last_epoch {ref}",
                        rank=ref_rank,
                    )
                )
    return out
