"""A DeepSpeed ZeRO checkpoint as a stream-export Plan (stream_plan): what zero_to_fp32 rebuilds, without torch,
DeepSpeed or the model in memory.

The files are read with the restricted unpickler (readers.pt) only; each output tensor is a list of byte
ranges in the shards, copied in blocks by stream_copy. The layout, as DeepSpeed 0.19 saves it:

- The model states (`mp_rank_00_model_states.pt`; ZeRO-3: `zero_pp_rank_D_mp_rank_00_model_states.pt` per rank)
  hold `param_shapes` (one {name: shape} per optimizer parameter group, in flattening order), `buffer_names`,
  `shared_params` ({tied name: the name it shares}), `frozen_param_shapes`/`frozen_param_fragments` (parameters
  without a gradient, which no optimizer partition holds) and `module`, the module's state dict.
- The optimizer states (`[bf16_|fp16_]zero_pp_rank_D_mp_rank_00_optim_states.pt`, one per data-parallel rank) hold
  that rank's partition of the fp32 master weights: `single_partition_of_fp32_groups` (ZeRO 1/2: group i of the
  whole model is the ranks' partitions one after another, each parameter followed by its
  `param_alignment_paddings` entry; the group ends padded to a multiple of 2 x world size) or `fp32_flat_groups`
  (ZeRO-3: every parameter split across the ranks, ceil(numel / world) elements each, the last rank's part padded;
  a rank's groups form one flat sequence of its parts, in `param_shapes` order).

`weights="fp32"` plans what `get_fp32_state_dict_from_zero_checkpoint` returns: buffers (floating ones as float32),
frozen parameters as saved, trainable parameters from the fp32 partitions, then each shared name as a copy of the
tensor it shares. `weights="module"` plans `module` as saved (ZeRO 1/2: the full 16-bit weights, or fp32 when
training in fp32). ZeRO-3 saves no module weights (every parameter in `module` is an empty placeholder; the
16-bit weights exist only where the trainer gathered them at save time, as HF Trainer's model.safetensors with
`stage3_gather_16bit_weights_on_model_save`), so that is refused with the way out. Model-parallel (mp_world_size
> 1), pipeline (`layer_*`) and MoE (`expert_*`) checkpoints are refused: zero_to_fp32 does not merge them either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpt_audit.export.stream_plan import (
    FLOATS,
    ITEMSIZE,
    Locator,
    Piece,
    Plan,
    Planned,
    StreamError,
    StreamUnsupported,
    streamable_structure,
)
from ckpt_audit.readers.deepspeed_meta import ZERO_STAGE
from ckpt_audit.readers.pt import PtStructure, TensorInfo
from ckpt_audit.readers.unpickler import is_record
from ckpt_audit.rules import deepspeed as ds

WEIGHTS = ("fp32", "module")
_MAX_TAG = 4096  # `latest` holds one tag name


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroFiles:
    """One tag directory's files by data-parallel rank, as the names say (the pickles are judged in plan_zero)."""

    tag_dir: Path
    model: dict[int, Path]  # ZeRO 1/2: {0: mp_rank_00_model_states.pt}; ZeRO-3: one per rank
    optim: dict[int, Path]

    def read(self, weights: str) -> list[Path]:
        """Every file the export of `weights` reads, in rank order."""
        files = [self.model[r] for r in sorted(self.model)]
        return files + ([self.optim[r] for r in sorted(self.optim)] if weights == "fp32" else [])


def tag_dir(src: Path, names: Callable[[Path], Sequence[str]]) -> Path | None:
    """The DeepSpeed tag directory `src` names: itself when it holds model states, else the tag its `latest` (the
    tracker DeepSpeed's load_checkpoint reads) names, as in a save dir or an HF Trainer checkpoint-N. None: not a
    DeepSpeed checkpoint. `names(d)`: the file names the walk listed in `d` (export.sources). Raises StreamError for
    a `latest` naming no tag here."""
    if any(map(_model_states, names(src))):
        return src
    if "latest" not in names(src):
        return None
    latest = src / "latest"
    try:
        with open(latest, "rb") as fh:
            tag = fh.read(_MAX_TAG).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise StreamError(f"{latest}: unreadable ({getattr(exc, 'strerror', None) or exc})") from None
    if not tag or "/" in tag or tag in (".", ".."):
        raise StreamError(f"{latest}: does not name a tag directory ({tag[:60]!r})")
    if not any(map(_model_states, names(src / tag))):
        raise StreamError(f"{latest} names {tag}, which holds no DeepSpeed model states")
    return src / tag


