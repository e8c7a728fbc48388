"""Cost of `ckpt-audit resume-test`, per step and per rank, as a ratio against plain training measured in the
same run: the same S steps at the same world size in one launcher, with no checkpoint written or loaded.

resume-test trains 2S steps in three fresh process sets (straight S, first half k, second half S-k), saves
twice, loads once, writes a probe and compares three trees; the baseline trains S steps once. Both pay one
torch/transformers import in their launcher, so the ratio is the honest end-to-end price of the proof.

With --resume-world-size W' the second half re-shards (continuity mode: the loss, lr and grad_norm logs are then
also judged as `ckpt-audit continuity` judges them), and S defaults to 24.

Run: python bench/bench_resume.py [--steps 8] [--world-sizes 1,2] [--resume-world-size 3] [--repeat 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    from harness.config import TrainConfig
    from harness.launch import run_phases
    from harness.resume import ResumeTestSpec, default_steps, metrics_of, run_resume_test

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--resume-world-size", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    to = args.resume_world_size
    print(
        f"resume-test cost vs plain training of the same steps (wall seconds, median of {args.repeat}; "
        f"steps_s = sum of per-step times from metrics.jsonl)" + (f"; second half at W'={to}" if to else "")
    )
    print(
        f"{'W':>2} {'S':>3} {'baseline_s':>10} {'resume_s':>9} {'ratio':>6} {'base_steps_s':>12} {'rt_steps_s':>10} "
        f"{'rt_s/step':>9} {'rt_s/step/rank':>14}"
    )
    for w in (int(x) for x in args.world_sizes.split(",")):
        steps = args.steps or default_steps(w, to)
        base_t, rt_t, base_steps, rt_steps = [], [], [], []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(tmp) / "demo" / "exp"
                t0 = time.perf_counter()
                run_phases([TrainConfig(run_dir=str(run), world_size=w, steps=steps, save_every=0)])
                base_t.append(time.perf_counter() - t0)
                base_steps.append(sum(r["time_s"] for r in metrics_of(run)))
                keep = Path(tmp) / "rt"
                t0 = time.perf_counter()
                report = run_resume_test(ResumeTestSpec(world_size=w, steps=steps, resume_world_size=to, keep=keep))
                rt_t.append(time.perf_counter() - t0)
                assert report.equivalent, report.summary()
                rt_steps.append(sum(r["time_s"] for r in report.straight + report.resumed))
        b, r = statistics.median(base_t), statistics.median(rt_t)
        per_step = r / (2 * steps)
        print(
            f"{w:>2} {steps:>3} {b:>10.1f} {r:>9.1f} {r / b:>6.2f} {statistics.median(base_steps):>12.2f} "
            f"{statistics.median(rt_steps):>10.2f} {per_step:>9.2f} {per_step / w:>14.2f}"
        )


if __name__ == "__main__":
    main()
