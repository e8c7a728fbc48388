"""verify's deep check of a DeepSpeed tag: what its optimizer partitions and model states hold, loaded the safe way.

Every shard goes through `safe_load` (DeepSpeed's LossScaler, ZeroStageEnum and fragment_address as inert records;
DeepSpeed is never imported). One file is loaded at a time and boiled down to a summary, so a tag costs one shard's
memory. Three properties the scan's file names and scalars cannot show:

- the optimizer step (torch AdamW's `step` in every parameter's state) is one value in every optimizer shard: a
  shard from another step of the same world size records nothing else that differs. Two values and no majority: the
  one that matches the model states' `global_steps - skipped_steps` (optimizer steps taken) is the tag's.
- the flat fp32 partitions cover `param_shapes` exactly, as DeepSpeed's `zero_to_fp32` reassembles them: ZeRO 1/2
  one `single_partition_of_fp32_groups` entry per group and rank, equal in size, whose sum (aligned to 2 x dp, as the
  converter aligns) is the group's parameters plus their alignment paddings; ZeRO-3 `fp32_flat_groups` per rank,
  each rank's total the sum of ceil(numel / dp) over the parameters. Anything else makes the converter raise
  ("consumed X numels out of Y") or reassemble garbage, and the engine's resume load the wrong slices.
- tensors that are copies of one value are bit-equal: under ZeRO-3 every data-parallel rank writes the module's
  non-partitioned tensors (buffers, persistent parameters) into its own model states; across model-parallel ranks,
  the parameters the checkpoint itself names as replicated (`universal_checkpoint_info`'s
  `tp_replicated_parameter_patterns`, what Megatron-DeepSpeed records). Without that record, tensors of equal shape
  on two model-parallel ranks may be slices of one tensor, so nothing is compared.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from ckpt_audit.codes import finding
from ckpt_audit.deep import safe_load
from ckpt_audit.deep.check import Deep
from ckpt_audit.models import Checkpoint, Component, Finding
from ckpt_audit.rules import deepspeed as rules


@dataclass(frozen=True, slots=True)
class ModelStates:
    path: str
    dp: int | None  # zero_pp_rank_D of a ZeRO-3 file; None for mp_rank_MM (ZeRO 0-2)
    mp: int
    steps_taken: int | None  # global_steps - skipped_steps: the optimizer steps the engine took
    shapes: tuple[tuple[int, ...], ...]  # numel of each parameter, one tuple per param group
    copies: Mapping[str, str]  # tensor name -> digest of its bytes, for the tensors that must equal other ranks'


@dataclass(frozen=True, slots=True)
class OptimStates:
    path: str
    dp: int
    mp: int
    stage: int | None
    steps: frozenset[float]
    flat: tuple[int, ...] | None  # numel of each group's flat fp32 partition on this rank
    paddings: tuple[int, ...] | None  # ZeRO 1/2: each group's parameter alignment paddings, summed
    partitions: int | None  # the partition_count it records (the data-parallel degree of its save)


def check(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> Deep:
    """Each tag directory among `comp`'s files (a bare engine tag, or Trainer's checkpoint-N/global_stepK/)."""
    tags: dict[str, list[str]] = {}
    for f in comp.files:
        d, _, name = f.path.rpartition("/")
        if rules.is_shard(name):
            tags.setdefault(d, []).append(f.path)
    return Deep(tuple(f for d in sorted(tags) for f in check_tag(tags[d], bad)))


def check_tag(paths: Sequence[str], bad: Set[str]) -> tuple[Finding, ...]:
    """Load each shard of one tag once (files the scan found broken are skipped) and judge the summaries."""
    out: list[Finding] = []
    models: list[ModelStates] = []
    optims: list[OptimStates] = []
    for path in sorted(paths):
        if path in bad:
            continue
        res = safe_load.load(path)
        out.extend(res.findings)
        if not res.loaded or not isinstance(res.value, Mapping):
            continue
        name = path.rsplit("/", 1)[-1]
        if m := rules.OPTIM_RE.fullmatch(name):
            optims.append(_optim(path, int(m.group(2)), int(m.group(3)), res.value))
        elif m := rules.ZERO3_MODEL_RE.fullmatch(name):
            models.append(_model(path, int(m.group(1)), int(m.group(2)), res.value))
        elif m := rules.MODEL_RE.fullmatch(name):
            models.append(_model(path, None, int(m.group(1)), res.value))
        del res  # one shard in memory at a time
    out += check_steps(optims, models)
    out += check_coverage(optims, models)
    out += check_copies(models)
    return tuple(out)


# -- the judgements (pure, on summaries) -------------------------------------------------------------------------


def check_steps(optims: Sequence[OptimStates], models: Sequence[ModelStates]) -> list[Finding]:
    """One optimizer step in every shard (and in every parameter's state of each)."""
    out = [
        finding(
            "ds-optim-step-mismatch",
            o.path,
            f"its parameters record different optimizer steps ({_steps(o.steps)}): not one save's state",
            rank=o.dp,
        )
        for o in optims
        if len(o.steps) > 1
    ]
    single = [o for o in optims if len(o.steps) == 1]
    counts = Counter(next(iter(o.steps)) for o in single)
    if len(counts) < 2:
        return out
    taken = {m.steps_taken for m in models if m.steps_taken is not None}
    top = counts.most_common()
    if top[0][1] > top[1][1]:
        common: float | None = top[0][0]
    else:  # no majority (two ranks, one stale): the model states say which step the engine was at
        common = next((s for s, _ in top if len(taken) == 1 and s == next(iter(taken))), None)
    for o in single:
        step = next(iter(o.steps))
        if step != common:
            others = f"the tag's other shards {_steps({common})}" if common is not None else "the other shards differ"
            out.append(
                finding(
                    "ds-optim-step-mismatch",
                    o.path,
                    f"optimizer step {_steps({step})}, {others}: a shard from another save; the engine would resume "
                    "with one rank's moments from another step",
                    rank=o.dp,
                )
            )
    return out


def check_coverage(optims: Sequence[OptimStates], models: Sequence[ModelStates]) -> list[Finding]:
    """Flat fp32 partitions against param_shapes, as zero_to_fp32 reassembles them (module docstring)."""
    shapes = {m.shapes for m in models if m.shapes}
    flat = [o for o in optims if o.flat is not None]
    if len(shapes) != 1 or not flat:
        return []  # nothing to hold them against (or model states disagree: the scan's ds-mixed-shards says so)
    groups = next(iter(shapes))
    out: list[Finding] = []
    for mp in sorted({o.mp for o in flat}):
        ranks = sorted((o for o in flat if o.mp == mp), key=lambda o: o.dp)
        dp = len(ranks)
        if {o.partitions for o in ranks} != {dp} or [o.dp for o in ranks] != list(range(dp)):
            continue  # a partition not loaded (the scan's findings say why) or of another world: nothing to sum
        stage = ranks[0].stage
        where = ranks[0].path.rsplit("/", 1)[0]
        sizes = {o.flat for o in ranks}
        if len(sizes) > 1 or any(len(o.flat or ()) != len(groups) for o in ranks):
            odd = [o for o in ranks if o.flat != ranks[0].flat or len(o.flat or ()) != len(groups)] or ranks
            out += [
                finding(
                    "ds-partition-mismatch",
                    o.path,
                    f"flat fp32 partitions of {list(o.flat or ())} elements for {len(groups)} parameter group(s) "
                    f"of {[sum(g) for g in groups]}; rank 0 holds {list(ranks[0].flat or ())}: partitions of "
                    "another model or world size",
                    rank=o.dp,
                )
                for o in odd
            ]
            continue
        per_rank = ranks[0].flat or ()
        if stage == 3:
            need = sum(math.ceil(n / dp) for g in groups for n in g)
            have = sum(per_rank)
            if need != have:
                out.append(_cover(where, mp, have * dp, need * dp))
            continue
        for g, numels in enumerate(groups):
            pads = ranks[0].paddings[g] if ranks[0].paddings and g < len(ranks[0].paddings) else 0
            need, have = sum(numels) + pads, per_rank[g] * dp
            align = 2 * dp
            if have < need or math.ceil(need / align) != math.ceil(have / align):
                out.append(_cover(where, mp, have, need, group=g))
    return out


def _cover(where: str, mp: int, have: int, need: int, *, group: int | None = None) -> Finding:
    grp = f" group {group}" if group is not None else ""
    return finding(
        "ds-partition-mismatch",
        where,
        f"mp rank {mp}{grp}: the flat fp32 partitions hold {have} elements, param_shapes need {need}: "
        f"zero_to_fp32 raises (consumed {need} numels out of {have}) and a resume loads the wrong slices",
        rank=mp,
    )


def check_copies(models: Sequence[ModelStates]) -> list[Finding]:
    """Tensors written as copies of one value (module docstring) bit-equal wherever they are written."""
    out: list[Finding] = []
    by_name: dict[str, list[tuple[ModelStates, str]]] = {}
    for m in models:
        for name, digest in m.copies.items():
            by_name.setdefault(name, []).append((m, digest))
    for name, held in sorted(by_name.items()):
        if len(held) < 2:
            continue
        common = Counter(d for _, d in held).most_common()
        if len(common) < 2:
            continue
        ref = common[0][0] if common[0][1] > common[1][1] else held[0][1]  # no majority: the lowest rank's
        first = next(m for m, d in held if d == ref)
        out += [
            finding(
                "ds-replica-mismatch",
                m.path,
                f"{name} differs from the copy in {first.path.rsplit('/', 1)[-1]}: ranks would resume with "
                "different values of one tensor",
                rank=m.dp if m.dp is not None else m.mp,
                tensor=name,
            )
            for m, d in held
            if d != ref
        ]
    return out


# -- summaries of loaded files -----------------------------------------------------------------------------------


def _optim(path: str, dp: int, mp: int, value: Mapping) -> OptimStates:
    osd = value.get("optimizer_state_dict")
    osd = osd if isinstance(osd, Mapping) else {}
    args = getattr(osd.get("zero_stage"), "args", None)  # a ZeroStageEnum record: args=(stage,)
    stage = args[0] if isinstance(args, tuple) and args and isinstance(args[0], int) else None
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))  # ZeRO 1/2 / ZeRO-3
    flat = osd.get("single_partition_of_fp32_groups", osd.get("fp32_flat_groups"))
    pads = osd.get("param_alignment_paddings")
    count = osd.get("partition_count")  # one per parameter group; zero_to_fp32 takes the largest
    if isinstance(count, (list, tuple)) and count and all(isinstance(c, int) for c in count):
        count = max(count)
    return OptimStates(
        path=path,
        dp=dp,
        mp=mp,
        stage=stage,
        steps=frozenset(_optimizer_steps(inner)),
        flat=tuple(_numel(t) for t in flat) if isinstance(flat, (list, tuple)) else None,
        paddings=tuple(sum(p) for p in pads) if isinstance(pads, (list, tuple)) and _all_ints(pads) else None,
        partitions=count if isinstance(count, int) and count > 0 else None,
    )


