"""Cost of the scan's safetensors header check, as a ratio to the extent-only check it replaced, in the same run.

Writes one sparse .safetensors file of T tensors (BF16 [64, 64] each, the data a hole: only the header is read),
then times, R times each, interleaved, best taken:

- the old check: read the header, json.loads it, compare the largest end offset with the file's length;
- readers/safetensors_header.read: the same read through bounded_json, every entry checked as safetensors does
  (dtype x shape = span, spans tiling the data, data ending at the file end).

The whole-file hash the scan does anyway is not timed: for a real shard it is the larger cost by far (a 5 GB shard
of ~300 tensors has a ~30 KB header).

    python bench/bench_safetensors_header.py [--tensors 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time

from ckpt_audit.readers import safetensors_header


def write(path: str, tensors: int) -> int:
    each = 64 * 64 * 2
    header = {"__metadata__": {"format": "pt"}}
    for i in range(tensors):
        header[f"model.layers.{i // 64}.mlp.experts.{i % 64}.weight"] = {
            "dtype": "BF16",
            "shape": [64, 64],
            "data_offsets": [i * each, (i + 1) * each],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + tensors * each)
    return len(raw)


def extent_only(path: str) -> bool:
    """What the scan checked before: the largest end offset against the data the file holds."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return end <= size - 8 - n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        size = write(path, args.tensors)
        best = {"extent only (before)": float("inf"), "full header check (now)": float("inf")}
        for _ in range(args.repeat):
            for name, check in zip(best, (extent_only, safetensors_header.read)):
                t = time.perf_counter()
                check(path)
                best[name] = min(best[name], time.perf_counter() - t)
    base = best["extent only (before)"]
    print(f"{args.tensors} tensors, header {size / 2**20:.1f} MiB, best of {args.repeat}:")
    for name, s in best.items():
        print(f"  {name:26s} {s * 1e3:8.1f} ms  {s / base:5.2f}x  {s / args.tensors * 1e6:6.2f} us/tensor")


if __name__ == "__main__":
    main()
