"""verify(): scan, then deep checks that need the files' contents: cross-rank consistency, DCP byte ranges.

`verify(paths)` = `scan.scan(...)` + `deepen(result)`. `deepen` loads every rank's shards through `safe_load`
(weights_only, mmap: per-file cost, no tensor bytes read except the few scalars the checks compare), boils them
down to the plain views of `deep.rules`, and attaches the findings to the component or checkpoint they concern;
statuses are re-derived. This is the one place that knows both the scan and the deep checks (the scanner never calls
back up here); torch is imported only below this module.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_audit.codes import CODES, NAMED_BY_VERIFY, UNREAD_CODES, finding
from ckpt_audit.deep import (
    dataloader,
    dcp_check,
    deepspeed_check,
    hf_check,
    identity,
    megatron_check,
    safe_load,
    structure,
    values,
)
from ckpt_audit.deep import rules as deep
from ckpt_audit.layouts import verl_fsdp
from ckpt_audit.models import (
    IN_PROGRESS_WINDOW_S,
    Checkpoint,
    Component,
    FileKind,
    Finding,
    ScanResult,
    Severity,
    Status,
)
from ckpt_audit.readers import bounded_json
from ckpt_audit.readers.pool import map_unordered
from ckpt_audit.rules import status as status_rules
from ckpt_audit.scan import scan
from ckpt_audit.scan.scrub import ScrubPolicy

Progress = Callable[[int, int], None]


def verify(
    paths: Sequence[str | Path],
    *,
    workers: int = 2,
    rehash: bool = False,
    progress: Progress | None = None,
    previous: Mapping | None = None,
    in_progress_window_s: float = IN_PROGRESS_WINDOW_S,
    scrub: ScrubPolicy | None = None,
) -> ScanResult:
    """Scan `paths` (step directories, runs or roots) and add the deep findings. Raises scan.ScanError."""
    result = scan(
        paths,
        workers=workers,
        rehash=rehash,
        previous=previous,
        progress=None,
        in_progress_window_s=in_progress_window_s,
        scrub=scrub,
    )
    result = deepen(result, workers=workers, progress=progress)
    return replace(result, deep=True, finished_ns=time.time_ns())


# -- deepen ---------------------------------------------------------------------------------------------------


def deepen(result: ScanResult, *, workers: int = 2, progress: Progress | None = None) -> ScanResult:
    """The result with deep findings attached and statuses re-derived."""
    # each run's checkpoints in step order, so a checkpoint's predecessor is done about when it is (values compare
    # the two) and only the views of the last few are held at a time
    jobs = [
        (ri, ci)
        for ri, run in enumerate(result.runs)
        for ci in sorted(range(len(run.checkpoints)), key=lambda i: run.checkpoints[i].step)
    ]
    total = len(jobs)
    done = 0
    runs = [list(r.checkpoints) for r in result.runs]
    ready: dict[tuple[int, int], dict[str, deep.ComponentView]] = {}
    order: dict[int, deque[tuple[int, int]]] = {ri: deque() for ri in range(len(runs))}
    for j in jobs:
        order[j[0]].append(j)
    last: dict[int, dict[str, tuple[str, deep.ComponentView]]] = {ri: {} for ri in range(len(runs))}
    for (ri, ci), (ckpt, views) in map_unordered(
        lambda j: _deepen(result.runs[j[0]].checkpoints[j[1]]), jobs, workers=workers, name="ckpt-verify"
    ):
        runs[ri][ci] = ckpt
        ready[(ri, ci)] = views
        while order[ri] and order[ri][0] in ready:  # the next checkpoint in step order is done: compare it
            _, cj = order[ri].popleft()
            runs[ri][cj] = _against_previous(runs[ri][cj], ready.pop((ri, cj)), last[ri])
        done += 1
        if progress is not None:
            progress(done, total)
    found = {  # a verdict on files being written describes nothing to keep
        ckpt.path: deep_only(ckpt, before=result.runs[ri].checkpoints[ci])
        for ri, ci in jobs
        if (ckpt := runs[ri][ci]).status is not Status.IN_PROGRESS
    }
    return replace(
        result,
        runs=tuple(replace(r, checkpoints=tuple(runs[i])) for i, r in enumerate(result.runs)),
        deep=True,
        deep_found=found,
    )


def deep_only(ckpt: Checkpoint, *, before: Checkpoint) -> tuple[Finding, ...]:
    """What the deep checks found beyond the scan: the verdict later scans keep (rules.deep_verdict). A file the
    deep checks could not read is no verdict on its bytes: the next scan reads it for itself."""
    had = set(before.all_findings)
    return tuple(f for f in ckpt.all_findings if f not in had and f.code not in UNREAD_CODES)


def _against_previous(
    ckpt: Checkpoint, views: Mapping[str, deep.ComponentView], last: dict[str, tuple[str, deep.ComponentView]]
) -> Checkpoint:
    """Findings of values.check_unchanged against the previous checkpoint's views of the same role (`last`, updated)."""
    comps = []
    for comp in ckpt.components:
        cv = views.get(comp.role)
        if cv is None:
            comps.append(comp)
            continue
        found: list[Finding] = []
        if comp.role in last:
            name, prev = last[comp.role]
            found = values.check_unchanged(prev, cv, _same_storage, name)
        last[comp.role] = (Path(ckpt.path).name, cv)
        comps.append(replace(comp, findings=comp.findings + _new(comp.findings, found)))
    out = replace(ckpt, components=tuple(comps))
    return rejudge(out, before=ckpt) if out != ckpt else ckpt


