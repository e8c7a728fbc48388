"""Cost of prune's survivor check, as a ratio to the plain cached re-scan that prune runs first, in the same run.

Builds a verl tree of S checkpoints at world size W with real `torch.save` shards (model M MiB per rank, optimizer
twice that, extra state and data.pt small), scans it once into a fresh catalog, then times, R times each:

- the plain cached re-scan prune starts with (read the manifest, walk, reuse every hash by stat, judge, record);
- the survivor check for `--keep-last 1` (`survivors.verify_plan`: re-read the newest complete checkpoint, which is
  also the tracker's target, in full: xxh3 + zip CRCs, compared with the recorded hashes).

The tree was just written, so its bytes are in the page cache: the re-read figure is the warm-cache cost (hash and
CRC bound); from a cold disk it is the checkpoint's size over the disk's read rate. Both are printed per byte too.

    python bench/bench_prune_survivor.py [--steps 6] [--world 4] [--mib 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build(root: Path, *, steps: int, world: int, mib: int) -> Path:
    import torch  # the bench writes real torch.save shards; the code it times never imports torch

    run = root / "proj" / "exp"
    n = mib * 2**20 // 4  # float32 elements per model shard
    for s in range(1, steps + 1):
        step = run / f"global_step_{s * 100}"
        actor = step / "actor"
        actor.mkdir(parents=True)
        for r in range(world):
            g = torch.Generator().manual_seed(s * 1000 + r)
            w = torch.randn(n, generator=g)
            torch.save({"model.weight": w}, actor / f"model_world_size_{world}_rank_{r}.pt")
            torch.save(
                {
                    "state": {0: {"step": torch.tensor(float(s)), "exp_avg": w.clone(), "exp_avg_sq": w.abs()}},
                    "param_groups": [{"lr": 1e-3, "params": [0]}],
                },
                actor / f"optim_world_size_{world}_rank_{r}.pt",
            )
            torch.save(
                {"lr_scheduler": {"last_epoch": s * 100}, "rng": {"cpu": torch.get_rng_state()}},
                actor / f"extra_state_world_size_{world}_rank_{r}.pt",
            )
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
        torch.save({"_num_yielded": s}, step / "data.pt")
    (run / "latest_checkpointed_iteration.txt").write_text(str(steps * 100))
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=4, help="model shard size per rank (optimizer: twice that)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from ckpt_audit.catalog import open_catalog, read_previous
    from ckpt_audit.lifecycle.retention import KeepLast, Policy, plan_prune
    from ckpt_audit.lifecycle.survivors import verify_plan
    from ckpt_audit.models import format_size
    from ckpt_audit.scan import scan

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        build(root, steps=args.steps, world=args.world, mib=args.mib)
        db = Path(tmp) / "c.db"
        t = time.perf_counter()
        first = scan([root], in_progress_window_s=0)
        full = time.perf_counter() - t
        with open_catalog(db) as cat:
            cat.record_scan(first)
        assert not [f for f in first.all_findings if f.severity > 0], "bench tree should scan clean"
        policy = Policy(rules=(KeepLast(n=1),))

        rescans, checks, reread = [], [], 0
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = scan([root], previous=read_previous(db), in_progress_window_s=0)
            with open_catalog(db) as cat:
                cat.record_scan(res)
            rescans.append(time.perf_counter() - t)
            t = time.perf_counter()
            check = verify_plan(plan_prune(res.runs, policy, now_ns=time.time_ns()), res.runs)
            checks.append(time.perf_counter() - t)
            assert not check.failed and len(check.plan.delete) == args.steps - 1
            reread = check.bytes_reread

        total = sum(c.size_bytes for r in first.runs for c in r.checkpoints)
        r, c = statistics.median(rescans), statistics.median(checks)
        print(
            f"tree: {args.steps} checkpoints, W={args.world}, {format_size(total)} "
            f"({sum(len(c.all_files) for r in first.runs for c in r.checkpoints)} files); "
            f"first full scan {full:.2f} s ({total / full / 2**20:.0f} MiB/s)"
        )
        print(
            f"plain cached re-scan (manifest, walk, reuse by stat, judge, record): {r * 1000:.0f} ms "
            f"(median of {args.repeat}; reused {res.files_reused}, hashed {res.files_hashed})"
        )
        print(
            f"survivor check (--keep-last 1: re-read the newest complete, {format_size(reread)}): "
            f"{c * 1000:.0f} ms ({reread / c / 2**20:.0f} MiB/s, warm cache)"
        )
        print(
            f"ratio survivor check / plain re-scan: {c / r:.1f}x; bytes re-read: {format_size(reread)} "
            f"= {reread / total:.0%} of the tree (1/{args.steps} of it here)"
        )


if __name__ == "__main__":
    main()
