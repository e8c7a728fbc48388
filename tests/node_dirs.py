"""A tree split over simulated nodes' local disks, as the Ray tests and their in-process twins use it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

RANK = re.compile(r"_rank_(\d+)\.")


def split_by_rank(run: Path, base: Path, n_nodes: int) -> list[Path]:
    """`run`'s tree copied into base/node<i>/<project>/<exp>: rank r's files on node r % n, the rest on node 0.
    Every node directory exists, even one that holds nothing."""
    top = run.parent.parent
    dirs = [base / f"node{i}" for i in range(n_nodes)]
    for d in dirs:
        d.mkdir(parents=True)
    for f in sorted(p for p in top.rglob("*") if p.is_file() and not p.name.startswith(".fixture")):
        m = RANK.search(f.name)
        dst = dirs[int(m.group(1)) % n_nodes if m else 0] / f.relative_to(top)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    return dirs
