"""The read: everything one file tells without judging its neighbours (hash, CRC, structure, text), and the stat
cache's test of whether a catalogued row still stands for a file. No torch: the cron path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TypeGuard

from ckpt_audit.codes import finding
from ckpt_audit.layouts import text_files
from ckpt_audit.models import DcpFacts, FileKind, Finding, ShardFile
from ckpt_audit.readers import hashing, safetensors_header
from ckpt_audit.readers.pool import map_unordered
from ckpt_audit.rules import files as file_rules
from ckpt_audit.tree import FileFacts, PtFacts

Progress = Callable[[int, int], None]  # (bytes done, bytes total), called on the scanning thread
# How the files a scan must read get read: (paths, walk stats, previous facts, kinds, workers=, now_ns=) ->
# (path, FileFacts) as each completes. Default read_all (this process's thread pool); the shared Ray placement
# (cluster/shared.py) spreads the same read_file calls over nodes, so everything else in the scan is unchanged.
Reader = Callable[..., Iterable[tuple[str, FileFacts]]]


def reading(reader: Reader, stats, previous, kinds, *, workers: int, now_ns: int, progress: Progress | None):
    """`reader` over a list of paths, batch after batch, with the byte progress carried across the batches."""
    done = 0

    def read(paths: list[str], *, total: int) -> Iterator[tuple[str, FileFacts]]:
        nonlocal done
        for p, fact in reader(sorted(paths), stats, previous, kinds, workers=workers, now_ns=now_ns):
            done += stats[p].st_size
            if progress is not None:
                progress(done, total)
            yield p, fact

    return read


def vouched(prev: FileFacts | ShardFile | None, st: os.stat_result, kind: FileKind) -> TypeGuard[FileFacts]:
    """The catalog vouches for this file: same stat, its content was read cleanly once (a row written before
    verified_ns existed lacks the structure facts the rules read), and it was recorded under today's rules."""
    return (
        isinstance(prev, FileFacts)
        and _same_stat(prev, st)
        and prev.hash is not None
        and prev.verified_ns is not None
        and file_rules.judged_as(kind, prev.findings)
        and _has_dcp_facts(kind, prev)
        and (bool(prev.checksums) or not hashing.store_checksums_enabled())  # scan --store-checksums fills them in
    )


def _same_stat(prev: FileFacts | ShardFile, st: os.stat_result) -> bool:
    return prev.size_bytes == st.st_size and prev.mtime_ns == st.st_mtime_ns and prev.inode == st.st_ino


def _wants_text(path: str) -> bool:
    return path[path.rfind("/") + 1 :] in text_files()  # os.path.basename without its fspath checks: once per file


def _read_text(path: str, st: os.stat_result) -> str | None:
    """The text the rules read of a file the layouts name (layouts.text_files): None when it is longer than they
    read and not read as a prefix, or unreadable."""
    how = text_files()[os.path.basename(path)]
    if st.st_size > how.limit and not how.prefix:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(how.limit).decode("utf-8", errors="replace")
    except OSError:
        return None


def stat_facts(path: str, st: os.stat_result) -> FileFacts:
    """A walked file as the layouts see it before its content is read: its stat, and the text their rules read
    (export builds the scan's component from these: export.sources)."""
    text = _read_text(path, st) if _wants_text(path) else None
    return FileFacts(path=path, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino, text=text)


def reused(path: str, prev: FileFacts, st: os.stat_result) -> FileFacts:
    """The catalog's row of `path` with what the catalog does not keep read again: a small JSON file's text, and a
    .safetensors file's header (_header_again)."""
    if _wants_text(path):
        return replace(prev, reused=True, text=_read_text(path, st))
    if path.endswith(".safetensors") and prev.size_bytes > 0:
        return replace(_header_again(prev), reused=True)
    return prev


def _header_again(prev: FileFacts) -> FileFacts:
    """`prev` with its safetensors header read and checked now (one small read): its tensor names (the index is
    checked against them; the catalog does not keep them), and the header judged by today's rules, not by the ones
    in force when the row was recorded."""
    found, names = _safetensors(prev.path)
    kept = tuple(f for f in prev.findings if not f.code.startswith("safetensors-"))
    return replace(prev, tensors=names, findings=kept + found)


