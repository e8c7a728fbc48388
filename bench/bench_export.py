"""Peak memory and time of `ckpt-audit export` against verl's merge strategy, side by side in one run.

Baseline (what verl's model merger does): torch.load every rank file fully, torch.cat every tensor into one
merged state dict in memory, then save it with safetensors. Ours: `export_checkpoint` (mmap'd shards, one
tensor at a time, source pages released after each tensor), with and without the read-back verification, and
`source-check` alone: the re-read of every source file (xxh3-128 + CRCs) that every export now starts with.

Each variant runs in a fresh child process. Memory is the child's peak RSS (`ru_maxrss`, i.e. VmHWM), which
counts anonymous memory AND file pages mapped into the process; the cost of `import torch` (measured in a
child that only imports) is subtracted, so "added peak" is what the export itself needed. Because the mmap'd
shard pages count toward RSS while mapped, the streaming export drops them after each tensor (madvise); without
that its RSS would also grow to the model's size even though that memory is reclaimable page cache.
The checkpoint is synthetic but real: W ranks write DTensor shards (Shard(0) and Shard(1), uneven) with
torch.save from a gloo process group. Runs are warm (page cache), alternating variants, median of --repeat.

Usage: python bench/bench_export.py [--mb 400] [--world-size 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN = 1024


def _layout(total_mb: int) -> list[tuple[str, tuple[int, int], int]]:
    """(name, global shape, shard dim): an embedding, per-layer projections, and an untied lm_head."""
    vocab = 8192 + 7  # not divisible by W: uneven shards
    out = [("model.embed_tokens.weight", (vocab, HIDDEN), 0)]
    per_layer = [
        ("q_proj", (HIDDEN, HIDDEN), 0),
        ("k_proj", (HIDDEN // 4, HIDDEN), 1),
        ("o_proj", (HIDDEN, HIDDEN), 0),
        ("up_proj", (HIDDEN * 3, HIDDEN), 0),
        ("down_proj", (HIDDEN, HIDDEN * 3), 1),
    ]
    layer_bytes = sum(a * b for _, (a, b), _ in per_layer) * 4
    fixed = 2 * vocab * HIDDEN * 4
    layers = max(1, (total_mb * 2**20 - fixed) // layer_bytes)
    for i in range(layers):
        out += [(f"model.layers.{i}.{n}.weight", s, d) for n, s, d in per_layer]
    out.append(("lm_head.weight", (vocab, HIDDEN), 0))
    return out


def _write_rank(rank: int, world: int, actor: str, total_mb: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    sd = {}
    for i, (name, shape, dim) in enumerate(_layout(total_mb)):
        full = shape[dim]
        chunk = -(-full // world)
        n = max(0, min(chunk, full - rank * chunk))
        local_shape = list(shape)
        local_shape[dim] = n
        g = torch.Generator().manual_seed(i * 100 + rank)
        local = torch.randn(local_shape, generator=g)
        sd[name] = DTensor.from_local(
            local,
            mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    torch.save(sd, f"{actor}/model_world_size_{world}_rank_{rank}.pt")
    dist.destroy_process_group()


def make_checkpoint(root: Path, total_mb: int, world: int) -> Path:
    import torch.multiprocessing as mp

    step = root / "global_step_1"
    actor = step / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text(
        json.dumps({"model_type": "llama", "tie_word_embeddings": False})
    )
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
    mp.spawn(_write_rank, args=(world, str(actor), total_mb, 29000 + os.getpid() % 1000), nprocs=world)
    return step


# ---------------------------------------------------------------------------------------------------- children


def child(variant: str, step: str, out: str) -> None:
    import torch  # noqa: F401 - the baseline RSS includes it for every variant
    import torch.distributed.tensor  # noqa: F401

    t0 = time.perf_counter()
    if variant == "import":
        pass
    elif variant in ("stream", "stream+verify"):
        from ckpt_audit.lifecycle.export import export_checkpoint

        export_checkpoint(step, out, verify=variant == "stream+verify")
    elif variant == "baseline":
        _verl_style(Path(step) / "actor", Path(out))
    elif variant == "source-check":
        from ckpt_audit.lifecycle.export import _files_to_read
        from ckpt_audit.lifecycle.export_guard import check_source

        actor = Path(step) / "actor"
        check_source(_files_to_read(actor, actor / "huggingface"), manifest={}, status=None)
    else:
        raise SystemExit(f"unknown variant {variant}")
    seconds = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": variant, "seconds": seconds, "peak_mib": peak_kib / 1024}))


def _verl_style(actor: Path, out: Path) -> None:
    """Load all shards, merge everything in memory, then save: verl/model_merger/fsdp_model_merger.py's shape."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    world = int(json.loads((actor / "fsdp_config.json").read_text())["world_size"])
    states = [
        torch.load(actor / f"model_world_size_{world}_rank_{r}.pt", weights_only=True, map_location="cpu")
        for r in range(world)
    ]
    merged = {}
    for key in states[0]:
        pieces = [s[key]._local_tensor if isinstance(s[key], DTensor) else s[key] for s in states]
        placement = states[0][key].placements[0] if isinstance(states[0][key], DTensor) else None
        merged[key] = torch.cat(pieces, dim=placement.dim if placement is not None else 0)
    out.mkdir(parents=True)
    save_file(merged, str(out / "model.safetensors"))


