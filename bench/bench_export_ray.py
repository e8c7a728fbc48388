"""`export --ray` against `export --jobs 1` (and `--jobs 2`) on the same checkpoint, as ratios from one run.

The checkpoint is bench_export.py's (W ranks of DTensor shards written with torch.save from a gloo group), exported
cut into about --files output shards (--max-shard-size a fraction of the shards' bytes), no transformers load. The
cluster is ray.cluster_utils.Cluster on this machine: --nodes simulated nodes of one CPU each, all on the same disk
(the "shared store" is the local filesystem). Started once, then one untimed round of every variant (Ray's workers
start and import the export modules on their first task; a long-lived cluster pays that once), then the variants
alternate, median of --repeat. Timed in this process (the driver stays connected, as one CLI run per export would
pay ray.init once: printed too). Every export's files are checked equal to --jobs 1's.

Usage: python bench/bench_export_ray.py [--mb 400] [--world-size 2] [--nodes 2] [--files 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import _shard_bytes, make_checkpoint  # noqa: E402 - the sibling script's checkpoint writer


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.safetensors"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=400, help="approximate checkpoint size (fp32 model weights)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2, help="simulated Ray nodes, one CPU each")
    ap.add_argument("--files", type=int, default=4, help="about this many output shards")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from ckpt_audit.cluster.ray_export import RayFiles
    from ckpt_audit.export.orchestrator import export_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-export-ray-"))
    cluster = None
    try:
        step = make_checkpoint(tmp / "ckpt", args.mb, args.world_size)
        size = _shard_bytes(step)
        shard = size // args.files + 1
        node = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20}
        cluster = Cluster(initialize_head=True, head_node_args=node)
        for _ in range(args.nodes - 1):
            cluster.add_node(**node)
        t0 = time.perf_counter()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        connect_s = time.perf_counter() - t0

        ray_files = RayFiles()
        variants = {
            "jobs1": dict(jobs=1),
            "jobs2": dict(jobs=2),
            "ray": dict(run_files=ray_files),
        }
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(1 + args.repeat):  # round 0: warm-up (workers started, modules imported), not counted
            for v, kw in variants.items():
                out = tmp / f"out-{v}"
                shutil.rmtree(out, ignore_errors=True)
                t = time.perf_counter()
                export_checkpoint(step, out, max_load_size=0, max_shard_size=shard, **kw)
                if i:
                    seconds[v].append(time.perf_counter() - t)
        want = _files(tmp / "out-jobs1")
        for v in ("jobs2", "ray"):
            assert _files(tmp / f"out-{v}") == want, f"{v} wrote different bytes"
        med = {v: statistics.median(s) for v, s in seconds.items()}
        print(
            f"checkpoint {size / 2**20:.0f} MiB in {args.world_size} rank files -> {len(want)} output shards; "
            f"{args.nodes} simulated Ray nodes on {os.cpu_count()} CPUs; ray.init {connect_s:.2f} s (not counted)"
        )
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        for v, s in med.items():
            print(f"{v:<6} {s:>7.2f} s   ({' '.join(f'{x:.2f}' for x in seconds[v])})")
        print(f"files per node (all rounds): {sorted(ray_files.nodes.values())}")
        print(
            f"\n--ray / --jobs 1: wall {med['ray'] / med['jobs1']:.2f}x; --jobs 2 / --jobs 1: "
            f"{med['jobs2'] / med['jobs1']:.2f}x"
        )
    finally:
        if cluster is not None:
            ray.shutdown()
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
