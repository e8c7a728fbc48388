"""What export checks before it puts anything in place: where it may write, and whether the source may be trusted.

Export is the one command that replaces a directory the user names, so a typo in `--to` must never reach a
checkpoint. `check_destination` refuses a `--to` that is, contains or sits inside a checkpoint, a run or a scanned
root (the source's own, every one the catalog knows, and anything at, above or inside `--to` that looks like one),
and lets `--force` replace only an earlier export (recognised by its marker file) or an empty directory.

`check_source` re-reads every file the export will read, by content: torch zips' CRCs and each file's xxh3-128
against the catalog's manifest, whatever the stat says (bit rot keeps size and mtime). A failure, or a checkpoint
the catalog holds as corrupt, unsafe or unknown, is a refusal unless the user opts in. `BackgroundCheck` runs it
on its own thread beside the copy pass; export joins it before the rename into place. No torch here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ckpt_audit.codes import finding
from ckpt_audit.layouts import enclosing_step_dir
from ckpt_audit.layouts.dcp import DISTCP_RE
from ckpt_audit.layouts.tracker import TRACKER
from ckpt_audit.layouts.verl_fsdp import SHARD_RE, STEP_RE
from ckpt_audit.models import Finding, Severity
from ckpt_audit.readers import bounded_json
from ckpt_audit.readers.hashing import digest_files
from ckpt_audit.rules.files import zip_finding

MARKER = ".ckpt-audit-export.json"  # written into every export: what makes `--force` allowed to replace it
MARKER_KIND = "ckpt-audit-export"
REFUSED_STATUSES = frozenset({"corrupt", "unsafe", "unknown"})


class ExportError(Exception):
    """The checkpoint cannot be exported; the message is one line for the user."""


class ExportRefused(ExportError):
    """A safety check said no; nothing was put at --to (a work directory written meanwhile is removed first).
    `about`: "destination" (--to, judged before anything is written), "source", or "model" (the export is not the
    model its config.json describes: export.model)."""

    def __init__(self, message: str, *, about: str, findings: tuple[Finding, ...] = ()) -> None:
        super().__init__(message)
        self.about = about
        self.findings = findings


# ---------------------------------------------------------------------------------------------------- --to


@dataclass(frozen=True, slots=True, kw_only=True)
class Destination:
    path: str  # absolute, links not resolved: a --force replaces a link, never the directory it points to
    real: str  # what it (or its nearest existing ancestor) resolves to
    replaces: str  # "" nothing there | "empty-dir" | "export" (an earlier export, by its marker)


def step_and_run(src: str) -> tuple[str, str]:
    """The checkpoint (nearest step directory at or above `src`, else `src`) and its run (that one's parent)."""
    ckpt = enclosing_step_dir(src) or src
    return ckpt, os.path.dirname(ckpt)


def check_destination(to: str | os.PathLike[str], *, protected: Iterable[tuple[str, str]], force: bool) -> Destination:
    """Refuse (ExportRefused) unless writing to `to` can destroy nothing but an earlier export or an empty dir.

    `protected`: (what, path) pairs such as ("run", "/ckpts/p/e"), real paths. Reads only; nothing is touched.
    """
    path = os.path.abspath(to)
    real = os.path.realpath(path)
    hits = [
        (relation, what, place)
        for what, place in protected
        if (relation := _relation(real, os.path.realpath(place)) or _relation(path, place))
    ]
    if not hits:  # places no catalog knows (an unscanned run): recognised by what they hold
        hits = [
            ("is" if place == top else "is inside", what, place)
            for top in (real, path)
            if (found := _enclosing_checkpoint_tree(top))
            for what, place in (found,)
        ]
    if hits:
        relation, what, place = min(hits, key=_most_telling)
        raise ExportRefused(
            f"--to {path} {relation} the {what} {place}: refusing to write there (choose a "
            "directory outside every checkpoint, run and scanned root)",
            about="destination",
        )
    if not os.path.lexists(path):
        return Destination(path=path, real=real, replaces="")
    if sign := _checkpoint_sign(real):
        raise ExportRefused(f"--to {path} holds checkpoint data ({sign}): refusing to replace it", about="destination")
    if not force:
        raise ExportRefused(
            f"{path} exists (use --force to replace an earlier export or an empty directory)", about="destination"
        )
    if os.path.isdir(real) and not os.listdir(real):
        return Destination(path=path, real=real, replaces="empty-dir")
    if why_not := _not_an_export(real):
        raise ExportRefused(
            f"--force replaces only an earlier export or an empty directory; {path} {why_not}", about="destination"
        )
    return Destination(path=path, real=real, replaces="export")


def _most_telling(hit: tuple[str, str, str]) -> tuple[int, int]:
    """Name what --to is; else the outermost place it contains; else the innermost one it sits in."""
    relation, _what, place = hit
    return {"is": (0, 0), "contains": (1, len(place)), "is inside": (2, -len(place))}[relation]


def _relation(to: str, place: str) -> str | None:
    if to == place:
        return "is"
    if _inside(place, to):
        return "contains"
    if _inside(to, place):
        return "is inside"
    return None


def _inside(child: str, parent: str) -> bool:
    return child.startswith(parent.rstrip("/") + "/")


def _enclosing_checkpoint_tree(path: str) -> tuple[str, str] | None:
    """("checkpoint" | "run", place) for the innermost directory at or above `path` that looks like one: named
    `global_step_N`, or directly holding a tracker or a `global_step_N` directory. Reads only directory listings."""
    probe = path
    while True:
        if STEP_RE.fullmatch(os.path.basename(probe)):
            return "checkpoint", probe
        if probe != path and os.path.isdir(probe):
            try:
                names = os.listdir(probe)
            except OSError:
                names = []
            if TRACKER in names or any(STEP_RE.fullmatch(n) and os.path.isdir(os.path.join(probe, n)) for n in names):
                return "run", probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent


def _checkpoint_sign(top: str) -> str | None:
    """The first thing inside `top` that only a checkpoint tree holds (a step dir, a tracker, a rank shard)."""
    if not os.path.isdir(top):
        return None
    for dirpath, dirs, files in os.walk(top, followlinks=False):
        for name in dirs:
            if STEP_RE.fullmatch(name):
                return os.path.relpath(os.path.join(dirpath, name), top)
        for name in files:
            if name == TRACKER or SHARD_RE.fullmatch(name) or DISTCP_RE.fullmatch(name):
                return os.path.relpath(os.path.join(dirpath, name), top)
    return None


def _not_an_export(top: str) -> str | None:
    """Why `top` is not an earlier export left as written (None if it is one)."""
    if not os.path.isdir(top):
        return "is not a directory"
    marker = read_marker(top)
    if marker is None:
        return f"is not empty and has no {MARKER} (not written by ckpt-audit export)"
    listed = set(marker.get("files", {}))
    for dirpath, _dirs, files in os.walk(top, followlinks=False):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), top)
            if rel != MARKER and rel not in listed:
                return f"holds {rel}, which the export did not write"
    return None


