"""Export of DeepSpeed ZeRO checkpoints (export/zero.py) on trees DeepSpeed itself writes, through the real
CLI in a child where `import torch` fails, compared tensor by tensor with DeepSpeed's own reconstruction.

tests/_write_deepspeed_export.py writes ZeRO 1, 2 and 3, fp32 and bf16, 2 gloo ranks, each save loaded back by
DeepSpeed; its model has the cases zero_to_fp32 treats specially (float and int buffers, a bf16 buffer it makes
float32, a frozen parameter, a tied weight, sizes that leave alignment and partition padding). The HF Trainer tree
(test_deepspeed.hf_ds, ZeRO-2) proves the export is a model transformers loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cli_proc import ckpt_audit
from conftest import build_cached, writer_key
from test_deepspeed import _write, hf_ds  # noqa: F401  hf_ds: the HF Trainer + DeepSpeed tree fixture
from test_no_torch import BLOCK

WRITER = Path(__file__).with_name("_write_deepspeed_export.py")
CASES = ("z1", "z2", "z2bf16", "z3", "z3bf16")


@pytest.fixture(scope="session")
def ds_export(tmp_path_factory) -> Path:
    """{case: save dir} for tests/_write_deepspeed_export.py's CASES (one 2-process run, cached)."""
    import deepspeed  # noqa: F401  the test extra installs it

    key = writer_key(WRITER, ("torch", "deepspeed"))
    return build_cached(tmp_path_factory, "deepspeed_export", lambda d: _write(WRITER, d / "out"), key=key) / "out"


def export(src: Path, to: Path, *args: object) -> subprocess.CompletedProcess:
    """`ckpt-audit export SRC --to TO --json ARGS` in a child that cannot import torch or transformers."""
    argv = ["export", src, "--to", to, "--json", *args]
    return subprocess.run([sys.executable, "-c", BLOCK, *map(str, argv)], capture_output=True, text=True, timeout=300)


