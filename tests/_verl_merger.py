"""verl 0.9.1's own Megatron model merger (`python -m verl.model_merger merge --backend megatron`), run on CPU.

Each run applies the stubs below, then runs the merger's own `main()` with `merge --backend megatron --local_dir
STEP/actor --target_dir OUT [...]`, as the merger runs without torchrun: one process, WORLD_SIZE=1, its own
MASTER_ADDR/PORT. The merger builds the model at TP=1 and megatron-core's
`dist_checkpointing.load` reshards the TP=2 / EP=2 trees into it.

Stubbed, each because a CPU-only process cannot do it, and nothing else (the merger's naming, QKV / gate-up splits,
`--tie-word-embedding` handling and `save_pretrained` run as shipped):
- verl's platform layer knows CUDA, NPU and ROCm only and falls back to "nvidia" on a CPU box, so
  `get_nccl_backend()` says "nccl", which CPU torch is not built with: gloo instead.
- `get_torch_device().set_device("cuda:0")` and `model_parallel_cuda_manual_seed(0)` (megatron-core seeds its CUDA
  RNG tracker with `torch.cuda.get_rng_state`) raise "Torch not compiled with CUDA enabled": no-ops (the weights come
  from the checkpoint; no forward runs).
- megatron-core's MoE alltoall token dispatcher creates a `torch.cuda.Stream()` in its constructor (used only in
  its forward): None.
- Transformer Engine is CUDA only (not installed): verl's model initializer asks megatron-core for its TE layer spec
  (`NameError: TENorm`), and its config converter sets options only TE implements (`persist_layer_norm`; MoE experts
  as grouped GEMM). megatron-core's local spec (sequential experts, plain norms) is what the trees were written with,
  and it saves and loads the same dist_ckpt keys (docs/megatron.md); the merger builds it instead.

`merge_cases(dst, mgx)` runs the merger on copies of the cached export trees (tests/_verl_megatron_export.py), one
run per case of CASES, each in its own process: the step copied to `dst/<case>/exp/global_step_1`, the base
model's config.json and a one-word tokenizer put in `actor/model/huggingface/` (the merger reads both from there, as
verl saves them when the run has a tokenizer), the output in `dst/<case>/hf`, the merger's exit status and last error
line in `dst/results.json`. One runner process imports torch, megatron-core and verl and applies the stubs once, then
forks a child per case that runs the merger's `main()` (the imports are most of a run's time on CPU).

Run as: python tests/_verl_merger.py CASES.json   ([[argv, stderr file], ...]; prints one exit status per case)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

STEP = "global_step_1"
# case -> (export tree, merger flags, how the step is laid out)
CASES = {
    "qwen2-tied": ("qwen2-tied", ["--tie-word-embedding"], "v2"),
    "qwen2-tied-no-flag": ("qwen2-tied", [], "v2"),  # the flag left out on a tied model
    "llama-untied": ("llama-untied", [], "v2"),
    "llama-untied-tie-flag": ("llama-untied", ["--tie-word-embedding"], "v2"),  # the flag given on an untied model
    "qwen3moe": ("qwen3moe", [], "v2"),
    "llama-pp2": ("llama-pp2", [], "v2"),  # saved with pipeline parallelism 2, merged at 1
    # verl <= 0.8's layout (dist_ckpt/ and huggingface/ under the role), and the same with huggingface/ moved by
    # hand to model/huggingface/, where the merger looks for the config
    "old-layout": ("qwen2-tied", ["--tie-word-embedding"], "old"),
    "old-layout-hf-moved": ("qwen2-tied", ["--tie-word-embedding"], "old-hf-moved"),
}


def _stub() -> None:
    import torch
    import verl.model_merger.megatron_model_merger as mm
    import verl.models.mcore.model_initializer as mi

    mm.get_nccl_backend = lambda: "gloo"  # the platform fallback says "nccl"; CPU torch has gloo only
    torch.cuda.set_device = lambda *a, **k: None  # set_device("cuda:0"): no CUDA device to select
    mm.model_parallel_cuda_manual_seed = lambda *a, **k: None  # seeds CUDA RNG states; weights come from the ckpt
    torch.cuda.Stream = lambda *a, **k: None  # made by the MoE dispatcher's constructor, used only in forward
    # Transformer Engine (CUDA only) is absent: megatron-core's local spec, as the trees were written
    te_spec = mi.get_gpt_decoder_block_spec

    def local_spec(config, use_transformer_engine, **kwargs):
        return te_spec(config, use_transformer_engine=False, normalization="RMSNorm", **kwargs)

    mi.get_gpt_decoder_block_spec = local_spec
    convert = mm.hf_to_mcore_config

    def without_te_options(*args, **kwargs):  # what verl's converter sets for TE: its fused norm, grouped GEMM
        config = convert(*args, **kwargs)
        config.persist_layer_norm = False
        config.moe_grouped_gemm = False
        return config

    mm.hf_to_mcore_config = without_te_options


def _prepare(mgx: Path, tree: str, layout: str, run: Path) -> Path:
    """The step copied under `run`, with the config and a tokenizer where the merger reads them; its actor dir."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(mgx / tree / "exp" / STEP, run / STEP)
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    actor = run / STEP / "actor"
    if layout != "v2":  # as tests/test_export_megatron.py's pre-v2 tree
        (actor / "model" / "dist_ckpt").rename(actor / "dist_ckpt")
        for d in ("model", "extra", "optimizer"):
            shutil.rmtree(actor / d)
        (actor / "ckpt_contents.json").unlink()
    hf = actor / ("huggingface" if layout == "old" else "model/huggingface")
    hf.mkdir(parents=True, exist_ok=True)
    shutil.copy(mgx / tree / "base_model" / "config.json", hf / "config.json")
    words = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(str(hf))
    return actor


