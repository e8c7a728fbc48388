"""Time and peak memory of `ckpt-audit export` of a Megatron dist_ckpt, against `cp` of its shards, from one run.

The checkpoint is real: two gloo CPU processes build a Llama-shaped megatron-core GPTModel (GQA, SwiGLU, RMSNorm,
untied head; local layer spec) with tensor parallelism 2 and save its sharded state dict with megatron-core's
`dist_checkpointing.save` (torch_dist, fully parallel: what verl's manager calls) to
`global_step_1/actor/model/dist_ckpt`, with the HF config in `model/huggingface`. `cp` copies the `.distcp` files to
the same disk and syncs them (the floor for reading and writing that many bytes). Ours: `stream` (the default export:
source check, copy, read-back, config check, transformers' load in a child process up to --max-load-size),
`stream-no-load` (--max-load-size 0: the copy and its checks only) and `stream-no-verify`. A second checkpoint with
4x the layers is exported too: the export's peak RSS must stay the small one's (constant memory). 5 layers by default:
each `.distcp` is then over 64 MiB, the size above which the source check hashes through a mapping (a fixed window
of mapped pages), as it does for the 4x model's, so the two peaks compare like with like.

Each variant is a fresh process timed whole from outside; memory is the child's VmHWM (anonymous memory and mapped
file pages). Runs are warm (page cache), variants alternate, median of --repeat. Children load compiled bytecode (an
installed package's case: PYTHONDONTWRITEBYTECODE is dropped). `--before DIR` adds the same no-load exports by the
package in DIR (e.g. `git archive HEAD~1 ckpt_audit | tar -x -C DIR`), interleaved.

Goals (issue 28): stream-no-load <= 2x cp; the 4x model's peak RSS within 10% of the small one's.

Usage: python bench/bench_export_megatron.py [--layers 5] [--hidden 1024] [--repeat 3] [--no-large] [--keep DIR]
       [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 8192
HEADS, GROUPS = 16, 4


def _config(layers: int, hidden: int) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": hidden // HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _write_rank(rank: int, world: int, actor: str, layers: int, hidden: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core's save finalize calls both; CPU-only torch
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    c = _config(layers, hidden)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        bias_activation_fusion=False,
        tensor_model_parallel_size=world,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
    dist_dir = Path(actor) / "model" / "dist_ckpt"
    if rank == 0:
        dist_dir.mkdir(parents=True)
        (dist_dir.parent / "huggingface").mkdir()
        (dist_dir.parent / "huggingface" / "config.json").write_text(json.dumps(c, indent=2))
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), ps.get_data_parallel_group(with_context_parallel=True)
    )
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), str(dist_dir), sharded_strategy=strategy)
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(root: Path, layers: int, hidden: int) -> Path:
    import torch.multiprocessing as mp

    actor = root / "run" / "global_step_1" / "actor"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_write_rank, args=(2, str(actor), layers, hidden, port), nprocs=2, start_method="spawn")
    settled = time.time() - 3600  # as exports meet them: the source check reads files younger than 2 min with read()
    for f in actor.rglob("*"):
        os.utime(f, (settled, settled))
    return actor.parent


def child(variant: str, step: str, out: str) -> None:
    if variant.startswith("stream"):
        from ckpt_audit.export.orchestrator import export_checkpoint

        load = {"max_load_size": 0} if variant in ("stream-no-load", "stream-4x") else {}
        r = export_checkpoint(step, out, verify=variant != "stream-no-verify", engine="stream", **load)
        assert r.source_kind == "megatron-dist-ckpt" and "torch" not in sys.modules
    elif variant == "cp":
        Path(out).mkdir(parents=True)
        shards = sorted(_dist(Path(step)).glob("*.distcp"))
        subprocess.run(["cp", *map(str, shards), out], check=True)
        subprocess.run(["sync", *(str(Path(out) / p.name) for p in shards)], check=True)  # as export fsyncs
    else:
        raise SystemExit(f"unknown variant {variant}")
    print(json.dumps({"variant": variant, "peak_mib": _peak_rss_kib() / 1024}))


def _dist(step: Path) -> Path:
    return step / "actor" / "model" / "dist_ckpt"


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_child(variant: str, step: Path, out: Path, env: dict) -> dict:
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
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed: {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "seconds": seconds, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-large", action="store_true")
    ap.add_argument("--keep", type=Path, help="write (or reuse) the checkpoints here")
    ap.add_argument("--before", type=Path, help="a package tree to compare with, put first on PYTHONPATH")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-mgx-"))
    small = root / "small"
    if not (small / "run").exists():
        make_checkpoint(small, args.layers, args.hidden)
    steps = {"": small / "run" / "global_step_1"}
    if not args.no_large:
        large = root / "large"
        if not (large / "run").exists():
            make_checkpoint(large, args.layers * 4, args.hidden)
        steps["-4x"] = large / "run" / "global_step_1"
    sizes = {k: sum(p.stat().st_size for p in _dist(s).glob("*.distcp")) for k, s in steps.items()}
    print(
        f"checkpoint: {sizes[''] / 2**20:.0f} MiB of .distcp"
        + (f"; 4x: {sizes['-4x'] / 2**20:.0f} MiB" if "-4x" in sizes else "")
    )
    variants = [("cp", ""), ("stream", ""), ("stream-no-load", ""), ("stream-no-verify", "")]
    if "-4x" in steps:
        variants += [("cp", "-4x"), ("stream-4x", "-4x")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # .pyc, as an installed package
    envs = {}
    if args.before:  # the same exports by another checkout's package, interleaved
        variants.insert(variants.index(("stream-no-load", "")) + 1, ("stream-no-load-before", ""))
        if "-4x" in steps:
            variants.append(("stream-4x-before", "-4x"))
        path = [str(args.before.resolve()), *filter(None, [env.get("PYTHONPATH")])]
        envs = {v: {**env, "PYTHONPATH": os.pathsep.join(path)} for v in ("stream-no-load-before", "stream-4x-before")}
    runs: dict[str, list[dict]] = {}
    out = root / "out"
    for _ in range(args.repeat):
        for variant, size in variants:
            name = variant if variant.startswith("stream-4x") else variant + size
            runs.setdefault(name, []).append(run_child(variant, steps[size], out, envs.get(variant, env)))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("seconds", "cpu", "peak_mib")} for k, v in runs.items()}
    for k, m in med.items():
        print(f"{k:22s} wall {m['seconds']:6.2f} s  cpu {m['cpu']:6.2f} s  peak RSS {m['peak_mib']:7.1f} MiB")
    c = med["cp"]
    for k in ("stream", "stream-no-load", "stream-no-verify", "stream-no-load-before"):
        if k in med:
            print(f"{k}/cp: wall {med[k]['seconds'] / c['seconds']:.2f}x, CPU {med[k]['cpu'] / c['cpu']:.2f}x")
    if "stream-4x" in med:
        big, c4 = med["stream-4x"], med["cp-4x"]
        ratio = f"wall {big['seconds'] / c4['seconds']:.2f}x, CPU {big['cpu'] / c4['cpu']:.2f}x"
        print(f"stream-4x/cp-4x: {ratio} (goal <= 2)")
        if b := med.get("stream-4x-before"):
            print(f"stream-4x-before/cp-4x: wall {b['seconds'] / c4['seconds']:.2f}x, CPU {b['cpu'] / c4['cpu']:.2f}x")
        print(f"peak RSS 4x / 1x: {big['peak_mib'] / med['stream-no-load']['peak_mib']:.2f} (goal <= 1.10)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