def _model(path: str, dp: int | None, mp: int, value: Mapping) -> ModelStates:
    gs, skipped = value.get("global_steps"), value.get("skipped_steps", 0)
    shapes = value.get("param_shapes")
    groups = shapes if isinstance(shapes, (list, tuple)) else [shapes] if isinstance(shapes, Mapping) else []
    numels = tuple(tuple(math.prod(s) for s in g.values()) for g in groups if isinstance(g, Mapping))
    module = value.get("module")
    module = module if isinstance(module, Mapping) else {}
    if dp is not None:  # ZeRO-3: partitioned parameters are empty here; what is left is each rank's full copy
        names: Iterable[str] = (n for n, t in module.items() if _numel(t) > 0)
    else:
        names = _tp_replicated(value, module)
    return ModelStates(
        path=path,
        dp=dp,
        mp=mp,
        steps_taken=gs - skipped if isinstance(gs, int) and isinstance(skipped, int) else None,
        shapes=numels,
        copies={n: _digest(module[n]) for n in names},
    )


def _tp_replicated(value: Mapping, module: Mapping) -> list[str]:
    info = value.get("universal_checkpoint_info")
    pats = info.get("tp_replicated_parameter_patterns") if isinstance(info, Mapping) else None
    if not isinstance(pats, (list, tuple)):
        return []
    regs = []
    for p in pats:
        if isinstance(p, str):
            try:
                regs.append(re.compile(p))
            except re.error:
                continue
    return [n for n in module if isinstance(n, str) and any(r.match(n) for r in regs)]


def _optimizer_steps(inner: Any) -> list[float]:
    """Every parameter state's `step` of a torch optimizer state dict (or a list of them, one per group)."""
    dicts = inner if isinstance(inner, (list, tuple)) else [inner]
    out = []
    for sd in dicts:
        state = sd.get("state") if isinstance(sd, Mapping) else None
        for entry in state.values() if isinstance(state, Mapping) else ():
            step = entry.get("step") if isinstance(entry, Mapping) else None
            if step is not None and _numel(step) <= 1:
                try:
                    out.append(float(step))
                except (TypeError, ValueError):
                    continue
    return out


def _numel(t: Any) -> int:
    n = getattr(t, "numel", None)
    return int(n()) if callable(n) else 0


def _digest(t: Any) -> str:
    import torch

    if not isinstance(t, torch.Tensor):
        return repr(t)
    flat = t.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def _all_ints(pads: Sequence) -> bool:
    return all(isinstance(g, (list, tuple)) and all(isinstance(x, int) for x in g) for g in pads)


def _steps(values: Iterable[float | None]) -> str:
    return ", ".join(f"{v:g}" if v is not None else "?" for v in sorted(values, key=lambda v: (v is None, v or 0)))
