"""Deep check of a torch.distributed.checkpoint directory from its `.metadata` alone, without torch.

`.metadata` is parsed by readers.dcp_metadata (the restricted unpickler: no torch class is resolved). Checks: every
storage entry's file exists and its byte range lies inside it; every tensor's chunks lie inside the tensor, tile it
with no gap or overlap, and each has a storage entry; .distcp files no entry references.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence, Set

from ckpt_audit.codes import NAMED_BY_VERIFY, finding
from ckpt_audit.deep.check import Deep
from ckpt_audit.layouts.dcp import DISTCP_RE, METADATA
from ckpt_audit.models import Checkpoint, Component, Finding
from ckpt_audit.readers import distcp_items
from ckpt_audit.readers.dcp_metadata import Chunk, DcpMetadata, read_metadata  # the one parser

__all__ = ["Chunk", "DcpMetadata", "check", "check_dir", "check_metadata", "check_tiling", "read_metadata"]

MAX_PAIRWISE = 4096  # chunks per tensor compared pairwise when they are not a 1-D split


def check(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> Deep:
    """A component that is one DCP directory (plain DCP, a torchtitan step): `check_dir` and every item's CRC-32."""
    return Deep((*check_dir(comp.path), *item_crcs(comp, comp.path, bad)))


def check_dir(dcp_dir: str) -> tuple[Finding, ...]:
    """All of verify's DCP checks for one directory DCP wrote."""
    meta_path = f"{dcp_dir}/{METADATA}"
    if not os.path.exists(meta_path):
        return ()  # the shallow layout already reported dcp-metadata-missing
    try:
        meta = read_metadata(meta_path)
    except (OSError, ValueError, TypeError) as exc:
        return (finding("dcp-metadata-invalid", meta_path, f".metadata {exc}"),)
    sizes = {}
    for name in os.listdir(dcp_dir):
        try:
            sizes[name] = os.stat(f"{dcp_dir}/{name}").st_size
        except OSError:
            continue
    return check_metadata(dcp_dir, meta, sizes)


def item_crcs(comp: Component, dcp_dir: str, bad: Set[str], meta: DcpMetadata | None = None) -> tuple[Finding, ...]:
    """distcp-crc-mismatch / distcp-item-invalid for each item of each `.distcp` of `dcp_dir` (in `comp`) that its
    `.metadata` references (Megatron, plain DCP, torchtitan alike). Files the scan found broken beyond loading and
    missing files are left to their own findings; a `.distcp` whose item CRCs the scan found failing is read again,
    to name the tensors."""
    if meta is None:
        try:
            meta = read_metadata(f"{dcp_dir}/{METADATA}")
        except (OSError, ValueError, TypeError):
            return ()  # check_dir reported it
    skip = set(bad) - {f.path for f in comp.findings if f.code in NAMED_BY_VERIFY}
    per_file: dict[str, list[tuple[str, int, int]]] = {}
    for (fqn, _off), (rel, start, length) in meta.storage.items():
        per_file.setdefault(rel, []).append((fqn, start, length))
    out = []
    for rel in sorted(per_file):
        path = f"{dcp_dir}/{rel}"
        if path in skip or not os.path.isfile(path):
            continue
        try:
            report = distcp_items.check_items(path, per_file[rel])
        except OSError:
            continue  # unreadable: the scan reported it
        m = DISTCP_RE.fullmatch(os.path.basename(rel))
        for p in report.problems:
            out.append(
                finding(
                    p.problem.code,
                    path,
                    f"{p.key}: {p.problem.message}",
                    rank=int(m.group(1)) if m else None,
                    tensor=p.key,
                )
            )
    return tuple(out)