def read_marker(top: str) -> dict | None:
    try:
        doc = bounded_json.load_file(os.path.join(top, MARKER))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("kind") == MARKER_KIND else None


def marker_document(
    *,
    source: str,
    created_ns: int,
    source_check: str,
    override: str,
    model_check: str,
    verified: bool,
    files: Iterable[tuple[str, int, str]],
) -> dict:
    """The marker's content: `files` are (path relative to the export, size, xxh3-128). `verified` and `model_check`
    (export.result.ExportResult's) say whether an --allow-unverified export is a model its config describes."""
    return {
        "kind": MARKER_KIND,
        "version": 1,
        "source": source,
        "created_ns": created_ns,
        "source_check": source_check,
        "override": override,
        "model_check": model_check,
        "verified": verified,
        "files": {rel: {"size_bytes": size, "hash": h} for rel, size, h in files},
    }


# ---------------------------------------------------------------------------------------------------- source


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceFile:
    path: str
    hash: str
    size_bytes: int
    mtime_ns: int
    inode: int
    weights: bool  # a file the tensors come from (not config or tokenizer)
    against: str  # "manifest" (hash = the catalog's) | "crc" (CRCs only) | "none" (nothing to compare with)


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceCheck:
    files: tuple[SourceFile, ...]
    findings: tuple[Finding, ...]  # errors: each one alone refuses the export
    status: str | None  # the catalog's verdict on the checkpoint; None when it has none
    notes: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        """How the weights were checked: "manifest" (all against the catalog), "crc-only", or "none"."""
        weights = [f for f in self.files if f.weights]
        if weights and all(f.against == "manifest" for f in weights):
            return "manifest"
        if weights and all(f.against in ("manifest", "crc") for f in weights):
            return "crc-only"
        return "none"


