"""Completeness of one HF Trainer `checkpoint-N/` from its file names and its small JSON files. Pure.

What transformers' Trainer (`_save_checkpoint`, `_load_from_checkpoint`, `_load_optimizer_and_scheduler`,
`_load_rng_state`) writes and reads, in the order it writes: the weights (and config.json, training_args.bin), then
optimizer.pt and scheduler.pt (scaler.pt with fp16), each rank's rng_state (rng_state.pth for one process,
rng_state_R.pth for R of several), and trainer_state.json last. On resume every piece but the weights is optional to
Trainer: a missing one is skipped with at most an info log, so a partial save resumes without a word and silently
differs from the run it continues. Here each missing piece is an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckpt_audit.codes import finding
from ckpt_audit.models import Finding
from ckpt_audit.readers import bounded_json

WEIGHT_FILES = frozenset({"model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin"})
INDEX_FILES = frozenset({"model.safetensors.index.json", "pytorch_model.bin.index.json"})
SAFETENSORS_INDEX = "model.safetensors.index.json"
INDEX_TEXT_LIMIT = 16 * 1024 * 1024  # an index is read whole up to this (a 1T-parameter model's is a few MB)
TEXT_LIMIT = 64 * 1024  # any other JSON file: larger ones are read as a prefix (layouts.hf_trainer.text_files)
WEIGHT_SHARD_RE = re.compile(r"(model|pytorch_model)-(\d{1,6})-of-(\d{1,6})\.(safetensors|bin)")
OPTIMIZER_FILES = frozenset({"optimizer.pt", "optimizer.bin"})
SCHEDULER = "scheduler.pt"
RNG_RE = re.compile(r"rng_state(?:_(\d{1,9}))?\.pth")
TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
# sharded states Trainer writes under FSDP / DeepSpeed in sub-directories: present, not read further
FSDP_MODEL_PREFIX = "pytorch_model_fsdp"
FSDP_OPTIM_PREFIX = "optimizer"
DEEPSPEED_STEP_RE = re.compile(r"global_step\d+")
# the output layer and the input embedding of transformers' *ForCausalLM models, the two tensors
# tie_word_embeddings ties (deep check tied-embedding-missing; export drops the first when both are equal)
TIED_EMBEDDINGS = ("lm_head.weight", "model.embed_tokens.weight")
_GLOBAL_STEP_RE = re.compile(r'^\s*"global_step":\s*(-?\d+)\s*,?\s*$', re.MULTILINE)
_SHARD_NAME_RE = re.compile(r'"([^"/]+\.(?:safetensors|bin))"')


def rng_ranks(names: frozenset[str]) -> tuple[bool, frozenset[int]]:
    """(rng_state.pth present, ranks R of the rng_state_R.pth present)."""
    ranks = frozenset(int(m.group(1)) for n in names if (m := RNG_RE.fullmatch(n)) and m.group(1) is not None)
    return "rng_state.pth" in names, ranks


def world_size(names: frozenset[str]) -> int | None:
    """The processes that saved, from the RNG files: one per rank (R+1 for the highest R), or 1 for rng_state.pth."""
    single, ranks = rng_ranks(names)
    if ranks:
        return max(ranks) + 1
    return 1 if single else None


def trainer_step(text: str | None, *, whole: bool) -> int | None | str:
    """global_step of trainer_state.json: an int, None when unknown (not read), or why it is unusable (a str).

    `whole`: `text` is the entire file (else a prefix: HF dumps it with sorted keys, global_step before
    log_history, so the prefix holds it on a line of its own)."""
    if text is None:
        return None
    if whole:
        try:
            doc = bounded_json.loads(text, max_bytes=TEXT_LIMIT)
        except ValueError as exc:
            return f"not JSON ({exc})"
        if not isinstance(doc, dict):
            return "not a JSON object"
        step = doc.get("global_step")
        if not isinstance(step, int) or isinstance(step, bool):
            return f"global_step is {step!r}, not an integer"
        return step
    m = _GLOBAL_STEP_RE.search(text)
    return int(m.group(1)) if m else None


def index_shards(text: str | None, *, whole: bool) -> frozenset[str] | str | None:
    """File names an .index.json's weight_map points at; why it is unusable (a str); None when not read.
    From a prefix, the names seen so far (never a false absence: only named files are looked for)."""
    if text is None:
        return None
    if not whole:
        return frozenset(_SHARD_NAME_RE.findall(text))
    wm = weight_map(text)
    return wm if isinstance(wm, str) else frozenset(wm.values())


def weight_map(text: str) -> dict[str, str] | str:
    """An index's weight_map (tensor name -> shard file name), or why it is unusable (a str)."""
    try:
        doc = bounded_json.loads(text, max_bytes=INDEX_TEXT_LIMIT)
    except ValueError as exc:
        return f"not JSON ({exc})"
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        return "no weight_map object"
    return {k: v for k, v in wm.items() if isinstance(v, str)}


