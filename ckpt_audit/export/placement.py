"""Putting a finished export at `--to`: the work directory beside it, one fsync per file, the marker, and one rename
(an atomic exchange where it replaces an earlier export), so `--to` is at every moment absent, the earlier export, or
the complete new one. A killed export's work directories are reclaimed by the next export to the same place."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from ckpt_audit.durable import fsync_dir
from ckpt_audit.export.guard import MARKER, marker_document
from ckpt_audit.export.result import ExportResult
from ckpt_audit.killpoints import OpCounter

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        _libc = None

LEFTOVER_RE = r"\.{name}\.ckpt-audit-(?:tmp|old)-(\d+)-[0-9a-f]{{8}}"  # a killed export's work dirs beside --to


def work_dir(out: Path) -> Path:
    """A fresh name for the hidden directory the export to `out` is built in (named by this pid: see LEFTOVER_RE)."""
    return out.parent / f".{out.name}.ckpt-audit-tmp-{os.getpid()}-{os.urandom(4).hex()}"


def missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first: what mkdir(parents=True) will create."""
    out = []
    while not os.path.lexists(path) and path.parent != path:
        out.append(path)
        path = path.parent
    return out


def remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this export created for --to, deepest first, as long as they are still empty."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return


def sync_tree(tmp: Path) -> None:
    """One fsync per file written under `tmp` (weights, index, config, tokenizer, adapter) and per subdirectory,
    after the read-back: the data is on disk before the marker says the export is complete (the marker then syncs
    `tmp` itself)."""
    for p in sorted(tmp.rglob("*")):
        if p.is_dir():
            fsync_dir(str(p))
        elif p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def write_marker(tmp: Path, result: ExportResult) -> None:
    """What makes this directory recognisable as an export (and so replaceable by a later --force)."""
    files = [(os.path.relpath(f.path, result.out_dir), f.size_bytes, f.hash) for f in result.files]
    doc = marker_document(
        source=result.source,
        created_ns=time.time_ns(),
        source_check=result.source_check,
        override=result.override,
        model_check=result.model_check,
        verified=result.verified,
        files=files,
    )
    with open(tmp / MARKER, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(doc, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(str(tmp))


def swap_into_place(tmp: Path, out: Path, ops: OpCounter) -> None:
    """Put the finished `tmp` at `out` by one rename; an earlier export there is swapped out atomically where the
    kernel can (renameat2 RENAME_EXCHANGE), so `out` never goes missing, and only then removed."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        ops.tick()  # in place
        fsync_dir(str(out.parent))
        return
    if not _exchange(tmp, out):  # older kernel or filesystem: a moment with nothing at `out`, never a half export
        old = out.parent / tmp.name.replace(".ckpt-audit-tmp-", ".ckpt-audit-old-")
        os.rename(out, old)
        os.rename(tmp, out)
        tmp = old
    ops.tick()  # in place; the earlier export now sits at `tmp`
    fsync_dir(str(out.parent))
    remove_work_dir(tmp)
    ops.tick()  # the earlier export removed


def _exchange(a: Path, b: Path) -> bool:
    fn = getattr(_libc, "renameat2", None) if _libc is not None else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_work_dir(path: Path) -> None:
    """Remove a work directory of ours; a link is unlinked, never followed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def reclaim_leftovers(out: Path) -> None:
    """Remove the work dirs a killed export to the same `out` left beside it (named by its pid, now dead)."""
    pattern = re.compile(LEFTOVER_RE.format(name=re.escape(out.name)))
    try:
        names = os.listdir(out.parent)
    except OSError:
        return
    for name in names:
        if (m := pattern.fullmatch(name)) and not _alive(int(m[1])):
            remove_work_dir(out.parent / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True
