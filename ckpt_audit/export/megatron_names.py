"""megatron-core parameter names -> HuggingFace names, per architecture family. Pure: no I/O.

A megatron-core `dist_checkpointing` save keys every transformer-layer parameter once for the whole model, with the
layer as its leading dimension (`decoder.layers.self_attention.linear_qkv.weight`, global shape (L, rows, cols)), and
MoE expert parameters with the expert next (`decoder.layers.mlp.experts.experts.linear_fc1.weight`: (L, E, rows,
cols)). Each HF tensor is then one slice of one megatron tensor: the leading indices (layer, expert) fixed, and a
selection of rows, because megatron fuses what HF keeps apart:

- `linear_qkv` holds, per query group, that group's query heads, then its key head, then its value head (rows of
  head_dim each); HF's q_proj / k_proj / v_proj are every group's part of each kind, in group order. The global
  tensor is laid out so for any tensor-parallel size (tensor parallelism splits whole groups).
- `linear_fc1` of a gated MLP is [gate; up] globally: megatron-core saves each rank's two halves at their global
  offsets (its swiglu sharded factory), so gate_proj is the first half of the rows and up_proj the second.
- the embedding and the output layer may be padded past the vocabulary (make_vocab_size_divisible_by): their
  first vocab_size rows are the model.

Families (HF `model_type`): llama, mistral, qwen2, qwen3 (dense); qwen2_moe, qwen3_moe, mixtral (MoE). What a
family's HF model holds beyond Llama's names is decided by its config and must be in the checkpoint, neither more nor
less (`problems`, `_layer_parts`): q/k/v biases (megatron add_qkv_bias: Qwen2 always, Qwen2-MoE's qkv_bias, the others'
attention_bias), q_norm / k_norm (megatron qk_layernorm: Qwen3, Qwen3-MoE), Qwen2-MoE's shared expert and its sigmoid
gate (megatron moe_shared_expert_intermediate_size, moe_shared_expert_gate). Mixtral's experts are written in its
checkpoints' names (block_sparse_moe.experts.E.w1/w2/w3), which transformers 5 renames and fuses as it loads and
writes back on save_pretrained. Not mapped, with the reason in UNSUPPORTED: what needs another transform than
slicing (Gemma's norm offset, DeepSeek's MLA, Phi-3's fused layout), or parameters these names do not cover.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DENSE = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MOE = frozenset({"qwen2_moe", "qwen3_moe", "mixtral"})
FAMILIES = DENSE | MOE
UNSUPPORTED = {
    "gemma": "Gemma's RMSNorm weights are stored as an offset from 1 in HF (not a slice of megatron's)",
    "gemma2": "Gemma's RMSNorm weights are stored as an offset from 1 in HF (not a slice of megatron's)",
    "gemma3": "Gemma's RMSNorm weights are stored as an offset from 1 in HF (not a slice of megatron's)",
    "deepseek_v2": "multi-latent attention (linear_q_down_proj, linear_kv_up_proj) is not mapped",
    "deepseek_v3": "multi-latent attention and the router's expert bias are not mapped",
    "phi3": "Phi-3's fused qkv_proj / gate_up_proj layout is not mapped",
    "qwen2_vl": "vision towers are not megatron-core GPTModel parameters",
    "qwen2_5_vl": "vision towers are not megatron-core GPTModel parameters",
    "qwen3_vl": "vision towers are not megatron-core GPTModel parameters",
    "qwen3_vl_moe": "vision towers are not megatron-core GPTModel parameters",
    "qwen3_next": "its linear-attention (gated DeltaNet) layers are not megatron-core GPTModel attention",
    "llama4": "interleaved dense / MoE layers and a shared expert under other names are not mapped",
    "glm4_moe": "the router's expert score bias and leading dense layers are not mapped",
    "gpt_oss": "attention sinks and expert biases are not mapped",
}
SPARSE_LAYERS = "megatron-core saves mixed dense and MoE layers under per-layer keys, which are not mapped"
Rows = tuple[tuple[int, int], ...]


class NameMapError(ValueError):
    """A megatron key, shape or config this map cannot turn into HF tensors; the message is one line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One HF tensor: megatron tensor `key` at leading indices `index`, rows `rows` of what is left (None: all)."""

    name: str
    key: str
    index: tuple[int, ...]
    rows: Rows | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Arch:
    family: str
    vocab: int
    heads: int
    groups: int
    head_dim: int
    tied: bool
    experts: int  # 0 for a dense model
    qkv_bias: bool  # HF q/k/v_proj have biases (megatron add_qkv_bias)
    qk_norm: bool  # HF q_norm / k_norm (megatron qk_layernorm)

    @property
    def moe_prefix(self) -> str:
        return "block_sparse_moe" if self.family == "mixtral" else "mlp"


def arch_of(config: dict) -> Arch:
    """The family and the shapes the split needs, from the HF config (raises NameMapError)."""
    family = str(config.get("model_type") or "")
    if family in UNSUPPORTED:
        raise NameMapError(f"model_type {family!r} is not supported: {UNSUPPORTED[family]}")
    if family not in FAMILIES:
        raise NameMapError(f"model_type {family!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    try:
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        vocab = int(config["vocab_size"])
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0) if family in MOE else 0
    except (KeyError, TypeError, ValueError) as exc:
        raise NameMapError(f"config.json lacks a usable {exc} for a {family} model") from None
    if heads <= 0 or groups <= 0 or heads % groups:
        raise NameMapError(f"config.json: {heads} attention heads do not divide into {groups} key/value heads")
    if family in MOE and (config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1):
        raise NameMapError(
            f"a {family} model with dense layers (mlp_only_layers, decoder_sparse_step): {SPARSE_LAYERS}"
        )
    tied = bool(config.get("tie_word_embeddings", False))
    if family == "qwen2":  # HF Qwen2 always has q/k/v biases, Qwen2-MoE by qkv_bias, the others by attention_bias
        qkv_bias = True
    elif family == "qwen2_moe":
        qkv_bias = bool(config.get("qkv_bias", True))
    else:
        qkv_bias = bool(config.get("attention_bias", False))
    return Arch(
        family=family,
        vocab=vocab,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        tied=tied,
        experts=experts,
        qkv_bias=qkv_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
    )


def problems(keys: set[str], arch: Arch) -> list[str]:
    """Why the checkpoint's megatron keys cannot make an HF model of `arch`, before any is mapped: per-layer keys,
    or a parameter the family has that the checkpoint lacks. One line each."""
    if per_layer := sorted(k for k in keys if _PER_LAYER.match(k)):
        return [f"{per_layer[0]}: {SPARSE_LAYERS}"]
    want = {}
    if arch.qkv_bias:
        want["self_attention.linear_qkv.bias"] = "q/k/v_proj biases (megatron add_qkv_bias)"
    if arch.qk_norm:
        want["self_attention.q_layernorm.weight"] = "q_norm (megatron qk_layernorm)"
        want["self_attention.k_layernorm.weight"] = "k_norm (megatron qk_layernorm)"
    if arch.family == "qwen2_moe":
        want["mlp.shared_experts.linear_fc1.weight"] = (
            "the shared expert (megatron moe_shared_expert_intermediate_size)"
        )
        want["mlp.shared_experts.gate_weight"] = "shared_expert_gate (megatron moe_shared_expert_gate)"
    return [
        f"a {arch.family} model has {what}; the checkpoint holds no {_LAYER}{rest}"
        for rest, what in want.items()
        if _LAYER + rest not in keys
    ]


_LAYER = "decoder.layers."
_PER_LAYER = re.compile(r"decoder\.layers\.\d")  # megatron-core's keys for non-homogeneous layers
_EXPERT = re.compile(r"mlp\.experts\.(?:experts\.|local_experts\.)?(linear_fc1|linear_fc2)\.weight")


def targets(key: str, shape: tuple[int, ...], arch: Arch) -> list[Target]:
    """The HF tensors megatron tensor `key` (global `shape`) holds; [] for what an export leaves out (none today).
    Raises NameMapError for a key with no HF name: nothing is dropped silently."""
    if key == "embedding.word_embeddings.weight":
        return [Target(name="model.embed_tokens.weight", key=key, index=(), rows=_vocab(key, shape, arch))]
    if key == "output_layer.weight":
        return [Target(name="lm_head.weight", key=key, index=(), rows=_vocab(key, shape, arch))]
    if key == "decoder.final_layernorm.weight":
        return [Target(name="model.norm.weight", key=key, index=())]
    if not key.startswith(_LAYER) or not shape:
        raise NameMapError(f"{key}: no HF name for this megatron-core parameter ({arch.family})")
    rest = key[len(_LAYER) :]
    out: list[Target] = []
    if m := _EXPERT.fullmatch(rest):
        if len(shape) != 4:
            raise NameMapError(f"{key}: expert weights of shape {list(shape)}, not (layers, experts, rows, cols)")
        if shape[1] != arch.experts:
            raise NameMapError(f"{key}: {shape[1]} experts; config.json says {arch.experts}")
        for layer in range(shape[0]):
            for e in range(shape[1]):
                for suffix, rows in _expert(m[1], shape[2], arch):
                    name = f"model.layers.{layer}.{arch.moe_prefix}.experts.{e}.{suffix}"
                    out.append(Target(name=name, key=key, index=(layer, e), rows=rows))
        return out
    parts = _layer_parts(rest, shape[1:], arch)
    for layer in range(shape[0]):
        for suffix, rows in parts:
            out.append(Target(name=f"model.layers.{layer}.{suffix}", key=key, index=(layer,), rows=rows))
    return out


def _vocab(key: str, shape: tuple[int, ...], arch: Arch) -> Rows:
    if len(shape) != 2 or shape[0] < arch.vocab:
        raise NameMapError(f"{key}: shape {list(shape)} holds fewer than the config's {arch.vocab} vocabulary rows")
    return ((0, arch.vocab),)


def _layer_parts(rest: str, shape: tuple[int, ...], arch: Arch) -> list[tuple[str, Rows | None]]:
    """(HF suffix under model.layers.L, rows) for one per-layer megatron parameter (shape without the layer dim)."""
    moe = arch.moe_prefix
    if rest in ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"):
        return [("input_layernorm.weight", None)]
    if rest in ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"):
        return [("post_attention_layernorm.weight", None)]
    if rest == "self_attention.linear_qkv.weight" or (rest == "self_attention.linear_qkv.bias" and arch.qkv_bias):
        kind = rest.rsplit(".", 1)[1]
        return [(f"self_attn.{p}_proj.{kind}", rows) for p, rows in _qkv(rest, shape[0], arch)]
    if rest == "self_attention.linear_proj.weight":
        return [("self_attn.o_proj.weight", None)]
    if rest == "self_attention.q_layernorm.weight" and arch.qk_norm:
        return [("self_attn.q_norm.weight", None)]
    if rest == "self_attention.k_layernorm.weight" and arch.qk_norm:
        return [("self_attn.k_norm.weight", None)]
    if rest == "mlp.linear_fc1.weight" and arch.family in DENSE:
        return [(f"mlp.{p}_proj.weight", rows) for p, rows in _halves(rest, shape[0])]
    if rest == "mlp.linear_fc2.weight" and arch.family in DENSE:
        return [("mlp.down_proj.weight", None)]
    if rest == "mlp.router.weight" and arch.family in MOE:
        if shape[0] != arch.experts:
            raise NameMapError(f"{rest}: the router scores {shape[0]} experts; config.json says {arch.experts}")
        return [(f"{moe}.gate.weight", None)]
    if arch.family == "qwen2_moe":
        if rest == "mlp.shared_experts.linear_fc1.weight":
            return [(f"mlp.shared_expert.{p}_proj.weight", rows) for p, rows in _halves(rest, shape[0])]
        if rest == "mlp.shared_experts.linear_fc2.weight":
            return [("mlp.shared_expert.down_proj.weight", None)]
        if rest == "mlp.shared_experts.gate_weight":
            return [("mlp.shared_expert_gate.weight", None)]
    why = _NOT_IN_CONFIG.get(rest, "no HF name for this megatron-core parameter")
    raise NameMapError(f"decoder.layers.{rest}: {why} ({arch.family})")


_NOT_IN_CONFIG = {  # saved, but config.json's model has no place for it: exporting would drop it
    "self_attention.linear_qkv.bias": "q/k/v biases, which config.json's model has none of (attention_bias)",
    "self_attention.q_layernorm.weight": "megatron qk_layernorm, which config.json's model has no q_norm for",
    "self_attention.k_layernorm.weight": "megatron qk_layernorm, which config.json's model has no k_norm for",
}


def _qkv(rest: str, rows: int, arch: Arch) -> list[tuple[str, Rows]]:
    q = arch.heads // arch.groups * arch.head_dim  # query rows of one group
    per = q + 2 * arch.head_dim
    if rows != arch.groups * per:
        raise NameMapError(
            f"{rest}: {rows} rows, not {arch.groups} groups x ({arch.heads // arch.groups} query + 1 key + 1 value) "
            f"heads x {arch.head_dim} (config.json disagrees with the checkpoint)"
        )
    starts = [g * per for g in range(arch.groups)]
    return [
        ("q", tuple((s, s + q) for s in starts)),
        ("k", tuple((s + q, s + q + arch.head_dim) for s in starts)),
        ("v", tuple((s + q + arch.head_dim, s + per) for s in starts)),
    ]


def _halves(rest: str, rows: int) -> list[tuple[str, Rows]]:
    if rows % 2:
        raise NameMapError(f"{rest}: {rows} rows do not split into gate and up halves")
    return [("gate", ((0, rows // 2),)), ("up", ((rows // 2, rows),))]


def _expert(kind: str, rows: int, arch: Arch) -> list[tuple[str, Rows | None]]:
    mixtral = arch.family == "mixtral"
    if kind == "linear_fc2":
        return [("w2.weight" if mixtral else "down_proj.weight", None)]
    (_g, gate), (_u, up) = _halves(f"experts {kind}", rows)
    return [("w1.weight" if mixtral else "gate_proj.weight", gate), ("w3.weight" if mixtral else "up_proj.weight", up)]
