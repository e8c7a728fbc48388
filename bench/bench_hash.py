"""Hash + CRC throughput of ckpt_audit.readers.hashing over multi-GB torch shards, as a ratio against `cat`
(and `dd bs=8M`) of the same files in the same run, warm and cold page cache. Target: ratio >= 0.9.

    python bench/bench_hash.py [--gib 5] [--world 4] [--reps 3] [--workers 2] [--no-cold] [--zip64] [--chunk-kib N]

Shards are written with torch.save into a temporary folder (deleted at the end), laid out like one verl
step: W model shards of 16 tensors and W optimizer shards twice their size (--zip64 adds one 4.4 GiB shard).
Cold runs evict the
bench's own files from the page cache (POSIX_FADV_DONTNEED; no root, nobody else's cache emptied) before each
measurement. Every figure is the median of --reps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_audit.readers import hashing  # noqa: E402

GiB = 1024**3


def make_shards(root: Path, total_gib: float, world: int, zip64: bool) -> list[Path]:
    """A verl-like step: `world` model shards of size s and `world` optimizer shards of 2s (AdamW's two moments)."""
    import torch  # the benchmark writes real torch.save files; ckpt_audit itself never imports torch

    g = torch.Generator().manual_seed(0)
    s = total_gib * GiB / (3 * world)
    paths = []
    for rank in range(world):
        n_tensors = 16
        per = int(s / n_tensors / 4)
        sd = {f"model.layers.{i}.weight": torch.rand(per, generator=g) for i in range(n_tensors)}
        p = root / f"model_world_size_{world}_rank_{rank}.pt"
        torch.save(sd, p)
        paths.append(p)
        osd = {
            "state": {
                i: {"step": torch.tensor(1.0), "exp_avg": v, "exp_avg_sq": torch.rand(per, generator=g)}
                for i, v in enumerate(sd.values())
            },
            "param_groups": [{"lr": 1e-5, "params": list(range(n_tensors))}],
        }
        p = root / f"optim_world_size_{world}_rank_{rank}.pt"
        torch.save(osd, p)
        paths.append(p)
        del sd, osd
    if zip64:  # one shard past 4 GiB, where torch writes zip64 records
        p = root / "optim_zip64.pt"
        per = int(2.2 * GiB / 4)
        torch.save({"exp_avg": torch.rand(per, generator=g), "exp_avg_sq": torch.rand(per, generator=g)}, p)
        paths.append(p)
    return paths


def drop_caches(paths: list[Path]) -> None:
    """Evict the bench's own files from the page cache (POSIX_FADV_DONTNEED on clean pages): a cold read of them
    without root, and without emptying the cache of everyone else on a shared machine (drop_caches did both)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[Path]) -> None:
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)


def run_cat(paths: list[Path]) -> None:
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)


def run_dd(paths: list[Path]) -> None:
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=8M", "status=none"], check=True)


def run_digest(paths: list[Path], workers: int) -> None:
    for path, d in hashing.digest_files(paths, workers=workers):
        if isinstance(d, OSError) or d.crc_ok is not True:
            raise SystemExit(f"unexpected digest for {path}: {d}")


def run_hash_only(paths: list[Path], workers: int) -> None:
    for path, d in hashing.digest_files(paths, workers=workers, check_crc=False):
        if isinstance(d, OSError):
            raise SystemExit(f"unexpected error for {path}: {d}")


def compute_costs() -> str:
    """In-memory GB/s of the two per-byte computations on a cache-resident 1 MiB buffer: what the CPU allows."""
    import mmap

    import xxhash

    buf = mmap.mmap(-1, 1 << 20)
    buf.write(os.urandom(1 << 20))
    mv = memoryview(buf)
    out = []
    for name, fn in (("xxh3_128", xxhash.xxh3_128_intdigest), ("crc32", hashing._crc32)):
        t0 = time.perf_counter()
        for _ in range(1000):
            fn(mv)
        out.append(f"{name} {1000 * len(mv) / (time.perf_counter() - t0) / 1e9:.1f}")
    return "in-memory GB/s, 1 thread: " + ", ".join(out)


def cpu_flags() -> str:
    """The flags that decide the CRC-32's and xxh3's code paths, to print beside the figures."""
    want = ("avx512f", "avx512bw", "avx512vl", "vpclmulqdq", "avx2", "sse4_2", "pclmulqdq")
    try:
        with open("/proc/cpuinfo") as f:
            have = set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return "cpu flags: unknown"
    return "cpu flags: " + (" ".join(w for w in want if w in have) or "none of " + ",".join(want))


def measure(runs: dict, reps: int, cold: bool, nbytes: int, paths: list[Path]) -> dict[str, tuple[float, ...]]:
    """Each repetition runs every variant once, in turn: a disk whose speed drifts over minutes (a shared virtual
    disk does) then slows all variants alike instead of whichever ran its repetitions during the slow spell."""
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            if cold:
                drop_caches(paths)
            else:
                warm(paths)
            t0 = time.perf_counter()
            fn()
            speeds[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {name: (statistics.median(v), min(v), max(v)) for name, v in speeds.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=5.0, help="total size of the shards (default 5)")
    ap.add_argument("--world", type=int, default=4, help="ranks: W model shards of s and W optimizer shards of 2s")
    ap.add_argument("--zip64", action="store_true", help="add one 4.4 GiB shard (zip64 records)")
    ap.add_argument("--tree", default=None, help="reuse the .pt files of this folder (kept) instead of writing")
    ap.add_argument("--chunk-kib", type=int, default=None, help="override hashing.CHUNK (read size)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    ap.add_argument("--dir", default="/tmp", help="where the temporary shards go")
    args = ap.parse_args()
    cold_ok = not args.no_cold and hasattr(os, "posix_fadvise")
    with open("/proc/meminfo") as f:
        avail = int(next(line for line in f if line.startswith("MemAvailable")).split()[1]) * 1024
    if args.chunk_kib:
        hashing.CHUNK = args.chunk_kib * 1024
    if (args.gib + 4.4 * args.zip64) * GiB > 0.6 * avail:
        print(f"# only {avail / GiB:.1f} GiB available: shrinking the tree from {args.gib} GiB", file=sys.stderr)
        args.gib = round(0.6 * avail / GiB, 1)
    root = Path(args.tree) if args.tree else Path(tempfile.mkdtemp(prefix="ckpt-audit-bench-hash-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        paths = sorted(root.glob("*.pt")) if args.tree else make_shards(root, args.gib, args.world, args.zip64)
        nbytes = sum(p.stat().st_size for p in paths)
        print(
            f"# {len(paths)} shards, {nbytes / GiB:.2f} GiB, written in {time.perf_counter() - t0:.0f} s; "
            f"read size {hashing.CHUNK // 1024} KiB; "
            f"load {os.getloadavg()[0]:.2f}; median of {args.reps} (min-max), GB/s"
        )
        print(f"# {compute_costs()}; {cpu_flags()}")
        runs = {
            "cat": lambda: run_cat(paths),
            "dd bs=8M": lambda: run_dd(paths),
            f"digest_files workers={args.workers}": lambda: run_digest(paths, args.workers),
            "digest_files workers=1": lambda: run_digest(paths, 1),
            f"xxh3 only (no CRC) workers={args.workers}": lambda: run_hash_only(paths, args.workers),
        }
        for cache in ["warm", "cold"] if cold_ok else ["warm"]:
            res = measure(runs, args.reps, cache == "cold", nbytes, paths)
            base_cat, base_dd = res["cat"][0], res["dd bs=8M"][0]
            for name, (med, lo, hi) in res.items():
                print(
                    f"{cache:4}  {name:28} {med:6.2f} ({lo:.2f}-{hi:.2f})   "
                    f"ratio vs cat {med / base_cat:5.2f}   vs dd {med / base_dd:5.2f}"
                )
        print(f"# load at end {os.getloadavg()[0]:.2f}; total {time.perf_counter() - t0:.0f} s")
    finally:
        if not args.tree:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
