"""The walk: list a root without following links out of it, and what the scan leaves out of it (prune's trash).

No judgement here: what is where, with each regular file's stat; what could not be listed becomes a finding.
"""

from __future__ import annotations

import errno
import os
import stat as statmod
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding, format_size
from ckpt_audit.tree import TRASH_PREFIX, Tree, trash_entry


def walk(root: str) -> tuple[Tree, dict[str, os.stat_result], list[Finding]]:
    """List `root` without following links out of it. Regular files only (a FIFO would block a reader)."""
    dirs: dict[str, tuple[str, ...]] = {}
    links: dict[str, str] = {}
    files: dict[str, tuple[str, ...]] = {}
    stats: dict[str, os.stat_result] = {}
    dir_mtimes: dict[str, int] = {}
    found: list[Finding] = []
    seen: set[tuple[int, int]] = set()
    inside = root.rstrip("/") + "/"
    stack = [root]
    while stack:
        d = stack.pop()
        fd = _open_dir(d)
        try:
            try:
                dst = os.stat(d) if fd < 0 else os.fstat(fd)
            except OSError as exc:
                found.append(_os_finding(d, exc))
                continue
            if (dst.st_dev, dst.st_ino) in seen:  # a bind mount or hard-linked directory loop
                found.append(finding("symlink-loop", d, "directory already walked under another path"))
                continue
            seen.add((dst.st_dev, dst.st_ino))
            dir_mtimes[d] = dst.st_mtime_ns
            subdirs: list[str] = []
            names: list[str] = []
            ascii_dir = d.isascii()  # an ASCII path always encodes: the UTF-8 check below is for the rest
            try:
                with os.scandir(d if fd < 0 else fd) as it:
                    entries = list(it)
            except OSError as exc:
                found.append(_os_finding(d, exc))
                dirs[d], files[d] = (), ()
                continue
            prefix = d + "/"
            for e in entries:
                name = e.name
                path = prefix + name
                if not (ascii_dir and name.isascii()):
                    try:
                        path.encode("utf-8")
                    except UnicodeEncodeError:
                        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
                        found.append(finding("non-utf8-name", shown, "name is not valid UTF-8; skipped"))
                        continue
                try:  # regular files first: nearly every entry is one (a link is neither file nor dir unfollowed)
                    if e.is_file(follow_symlinks=False):
                        stats[path] = e.stat(follow_symlinks=False)  # fstatat in `fd`
                        names.append(name)
                    elif e.is_dir(follow_symlinks=False):
                        subdirs.append(name)
                    elif e.is_symlink():
                        links[path] = os.readlink(path)
                        kind = _follow_link(path, d, root, inside, found)
                        if kind is not None:
                            names.append(name)
                            stats[path] = kind
                except FileNotFoundError:
                    found.append(finding("file-vanished", path, "listed, then gone before it could be examined"))
                except OSError as exc:
                    found.append(_os_finding(path, exc))
            subdirs.sort()
            names.sort()
            dirs[d] = tuple(subdirs)
            files[d] = tuple(names)
            stack.extend([prefix + s for s in reversed(subdirs)])
        finally:
            if fd >= 0:
                os.close(fd)
    return Tree(dirs=dirs, files=files, dir_mtime_ns=dir_mtimes, links=links), stats, found


def _open_dir(d: str) -> int:
    """`d` opened for listing, or -1. Its entries are then stat'ed relative to it (fstatat), not by a path the kernel
    resolves again from "/" (1M files: ~0.4 s less system time). One that cannot be opened is stat'ed and listed by
    its path, as before, for the finding that says why."""
    try:
        return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


def _follow_link(path: str, parent: str, root: str, inside: str, found: list[Finding]) -> os.stat_result | None:
    """The target's stat when `path` is a link to a regular file inside the root; else a finding and None.

    Directory links inside the root are not walked: their targets are walked under their real paths anyway.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        found.append(finding("broken-symlink", path, f"points to missing {os.readlink(path)!r}"))
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            found.append(finding("symlink-loop", path, "link resolves to itself (ELOOP)"))
        else:
            found.append(_os_finding(path, exc))
        return None
    target = os.path.realpath(path)
    if target != root and not target.startswith(inside):
        found.append(finding("symlink-outside-root", path, f"points outside the root to {target}; not followed"))
        return None
    if statmod.S_ISDIR(st.st_mode):
        if parent == target or parent.startswith(target.rstrip("/") + "/"):
            found.append(finding("symlink-loop", path, f"points back to its ancestor {target}; not followed"))
        return None
    return st if statmod.S_ISREG(st.st_mode) else None


def _os_finding(path: str, exc: OSError) -> Finding:
    return finding("unreadable", path, f"cannot read: {exc.strerror or type(exc).__name__}")


def files_under(dirs: Iterable[str], paths: Iterable[str]) -> dict[str, list[str]]:
    """dir -> the paths of `paths` inside it, sorted: slices of the very strings given (the walk's `stats` keys, one
    per file; or the tree's directories), sorted once (~0.1 s for 1M), so a lookup in `stats` finds the very key, its
    hash kept, and a million paths are not built and held twice. (Paths built again from the tree and sorted per run
    cost ~0.3 s more at 1M, and their lookups ~0.3 s more.)"""
    every = sorted(paths)
    return {d: every[subtree(every, d)] for d in dirs}


def subtree(paths: Sequence[str], d: str, lo: int = 0) -> slice:
    """Where the paths inside directory `d` are in the sorted `paths` (looking from `lo`): one slice, from "d/" up
    to "d0" ("0" follows "/"), whatever sorts beside it ("d-x/" before "d/")."""
    below = d.rstrip("/") + "/"
    start = bisect_left(paths, below, lo)
    return slice(start, bisect_left(paths, below[:-1] + "0", start))


def without_trash(paths: list[str], stats: Mapping[str, os.stat_result]) -> tuple[list[str], list[Finding]]:
    """The paths outside prune's trash, and one finding per trash entry: an interrupted prune's leftovers are
    being deleted, so hashing them would only spend I/O, but the disk they hold is worth a line in cron's mail."""
    if f"/{TRASH_PREFIX}" not in "\n".join(paths):  # nearly always: one search in C instead of one per path
        return paths, []
    keep: list[str] = []
    trash: dict[str, list[int]] = {}
    for p in paths:
        if (entry := trash_entry(p)) is None:
            keep.append(p)
        else:
            trash.setdefault(entry, []).append(stats[p].st_size)
    found = [
        finding(
            "prune-leftover",
            entry,
            f"marked for deletion by an interrupted prune: {len(sizes)} file(s), "
            f"{format_size(sum(sizes))}; the next `ckpt-audit prune` reclaims it",
        )
        for entry, sizes in trash.items()
    ]
    return keep, found