def read_all(
    paths: Sequence[str],
    stats: Mapping[str, os.stat_result],
    previous: Mapping,
    kinds: Mapping[str, FileKind],
    *,
    workers: int,
    now_ns: int,
    reparse: bool = True,
) -> Iterator[tuple[str, FileFacts]]:
    """read_file over the file thread pool (hashing and CRC release the GIL), as each file completes."""
    return map_unordered(
        lambda p: read_file(p, stats[p], previous.get(p), kind=kinds[p], now_ns=now_ns, reparse=reparse),
        paths,
        workers=workers,
        name="ckpt-scan",
    )


def read_file(
    path: str,
    st: os.stat_result,
    prev: FileFacts | ShardFile | None,
    *,
    kind: FileKind,
    now_ns: int | None = None,
    reparse: bool = True,
) -> FileFacts:
    """Everything one file tells without judging its neighbours. Never raises for a bad file.

    `kind` is what the layouts call the file by its name (layouts.file_kind); the file rules depend on it.

    A clean read (the stat held still) is stamped verified at `now_ns` (default: now); content that differs from
    `prev` under the same stat is hash-drift, and stays so while the stat and the drifted content stay.

    `reparse` False: when the bytes read back as `prev` recorded them (same stat, same xxh3-128, same CRC verdict),
    everything else `prev` holds was derived from these very bytes, so the pickle, DCP metadata and safetensors
    header are not parsed again (the scrub's re-reads; `--rehash` re-parses, for a newer reader).
    """
    base = FileFacts(path=path, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)
    try:
        d = hashing.digest_file(path)
    except FileNotFoundError:
        return replace(base, findings=(finding("file-vanished", path, "listed, then gone before it was read"),))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return replace(base, findings=(finding("unreadable", path, f"cannot read: {reason}"),))
    changed = d.changed_during_read or d.stat_size != st.st_size or d.mtime_ns != st.st_mtime_ns
    if not reparse and not changed and _same_bytes(prev, st, d, kind):
        return replace(
            _header_again(prev) if path.endswith(".safetensors") and prev.size_bytes > 0 else prev,
            reused=False,
            text=_read_text(path, st) if _wants_text(path) else None,
            verified_ns=(now_ns if now_ns is not None else time.time_ns()),
            checksums=d.checksums or prev.checksums,
        )
    found = list(
        file_rules.digest_findings(
            path,
            kind=kind,
            size=d.size_bytes,
            zip_error=d.zip_error,
            crc_bad=d.crc_bad_entries,
            prefix=d.prefix,
            changed=changed,
            local_mismatch=d.local_header_mismatch,
        )
    )
    found.extend(_drift(path, st, prev, d.hash) if not changed else ())
    pt = None
    if file_rules.reads_structure(path, kind=d.kind, is_zip=d.is_zip, zip_error=d.zip_error):
        pt, more = _structure(path)
        found.extend(more)
    if d.item_pickles:  # a .distcp's items: DCP's load unpickles each, bytes items with the full unpickler
        found.extend(_item_pickles(path, d.item_pickles))
    dcp, more = _dcp_facts(path) if kind is FileKind.DCP_METADATA else (None, ())
    found.extend(more)
    tensors = None
    if path.endswith(".safetensors") and d.size_bytes > 0 and not changed:
        more, tensors = _safetensors(path)
        found.extend(more)
    return replace(
        base,
        size_bytes=d.size_bytes,
        mtime_ns=d.mtime_ns,
        inode=d.inode,
        hash=d.hash,
        crc_ok=d.crc_ok,
        pt=pt,
        text=_read_text(path, st) if _wants_text(path) else None,
        dcp=dcp,
        tensors=tensors,
        findings=tuple(found),
        verified_ns=None if changed else (now_ns if now_ns is not None else time.time_ns()),
        # the same xxh3-128 is the same bytes: their store checksums stand (--rehash without --store-checksums)
        checksums=d.checksums or (prev.checksums if _same_hash(prev, d) and not changed else ()),
    )


def _same_hash(prev: FileFacts | ShardFile | None, d: hashing.FileDigest) -> TypeGuard[FileFacts]:
    return isinstance(prev, FileFacts) and (prev.hash, prev.size_bytes) == (d.hash, d.size_bytes)


def _same_bytes(
    prev: FileFacts | ShardFile | None, st: os.stat_result, d: hashing.FileDigest, kind: FileKind
) -> TypeGuard[FileFacts]:
    """`prev` is a row the catalog vouches for (vouched) and these are exactly the bytes it was read from."""
    return (
        vouched(prev, st, kind)
        and (prev.hash, prev.crc_ok, prev.size_bytes) == (d.hash, d.crc_ok, d.size_bytes)
        and not d.crc_bad_entries
        and d.zip_error is None
    )


