"""resume-test --model-config: the team's own model, from a config.json, a model directory, or a Hub id already in
the local Hugging Face cache (nothing is downloaded), and what the harness shrinks of it.

The trainer builds the model from the config with `harness.model.build_hf_config`, which changes only sizes
(layers, hidden, intermediate, heads, vocabulary): the architecture class, its parameter names, tied embeddings,
biases, norms and any other module the config switches on stay as they are. `describe_shrink` reports the sizes
that changed by building the same config the trainer builds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# sizes build_hf_config sets, by their transformers attribute, with a short name for the report
SIZES = (
    ("num_hidden_layers", "layers"),
    ("hidden_size", "hidden"),
    ("intermediate_size", "intermediate"),
    ("num_attention_heads", "heads"),
    ("num_key_value_heads", "kv heads"),
    ("head_dim", "head dim"),
    ("vocab_size", "vocab"),
)
# switches the shrunk model keeps from the config, named in the report when set
KEPT = (
    ("tie_word_embeddings", "tied embeddings"),
    ("attention_bias", "attention bias"),
    ("mlp_bias", "MLP bias"),
    ("use_sliding_window", "sliding window"),
    ("num_experts", "experts"),
    ("num_local_experts", "experts"),
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelSourceError(ValueError):
    """--model-config names nothing usable (a usage error)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    given: str
    """As typed: a config.json, a model directory, or a Hub id."""
    config: Path
    """The config.json the trainer reads."""
    kind: str
    """"file", "directory" or "hub cache"."""


def resolve(value: str) -> ModelSource:
    """A config.json, a directory holding one, or a Hub id (`org/name`) whose config.json is in the local Hugging
    Face cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub): read from disk, never fetched."""
    path = Path(value).expanduser()
    if path.is_file():
        return ModelSource(given=value, config=path, kind="file")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{value}: a directory without config.json")
        return ModelSource(given=value, config=path / "config.json", kind="directory")
    if not _HUB_ID.match(value):  # a path (./x, /x, a/b/c), not a Hub id
        raise ModelSourceError(f"{value}: no such file or directory")
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(value, "config.json")
    except ValueError:  # huggingface_hub's HFValidationError: not a valid repo id after all
        found = None
    if not isinstance(found, str):
        raise ModelSourceError(
            f"{value}: neither a path nor a model in the local Hugging Face cache (nothing is downloaded: "
            f"fetch its config first, e.g. `hf download {value} config.json`)"
        )
    return ModelSource(given=value, config=Path(found), kind="hub cache")


def describe_shrink(source: ModelSource, *, layers: int, hidden: int) -> dict:
    """What the trainer builds from the config: the architecture, each size as given -> as trained, and the
    switches it keeps. Raises ModelSourceError for a config the trainer cannot build."""
    from transformers.utils import logging as hf_logging

    from harness.config import TrainConfig
    from harness.model import build_hf_config

    hf_logging.set_verbosity_error()  # the trainer's ranks run with TRANSFORMERS_VERBOSITY=error too
    try:
        raw = json.loads(source.config.read_text())
        built = build_hf_config(TrainConfig(run_dir="", model_config=str(source.config), layers=layers, hidden=hidden))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"--model-config {source.given}: {exc}") from None
    shrunk = {
        label: [raw[attr], getattr(built, attr)]
        for attr, label in SIZES
        if attr in raw and raw[attr] is not None and raw[attr] != getattr(built, attr, None)
    }
    kept = sorted({label for attr, label in KEPT if raw.get(attr)})
    return {
        "source": source.given,
        "kind": source.kind,
        "config": str(source.config),
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures") or [],
        "shrunk": shrunk,
        "kept": kept,
    }


def shrink_line(doc: dict, architecture: str | None) -> str:
    """One line for the text report: what was trained, from what, and what was made smaller."""
    sizes = ", ".join(f"{k} {a}->{b}" for k, (a, b) in doc["shrunk"].items()) or "nothing"
    kept = f"; kept: {', '.join(doc['kept'])}" if doc["kept"] else ""
    return f"  model: {architecture or doc['model_type']} from {doc['source']} ({doc['kind']}); shrunk: {sizes}{kept}"
