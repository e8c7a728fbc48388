"""verify's deep checks on a multi-GB checkpoint, as a ratio against scan's hashing of the same tree.

Writes a verl FSDP2-named step (W ranks of real DTensor model / AdamW optimizer / extra_state shards from a gloo
group, --gib in total), then in this one run times (warm page cache, median of --repeat):
  hash    scan.scan with no previous manifest: every byte read, xxh3-128 + CRC-32   (the baseline)
  deep    verify.deepen on that scan result: every shard torch.load-ed (weights_only, mmap) and compared
  verify  verify() with the catalog's manifest reused by stat, as `ckpt-audit verify` runs after a scan

    python bench/bench_verify.py [--gib 2] [--world 2] [--repeat 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path


def _rank(rank: int, world: int, out: str, port: int, floats_per_rank: int) -> None:
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    n_layers = 24
    rows = max(world, int((floats_per_rank / 3 / n_layers / 1024) * world))
    model, state = {}, {}
    for i in range(n_layers):
        local = torch.full((rows // world, 1024), float(i))
        p = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        model[f"model.layers.{i}.mlp.weight"] = p
        state[i] = {
            "step": torch.tensor(10.0),
            "exp_avg": DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False),
            "exp_avg_sq": DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False),
        }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(range(n_layers))}]
    actor = Path(out) / "global_step_10" / "actor"
    if rank == 0:
        actor.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(model, actor / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save({"state": state, "param_groups": groups}, actor / f"optim_world_size_{world}_rank_{rank}.pt")
    torch.save(
        {
            "lr_scheduler": {"last_epoch": 10, "base_lrs": [1e-3], "_step_count": 11, "lr_lambdas": [None]},
            "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
        },
        actor / f"extra_state_world_size_{world}_rank_{rank}.pt",
    )
    if rank == 0:
        from torchdata.stateful_dataloader import StatefulDataLoader

        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
        loader = StatefulDataLoader(list(range(40)), batch_size=2)
        for _, _ in zip(range(10), loader):
            pass
        torch.save(loader.state_dict(), actor.parent / "data.pt")  # what verl's data.pt holds
    dist.barrier()
    if rank == 0:  # after every rank's files, as verl's trainer does
        (Path(out) / "latest_checkpointed_iteration.txt").write_text("10")
    dist.destroy_process_group()


def write_tree(root: Path, *, gib: float, world: int) -> Path:
    import torch.multiprocessing as mp

    run = root / "bench" / "exp"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    floats = int(gib * 2**30 / 4 / world)
    mp.start_processes(_rank, args=(world, str(run), port, floats), nprocs=world, join=True, start_method="spawn")
    return run


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="write the tree here and keep it")
    args = ap.parse_args()

    from ckpt_audit import scan, verify
    from ckpt_audit.tree import FileFacts

    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        run = write_tree(root, gib=args.gib, world=args.world)
        size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
        scan.scan([run])  # warm the page cache once, as a nightly re-read would find it
        t_hash, result = timed(lambda: scan.scan([run]), args.repeat)
        t_deep, deep = timed(lambda: verify.deepen(result), args.repeat)
        bad = [f for f in deep.all_findings if f.severity > 0]
        assert not bad, bad
        previous = {}
        for r in result.runs:
            for c in r.checkpoints:
                for f in c.all_files:
                    previous[f.path] = FileFacts(
                        path=f.path,
                        size_bytes=f.size_bytes,
                        mtime_ns=f.mtime_ns,
                        inode=f.inode,
                        hash=f.hash,
                        crc_ok=f.crc_ok,
                    )
        t_verify, _ = timed(lambda: verify.verify([run], previous=previous), args.repeat)
        n = sum(len(c.all_files) for r in result.runs for c in r.checkpoints)
        print(f"tree: {size / 2**30:.2f} GiB in {n} files, W={args.world}; warm cache; median of {args.repeat}")
        print(f"scan hashing (baseline)         {t_hash:8.3f} s  {size / 2**30 / t_hash:6.2f} GiB/s  1.000x")
        print(f"deep checks (deepen)            {t_deep:8.3f} s  {'':>12}  {t_deep / t_hash:.3f}x")
        print(f"verify, manifest reused by stat {t_verify:8.3f} s  {'':>12}  {t_verify / t_hash:.3f}x")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
