"""Time and peak memory of `ckpt-audit export` against an in-memory merge and `cp`, as ratios from one run.

Baselines measured in the same run: `merge` is what verl's model merger does (torch.load every rank file fully,
torch.cat every tensor into one state dict in memory, save it with safetensors); `cp` copies the model shards to the
same disk and fsyncs them (the physical floor for reading and writing that many bytes). Ours: the default stream
engine (no torch: bytes copied from the shards' zip entries in 1 MiB blocks, CRC-checked, hashed and read back in
bounded chunks; then checked as a model and, where transformers is installed, loaded by transformers in a child
process, whose peak RSS is shown beside the export's), the same without that load (`stream-no-load`: --max-load-size
0) and with --no-verify, the torch engine (the oracle), and `source-check` alone (the re-read
of every source file that every export starts with). `stream-jobs1` / `stream-jobs2`: the export cut into about 4
output shards, written and read back by one process or by two workers (--jobs 2), no transformers load; their wall
ratio is printed. A second checkpoint 4x as large is exported by the stream
engine too: its peak RSS must stay the small one's (constant memory).

Each variant is a fresh process, timed whole from outside (interpreter start and imports included: what a cron job
pays). Memory is the child's peak RSS (VmHWM), which counts anonymous memory and file pages mapped into the
process, so the stream engine reads sources with pread (a cast: through mappings whose pages it drops after each
block). The checkpoint is synthetic but real: W ranks write DTensor shards (Shard(0) and Shard(1), uneven) with
torch.save from a gloo process group. Runs are warm (page cache), variants alternate, median of --repeat.

Goals (issue 16): stream/merge wall <= 0.3x and peak RSS <= 0.15x; stream <= 2x cp; 4x model's peak RSS within 10%.

Modules load from compiled bytecode, as in an installed package (pip writes .pyc files at install): children run
with PYTHONDONTWRITEBYTECODE unset and a private PYTHONPYCACHEPREFIX, warmed by one discarded round of every variant.
Where the environment sets PYTHONDONTWRITEBYTECODE (the development VM does), every child would otherwise compile
each module from source (~0.1-0.2 s of an export); `--no-bytecode` measures that case. CPU is user+sys of the child
and what it waited for (cp, sync), from RUSAGE_CHILDREN: on a shared box the steadier figure.

`--before DIR` adds a `stream-before` variant: the same export with DIR (a copy of the package from another commit,
e.g. `git archive HEAD~3 ckpt_audit | tar -x -C DIR`) first on PYTHONPATH, interleaved with `stream` in every round.

Usage: python bench/bench_export.py [--mb 400] [--world-size 2] [--repeat 3] [--no-large] [--no-bytecode]
       [--step DIR] [--only stream,cp,stream-jobs1,stream-jobs2] [--before DIR] [--dim0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN = 1024
VOCAB = 8192 + 7  # not divisible by W: uneven shards


PER_LAYER = (
    ("self_attn.q_proj.weight", (HIDDEN, HIDDEN), 0),
    ("self_attn.k_proj.weight", (HIDDEN // 4, HIDDEN), 1),
    ("self_attn.v_proj.weight", (HIDDEN // 4, HIDDEN), 0),
    ("self_attn.o_proj.weight", (HIDDEN, HIDDEN), 0),
    ("mlp.gate_proj.weight", (HIDDEN * 3, HIDDEN), 0),
    ("mlp.up_proj.weight", (HIDDEN * 3, HIDDEN), 0),
    ("mlp.down_proj.weight", (HIDDEN, HIDDEN * 3), 1),
    ("input_layernorm.weight", (HIDDEN,), 0),
    ("post_attention_layernorm.weight", (HIDDEN,), 0),
)


def _layout(total_mb: int, dim0: bool = False) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, global shape, shard dim) of a Llama model (every tensor its config implies, so the export's model check
    passes): an embedding, per-layer attention, MLP and norms, an untied lm_head. `dim0`: every tensor Shard(0), as
    FSDP2's fully_shard saves them (the default mixes in Shard(1) to exercise the row gather)."""
    out: list[tuple[str, tuple[int, ...], int]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN), 0)]
    for i in range(_layers(total_mb)):
        out += [(f"model.layers.{i}.{n}", s, d) for n, s, d in PER_LAYER]
    out += [("model.norm.weight", (HIDDEN,), 0), ("lm_head.weight", (VOCAB, HIDDEN), 0)]
    return [(n, s, 0) for n, s, _d in out] if dim0 else out