def index_against_headers(
    at, index: str, text: str, names: frozenset[str], headers: Mapping[str, tuple[str, ...] | None]
) -> list[Finding]:
    """What transformers will load from a sharded safetensors folder, against its index.

    transformers opens exactly the files the weight_map names and loads every tensor in them (whatever file the map
    says a tensor is in); a model weight in no opened file keeps its random init, with a warning at most. So a
    shard the index no longer names, or an index entry no opened shard holds, is a model that trains from random
    weights. `headers`: each .safetensors file of the folder -> its tensor names (None: its header is unusable,
    which its own finding reports; the comparison is then skipped). Absent shards are hf-shard-missing already."""
    wm = weight_map(text)
    if isinstance(wm, str):
        return []
    opened = set(wm.values()) & names
    if set(wm.values()) - names or any(headers.get(f) is None for f in opened):
        return []
    held = {t for f in opened for t in headers[f] or ()}  # none is None: checked above
    out: list[Finding] = []
    lost: set[str] = set()
    for f in sorted(set(headers) - opened):
        mine = sorted(set(headers[f] or ()) - held)
        if mine:
            lost.update(mine)
            out.append(
                finding(
                    "hf-index-mismatch",
                    at(f),
                    f"{index} does not name {f}: transformers never opens it, so its {len(mine)} tensor(s) "
                    f"({mine[0]}{', ...' if len(mine) > 1 else ''}) start from random weights",
                )
            )
    unheld = sorted(set(wm) - held - lost)
    if unheld:
        out.append(
            finding(
                "hf-index-mismatch",
                at(index),
                f"{index} names {len(unheld)} tensor(s) ({unheld[0]}{', ...' if len(unheld) > 1 else ''}) that no "
                "shard holds: transformers leaves them at random weights",
            )
        )
    return out


def check_checkpoint(
    step_dir: str,
    step: int,
    names: frozenset[str],
    subdirs: frozenset[str],
    texts: Mapping[str, tuple[str | None, bool]],
    *,
    weights_below: bool = False,
    headers: Mapping[str, tuple[str, ...] | None] | None = None,
) -> tuple[Finding, ...]:
    """Findings for checkpoint-`step` at `step_dir` holding files `names` and sub-directories `subdirs`.

    `texts`: file name -> (text read by the scan, whether it is the whole file) for the JSON files present.
    `weights_below`: a sub-directory holds weights Trainer loads (PEFT adapters, FSDP or DeepSpeed states).
    `headers`: the tensor names of the folder's .safetensors files (index_against_headers)."""
    out: list[Finding] = []
    at = lambda n: f"{step_dir}/{n}"  # noqa: E731
    out += _weights(names, texts, at, step_dir, weights_below, headers or {})
    deepspeed = any(DEEPSPEED_STEP_RE.fullmatch(s) for s in subdirs)  # optimizer and model states live there
    fsdp_optim = any(s.startswith(FSDP_OPTIM_PREFIX) for s in subdirs)
    resume_state = names & OPTIMIZER_FILES or SCHEDULER in names or any(RNG_RE.fullmatch(n) for n in names)
    if not resume_state and not deepspeed and not fsdp_optim and not out and TRAINER_STATE in names:
        # trainer_state.json is written after them all: their absence is no crash but a model-only save
        out.append(
            finding(
                "hf-model-only",
                step_dir,
                "weights and trainer_state.json but no optimizer, scheduler or RNG state (save_only_model?)",
            )
        )
        return tuple(out + _trainer_state(step, names, texts, at))
    if not (names & OPTIMIZER_FILES) and not deepspeed and not fsdp_optim:
        out.append(
            finding("hf-missing-optimizer", at("optimizer.pt"), "no optimizer.pt: a resume starts a fresh optimizer")
        )
    if SCHEDULER not in names and not deepspeed:
        out.append(
            finding(
                "hf-missing-scheduler",
                at(SCHEDULER),
                "no scheduler.pt: a resume restarts the LR schedule and skips optimizer.pt too",
            )
        )
    out += _rng(names, at)
    out += _trainer_state(step, names, texts, at)
    return tuple(out)


