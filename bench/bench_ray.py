"""The driver's side of scan --ray, per 100k files: merging node partials (scanner.merge_partials) and the size of
the partials it receives (pickle, as Ray ships them). Synthetic FileFacts, 8 ranks per checkpoint dir, split over
N nodes. Usage: python bench/bench_ray.py [--files 100000] [--nodes 3]. Not yet: scan throughput on 1/2/3 nodes."""

from __future__ import annotations

import argparse
import pickle
import time

from ckpt_audit.scanner import merge_partials
from ckpt_audit.tree import FileFacts, Partial, Tree


def partials(files: int, nodes: int) -> list[Partial]:
    out = []
    for n in range(nodes):
        dirs: dict[str, tuple[str, ...]] = {}
        names: dict[str, tuple[str, ...]] = {}
        facts = {}
        for i in range(n, files, nodes):
            d = f"/ckpts/run/global_step_{i // 8}/actor"
            name = f"model_world_size_8_rank_{i % 8}.pt"
            names[d] = names.get(d, ()) + (name,)
            dirs.setdefault(d, ())
            p = f"{d}/{name}"
            facts[p] = FileFacts(path=p, size_bytes=2**30, mtime_ns=i, inode=i, hash=f"{i:032x}")
        out.append(Partial(root="/ckpts", tree=Tree(dirs=dirs, files=names), facts=facts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--nodes", type=int, default=3)
    a = ap.parse_args()
    parts = partials(a.files, a.nodes)
    wire = sum(len(pickle.dumps(p)) for p in parts)
    t0 = time.perf_counter()
    merge_partials(parts)
    merge_s = time.perf_counter() - t0
    per = 100_000 / a.files
    print(
        f"files={a.files} nodes={a.nodes} merge_s_per_100k={merge_s * per:.3f} wire_MB_per_100k={wire * per / 1e6:.1f}"
    )


if __name__ == "__main__":
    main()
