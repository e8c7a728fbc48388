"""What the default scrub costs a cron re-scan, as a ratio against the plain cached re-scan in the same run.

Builds a multi-GB verl tree (W=8, torch-like zip shards written with zipfile: no torch needed), scans it once into a
fresh catalog, then times, from a copy of that catalog each time:

  plain  re-scan with the scrub off (--no-scrub): every file reused by stat;
  cron   the default nightly re-scan one day later (scrub on, 7-day period, no budget): about a seventh of the
         bytes re-read by content, oldest verified first.

Both run the cron path (read the manifest, walk, reuse/scrub, judge, record). The clock is simulated (scan's now_ns)
so the catalog looks a day old. --cold drops the page cache before each measurement (root only), as a nightly scan
of shards written days ago would find it; warm figures measure hashing alone.

    python bench/bench_scrub.py [--gib 2] [--steps 4] [--repeat 3] [--cold]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_audit.models import format_size  # noqa: E402
from ckpt_audit.scan.scrub import DAY_NS, ScrubPolicy  # noqa: E402

WORLD = 8
CHUNK = 8 * 1024 * 1024


def torch_like_zip(path: Path, payload_bytes: int) -> None:
    """A stored zip shaped like torch.save's, with one payload entry of `payload_bytes` (zipfile computes its CRC)."""
    stem = path.name[:-3]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr(f"{stem}/data.pkl", pickle.dumps({"step": 1}, protocol=2))
        z.writestr(f"{stem}/byteorder", "little")
        with z.open(f"{stem}/data/0", "w", force_zip64=True) as out:
            left = payload_bytes
            block = os.urandom(min(CHUNK, max(1, left)))
            while left > 0:
                out.write(block[:left])
                left -= len(block)
        z.writestr(f"{stem}/version", "3\n")


def build(root: Path, gib: float, steps: int) -> Path:
    run = root / "proj" / "exp"
    per_model = int(gib * 1024**3 / (steps * WORLD * 3))  # model s, optimizer 2s (two AdamW moments)
    for s in range(1, steps + 1):
        actor = run / f"global_step_{s}" / "actor"
        actor.mkdir(parents=True)
        for r in range(WORLD):
            torch_like_zip(actor / f"model_world_size_{WORLD}_rank_{r}.pt", per_model)
            torch_like_zip(actor / f"optim_world_size_{WORLD}_rank_{r}.pt", 2 * per_model)
            torch_like_zip(actor / f"extra_state_world_size_{WORLD}_rank_{r}.pt", 4096)
        (actor / "fsdp_config.json").write_text(f'{{\n    "FSDP_version": 2,\n    "world_size": {WORLD}\n}}')
        torch_like_zip(run / f"global_step_{s}" / "data.pt", 1024)
    (run / "latest_checkpointed_iteration.txt").write_text(str(steps))
    return run


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def rescan(root: Path, base_db: Path, work_db: Path, *, now_ns: int, scrub: ScrubPolicy | None, cold: bool):
    """One cron re-scan from a copy of the first scan's catalog: (seconds, result)."""
    from ckpt_audit.catalog import open_catalog, read_previous
    from ckpt_audit.scan import scan

    for suffix in ("", "-wal", "-shm"):
        Path(f"{work_db}{suffix}").unlink(missing_ok=True)
    shutil.copy(base_db, work_db)
    if cold:
        drop_caches()
    t = time.perf_counter()
    res = scan([root], previous=read_previous(work_db), in_progress_window_s=0, now_ns=now_ns, scrub=scrub)
    with open_catalog(work_db) as cat:
        cat.record_scan(res)
    return time.perf_counter() - t, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each measurement (root)")
    args = ap.parse_args()
    from ckpt_audit.catalog import open_catalog
    from ckpt_audit.scan import scan

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        root = Path(tmp) / "root"
        t = time.perf_counter()
        build(root, args.gib, args.steps)
        built = time.perf_counter() - t
        base_db = Path(tmp) / "base.db"
        t0 = time.time_ns()
        with open_catalog(base_db) as cat:
            first = scan([root], in_progress_window_s=0, now_ns=t0)
            cat.record_scan(first)
        assert not [f for f in first.all_findings if f.severity > 0], "bench tree should scan clean"
        total = first.bytes_hashed
        day_later = t0 + DAY_NS
        plain, cron = [], []
        res_plain = res_cron = None
        for _ in range(args.repeat):  # interleaved, so load on the shared box hits both alike
            s, res_plain = rescan(root, base_db, Path(tmp) / "work.db", now_ns=day_later, scrub=None, cold=args.cold)
            plain.append(s)
            s, res_cron = rescan(
                root, base_db, Path(tmp) / "work.db", now_ns=day_later, scrub=ScrubPolicy(), cold=args.cold
            )
            cron.append(s)
        p, c = statistics.median(plain), statistics.median(cron)
        cache = "cold" if args.cold else "warm"
        print(f"tree: {first.files_hashed} files, {format_size(total)} (built in {built:.1f} s); page cache {cache}")
        print(
            f"plain cached re-scan (--no-scrub): {p * 1000:.0f} ms median of {args.repeat} "
            f"(min {min(plain) * 1000:.0f}, max {max(plain) * 1000:.0f}); {res_plain.files_reused} reused, "
            f"{format_size(res_plain.bytes_hashed)} read"
        )
        print(
            f"cron re-scan a day later, default scrub (7d period, no budget): {c * 1000:.0f} ms median "
            f"(min {min(cron) * 1000:.0f}, max {max(cron) * 1000:.0f}); {res_cron.files_scrubbed} file(s) "
            f"scrubbed, {format_size(res_cron.bytes_scrubbed)} re-read = {res_cron.bytes_scrubbed / total:.1%} "
            f"of the tree ({format_size(res_cron.bytes_scrubbed / (c - p) if c > p else 0)}/s)"
        )
        print(f"ratio cron scrub / plain re-scan: {c / p:.1f}x")


if __name__ == "__main__":
    main()
