"""Completeness of one DeepSpeed checkpoint tag from its file names and what its files record of themselves. Pure.

What `DeepSpeedEngine.load_checkpoint(load_dir, tag)` opens (deepspeed 0.19, runtime/engine.py): ZeRO 0-2 read
`mp_rank_MM_model_states.pt` for the rank's model-parallel rank; ZeRO-3 reads
`zero_pp_rank_D_mp_rank_MM_model_states.pt` for its own data-parallel rank D. With ZeRO >= 1 each rank then opens
its own `[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`, one spelling for all (the engine's bf16 setting picks
it). The checkpoint's data-parallel degree is the model states' `dp_world_size` (the engine refuses another world
size), the model-parallel degree its `mp_world_size`: the grid is read from those, never from the highest file
index, so a missing last rank is found and a leftover rank from a larger world is not taken for part of the save.

A model with DeepSpeed MoE layers (engine._save_moe_checkpoint / load_moe_state_dict): the model states record
`num_experts`, one count per MoE layer in module order, and the load opens
`layer_L_expert_E_mp_rank_MM_model_states.pt` for every layer L and global expert id E < num_experts[L] across the
expert-parallel ranks (the old one-layer format: an int, and `expert_E_mp_rank_MM_model_states.pt`). At ZeRO-0 each
rank also opens `expp_rank_R_mp_rank_MM_optim_states.pt` for its expert-parallel rank R (ZeRO >= 1 keeps the
optimizer in its partitions and writes none): R < the expert-parallel size, which the files record only as the name
of the experts' optimizer group (`ep_size_N`), capped by dp_world_size as deepspeed.utils.groups caps it.

A PipelineModule (runtime/pipe/module.py save_state_dict / load_state_dir): the model states (`module` None, one
mp_rank_MM per pipeline stage x tensor slice) hold no weights; each layer with state is
`layer_XX[-model_YY]-model_states.pt`, one per tensor-slice rank YY < tp_degree, and each stage's load asserts a file
for every layer it owns that has state (a function layer has none). What records which layers those are: at ZeRO >= 1
each stage's `param_shapes` (its parameters named `<layer>.<name>`), so those are required exactly; a layer without
parameters, or any layer at ZeRO-0, is recorded nowhere, so an index missing between files is only a warning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding

LATEST = "latest"  # <save_dir>/latest: the tag load_checkpoint(tag=None) resumes
# ds_to_universal's output: <save_dir>/<tag>/zero/<param>/{fp32,exp_avg,...}.pt and zero/optimizer_state.pt beside
# the model states, named by <save_dir>/latest_universal, which an engine with checkpoint.load_universal resumes
LATEST_UNIVERSAL = "latest_universal"
UNIVERSAL_DIR = "zero"
UNIVERSAL_OPTIM = "optimizer_state.pt"
MODEL_RE = re.compile(r"mp_rank_(\d{2,9})_model_states\.pt")
ZERO3_MODEL_RE = re.compile(r"zero_pp_rank_(\d{1,9})_mp_rank_(\d{2,9})_model_states\.pt")
OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d{1,9})_mp_rank_(\d{2,9})_optim_states\.pt")
EXPERT_RE = re.compile(r"(?:layer_(\d{1,9})_)?expert_(\d{1,9})_mp_rank_(\d{2,9})_model_states\.pt")
PIPE_LAYER_RE = re.compile(r"layer_(\d{2,9})(?:-model_(\d{2,9}))?-model_states\.pt")
EXPP_RE = re.compile(r"expp_rank_(\d{1,9})_mp_rank_(\d{2,9})_optim_states\.pt")
MAX_EXPERT_FILES = 1 << 20  # beyond any MoE save (1024 experts x 64 layers x 16 mp ranks): a count not to expand
MAX_GRID_FILES = 1 << 20  # beyond any save's dp x mp grid of model-state files (a million ranks): not expanded
STEP_TAG_RE = re.compile(r"(?:best_)?global_step(\d{1,19})")  # engine's default tag, and OpenRLHF's best_ tags
# OpenRLHF (openrlhf/utils/deepspeed/deepspeed.py save_ckpt): PPO saves the actor's and the critic's engines into
# <ckpt.path>/_actor and <ckpt.path>/_critic under one tag, writes <tag>/metric.json after each DeepSpeed save, and
# may export the actor's HF weights to <ckpt.path>/<tag>_hf
OPENRLHF_PAIR = {"_actor": "_critic", "_critic": "_actor"}
METRIC_JSON = "metric.json"
HF_EXPORT_SUFFIX = "_hf"
# what every file of one save records alike (partition_count is checked against dp_world_size below)
SAME_KEYS = (
    *("ds_version", "zero_stage", "dp_world_size", "mp_world_size", "global_steps", "partition_count"),
    *("num_experts", "ep_size", "pipeline", "tp_degree"),
)


# any of them, as one pattern: the layout asks this of every file name on every scan (a million at 1M files)
SHARD_RE = re.compile(
    "|".join(f"(?:{r.pattern})" for r in (MODEL_RE, ZERO3_MODEL_RE, OPTIM_RE, EXPERT_RE, EXPP_RE, PIPE_LAYER_RE))
)


def is_shard(name: str) -> bool:
    return SHARD_RE.fullmatch(name) is not None


def rank_of(name: str) -> int | None:
    """The data-parallel rank of a zero_pp_rank_D file, the expert-parallel rank of an expp_rank_R file, the
    model-parallel rank of an mp_rank_MM file."""
    if m := ZERO3_MODEL_RE.fullmatch(name):
        return int(m.group(1))
    if m := OPTIM_RE.fullmatch(name):
        return int(m.group(2))
    if m := EXPP_RE.fullmatch(name):
        return int(m.group(1))
    if m := MODEL_RE.fullmatch(name):
        return int(m.group(1))
    return None  # an expert's file: read by whichever rank holds that expert


@dataclass(frozen=True, slots=True)
class Degrees:
    stage: int
    dp: int
    mp: int
    experts: tuple[int, ...] | int | None = None  # num_experts: one count per MoE layer, or the old format's int
    ep: int | None = None  # the expert-parallel size, when the files record it
    autoep: bool = False  # AutoEP layers: at ZeRO-3 their experts are in the ZeRO partitions, no expert files
    pipeline: bool = False  # a PipelineModule's: its weights are in layer_XX files
    tp: int = 1  # the tensor-slice degree (checkpoint_parallel_dimensions' tp_degree)
    layers: frozenset[int] = frozenset()  # the pipeline layers the stages' param_shapes record


def check_tag(
    tag_dir: str, step: int | None, metas: Mapping[str, Mapping[str, int | str] | None], *, universal: bool = False
) -> tuple[Degrees | None, tuple[Finding, ...]]:
    """(the degrees the tag records, findings) for the DeepSpeed files `metas` in `tag_dir`.

    `metas`: file name -> what it records (readers.deepspeed_meta), or None when it could not be read (its own
    findings say why); `step`: the N of a global_stepN tag, which every model states file's global_steps must equal;
    `universal`: a universal checkpoint (its optimizer state is in zero/, see universal_findings).
    """
    at = lambda n: f"{tag_dir}/{n}"  # noqa: E731
    out: list[Finding] = []
    seen: dict[str, dict[int | str, list[str]]] = {}  # key -> value -> files recording it
    for name, meta in sorted(metas.items()):
        for key, value in (meta or {}).items():
            seen.setdefault(key, {}).setdefault(value, []).append(name)
    recorded_dp = _one(seen.get("dp_world_size"))
    for key in SAME_KEYS:
        if key == "global_steps" and step is not None:
            continue  # checked against the tag's N below
        if key == "partition_count" and isinstance(recorded_dp, int):
            continue  # each held against the model states' dp_world_size below, not against the other shards
        values = seen.get(key, {})
        if len(values) > 1:
            common = max(values, key=lambda v: len(values[v]))
            for value, names in values.items():
                if value != common:
                    out += [
                        finding(
                            "ds-mixed-shards",
                            at(n),
                            f"records {key}={value}, the tag's other files {key}={common}: from another save",
                            rank=rank_of(n),
                        )
                        for n in names
                    ]
    if step is not None:
        for value, names in seen.get("global_steps", {}).items():
            if value != step:
                out += [
                    finding(
                        "ds-mixed-shards",
                        at(n),
                        f"records global_steps={value} in tag global_step{step}: a stale file from another save",
                        rank=rank_of(n),
                    )
                    for n in names
                ]
    stage, dp, mp = (_one(seen.get(k)) for k in ("zero_stage", "dp_world_size", "mp_world_size"))
    if dp is None:
        dp = _one(seen.get("partition_count"))  # the optimizer's own partition count: the same degree
    if isinstance(recorded_dp, int):
        out += [
            finding(
                "ds-mixed-shards",
                at(n),
                f"partition_count={pc} but the model states record dp_world_size={recorded_dp}: another world size",
                rank=rank_of(n),
            )
            for pc, names in seen.get("partition_count", {}).items()
            if pc != recorded_dp
            for n in names
        ]
    if (
        not (isinstance(stage, int) and isinstance(dp, int) and isinstance(mp, int))
        or min(stage, dp, mp) < 0
        or not dp
        or not mp
    ):
        if all(m is not None for m in metas.values()):  # an unread file already says why it is not known
            out.append(
                finding(
                    "ds-degrees-unknown",
                    tag_dir,
                    "no file records the ZeRO stage, dp_world_size and mp_world_size: the files a resume needs "
                    "cannot be told",
                )
            )
        return None, tuple(out)
    if dp * mp > MAX_GRID_FILES:  # a crafted or damaged file: its grid (optimizer shards: dp x mp) is not expanded
        why = f"dp_world_size={dp} and mp_world_size={mp} make a grid of {dp * mp} files, more than any save writes"
        return None, (*out, finding("ds-degrees-unknown", tag_dir, f"{why}; which files a resume needs cannot be told"))
    experts, ep = _one(seen.get("num_experts")), _one(seen.get("ep_size"))
    deg = Degrees(
        stage=stage,
        dp=dp,
        mp=mp,
        experts=tuple(map(int, experts.strip("[]").split(","))) if isinstance(experts, str) else experts,
        ep=ep if isinstance(ep, int) and ep > 0 else None,
        autoep=bool(seen.get("autoep")),
        pipeline=bool(seen.get("pipeline")),
        tp=tp if isinstance(tp := _one(seen.get("tp_degree")), int) and 0 < tp <= mp else 1,  # a slice of mp
        layers=frozenset(int(i) for v in seen.get("pipe_layers", {}) for i in str(v).strip("[]").split(",") if i),
    )
    out += _grid(tag_dir, deg, frozenset(metas), universal)
    return deg, tuple(out)


def _grid(tag_dir: str, deg: Degrees, names: frozenset[str], universal: bool = False) -> list[Finding]:
    """Missing files of the grid the degrees require, one optimizer spelling, and leftovers beyond the grid."""
    at = lambda n: f"{tag_dir}/{n}"  # noqa: E731
    out: list[Finding] = []
    mps = [f"{m:02d}" for m in range(deg.mp)]
    if universal:  # the engine opens data-parallel rank 0's model states (ZeRO-3) and reads optimizer state in zero/
        prefix = "zero_pp_rank_0_" if deg.stage == 3 else ""
        need = {f"{prefix}mp_rank_{m}_model_states.pt" for m in mps}
        return [
            finding(
                "ds-missing-shard",
                at(n),
                "missing: the universal checkpoint's model states; load_checkpoint raises FileNotFoundError",
                rank=rank_of(n),
            )
            for n in sorted(need - names, key=_natural)
        ]
    if deg.stage == 3:
        need = {f"zero_pp_rank_{d}_mp_rank_{m}_model_states.pt" for d in range(deg.dp) for m in mps}
    else:
        need = {f"mp_rank_{m}_model_states.pt" for m in mps}
    expert_files = (deg.experts if isinstance(deg.experts, int) else sum(deg.experts or ())) * deg.mp
    if expert_files > MAX_EXPERT_FILES:  # a count no save writes (a crafted or damaged file): not judged by it
        out.append(
            finding(
                "ds-degrees-unknown",
                tag_dir,
                f"the model states' num_experts and mp_world_size add up to {expert_files} expert files, more "
                "than any save writes; which files a resume needs cannot be told",
            )
        )
    else:
        need |= _moe_need(deg, mps)
    if deg.pipeline:
        pipe_need, pipe_found = _pipe(tag_dir, deg, names)
        need |= pipe_need
        out += pipe_found
    if deg.experts is not None and deg.stage == 0 and deg.ep is None:
        out.append(
            finding(
                "ds-moe-ep-unknown",
                tag_dir,
                "MoE at ZeRO-0: no optimizer group records the expert-parallel size (ep_size_N), so only "
                "expp_rank_0's optimizer file is required",
            )
        )
    optim = {n for n in names if OPTIM_RE.fullmatch(n)}
    spellings = {n.startswith("bf16_") for n in optim}
    if len(spellings) > 1:
        plain = sorted(n for n in optim if not n.startswith("bf16_"))
        out.append(
            finding(
                "ds-mixed-names",
                at(plain[0]),
                f"{len(optim) - len(plain)} bf16_zero_pp_rank_* and {len(plain)} zero_pp_rank_* optimizer shards: "
                "the engine opens one spelling for every rank",
            )
        )
    prefix = "bf16_" if spellings == {True} else ""
    if deg.stage >= 1:
        need |= {f"{prefix}zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt" for d in range(deg.dp) for m in mps}
    for n in sorted(need - names, key=_natural):
        out.append(
            finding(
                "ds-missing-shard",
                at(n),
                f"missing: pipeline layer {m.group(1)} of a stage's param_shapes (tp_degree={deg.tp}): that "
                "stage's load_checkpoint fails on it (AssertionError when no file of the layer is left)"
                if (m := PIPE_LAYER_RE.fullmatch(n))
                else f"missing: ZeRO-{deg.stage} with dp_world_size={deg.dp}, mp_world_size={deg.mp}"
                f"{_moe_text(deg)} needs it; that rank's load_checkpoint raises FileNotFoundError",
                rank=rank_of(n),
            )
        )
    extra = names - need - (optim if len(spellings) > 1 else set())
    for n in sorted(extra, key=_natural):
        out.append(
            finding(
                "ds-extra-shard",
                at(n),
                f"beyond the grid of ZeRO-{deg.stage}, dp_world_size={deg.dp}, mp_world_size={deg.mp}: "
                "left by another save; load_checkpoint never opens it",
                rank=rank_of(n),
            )
        )
    return out


def _moe_need(deg: Degrees, mps: list[str]) -> set[str]:
    """The MoE files load_checkpoint opens for the experts the model states record (none for a dense model)."""
    if deg.experts is None or (deg.autoep and deg.stage == 3):
        return set()
    if isinstance(deg.experts, int):  # the old format's load: expert_E for E < num_experts
        need = {f"expert_{e}_mp_rank_{m}_model_states.pt" for e in range(deg.experts) for m in mps}
    else:
        need = {
            f"layer_{layer}_expert_{e}_mp_rank_{m}_model_states.pt"
            for layer, n in enumerate(deg.experts)
            for e in range(n)
            for m in mps
        }
    if deg.stage == 0:
        need |= {f"expp_rank_{r}_mp_rank_{m}_optim_states.pt" for r in range(min(deg.ep or 1, deg.dp)) for m in mps}
    return need


def _pipe(tag_dir: str, deg: Degrees, names: frozenset[str]) -> tuple[set[str], list[Finding]]:
    """(the layer files a pipeline's load opens, as far as the files record them; a warning for each index missing
    between them, or a finding when there is no layer file at all)."""
    present = {int(m.group(1)): m.group(2) is not None for n in names if (m := PIPE_LAYER_RE.fullmatch(n))}
    if not present and not deg.layers:
        return set(), [
            finding(
                "ds-missing-shard", tag_dir, "a pipeline's model states but no layer_* file: its weights are nowhere"
            )
        ]
    # topologies with a tensor-slice axis name it in every layer file (layer_XX-model_YY); without one, none does
    sliced = deg.tp > 1 or any(present.values())
    known = deg.layers | set(present)
    need = {
        f"layer_{i:02d}-model_{y:02d}-model_states.pt" if sliced else f"layer_{i:02d}-model_states.pt"
        for i in known
        for y in range(deg.tp)
    }
    ordered = sorted(known)
    gaps = [(a + 1, b - 1) for a, b in zip([-1, *ordered], ordered) if b > a + 1]  # runs of absent indices
    if not gaps:
        return need, []
    runs = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in gaps[:5]) + (", ..." if len(gaps) > 5 else "")
    return need, [
        finding(
            "ds-pipe-layer-gap",
            f"{tag_dir}/layer_{gaps[0][0]:02d}-*model_states.pt",
            f"no file for pipeline layer(s) {runs} between others: a layer without state (a function) has none, a "
            "module's missing file makes its stage's load_checkpoint fail (AssertionError); the files do not record "
            "which",
        )
    ]


def _moe_text(deg: Degrees) -> str:
    if deg.experts is None:
        return ""
    n = deg.experts if isinstance(deg.experts, int) else list(deg.experts)
    return f", num_experts={n}" + (f", expert-parallel size {deg.ep}" if deg.ep else "")


def _one(values: Mapping[int | str, list[str]] | None) -> int | str | None:
    """The value most files record (ties: the smallest), or None when none does."""
    if not values:
        return None
    return max(sorted(values, key=str), key=lambda v: len(values[v]))


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def tag_step(tag: str) -> int | None:
    """N of a global_stepN / best_global_stepN tag; None for a custom tag."""
    m = STEP_TAG_RE.fullmatch(tag)
    return int(m.group(1)) if m else None


def read_latest(text: str | None) -> str | None:
    """The tag `latest` names as load_checkpoint reads it (`fd.read().strip()`); None when empty or unread."""
    if text is None:
        return None
    tag = text.strip()
    return tag or None


def read_metric_json(doc: object) -> tuple[str | None, float | None]:
    """(metric_key, metric_value) of an OpenRLHF metric.json as its own rotation reads it (a value that float()
    refuses, or none, is no metric)."""
    if not isinstance(doc, dict):
        return None, None
    key, value = doc.get("metric_key"), doc.get("metric_value")
    try:
        number = float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    return (key if isinstance(key, str) else None), number


def universal_findings(tag_dir: str, params: Mapping[str, frozenset[str]], names: frozenset[str]) -> list[Finding]:
    """A universal checkpoint's zero/ (`names`: its files, `params`: each parameter folder's files), as the engine's
    universal load reads it: zero/optimizer_state.pt (it asserts the file is there), and in each parameter folder
    every `<key>.pt` it finds (fp32.pt the master weights, the optimizer's moments, step): a folder lacking a file
    the others hold resumes that parameter without it."""
    zero = f"{tag_dir}/{UNIVERSAL_DIR}"
    out = []
    if UNIVERSAL_OPTIM not in names:
        out.append(
            finding(
                "ds-missing-shard",
                f"{zero}/{UNIVERSAL_OPTIM}",
                "missing: the universal load asserts the optimizer's global state is there",
            )
        )
    held = frozenset().union(*params.values()) if params else frozenset()
    if "fp32.pt" not in held:
        out.append(finding("ds-missing-shard", zero, "no parameter folder holds fp32.pt: no master weights to load"))
    for p, files in sorted(params.items()):
        out += [
            finding(
                "ds-missing-shard",
                f"{zero}/{p}/{f}",
                "missing: the other parameter folders hold it; the universal load resumes this parameter without it",
            )
            for f in sorted(held - files)
        ]
    return out
