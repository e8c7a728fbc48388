"""What the shallow scan's load checks cost: a first scan (every file read, hashed, CRC-checked and parsed), whole
process, of this checkout against another source tree (--before), interleaved, with `cat` of the same files as the
baseline measured in the same run. Goal (issue 26): the checks that follow what loaders read (zip central directory
against local headers, safetensors headers, .distcp items, bounded pickles) cost within 10 % of the scan before them.

    python bench/bench_shallow.py --before /path/to/old/checkout [--files 10000] [--gib 4] [--repeat 5]

Two trees, written once into a temporary folder: --files small torch-layout shards in verl runs (bench_rescan's
builder, the many-files case) and a --gib verl step of torch.save shards (bench_hash's writer, the many-bytes case,
needs torch). Each measurement is `ckpt-audit scan -q --rehash` into a fresh catalog copy, so every byte is read
and judged again; children use cached bytecode. Figures are medians; the ratio that matters is this/before.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hash import make_shards  # noqa: E402
from bench_rescan import build, child_env, timed_scan  # noqa: E402


def files_under(root: Path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def cat(paths: list[str]) -> float:
    t = time.perf_counter()
    for i in range(0, len(paths), 2000):  # argument lists stay under ARG_MAX
        subprocess.run(["cat", *paths[i : i + 2000]], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def measure(name: str, root: Path, work: Path, srcs: dict[str, str], repeat: int) -> None:
    paths = files_under(root)
    nbytes = sum(os.path.getsize(p) for p in paths)
    envs = {k: child_env(work, src) for k, src in srcs.items()}
    for k in srcs:  # bytecode written, first catalog made; not timed
        timed_scan(work / f"{name}-{k}.db", root, envs[k], ("--rehash",))
    walls: dict[str, list[float]] = {k: [] for k in ["cat", *srcs]}
    cpus: dict[str, list[float]] = {k: [] for k in srcs}
    for _ in range(repeat):
        walls["cat"].append(cat(paths))
        for k in srcs:  # interleaved: a drifting disk or load slows both alike
            r = timed_scan(work / f"{name}-{k}.db", root, envs[k], ("--rehash",))
            walls[k].append(r["wall"])
            cpus[k].append(r["cpu"])
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(
        f"{name}: {len(paths)} files, {nbytes / 2**30:.2f} GiB, {repeat} interleaved rounds, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"  cat            {med['cat']:7.2f} s")
    for k in srcs:
        print(
            f"  scan --rehash {k:>7} {med[k]:7.2f} s wall ({med[k] / med['cat']:.2f}x cat), "
            f"CPU {statistics.median(cpus[k]):.2f} s"
        )
    if "before" in srcs:
        print(
            f"  this/before    {med['this'] / med['before']:.3f}x wall, "
            f"{statistics.median(cpus['this']) / statistics.median(cpus['before']):.3f}x CPU"
        )


def write_extra_state(step: Path, world: int) -> None:
    """The small per-rank extra_state verl writes beside model and optimizer shards, so the step is complete."""
    import torch

    for rank in range(world):
        state = {"lr_scheduler": {"last_epoch": 1, "_step_count": 2}, "rng": {"cpu": torch.get_rng_state()}}
        torch.save(state, step / f"extra_state_world_size_{world}_rank_{rank}.pt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout to compare with (put first on PYTHONPATH)")
    ap.add_argument("--files", type=int, default=10_000, help="files of the many-files tree (0: skip it)")
    ap.add_argument("--gib", type=float, default=4.0, help="size of the many-bytes tree (0: skip it)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the temporary trees go (default: $TMPDIR)")
    args = ap.parse_args()

    srcs = {"this": str(Path(__file__).resolve().parents[1])}
    if args.before:
        srcs["before"] = str(Path(args.before).resolve())
    work = Path(tempfile.mkdtemp(prefix="bench-shallow-", dir=args.dir))
    try:
        if args.files:
            build(work / "files", args.files)
            measure("many files", work / "files", work, srcs, args.repeat)
        if args.gib:
            step = work / "bytes" / "proj" / "exp" / "global_step_1" / "actor"
            step.mkdir(parents=True)
            make_shards(step, args.gib, 4, False)
            write_extra_state(step, 4)
            (step / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 4}')
            (step.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
            measure("many bytes", work / "bytes", work, srcs, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
