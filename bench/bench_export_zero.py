"""Time and peak memory of `ckpt-audit export` of a DeepSpeed ZeRO checkpoint, against `cp` of the same bytes and
DeepSpeed's own converter, as ratios from one run.

The checkpoints are written by DeepSpeed itself (CPU accelerator, gloo, W ranks, torch's AdamW, one training step
so the optimizer shards hold exp_avg and exp_avg_sq beside the fp32 partition): a stack of Linear layers of about
--mb MiB of fp32 master weights, ZeRO-2 with bf16 and ZeRO-3 in fp32, and a ZeRO-2 one 4x as large.

Variants, each a fresh process timed whole from outside (interpreter start and imports included):
`zero2`/`zero3`: `export_checkpoint(save_dir, weights="fp32")` (no torch: the fp32 partitions' byte ranges copied
in blocks, every file the export reads re-read in full by the source check beside the copy, the output read back);
`zero2-module`: `--weights module`; `cp`/`cp3`: every file the fp32 export of the ZeRO-2/ZeRO-3 checkpoint reads
(model and optimizer states) copied to the same disk and fsynced, the floor for reading that many bytes and
writing them; `zero_to_fp32`: DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict` (safetensors);
`zero2-4x`: the 4x checkpoint, whose peak RSS must stay the 1x one's (flat memory). Memory is the child's peak
RSS (VmHWM). Runs are warm (page cache), variants alternate, median of --repeat.

Goals (issue 29): zero export <= 2x cp of the bytes it reads; 4x model's peak RSS within 10% of the 1x one's.

Usage: python bench/bench_export_zero.py [--mb 200] [--world-size 2] [--repeat 3] [--no-large] [--only zero2,cp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WIDTH = 1024 + 3  # not divisible by 2 x W: ZeRO-2 alignment and ZeRO-3 partition padding


def write_rank(dest: str, stage: int, mb: int, bf16: bool) -> None:
    """One rank of the DeepSpeed run (started by torch.distributed.run, see make_checkpoint)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # as the test writers: no JIT build
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = max(1, mb * 2**20 // (WIDTH * WIDTH * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "bf16": {"enabled": bf16},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng = deepspeed.initialize(model=model, optimizer=opt, config=config)[0]
    x = torch.randn(1, WIDTH, dtype=torch.bfloat16 if bf16 else torch.float32)
    eng.backward(eng(x).float().pow(2).mean())
    eng.step()
    eng.save_checkpoint(dest)


def make_checkpoint(dest: Path, stage: int, mb: int, world: int, bf16: bool) -> Path:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port)]
    args = ["--write", str(dest), str(stage), str(mb), "1" if bf16 else "0"]
    subprocess.run([*run, __file__, *args], check=True, env=env, capture_output=True)
    return dest


# ---------------------------------------------------------------------------------------------------- children


def child(variant: str, save_dir: str, out: str) -> None:
    if variant in ("zero2", "zero3", "zero2-4x", "zero2-module"):
        from ckpt_audit.export.orchestrator import export_checkpoint

        weights = "module" if variant == "zero2-module" else "fp32"
        export_checkpoint(save_dir, out, weights=weights, allow_unverified=True)  # no config.json: not a model dir
        assert "torch" not in sys.modules, "the ZeRO export imported torch"
    elif variant in ("cp", "cp3"):
        Path(out).mkdir(parents=True)
        files = [str(p) for p in _read_files(Path(save_dir))]
        subprocess.run(["cp", *files, out], check=True)
        subprocess.run(["sync", *(str(Path(out) / Path(p).name) for p in files)], check=True)  # as export fsyncs
    elif variant == "zero_to_fp32":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, safe_serialization=True)
    else:
        raise SystemExit(f"unknown variant {variant}")
    print(json.dumps({"variant": variant, "peak_mib": _peak_rss_kib() / 1024}))


def _read_files(save_dir: Path) -> list[Path]:
    from ckpt_audit.export.sources import export_input

    return export_input(Path(save_dir).resolve(), "actor", None, "auto").zero.read("fp32")


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def run_child(variant: str, save_dir: Path, out: Path, env: dict[str, str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(save_dir), str(out)], capture_output=True, text=True, env=env
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed: {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200, help="approximate fp32 master weights, MiB")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-large", action="store_true", help="skip the 4x checkpoint (flat-memory check)")
    ap.add_argument("--only", help="comma-separated variants to run (default: all)")
    ap.add_argument("--write", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "SAVE_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write:
        dest, stage, mb, bf16 = args.write
        write_rank(dest, int(stage), int(mb), bf16 == "1")
        return
    if args.child:
        child(*args.child)
        return

    tmp = Path(tempfile.mkdtemp(prefix="bench-export-zero-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        w = args.world_size
        trees = {
            "zero2": make_checkpoint(tmp / "z2", 2, args.mb, w, bf16=True),
            "zero3": make_checkpoint(tmp / "z3", 3, args.mb, w, bf16=False),
        }
        trees["zero2-module"] = trees["cp"] = trees["zero_to_fp32"] = trees["zero2"]
        trees["cp3"] = trees["zero3"]
        if not args.no_large:
            trees["zero2-4x"] = make_checkpoint(tmp / "z2x4", 2, 4 * args.mb, w, bf16=True)
        for name in ("zero2", "zero3", "zero2-4x"):
            if name in trees:
                size = sum(p.stat().st_size for p in _read_files(trees[name]))
                print(f"{name}: {size / 2**20:.0f} MiB read by the fp32 export ({w} ranks)")
        variants = [
            v for v in ("cp", "zero2", "zero2-module", "cp3", "zero3", "zero_to_fp32", "zero2-4x") if v in trees
        ]
        if args.only:
            variants = [v for v in variants if v in args.only.split(",")]
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for i in range(1 + args.repeat):  # a first round warms the page cache and bytecode: not counted
            for v in variants:
                got = run_child(v, trees[v], tmp / f"out-{v}", env)
                if i:
                    results[v].append(got)
        med = {
            v: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_mib")} for v, rs in results.items()
        }
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"{'variant':<14} {'wall s':>8} {'peak RSS MiB':>13}")
        for v in variants:
            print(f"{v:<14} {med[v]['seconds']:>8.2f} {med[v]['peak_mib']:>13.0f}")
        print()
        if (z := med.get("zero2")) and (c := med.get("cp")):
            print(f"zero2/cp: wall {z['seconds'] / c['seconds']:.2f}x (goal <= 2)")
            if (z3 := med.get("zero3")) and (c3 := med.get("cp3")):
                print(f"zero3/cp3: wall {z3['seconds'] / c3['seconds']:.2f}x (goal <= 2)")
            if d := med.get("zero_to_fp32"):
                wall, peak = z["seconds"] / d["seconds"], z["peak_mib"] / d["peak_mib"]
                print(f"zero2/zero_to_fp32: wall {wall:.2f}x, peak RSS {peak:.2f}x")
        if (z := med.get("zero2")) and (b := med.get("zero2-4x")):
            print(f"zero2 4x model / 1x: peak RSS {b['peak_mib'] / z['peak_mib']:.2f}x (goal within 10%)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