def _weights(names, texts, at, step_dir, weights_below: bool, headers) -> list[Finding]:
    shards: dict[str, set[int]] = {}  # "model-*-of-N.safetensors" family -> shard numbers present
    totals: dict[str, int] = {}
    for n in names:
        if m := WEIGHT_SHARD_RE.fullmatch(n):
            fam = f"{m.group(1)}.{m.group(4)}"
            shards.setdefault(fam, set()).add(int(m.group(2)))
            totals[fam] = max(totals.get(fam, 0), int(m.group(3)))
    fsdp = any(n.startswith(FSDP_MODEL_PREFIX) for n in names)  # FSDP FULL_STATE_DICT: pytorch_model_fsdp.bin
    out: list[Finding] = []
    if not (names & WEIGHT_FILES) and not (names & INDEX_FILES) and not shards and not fsdp and not weights_below:
        out.append(finding("hf-missing-model", step_dir, "no model weights (model.safetensors or shards + index)"))
    for fam, have in sorted(shards.items()):
        total = totals[fam]
        width = 5
        for i in sorted(set(range(1, total + 1)) - have):
            name = f"{fam.split('.')[0]}-{i:0{width}d}-of-{total:0{width}d}.{fam.split('.')[1]}"
            out.append(finding("hf-shard-missing", at(name), f"shard {i} of {total} is absent"))
        index = f"{fam}.index.json"
        if index not in names:
            out.append(finding("hf-index-missing", at(index), f"{len(have)} {fam} shard(s) without {index}"))
    for index in sorted(names & INDEX_FILES):
        text, whole = texts.get(index, (None, False))
        listed = index_shards(text, whole=whole)
        if isinstance(listed, str):
            out.append(finding("hf-index-invalid", at(index), listed))
        elif listed:
            reported = {f.path for f in out}
            for name in sorted(listed - names):
                if at(name) not in reported:
                    out.append(finding("hf-shard-missing", at(name), f"{index} names {name}, which is absent"))
    if SAFETENSORS_INDEX in names and "model.safetensors" not in names:  # else transformers loads that one file
        text, whole = texts.get(SAFETENSORS_INDEX, (None, False))
        if text is not None and whole:
            out += index_against_headers(at, SAFETENSORS_INDEX, text, names, headers)
    return out


def _rng(names: frozenset[str], at) -> list[Finding]:
    single, ranks = rng_ranks(names)
    if not single and not ranks:
        return [finding("hf-missing-rng-state", at("rng_state.pth"), "no rng_state.pth nor rng_state_R.pth")]
    out = []
    for r in sorted(set(range(max(ranks) + 1)) - ranks) if ranks else ():
        out.append(
            finding(
                "hf-missing-rng-state",
                at(f"rng_state_{r}.pth"),
                f"rank {r}'s RNG state is absent (ranks up to {max(ranks)} saved theirs)",
                rank=r,
            )
        )
    return out


def _trainer_state(step: int, names, texts, at) -> list[Finding]:
    if TRAINER_STATE not in names:
        return [
            finding(
                "hf-missing-trainer-state",
                at(TRAINER_STATE),
                "no trainer_state.json (written last): the save did not finish, or it was removed",
            )
        ]
    text, whole = texts.get(TRAINER_STATE, (None, False))
    got = trainer_step(text, whole=whole)
    if isinstance(got, str):
        return [finding("hf-trainer-state-invalid", at(TRAINER_STATE), got)]
    if got is not None and got != step:
        return [
            finding(
                "hf-step-mismatch",
                at(TRAINER_STATE),
                f"global_step is {got} in checkpoint-{step}: the files are not one save",
            )
        ]
    return []
