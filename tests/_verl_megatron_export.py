"""Megatron trees for export, written by verl 0.9.1's own `MegatronCheckpointManager.save_checkpoint` (layout v2),
with what the trainer held: the reference an export is compared against.

`write_models(root)` spawns two CPU processes (gloo). For each model of MODELS and REFUSED, both build the same tiny
megatron-core `GPTModel` (local layer spec: no Transformer Engine, no apex) shaped like an HF architecture (GQA,
RMSNorm, SwiGLU, RoPE), take two Adam steps on fixed gradients (so norms and biases are not their initial constants)
and save through verl's manager (`save_contents=[model, extra]`, `use_dist_checkpointing=True`, no bridge: verl then
writes no HF config, as in a real run) to `<root>/<model>/exp/global_step_1/actor`. The parallel layout differs per
model: TP=2 (dense), TP=2 with expert parallelism 2 and expert TP 1 (MoE), pipeline parallelism 2 (dense, a layer a
stage). Beside it, `<root>/<model>/base_model/config.json` is the HF config the run was started from (what `export
--hf-config` is given, as verl's merger's `--hf_model_path`).

What the trainer held: each rank's `model.state_dict()` (its TP / EP / PP pieces, megatron-core's own names) goes to
`<root>/<model>/trainer/rank<R>.pt`, and the logits of megatron-core's own forward on TOKENS (TP forward, dense
models only) to `<root>/<model>/trainer/logits.pt`. The test converts the pieces to HF names independently of
ckpt-audit.

Stubbed, as in tests/_verl_megatron_v2.py: `torch.cuda.synchronize` / `torch.cuda.current_device` (megatron-core's
save finalize calls them; tests/_megatron_trees.py's stub). No optimizer is handed to verl's manager (none is saved).

Run as: python tests/_verl_megatron_export.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _megatron_trees as mt  # noqa: E402  (the CUDA stubs, the free port)

WORLD = 2
STEP = 1
TOKENS = [[3, 17, 42, 5, 99, 64, 1, 7, 23, 11]]
VOCAB = 128  # megatron pads nothing: 128 divides by 128 * TP? no: make_vocab_size_divisible_by is the caller's job
# model -> (HF config, megatron extras, tied, tp, ep)
MODELS = {
    "qwen2-tied": dict(arch="qwen2", tied=True, tp=2, ep=1, experts=0),
    "llama-untied": dict(arch="llama", tied=False, tp=2, ep=1, experts=0),
    "qwen3moe": dict(arch="qwen3_moe", tied=False, tp=2, ep=2, experts=4),
    "llama-pp2": dict(arch="llama", tied=False, tp=1, ep=1, experts=0, pp=2),
    # one of each further architecture the export names (megatron_names.FAMILIES), as verl's config converter
    # builds it: Mistral (Llama's names), Qwen3 (qk_layernorm), Qwen2-MoE (qkv bias, shared experts with a
    # sigmoid gate), Mixtral (MoE without shared experts, HF names block_sparse_moe.experts.E.w1/w2/w3)
    "mistral": dict(arch="mistral", tied=False, tp=2, ep=1, experts=0),
    "qwen3-tied": dict(arch="qwen3", tied=True, tp=2, ep=1, experts=0),
    "qwen2moe": dict(arch="qwen2_moe", tied=False, tp=2, ep=2, experts=4),
    "mixtral": dict(arch="mixtral", tied=False, tp=2, ep=2, experts=4),
}
# written, and refused by the export (test_export_megatron's ARCH_REFUSALS): an MoE model with a dense layer
# (megatron-core moe_layer_freq [1, 0], HF mlp_only_layers [1]), which megatron-core saves under per-layer keys
REFUSED = {"qwen3moe-mixed": dict(arch="qwen3_moe", tied=False, tp=2, ep=2, experts=4, moe_freq=[1, 0])}
HIDDEN, FFN, MOE_FFN, HEADS, GROUPS, HEAD_DIM, LAYERS = 32, 64, 24, 4, 2, 8, 2
SHARED_FFN = 40  # Qwen2-MoE's shared expert: its own width, so a mix-up with the routed experts' shows
CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def hf_config(name: str) -> dict:
    m = (MODELS | REFUSED)[name]
    arch = m["arch"]
    cfg = {
        "model_type": arch,
        "architectures": [CLASSES[arch]],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": m["tied"],
        "torch_dtype": "float32",
        "attention_bias": False,
    }
    if arch == "qwen3_moe":
        cfg.update(
            num_experts=m["experts"],
            num_experts_per_tok=2,
            moe_intermediate_size=MOE_FFN,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(m.get("moe_freq", ())) if not moe],
        )
    if arch == "qwen2_moe":
        cfg.update(
            num_experts=m["experts"],
            num_experts_per_tok=2,
            moe_intermediate_size=MOE_FFN,
            shared_expert_intermediate_size=SHARED_FFN,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,
        )
    if arch == "mixtral":
        cfg.update(num_local_experts=m["experts"], num_experts_per_tok=2, intermediate_size=MOE_FFN)
    if arch in ("mistral", "mixtral"):
        cfg.update(sliding_window=None)
    return cfg


def _build(name: str):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    m = (MODELS | REFUSED)[name]
    moe = m["experts"] > 0
    torch.manual_seed(0)
    extra = {}
    if moe:
        extra = dict(
            num_moe_experts=m["experts"],
            moe_router_topk=2,
            moe_ffn_hidden_size=MOE_FFN,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            expert_model_parallel_size=m["ep"],
            expert_tensor_parallel_size=1,
        )
    if m["arch"] == "qwen2_moe":  # verl's hf_to_mcore_config_qwen2moe: a gated shared expert
        extra.update(moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True)
    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        add_qkv_bias=m["arch"] in ("qwen2", "qwen2_moe"),
        qk_layernorm=m["arch"] in ("qwen3", "qwen3_moe"),
        tensor_model_parallel_size=m["tp"],
        pipeline_model_parallel_size=m.get("pp", 1),
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        moe_layer_freq=m.get("moe_freq", 1),
        **extra,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=m["experts"] or None, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm"
    )
    if "moe_freq" in m:  # a spec per layer, dense or MoE as moe_layer_freq says
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=m["tied"],
        pre_process=ps.is_pipeline_first_stage(),  # pipeline parallelism: each stage builds its own layers
        post_process=ps.is_pipeline_last_stage(),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for seed in (1, 2):  # the same gradients on every rank: TP-replicated parameters stay replicas
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return model


def _manager(model):
    import torch
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    return MegatronCheckpointManager(
        config=OmegaConf.create({"model": {"path": "unused"}}),
        checkpoint_config=OmegaConf.create(
            {"save_contents": ["model", "extra"], "load_contents": ["model"], "async_save": False}
        ),
        model_config=None,
        transformer_config=model.config,
        role="actor",
        model=[model],
        arch="GPTModel",
        hf_config=None,
        param_dtype=torch.float32,
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
        processing_class=None,
        optimizer=None,
        optimizer_scheduler=None,
        use_distributed_optimizer=False,
        use_dist_checkpointing=True,
    )


def _rank(rank: int, world: int, root: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    mt._stub_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    for name, m in (MODELS | REFUSED).items():
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=m["tp"],
            pipeline_model_parallel_size=m.get("pp", 1),
            expert_model_parallel_size=m["ep"],
            expert_tensor_parallel_size=1,
        )
        model = _build(name)
        out = Path(root) / name
        mgr = _manager(model)
        mgr.save_checkpoint(str(out / "exp" / f"global_step_{STEP}" / "actor"), global_step=STEP)
        trainer = out / "trainer"
        if rank == 0:
            trainer.mkdir(parents=True, exist_ok=True)
            (out / "base_model").mkdir(exist_ok=True)
            (out / "base_model" / "config.json").write_text(json.dumps(hf_config(name), indent=2))
            (out / "exp" / "latest_checkpointed_iteration.txt").write_text(str(STEP))
        dist.barrier()
        sd = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        sd = {k: v for k, v in sd.items() if "_extra_state" not in k}
        ranks = {
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
        }
        torch.save(
            {**ranks, "sd": sd},
            trainer / f"rank{rank}.pt",
        )
        if not m["experts"] and m.get("pp", 1) == 1:  # a pipeline forward needs megatron's schedules
            model.eval()
            tokens = torch.tensor(TOKENS)
            pos = torch.arange(tokens.shape[1]).unsqueeze(0)
            import contextlib

            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            # stubbed: the forward forks the CUDA RNG tracker for dropout (0 here); a CPU process has no CUDA RNG
            get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
            n = tokens.shape[1]
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
            with torch.no_grad():  # an explicit mask: megatron-core's default one is built on CUDA
                logits = model(tokens, pos, attention_mask=causal)
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            full = gather_from_tensor_model_parallel_region(logits) if logits.shape[-1] != VOCAB else logits
            if rank == 0:
                torch.save(full, trainer / "logits.pt")
        dist.barrier()
    dist.destroy_process_group()


def write_models(root: Path) -> None:
    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(WORLD, str(root), mt._free_port()), nprocs=WORLD, join=True, start_method="spawn")


if __name__ == "__main__":
    write_models(Path(sys.argv[1]))
