"""transformers' own load of a finished export, run as a child process by model.load_with_transformers.

`python transformers_load.py DIR` loads DIR with from_pretrained on CPU (the class config.json names, else
AutoModelForCausalLM), then compares the loaded state dict with the exported tensors, bit for bit, one tensor at a
time. It prints one JSON line: {"ran": false, "why": ...} when the load could not be tried here, else {"ran": true,
"transformers", "class", "tensors", "problems": [...]}. Never runs code shipped with the model
(trust_remote_code=False) and never unpickles (use_safetensors=True). Imports nothing from ckpt_audit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> dict:
    try:
        import torch
        import transformers
        from safetensors import safe_open
    except ImportError as exc:
        return {"ran": False, "why": f"transformers cannot be imported here ({exc})"}
    config = json.loads((out / "config.json").read_text())
    arch = config.get("architectures")
    name = str(arch[0]) if isinstance(arch, list) and arch else ""
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        if name and config.get("auto_map"):
            return {"ran": False, "why": f"{name} is the model's own code (auto_map), which ckpt-audit never runs"}
        cls = transformers.AutoModelForCausalLM
    done = {"ran": True, "transformers": transformers.__version__, "class": getattr(cls, "__name__", name)}
    try:
        # transformers types from_pretrained as returning the model; output_loading_info=True makes it (model, info)
        model, info = cls.from_pretrained(  # type: ignore[misc]
            out,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype="auto",
            output_loading_info=True,
        )
    except Exception as exc:  # noqa: BLE001 - whatever the library raises is the verdict, in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return {**done, "tensors": 0, "problems": [f"from_pretrained fails: {first}"]}
    problems = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if got := sorted(map(str, info.get(what) or ())):
            problems.append(f"{what.replace('_', ' ')}: {', '.join(got[:3])}" + (" ..." if len(got) > 3 else ""))
    state = _checkpoint_format(model, model.state_dict())
    count = 0
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                count += 1
                loaded = state.get(key)
                if loaded is None:
                    problems.append(f"{key} is exported but not in the loaded model")
                    continue
                want = fh.get_tensor(key)
                if want.dtype != loaded.dtype:  # the load cast it (config dtype, or modules kept in float32)
                    want = want.to(loaded.dtype)
                if tuple(want.shape) != tuple(loaded.shape) or not torch.equal(
                    _bits(want, torch), _bits(loaded, torch)
                ):
                    problems.append(f"{key} as loaded differs from the exported tensor")
    return {**done, "tensors": count, "problems": problems}


def _checkpoint_format(model, state: dict) -> dict:
    """The loaded state in the checkpoint's names, as save_pretrained writes it: transformers >= 5 fuses some
    weights as it loads (MoE experts into one tensor per projection) and reverts that on save."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: loads names as they are
        return state
    return dict(revert_weight_conversion(model, dict(state)))


def _bits(t, torch):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
