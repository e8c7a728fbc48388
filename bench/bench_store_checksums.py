"""What the object stores' checksums (CRC-32, CRC-32C, CRC-64/NVME: readers.hashing.StoreSums) add to the scan's one
read pass: digest_file over the same warm files with and without them, each as a ratio against `cat` of the same
files in the same run (the read limit). Median of --reps.

    python bench/bench_store_checksums.py [--mib 1024] [--files 4] [--reps 5]

The files are random bytes in a temporary folder (deleted at the end); a non-zip file is hashed exactly like a
shard's payload (the zip CRC pass is the same with and without the store checksums).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_audit.readers import hashing  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024, help="total size of the files")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sums-") as tmp:
        paths = []
        for i in range(args.files):
            p = os.path.join(tmp, f"shard_{i}.bin")
            with open(p, "wb") as f:
                for _ in range(args.mib // args.files):
                    f.write(os.urandom(1024 * 1024))
            paths.append(p)
        total = sum(os.path.getsize(p) for p in paths)

        def cat() -> None:
            subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)

        def digest(sums: bool):
            return lambda: [hashing.digest_file(p, store_checksums=sums) for p in paths]

        cat()  # warm the page cache
        runs = {"cat": [], "hash": [], "hash+store sums": []}
        for _ in range(args.reps):
            runs["cat"].append(timed(cat))
            runs["hash"].append(timed(digest(False)))
            runs["hash+store sums"].append(timed(digest(True)))
        med = {k: statistics.median(v) for k, v in runs.items()}
        for k, v in med.items():
            print(f"{k:<16} {total / v / 1e9:6.2f} GB/s  ratio vs cat {med['cat'] / v:5.2f}")
        print(f"store sums cost: {med['hash+store sums'] / med['hash'] - 1:+.1%} of the hash pass (warm, one thread)")


if __name__ == "__main__":
    main()