def check_metadata(dcp_dir: str, meta: DcpMetadata, file_sizes: Mapping[str, int]) -> tuple[Finding, ...]:
    """Pure: `.metadata` against the directory's file sizes (name -> bytes)."""
    out: list[Finding] = []
    missing_reported: set[str] = set()
    for (fqn, _off), (rel, start, length) in sorted(meta.storage.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if rel not in file_sizes:
            if rel not in missing_reported:
                out.append(
                    finding(
                        "dcp-file-missing",
                        f"{dcp_dir}/{rel}",
                        f".metadata stores {fqn} (and maybe more) in {rel}, which does not exist",
                        rank=_rank(rel),
                        tensor=fqn,
                    )
                )
                missing_reported.add(rel)
        elif start < 0 or length < 0 or start + length > file_sizes[rel]:
            out.append(
                finding(
                    "dcp-range-outside-file",
                    f"{dcp_dir}/{rel}",
                    f"{fqn}: bytes [{start}, {start + length}) but the file holds {file_sizes[rel]}",
                    rank=_rank(rel),
                    tensor=fqn,
                )
            )
    for fqn, (size, chunks, _dtype) in sorted(meta.tensors.items()):
        out.extend(check_tiling(dcp_dir, fqn, size, chunks))
        for c in chunks:
            if (fqn, c.offsets) not in meta.storage:
                out.append(
                    finding(
                        "dcp-chunk-unstored",
                        f"{dcp_dir}/{METADATA}",
                        f"{fqn}: chunk at {list(c.offsets)} has no storage entry",
                        tensor=fqn,
                    )
                )
    for fqn in sorted(meta.byte_items):
        if not any(k[0] == fqn for k in meta.storage):
            out.append(
                finding(
                    "dcp-chunk-unstored", f"{dcp_dir}/{METADATA}", f"{fqn}: object has no storage entry", tensor=fqn
                )
            )
    used = {rel for rel, _, _ in meta.storage.values()}
    for name in sorted(file_sizes):
        if DISTCP_RE.fullmatch(name) and name not in used:
            out.append(
                finding(
                    "dcp-unreferenced-file",
                    f"{dcp_dir}/{name}",
                    "no .metadata entry points into this file (a leftover of another save?)",
                    rank=_rank(name),
                )
            )
    return tuple(out)


def _rank(rel: str) -> int | None:
    m = DISTCP_RE.fullmatch(os.path.basename(rel))
    return int(m.group(1)) if m else None


def check_tiling(where: str, fqn: str, size: Sequence[int], chunks: Sequence[Chunk]) -> list[Finding]:
    """Chunks must lie inside the tensor and cover it exactly once."""
    path = f"{where}/{METADATA}"
    total = 1
    for s in size:
        total *= s
    out = []
    vol = 0
    for c in chunks:
        if (
            len(c.offsets) != len(size)
            or len(c.sizes) != len(size)
            or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, size))
        ):
            out.append(
                finding(
                    "dcp-chunk-overlap",
                    path,
                    f"{fqn}: chunk at {list(c.offsets)} of {list(c.sizes)} lies outside the tensor {list(size)}",
                    tensor=fqn,
                )
            )
            return out
        n = 1
        for s in c.sizes:
            n *= s
        vol += n
    overlap = _overlap(chunks, len(size))
    if overlap is not None:
        a, b = overlap
        out.append(
            finding(
                "dcp-chunk-overlap",
                path,
                f"{fqn}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap",
                tensor=fqn,
            )
        )
    elif vol < total:
        out.append(
            finding(
                "dcp-chunk-gap",
                path,
                f"{fqn}: chunks cover {vol} of {total} elements of {list(size)}: part of the tensor is stored nowhere",
                tensor=fqn,
            )
        )
    return out


def _overlap(chunks: Sequence[Chunk], ndim: int) -> tuple[Chunk, Chunk] | None:
    live = [c for c in chunks if all(s > 0 for s in c.sizes)]
    if len(live) < 2:
        return None
    # the usual case: a split along one dim, every other extent equal -> sort and sweep
    for d in range(ndim):
        others = {(c.offsets[:d] + c.offsets[d + 1 :], c.sizes[:d] + c.sizes[d + 1 :]) for c in live}
        if len(others) == 1:
            live.sort(key=lambda c: c.offsets[d])
            for a, b in zip(live, live[1:]):
                if b.offsets[d] < a.offsets[d] + a.sizes[d]:
                    return a, b
            return None
    if len(live) > MAX_PAIRWISE:
        return None
    for i, a in enumerate(live):
        for b in live[i + 1 :]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return a, b
    return None
