"""The torch-free export engine against its oracle: every trainer tree and every hand-made edge case exported with
engine="stream" and engine="torch" must give byte-identical files (safetensors, index, config), the same hashes and
the same warnings. The torch engine is itself checked against torch.cat of the shards and transformers' logits in
test_export.py, so equal bytes carry that check over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_export_trees import write_plain, write_raw

from ckpt_audit.export.guard import MARKER, ExportError
from ckpt_audit.export.orchestrator import export_checkpoint
from ckpt_audit.export.stream_copy import _cast


def latest_step(run: Path) -> Path:
    return run / f"global_step_{int((run / 'latest_checkpointed_iteration.txt').read_text())}"


def both(step: Path, out: Path, **kw):
    """Export `step` with each engine; assert the two directories are byte-identical; return the stream result.
    transformers' load of the export is left out (max_load_size 0): the bytes are the point here, and
    test_export_model.py checks the load."""
    kw.setdefault("max_load_size", 0)
    got = {}
    for engine in ("stream", "torch"):
        got[engine] = export_checkpoint(step, out / engine, engine=engine, **kw)
    s, t = got["stream"], got["torch"]
    a, b = Path(s.out_dir), Path(t.out_dir)
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file() and p.name != MARKER)
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file() and p.name != MARKER)
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    assert [(os.path.relpath(f.path, a), f.size_bytes, f.hash) for f in s.files] == [
        (os.path.relpath(f.path, b), f.size_bytes, f.hash) for f in t.files
    ]
    assert (s.tensors, s.total_bytes, s.dtype, s.world_size, s.source_kind) == (
        t.tensors,
        t.total_bytes,
        t.dtype,
        t.world_size,
        t.source_kind,
    )
    assert [w.replace(s.out_dir, "OUT") for w in s.warnings] == [w.replace(t.out_dir, "OUT") for w in t.warnings]
    assert s.read_back == t.read_back and s.verified == t.verified and s.model_check == t.model_check
    return s


@pytest.mark.parametrize("fixture", ["verl_run", "verl_run_w3", "verl_run_hsdp", "verl_run_w1"])
@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_every_trainer_tree_exports_byte_identical_to_the_torch_engine(request, tmp_path, fixture, dtype):
    step = latest_step(Path(request.getfixturevalue(fixture)))
    result = both(step, tmp_path, dtype=dtype)
    assert result.verified and result.tensors > 0


def test_critic_sft_and_sharded_index_byte_identical(verl_run_critic, verl_run_sft, verl_run, tmp_path):
    both(latest_step(verl_run_critic), tmp_path / "critic", role="critic")
    both(latest_step(verl_run_sft), tmp_path / "sft")
    result = both(latest_step(verl_run), tmp_path / "split", dtype="bf16", max_shard_size=20_000)
    assert (Path(result.out_dir) / "model.safetensors.index.json").is_file()
    assert both(latest_step(verl_run), tmp_path / "nv", verify=False).read_back is False


@pytest.mark.slow  # write_raw: a 3-process gloo group
def test_empty_trailing_shards_and_plain_tensors_byte_identical(tmp_path):
    raw = write_raw(tmp_path / "raw", 3)  # Shard(0) 2/2/0 and Shard(1) 3/3/1
    for dtype in (None, "bf16", "fp16", "fp32"):
        both(raw, tmp_path / f"raw-{dtype}", dtype=dtype, allow_unverified=True)  # tensors, not a model
    plain = latest_step(write_plain(tmp_path / "plain"))  # W=1 NO_SHARD, tied embeddings
    both(plain, tmp_path / "plain-out", dtype="bf16")


def _one_rank(tmp_path: Path, sd: dict, **config) -> Path:
    actor = tmp_path / "run" / "global_step_1" / "actor"
    (actor / "huggingface").mkdir(parents=True, exist_ok=True)
    (actor / "huggingface" / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    torch.save(sd, actor / "model_world_size_1_rank_0.pt")
    return actor.parent


def test_views_strides_offsets_dtypes_and_scalars_byte_identical(tmp_path):
    """Tensors that are not their storage: a transposed view, a slice at an offset sharing its storage, a 0-d
    scalar, integer and bool tensors (never cast), bf16/fp16 sources, NaN, inf and subnormals."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(8, 6, generator=g)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -0.0, 65520.0, 3.0e38, 1.0])
    sd = {
        "t": big.t(),
        "slice": big[2:5],
        "scalar": torch.tensor(3.5),
        "ids": torch.arange(10),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(5, 3, generator=g).half(),
        "brain": torch.randn(4, 4, generator=g).bfloat16(),
        "special": special,
        "empty": torch.zeros(0, 4),
    }
    step = _one_rank(tmp_path, sd)
    for dtype in (None, "bf16", "fp16", "fp32"):
        both(step, tmp_path / f"out-{dtype}", dtype=dtype, allow_unverified=True)  # tensors, not a model


