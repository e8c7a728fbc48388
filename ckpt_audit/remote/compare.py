"""`compare A B`: is B an exact copy of A, file by file (either side a local directory or an s3:// prefix)?

Each side is listed as {path under the root: (size, checksums)}: a local file's checksums are computed by reading
it (readers.hashing.StoreSums, the values S3 and GCS record); an object's are its store's full-object checksums
(one HEAD each, no download). Two files match when their sizes are equal and every checksum both sides know is
equal, with at least one known to both. What cannot be compared is a difference: a copy-out job deletes its source
only on a clean answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from ckpt_audit.remote import RemoteError, is_remote, normal


@dataclass(frozen=True, slots=True)
class Entry:
    size: int
    checksums: tuple[tuple[str, str], ...]
    why_none: str = ""  # why no checksum is known (a composite multipart checksum, an unreadable file)


@dataclass(frozen=True, slots=True)
class Difference:
    path: str  # under both roots
    reason: str


def compare(a: str, b: str) -> tuple[int, list[Difference]]:
    """(files compared, the differences); RemoteError / OSError when a side cannot be listed."""
    left, right = side(a), side(b)
    out: list[Difference] = []
    for rel in sorted(left.keys() | right.keys()):
        x, y = left.get(rel), right.get(rel)
        if x is None or y is None:
            out.append(Difference(rel, f"only in {a if y is None else b}"))
        elif (why := differs(x, y)) is not None:
            out.append(Difference(rel, why))
    return len(left.keys() | right.keys()), out


def differs(x: Entry, y: Entry) -> str | None:
    if x.size != y.size:
        return f"size {x.size} B vs {y.size} B"
    mine, theirs = dict(x.checksums), dict(y.checksums)
    common = sorted(mine.keys() & theirs.keys())
    if not common:
        return "no checksum known to both sides: " + (x.why_none or y.why_none or "different algorithms")
    bad = [f"{k} {mine[k]} vs {theirs[k]}" for k in common if mine[k] != theirs[k]]
    return "checksum differs: " + ", ".join(bad) if bad else None


def side(root: str) -> dict[str, Entry]:
    return remote_side(normal(root)) if is_remote(root) else local_side(root)


def remote_side(root: str) -> dict[str, Entry]:
    from ckpt_audit.remote.store import Store

    store = Store(root)
    objs = store.objects(root)
    heads = store.heads([o.url for o in objs])
    out: dict[str, Entry] = {}
    for o in objs:
        h = heads[o.url]
        rel = o.url[len(root) + 1 :]
        if isinstance(h, RemoteError):
            out[rel] = Entry(o.size, (), why_none=str(h))
        elif h.kind == "COMPOSITE":
            out[rel] = Entry(o.size, (), why_none="the object has only a composite (multipart) checksum")
        else:
            out[rel] = Entry(o.size, h.checksums, why_none="the store keeps no checksum of it")
    return out


def local_side(root: str) -> dict[str, Entry]:
    from ckpt_audit.readers.hashing import digest_file

    if not os.path.isdir(root):
        raise OSError(f"{root} is not a directory")
    out: dict[str, Entry] = {}
    for path in _files(root):
        rel = os.path.relpath(path, root)
        try:
            d = digest_file(path, expect_zip=False, check_crc=False, store_checksums=True)
        except OSError as exc:
            out[rel] = Entry(-1, (), why_none=f"cannot read: {exc.strerror or exc}")
            continue
        why = "it changed while being read" if d.changed_during_read else ""
        out[rel] = Entry(d.size_bytes, () if why else d.checksums, why_none=why)
    return out


def _files(root: str) -> Iterator[str]:
    """Regular files below `root`, links not followed (an object store has none)."""
    for d, subdirs, names in os.walk(root):
        subdirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                yield p
