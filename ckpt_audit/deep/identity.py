"""Per-rank shard identity from the content: does rank r's file hold rank r's pieces?

verl's load opens `model_world_size_W_rank_{r}.pt` on rank r by name and copies each local tensor into rank r's
DTensor parameter; nothing checks whose piece it was. A shard saved by another rank (copied or renamed, archive
folder and all) therefore resumes silently wrong: rank r trains on that rank's slice of every parameter. The
content says who wrote it: each DTensor pickles its DeviceMesh, whose state includes the saving rank's coordinate
(`_coordinate_on_dim`) and, in recent torch (2.13 here), its global `_rank`. Where the mesh records neither, two
ranks whose sharded pieces are bit-identical (zip CRC-32 of every non-empty piece that should differ) are the same
file twice.

Only a difference on a Shard mesh dimension is a wrong piece: HSDP replicas (Replicate over `ddp`) hold the same
bytes by design, so rank r+F loading rank r's file resumes right. Pure over `views.TensorView`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckpt_audit.codes import finding
from ckpt_audit.deep.views import ComponentView, RankView, TensorView, mesh_coords
from ckpt_audit.models import Finding


def other_piece(t: TensorView, a: int, b: int) -> bool:
    """Ranks a and b hold different pieces of t: their coordinates differ on a mesh dim t is sharded over."""
    ca, cb = mesh_coords(t, a), mesh_coords(t, b)
    if ca is None or cb is None:
        return False
    return any(p.startswith("Shard") and x != y for p, x, y in zip(t.placements, ca, cb))


def _tensors(r: RankView) -> Iterable[tuple[str, str, TensorView]]:
    for k, t in (r.model or {}).items():
        yield r.model_path or "", k, t
    for idx, st in (r.optim_state or {}).items():
        for n, t in st.items():
            if isinstance(t, TensorView):
                yield r.optim_path or "", f"state.{idx}.{n}", t


def check_identity(c: ComponentView) -> list[Finding]:
    out: list[Finding] = []
    for r in c.ranks:
        by_path: dict[str, list[tuple[str, TensorView]]] = {}
        for path, key, t in _tensors(r):
            if t.is_dtensor and t.writer_rank is not None and other_piece(t, t.writer_rank, r.rank):
                by_path.setdefault(path, []).append((key, t))
        for path, wrong in by_path.items():
            key, t = wrong[0]
            writers = sorted({t.writer_rank for _, t in wrong if t.writer_rank is not None})
            out.append(
                finding(
                    "shard-rank-mismatch",
                    path,
                    f"{len(wrong)} DTensor piece(s) were saved by rank {', '.join(map(str, writers))} (their "
                    f"DeviceMesh coordinate), not by rank {r.rank} whose file this is (first: {key}): verl loads "
                    "another rank's slice of every parameter here",
                    rank=r.rank,
                    tensor=key,
                )
            )
    return out + _duplicates([r for r in c.ranks if r.model is not None])


def _duplicates(ranks: Sequence[RankView]) -> list[Finding]:
    """Fallback for meshes that do not record the saving rank: two ranks' model shards with the same bytes in every
    piece that should differ between them."""
    out = []
    for i, a in enumerate(ranks):
        for b in ranks[i + 1 :]:
            pieces = [
                (k, t, (b.model or {}).get(k))
                for k, t in (a.model or {}).items()
                if t.is_dtensor and t.writer_rank is None and 0 not in t.local_shape and other_piece(t, a.rank, b.rank)
            ]
            if pieces and all(u is not None and t.crc and t.crc == u.crc for _, t, u in pieces):
                out.append(
                    finding(
                        "shard-rank-mismatch",
                        b.model_path or "",
                        f"all {len(pieces)} sharded piece(s) are byte-identical (CRC-32) to rank {a.rank}'s although "
                        f"the two ranks hold different slices: one of the files is the other's copy",
                        rank=b.rank,
                        tensor=pieces[0][0],
                    )
                )
    return out
