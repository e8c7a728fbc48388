"""verify's deep check of a verl FSDP component: every rank's files loaded the safe way, boiled down to plain views,
and judged across ranks; and of a verl step's own dataloader state (`data.pt`).

Each rank's model, optimizer and extra-state shard goes through `safe_load` (weights_only, mmap: per-file cost, no
tensor bytes read except the few scalars the checks compare) and `structure` (what verl's load indexes). What loads
becomes a `views.RankView`; the pure rules compare the ranks (`model_rules`, `optim_rules`, `identity`, `values`),
and `values.check_unchanged` compares the component with the run's previous checkpoint (`Deep.since`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import replace
from functools import partial
from typing import Any

from ckpt_audit.deep import dataloader, identity, model_rules, optim_rules, safe_load, structure, values
from ckpt_audit.deep.check import Deep
from ckpt_audit.deep.views import ComponentView, RankView, TensorView
from ckpt_audit.layouts import verl_fsdp
from ckpt_audit.models import Checkpoint, Component, FileKind, Finding
from ckpt_audit.readers import bounded_json


def check(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> Deep:
    """The component's findings, and its view for the next checkpoint's comparison (none when no rank loaded)."""
    found, cv = _fsdp(ckpt, comp, bad)
    # the scan already named a DeviceMesh that disagrees with the shard names (mesh-size-mismatch): not again
    meshes = {f.path for f in comp.findings if f.code == "mesh-size-mismatch"}
    found = tuple(f for f in found if not (f.code == "mesh-config-mismatch" and f.path in meshes))
    if cv is None:
        return Deep(found)
    return Deep(found, view=cv, since=partial(_since, cv))


def check_rules(c: ComponentView) -> tuple[Finding, ...]:
    """The cross-rank rules over one component's views."""
    models = [r for r in c.ranks if r.model is not None]
    return (
        *model_rules.check_key_sets(models),
        *model_rules.check_dtensors(c, models),
        *model_rules.check_tied(c, models),
        *optim_rules.check_optimizer(c.ranks),
        *optim_rules.check_extra(c),
    )


def check_step(ckpt: Checkpoint, bad: Set[str]) -> tuple[Finding, ...]:
    """The dataloader state (`data.pt`) a verl step holds beside its roles, as StatefulDataLoader reads it."""
    out: list[Finding] = []
    for f in ckpt.files:
        if f.kind is FileKind.DATA and f.path not in bad:
            res = safe_load.load(f.path)
            out.extend(dataloader.check_dataloader(f.path, res.value) if res.loaded else res.findings)
    return tuple(out)


def _since(cv: ComponentView, previous: Deep, name: str) -> Sequence[Finding]:
    if not isinstance(previous.view, ComponentView):
        return ()
    return values.check_unchanged(previous.view, cv, _same_storage, name)


OPTIM_INVALID = "optimizer-state-invalid"
# what verl's load does with each kind of per-rank file (deep/structure.py)
_STRUCTURE = {
    FileKind.MODEL: structure.check_model,
    FileKind.OPTIM: structure.check_optimizer,
    FileKind.EXTRA_STATE: structure.check_extra_state,
}


