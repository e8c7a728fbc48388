"""A scan of an object-store prefix: the listing and one HEAD per object build the same Tree and FileFacts a local
walk does, so the same layouts, statuses, findings and catalog apply, keyed by URL.

No object is downloaded unless `read_data` (scan --read-data), except the small text files the rules read (the
tracker, HF's trainer_state.json and indexes: the layouts' text_files). Every other object is judged from metadata:

- its size and the store's full-object checksum equal the catalog's for the same logical file (a local file whose
  path ends with the same run name and path under the run, recorded by `scan --store-checksums`): the catalog's
  facts (hash, CRC verdict, structure) stand for the object, which holds exactly those bytes;
- a different size or checksum: `remote-checksum-mismatch` (corrupt);
- nothing to compare with (no catalogued checksum, or only a composite multipart checksum, which no whole-file
  value reproduces): `remote-unverified`, a file not read, so its checkpoint is unknown (protected), unless
  `read_data` streams it through the local readers.

A multipart upload begun and not completed under a checkpoint is `upload-in-progress` (the checkpoint is unknown).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import ckpt_audit.scan as local_scan
from ckpt_audit.codes import finding
from ckpt_audit.layouts import enclosing_step_dir, file_kind, load_layouts
from ckpt_audit.models import IN_PROGRESS_WINDOW_S, FileFacts, Finding, many_objects
from ckpt_audit.remote import RemoteError, normal
from ckpt_audit.remote.store import Head, Obj, Store
from ckpt_audit.rules.status import ScanContext
from ckpt_audit.scan.pipeline import _in_focus
from ckpt_audit.scan.read import _wants_text
from ckpt_audit.tree import Tree

READERS = 8  # objects downloaded and read at once (--read-data, the text files)
TEXT_GET_LIMIT = 16 * 1024 * 1024  # a "text" object larger than this is not fetched (the rules read prefixes only)
_READ_DATA = [False]


@contextlib.contextmanager
def read_data_on(on: bool = True) -> Iterator[None]:
    """scan --read-data, while inside: stream every object of a run through the local readers (a GET each)."""
    was, _READ_DATA[0] = _READ_DATA[0], on
    try:
        yield
    finally:
        _READ_DATA[0] = was


def scan_remote(
    roots: Sequence[str],
    *,
    previous: Mapping[str, FileFacts] | None = None,
    window_s: float = IN_PROGRESS_WINDOW_S,
    now_ns: int | None = None,
    read_data: bool | None = None,
    rehash: bool = False,
    store: Store | None = None,
):
    """Scan remote `roots` (URLs) into a ScanResult, as scan.scan does a local tree. A root at or inside a step
    directory scans that checkpoint with its run (scan.focus_of); `rehash` (latest --verified's re-read of its
    candidate) reads the objects as `read_data` does."""
    started = time.time_ns()
    now = now_ns if now_ns is not None else started
    read_data = (_READ_DATA[0] if read_data is None else read_data) or rehash
    layouts = load_layouts()
    real = [normal(r) for r in roots]
    walk_roots, focus = focus_of(real)
    with many_objects():
        partials = []
        for url in walk_roots:
            store = store or Store(url)
            partials.append(
                _partial(url, store, previous or {}, layouts=layouts, now_ns=now, read_data=read_data, focus=focus)
            )
        ctx = ScanContext(now_ns=now, in_progress_window_ns=int(window_s * 1e9))
        result = local_scan.reduce(partials, ctx=ctx, layouts=layouts)
    if focus:
        whole = frozenset(walk_roots) - {os.path.dirname(f) for f in focus}
        result = local_scan.only_checkpoints(result, focus, whole=whole)
    return replace(result, roots=tuple(real), started_ns=started, finished_ns=time.time_ns())


def focus_of(urls: Sequence[str]) -> tuple[list[str], frozenset[str]]:
    """scan.focus_of for URLs: (prefixes to list, checkpoint prefixes asked for by a URL at or inside them)."""
    walk: list[str] = []
    focus: set[str] = set()
    for url in urls:
        bucket_len = url.index("/", url.index("://") + 3) if url.count("/") > 2 else len(url)
        step = enclosing_step_dir(url[bucket_len:] or "/")  # the key part: the scheme's "//" is no directory
        target = url[:bucket_len] + os.path.dirname(step) if step else url
        if step:
            focus.add(url[:bucket_len] + step)
        if target not in walk:
            walk.append(target)
    return walk, frozenset(f for f in focus if os.path.dirname(f) not in urls)


def _partial(root: str, store: Store, previous: Mapping[str, FileFacts], *, layouts, now_ns: int, read_data, focus):
    objs = store.objects(root)
    tree = tree_of(root, objs)
    found: list[Finding] = []
    owners: dict[str, str] = {}
    for layout in layouts:
        for d in layout.find_runs(tree):
            owners.setdefault(d, layout.name)
    if not owners:
        found.append(finding("no-runs", root, "no checkpoint runs found under this prefix"))
    by_url = {o.url: o for o in objs}
    run_of = {p: r for r in owners for p in tree.files_below(r)}
    heads = store.heads(sorted(run_of))
    catalogued = _Catalogued(previous)
    facts: dict[str, FileFacts] = {}
    to_read: list[tuple[Obj, Head]] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-audit-remote-") as tmp:
        for url, run in sorted(run_of.items()):
            obj, head = by_url[url], heads[url]
            if isinstance(head, RemoteError):
                facts[url] = _fact(obj, finding("unreadable", url, f"cannot read: {head}"))
            elif obj.size == head.size == 0:  # known whole from the listing: judged as an empty local file is
                facts[url] = _read_local(_local_path(obj, tmp), obj, head, file_kind(url, layouts), now_ns=now_ns)
            elif (read_data and (not focus or _in_focus(url, focus))) or (
                _wants_text(url) and obj.size <= TEXT_GET_LIMIT
            ):
                to_read.append((obj, head))
            else:
                facts[url] = _judged(obj, head, catalogued.candidates(run, url))
        with ThreadPoolExecutor(READERS) as pool:
            # GETs in flight together (a round trip each); at most READERS objects in the temporary folder at once
            done = pool.map(
                lambda oh: _read(store, oh[0], oh[1], file_kind(oh[0].url, layouts), tmp, now_ns=now_ns), to_read
            )
            facts.update((f.path, f) for f in done)
    read = len(to_read)
    for key in store.uploads(root):
        found.append(
            finding("upload-in-progress", key, "a multipart upload of this object was begun and not completed")
        )
    from ckpt_audit.tree import Partial

    return Partial(
        root=root,
        tree=tree,
        facts=facts,
        findings=tuple(found),
        files_hashed=read,
        bytes_hashed=sum(by_url[u].size for u, f in facts.items() if not f.reused and f.hash is not None),
        files_reused=sum(1 for f in facts.values() if f.reused),
        owners=owners,
    )


def tree_of(root: str, objs: Sequence[Obj]) -> Tree:
    """The listing as a Tree: each `/` in a key is a directory. A directory's mtime is its newest object's (a
    store has no directory mtimes; a step whose objects are all old is not young)."""
    dirs: dict[str, set[str]] = {root: set()}
    files: dict[str, list[str]] = {}
    mtimes: dict[str, int] = {}
    for o in objs:
        parent, name = o.url.rsplit("/", 1)
        files.setdefault(parent, []).append(name)
        d = parent
        while d != root and d.startswith(root + "/"):
            mtimes[d] = max(mtimes.get(d, 0), o.mtime_ns)
            up, sub = d.rsplit("/", 1)
            dirs.setdefault(up, set()).add(sub)
            dirs.setdefault(d, set())
            d = up
        mtimes[root] = max(mtimes.get(root, 0), o.mtime_ns)
    return Tree(
        dirs={d: tuple(sorted(s)) for d, s in dirs.items()},
        files={d: tuple(sorted(n)) for d, n in files.items()},
        dir_mtime_ns=mtimes,
    )


class _Catalogued:
    """The catalog's local files by logical name (run directory's name + path under the run)."""

    def __init__(self, previous: Mapping[str, FileFacts]) -> None:
        self.previous = previous
        self._by_name: dict[str, list[str]] | None = None

    def candidates(self, run: str, url: str) -> list[FileFacts]:
        if self._by_name is None:
            self._by_name = {}
            for p in self.previous:
                if p.startswith("/"):  # local files only: a bucket is checked against its source
                    self._by_name.setdefault(p[p.rfind("/") + 1 :], []).append(p)
        tail = "/" + os.path.basename(run) + url[len(run) :]
        return [self.previous[p] for p in self._by_name.get(url[url.rfind("/") + 1 :], ()) if p.endswith(tail)]


def _fact(obj: Obj, *found: Finding, sums: tuple[tuple[str, str], ...] = ()) -> FileFacts:
    return FileFacts(path=obj.url, size_bytes=obj.size, mtime_ns=obj.mtime_ns, inode=0, findings=found, checksums=sums)


def _judged(obj: Obj, head: Head, candidates: list[FileFacts]) -> FileFacts:
    """The object's facts from its metadata and the catalog's copies of the same logical file (module docstring)."""
    full = head.checksums if head.kind != "COMPOSITE" else ()
    known = [c for c in candidates if c.checksums]
    mine = dict(full)
    for c in known:
        if c.size_bytes == obj.size and any(mine.get(a) == v for a, v in c.checksums):
            found = tuple(replace(f, path=obj.url) if f.path == c.path else f for f in c.findings)
            return replace(
                c, path=obj.url, mtime_ns=obj.mtime_ns, inode=0, reused=True, text=None, findings=found, checksums=full
            )
    comparable = [c for c in known if c.size_bytes != obj.size or set(mine) & {a for a, _ in c.checksums}]
    if comparable:
        c = comparable[0]
        what = (
            f"size {obj.size} B, the catalogued copy {c.path} has {c.size_bytes} B"
            if c.size_bytes != obj.size
            else f"store checksum differs from the catalogued copy {c.path}'s ({_show(full, c.checksums)})"
        )
        return _fact(obj, finding("remote-checksum-mismatch", obj.url, what), sums=full)
    if head.kind == "COMPOSITE":
        why = "the store holds only a composite (multipart, per-part) checksum, which no whole-file value matches"
    elif not candidates:
        why = "no catalogued local copy of this file to compare with"
    elif not known:
        why = "its catalogued copy has no store checksums (scan the source with --store-checksums)"
    else:
        why = "the store holds no checksum the catalog has (" + ", ".join(a for a, _ in full) + ")"
    return _fact(obj, finding("remote-unverified", obj.url, f"not read: {why}; --read-data reads it"), sums=full)


def _show(full: tuple[tuple[str, str], ...], theirs: tuple[tuple[str, str], ...]) -> str:
    mine = dict(full)
    return ", ".join(f"{a} {mine[a]} vs {v}" for a, v in theirs if a in mine)


def _local_path(obj: Obj, tmp: str) -> str:
    """A path for the object's bytes in its own folder, under its own name (the readers and the text rules go by
    the file name); an empty file until written."""
    local = os.path.join(tempfile.mkdtemp(dir=tmp), os.path.basename(obj.url))
    open(local, "wb").close()
    return local


def _read(store: Store, obj: Obj, head: Head, kind, tmp: str, *, now_ns: int) -> FileFacts:
    """The object downloaded to a temporary file and read by the local readers (_read_local)."""
    local = _local_path(obj, tmp)
    try:
        store.download(obj.url, local)
    except (RemoteError, FileNotFoundError) as exc:
        os.unlink(local)
        return _fact(obj, finding("unreadable", obj.url, f"cannot read: {exc}"))
    return _read_local(local, obj, head, kind, now_ns=now_ns)


def _read_local(local: str, obj: Obj, head: Head, kind, *, now_ns: int) -> FileFacts:
    """The facts the local readers find in the object's bytes at `local` (then deleted), keyed by its URL."""
    try:
        fact = local_scan.read_file(local, os.stat(local), None, kind=kind, now_ns=now_ns)
    finally:
        os.unlink(local)
    found = tuple(replace(f, path=obj.url) if f.path == local else f for f in fact.findings)
    return replace(
        fact, path=obj.url, mtime_ns=obj.mtime_ns, inode=0, findings=found, checksums=head.checksums or fact.checksums
    )
