"""Re-scan of an unchanged tree, whole process and in parts, as ratios against a plain os.scandir walk.

Builds N small shards in torch's zip layout (written with zipfile: no torch needed) in a verl tree (W=8), scans once
into a fresh catalog, then times the re-scan the cron job makes: `ckpt-audit scan -q` as a fresh process (interpreter
start, imports, manifest read, walk, reuse every hash by stat, judge, record the scan), and the same steps in this
process, split. Goals (issue 16): whole process < 0.5 s at 10k files, < 3 s at 100k; the catalog's size and the
record step are printed so the growth 10k -> 100k -> 1M can be read off runs with --files.

    python bench/bench_rescan.py [--files 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


def torch_like_zip(path: Path) -> None:
    """A tiny archive shaped like torch.save's: stored entries under the file stem, a data.pkl, version, byteorder."""
    stem = path.name[:-3]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{stem}/data.pkl", pickle.dumps({"step": 1}, protocol=2))
        z.writestr(f"{stem}/byteorder", "little")
        z.writestr(f"{stem}/version", "3\n")
        z.writestr(f"{stem}/.data/serialization_id", os.urandom(8).hex())


def build(root: Path, n_files: int) -> Path:
    run = root / "proj" / "exp"
    per_step = 3 * 8 + 2  # W=8: model/optim/extra_state per rank + fsdp_config + data.pt
    steps = max(1, n_files // per_step)
    for s in range(1, steps + 1):
        actor = run / f"global_step_{s}" / "actor"
        actor.mkdir(parents=True)
        for r in range(8):
            for kind in ("model", "optim", "extra_state"):
                torch_like_zip(actor / f"{kind}_world_size_8_rank_{r}.pt")
        (actor / "fsdp_config.json").write_text('{\n    "FSDP_version": 2,\n    "world_size": 8\n}')
        torch_like_zip(run / f"global_step_{s}" / "data.pt")
    (run / "latest_checkpointed_iteration.txt").write_text(str(steps))
    return run


def walk_baseline(root: str) -> int:
    n = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    e.stat(follow_symlinks=False)
                    n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from ckpt_audit.catalog import open_catalog, read_previous
    from ckpt_audit.scanner import scan

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        build(root, args.files)
        db = Path(tmp) / "c.db"
        with open_catalog(db) as cat:
            first = scan([root], in_progress_window_s=0)
            cat.record_scan(first)
        assert not [f for f in first.all_findings if f.severity > 0], "bench tree should scan clean"
        n = walk_baseline(str(root))
        base, rescans, reused = [], [], 0
        for _ in range(args.repeat):
            t = time.perf_counter()
            walk_baseline(str(root))
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            prev = read_previous(db)
            res = scan([root], previous=prev, in_progress_window_s=0)
            with open_catalog(db) as cat:
                cat.record_scan(res)
            rescans.append(time.perf_counter() - t)
            reused = res.files_reused
        parts: dict[str, list[float]] = {"manifest": [], "scan": [], "record": []}
        cpu: dict[str, list[float]] = {"manifest": [], "scan": [], "record": []}
        whole, bare, whole_cpu = [], [], []
        # children load cached bytecode, as an installed package does (see bench_startup.py)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        cmd = [sys.executable, "-m", "ckpt_audit", "scan", "-q", "--in-progress-window", "0", "--catalog", str(db)]
        subprocess.run([*cmd, str(root)], capture_output=True, env=env)  # writes the bytecode; not timed
        for _ in range(args.repeat):
            c0, t0 = time.process_time(), time.perf_counter()
            prev = read_previous(db)
            c1, t1 = time.process_time(), time.perf_counter()
            res = scan([root], previous=prev, in_progress_window_s=0)
            c2, t2 = time.process_time(), time.perf_counter()
            with open_catalog(db) as cat:
                cat.record_scan(res)
            c3, t3 = time.process_time(), time.perf_counter()
            for k, v, c in zip(parts, (t1 - t0, t2 - t1, t3 - t2), (c1 - c0, c2 - c1, c3 - c2)):
                parts[k].append(v)
                cpu[k].append(c)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
            bare.append(time.perf_counter() - t)
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            proc = subprocess.run(
                [*cmd, str(root)],
                capture_output=True,
                text=True,
                env=env,
            )
            whole.append(time.perf_counter() - t)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            whole_cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            assert proc.returncode == 0, proc.stdout + proc.stderr
        b, r = statistics.median(base), statistics.median(rescans)
        w, p = statistics.median(whole), statistics.median(bare)
        print(f"files in tree: {n}; reused by stat: {reused}; hashed: {res.files_hashed}")
        print(f"catalog: {db.stat().st_size / 2**20:.1f} MiB after {3 + 3 * args.repeat} scans")
        print(f"plain os.scandir walk + stat: {b * 1000:.0f} ms (median of {args.repeat})")
        print(
            f"in-process re-scan (manifest read, walk, reuse, judge, record): {r * 1000:.0f} ms "
            f"(min {min(rescans) * 1000:.0f}, max {max(rescans) * 1000:.0f}); parts: "
            + ", ".join(f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in parts.items())
        )
        print(
            "CPU time (user+sys; steadier than wall time on a loaded box): "
            + ", ".join(f"{k} {statistics.median(v) * 1000:.0f} ms" for k, v in cpu.items())
            + f"; whole process {statistics.median(whole_cpu) * 1000:.0f} ms"
        )  # (no peak RSS: a child forked from this big process inherits its high-water mark; use /usr/bin/time)
        print(f"ratio in-process re-scan / walk: {r / b:.1f}x")
        goal = 0.5 if n <= 20_000 else 3.0 * n / 100_000
        print(
            f"whole process `ckpt-audit scan -q`: {w * 1000:.0f} ms (min {min(whole) * 1000:.0f}); bare python "
            f"{p * 1000:.0f} ms; goal < {goal:.1f} s: {'met' if w < goal else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
