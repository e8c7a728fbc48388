"""The models: a transformers causal LM (actor) and a value model (critic) from a config; random init, no downloads."""

from __future__ import annotations

import json
from pathlib import Path

from harness.config import TrainConfig


def build_hf_config(cfg: TrainConfig):
    """A tiny Qwen2 config, or the user's config.json shrunk to `layers` x `hidden`, any causal-LM architecture."""
    from transformers import AutoConfig, Qwen2Config

    if cfg.model_config is None:
        hf = Qwen2Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        )
        hf.architectures = ["Qwen2ForCausalLM"]
    else:
        raw = json.loads(Path(cfg.model_config).read_text())
        model_type = raw.pop("model_type", None)
        if not model_type:
            raise ValueError(f"{cfg.model_config}: no model_type, not a transformers config")
        for key in ("auto_map", "quantization_config"):  # custom code and quantisation are not ours to run
            raw.pop(key, None)
        hf = AutoConfig.for_model(model_type, **raw)
    heads = max(1, cfg.hidden // 8)
    kv = getattr(hf, "num_key_value_heads", None)
    orig_heads = getattr(hf, "num_attention_heads", heads) or heads
    ratio = max(1, orig_heads // kv) if kv else 1
    hf.num_hidden_layers = cfg.layers
    hf.hidden_size = cfg.hidden
    hf.intermediate_size = 2 * cfg.hidden
    hf.num_attention_heads = heads
    if kv is not None:
        hf.num_key_value_heads = max(1, heads // ratio) if heads % ratio == 0 else heads
    if hasattr(hf, "head_dim"):
        hf.head_dim = cfg.hidden // heads
    hf.vocab_size = cfg.vocab
    hf.attention_dropout = cfg.dropout
    hf.use_cache = False
    hf.torch_dtype = "float32"
    for key in ("layer_types", "sliding_window"):  # per-layer lists must follow the new layer count
        if isinstance(getattr(hf, key, None), list):
            setattr(hf, key, getattr(hf, key)[: cfg.layers])
    hf.pad_token_id, hf.bos_token_id, hf.eos_token_id = 0, 1, 2
    hf._attn_implementation = "eager"  # one deterministic kernel on every device
    return hf


def build_actor(hf_config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    model.config.architectures = [type(model).__name__]
    return model.float()


def build_critic(hf_config):
    """verl's critic: AutoModelForTokenClassification with num_labels=1 (a `score` head of shape [1, H])."""
    import copy

    from transformers import AutoModelForTokenClassification

    critic_config = copy.deepcopy(hf_config)
    critic_config.num_labels = 1
    critic_config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_config(critic_config, attn_implementation="eager")
    model.config.architectures = [type(model).__name__]
    return model.float()


def decoder_layers(model):
    """The ModuleList of decoder blocks, found by shape rather than by name so any architecture works."""
    import torch

    n = model.config.num_hidden_layers
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    raise ValueError(f"{type(model).__name__}: no ModuleList of {n} decoder layers found")


def build_tokenizer(vocab: int):
    """A word-level tokenizer over tokens t0..t{V-1}, built offline and wrapped like any HF fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"t{i}" for i in range(4, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