def deepspeed_fp32(save_dir: Path) -> dict:
    """DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint (the tag `latest` names), its prints silenced."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(save_dir))


def assert_bit_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), name
        assert g.contiguous().view(-1).view(dtype=_u8()).equal(w.contiguous().view(-1).view(dtype=_u8())), name


def _u8():
    import torch

    return torch.uint8


def exported(to: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(to / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fp32_export_equals_deepspeeds_own_reconstruction_bit_for_bit(ds_export, case, tmp_path):
    to = tmp_path / "hf"
    res = export(ds_export / case, to, "--allow-unverified", "--catalog", tmp_path / "c.db")  # no config.json
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    stage = case[1]
    assert doc["source_kind"] == f"deepspeed-zero{stage}-fp32" and doc["read_back"] is True
    assert doc["source"] == str((ds_export / case / "global_step2").resolve())  # the tag `latest` names
    want = deepspeed_fp32(ds_export / case)
    assert {"scale", "seen", "shift", "up.bias"} <= set(want)  # the tree has what the test is for
    assert_bit_equal(exported(to), want)
    # ZeRO-1 saves no frozen_param_shapes, so DeepSpeed's reconstruction (and so the export) has no frozen.*: said
    lost = [w for w in doc["warnings"] if "not in DeepSpeed's fp32 reconstruction" in w]
    assert ("frozen.weight" in want) == (not lost), doc["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["z1", "z2bf16"])
def test_module_export_equals_the_modules_saved_weights(ds_export, case, tmp_path):
    import torch

    to = tmp_path / "hf"
    res = export(ds_export / case / "global_step2", to, "--weights", "module", "--allow-unverified")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["source_kind"] == "deepspeed-module"
    states = ds_export / case / "global_step2" / "mp_rank_00_model_states.pt"
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]  # our own test tree
    assert_bit_equal(exported(to), dict(module))
    if case == "z2bf16":
        assert exported(to)["up.weight"].dtype == torch.bfloat16  # the 16-bit weights, not the fp32 master


@pytest.mark.slow
def test_zero3_module_weights_are_refused_with_the_way_out(ds_export, tmp_path):
    to = tmp_path / "hf"
    res = export(ds_export / "z3", to, "--weights", "module", "--allow-unverified")
    assert res.returncode == 3, res.stderr
    assert "ZeRO-3 saves no module weights" in res.stderr and "--weights fp32" in res.stderr
    assert not to.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_hf_trainer_deepspeed_checkpoint_exports_a_model_transformers_loads(hf_ds, tmp_path):  # noqa: F811
    ckpt = hf_ds / "checkpoint-4"
    db = tmp_path / "c.db"
    scanned = ckpt_audit("scan", "-q", "--catalog", db, hf_ds)
    assert scanned.returncode == 0, scanned.stderr
    to = tmp_path / "hf"
    # transformers' own load is part of the verdict, so this one runs where transformers can be imported
    res = ckpt_audit("export", ckpt, "--to", to, "--weights", "fp32", "--json", "--catalog", db)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["verified"] is True and doc["model_check"] == "transformers" and doc["source_check"] == "manifest"
    assert doc["role_dir"] == str((ckpt / "global_step4").resolve())
    want = deepspeed_fp32(ckpt)
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(want)  # tied: one of them from shared_params
    assert_bit_equal(exported(to), want)
    with sqlite3.connect(db) as con:
        [(kind, out)] = con.execute("SELECT source_kind, out_dir FROM exports").fetchall()
    assert (kind, out) == ("deepspeed-zero2-fp32", str(to))


def _drop_rank1(tag: Path) -> str:
    next(tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")).unlink()
    return "missing optimizer shard(s) for rank 1 of 2"


def _truncate_rank1(tag: Path) -> str:
    p = next(tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    os.truncate(p, p.stat().st_size // 2)
    return "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _two_spellings(tag: Path) -> str:
    p = next(tag.glob("zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    p.rename(p.with_name("bf16_" + p.name))
    return "optimizer shards in two spellings"


def _latest_names_a_missing_tag(tag: Path) -> str:
    (tag.parent / "latest").write_text("global_step9")
    return "latest names global_step9, which holds no DeepSpeed model states"


@pytest.mark.slow
@pytest.mark.parametrize(
    "cut", [_drop_rank1, _truncate_rank1, _two_spellings, _latest_names_a_missing_tag], ids=lambda f: f.__name__[1:]
)
def test_a_damaged_source_is_refused_in_one_line_and_nothing_is_written(ds_export, cut, tmp_path):
    save = tmp_path / "runs" / "z2"
    shutil.copytree(ds_export / "z2", save)
    said = cut(save / "global_step2")
    to = tmp_path / "hf"
    res = export(save, to, "--allow-unverified")
    assert res.returncode in (1, 3), res.stderr  # 3: cannot be exported; 1: the source failed its check
    assert said in res.stderr and "Traceback" not in res.stderr
    assert not to.exists() and not list(tmp_path.glob(".hf.*"))


def test_weights_on_a_source_that_is_not_deepspeed_is_refused_in_one_line(tmp_path):
    from cli_json import invoke

    step = tmp_path / "runs" / "global_step_1"
    step.mkdir(parents=True)
    res = invoke("export", str(step), "--to", str(tmp_path / "hf"), "--weights", "module", catalog=tmp_path / "c.db")
    assert res.exit_code == 3, res.output
    assert "--weights applies to DeepSpeed checkpoints" in res.output and not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["z2", "z3"])
def test_check_accepts_the_export_and_names_a_one_ulp_change(ds_export, case, tmp_path):
    """`export --check` plans a DeepSpeed source as the export does (export_zero), then compares bit for bit."""
    import torch
    from safetensors.torch import save_file

    to = tmp_path / "hf"
    assert export(ds_export / case, to, "--allow-unverified").returncode == 0
    argv = ["export", str(ds_export / case), "--check", str(to)]
    same = subprocess.run([sys.executable, "-c", BLOCK, *argv], capture_output=True, text=True, timeout=300)
    assert same.returncode == 0 and "equal bit for bit" in same.stdout, same.stdout + same.stderr
    sd = exported(to)
    name = "up.weight"
    flat = sd[name].view(-1).view(torch.int32)
    flat[0] += 1  # one ulp of the first fp32 value
    save_file(sd, str(to / "model.safetensors"))
    diff = subprocess.run([sys.executable, "-c", BLOCK, *argv], capture_output=True, text=True, timeout=300)
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert any(ln.strip().startswith(f"{name}: values differ") for ln in diff.stdout.splitlines()), diff.stdout