def _layers(total_mb: int) -> int:
    layer_bytes = sum(math.prod(s) for _, s, _ in PER_LAYER) * 4
    return max(1, (total_mb * 2**20 - 2 * VOCAB * HIDDEN * 4) // layer_bytes)


def _config(total_mb: int) -> dict:
    """The Llama config that `_layout` is (head_dim 128, grouped-query attention with 2 key/value heads)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 3 * HIDDEN,
        "num_hidden_layers": _layers(total_mb),
        "num_attention_heads": HIDDEN // 128,
        "num_key_value_heads": HIDDEN // 4 // 128,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def _write_rank(rank: int, world: int, actor: str, total_mb: int, port: int, dim0: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    sd = {}
    for i, (name, shape, dim) in enumerate(_layout(total_mb, dim0)):
        full = shape[dim]
        chunk = -(-full // world)
        n = max(0, min(chunk, full - rank * chunk))
        local_shape = list(shape)
        local_shape[dim] = n
        g = torch.Generator().manual_seed(i * 100 + rank)
        local = torch.randn(local_shape, generator=g)
        sd[name] = DTensor.from_local(
            local,
            mesh,
            [Shard(dim)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    torch.save(sd, f"{actor}/model_world_size_{world}_rank_{rank}.pt")
    dist.destroy_process_group()


def make_checkpoint(root: Path, total_mb: int, world: int, dim0: bool = False) -> Path:
    import torch.multiprocessing as mp

    step = root / "global_step_1"
    actor = step / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text(json.dumps(_config(total_mb)))
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
    mp.spawn(_write_rank, args=(world, str(actor), total_mb, 29000 + os.getpid() % 1000, dim0), nprocs=world)
    return step


# ---------------------------------------------------------------------------------------------------- children


def child(variant: str, step: str, out: str) -> None:
    if variant in ("merge", "torch", "import-torch"):
        import torch  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
    if variant == "import-torch":
        pass
    elif variant in ("stream", "stream-no-load", "stream-no-verify", "stream-4x", "torch"):
        from ckpt_audit.export.orchestrator import export_checkpoint

        engine = "torch" if variant == "torch" else "stream"
        load = {"max_load_size": 0} if variant == "stream-no-load" else {}  # the default: transformers' load too
        export_checkpoint(step, out, verify=variant != "stream-no-verify", engine=engine, **load)
        if engine == "stream":
            assert "torch" not in sys.modules, "the stream engine imported torch"
    elif variant in ("stream-jobs1", "stream-jobs2"):  # about 4 output shards, written by 1 or 2 processes
        from ckpt_audit.export.orchestrator import export_checkpoint

        shard = _shard_bytes(Path(step)) // 4 + 1
        export_checkpoint(step, out, max_load_size=0, max_shard_size=shard, jobs=int(variant[-1]))
    elif variant == "merge":
        _verl_style(Path(step) / "actor", Path(out))
    elif variant == "cp":
        Path(out).mkdir(parents=True)
        shards = sorted((Path(step) / "actor").glob("model_world_size_*.pt"))
        subprocess.run(["cp", *map(str, shards), out], check=True)
        subprocess.run(["sync", *(str(Path(out) / p.name) for p in shards)], check=True)  # as export fsyncs
    elif variant == "source-check":
        from ckpt_audit.export.guard import check_source
        from ckpt_audit.export.sources import export_input, files_to_read

        inp = export_input(Path(step).resolve(), "actor", None, "auto")
        check_source(files_to_read(inp, inp.hf_dir), manifest={}, status=None)
    else:
        raise SystemExit(f"unknown variant {variant}")
    # a child process of the export: transformers' load (export/transformers_load.py), where it ran
    load_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"variant": variant, "peak_mib": _peak_rss_kib() / 1024, "load_peak_mib": load_mib}))


def _peak_rss_kib() -> int:
    """This process image's peak RSS (VmHWM). Not ru_maxrss: Linux keeps that across exec, so a child forked from
    this bench (which imported torch to write the checkpoint) would report the parent's size."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _verl_style(actor: Path, out: Path) -> None:
    """Load all shards, merge everything in memory, then save: verl/model_merger/fsdp_model_merger.py's shape."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    world = int(json.loads((actor / "fsdp_config.json").read_text())["world_size"])
    states = [
        torch.load(actor / f"model_world_size_{world}_rank_{r}.pt", weights_only=True, map_location="cpu")
        for r in range(world)
    ]
    merged = {}
    for key in states[0]:
        pieces = [s[key]._local_tensor if isinstance(s[key], DTensor) else s[key] for s in states]
        placement = states[0][key].placements[0] if isinstance(states[0][key], DTensor) else None
        merged[key] = torch.cat(pieces, dim=placement.dim if placement is not None else 0)
    out.mkdir(parents=True)
    save_file(merged, str(out / "model.safetensors"))


def run_child(variant: str, step: Path, out: Path, env: dict[str, str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant.removesuffix("-before"), str(step), str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child and what it waited for (cp, sync)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed: {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "seconds": seconds, "cpu": cpu}


def _shard_bytes(step: Path) -> int:
    return sum(p.stat().st_size for p in (step / "actor").glob("model_*.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=400, help="approximate checkpoint size (fp32 model weights)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-large", action="store_true", help="skip the 4x checkpoint (constant-memory check)")
    ap.add_argument("--dim0", action="store_true", help="every tensor Shard(0), as FSDP2 saves them")
    ap.add_argument("--no-bytecode", action="store_true", help="compile from source in every child (no .pyc)")
    ap.add_argument("--step", type=Path, help="export this existing step directory instead of writing one")
    ap.add_argument("--only", help="comma-separated variants to run (default: all)")
    ap.add_argument("--before", type=Path, help="a package tree to compare with, put first on PYTHONPATH")
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "STEP", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return

    tmp = Path(tempfile.mkdtemp(prefix="bench-export-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.no_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    try:
        step = args.step.resolve() if args.step else make_checkpoint(tmp / "ckpt", args.mb, args.world_size, args.dim0)
        big = (
            None
            if args.no_large or args.step
            else make_checkpoint(tmp / "ckpt4x", 4 * args.mb, args.world_size, args.dim0)
        )
        size = _shard_bytes(step)
        print(
            f"checkpoint: {size / 2**20:.0f} MiB in {len(list((step / 'actor').glob('model_*.pt')))} rank files"
            + ("" if args.step else f", {len(_layout(args.mb))} tensors, largest {_largest(args.mb) / 2**20:.1f} MiB")
            + ("" if big is None else f"; 4x: {_shard_bytes(big) / 2**20:.0f} MiB")
        )
        variants = ["import-torch", "merge", "cp", "stream", "stream-no-load", "stream-no-verify", "torch"]
        variants += ["source-check", "stream-jobs1", "stream-jobs2"]
        if big is not None:
            variants.append("stream-4x")
        if args.before:
            variants.insert(variants.index("stream"), "stream-before")
        if args.only:
            variants = [v for v in variants if v in args.only.split(",")]
        envs = {v: env for v in variants}
        if args.before:
            path = [str(args.before.resolve()), *filter(None, [env.get("PYTHONPATH")])]
            envs["stream-before"] = {**env, "PYTHONPATH": os.pathsep.join(path)}
        results: dict[str, list[dict]] = {v: [] for v in variants}
        warm = 0 if args.no_bytecode else 1  # a first round writes the bytecode: not counted
        for i in range(warm + args.repeat):
            for v in variants:  # alternate so drift hits every variant alike
                got = run_child(v, big if v == "stream-4x" else step, tmp / f"out-{v}", envs[v])
                if i >= warm:
                    results[v].append(got)
        med = {
            v: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "cpu", "peak_mib", "load_peak_mib")}
            for v, rs in results.items()
        }
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"{'variant':<18} {'wall s':>8} {'CPU s':>7} {'peak RSS MiB':>13} {'its load child':>15}")
        for v in variants:
            m = med[v]
            load = f"{m['load_peak_mib']:>15.0f}" if v.startswith("stream") and m["load_peak_mib"] else ""
            print(f"{v:<18} {m['seconds']:>8.2f} {m['cpu']:>7.2f} {m['peak_mib']:>13.0f} {load}")
        _ratios(med, big is not None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _largest(mb: int) -> int:
    return max(math.prod(s) for _, s, _ in _layout(mb)) * 4


def _ratios(med: dict[str, dict[str, float]], big: bool) -> None:
    print()
    if (j1 := med.get("stream-jobs1")) and (j2 := med.get("stream-jobs2")):
        print(
            f"--jobs 2 / --jobs 1 (about 4 shards, no transformers load): wall {j2['seconds'] / j1['seconds']:.2f}x "
            f"on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        )
    s = med.get("stream")
    if s is None:
        return
    if m := med.get("merge"):
        print(
            f"stream/merge: wall {s['seconds'] / m['seconds']:.2f}x (goal <= 0.3), "
            f"peak RSS {s['peak_mib'] / m['peak_mib']:.2f}x (goal <= 0.15)"
        )
    if c := med.get("cp"):
        print(f"stream/cp: wall {s['seconds'] / c['seconds']:.2f}x (goal <= 2), CPU {s['cpu'] / c['cpu']:.2f}x")
        if b := med.get("stream-before"):
            print(f"stream-before/cp: wall {b['seconds'] / c['seconds']:.2f}x, CPU {b['cpu'] / c['cpu']:.2f}x")
        if nv := med.get("stream-no-verify"):
            print(f"stream-no-verify/cp: wall {nv['seconds'] / c['seconds']:.2f}x")
    if nl := med.get("stream-no-load"):
        print(f"stream/stream-no-load (transformers' load): wall {s['seconds'] / nl['seconds']:.2f}x")
    if b := med.get("stream-before"):
        print(f"stream/stream-before: wall {s['seconds'] / b['seconds']:.2f}x, CPU {s['cpu'] / b['cpu']:.2f}x")
    if (t := med.get("torch")) and (m := med.get("merge")):
        print(
            f"torch engine/merge: wall {t['seconds'] / m['seconds']:.2f}x, "
            f"peak RSS {t['peak_mib'] / m['peak_mib']:.2f}x"
        )
    if sc := med.get("source-check"):
        print(f"source-check/stream: wall {sc['seconds'] / s['seconds']:.2f}x")
    if big and (b := med.get("stream-4x")):
        print(
            f"stream 4x model / 1x: peak RSS {b['peak_mib'] / s['peak_mib']:.2f}x (goal within 10%), "
            f"wall {b['seconds'] / s['seconds']:.2f}x"
        )


if __name__ == "__main__":
    main()
