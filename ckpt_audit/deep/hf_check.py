"""verify's deep check of an HF Trainer checkpoint-N: its resume pickles loaded the safe way and read as Trainer does.

Each of optimizer.pt, scheduler.pt, scaler.pt and rng_state*.pth goes through `safe_load` (the restricted
unpickler first, then `torch.load(weights_only=True)` with the one allowlist), as verl's files do. What loads must
hold what Trainer's resume indexes: `rng_state["python"]`, `["numpy"]`, `["cpu"]` (`_load_rng_state`), an optimizer
state dict with `state` and `param_groups`, a scheduler state dict. training_args.bin is never loaded (see
rules/files.py OBJECT_PICKLES). The weights' safetensors headers are verify's generic check.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from ckpt_audit.codes import finding
from ckpt_audit.deep import safe_load
from ckpt_audit.deep.check import Deep
from ckpt_audit.models import Checkpoint, Component, FileKind, Finding

RNG_KEYS = ("python", "numpy", "cpu")
OPTIM_KEYS = ("state", "param_groups")


def check(ckpt: Checkpoint, comp: Component, bad: Set[str]) -> Deep:
    """Each resume pickle of the checkpoint-N, loaded and read as Trainer's resume reads it."""
    out: list[Finding] = []
    for f in comp.files:
        if (
            f.kind not in (FileKind.OPTIM, FileKind.EXTRA_STATE)
            or f.path in bad
            or not f.path.endswith((".pt", ".pth"))
        ):
            continue
        res = safe_load.load(f.path)
        out.extend(res.findings)
        if res.loaded:
            out.extend(check_state(f.path, res.value))
    return Deep(tuple(out))


def check_state(path: str, value: object) -> tuple[Finding, ...]:
    """What Trainer's resume would fail on (KeyError, TypeError) in one loaded state file, by its name."""
    name = path.rsplit("/", 1)[-1]
    want = RNG_KEYS if name.startswith("rng_state") else OPTIM_KEYS if name.startswith("optimizer") else ()
    if not isinstance(value, Mapping):
        return (finding("hf-state-invalid", path, f"holds a {type(value).__name__}, not the dict Trainer saves"),)
    missing = [k for k in want if k not in value]
    if missing:
        return (finding("hf-state-invalid", path, f"no {', '.join(map(repr, missing))}: Trainer's resume reads it"),)
    return ()
