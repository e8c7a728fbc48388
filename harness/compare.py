"""Exact comparison of two saved training states (verl layout), naming the first thing that differs.

Same world size: every rank's files are compared tensor by tensor (local shards, placements) with torch.equal.
Different world sizes: model and optimizer tensors are assembled to full tensors first; RNG is compared for the
ranks both runs have; scheduler and data position must match exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harness import checkpoint

COMPONENTS = ("model", "optimizer", "scheduler", "rng", "data")


@dataclass(frozen=True, slots=True, kw_only=True)
class Difference:
    component: str
    """One of COMPONENTS: which piece of training state differs."""
    role: str | None
    """actor / critic (None for the data loader)."""
    rank: int | None
    """The rank file, or None when compared as full tensors or when rank-independent."""
    key: str
    """Where inside: a parameter FQN (plus optimizer field), an RNG stream, a scheduler or sampler field."""
    detail: str

    def describe(self) -> str:
        where = " ".join(filter(None, [self.role, f"rank {self.rank}" if self.rank is not None else None]))
        return f"{self.component}: {where + ': ' if where else ''}{self.key}: {self.detail}"

    def to_json(self) -> dict:
        return {
            "component": self.component,
            "role": self.role,
            "rank": self.rank,
            "key": self.key,
            "detail": self.detail,
        }


def diff_values(a, b, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, detail) for every leaf that differs; tensors bit for bit, DTensors by placement and local shard."""
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
            yield path, f"{type(a).__name__} vs {type(b).__name__}"
        elif tuple(a.placements) != tuple(b.placements):
            yield path, f"placements {a.placements} vs {b.placements}"
        else:
            yield from diff_values(a.to_local(), b.to_local(), path)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            yield path, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        elif not torch.equal(a, b):
            if a.is_floating_point():
                delta = (a.double() - b.double()).abs()
                yield path, f"{int((a != b).sum())} of {a.numel()} elements differ, max |diff| {delta.max().item():.3g}"
            else:
                yield path, f"{int((a != b).sum())} of {a.numel()} elements differ"
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
        ):
            yield path, "arrays differ"
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                yield sub, "missing on the left" if k not in a else "missing on the right"
            else:
                yield from diff_values(a[k], b[k], sub)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield path, f"length {len(a)} vs {len(b)}"
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                yield from diff_values(x, y, f"{path}[{i}]")
    elif type(a) is not type(b) or a != b:
        yield path, f"{a!r} vs {b!r}"


# Fields that say where the data stream or the optimizer is; named first when they differ.
_FIRST = (
    "samples_yielded",
    "_num_yielded",
    "_snapshot_step",
    "_steps_since_snapshot",
    "yielded",
    "state.",
    "last_epoch",
)


def _sorted(pairs):
    """Deterministic, natural order for dict-derived paths (state.2 before state.10), position fields first."""
    import re

    def key(pair):
        path = pair[0]
        first = next((i for i, f in enumerate(_FIRST) if f in path), len(_FIRST))
        return [first] + [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"[.\[\]]+", path) if t]

    return sorted(pairs, key=key)