def zero_files(tag: Path, names: Sequence[str]) -> ZeroFiles:
    """The model and optimizer states of `tag` (whose files are `names`) by rank, named as DeepSpeed's load opens
    them (rules.deepspeed, the scan's names); one spelling of the optimizer shards, model-parallel rank 0 only.
    Raises StreamUnsupported for layouts zero_to_fp32 does not merge."""
    if any(n.startswith(("layer_", "expert_", "expp_rank_")) for n in names):
        raise StreamUnsupported(f"{tag}: pipeline or MoE files (layer_*, expert_*): zero_to_fp32 does not merge them")
    model, optim, spellings = {}, {}, set()
    for n in sorted(names):
        if m := ds.ZERO3_MODEL_RE.fullmatch(n):
            _mp_zero(tag, n, m[2])
            model[int(m[1])] = tag / n
        elif m := ds.MODEL_RE.fullmatch(n):
            _mp_zero(tag, n, m[1])
            model[0] = tag / n
        elif m := ds.OPTIM_RE.fullmatch(n):
            _mp_zero(tag, n, m[3])
            spellings.add(m[1] or "")
            optim[int(m[2])] = tag / n
    if len(spellings) > 1:
        named = " and ".join(f"{s}zero_pp_rank_*" for s in sorted(spellings))
        raise StreamError(f"{tag}: optimizer shards in two spellings ({named}): from two different saves")
    return ZeroFiles(tag_dir=tag, model=model, optim=optim)


def plan_zero(files: ZeroFiles, weights: str = "fp32") -> Plan:
    """The Plan of a ZeRO 1/2/3 checkpoint's tag `files` (zero_files). Raises StreamError (one line) for what
    cannot be exported as it is."""
    if weights not in WEIGHTS:
        raise StreamError(f"unknown weights {weights!r} (use {' or '.join(WEIGHTS)})")
    tag = files.tag_dir
    if 0 not in files.model:
        raise StreamError(f"{tag}: no model states of rank 0")
    first = streamable_structure(files.model[0])
    tree = first.tree if isinstance(first.tree, dict) else {}
    if not isinstance(tree.get("ds_version"), str) or "param_shapes" not in tree:
        raise StreamError(f"{files.model[0]}: not DeepSpeed model states (no ds_version, no param_shapes)")
    if (mp := tree.get("mp_world_size", 1)) != 1:
        raise StreamUnsupported(
            f"{tag}: model-parallel checkpoint (mp_world_size {mp}): zero_to_fp32 does not merge it"
        )
    if weights == "module":
        return _plan_module(files, first, tree)
    return _Fp32(files, first, tree).plan()


def _model_states(name: str) -> bool:
    return bool(ds.MODEL_RE.fullmatch(name) or ds.ZERO3_MODEL_RE.fullmatch(name))


# ---------------------------------------------------------------------------------------------------- module


def _plan_module(files: ZeroFiles, first: PtStructure, tree: dict) -> Plan:
    shapes = {n: s for g in _shape_groups(tree, files.model[0]) for n, s in g.items()}
    module = _tensor_dict(tree.get("module"), files.model[0], "module")
    empty = [n for n, t in module.items() if n in shapes and _numel(t.shape) == 0 and _numel(shapes[n])]
    if empty:
        raise StreamError(
            f"{files.tag_dir}: ZeRO-3 saves no module weights ({empty[0]} is an empty placeholder in "
            "module); export the fp32 master weights (--weights fp32), or the 16-bit weights the trainer gathered "
            "at save time (HF Trainer's model.safetensors with stage3_gather_16bit_weights_on_model_save)"
        )
    loc = Locator(files.model[0], first)
    try:
        out = tuple(_whole(loc, n, t) for n, t in module.items())
    finally:
        loc.close()
    dp = tree.get("dp_world_size")
    skipped = [k for k in tree["module"] if k not in module]
    warnings = (f"{len(skipped)} module entries are not tensors (e.g. {skipped[0]}); skipped",) if skipped else ()
    world = dp if isinstance(dp, int) and not isinstance(dp, bool) else None
    return Plan(kind="deepspeed-module", world_size=world, tensors=out, warnings=warnings)


# ---------------------------------------------------------------------------------------------------- fp32