def test_tied_lora_and_hf_weights_byte_identical(tmp_path):
    emb = torch.randn(6, 4)
    tied = _one_rank(
        tmp_path / "tied", {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()}, tie_word_embeddings=True
    )
    assert both(tied, tmp_path / "tied-out", allow_unverified=True).tensors == 1  # not a model: no sizes
    untied = _one_rank(
        tmp_path / "untied", {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1}, tie_word_embeddings=True
    )
    untied_out = both(untied, tmp_path / "untied-out", allow_unverified=True)
    assert any("differs from embed_tokens" in w for w in untied_out.warnings)

    lora = _one_rank(
        tmp_path / "lora",
        {
            "base_model.model.model.q.base_layer.weight": torch.randn(8, 8),
            "base_model.model.model.q.lora_A.default.weight": torch.randn(2, 8),
            "base_model.model.model.q.lora_B.default.weight": torch.randn(8, 2),
        },
    )
    (lora / "actor" / "lora_adapter").mkdir()
    (lora / "actor" / "lora_adapter" / "adapter_config.json").write_text('{"r": 2}')
    assert both(lora, tmp_path / "lora-out", allow_unverified=True).lora_dir

    actor = tmp_path / "mega" / "global_step_5" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "config.json").write_text('{"model_type": "llama"}')
    save_file(
        {"b": torch.randn(3, 4), "a": torch.randn(5).bfloat16()}, str(actor / "huggingface" / "model.safetensors")
    )
    assert both(actor.parent, tmp_path / "mega-out", dtype="fp16", allow_unverified=True).source_kind == "hf-weights"


def test_a_cast_streaming_cannot_do_exactly_falls_back_to_torch_or_is_refused(tmp_path):
    step = _one_rank(tmp_path, {"w": torch.randn(4, 4, dtype=torch.float64)})
    auto = export_checkpoint(step, tmp_path / "auto", dtype="bf16", allow_unverified=True)
    assert any(w.startswith("exported with torch: w: a float64 to bfloat16 cast") for w in auto.warnings)
    with pytest.raises(ExportError, match="needs the torch engine"):
        export_checkpoint(step, tmp_path / "stream", dtype="bf16", engine="stream", allow_unverified=True)
    assert not (tmp_path / "stream").exists()
    f32 = both(step, tmp_path / "f32", dtype="fp32", allow_unverified=True)
    assert f32.dtype == "float32"  # float64 -> float32 streams


