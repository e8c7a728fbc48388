"""Cross-rank rules on the training state beside the weights of a verl FSDP component: the optimizer (parameter
count, state shapes, step, param_groups) and the extra state that steps with it (lr scheduler, rng). Pure over
`views`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.deep.views import ComponentView, RankView, TensorView, unique_params
from ckpt_audit.models import Finding


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
