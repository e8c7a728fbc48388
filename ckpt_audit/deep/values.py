"""Values, not only structure: NaN/Inf, Adam moments that are zero after training, and tensors a step of training
must have changed that are bit-identical to the previous checkpoint's.

`tensor_stats` judges each tensor while verify's one load of its file has it mapped (one `aminmax` pass over its
bytes). The rules are pure over `views.TensorView`s. verl loads all of these
without complaint, so each is a silent wrong resume and an error:
- NaN/Inf in a weight or a moment: training goes on from (or immediately produces) NaN;
- exp_avg_sq all zero while exp_avg is not, or every moment of a shard zero, at optimizer step > 0: Adam's state
  is lost, and the first update after the resume is m/sqrt(v) = 0.1/sqrt(0.001), about 3x a full-size step in
  every coordinate (more where exp_avg survived);
- a weight or moment identical to the previous checkpoint's although the optimizer stepped (with lr > 0) between
  them: the newer checkpoint holds the older state under a newer step (a stale or copied save), and a resume from it
  silently drops the training in between. Compared by the zip CRC-32 of each storage (recorded by torch.save, read
  with the zip directory), confirmed byte for byte only where the CRCs agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.deep.views import ComponentView, RankView, TensorView, unique_params
from ckpt_audit.models import Finding

CHUNK = 1 << 22  # elements per exact count (16 MiB of float32), only for a tensor holding NaN/Inf
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueStats:
    nonfinite: int = 0
    nan: int = 0
    zero: bool | None = None  # every element 0; None: not judged (not a float tensor, or no kernel for its dtype)


def tensor_stats(t: Any) -> ValueStats:
    """NaN+Inf and NaN counts and all-zero of a plain (local) tensor. One `aminmax` pass answers both questions for
    the usual tensor (NaN or Inf shows in min or max; all zero is min == max == 0), with no allocation; only a
    tensor that holds NaN/Inf is counted exactly, a chunk at a time."""
    import torch

    if t.device.type == "meta" or not t.is_floating_point():  # no data saved, or not a value that can be NaN
        return ValueStats()
    if t.numel() == 0:
        return ValueStats(zero=True)
    try:
        lo, hi = (float(v) for v in torch.aminmax(t))
        if math.isfinite(lo) and math.isfinite(hi):
            return ValueStats(zero=lo == 0 and hi == 0)
        flat = t.reshape(-1)
        nonfinite = nan = 0
        for i in range(0, flat.numel(), CHUNK):
            x = flat[i : i + CHUNK]
            nonfinite += x.numel() - int(torch.isfinite(x).sum())
            nan += int(torch.isnan(x).sum())
    except (RuntimeError, TypeError, NotImplementedError):  # float8 and others without these kernels: not judged
        return ValueStats()
    return ValueStats(nonfinite=nonfinite, nan=nan, zero=False)


def _count(n: int) -> str:
    return f"{n:,}"


# -- one checkpoint -------------------------------------------------------------------------------------------


def check_values(c: ComponentView) -> list[Finding]:
    out: list[Finding] = []
    for r in c.ranks:
        out += _nonfinite(r.model_path or "", r.rank, (r.model or {}).items())
        names = _index_names(r)  # walks the whole model once per rank: shared by both moment checks
        moments = [(f"{n} of {name}", t) for name, n, t in _moments(r, names)]
        out += _nonfinite(r.optim_path or "", r.rank, moments)
        out += _zero_moments(r, names)
    return out


def _nonfinite(path: str, rank: int, tensors) -> list[Finding]:
    bad = [(k, t) for k, t in tensors if t.nonfinite]
    if not bad:
        return []
    values, nan = sum(t.nonfinite for _, t in bad), sum(t.nan for _, t in bad)
    return [
        finding(
            "nonfinite-values",
            path,
            f"{len(bad)} tensor(s), {_count(values)} non-finite value(s) ({_count(nan)} NaN, {_count(values - nan)} "
            f"Inf; first: {bad[0][0]}): verl loads them and training goes on from them",
            rank=rank,
            tensor=bad[0][0],
        )
    ]


def _moments(r: RankView, names: dict[int, str]) -> list[tuple[str, str, TensorView]]:
    """(parameter name, moment name, view) for every moment tensor of the rank's optimizer shard."""
    out = []
    for idx, st in (r.optim_state or {}).items():
        for n in MOMENTS:
            t = st.get(n)
            if isinstance(t, TensorView):
                out.append((names.get(idx, f"state.{idx}"), n, t))
    return out


def _index_names(r: RankView) -> dict[int, str]:
    indices = [i for g in r.param_groups or () for i in g.get("params", ())]
    params = unique_params(r.model) if r.model is not None else []
    return dict(zip(indices, params)) if len(params) == len(indices) else {}