def test_casts_match_torch_bit_for_bit_on_every_kind_of_value():
    """Random bit patterns cover normals, subnormals, infinities and overflow; NaNs must stay NaN (their exact bits
    follow torch's CPU kernel of the day, so they are checked apart)."""
    bits = np.random.default_rng(0).integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    f32 = torch.from_numpy(bits.view(np.float32).copy())
    nan = torch.isnan(f32).numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        for dst, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            want = f32.to(tdt).view(torch.int16).numpy().view(np.uint16)
            got = _cast(bits.view(np.float32), "float32", dst).view(np.uint16)
            assert np.array_equal(got[~nan], want[~nan]), dst
            back = _cast(got.view(np.float16) if dst == "float16" else got, dst, "float32")  # back, exactly
            assert np.array_equal(back.view(np.uint32)[~nan], f32.to(tdt).float().numpy().view(np.uint32)[~nan])
            assert np.isnan(back[nan]).all()
        halves = torch.from_numpy((bits & 0xFFFF).astype(np.uint16).view(np.int16)).view(torch.float16)
        want = halves.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        got = _cast(halves.view(torch.int16).numpy().view(np.float16), "float16", "bfloat16").view(np.uint16)
        hnan = torch.isnan(halves).numpy()
        assert np.array_equal(got[~hnan], want[~hnan])


def test_the_stream_engine_never_imports_torch(verl_run, tmp_path):
    step = latest_step(verl_run)
    code = (
        "import sys; from ckpt_audit.export.orchestrator import export_checkpoint; "
        f"r = export_checkpoint({str(step)!r}, {str(tmp_path / 'hf')!r}, dtype='bf16', engine='stream'); "
        "assert r.verified; bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_plain_byte_copies_need_no_numpy_and_equal_the_torch_engine(tmp_path):
    """Tensors whose output is runs of their pieces' bytes (no cast; C order: every tensor of an FSDP2 or Megatron
    checkpoint) are read straight into the copy's buffer, so numpy (~0.2 s to import) is never loaded; a cast or a
    view that is not in C order still goes through numpy."""
    g = torch.Generator().manual_seed(1)
    sd = {
        "w": torch.randn(300, 70, generator=g),
        "ids": torch.arange(10),
        "s": torch.tensor(2.0),
        "e": torch.zeros(0, 3),
    }
    step = _one_rank(tmp_path, sd)
    both(step, tmp_path / "same", allow_unverified=True)  # tensors, not a model
    code = (
        "import sys; from ckpt_audit.export.orchestrator import export_checkpoint; "
        "r = export_checkpoint(sys.argv[1], sys.argv[2], dtype=sys.argv[3] or None, engine='stream', "
        "allow_unverified=True); assert r.read_back; print('numpy' in sys.modules)"
    )
    loaded = {}
    for dtype in ("", "bf16"):
        proc = subprocess.run(
            [sys.executable, "-c", code, str(step), str(tmp_path / f"np-{dtype}"), dtype],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        loaded[dtype] = proc.stdout.strip()
    assert loaded == {"": "False", "bf16": "True"}


def test_a_payload_changed_after_the_check_fails_its_crc_in_the_copy(verl_run, copy_run, tmp_path):
    """The stream compares each copied storage with the CRC-32 torch recorded: a byte flipped between the source
    check and the copy (simulated by flipping it in a copy and skipping the guard's re-read) is caught."""
    from ckpt_audit.export.fsdp_shards import plan_shards
    from ckpt_audit.export.stream_plan import StreamError
    from ckpt_audit.export.stream_write import export_tensors

    step = latest_step(copy_run(verl_run))
    shard = step / "actor" / "model_world_size_2_rank_0.pt"
    files = {0: shard, 1: step / "actor" / "model_world_size_2_rank_1.pt"}
    plan = plan_shards(files, 2, step / "actor")
    piece = next(p for t in plan.tensors for p in t.pieces if p.entry is not None and p.path == str(shard))
    with open(shard, "r+b") as fh:
        fh.seek(piece.offset)
        b = fh.read(1)
        fh.seek(piece.offset)
        fh.write(bytes([b[0] ^ 0x40]))
    (tmp_path / "w").mkdir()
    with pytest.raises(StreamError, match="fails its CRC-32"):
        export_tensors(
            plan,
            tmp_path / "w",
            target=None,
            max_shard_size=10**12,
            verify=True,
            tie=False,
            tick=lambda n: None,
            read_tick=lambda: None,
        )