class _Fp32:
    """zero_to_fp32's reconstruction, as byte ranges."""

    def __init__(self, files: ZeroFiles, first: PtStructure, tree: dict) -> None:
        self.files, self.first, self.tree = files, first, tree
        self.path0 = files.model[0]
        self.flat_dtype: str | None = None  # every partition's dtype (float32 as DeepSpeed saves them)
        self.item = 4

    def plan(self) -> Plan:
        structs = {r: streamable_structure(p) for r, p in sorted(self.files.optim.items())}
        if not structs:
            raise StreamError(
                f"{self.files.tag_dir}: no optimizer states ([bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt, "
                "the names DeepSpeed saves and loads): the fp32 master weights are in them (--weights module "
                "exports the module's own weights)"
            )
        osd = {r: _dict(s.tree, "optimizer_state_dict", s.path) for r, s in structs.items()}
        stage, world = _stage_and_world(osd[min(osd)], structs[min(structs)].path)
        for r, o in osd.items():
            if _stage_and_world(o, structs[r].path) != (stage, world):
                raise StreamError(f"{structs[r].path}: ZeRO stage or partition count differs from rank {min(osd)}'s")
        # the first few missing ranks: a hostile partition_count must not make a list that large
        if missing := [r for r in range(min(world, max(structs) + 9)) if r not in structs][:8]:
            raise StreamError(
                f"{self.files.tag_dir}: missing optimizer shard(s) for rank {', '.join(map(str, missing))} of {world} "
                "(partition_count)"
            )
        if extra := [r for r in structs if r >= world]:
            raise StreamError(
                f"{self.files.tag_dir}: optimizer shard of rank {extra[0]} beyond partition_count {world}"
            )
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        locs = {r: Locator(self.files.optim[r], s) for r, s in structs.items()}
        try:
            groups = {
                r: [self._flat(locs[r], t) for t in _tensor_list(osd[r].get(key), structs[r].path, key)]
                for r in range(world)
            }
            shapes = _shape_groups(self.tree, self.path0)
            trainable = (
                self._zero3(groups, shapes, world) if stage == 3 else self._zero12(groups, shapes, world, osd[0])
            )
        finally:
            for loc in locs.values():
                loc.close()
        out = [*self._buffers(), *self._frozen(stage, world), *trainable]
        names = {t.name: t for t in out}
        for tied, shared in self._shared():
            if shared in names:  # zero_to_fp32: the tied name gets the same tensor
                out.append(replace(names[shared], name=tied))
        return Plan(
            kind=f"deepspeed-zero{stage}-fp32", world_size=world, tensors=tuple(out), warnings=self._left_out(out)
        )

    def _left_out(self, out: list[Planned]) -> tuple[str, ...]:
        """Module tensors DeepSpeed's reconstruction has no place for (ZeRO-1 records no frozen parameters), said
        rather than silently missing; a tensor sharing the storage of an exported one is a tie, not a loss."""
        module = _tensor_dict(self.tree.get("module"), self.path0, "module")
        names = {t.name for t in out}
        kept = {module[n].storage_key for n in names if n in module}
        lost = [n for n, t in module.items() if n not in names and t.storage_key not in kept]
        if not lost:
            return ()
        return (
            f"{len(lost)} module tensor(s) are not in DeepSpeed's fp32 reconstruction (e.g. {lost[0]}; ZeRO-1 records "
            "no frozen parameters) and not exported; --weights module exports the module as saved",
        )

    # -- trainable parameters

    def _zero12(self, groups, shapes: list[dict], world: int, osd0: dict) -> list[Planned]:
        paddings = osd0.get("param_alignment_paddings")
        if len(shapes) != len(groups[0]) or any(len(g) != len(shapes) for g in groups.values()):
            raise StreamError(f"{self.path0}: {len(shapes)} parameter groups, the optimizer shards hold another count")
        out = []
        for i, group in enumerate(shapes):
            parts = [groups[r][i] for r in range(world)]
            pad = paddings[i] if isinstance(paddings, list) and i < len(paddings) else None
            if pad is not None and (not isinstance(pad, list) or len(pad) != len(group)):
                raise StreamError(
                    f"{self.files.optim[0]}: param_alignment_paddings of group {i} do not match param_shapes"
                )
            offset = 0
            for j, (name, shape) in enumerate(group.items()):
                n = _numel(shape)
                out.append(self._planned(name, shape, _cut(parts, offset, n, self.item, name)))
                offset += n + (pad[j] if pad else 0)
            align = 2 * world
            avail = sum(length for _p, length in parts)
            if -(-offset // align) * align != -(-avail // align) * align:  # zero_to_fp32's own sanity check
                raise StreamError(
                    f"{self.files.tag_dir}: group {i}'s partitions hold {avail} elements, param_shapes {offset}"
                )
        return out

    def _zero3(self, groups, shapes: list[dict], world: int) -> list[Planned]:
        out = []
        offset = 0
        for name, shape in ((n, s) for g in shapes for n, s in g.items()):
            n = _numel(shape)
            part = -(-n // world)
            pieces = [p for r in range(world) for p in _cut(groups[r], offset, part, self.item, name)]
            out.append(self._planned(name, shape, _first(pieces, n, self.item)))
            offset += part
        for r in range(world):
            if (have := sum(length for _p, length in groups[r])) != offset:
                raise StreamError(
                    f"{self.files.optim[r]}: its flat partition holds {have} elements, param_shapes {offset}"
                )
        return out

    def _planned(self, name: str, shape: tuple[int, ...], pieces: list[Piece]) -> Planned:
        dtype = self.flat_dtype or "float32"
        return Planned(name=name, shape=shape, dtype=dtype, pieces=tuple(pieces), dim=0 if len(pieces) > 1 else None)

    def _flat(self, loc: Locator, t: TensorInfo) -> tuple[Piece, int]:
        if len(t.shape) != 1 or t.stride != (1,) or t.dtype not in FLOATS:
            raise StreamError(f"{loc.path}: {t.key} is not a flat floating partition ({t.dtype} {list(t.shape)})")
        if self.flat_dtype not in (None, t.dtype):
            raise StreamError(f"{loc.path}: {t.key} is {t.dtype}, other partitions {self.flat_dtype}")
        self.flat_dtype, self.item = t.dtype, ITEMSIZE[t.dtype]
        return loc.piece(t), t.shape[0]

    # -- the rest of the state dict

    def _buffers(self) -> list[Planned]:
        names = self.tree.get("buffer_names") or []
        module = _tensor_dict(self.tree.get("module"), self.path0, "module")
        loc = Locator(self.path0, self.first)
        try:
            out = []
            for n, t in module.items():
                if n in names:
                    p = _whole(loc, n, t)
                    out.append(replace(p, to="float32") if t.dtype in FLOATS and t.dtype != "float32" else p)
            return out
        finally:
            loc.close()

    def _frozen(self, stage: int, world: int) -> list[Planned]:
        shapes = _shape_dict(self.tree.get("frozen_param_shapes") or {}, self.path0, "frozen_param_shapes")
        if not shapes:
            return []
        ranks = list(range(world)) if stage == 3 else [0]
        frags, locs = {}, {}
        for r in ranks:
            if r not in self.files.model:
                raise StreamError(f"{self.files.tag_dir}: missing model states of rank {r} (frozen parameters)")
            s = self.first if r == 0 else streamable_structure(self.files.model[r])
            tree = s.tree if isinstance(s.tree, dict) else {}
            frags[r] = _tensor_dict(tree.get("frozen_param_fragments"), s.path, "frozen_param_fragments")
            locs[r] = Locator(self.files.model[r], s)
        try:
            out = []
            for name, shape in shapes.items():
                if any(name not in frags[r] for r in ranks):
                    raise StreamError(f"{self.path0}: frozen parameter {name} has no saved fragment")
                if stage != 3:  # saved whole
                    if frags[0][name].shape != shape:
                        raise StreamError(f"{self.path0}: frozen {name} is saved as {list(frags[0][name].shape)}")
                    out.append(_whole(locs[0], name, frags[0][name]))
                    continue
                dtype = frags[0][name].dtype
                parts = [(locs[r].piece(frags[r][name]), _numel(frags[r][name].shape)) for r in ranks]
                if any(frags[r][name].dtype != dtype or len(frags[r][name].shape) != 1 for r in ranks):
                    raise StreamError(f"{self.path0}: frozen {name}'s fragments differ in dtype or are not flat")
                item = ITEMSIZE[dtype]
                pieces = _first(_cut(parts, 0, sum(n for _p, n in parts), item, name), _numel(shape), item)
                out.append(Planned(name=name, shape=shape, dtype=dtype, pieces=tuple(pieces), dim=0))
            return out
        finally:
            for loc in locs.values():
                loc.close()

    def _shared(self) -> list[tuple[str, str]]:
        raw = self.tree.get("shared_params") or {}
        if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
            raise StreamError(f"{self.path0}: shared_params is not a {{name: name}} dict")
        return list(raw.items())


# ---------------------------------------------------------------------------------------------------- helpers


def _cut(parts: list[tuple[Piece, int]], start: int, n: int, item: int, name: str) -> list[Piece]:
    """Elements [start, start + n) of the flat sequence the parts (flat pieces, `item` bytes an element) make one
    after another, as pieces."""
    out, base = [], 0
    for p, length in parts:
        lo, hi = max(start, base), min(start + n, base + length)
        if hi > lo:
            out.append(_sub(p, lo - base, hi - lo, item))
        base += length
    if start + n > base:
        raise StreamError(f"{name}: the flat partitions end before it does ({start + n} of {base} elements)")
    return out


def _first(pieces: list[Piece], n: int, item: int) -> list[Piece]:
    """The pieces cut to their first `n` elements (ZeRO-3 pads the last rank's part)."""
    out, left = [], n
    for p in pieces:
        if left <= 0:
            break
        k = min(left, p.shape[0])
        out.append(p if k == p.shape[0] else _sub(p, 0, k, item))
        left -= k
    return out


def _sub(p: Piece, start: int, n: int, item: int) -> Piece:
    return Piece(path=p.path, offset=p.offset + start * item, shape=(n,), strides=(1,))


def _whole(loc: Locator, name: str, t: TensorInfo) -> Planned:
    if t.dtype not in ITEMSIZE or t.storage_key is None:
        raise StreamUnsupported(f"{name}: a {t.dtype} tensor on {t.device}")
    return Planned(name=name, shape=t.shape, dtype=t.dtype, pieces=(loc.piece(t),))


def _stage_and_world(osd: dict, path: str) -> tuple[int, int]:
    rec: Any = osd.get("zero_stage")  # a ZeroStageEnum record, or a plain int
    stage = rec.args[0] if is_record(rec, ZERO_STAGE) and len(rec.args) == 1 else rec
    if stage not in (1, 2, 3):
        raise StreamError(f"{path}: not a ZeRO 1/2/3 optimizer state (zero_stage {stage!r})")
    pc = osd.get("partition_count")
    world = max(pc) if isinstance(pc, list) and pc else pc  # one per group; zero_to_fp32 takes the largest
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise StreamError(f"{path}: partition_count {pc!r} is not a world size")
    return stage, world


def _mp_zero(tag: Path, name: str, mp: str) -> None:
    if int(mp) != 0:
        raise StreamUnsupported(f"{tag}/{name}: model-parallel rank {int(mp)}: zero_to_fp32 does not merge it")


def _dict(tree: Any, key: str, path: str) -> dict:
    v = tree.get(key) if isinstance(tree, dict) else None
    if not isinstance(v, dict):
        raise StreamError(f"{path}: no {key}")
    return v


def _tensor_dict(v: Any, path: Path | str, what: str) -> dict[str, TensorInfo]:
    """The tensors of a {name: tensor} dict (an `_extra_state` or other non-tensor entry is left out)."""
    if not isinstance(v, dict):
        raise StreamError(f"{path}: {what} is not a dict")
    return {k: t for k, t in v.items() if isinstance(k, str) and isinstance(t, TensorInfo)}


def _tensor_list(v: Any, path: str, what: str) -> list[TensorInfo]:
    if not isinstance(v, list) or not v or not all(isinstance(t, TensorInfo) for t in v):
        raise StreamError(f"{path}: {what} is not a list of tensors")
    return v


def _shape_dict(v: Any, path: Path | str, what: str) -> dict[str, tuple[int, ...]]:
    ok = isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(s, tuple) and all(isinstance(x, int) and x >= 0 for x in s)
        for k, s in v.items()
    )
    if not ok:
        raise StreamError(f"{path}: {what} is not a dict of shapes")
    return v


def _shape_groups(tree: dict, path: Path) -> list[dict[str, tuple[int, ...]]]:
    """`param_shapes`: one {name: shape} per optimizer parameter group, in flattening order."""
    raw = tree.get("param_shapes")
    return [_shape_dict(g, path, "param_shapes") for g in (raw if isinstance(raw, list) else [raw])]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
