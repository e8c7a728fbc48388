"""A remote scan of N objects against an S3 server (moto's, in its own process): requests per object and wall time,
against a plain listing of the same prefix in the same run; and `compare`'s remote side (HEADs) against downloading
the objects.

    python bench/bench_remote.py [--objects 10000] [--world 8] [--size 4096]

The objects are laid out as one verl run (global_step_N/actor/{model,optim,extra_state}_world_size_W_rank_R.pt and
fsdp_config.json, a tracker), with random bytes: no catalog holds them, so every shard is judged
remote-unverified, the same requests as a matched one. Requests are counted in the server's own access log.
Needs the s3 extra and moto[server].
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUCKET = "bench-bucket"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests(log: Path, since: int) -> tuple[Counter, int]:
    lines = log.read_text(errors="replace").splitlines()
    return Counter(m.group(1) for line in lines[since:] if (m := re.search(r'"([A-Z]+) /', line))), len(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=10000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--size", type=int, default=4096, help="bytes per object")
    args = ap.parse_args()
    port = free_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "w") as out:
            server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stderr=out, stdout=out)
        try:
            run(args, log, tmp)
        finally:
            server.terminate()
            server.wait()


def run(args, log: Path, tmp: str) -> None:
    import boto3

    from ckpt_audit.remote.compare import remote_side
    from ckpt_audit.remote.scan import scan_remote
    from ckpt_audit.remote.store import Store

    for _ in range(100):
        try:
            client = boto3.client("s3")
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:  # noqa: BLE001 - the server is still starting
            time.sleep(0.1)
    per_step = 3 * args.world + 1
    steps = max(1, args.objects // per_step)
    keys = ["run/demo/exp/latest_checkpointed_iteration.txt"]
    for s in range(1, steps + 1):
        base = f"run/demo/exp/global_step_{s}/actor"
        keys.append(f"{base}/fsdp_config.json")
        keys += [f"{base}/{k}_world_size_{args.world}_rank_{r}.pt" for k in ("model", "optim", "extra_state")
                 for r in range(args.world)]  # fmt: skip
    body = os.urandom(args.size)

    def put(key: str) -> None:
        data = str(steps).encode() if key.endswith(".txt") else body
        client.put_object(Bucket=BUCKET, Key=key, Body=data, ChecksumAlgorithm="CRC64NVME")

    t = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))
    print(f"uploaded {len(keys)} objects of {args.size} B in {time.perf_counter() - t:.1f} s")
    _, mark = requests(log, 0)
    url = f"s3://{BUCKET}/run"
    store = Store(url)
    t = time.perf_counter()
    listed = store.objects(url)
    t_list = time.perf_counter() - t
    counts, mark = requests(log, mark)
    print(f"plain listing: {len(listed)} objects in {t_list:.2f} s, requests {dict(counts)}")
    t = time.perf_counter()
    result = scan_remote([url], store=store, window_s=0)
    t_scan = time.perf_counter() - t
    counts, mark = requests(log, mark)
    n = len(listed)
    statuses = Counter(c.status.value for r in result.runs for c in r.checkpoints)
    print(
        f"remote scan: {t_scan:.2f} s ({t_scan / t_list:.1f}x the listing), {sum(counts.values()) / n:.3f} requests "
        f"per object {dict(counts)}, objects downloaded {store.gets}; statuses {dict(statuses)}"
    )
    t = time.perf_counter()
    remote_side(url)
    t_cmp = time.perf_counter() - t
    counts, mark = requests(log, mark)
    print(f"compare (one side): {t_cmp:.2f} s, requests {dict(counts)}")
    t = time.perf_counter()
    store.fs.get(f"{BUCKET}/run", os.path.join(tmp, "download"), recursive=True)
    t_get = time.perf_counter() - t
    counts, mark = requests(log, mark)
    print(f"download of the same objects: {t_get:.2f} s ({t_get / t_cmp:.2f}x compare), requests {dict(counts)}")


if __name__ == "__main__":
    main()