def merge_cases(dst: Path, mgx: Path) -> None:
    runs = []
    for case, (tree, flags, layout) in CASES.items():
        actor = _prepare(mgx, tree, layout, dst / case / "exp")
        argv = ["merge", "--backend", "megatron", "--use_cpu_initialization"]
        argv += ["--local_dir", str(actor), "--target_dir", str(dst / case / "hf"), *flags]
        runs.append([argv, str(dst / f"{case}.stderr")])
    spec = dst / "cases.json"
    spec.write_text(json.dumps(runs))
    proc = subprocess.run([sys.executable, __file__, str(spec)], capture_output=True, text=True, timeout=1200)
    codes = [int(line) for line in proc.stdout.split()]
    assert len(codes) == len(runs), proc.stderr[-3000:]
    results = {}
    for case, (_argv, err), rc in zip(CASES, runs, codes):
        stderr = Path(err).read_text(errors="replace")
        errors = [ln for ln in stderr.splitlines() if "Error" in ln or "Exception" in ln]
        results[case] = {"rc": rc, "error": errors[-1].removeprefix("[rank0]: ") if errors else ""}
        Path(err).unlink()
    spec.unlink()
    (dst / "results.json").write_text(json.dumps(results, indent=2))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_case(argv: list[str], stderr: str) -> int:
    """The merger's `main()` with `argv` in a forked child, as `python -m verl.model_merger ARGV` would run it
    without torchrun: its exit status, its stderr in the file `stderr`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
            fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.dup2(fd, 1)  # the merger's prints: kept out of the runner's stdout, which carries the statuses
            sys.argv = ["verl.model_merger", *argv]
            from verl.model_merger.__main__ import main

            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes "[rank0]: ", as in a plain run
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")  # apex / Transformer Engine absent: megatron-core warns on every import
    _stub()
    for argv, stderr in json.loads(Path(sys.argv[1]).read_text()):
        print(_run_case(argv, stderr), flush=True)