def compare_states(
    left: Path, right: Path, *, roles: tuple[str, ...] = ("actor",), sft: bool = False, rng_ranks: int | None = None
) -> list[Difference]:
    """Differences between two saved states (step dirs or probe dirs with <role>/ and data.pt)."""
    out: list[Difference] = []
    for role in roles:
        a_dir, b_dir = checkpoint.role_dir(left, role, sft=sft), checkpoint.role_dir(right, role, sft=sft)
        wa, wb = checkpoint.saved_world_size(a_dir), checkpoint.saved_world_size(b_dir)
        load = checkpoint.load_file
        if wa == wb:
            for r in range(wa):
                ma = load(a_dir / checkpoint.shard_name("model", wa, r))
                mb = load(b_dir / checkpoint.shard_name("model", wb, r))
                out += [
                    Difference(component="model", role=role, rank=r, key=k, detail=d)
                    for k, d in _ordered(diff_values(ma, mb), list(ma))
                ]
                oa = load(a_dir / checkpoint.shard_name("optim", wa, r))
                ob = load(b_dir / checkpoint.shard_name("optim", wb, r))
                names = _param_keys(ma, oa)
                out += [
                    Difference(component="optimizer", role=role, rank=r, key=_name_optim(k, names), detail=d)
                    for k, d in _sorted(diff_values(oa, ob))
                ]
        else:
            ma, mb = _full_model(a_dir, wa), _full_model(b_dir, wb)
            out += [
                Difference(component="model", role=role, rank=None, key=k, detail=d)
                for k, d in _ordered(diff_values(ma, mb), list(ma))
            ]
            oa, ob = _full_optim(a_dir, wa), _full_optim(b_dir, wb)
            names = _param_keys(ma, oa)
            out += [
                Difference(component="optimizer", role=role, rank=None, key=_name_optim(k, names), detail=d)
                for k, d in _sorted(diff_values(oa, ob))
            ]
        for r in range(min(wa, wb) if rng_ranks is None else min(rng_ranks, wa, wb)):
            ea = load(a_dir / checkpoint.shard_name("extra_state", wa, r))
            eb = load(b_dir / checkpoint.shard_name("extra_state", wb, r))
            if r == 0 or wa == wb:
                out += [
                    Difference(
                        component="scheduler",
                        role=role,
                        rank=r if wa == wb else None,
                        key=f"lr_scheduler.{k}" if k else "lr_scheduler",
                        detail=d,
                    )
                    for k, d in _sorted(diff_values(ea.get("lr_scheduler"), eb.get("lr_scheduler")))
                ]
            for stream in sorted((ea.get("rng") or {}).keys() | (eb.get("rng") or {}).keys()):
                pairs = list(diff_values((ea.get("rng") or {}).get(stream), (eb.get("rng") or {}).get(stream)))
                if pairs:
                    out.append(
                        Difference(component="rng", role=role, rank=r, key=stream, detail="stream state differs")
                    )
    da, db = left / "data.pt", right / "data.pt"
    if da.is_file() or db.is_file():
        if not (da.is_file() and db.is_file()):
            out.append(Difference(component="data", role=None, rank=None, key="data.pt", detail="missing on one side"))
        else:
            out += [
                Difference(component="data", role=None, rank=None, key=k, detail=d)
                for k, d in _sorted(diff_values(checkpoint.load_file(da), checkpoint.load_file(db)))
            ]
    return out


def _ordered(pairs, keys: list[str]):
    """Model differences in state-dict order, so "first differing tensor" means the first in the model."""
    rank = {k: i for i, k in enumerate(keys)}
    return sorted(pairs, key=lambda p: rank.get(p[0], len(rank)))


def _param_keys(model_sd: dict, optim_sd: dict) -> list[str]:
    """Model keys by optimizer index, when the state dict holds exactly the parameters (else no names)."""
    n = sum(len(g["params"]) for g in optim_sd.get("param_groups", []))
    return list(model_sd) if n == len(model_sd) else []


def _name_optim(path: str, model_keys: list[str]) -> str:
    """state.7.exp_avg -> state[model.layers.0.mlp.up_proj.weight].exp_avg (params are indexed in model order)."""
    parts = path.split(".")
    if len(parts) >= 2 and parts[0] == "state" and parts[1].isdigit() and int(parts[1]) < len(model_keys):
        return f"state[{model_keys[int(parts[1])]}]" + "".join("." + p for p in parts[2:])
    return path


def _full_model(role_dir: Path, world_size: int) -> dict:
    per_rank = {
        r: checkpoint.load_file(role_dir / checkpoint.shard_name("model", world_size, r)) for r in range(world_size)
    }
    ranks = range(world_size)
    return {k: checkpoint.full_tensor({r: per_rank[r][k] for r in ranks}, ranks) for k in per_rank[0]}


def _full_optim(role_dir: Path, world_size: int) -> dict:
    per_rank = {
        r: checkpoint.load_file(role_dir / checkpoint.shard_name("optim", world_size, r)) for r in range(world_size)
    }
    ranks = range(world_size)
    state = {
        idx: {
            name: checkpoint.full_tensor({r: per_rank[r]["state"][idx][name] for r in ranks}, ranks) for name in entry
        }
        for idx, entry in per_rank[0]["state"].items()
    }
    return {"state": state, "param_groups": per_rank[0]["param_groups"]}