def _drift(path: str, st: os.stat_result, prev: FileFacts | ShardFile | None, new_hash: str) -> tuple[Finding, ...]:
    """hash-drift when the content moved under an unchanged stat; a drift found before is kept while the file
    still holds the drifted content (re-reading rotten bytes must not make them good)."""
    if prev is None or prev.hash is None or not _same_stat(prev, st):
        return ()
    if prev.hash != new_hash:
        return (
            finding(
                "hash-drift",
                path,
                f"content hash changed ({prev.hash[:12]}… -> {new_hash[:12]}…) while size, mtime and inode did not",
            ),
        )
    return tuple(f for f in getattr(prev, "findings", ()) if f.code == "hash-drift")


def _safetensors(path: str) -> tuple[tuple[Finding, ...], tuple[str, ...] | None]:
    """(findings, tensor names: None unless the header is one safetensors loads) of a .safetensors file."""
    try:
        header = safetensors_header.read(path)
    except OSError as exc:
        return (finding("unreadable", path, f"cannot read the safetensors header: {exc.strerror or exc}"),), None
    found = tuple(finding(p.code, path, p.message, tensor=p.tensor) for p in header.problems)
    return found, None if header.problems else header.names


def _structure(path: str) -> tuple[PtFacts | None, tuple[Finding, ...]]:
    # imported on the first pickle read, not at start-up: the first file is opened (and hashed) without it
    from ckpt_audit.readers import deepspeed_meta, megatron_meta, pt

    try:
        s = pt.read_pt_structure(path)
    except OSError as exc:
        return None, (finding("unreadable", path, f"cannot read data.pkl: {exc.strerror or exc}"),)
    except Exception as exc:  # noqa: BLE001 - a reader bug on odd input must become a finding, not a crash
        return None, (finding("bad-pickle", path, f"{type(exc).__name__}: {exc}"),)
    meshes = sorted({len(t.mesh_ranks or ()) or _prod(t.mesh_shape) for t in s.tensors if t.is_dtensor} - {0})
    facts = PtFacts(
        prefix=s.prefix,
        n_tensors=len(s.tensors),
        n_dtensors=sum(1 for t in s.tensors if t.is_dtensor),
        mesh_sizes=tuple(meshes),
        top_keys=s.keys,
        meta=deepspeed_meta.read_meta(s.tree) or megatron_meta.read_meta(s.tree),
    )
    return facts, file_rules.structure_findings(path, problems=s.problems, unsafe_globals=s.unsafe_globals)


def _item_pickles(path: str, pickles: tuple[tuple[str, bytes | None], ...]) -> tuple[Finding, ...]:
    from ckpt_audit.readers import distcp_items  # on the first .distcp: it loads the unpickler, off start-up

    try:
        s = distcp_items.read_item_pickles(pickles)
    except Exception as exc:  # noqa: BLE001 - a reader bug on odd input must become a finding, not a crash
        return (finding("distcp-item-invalid", path, f"{type(exc).__name__}: {exc}"),)
    return file_rules.structure_findings(path, problems=s.problems, unsafe_globals=s.unsafe_globals)


def _has_dcp_facts(kind: FileKind, prev: FileFacts) -> bool:
    """A DCP .metadata is reused only with its parsed facts (a row from before m006 has none: it is read again)."""
    if kind is not FileKind.DCP_METADATA or prev.dcp is not None:
        return True
    return any(f.code == "dcp-metadata-invalid" for f in prev.findings)  # unparseable: nothing to re-learn


def _dcp_facts(path: str) -> tuple[DcpFacts | None, tuple[Finding, ...]]:
    """A DCP `.metadata`'s byte ranges and keys: the scan checks its data files against them (layouts.dcp)."""
    from ckpt_audit.readers import dcp_metadata  # on the first .metadata: it loads the unpickler, off start-up

    try:
        return dcp_metadata.read_facts(path), ()
    except OSError as exc:
        return None, (finding("unreadable", path, f"cannot read .metadata: {exc.strerror or exc}"),)
    except Exception as exc:  # noqa: BLE001 - a reader bug on odd input must become a finding, not a crash
        return None, (finding("dcp-metadata-invalid", path, f".metadata {exc}"),)


def _prod(shape: tuple[int, ...] | None) -> int:
    n = 1
    for x in shape or (0,):
        n *= x
    return n
