"""Completeness of one FSDP shard set (docs/verl-format.md §7.3) and of a step directory (§7.2)."""

from __future__ import annotations

from collections.abc import Mapping

from ckpt_audit.codes import finding
from ckpt_audit.models import Checkpoint, Component, FileKind, Finding, ShardFile
from ckpt_audit.readers import bounded_json

SHARD_KINDS = (FileKind.MODEL, FileKind.OPTIM, FileKind.EXTRA_STATE)
_PREFIX = {FileKind.MODEL: "model", FileKind.OPTIM: "optim", FileKind.EXTRA_STATE: "extra_state"}


def shard_name(kind: FileKind, rank: int, world_size: int | None) -> str:
    ws = f"world_size_{world_size}_" if world_size is not None else ""
    return f"{_PREFIX[kind]}_{ws}rank_{rank}.pt"


def current_world_size(newest_mtime_ns: Mapping[int | None, int], config_ws: int | None) -> int | None:
    """Which shard set of a role directory is the checkpoint, given each set's world size (None: named without
    one) and its newest file's mtime: the one fsdp_config.json names, else the only one, else the most recently
    written (a resume at another world size writes beside the old set). The one policy: the scan judges this set
    and export reads it."""
    if config_ws is not None and config_ws in newest_mtime_ns:
        return config_ws
    if len(newest_mtime_ns) == 1:
        return next(iter(newest_mtime_ns))
    return max(newest_mtime_ns, key=lambda w: newest_mtime_ns[w]) if newest_mtime_ns else None


def parse_fsdp_config(path: str, text: str | None) -> tuple[int | None, tuple[Finding, ...]]:
    """world_size from fsdp_config.json's text (None when absent or unusable, with a finding when unusable)."""
    if text is None:
        return None, ()
    try:
        doc = bounded_json.loads(text, max_bytes=bounded_json.MAX_FILE)
    except ValueError as exc:
        return None, (finding("fsdp-config-invalid", path, f"not JSON: {exc}"),)
    ws = doc.get("world_size") if isinstance(doc, dict) else None
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        return None, (finding("fsdp-config-invalid", path, f"no positive integer world_size in {text[:80]!r}"),)
    return ws, ()


def check_fsdp_shards(comp: Component, *, config_text: str | None) -> tuple[int | None, tuple[Finding, ...]]:
    """(world size, findings) of a role directory's model/optim/extra_state shard files."""
    config_path = f"{comp.path}/fsdp_config.json"
    # one pass over the files (this runs for every role directory of every checkpoint on each re-scan)
    has_config = False
    shards: list[ShardFile] = []
    newest: dict[int | None, int] = {}  # world size in the names -> that set's newest mtime
    for f in comp.files:
        if f.kind is FileKind.FSDP_CONFIG:
            has_config = True
        elif f.kind in SHARD_KINDS and f.rank is not None:
            shards.append(f)
            if f.world_size not in newest or f.mtime_ns > newest[f.world_size]:
                newest[f.world_size] = f.mtime_ns
    config_ws, found_cfg = parse_fsdp_config(config_path, config_text if has_config else None)
    found: list[Finding] = list(found_cfg)
    where = comp.path
    if not shards:
        found.append(finding("empty-role", where, "no model/optim/extra_state shard files"))
        return config_ws, tuple(found)

    named = newest.keys()
    current = current_world_size(newest, config_ws)

    if config_ws is not None and current is not None and config_ws != current:
        found.append(
            finding(
                "world-size-mismatch",
                config_path,
                f"fsdp_config.json says world_size {config_ws} but the shard files are named for world size {current}",
            )
        )
    for other in sorted(w for w in named if w != current and w is not None):
        n = sum(1 for f in shards if f.world_size == other)
        found.append(
            finding(
                "stale-world-size",
                where,
                f"{n} shard file(s) for world size {other} sit beside the world size {current} set",
            )
        )

    # (kind, rank) of the current world size's shards: a shard's name always carries its rank
    cur = [(f.kind, f.rank) for f in shards if f.world_size == current and f.rank is not None]
    ranks_by_kind: dict[FileKind, set[int]] = {}
    for kind, rank in cur:
        ranks_by_kind.setdefault(kind, set()).add(rank)
    if current is not None:
        expected = current
    elif config_ws is not None:
        expected = config_ws
    else:  # v0.2-era names and no config: the highest rank seen is the only hint
        expected = max(rank for _, rank in cur) + 1
    for kind in SHARD_KINDS:
        ranks = ranks_by_kind.get(kind)
        if not ranks:
            continue
        for r in sorted(set(range(expected)) - ranks):
            found.append(
                finding(
                    "missing-rank",
                    f"{where}/{shard_name(kind, r, current)}",
                    f"{_PREFIX[kind]} shard of rank {r} of {expected} is missing",
                    rank=r,
                )
            )
    if FileKind.MODEL not in ranks_by_kind:
        found.append(finding("missing-model", where, f"no model shards for world size {expected}"))
    else:
        if FileKind.OPTIM not in ranks_by_kind:
            found.append(finding("missing-optimizer", where, f"no optim shards for world size {expected}"))
        if FileKind.EXTRA_STATE not in ranks_by_kind:
            found.append(finding("missing-extra-state", where, f"no extra_state shards for world size {expected}"))
    if not has_config and current is not None:
        found.append(
            finding("missing-fsdp-config", config_path, "no fsdp_config.json (checkpoint predates verl v0.4.1?)")
        )
    return expected, tuple(found)


def check_meshes(
    comp: Component, world_size: int | None, mesh_sizes: dict[str, tuple[int, ...]]
) -> tuple[Finding, ...]:
    """DTensor shards record their DeviceMesh: its rank count must be the W in the file name (HSDP: F x R = W)."""
    if world_size is None:
        return ()
    out = []
    for f in comp.files:
        if f.kind not in SHARD_KINDS or f.world_size not in (world_size, None):
            continue
        wrong = [m for m in mesh_sizes.get(f.path, ()) if m != world_size]
        if wrong:
            out.append(
                finding(
                    "mesh-size-mismatch",
                    f.path,
                    f"DTensors on a {wrong[0]}-rank DeviceMesh in a world size {world_size} shard",
                    rank=f.rank,
                )
            )
    return tuple(out)


def has_model(comp: Component) -> bool:
    return any(f.kind is FileKind.MODEL for f in comp.files)


def check_step(ckpt: Checkpoint, *, sft: bool) -> tuple[Finding, ...]:
    """A step with model shards needs its dataloader state (data.pt; data_{dp}.pt for engine SFT)."""
    if not any(has_model(c) for c in ckpt.components):
        return ()
    if any(f.kind is FileKind.DATA for f in ckpt.files):
        return ()
    return (
        finding(
            "missing-dataloader-state",
            f"{ckpt.path}/data.pt",
            "no data.pt: the save died before the dataloader state, or a resume will repeat the epoch's data",
        ),
    )
