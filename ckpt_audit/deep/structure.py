"""Each per-rank file against what verl's own load does with it (verl 0.9.1, `FSDPCheckpointManager.load_checkpoint`).

Per rank verl torch.loads its three files and then:
- model: `model.load_state_dict(sd)`, strict: anything but a mapping holding the model's tensors raises;
- optim: `_backfill_optimizer_state` passes a plain optimizer state dict through, then torch's
  `Optimizer.load_state_dict` reads `sd["param_groups"]` and `sd["state"]` (KeyError without them), needs one saved
  group per group with as many `params` (ValueError) and keys state by those indices; AdamW's first step after the
  resume reads `step`, `exp_avg` and `exp_avg_sq` of every non-empty entry (KeyError), while a parameter without an
  entry silently starts from zero moments;
- extra_state: `if "rng" in extra` then `torch.set_rng_state(rng["cpu"])`, `np.random.set_state(rng["numpy"])`,
  `random.setstate(rng["random"])` (KeyError / TypeError), then `extra["lr_scheduler"]` (KeyError; a list raises
  TypeError) and, unless None, `LambdaLR.load_state_dict`, which pops `lr_lambdas` (KeyError) and takes the rest as
  attributes (no `last_epoch`: the schedule silently restarts).
Every case that raises or resumes wrong is an error here. Pure functions over the loaded objects (`is_tensor` says
what a tensor is); no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding

ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
RNG_REQUIRED = ("cpu", "numpy", "random")
IsTensor = Callable[[Any], bool]


def _kind(value: Any) -> str:
    name = type(value).__name__
    return ("an " if name[:1] in "aeiou" else "a ") + name


def check_model(path: str, rank: int | None, value: Any, is_tensor: IsTensor) -> list[Finding]:
    if not isinstance(value, Mapping):
        why = f"{_kind(value)}, not a state dict: verl's model.load_state_dict raises"
    elif not any(is_tensor(v) for v in value.values()):
        why = f"a state dict of {len(value)} entries, none a tensor: verl's strict model.load_state_dict raises"
    else:
        return []
    return [finding("model-state-invalid", path, why, rank=rank)]


def check_optimizer(path: str, rank: int | None, value: Any, is_tensor: IsTensor) -> list[Finding]:
    def bad(why: str, tensor: str | None = None) -> list[Finding]:
        return [finding("optimizer-state-invalid", path, why, rank=rank, tensor=tensor)]

    if not isinstance(value, Mapping):
        return bad(f"{_kind(value)}, not an optimizer state dict: torch's Optimizer.load_state_dict raises")
    missing = [k for k in ("state", "param_groups") if k not in value]
    if missing:
        keys = sorted(map(str, value))[:5]
        return bad(f"no {' or '.join(map(repr, missing))} (keys: {keys}): Optimizer.load_state_dict raises KeyError")
    state, groups = value["state"], value["param_groups"]
    if not isinstance(groups, (list, tuple)) or not groups:
        what = "empty" if isinstance(groups, (list, tuple)) else _kind(groups)
        return bad(f"param_groups is {what}: Optimizer.load_state_dict raises")
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups):
        return bad("a param group without a 'params' list: Optimizer.load_state_dict raises")
    if not isinstance(state, Mapping):
        return bad(f"state is {_kind(state)}, not a dict: Optimizer.load_state_dict raises")
    indices = [i for g in groups for i in g["params"]]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        return bad("param_groups list something other than parameter indices: the state cannot be keyed by them")
    if len(set(indices)) != len(indices):
        return bad("a parameter index is listed twice in param_groups: two parameters would share one state")
    adam = all("betas" in g for g in groups)
    for idx, st in state.items():
        if not isinstance(st, Mapping):
            return bad(f"state[{idx!r}] is {_kind(st)}, not a dict: the optimizer cannot use it", f"state.{idx}")
        lacks = [k for k in ADAM_STATE if k not in st]
        if adam and st and lacks:
            return bad(
                f"state[{idx!r}] lacks {lacks}: AdamW's first step after the resume raises KeyError", f"state.{idx}"
            )
    stateless = [i for i in indices if i not in state]
    if state and stateless:
        return [
            finding(
                "optimizer-state-partial",
                path,
                f"no state for {len(stateless)} of {len(indices)} parameter(s) (first: index {stateless[0]}): a resume "
                "starts their moments from zero (right only for parameters that never had a gradient)",
                rank=rank,
            )
        ]
    return []


def check_extra_state(path: str, rank: int | None, value: Any, is_tensor: IsTensor) -> list[Finding]:
    def bad(why: str, tensor: str | None = None) -> list[Finding]:
        return [finding("extra-state-invalid", path, why, rank=rank, tensor=tensor)]

    if not isinstance(value, Mapping):
        return bad(f"{_kind(value)}, not a dict: verl's extra_state['lr_scheduler'] raises TypeError")
    if "rng" in value:
        rng = value["rng"]
        if not isinstance(rng, Mapping):
            return bad(f"rng is {_kind(rng)}, not a dict: verl's load_rng_state raises")
        for s in RNG_REQUIRED:
            if s not in rng:
                return bad(f"rng has no {s!r} stream: verl's load_rng_state raises KeyError", s)
        cpu = rng["cpu"]
        if not is_tensor(cpu) or str(getattr(cpu, "dtype", "")) != "torch.uint8":
            return bad("rng['cpu'] is not a uint8 tensor: torch.set_rng_state raises", "cpu")
        np_state = rng["numpy"]
        if not (isinstance(np_state, Mapping) or (isinstance(np_state, (tuple, list)) and len(np_state) >= 3)):
            return bad("rng['numpy'] is not a numpy RNG state: np.random.set_state raises", "numpy")
        if not (isinstance(rng["random"], (tuple, list)) and len(rng["random"]) == 3):
            return bad("rng['random'] is not a random.getstate() triple: random.setstate raises", "random")
    sched = value.get("lr_scheduler")  # absent: rules.check_extra's lr-scheduler-missing
    if sched is not None and "lr_scheduler" in value:
        if not isinstance(sched, Mapping):
            return bad(f"lr_scheduler is {_kind(sched)}, not a state dict: the scheduler's load_state_dict raises")
        lacks = [k for k in ("lr_lambdas", "last_epoch") if k not in sched]
        if lacks:
            return bad(
                f"lr_scheduler lacks {lacks}: LambdaLR.load_state_dict raises KeyError without lr_lambdas and "
                "silently restarts the schedule without last_epoch"
            )
    return []
