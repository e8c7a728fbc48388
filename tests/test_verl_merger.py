"""`export` against verl 0.9.1's own Megatron model merger, run on CPU (tests/_verl_merger.py: its CUDA calls and
Transformer Engine stubbed, one cached run per case) on the trees verl's MegatronCheckpointManager wrote
(tests/_verl_megatron_export.py).

The merger builds the model in bfloat16 (verl's config converter is called with `torch.bfloat16`) and saves that,
so its output is compared with `export --dtype bf16`: keys, shapes, dtypes and bytes. `export --check` is run on the
merger's output as a user would, against the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from cli_json import codes_of, findings_of, scan_json, statuses
from conftest import build_cached, writer_key
from safetensors import safe_open
from test_export_megatron import _cli, _step, mgx  # noqa: F401  (mgx: the cached export trees, a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        find_spec("megatron") is None or find_spec("verl") is None or find_spec("transformers") is None,
        reason="needs the 'megatron', 'verl' and 'transformers' extras",
    ),
]

HERE = Path(__file__).parent
RUNNER = HERE / "_verl_merger.py"
sys.path.insert(0, str(HERE))
import _verl_merger as M  # noqa: E402


@pytest.fixture(scope="session")
def merged(tmp_path_factory, mgx) -> Path:  # noqa: F811
    pkgs = ("torch", "megatron-core", "verl", "transformers", "tokenizers")
    key = hashlib.sha256(f"{writer_key(RUNNER, pkgs)}:{mgx.name}".encode()).hexdigest()[:16]
    return build_cached(tmp_path_factory, "verl_merger", M.merge_cases, key=key, mgx=mgx)


def _tensors(hf: Path) -> dict[str, tuple]:
    """name -> (dtype, shape, raw bytes) of every tensor in a safetensors directory."""
    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                t = s.get_tensor(k).contiguous()
                out[k] = (t.dtype, tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def bf16_export(mgx, tmp_path_factory):  # noqa: F811
    """tree -> the tensors of its `export --dtype bf16`, each exported once."""
    done: dict[str, dict] = {}

    def export(tree: str) -> dict[str, tuple]:
        if tree not in done:
            to = tmp_path_factory.mktemp("ours") / tree
            args = ("--to", to, "--hf-config", mgx / tree / "base_model", "--dtype", "bf16")
            proc = _cli(_step(mgx, tree), *args, catalog=to.parent / "c.db")
            assert proc.returncode == 0, proc.stderr
            done[tree] = _tensors(to)
        return done[tree]

    return export


def _check(mgx: Path, tree: str, hf: Path, catalog: Path):  # noqa: F811
    return _cli(_step(mgx, tree), "--check", hf, "--hf-config", mgx / tree / "base_model", catalog=catalog)


@pytest.mark.parametrize(
    "case, tree",
    [
        ("qwen2-tied", "qwen2-tied"),
        ("qwen2-tied-no-flag", "qwen2-tied"),
        ("llama-untied", "llama-untied"),
        ("llama-pp2", "llama-pp2"),
    ],
)
def test_merger_output_equals_the_export_and_passes_check(mgx, merged, bf16_export, tmp_path, case, tree):  # noqa: F811
    """Dense, with the flag right (and left out on a tied model, where it does not matter: megatron-core holds no
    output layer and transformers' save drops the tied lm_head): the same tensors, bit for bit."""
    assert json.loads((merged / "results.json").read_text())[case]["rc"] == 0
    theirs = _tensors(merged / case / "hf")
    ours = bf16_export(tree)
    assert theirs.keys() == ours.keys() and theirs == ours
    assert ("lm_head.weight" in ours) is tree.startswith("llama")
    proc = _check(mgx, tree, merged / case / "hf", tmp_path / "c.db")
    assert proc.returncode == 0 and "bit for bit" in proc.stdout, proc.stdout + proc.stderr


def test_wrong_tie_flag_drops_lm_head_and_check_names_it(mgx, merged, bf16_export, tmp_path):  # noqa: F811
    """`--tie-word-embedding` on an untied model: the merger exits 0 without lm_head (transformers would then start
    the head from random weights); everything else equals the export, and `export --check` exits 1 naming it."""
    assert json.loads((merged / "results.json").read_text())["llama-untied-tie-flag"]["rc"] == 0
    theirs = _tensors(merged / "llama-untied-tie-flag" / "hf")
    ours = bf16_export("llama-untied")
    assert ours.keys() - theirs.keys() == {"lm_head.weight"}
    assert theirs == {k: v for k, v in ours.items() if k != "lm_head.weight"}
    proc = _check(mgx, "llama-untied", merged / "llama-untied-tie-flag" / "hf", tmp_path / "c.db")
    assert proc.returncode == 1 and "lm_head.weight: missing" in proc.stdout + proc.stderr


def test_moe_merger_names_sequential_experts_that_transformers_does_not_load(mgx, merged, bf16_export, tmp_path):  # noqa: F811
    """Qwen3-MoE, TP=2 / EP=2: verl's merger renames only grouped-GEMM expert names (`...weightE`); megatron-core's
    sequential experts (the local spec's, what these trees hold) come out as `mlp.experts.local_experts.E.*`, names
    transformers does not know. Renamed, every tensor equals the export's; `export --check` refuses the names."""
    assert json.loads((merged / "results.json").read_text())["qwen3moe"]["rc"] == 0
    theirs = _tensors(merged / "qwen3moe" / "hf")
    ours = bf16_export("qwen3moe")
    assert any(".local_experts." in k for k in theirs)
    assert {re.sub(r"\.experts\.local_experts\.", ".experts.", k): v for k, v in theirs.items()} == ours
    proc = _check(mgx, "qwen3moe", merged / "qwen3moe" / "hf", tmp_path / "c.db")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "model.layers.0.mlp.experts.0.gate_proj.weight: missing" in out


def test_merger_on_the_old_layout(merged, tmp_path):
    """verl <= 0.8's layout: the merger fails on its config path (it reads model/huggingface/) and leaves the tree
    as it was. With huggingface/ moved there by hand, it creates an empty model/dist_ckpt/ in the checkpoint it reads
    and fails. verl's load of that role (it has model/, so no migration error) fails on the same empty directory,
    and the scan says the step is incomplete, naming it."""
    results = json.loads((merged / "results.json").read_text())
    old = merged / "old-layout" / "exp" / M.STEP / "actor"
    assert results["old-layout"]["error"].startswith("OSError") and not (old / "model").exists()
    moved = merged / "old-layout-hf-moved" / "exp"
    assert "is not a distributed checkpoint" in results["old-layout-hf-moved"]["error"]
    assert not any((moved / M.STEP / "actor" / "model" / "dist_ckpt").iterdir())
    shutil.copytree(moved, tmp_path / "run" / "exp")
    doc = scan_json(tmp_path / "run", tmp_path / "c.db")
    assert statuses(doc) == {1: "incomplete"}
    assert "megatron-v2-content-missing" in codes_of(doc, 1)
    assert any(f["path"].endswith("actor/model/dist_ckpt") for f in findings_of(doc, 1))