def _deepen(ckpt: Checkpoint) -> tuple[Checkpoint, dict[str, deep.ComponentView]]:
    """The checkpoint with its deep findings, and the views of its verl FSDP components by role."""
    if ckpt.status is Status.HUSK and not ckpt.components:
        return ckpt, {}
    bad = _bad_paths(ckpt)
    comps = []
    views: dict[str, deep.ComponentView] = {}
    for comp in ckpt.components:
        if comp.layout == "verl-fsdp":
            fsdp, cv = _fsdp(ckpt, comp, bad)
            found = list(fsdp)
            if cv is not None:
                views[comp.role] = cv
        else:
            found = list(_component_findings(ckpt, comp, bad))
        comps.append(replace(comp, findings=comp.findings + _new(comp.findings, found)))
    # .safetensors headers are not read again here: verify's own scan judges afresh and checked each one just now
    step_found: list[Finding] = []
    for f in ckpt.files:
        if f.kind is FileKind.DATA and f.path not in bad:
            step_found.extend(_dataloader(f.path))
    out = replace(ckpt, components=tuple(comps), findings=ckpt.findings + _new(ckpt.findings, step_found))
    return rejudge(out, before=ckpt), views


def _new(existing: Sequence[Finding], found: Sequence[Finding]) -> tuple[Finding, ...]:
    """Deep findings the scan has not already made (the scanner flags unsafe pickles and mesh sizes too)."""
    have = {(f.code, f.path) for f in existing}
    meshes = {f.path for f in existing if f.code == "mesh-size-mismatch"}
    out, seen = [], set()
    for f in found:
        key = (f.code, f.path, f.rank, f.tensor, f.message)
        named = f.code in NAMED_BY_VERIFY and f.tensor is not None
        if (
            ((f.code, f.path) in have and not named)
            or key in seen
            or (f.code == "mesh-config-mismatch" and f.path in meshes)
        ):
            continue
        seen.add(key)
        out.append(f)
    return tuple(out)


def _bad_paths(ckpt: Checkpoint) -> set[str]:
    """Files the scan already found broken beyond loading: not opened again."""
    return {f.path for f in ckpt.all_findings if f.code in CODES and CODES[f.code].corrupts}


def rejudge(ckpt: Checkpoint, *, before: Checkpoint) -> Checkpoint:
    """Status after deep findings, in the scan's order (rules.status.PRECEDENCE): a deep error can only make a
    checkpoint worse (complete -> incomplete, unsafe or corrupt), never better."""
    if ckpt.status is Status.IN_PROGRESS:
        soft = lambda fs: tuple(replace(f, severity=Severity.INFO) if f.severity > Severity.INFO else f for f in fs)  # noqa: E731
        return replace(
            ckpt,
            findings=soft(ckpt.findings),
            components=tuple(replace(c, findings=soft(c.findings)) for c in ckpt.components),
        )
    added = set(ckpt.all_findings) - set(before.all_findings)
    errors = [f for f in added if f.severity is Severity.ERROR]
    if not errors:
        return ckpt
    return replace(ckpt, status=status_rules.worst(ckpt.status, status_rules.from_errors(errors)))


# -- per component --------------------------------------------------------------------------------------------


def _component_findings(ckpt: Checkpoint, comp: Component, bad: set[str]) -> list[Finding]:
    if comp.layout == "verl-megatron":
        return list(_megatron(comp, bad))
    if comp.layout == "verl-megatron-v2":  # each dist_ckpt/ (the directory of a .metadata), as the old one's
        dirs = sorted({f.path.rsplit("/", 1)[0] for f in comp.files if f.kind is FileKind.DCP_METADATA})
        return [f for d in dirs for f in _dist_ckpt(comp, d, bad)[0]]
    if comp.layout == "hf-trainer":  # and DeepSpeed's tags inside a checkpoint-N, as a bare engine tree's
        return [*hf_check.check_component(comp, bad), *deepspeed_check.check_component(comp, bad)]
    if comp.layout == "deepspeed":
        return list(deepspeed_check.check_component(comp, bad))
    if comp.layout in ("dcp", "torchtitan"):
        return [*dcp_check.check_dir(comp.path), *_item_crcs(comp, comp.path, bad)]
    return []


