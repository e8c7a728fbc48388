"""FSDP rank files as a stream-export Plan (stream_plan): which bytes of which rank file make each full tensor, read
from the pickles alone (no torch). A DTensor's Shard(d) pieces are joined along d; HSDP replicas after the first row
of the device mesh are never opened; a plain tensor that differs across ranks is concatenated on dim 0, as verl's
merger does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpt_audit.export.stream_copy import same_bytes
from ckpt_audit.export.stream_plan import (
    ITEMSIZE,
    Locator,
    Plan,
    Planned,
    StreamError,
    StreamUnsupported,
    numel,
    streamable_structure,
)
from ckpt_audit.readers.pt import PtStructure, TensorInfo


def plan_shards(files: dict[int, Path], world_size: int, role_dir: Path) -> Plan:
    """Which bytes of which rank file make each full tensor, read from the pickles alone (no torch)."""
    first = streamable_structure(files[0])
    mesh = _mesh_ranks(first, world_size)
    width = mesh[1]
    ranks = list(mesh[0][:width])  # HSDP: ranks along the leading (replicate) dims hold copies; read the first row
    if 0 not in ranks:
        raise StreamError(f"{role_dir}: rank 0 is not in the first replica of mesh {list(mesh[0])}")
    structs = {0: first}
    for r in ranks:
        if r not in structs:
            structs[r] = streamable_structure(files[r])
    keys0 = list(first.keys)
    for r, s in structs.items():
        if set(s.keys) != set(keys0):
            extra = sorted(set(s.keys) ^ set(keys0))[:3]
            raise StreamError(f"rank {r} and rank 0 hold different keys (e.g. {', '.join(extra)})")
    locate = {r: Locator(files[r], structs[r]) for r in ranks}
    top = {r: {str(t.key_path[0]): t for t in s.tensors if len(t.key_path) == 1} for r, s in structs.items()}
    tree = first.tree if isinstance(first.tree, dict) else {}
    values = {str(k): v for k, v in tree.items()}
    warnings: list[str] = []
    out: list[Planned] = []
    for key in keys0:
        v0 = top[0].get(key)
        if v0 is None:
            warnings.append(f"{key}: not a tensor ({type(values.get(key)).__name__}); skipped")
            continue
        if v0.dtype not in ITEMSIZE or v0.storage_key is None:
            raise StreamUnsupported(f"{key}: a {v0.dtype} tensor on {v0.device}")
        if v0.is_dtensor:
            out.append(_plan_dtensor(key, v0, ranks, top, locate))
        else:
            pieces = [locate[r].piece(top[r][key]) for r in ranks]
            t = Planned(name=key, shape=v0.shape, dtype=v0.dtype, pieces=(pieces[0],))
            if len(pieces) > 1 and not all(
                top[r][key].shape == v0.shape and top[r][key].dtype == v0.dtype and same_bytes(p, pieces[0], v0.dtype)
                for r, p in zip(ranks[1:], pieces[1:])
            ):
                shape = (sum(top[r][key].shape[0] for r in ranks), *v0.shape[1:])
                t = replace(t, dim=0, pieces=tuple(pieces), shape=shape)  # what verl's merger does
                warnings.append(f"{key}: plain tensor differs across ranks; concatenated on dim 0")
            out.append(t)
    for loc in locate.values():
        loc.close()
    return Plan(kind="fsdp-shards", world_size=world_size, tensors=tuple(out), warnings=tuple(warnings))


def _mesh_ranks(first: PtStructure, world_size: int) -> tuple[tuple[int, ...], int]:
    """(mesh ranks in row-major order, size of the last mesh dim), from the first DTensor in key order."""
    for t in sorted((t for t in first.tensors if t.is_dtensor and len(t.key_path) == 1), key=lambda t: t.key):
        shape = t.mesh_shape
        if not shape:
            raise StreamUnsupported(f"{t.key}: device mesh not readable")
        ranks = t.mesh_ranks if t.mesh_ranks is not None else tuple(range(numel(shape)))
        if len(ranks) != world_size:
            raise StreamError(f"device mesh {list(ranks)} does not cover world size {world_size}")
        return ranks, shape[-1]
    return tuple(range(world_size)), world_size


def _plan_dtensor(key: str, v0: TensorInfo, ranks: list[int], top, locate) -> Planned:
    placements = v0.placements
    for r in ranks:
        if top[r][key].placements != placements:
            raise StreamError(f"{key}: placements differ between rank 0 and rank {r}")
    if any(p != "Replicate()" for p in placements[:-1]):
        raise StreamError(f"{key}: placements {placements} shard a replicate mesh dim; unsupported")
    if v0.global_shape is None:
        raise StreamUnsupported(f"{key}: DTensor without its global shape")
    last = placements[-1] if placements else ""
    shape = v0.global_shape
    if last == "Replicate()":
        return Planned(name=key, shape=shape, dtype=v0.dtype, pieces=(locate[0].piece(v0),))
    if last.startswith("Shard(") and last[6:-1].isdigit():
        dim = int(last[6:-1])
        infos = [top[r][key] for r in ranks]
        if any(t.dtype != v0.dtype or len(t.shape) != len(shape) for t in infos):
            raise StreamError(f"{key}: local shards differ in dtype or rank")
        joined = sum(t.shape[dim] for t in infos)
        if joined != shape[dim]:
            raise StreamError(f"{key}: shards join to {joined} along dim {dim}, not {shape[dim]}")
        pieces = tuple(locate[r].piece(t) for r, t in zip(ranks, infos))
        return Planned(name=key, shape=shape, dtype=v0.dtype, pieces=pieces, dim=dim)
    raise StreamError(f"{key}: placement {last} is not supported (only Shard(d) and Replicate)")
