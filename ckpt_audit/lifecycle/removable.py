"""Can this tree be removed in full, by us, now? Every refusal the filesystem can give, found before the rename.

Prune renames a checkpoint to trash and then removes it file by file; a refusal found only then leaves a half-deleted
tree. So before the rename the whole tree is checked for what `unlink(2)`, `rmdir(2)` and `rename(2)` refuse, as
the effective user with its capabilities (even root cannot remove an immutable file):

- a directory we cannot list, or cannot write and search (`access(2)` with the effective ids: capabilities count,
  an immutable directory and a read-only mount answer no);
- a read-only mount (`statvfs` ST_RDONLY) and a mount point inside the tree (`rmdir` says EBUSY);
- an immutable or append-only entry (`chattr +i` / `+a`, read with the FS_IOC_GETFLAGS ioctl): neither it nor,
  for an append-only directory, anything in it can be unlinked or renamed; the parent must be neither;
- a sticky directory whose entries are someone else's, without CAP_FOWNER.

Linux only: elsewhere, and on filesystems without inode flags, the flags read as none. A file we may not open
(mode 000 under another owner) cannot show its flags: a refusal there is caught after the rename, and prune
renames the tree back while nothing of it is removed (`prune._delete`).
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import struct

FS_IMMUTABLE_FL = 0x10
FS_APPEND_FL = 0x20
# _IOR('f', 1, long): the ioctl number carries the size of a long
FS_IOC_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
CAP_FOWNER = 3
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def cannot_remove(top: str) -> str | None:
    """Why `top` (a real directory) cannot be removed in full, found before anything is touched, else None."""
    parent = os.path.dirname(top)
    try:
        top_st, parent_st = os.lstat(top), os.stat(parent)
    except OSError as exc:
        return f"cannot stat {exc.filename}: {exc.strerror}"
    try:
        if os.statvfs(top).f_flag & os.ST_RDONLY:
            return f"read-only filesystem at {top}"
    except OSError as exc:
        return f"cannot statvfs {top}: {exc.strerror}"
    inside = top.rstrip("/") + "/"
    if mounted := next((m for m in mount_points() if m == top or m.startswith(inside)), None):
        return f"a mount point (rmdir says EBUSY): {os.path.relpath(mounted, parent)}"
    if why := _writable_dir(parent, parent_st, shown=parent):
        return why
    if why := _entry(top, top_st, parent, parent_st, shown=os.path.basename(top)):
        return why
    stack = [(top, top_st)]
    while stack:
        d, d_st = stack.pop()
        shown = os.path.relpath(d, parent)
        if why := _writable_dir(d, d_st, shown=shown):
            return why
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as exc:
            return f"cannot read {shown}: {exc.strerror or exc}"
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError as exc:
                return f"cannot stat {os.path.join(shown, e.name)}: {exc.strerror or exc}"
            if why := _entry(e.path, st, d, d_st, shown=os.path.join(shown, e.name)):
                return why
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev != d_st.st_dev:  # where /proc/self/mountinfo cannot be read
                    return f"a mount point (rmdir says EBUSY): {os.path.join(shown, e.name)}"
                stack.append((e.path, st))
    return None


def mount_points() -> list[str]:
    """Every mount point of this process (/proc/self/mountinfo; a bind mount of a directory onto itself keeps its
    device number, so stat alone cannot see it); empty where it cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:  # the 5th field, with spaces and the like escaped as \ooo
            out.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))
    return out


def _writable_dir(d: str, st: os.stat_result, *, shown: str) -> str | None:
    """A directory entries are removed from: writable and searchable by us, not append-only."""
    if not _access(d, os.W_OK | os.X_OK):
        return f"no write permission on {shown}"
    if flags(d, st) & FS_APPEND_FL:
        return f"append-only directory (chattr +a): {shown}"
    return None


def _entry(path: str, st: os.stat_result, d: str, d_st: os.stat_result, *, shown: str) -> str | None:
    """An entry of directory `d` to unlink (or rename): not immutable or append-only, not sticky-protected."""
    got = flags(path, st)
    if got & FS_IMMUTABLE_FL:
        return f"immutable (chattr +i): {shown}"
    if got & FS_APPEND_FL:
        return f"append-only (chattr +a): {shown}"
    euid = os.geteuid()
    if d_st.st_mode & stat.S_ISVTX and euid not in (d_st.st_uid, st.st_uid) and not _has_cap(CAP_FOWNER):
        return f"sticky directory {os.path.dirname(shown) or '.'}: {shown} belongs to uid {st.st_uid}"
    return None


def flags(path: str, st: os.stat_result) -> int:
    """The inode flags (FS_*_FL) of a regular file or directory; 0 when there are none or they cannot be read."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return 0  # links, FIFOs, devices: opening one may block or act; chattr sets none on a link
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return 0
    try:
        got = fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(8))
    except OSError:  # ENOTTY, EOPNOTSUPP: this filesystem keeps no inode flags
        return 0
    finally:
        os.close(fd)
    return struct.unpack_from("=I", got)[0]


def _access(path: str, mode: int) -> bool:
    """access(2) as the effective user (AT_EACCESS: its capabilities, not the real user's)."""
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)


def _has_cap(cap: int) -> bool:
    """Whether capability `cap` is in the effective set (/proc/self/status CapEff); False when it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except (OSError, ValueError):
        pass
    return False