def _dist_ckpt(comp: Component, dist: str, bad: set[str]) -> tuple[list[Finding], dcp_check.DcpMetadata | None]:
    """(findings, its .metadata) of one megatron-core dist_checkpointing directory of `comp`."""
    out = list(dcp_check.check_dir(dist))
    for f in comp.files:
        if f.kind is FileKind.COMMON and f.path == f"{dist}/common.pt" and f.path not in bad:
            out.extend(safe_load.load(f.path).findings)
    out.extend(megatron_check.check_integrity(dist))
    try:
        meta = dcp_check.read_metadata(f"{dist}/.metadata")
    except (OSError, ValueError, TypeError):
        return out, None
    out.extend(_item_crcs(comp, dist, bad, meta))
    return out, meta


def _megatron(comp: Component, bad: set[str]) -> list[Finding]:
    dist = f"{comp.path}/dist_ckpt"
    out, meta = _dist_ckpt(comp, dist, bad)
    if meta is None:
        return out
    has_model = megatron_check.has_model_state(meta)
    hf_weights = any(f.kind is FileKind.HF and f.path.endswith((".safetensors", ".bin")) for f in comp.files)
    if not has_model and not hf_weights:
        out.append(
            finding(
                "megatron-model-missing",
                dist,
                "dist_ckpt holds only optimizer/RNG state and huggingface/ no weights (mbridge saves the model there)",
            )
        )
    return out


def _item_crcs(
    comp: Component, dcp_dir: str, bad: set[str], meta: dcp_check.DcpMetadata | None = None
) -> tuple[Finding, ...]:
    """Every item of every `.distcp` against its CRC-32 (Megatron, plain DCP, torchtitan alike)."""
    if meta is None:
        try:
            meta = dcp_check.read_metadata(f"{dcp_dir}/.metadata")
        except (OSError, ValueError, TypeError):
            return ()  # check_dir reported it
    # the scan names a .distcp whose item CRCs fail; verify reads the items again to name the tensors
    crc_only = {f.path for f in comp.findings if f.code in NAMED_BY_VERIFY}
    return megatron_check.check_item_crcs(dcp_dir, meta, skip=bad - crc_only)


OPTIM_INVALID = "optimizer-state-invalid"
# what verl's load does with each kind of per-rank file (deep/structure.py)
_STRUCTURE = {
    FileKind.MODEL: structure.check_model,
    FileKind.OPTIM: structure.check_optimizer,
    FileKind.EXTRA_STATE: structure.check_extra_state,
}


def _fsdp(ckpt: Checkpoint, comp: Component, bad: set[str]) -> tuple[tuple[Finding, ...], deep.ComponentView | None]:
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
    cv = deep.ComponentView(
        path=comp.path,
        step=ckpt.step,
        world_size=ws,
        config_world_size=verl_fsdp.config_world_size(comp.path),
        tie_word_embeddings=_json_bool(f"{comp.path}/huggingface/config.json", "tie_word_embeddings"),
        ranks=tuple(views),
    )
    return (
        tuple(found) + deep.check_component(cv) + tuple(identity.check_identity(cv)) + tuple(values.check_values(cv)),
        cv,
    )


def _rank_view(
    rank: int, model: str | None, optim: str | None, extra: str | None, loaded: Mapping[str, safe_load.LoadResult]
) -> deep.RankView:
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
    return deep.RankView(**kw)


def _infos(res: safe_load.LoadResult) -> dict:
    return {t.key_path: t for t in (res.structure.tensors if res.structure else ())}


def _replica_equality(
    views: list[deep.RankView], loaded: Mapping[str, safe_load.LoadResult], files: Mapping[tuple[FileKind, int], str]
) -> list[deep.RankView]:
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


def tensor_view(v: Any, info: Any, crcs: Mapping[str, int]) -> deep.TensorView:
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
        return deep.TensorView(local_shape=tuple(v.shape), **common)
    mesh = v.device_mesh
    ranks = tuple(int(x) for x in mesh.mesh.flatten().tolist())
    return deep.TensorView(
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


def _dataloader(path: str) -> tuple[Finding, ...]:
    res = safe_load.load(path)
    if not res.loaded:
        return res.findings
    return dataloader.check_dataloader(path, res.value)


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
