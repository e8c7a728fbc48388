"""Symbolic links under the scanned roots that lead into checkpoints: prune's blast radius past one run.

A run warm-started from another run's step through a link (`B/global_step_4 -> ../exp/global_step_4`, which verl
follows) loads `exp`'s step 4 from B: deleting that step would break B's resume point though nothing of B is
deleted. So a checkpoint that a link outside it leads to (or into: a link to one shard counts too) is kept while
the link exists. A link to a run directory or above pins no step: a resume through it reads that run's tracker,
whose target prune protects anyway.

`find_links` walks the roots without following links (one listing per directory, no stat per entry), and the
directories holding the runs two levels deep (a sibling run outside the roots: `B/global_step_4`); the plan takes
its result as an input (`retention.plan_prune(links=...)`), and `prune.execute` walks the same places again before
its first deletion and re-checks each link it found at the moment it acts.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from ckpt_audit.models import Run
from ckpt_audit.tree import TRASH_PREFIX


@dataclass(frozen=True, slots=True, kw_only=True)
class Links:
    """The links found under `roots` (walked in full) and `near` (two levels: sibling runs' step links), as
    (link path, the real path it leads to), sorted by link path."""

    roots: tuple[str, ...] = ()
    near: tuple[str, ...] = ()
    found: tuple[tuple[str, str], ...] = ()
    _by_target: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_target", tuple(sorted((t, ln) for ln, t in self.found)))

    def into(self, path: str) -> tuple[str, ...]:
        """The links that lead to `path` or below it from outside it."""
        inside = path.rstrip("/") + "/"
        out = []
        for target, link in self._by_target[bisect.bisect_left(self._by_target, (path,)) :]:
            if target != path and not target.startswith(inside):
                break
            if not link.startswith(inside):
                out.append(link)
        return tuple(sorted(out))


def find_links(roots: Iterable[str], *, near: Iterable[str] = ()) -> Links:
    """Every symbolic link below `roots`, and in `near` and its subdirectories (not followed; prune's trash is not
    looked into). `near`: the directories holding the runs (a run beside them, outside the roots, that warm-started
    from one of their steps links to it from there). What cannot be listed is passed over: prune's own checks
    refuse to remove what they cannot list."""
    roots = tuple(dict.fromkeys(roots))
    near = tuple(sorted(p for p in set(near) if not _below(p, roots)))
    found: dict[str, str] = {}
    for top in _outermost(roots):
        _walk(top, found, depth=None)
    for top in near:
        _walk(top, found, depth=2)
    return Links(roots=roots, near=near, found=tuple(sorted(found.items())))


def links_for(roots: Iterable[str], runs: Iterable[Run]) -> Links:
    """The links a prune plan of `runs` under `roots` must respect: below the roots, and beside every run (what the
    CLI's and the TUI's plans both take, so the two cannot look in different places)."""
    return find_links(roots, near={os.path.dirname(r.path) for r in runs})


def _walk(top: str, found: dict[str, str], *, depth: int | None) -> None:
    stack = [(top, 1)]
    while stack:
        d, level = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith(TRASH_PREFIX):
                continue
            try:
                if e.is_symlink():
                    found[e.path] = os.path.realpath(e.path)
                elif e.is_dir(follow_symlinks=False) and (depth is None or level < depth):
                    stack.append((e.path, level + 1))
            except OSError:
                continue


def _below(path: str, tops: Iterable[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _outermost(paths: Iterable[str]) -> list[str]:
    """`paths` without those inside another one (each directory is walked once)."""
    out: list[str] = []
    for p in sorted(paths):
        if not _below(p, out):
            out.append(p)
    return out
