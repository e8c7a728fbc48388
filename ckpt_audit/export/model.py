"""Is the export a model transformers will load as written? Asked of the finished work directory, before the marker.

`check_config` needs no torch: config.json must exist and agree with the exported tensors as their safetensors
headers say. For the architectures whose names it knows (TEMPLATE_FAMILIES: every tensor transformers builds from the
config, with its shape) the names must be exactly those; for others it checks what any decoder shares (layer count,
every layer alike, embedding size). Everywhere: no floating tensor the config's dtype would round, and lm_head.weight
present iff the embeddings are not tied (a tied config with its own lm_head contradicts itself: transformers 4 and
vLLM tie them and drop lm_head's values; an untied one without lm_head gets a random output layer). What
transformers' own load does is the final word: `load_with_transformers` runs it in a child process
(transformers_load.py) where transformers is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ckpt_audit.codes import finding
from ckpt_audit.export.children import sigint_held
from ckpt_audit.export.stream_plan import FLOATS, ITEMSIZE, SAFETENSORS_DTYPE
from ckpt_audit.models import Finding
from ckpt_audit.readers import bounded_json, safetensors_header
from ckpt_audit.rules.hf_trainer import TIED_EMBEDDINGS
from ckpt_audit.units import format_size

TEMPLATE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
MOE_SIZES = {  # what the MoE families' templates read besides SIZES and the expert count
    "mixtral": (),
    "qwen3_moe": ("moe_intermediate_size",),
    "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
}
EXPERTS = ("num_experts", "num_local_experts")  # either: transformers 5 saves Qwen3-MoE's as num_local_experts
DTYPE_NAME = {code: name for name, code in SAFETENSORS_DTYPE.items() if name in FLOATS}  # floating formats only
LM_HEAD, EMBED = TIED_EMBEDDINGS
LAYER_RE = re.compile(r"^(.*?\.(?:layers|h|blocks)\.)(\d+)\.(.+)$")
LOADER = Path(__file__).with_name("transformers_load.py")
NO_CONFIG = (
    "no config.json: the step has no huggingface/ with the model's config (verl writes it with the checkpoint), so "
    "transformers cannot load the export"
)
LOAD_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCheck:
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()  # what the check could not cover (an architecture it has no template for)


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    ran: bool
    note: str  # one line: what transformers loaded, or why the load did not run
    findings: tuple[Finding, ...] = ()


def check_config(work: Path, out: Path) -> ModelCheck:
    """config.json in `work` (the finished export, to be put at `out`) against its model*.safetensors headers."""
    cfg_path = str(out / "config.json")
    try:
        config = bounded_json.load_file(str(work / "config.json"))
    except FileNotFoundError:
        return ModelCheck(findings=(finding("export-no-config", cfg_path, NO_CONFIG),))
    except (OSError, ValueError) as exc:
        return ModelCheck(
            findings=(finding("export-no-config", cfg_path, f"config.json is not readable JSON ({exc})"),)
        )
    if not isinstance(config, dict):
        return ModelCheck(findings=(finding("export-no-config", cfg_path, "config.json is not a JSON object"),))
    tensors = _headers(work)
    problems: list[str] = []
    notes: list[str] = []
    if config.get("model_type") not in TEMPLATE_FAMILIES:
        notes.append(
            f"model_type {config.get('model_type')!r}: names checked by layer count, layer likeness and embedding "
            f"size only (all names and shapes for {', '.join(TEMPLATE_FAMILIES)})"
        )
        problems += _generic(config, tensors)
    elif missing := _unsized(config):
        problems.append(f"config.json gives no {', '.join(missing)}: the model's size cannot be checked")
    elif many := [k for k in ("num_hidden_layers", *EXPERTS) if (_first_int(config, k) or 0) > len(tensors)]:
        # bounded work: never a template for a billion layers or experts
        problems.append(f"{many[0]} is {config[many[0]]}, more than the {len(tensors)} tensors")
    else:
        problems += _against(expected_tensors(config) or {}, tensors, config)
    problems += _dtype(config, tensors, notes)
    return ModelCheck(
        findings=tuple(finding("export-config-mismatch", cfg_path, p) for p in problems), notes=tuple(notes)
    )


def config_unusable(cfg_dir: Path) -> str | None:
    """Why cfg_dir/config.json, which is there, is no JSON object to read the model from; None when it is one (or
    is not there: source_config_problem says so)."""
    path = cfg_dir / "config.json"
    try:
        config = bounded_json.load_file(str(path))
    except FileNotFoundError:
        return None
    except ValueError as exc:  # JSON, UTF-8 or a bound
        return f"{path} is not valid JSON ({exc})"
    return None if isinstance(config, dict) else f"{path} is not a JSON object"


def source_config_problem(hf_dir: Path) -> str | None:
    """Why the source holds no config.json to export (checked before anything is written), or None."""
    return None if (hf_dir / "config.json").is_file() else f"{hf_dir / 'config.json'}: export-no-config: {NO_CONFIG}"


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor transformers builds from `config` (what save_pretrained writes), for the families
    in TEMPLATE_FAMILIES; None for any other model_type. Read from the modeling code of those families."""
    family = config.get("model_type")
    if family not in TEMPLATE_FAMILIES:
        return None
    layers, hidden, inter, heads, vocab = (config[k] for k in SIZES)
    kv = _first_int(config, "num_key_value_heads") or heads
    hd = _first_int(config, "head_dim") or (hidden // heads if heads else 0)
    attn_bias = bool(config.get("attention_bias", False)) if family in ("llama", "qwen3", "qwen3_moe") else False
    qkv_bias = attn_bias or family == "qwen2"  # Qwen2Attention: q, k and v always biased, o never
    qkv_bias |= family == "qwen2_moe" and bool(config.get("qkv_bias", True))
    mlp_bias = family == "llama" and bool(config.get("mlp_bias", False))
    out: dict[str, tuple[int, ...]] = {EMBED: (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv * hd, hidden),
            p + "self_attn.v_proj.weight": (kv * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if qkv_bias:
            out |= {p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,)}
            out[p + "self_attn.v_proj.bias"] = (kv * hd,)
        if attn_bias:
            out[p + "self_attn.o_proj.bias"] = (hidden,)
        if mlp_bias:
            out |= {
                p + "mlp.gate_proj.bias": (inter,),
                p + "mlp.up_proj.bias": (inter,),
                p + "mlp.down_proj.bias": (hidden,),
            }
        out |= {p + k: shape for k, shape in _mlp(config, i, hidden, inter).items()}
        if family in ("qwen3", "qwen3_moe"):
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    head = _architecture(config)
    if head.endswith("ForTokenClassification"):  # verl's critic: GenericForTokenClassification's score head
        labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)
        out["score.weight"] = (labels, hidden)
        if config.get("token_classification_bias", True):
            out["score.bias"] = (labels,)
    elif not _tied(config):
        out[LM_HEAD] = (vocab, hidden)
    return out


def _unsized(config: dict) -> list[str]:
    """The sizes the family's template reads that config.json does not give as non-negative integers."""
    family = str(config.get("model_type"))
    out = [k for k in SIZES + MOE_SIZES.get(family, ()) if not isinstance(config.get(k), int) or config[k] < 0]
    experts = _first_int(config, *EXPERTS)
    if family in MOE_SIZES and (experts is None or experts < 0):
        out.append(" or ".join(EXPERTS))
    return out


def _mlp(config: dict, layer: int, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP under model.layers.N, in the names the family's checkpoints use (transformers 5 fuses the
    experts as it loads and writes these names back on save)."""
    family = config["model_type"]
    experts = (_first_int(config, *EXPERTS) or 0) if family in MOE_SIZES else 0
    if family == "mixtral":
        out: dict[str, tuple[int, ...]] = {"block_sparse_moe.gate.weight": (experts, hidden)}
        for e in range(experts):
            x = f"block_sparse_moe.experts.{e}."
            out |= {
                x + "w1.weight": (inter, hidden),
                x + "w3.weight": (inter, hidden),
                x + "w2.weight": (hidden, inter),
            }
        return out
    dense = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step") or 1
    if not experts or (isinstance(dense, list) and layer in dense) or (isinstance(step, int) and (layer + 1) % step):
        return _glu("mlp.", inter, hidden)  # the Qwen MoE models' decoder_sparse_step / mlp_only_layers rule
    out = {"mlp.gate.weight": (experts, hidden)}
    for e in range(experts):
        out |= _glu(f"mlp.experts.{e}.", config["moe_intermediate_size"], hidden)
    if family == "qwen2_moe":  # a shared expert beside the routed ones, scaled by a sigmoid gate
        out |= _glu("mlp.shared_expert.", config["shared_expert_intermediate_size"], hidden)
        out["mlp.shared_expert_gate.weight"] = (1, hidden)
    return out


def _glu(prefix: str, inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return {f"{prefix}{k}.weight": shape for k, shape in shapes.items()}


def _architecture(config: dict) -> str:
    arch = config.get("architectures")
    return str(arch[0]) if isinstance(arch, list) and arch else "ForCausalLM"  # AutoModelForCausalLM's choice


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", False))  # False: every family in TEMPLATE_FAMILIES defaults to it


def _against(expected: dict[str, tuple[int, ...]], tensors: dict[str, tuple[str, tuple[int, ...]]], config) -> list:
    out = []
    sizes = ", ".join(f"{k} {config[k]}" for k in SIZES)
    lm = LM_HEAD
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if lm in unexpected and _tied(config) and _architecture(config).endswith("ForCausalLM"):
        unexpected.remove(lm)
        out.append(
            "tie_word_embeddings is true but lm_head.weight is exported (it differs from model.embed_tokens.weight): "
            "the config contradicts the weights (transformers 4 and vLLM tie them and drop lm_head's values; "
            "transformers 5 unties them with a warning)"
        )
    if lm in missing:  # expected only when untied
        missing.remove(lm)
        out.append(
            "tie_word_embeddings is false but no lm_head.weight is exported: transformers would initialise the "
            "output layer at random"
        )
    if missing:
        out.append(f"{len(missing)} tensor(s) the config implies ({sizes}) are not exported: {_some(missing)}")
    if unexpected:
        out.append(f"{len(unexpected)} exported tensor(s) the config does not describe ({sizes}): {_some(unexpected)}")
    wrong = [
        f"{n} is {list(tensors[n][1])}, the config implies {list(shape)}"
        for n, shape in expected.items()
        if n in tensors and tensors[n][1] != shape
    ]
    if wrong:
        out.append(f"{len(wrong)} tensor shape(s) disagree with the config ({sizes}): {_some(wrong)}")
    return out


def _generic(config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """Checks that hold for any decoder, as far as the config says (GPT-2's names for the sizes included): layers
    0..N-1 all alike, the embedding [vocab, hidden], lm_head iff untied."""
    out = []
    layers: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, (_dtype, shape) in tensors.items():
        if m := LAYER_RE.match(name):
            layers.setdefault(int(m[2]), {})[m[1] + "*." + m[3]] = shape
    n = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
    if n is not None and layers and sorted(layers) != list(range(n)):
        out.append(f"num_hidden_layers is {n} but the exported layers are {_some([str(i) for i in sorted(layers)])}")
    first = layers.get(0, {})
    if unlike := [i for i, names in sorted(layers.items()) if names != first]:
        out.append(f"layer(s) {_some([str(i) for i in unlike])} hold other tensors or shapes than layer 0")
    want = (_first_int(config, "vocab_size"), _first_int(config, "hidden_size", "n_embd", "d_model"))
    for name, (_dtype, shape) in tensors.items():
        if None not in want and name.endswith(("embed_tokens.weight", "wte.weight")) and shape != want:
            out.append(f"{name} is {list(shape)}, the config implies {list(want)} (vocab_size, hidden_size)")
    if _architecture(config).endswith("ForCausalLM") and "tie_word_embeddings" in config:
        if _tied(config) and LM_HEAD in tensors:
            out.append("tie_word_embeddings is true but lm_head.weight is exported: the config contradicts the weights")
        elif not _tied(config) and LM_HEAD not in tensors:
            out.append("tie_word_embeddings is false but no lm_head.weight is exported (random output layer)")
    return out


def _first_int(config: dict, *keys: str) -> int | None:
    return next((config[k] for k in keys if isinstance(config.get(k), int)), None)


def _dtype(config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]], notes: list[str]) -> list[str]:
    """Floating tensors that transformers' load (in the config's dtype) would round: wider than it, or as wide and
    another format (bf16 vs fp16). A narrower one is widened exactly, and loads as exported."""
    said = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(said, str):
        notes.append("config.json names no dtype: transformers loads the weights as float32")
        return []
    width = ITEMSIZE[said] if said in FLOATS else 0
    rounded = sorted(
        n
        for n, (dt, _s) in tensors.items()
        if dt in DTYPE_NAME and DTYPE_NAME[dt] != said and ITEMSIZE[DTYPE_NAME[dt]] >= width
    )
    if not rounded:
        return []
    got = DTYPE_NAME[tensors[rounded[0]][0]]
    return [
        f"config.json's dtype is {said} but {len(rounded)} floating tensor(s) are wider or another format, e.g. "
        f"{rounded[0]} ({got}): transformers' load rounds them (export with --dtype to make them one dtype)"
    ]


def _headers(work: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of every tensor in the export's model*.safetensors (not the LoRA adapter)."""
    out = {}
    for path in sorted(work.glob("*.safetensors")):  # written by this export a moment ago
        for name, v in safetensors_header.read(str(path)).tensors.items():
            out[name] = (v["dtype"], tuple(v["shape"]))
    return out


def _some(items: list[str], k: int = 3) -> str:
    more = f" (+{len(items) - k} more)" if len(items) > k else ""
    return ", ".join(items[:k]) + more


# ---------------------------------------------------------------------------------------------------- transformers


def transformers_importable() -> bool:
    """transformers and torch can be imported here (looked up, not imported: export itself never imports torch)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    except (ImportError, ValueError):  # a blocked or broken install
        return False


def load_with_transformers(work: Path, out: Path, *, total_bytes: int, max_size: int) -> Load:
    """transformers' from_pretrained of `work` on CPU in a child process, its state dict compared with the exported
    tensors (transformers_load.py). Not run without transformers, or past `max_size` bytes of tensors (the child
    holds the whole model in memory)."""
    if not transformers_importable():
        return Load(ran=False, note="transformers load not run: transformers is not installed")
    if total_bytes > max_size:
        return Load(
            ran=False,
            note=f"transformers load not run: the model ({format_size(total_bytes)}) is over --max-load-size "
            f"({format_size(max_size)}), and the load holds it all in memory",
        )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with sigint_held():  # a Ctrl-C during the fork was swallowed by Python's at-fork handlers
        proc = subprocess.Popen(
            [sys.executable, str(LOADER), str(work)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    with proc:  # killed on the way out, as subprocess.run does, on a timeout or a Ctrl-C alike
        try:
            stdout, stderr = proc.communicate(timeout=LOAD_TIMEOUT_S + total_bytes // (50 * 2**20))
        except subprocess.TimeoutExpired:
            return Load(ran=False, note="transformers load not run: it did not finish in time")
        finally:
            proc.kill()
    lines = stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
        return Load(ran=False, note=f"transformers load did not finish ({tail})")
    if not got.get("ran"):
        return Load(ran=False, note=f"transformers load not run: {got.get('why')}")
    what = f"transformers {got['transformers']} ({got['class']})"
    problems = got.get("problems") or []
    if problems:
        path = str(out)
        found = tuple(finding("export-load-failed", path, f"{what}: {p}") for p in problems)
        return Load(ran=True, note=f"loaded with {what}: {len(problems)} problem(s)", findings=found)
    return Load(ran=True, note=f"loaded with {what}: its {got['tensors']} weights equal the exported tensors")


def _die_with_parent() -> None:
    """In the child, before exec: end it when the export dies (kill -9 included), not leave it loading alone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