def _fsdp(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> tuple[tuple[Finding, ...], ComponentView | None]:
    ws = comp.world_size
    files: dict[tuple[FileKind, int], str] = {}
    for f in comp.files:
        if f.rank is not None and f.kind in _STRUCTURE and (ws is None or f.world_size in (ws, None)):
            files[(f.kind, f.rank)] = f.path
    ranks = sorted({r for _, r in files})
    if not ranks:
        return (), None
    found: list[Finding] = []
    loaded: dict[str, safe_load.LoadResult] = {}
    for (kind, rank), path in sorted(files.items(), key=lambda kv: kv[1]):
        if path in bad:
            continue
        res = safe_load.load(path)
        found.extend(res.findings)
        if res.loaded:
            found.extend(_STRUCTURE[kind](path, rank, res.value, _is_tensor))
        loaded[path] = res
    # an optimizer shard structure.check_optimizer rejects gets no view: the value checks read only usable state
    usable = {p: res for p, res in loaded.items() if p not in {f.path for f in found if f.code == OPTIM_INVALID}}
    views = []
    for r in ranks:
        views.append(
            _rank_view(
                r,
                files.get((FileKind.MODEL, r)),
                files.get((FileKind.OPTIM, r)),
                files.get((FileKind.EXTRA_STATE, r)),
                usable,
            )
        )
    views = _replica_equality(views, loaded, files)
    cv = ComponentView(
        path=comp.path,
        step=ckpt.step,
        world_size=ws,
        config_world_size=verl_fsdp.config_world_size(comp.path),
        tie_word_embeddings=_json_bool(f"{comp.path}/{verl_fsdp.HF_CONFIG}", "tie_word_embeddings"),
        ranks=tuple(views),
    )
    return (
        tuple(found) + check_rules(cv) + tuple(identity.check_identity(cv)) + tuple(values.check_values(cv)),
        cv,
    )


def _rank_view(
    rank: int, model: str | None, optim: str | None, extra: str | None, loaded: Mapping[str, safe_load.LoadResult]
) -> RankView:
    kw: dict[str, Any] = {"rank": rank, "model_path": model, "optim_path": optim, "extra_path": extra}
    m = loaded.get(model) if model else None
    if m is not None and m.loaded and isinstance(m.value, Mapping):
        infos = _infos(m)
        crcs = m.entry_crc
        kw["model"] = {str(k): tensor_view(v, infos.get((k,)), crcs) for k, v in m.value.items() if _is_tensor(v)}
    o = loaded.get(optim) if optim else None
    if o is not None and o.loaded:  # only when structure.check_optimizer found it usable (_fsdp)
        infos = _infos(o)
        kw["optim_state"] = {
            int(i): {
                str(n): (
                    _scalar(t)
                    if n == "step"
                    else tensor_view(t, infos.get(("state", i, n)), o.entry_crc)
                    if _is_tensor(t)
                    else t
                )
                for n, t in st.items()
            }
            for i, st in o.value["state"].items()
            if isinstance(i, int) and isinstance(st, Mapping)
        }
        kw["param_groups"] = [{str(k): _plain(v) for k, v in g.items()} for g in o.value["param_groups"]]
    e = loaded.get(extra) if extra else None
    if e is not None and e.loaded and isinstance(e.value, Mapping):
        kw["extra_keys"] = frozenset(str(k) for k in e.value)
        sched = e.value.get("lr_scheduler")
        kw["lr_scheduler"] = {str(k): _plain(v) for k, v in sched.items()} if isinstance(sched, Mapping) else None
        rng = e.value.get("rng")
        kw["rng_keys"] = frozenset(str(k) for k in rng) if isinstance(rng, Mapping) else None
    return RankView(**kw)


def _infos(res: safe_load.LoadResult) -> dict:
    return {t.key_path: t for t in (res.structure.tensors if res.structure else ())}


def _replica_equality(
    views: list[RankView], loaded: Mapping[str, safe_load.LoadResult], files: Mapping[tuple[FileKind, int], str]
) -> list[RankView]:
    """HSDP replicas whose storages carry no CRC (saved with CRCs off) are compared element by element."""
    out = []
    for v in views:
        eq: dict[tuple[int, str], bool] = {}
        for key, t in (v.model or {}).items():
            if t.crc or not t.mesh_shape or len(t.mesh_shape) != 2 or t.placements[:1] != ("Replicate()",):
                continue
            if t.mesh_ranks is None or v.rank not in t.mesh_ranks:
                continue
            i = t.mesh_ranks.index(v.rank)
            twin = t.mesh_ranks[i % t.mesh_shape[1]]
            if twin == v.rank:
                continue
            a, b = (
                loaded.get(files.get((FileKind.MODEL, v.rank), "")),
                loaded.get(files.get((FileKind.MODEL, twin), "")),
            )
            if a is None or b is None or not a.loaded or not b.loaded:
                continue
            eq[(twin, key)] = _equal(a.value.get(key), b.value.get(key))
        out.append(replace(v, equal_to=eq) if eq else v)
    return out


def _equal(a: Any, b: Any) -> bool:
    import torch

    la, lb = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
    return (
        isinstance(la, torch.Tensor)
        and isinstance(lb, torch.Tensor)
        and la.shape == lb.shape
        and bool(torch.equal(la, lb))
    )


def tensor_view(v: Any, info: Any, crcs: Mapping[str, int]) -> TensorView:
    """The plain view of one loaded tensor or DTensor (storage key and CRC from the restricted read), with its
    values counted (values.tensor_stats: the one pass over the mapped bytes)."""
    local = getattr(v, "_local_tensor", None)
    storage = info.storage_key if info is not None else None
    stats = values.tensor_stats(v if local is None else local)
    common: dict[str, Any] = dict(
        dtype=str(v.dtype).removeprefix("torch."),
        device=info.device if info is not None else "cpu",
        storage=storage,
        storage_offset=info.storage_offset if info is not None else 0,
        crc=crcs.get(storage) if storage is not None else None,
        nonfinite=stats.nonfinite,
        nan=stats.nan,
        zero=stats.zero,
    )
    if local is None:
        return TensorView(local_shape=tuple(v.shape), **common)
    mesh = v.device_mesh
    ranks = tuple(int(x) for x in mesh.mesh.flatten().tolist())
    return TensorView(
        local_shape=tuple(local.shape),
        is_dtensor=True,
        global_shape=tuple(v.shape),
        placements=tuple(_placement(p) for p in v.placements),
        mesh_shape=tuple(mesh.mesh.shape),
        mesh_ranks=ranks,
        mesh_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        writer_rank=_writer_rank(mesh),
        **common,
    )


def _writer_rank(mesh: Any) -> int | None:
    """The global rank that pickled this DeviceMesh: its coordinate on the mesh (`_coordinate_on_dim`), else its
    `_rank`. Private fields of the pickled state: anything missing or unexpected is "not recorded" (None)."""
    state = getattr(mesh, "__dict__", {})
    try:
        coord = state.get("_coordinate_on_dim")
        if coord is not None:
            return int(mesh.mesh[tuple(int(c) for c in coord)].item())
        rank = state.get("_rank")
        return int(rank) if isinstance(rank, int) else None
    except (IndexError, TypeError, ValueError, RuntimeError):
        return None


def _placement(p: Any) -> str:
    if p.is_shard():
        return f"Shard({p.dim})"
    if p.is_replicate():
        return "Replicate()"
    return type(p).__name__ + "()"


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def _scalar(v: Any) -> Any:
    try:
        return float(v.item()) if hasattr(v, "item") else float(v)
    except (TypeError, ValueError, RuntimeError):
        return None


def _plain(v: Any) -> Any:
    """Tensors inside param_groups / scheduler state as numbers, so ranks compare by value."""
    if _is_tensor(v):
        return v.tolist() if v.numel() <= 16 else ("tensor", tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _json(path: str) -> Any:
    try:
        return bounded_json.load_file(path)
    except (OSError, ValueError):
        return None


def _json_bool(path: str, key: str) -> bool | None:
    doc = _json(path)
    v = doc.get(key) if isinstance(doc, dict) else None
    return v if isinstance(v, bool) else None


def _same_storage(path_a: str, key_a: str, path_b: str, key_b: str) -> bool:
    """Byte comparison of two storages' zip entries (values.check_unchanged asks only where the CRC-32s agree)."""
    import zipfile

    try:
        with zipfile.ZipFile(path_a) as za, zipfile.ZipFile(path_b) as zb:
            ea, eb = _storage_entry(za, key_a), _storage_entry(zb, key_b)
            if ea is None or eb is None or ea.file_size != eb.file_size:
                return False
            with za.open(ea) as fa, zb.open(eb) as fb:
                while True:
                    x, y = fa.read(1 << 20), fb.read(1 << 20)
                    if x != y:
                        return False
                    if not x:
                        return True
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


def _storage_entry(z: Any, key: str) -> Any:
    name = next((n for n in z.namelist() if n.endswith(f"/data/{key}")), None)
    return z.getinfo(name) if name is not None else None
