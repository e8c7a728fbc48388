"""verl 0.9.1's own Megatron model merger (`python -m verl.model_merger merge --backend megatron`), run on CPU.

`python tests/_verl_merger.py merge --backend megatron --local_dir STEP/actor --target_dir OUT [...]` applies the stubs
below in this process, then runs the merger's own `main()` with those arguments. It runs as the merger does without
torchrun: one process, WORLD_SIZE=1, its own MASTER_ADDR/PORT. The merger builds the model at TP=1 and megatron-core's
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
run per case of CASES, each in its own subprocess: the step copied to `dst/<case>/exp/global_step_1`, the base
model's config.json and a one-word tokenizer put in `actor/model/huggingface/` (the merger reads both from there, as
verl saves them when the run has a tokenizer), the output in `dst/<case>/hf`, the merger's exit status and last error
line in `dst/results.json`.
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
    results = {}
    for case, (tree, flags, layout) in CASES.items():
        actor = _prepare(mgx, tree, layout, dst / case / "exp")
        cmd = [sys.executable, __file__, "merge", "--backend", "megatron", "--use_cpu_initialization"]
        cmd += ["--local_dir", str(actor), "--target_dir", str(dst / case / "hf"), *flags]
        env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(_free_port())
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "Exception" in ln]
        results[case] = {"rc": proc.returncode, "error": errors[-1].removeprefix("[rank0]: ") if errors else ""}
    (dst / "results.json").write_text(json.dumps(results, indent=2))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")  # apex / Transformer Engine absent: megatron-core warns on every import
    _stub()
    from verl.model_merger.__main__ import main

    main()
