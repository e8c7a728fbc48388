"""Cost of `ckpt-audit continuity` on a long log, as a ratio against the floor any reader pays: json.loads of every
line of the same file, measured in the same run.

The log is synthetic and deterministic: N steps of a noisy decaying loss in the harness's flat JSONL form, split
into attempts that each resume from the last checkpoint (every 500 steps) after logging a few steps past it, so
every resume point is found from the counter reset and judged. With `tensorboard` installed, the same loss as one
TensorBoard event file is timed too, against the plain way to read it: a loop over TensorBoard's EventFileLoader.

Run: python bench/bench_continuity.py [--steps 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path


def write_log(path: Path, steps: int, every: int = 500, redo: int = 7) -> int:
    rng = random.Random(0)
    lines, step, resumes = [], 1, 0
    while step <= steps:
        end = min(step + every + redo, steps + 1)
        for s in range(step, end):
            loss = 2.0 * math.exp(-s / steps) + 0.5 + rng.gauss(0, 0.02)
            lines.append(json.dumps({"step": s, "loss": loss, "lr": 1e-4, "grad_norm": 1 + rng.random()}))
        if end > steps:
            break
        step = end - redo  # crash after `redo` steps past the checkpoint; resume from it
        resumes += 1
    path.write_text("\n".join(lines) + "\n")
    return resumes


def median_time(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from ckpt_audit.continuity.audit import audit_log
    from ckpt_audit.continuity.metrics import read_metrics

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "metrics.jsonl"
        resumes = write_log(log, args.steps)

        def floor() -> None:
            with open(log) as fh:
                for line in fh:
                    json.loads(line)

        def audit() -> None:
            result = audit_log(read_metrics([log]))
            assert len(result.points) == resumes and not any(f.code == "metric-jump" for f in result.findings)

        base, ours = median_time(args.repeat, floor), median_time(args.repeat, audit)
        lines = sum(1 for _ in open(log))
        print(f"continuity on {lines} JSONL lines, {resumes} resumes (median of {args.repeat})")
        print(
            f"  json.loads floor {base:.3f} s   read+audit {ours:.3f} s   ratio {ours / base:.2f}   "
            f"{lines / ours / 1e3:.0f} k lines/s"
        )
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("  tensorboard not installed: event-file row skipped")
            return
        tb = Path(tmp) / "tb"
        writer = SummaryWriter(str(tb))
        for line in open(log):
            row = json.loads(line)
            writer.add_scalar("actor/loss", row["loss"], row["step"])
        writer.close()
        event = str(next(tb.iterdir()))
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        base = median_time(args.repeat, lambda: sum(1 for _ in EventFileLoader(event).Load()))
        ours = median_time(args.repeat, lambda: audit_log(read_metrics([event])))
        print(
            f"  event file ({Path(event).stat().st_size >> 10} KiB): TensorBoard's EventFileLoader loop "
            f"{base:.3f} s   read+audit {ours:.3f} s   ratio {ours / base:.2f}"
        )


if __name__ == "__main__":
    main()