def check_source(
    paths: Iterable[tuple[str, bool]],
    *,
    manifest: dict[str, dict],
    status: str | None,
    status_findings: Iterable[Finding] = (),
    stop: threading.Event | None = None,
) -> SourceCheck:
    """Re-read `paths` ((path, holds weights) pairs) by content and compare with the catalog's `manifest`
    (path -> files row: hash, size_bytes, mtime_ns, inode). `status`/`status_findings`: the catalog's verdict.
    `stop`: when set, the check ends after the files being read (its result is then incomplete: not for use)."""
    weights = dict(paths)
    found: list[Finding] = []
    notes: list[str] = []
    files: list[SourceFile] = []
    digests = digest_files(list(weights))
    for path, got in digests:
        if stop is not None and stop.is_set():
            digests.close()  # the pool drops what it has not started and joins its threads
            break
        if isinstance(got, OSError):
            found.append(finding("unreadable", path, f"cannot read: {got.strerror or got}"))
            continue
        bad = _digest_problems(path, got)
        found += bad
        row = manifest.get(path)
        same_stat = row is not None and (row["size_bytes"], row["mtime_ns"], row["inode"]) == (
            got.stat_size,
            got.mtime_ns,
            got.inode,
        )
        if row is not None and same_stat and row["hash"] and row["hash"] != got.hash:
            found.append(
                finding(
                    "hash-drift",
                    path,
                    f"content differs from the catalog's manifest (xxh3 "
                    f"{got.hash[:12]}.. vs {row['hash'][:12]}..) with size and "
                    "mtime unchanged",
                )
            )
        if row is not None and not same_stat:
            notes.append(f"{path}: changed since the last scan; checked by CRC only")
        against = (
            "manifest"
            if row is not None and same_stat and row["hash"] == got.hash
            else ("crc" if got.crc_ok else "none")
        )
        files.append(
            SourceFile(
                path=path,
                hash=got.hash,
                size_bytes=got.size_bytes,
                mtime_ns=got.mtime_ns,
                inode=got.inode,
                weights=weights[path],
                against=against,
            )
        )
    if status in REFUSED_STATUSES:
        errors = [f for f in status_findings if f.severity is Severity.ERROR] or list(status_findings)
        if errors:
            found += [f for f in errors if (f.path, f.code) not in {(g.path, g.code) for g in found}]
        else:
            notes.append(f"the catalog holds the checkpoint as {status}")
    return SourceCheck(
        files=tuple(sorted(files, key=lambda f: f.path)), findings=tuple(found), status=status, notes=tuple(notes)
    )


class BackgroundCheck:
    """check_source on its own thread while the copy pass writes the export (its hashing releases the GIL).

    `result()` joins it and returns the check (or raises what it raised); `cancel()` stops it after the files being
    read and joins it. Either way the thread ends before the export returns or raises: never left running."""

    def __init__(self, paths: Iterable[tuple[str, bool]], **options) -> None:
        self._stop = threading.Event()
        self._out: list[SourceCheck | BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(list(paths), options), name="ckpt-export-check", daemon=True
        )
        self._thread.start()

    def _run(self, paths: list[tuple[str, bool]], options: dict) -> None:
        try:
            self._out.append(check_source(paths, stop=self._stop, **options))
        except BaseException as exc:  # noqa: BLE001 - raised in the exporting thread by result()
            self._out.append(exc)

    def result(self) -> SourceCheck:
        self._thread.join()
        got = self._out[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()


def _digest_problems(path: str, got) -> list[Finding]:
    out = []
    if got.crc_bad_entries:
        out.append(finding("crc-mismatch", path, f"CRC-32 mismatch in {', '.join(got.crc_bad_entries[:3])}"))
    if got.zip_error is not None and path.endswith((".pt", ".pth")):
        f = zip_finding(path, got.zip_error)
        if f.severity is Severity.ERROR:
            out.append(f)
    if got.changed_during_read:
        out.append(finding("file-changed-during-scan", path, "size or mtime changed while it was read"))
    return out


def first_of(findings: Sequence[Finding]) -> str:
    """A refusal's one line: the first finding, and how many more there are."""
    first = findings[0]
    more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
    return f"{first.path}: {first.code}: {first.message}{more}"


def refusal(check: SourceCheck) -> ExportRefused | None:
    """The one-line refusal for a source that failed its check, or None when it passed."""
    if not check.findings and check.status not in REFUSED_STATUSES:
        return None
    head = first_of(check.findings) if check.findings else f"the catalog holds the checkpoint as {check.status}"
    return ExportRefused(
        f"refusing to export an unverified source: {head}; re-scan if it was repaired, or pass "
        "--allow-corrupt to export it anyway (recorded)",
        about="source",
        findings=check.findings,
    )


def changed_since(check: SourceCheck, listed: Mapping[str, tuple[int, int, int]] | None = None) -> str | None:
    """After the export: a source file whose stat moved since it was checked (its bytes are not what we checked),
    or that the check found other than the walk had listed it (`listed`: path -> (size, mtime_ns, inode), what
    export.sources.export_input chose it by: a file replaced, or by a link, in between)."""
    for f in check.files:
        if listed is not None and f.path in listed and listed[f.path] != (f.size_bytes, f.mtime_ns, f.inode):
            return f.path
        try:
            st = os.stat(f.path)
        except OSError:
            return f.path
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (f.size_bytes, f.mtime_ns, f.inode):
            return f.path
    return None