def run_child(variant: str, step: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(step), str(out)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=400, help="approximate checkpoint size (fp32 model weights)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "STEP", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return

    tmp = Path(tempfile.mkdtemp(prefix="bench-export-"))
    try:
        step = make_checkpoint(tmp / "ckpt", args.mb, args.world_size)
        shards = sorted((step / "actor").glob("model_*.pt"))
        size = sum(p.stat().st_size for p in shards)
        largest = max(a * b for _, (a, b), _ in _layout(args.mb)) * 4
        print(
            f"checkpoint: {size / 2**20:.0f} MiB in {len(shards)} rank files, "
            f"{len(_layout(args.mb))} tensors, largest {largest / 2**20:.1f} MiB",
            file=sys.stderr,
        )
        variants = ["import", "baseline", "stream", "stream+verify", "source-check"]
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.repeat):
            for v in variants:  # alternate so drift hits every variant alike
                results[v].append(run_child(v, step, tmp / f"out-{v}"))
        med = {
            v: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_mib")} for v, rs in results.items()
        }
        base_rss = med["import"]["peak_mib"]
        print(f"{'variant':<16} {'time s':>8} {'peak RSS MiB':>13} {'added MiB':>10} {'added/model':>12}")
        for v in variants[1:]:
            added = med[v]["peak_mib"] - base_rss
            print(
                f"{v:<16} {med[v]['seconds']:>8.2f} {med[v]['peak_mib']:>13.0f} {added:>10.0f} "
                f"{added / (size / 2**20):>12.2f}"
            )
        b, s, sv = (med[v] for v in ("baseline", "stream", "stream+verify"))
        add = lambda m: max(m["peak_mib"] - base_rss, 1e-9)  # noqa: E731
        print(
            f"\nratio stream/baseline: added peak memory {add(s) / add(b):.2f}x, time {s['seconds'] / b['seconds']:.2f}x"
        )
        print(
            f"ratio stream+verify/baseline: added peak memory {add(sv) / add(b):.2f}x, "
            f"time {sv['seconds'] / b['seconds']:.2f}x"
        )
        print(
            f"ratio source-check/stream+verify: time {med['source-check']['seconds'] / sv['seconds']:.2f}x "
            "(the share of the default export spent re-reading its source)"
        )
        print(
            f"stream added peak / largest tensor: {add(s) / (largest / 2**20):.2f}x "
            f"(model is {size / largest:.0f}x the largest tensor)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