def _zero_moments(r: RankView, names: dict[int, str]) -> list[Finding]:
    stepped = []
    for idx, st in (r.optim_state or {}).items():
        avg, sq = st.get("exp_avg"), st.get("exp_avg_sq")
        if not (isinstance(avg, TensorView) and isinstance(sq, TensorView)) or not (st.get("step") or 0) > 0:
            continue
        if sq.zero is None or avg.zero is None or 0 in sq.local_shape:
            continue
        stepped.append((names.get(idx, f"state.{idx}"), avg, sq))
    lone = [n for n, avg, sq in stepped if sq.zero and not avg.zero]  # m != 0 needs a gradient, and then v > 0
    both = [n for n, avg, sq in stepped if sq.zero and avg.zero]
    if lone:
        why, first, count = "exp_avg_sq is all zero while exp_avg is not", lone[0], len(lone)
    elif stepped and len(both) == len(stepped):
        why, first, count = "every exp_avg and exp_avg_sq is all zero", both[0], len(both)
    else:
        return []  # a few all-zero pairs: parameters whose gradient was always zero
    return [
        finding(
            "optimizer-moments-zero",
            r.optim_path or "",
            f"{why} ({count} parameter(s), first: {first}) after optimizer step > 0: Adam's state is lost and the "
            "first update after a resume is about 3x a full step in every coordinate",
            rank=r.rank,
            tensor=first,
        )
    ]


# -- against the previous checkpoint --------------------------------------------------------------------------

Same = Callable[[str, str, str, str], bool]  # (path, storage key, path, storage key) -> bytes equal


def check_unchanged(prev: ComponentView, cur: ComponentView, same: Same, prev_name: str) -> list[Finding]:
    """Per rank: weights and moments that the optimizer changed since `prev` (its step advanced, lr > 0) yet are
    bit-identical to prev's. CRC-32 and shape first (no bytes read), `same` confirms the few candidates."""
    out: list[Finding] = []
    before = {r.rank: r for r in prev.ranks}
    for r in cur.ranks:
        p = before.get(r.rank)
        if p is None or r.model is None or p.model is None:
            continue
        names, pnames = _index_names(r), _index_names(p)
        if not names or not pnames:
            continue
        pidx = {n: i for i, n in pnames.items()}
        lrs, plrs = _lrs(r), _lrs(p)
        weights, moments, trained = [], [], 0
        for idx, name in names.items():
            st, pst = (r.optim_state or {}).get(idx), (p.optim_state or {}).get(pidx.get(name, -1))
            if not st or not pst or not _stepped(pst, st, max(plrs.get(pidx[name], 0.0), lrs.get(idx, 0.0))):
                continue
            trained += 1
            avg = st.get("exp_avg")
            moved = avg is not None and avg.zero is False  # m == 0 and no weight decay: AdamW leaves the weight be
            if moved and _equal(p.model.get(name), r.model.get(name), p.model_path, r.model_path, same):
                weights.append(name)
            for n in MOMENTS:
                t, pt = st.get(n), pst.get(n)
                if isinstance(t, TensorView) and t.zero is False and _equal(pt, t, p.optim_path, r.optim_path, same):
                    moments.append(f"{n} of {name}")
        for path, hits, what in ((r.model_path, weights, "weight"), (r.optim_path, moments, "moment")):
            if hits:
                out.append(
                    finding(
                        "unchanged-since-previous",
                        path or "",
                        f"{len(hits)} {what} tensor(s) of {trained} trained parameter(s) are bit-identical to "
                        f"{prev_name}'s although the optimizer stepped since (first: {hits[0]}): a resume from here "
                        "restarts from the older state",
                        rank=r.rank,
                        tensor=hits[0],
                    )
                )
    return out


def _lrs(r: RankView) -> dict[int, float]:
    """Each parameter index's lr from its param group (0 where it is not a number)."""
    out = {}
    for g in r.param_groups or ():
        lr = g.get("lr")
        for i in g.get("params", ()):
            out[i] = float(lr) if isinstance(lr, (int, float)) else 0.0
    return out


def _stepped(before: Mapping, after: Mapping, lr: float) -> bool:
    s0, s1 = before.get("step"), after.get("step")
    return isinstance(s0, float) and isinstance(s1, float) and s1 > s0 and lr > 0


def _equal(a: TensorView | None, b: TensorView | None, pa: str | None, pb: str | None, same: Same) -> bool:
    if a is None or b is None or not a.crc or a.crc != b.crc or not a.storage or not b.storage or not pa or not pb:
        return False
    if (a.dtype, a.local_shape, a.storage_offset) != (b.dtype, b.local_shape, b.storage_offset):
        return False
    return same(pa, a.storage, pb, b.storage)
