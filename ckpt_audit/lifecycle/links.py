"""Symbolic links under the scanned roots that lead into checkpoints: prune's blast radius past one run.

A run warm-started from another run's step through a link (`B/global_step_4 -> ../exp/global_step_4`, which verl
follows) loads `exp`'s step 4 from B: deleting that step would break B's resume point though nothing of B is
deleted. So a checkpoint that a link outside it leads to (or into: a link to one shard counts too) is kept while
the link exists. A link to a run directory or above pins no step: a resume through it reads that run's tracker,
whose target prune protects anyway.

`find_links` walks the roots without following links (one listing per directory, no stat per entry); the plan
takes its result as an input (`retention.plan_prune(links=...)`), and `prune.execute` walks the roots again
before its first deletion and re-checks each link it found at the moment it acts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from ckpt_audit.tree import TRASH_PREFIX


@dataclass(frozen=True, slots=True, kw_only=True)
class Links:
    """The links found under `roots`: (link path, the real path it leads to), sorted by link path."""

    roots: tuple[str, ...] = ()
    found: tuple[tuple[str, str], ...] = ()

    def into(self, path: str, *, besides: Iterable[str] = ()) -> tuple[str, ...]:
        """The links that lead to `path` or below it from outside it (and outside every path in `besides`)."""
        inside = path.rstrip("/") + "/"
        outside = [p.rstrip("/") + "/" for p in (path, *besides)]
        return tuple(
            link
            for link, target in self.found
            if (target == path or target.startswith(inside)) and not any(link.startswith(o) for o in outside)
        )


def find_links(roots: Iterable[str]) -> Links:
    """Every symbolic link below `roots` (not followed; prune's trash is not looked into). A root or directory
    that cannot be listed is passed over: prune's own checks refuse to remove what they cannot list."""
    roots = tuple(dict.fromkeys(roots))
    found: dict[str, str] = {}
    for top in _outermost(roots):
        stack = [top]
        while stack:
            d = stack.pop()
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
                    elif e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                except OSError:
                    continue
    return Links(roots=roots, found=tuple(sorted(found.items())))


def _outermost(paths: Iterable[str]) -> list[str]:
    """`paths` without those inside another one (each directory is walked once)."""
    out: list[str] = []
    for p in sorted(paths):
        if not any(p == o or p.startswith(o.rstrip("/") + "/") for o in out):
            out.append(p)
    return out
