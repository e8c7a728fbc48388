"""scan --ray on simulated nodes (ray.cluster_utils.Cluster on this machine) and the driver's cost per 100k files.

1. Shared placement throughput: one shared root (a verl-like tree written here with torch.save, R ranks per step)
   scanned with 1, 2, 3 ... nodes (cluster/shared.RayReader), every file hashed (no catalog), median of --repeat
   after one untimed warm-up per cluster (worker start-up and imports). Printed: seconds, MB/s, the ratio to one
   node and to a plain local scan (no Ray) in the same run, and each node's share (files, bytes). On a small VM every
   simulated node shares the same cores and page cache, so the ratio is bounded by the machine, not by the store.
2. The driver's side per 100k files, synthetic FileFacts copied from the real tree's (8 ranks per step dir):
   node-local: merging the partials (scan.merge_partials) and their pickled size; shared: unpickling the nodes'
   answers (as Ray hands them over) and their size in memory (tracemalloc), and the reduce that judges every run
   (layouts + rules), which a local scan of the same files also pays.

Usage: python bench/bench_ray.py [--nodes 3] [--steps 4] [--ranks 8] [--shard-mib 16] [--repeat 3] [--files 100000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import replace

from ckpt_audit import scan
from ckpt_audit.cluster.shared import RayReader, ShareAnswer
from ckpt_audit.layouts import ScanContext, load_layouts
from ckpt_audit.tree import FileFacts, Partial, Tree


def write_tree(root: str, *, steps: int, ranks: int, shard_mib: int) -> int:
    """A verl FSDP run: per step, per rank a model shard, an optimizer shard (2x) and a small extra_state."""
    import torch

    run = os.path.join(root, "proj", "exp")
    n = shard_mib * 2**20 // 4
    total = 0
    for s in range(1, steps + 1):
        d = os.path.join(run, f"global_step_{s * 100}", "actor")
        os.makedirs(d)
        for r in range(ranks):
            for name, numel in (("model", n), ("optim", 2 * n), ("extra_state", 16)):
                p = os.path.join(d, f"{name}_world_size_{ranks}_rank_{r}.pt")
                torch.save({"w": torch.randn(numel)}, p)
                total += os.path.getsize(p)
    with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(steps * 100))
    return total


def time_local(root: str, *, workers: int, repeat: int) -> float:
    scan.scan([root], workers=workers)  # warm the page cache
    return statistics.median(_timed(lambda: scan.scan([root], workers=workers)) for _ in range(repeat))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_shared(root: str, k: int, *, workers: int, repeat: int) -> tuple[float, dict]:
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * 2**20})
    for _ in range(k - 1):
        c.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        scan.scan([root], workers=workers, reader=RayReader(nodes=nodes))  # warm-up: workers start, import
        times, tally = [], {}
        for _ in range(repeat):
            reader = RayReader(nodes=nodes)
            times.append(_timed(lambda r=reader: scan.scan([root], workers=workers, reader=r)))
            assert reader.read_here == 0, "a node handed files back: not one shared root"
            tally = {n: (t.files, t.bytes) for n, t in reader.tally.items()}
        return statistics.median(times), tally
    finally:
        ray.shutdown()
        c.shutdown()


def synthetic(templates: dict[str, FileFacts], files: int, nodes: int) -> list[Partial]:
    """`files` facts copied from the real tree's (model/optim/extra_state), 8 ranks per step dir, over `nodes`."""
    kinds = sorted(templates)
    out = []
    for n in range(nodes):
        dirs: dict[str, tuple[str, ...]] = {"/ckpts/proj/exp": ()}
        names: dict[str, list[str]] = {"/ckpts/proj/exp": ["latest_checkpointed_iteration.txt"]}
        facts = {}
        for i in range(n, files, nodes):
            step, rest = divmod(i, 8 * len(kinds))
            kind, rank = kinds[rest // 8], rest % 8
            d = f"/ckpts/proj/exp/global_step_{step + 1}/actor"
            name = f"{kind}_world_size_8_rank_{rank}.pt"
            names.setdefault(d, []).append(name)
            dirs.setdefault(d, ())
            dirs.setdefault(d.rsplit("/", 1)[0], ("actor",))
            p = f"{d}/{name}"
            facts[p] = replace(templates[kind], path=p, inode=i, hash=f"{i:032x}")
        tree = Tree(dirs=dirs, files={d: tuple(v) for d, v in names.items()})
        out.append(Partial(root="/ckpts", tree=tree, facts=facts))
    steps = sorted({p.rsplit("/", 3)[1] for part in out for p in part.facts})
    top = {"/ckpts": ("proj",), "/ckpts/proj": ("exp",), "/ckpts/proj/exp": tuple(steps)}
    return [replace(part, tree=replace(part.tree, dirs={**part.tree.dirs, **top})) for part in out]


def driver_costs(templates: dict[str, FileFacts], files: int, nodes: int) -> dict[str, float]:
    parts = synthetic(templates, files, nodes)
    wire = [pickle.dumps(p) for p in parts]
    t0 = time.perf_counter()
    scan.merge_partials(parts)
    merge_s = time.perf_counter() - t0
    answers = [pickle.dumps(ShareAnswer(node_id=str(i), facts=dict(p.facts))) for i, p in enumerate(parts)]
    t0 = time.perf_counter()
    for a in answers:
        pickle.loads(a)
    unpickle_s = time.perf_counter() - t0
    tracemalloc.start()  # the driver's memory for every answer received at once (a separate, slower pass)
    held = [pickle.loads(a) for a in answers]
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del held
    whole = Partial(
        root="/ckpts", tree=scan.merge_partials(parts)[0], facts={k: v for p in parts for k, v in p.facts.items()}
    )
    ctx = ScanContext(now_ns=time.time_ns(), in_progress_window_ns=0)
    t0 = time.perf_counter()
    result = scan.reduce([whole], ctx=ctx, layouts=load_layouts())
    reduce_s = time.perf_counter() - t0
    assert sum(len(c.components) for r in result.runs for c in r.checkpoints) > 0
    per = 100_000 / files
    return {
        "local_wire_MB": sum(map(len, wire)) * per / 1e6,
        "local_merge_s": merge_s * per,
        "shared_wire_MB": sum(map(len, answers)) * per / 1e6,
        "shared_unpickle_s": unpickle_s * per,
        "answers_in_memory_MB": memory * per / 1e6,
        "reduce_s": reduce_s * per,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="up to this many simulated nodes (1, 2, ... N)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=16, help="model shard size; optimizer shards are twice that")
    ap.add_argument("--workers", type=int, default=2, help="reader threads per node (scan --workers)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--files", type=int, default=100_000, help="synthetic files for the driver's costs")
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    tmp = tempfile.mkdtemp(prefix="bench-ray-")
    try:
        root = os.path.join(tmp, "shared")
        total = write_tree(root, steps=a.steps, ranks=a.ranks, shard_mib=a.shard_mib)
        n_files = 3 * a.steps * a.ranks
        print(f"shared root: {n_files} files, {total / 1e6:.0f} MB, workers={a.workers} per node")
        local = time_local(root, workers=a.workers, repeat=a.repeat)
        print(f"local scan (no Ray): {local:.2f} s, {total / local / 1e6:.0f} MB/s")
        one = None
        for k in range(1, a.nodes + 1):
            t, tally = time_shared(root, k, workers=a.workers, repeat=a.repeat)
            one = one or t
            split = "; ".join(f"{n[:8]}: {f} files {b / 1e6:.0f} MB" for n, (f, b) in sorted(tally.items()))
            print(
                f"shared, {k} node(s): {t:.2f} s, {total / t / 1e6:.0f} MB/s, x{one / t:.2f} vs 1 node, "
                f"x{local / t:.2f} vs local | {split}"
            )
        res = scan.scan([root], workers=a.workers)
        templates = {os.path.basename(p).split("_world")[0]: f for p, f in res.file_facts.items() if "_rank_0." in p}
        costs = driver_costs(templates, a.files, a.nodes)
        print(
            f"driver per 100k files ({a.files} synthetic, {a.nodes} nodes): "
            f"node-local merge {costs['local_merge_s']:.2f} s"
            f" (partials {costs['local_wire_MB']:.0f} MB pickled); shared unpickle {costs['shared_unpickle_s']:.2f} s"
            f" (answers {costs['shared_wire_MB']:.0f} MB pickled, {costs['answers_in_memory_MB']:.0f} MB in memory);"
            f" reduce (layouts + rules) {costs['reduce_s']:.2f} s"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
