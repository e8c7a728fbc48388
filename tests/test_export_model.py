"""Issue 26: export is verified as a model. Attacks through the real CLI (a subprocess) on copies of the trainer's
verl tree: an export transformers cannot load as written is refused (exit 1, nothing at --to) or, with
--allow-unverified, written and marked unverified (JSON, marker, catalog). For each broken case the test also runs
transformers' own load of the unverified export, so the refusal is what the library does; a clean export says it was
loaded with transformers. The config check itself is torch-free: shown in a child where torch cannot be imported.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_no_torch import NO_TORCH

from ckpt_audit.export.model import expected_tensors

MARKER = ".ckpt-audit-export.json"


# not cli_proc.ckpt_audit: `prelude` runs in the child before main (through -c), which `-m` cannot
def cli(catalog: Path, *args: object, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nfrom ckpt_audit.cli import main\nmain()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "CKPT_AUDIT_CATALOG": str(catalog)},
    )


def edit_config(step: Path, **changes) -> None:
    path = step / "actor" / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}, indent=2))


def refused(proc: subprocess.CompletedProcess, out: Path, needle: str) -> None:
    """Exit 1, one line naming the finding, and nothing at --to or beside it (no half-written work directory)."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt-audit: error: refusing to export what transformers"), lines
    assert needle in lines[0] and "--allow-unverified" in lines[0], lines
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def unverified(catalog: Path, step: Path, out: Path, code: str) -> dict:
    """--allow-unverified writes it, says it is not verified (JSON, marker, catalog) and names the finding."""
    proc = cli(catalog, "export", step, "--to", out, "--allow-unverified", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verified"] is False and doc["model_check"] == "failed", doc
    assert code in {f["code"] for f in doc["model_findings"]}, doc["model_findings"]
    marker = json.loads((out / MARKER).read_text())
    assert (marker["verified"], marker["model_check"]) == (False, "failed")
    row = sqlite3.connect(catalog).execute("SELECT verified FROM exports WHERE out_dir = ?", [str(out)]).fetchone()
    assert row == (0,)
    return doc


def transformers_load(out: Path):
    """What transformers itself does with the export: (model, loading info) or the exception it raises."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - the library's answer is what the test records
        return exc


@pytest.mark.slow  # copy_run of verl_run
def test_a_clean_export_is_verified_and_loaded_with_transformers(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    out = tmp_path / "hf"
    proc = cli(tmp_path / "c.db", "export", run / "global_step_6", "--to", out)
    assert proc.returncode == 0, proc.stderr
    assert "config.json agrees with the tensors; loaded with transformers" in proc.stdout, proc.stdout
    proc = cli(tmp_path / "c.db", "export", run / "global_step_6", "--to", out, "--force", "--json")
    doc = json.loads(proc.stdout)
    assert (doc["verified"], doc["model_check"], doc["model_findings"]) == (True, "transformers", [])
    assert doc["model_load"].startswith("loaded with transformers") and "(Qwen2ForCausalLM)" in doc["model_load"]
    assert json.loads((out / MARKER).read_text())["verified"] is True


@pytest.mark.slow
def test_a_step_without_huggingface_is_refused_before_anything_is_written(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    step = run / "global_step_6"
    shutil.rmtree(step / "actor" / "huggingface")
    out = tmp_path / "hf"
    refused(cli(tmp_path / "c.db", "export", step, "--to", out), out, "export-no-config")
    unverified(tmp_path / "c.db", step, out, "export-no-config")
    assert not (out / "config.json").exists()
    got = transformers_load(out)
    assert isinstance(got, ValueError) and "model_type" in str(got)  # transformers: "Unrecognized model"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [("hidden_size", 64, "27 tensor shape(s) disagree"), ("num_hidden_layers", 3, "12 tensor(s) the config implies")],
)
def test_config_sizes_that_disagree_with_the_tensors_are_refused(verl_run, copy_run, tmp_path, key, value, needle):
    run = copy_run(verl_run)
    step = run / "global_step_6"
    edit_config(step, **{key: value})
    out = tmp_path / "hf"
    refused(cli(tmp_path / "c.db", "export", step, "--to", out), out, f"export-config-mismatch: {needle}")
    doc = unverified(tmp_path / "c.db", step, out, "export-config-mismatch")
    assert f"{key} {value}" in doc["model_findings"][0]["message"]
    assert "transformers load not run" in doc["model_load"]
    assert isinstance(transformers_load(out), Exception)  # sizes: mismatched shapes; layers: layer_types too short
    if key == "num_hidden_layers":  # with a config transformers accepts, layer 2 is random weights, reported missing
        edit_config(step, layer_types=["full_attention"] * 3)
        shutil.rmtree(out)
        refused(cli(tmp_path / "c.db", "export", step, "--to", out), out, "model.layers.2.")
        unverified(tmp_path / "c.db", step, out, "export-config-mismatch")
        _model, info = transformers_load(out)
        assert any(k.startswith("model.layers.2.") for k in info["missing_keys"]), info


@pytest.mark.slow
def test_tie_word_embeddings_flipped_is_refused(verl_run, copy_run, tmp_path):
    """The trainer's model has its own lm_head; a config saying the embeddings are tied contradicts the weights."""
    run = copy_run(verl_run)
    step = run / "global_step_6"
    edit_config(step, tie_word_embeddings=True)
    out = tmp_path / "hf"
    refused(cli(tmp_path / "c.db", "export", step, "--to", out), out, "tie_word_embeddings is true")
    unverified(tmp_path / "c.db", step, out, "export-config-mismatch")


@pytest.mark.slow
def test_a_load_transformers_refuses_is_refused_although_the_names_agree(verl_run, copy_run, tmp_path):
    """Qwen2 names and sizes, but architectures names Qwen3 (q_norm, k_norm, no biases): only the load sees it."""
    run = copy_run(verl_run)
    step = run / "global_step_6"
    edit_config(step, architectures=["Qwen3ForCausalLM"])
    out = tmp_path / "hf"
    refused(cli(tmp_path / "c.db", "export", step, "--to", out), out, "export-load-failed: transformers")
    doc = unverified(tmp_path / "c.db", step, out, "export-load-failed")
    assert "(Qwen3ForCausalLM)" in doc["model_findings"][0]["message"]


@pytest.mark.slow
def test_without_torch_the_config_check_still_refuses_and_says_the_load_did_not_run(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    out = tmp_path / "hf"
    proc = cli(tmp_path / "c.db", "export", run / "global_step_6", "--to", out, "--json", prelude=NO_TORCH)
    doc = json.loads(proc.stdout)
    assert (doc["verified"], doc["model_check"]) == (True, "config"), doc
    assert doc["model_load"] == "transformers load not run: transformers is not installed"
    edit_config(run / "global_step_4", tie_word_embeddings=True)
    out = tmp_path / "hf4"
    proc = cli(tmp_path / "c.db", "export", run / "global_step_4", "--to", out, prelude=NO_TORCH)
    refused(proc, out, "tie_word_embeddings is true")


@pytest.mark.slow
def test_max_load_size_0_and_no_verify_skip_the_load_and_say_so(verl_run, copy_run, tmp_path):
    run = copy_run(verl_run)
    step = run / "global_step_6"
    for flags, why in ((["--max-load-size", "0"], "over --max-load-size"), (["--no-verify"], "(--no-verify)")):
        out = tmp_path / flags[0].strip("-")
        proc = cli(tmp_path / "c.db", "export", step, "--to", out, "--json", *flags)
        doc = json.loads(proc.stdout)
        assert doc["model_check"] == "config" and why in doc["model_load"], doc["model_load"]


def _meta_model(config_cls, arch: str = "ForCausalLM", **kw):
    import torch
    import transformers

    config = config_cls(
        vocab_size=37,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )
    family = config_cls.__name__.removesuffix("Config")
    with torch.device("meta"):
        model = getattr(transformers, family + arch)(config)
    config.architectures = [family + arch]
    return model, json.loads(config.to_json_string())


@pytest.mark.parametrize(
    ("family", "arch", "kw"),
    [
        ("Llama", "ForCausalLM", {}),
        ("Llama", "ForCausalLM", {"attention_bias": True, "mlp_bias": True, "head_dim": 16}),
        ("Qwen2", "ForCausalLM", {"tie_word_embeddings": True}),
        ("Qwen2", "ForTokenClassification", {"num_labels": 1}),
        ("Qwen3", "ForCausalLM", {"attention_bias": True}),
        ("Mistral", "ForCausalLM", {"tie_word_embeddings": False}),
        ("Qwen2Moe", "ForCausalLM", {"num_experts": 3, "moe_intermediate_size": 24, "mlp_only_layers": [1]}),
        ("Qwen2Moe", "ForCausalLM", {"num_experts": 2, "shared_expert_intermediate_size": 8, "qkv_bias": False}),
        ("Qwen3Moe", "ForCausalLM", {"num_experts": 3, "decoder_sparse_step": 2, "attention_bias": True}),
        ("Mixtral", "ForCausalLM", {"num_local_experts": 3}),
    ],
)
def test_the_names_and_shapes_expected_are_what_transformers_builds(family, arch, kw):
    """The torch-free template against the modeling code itself (a model on the meta device: no weights)."""
    import transformers

    model, config = _meta_model(getattr(transformers, f"{family}Config"), arch, **kw)
    from transformers.core_model_loading import revert_weight_conversion

    # in the names save_pretrained writes: transformers 5 fuses MoE experts on load and splits them back on save
    built = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    if config.get("tie_word_embeddings") and arch == "ForCausalLM":
        built.pop("lm_head.weight")  # save_pretrained writes a tied head once, as the embedding
    assert expected_tensors(config) == built


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_kill_9_during_transformers_load_ends_the_loader_and_leaves_nothing_at_to(verl_run, copy_run, tmp_path):
    """The load runs in a child of the export; SIGKILL of the export while it loads ends that child too (it dies
    with its parent), nothing is at --to, and the next export reclaims the hidden work directory."""
    import signal
    import time

    run = copy_run(verl_run)
    out = tmp_path / "hf"
    env = {**os.environ, "CKPT_AUDIT_CATALOG": str(tmp_path / "c.db")}
    args = [sys.executable, "-m", "ckpt_audit", "export", str(run / "global_step_6"), "--to", str(out)]
    export = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    loader = None
    deadline = time.monotonic() + 120
    while loader is None and time.monotonic() < deadline and export.poll() is None:
        for pid in _children(export.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"transformers_load.py" in fh.read():
                    loader = pid
        time.sleep(0.02)
    assert loader is not None, "the export never started transformers' load"
    export.send_signal(signal.SIGKILL)
    export.wait()
    deadline = time.monotonic() + 10
    while _alive(loader) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(loader)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf.ckpt-audit-tmp-")]
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf.")]


@pytest.mark.parametrize("tied", [False, True])
def test_directories_transformers_saves_pass_the_check_and_a_changed_size_fails_it(tmp_path, tied):
    """save_pretrained's own output (a Qwen2 in the template, a GPT-2 checked generically by its n_layer/n_embd) is a
    model by the check; the same with one size changed in config.json is not."""
    import transformers

    from ckpt_audit.export.model import check_config

    qwen = transformers.Qwen2Config(
        vocab_size=37, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    gpt2 = transformers.GPT2Config(vocab_size=37, n_embd=16, n_layer=2, n_head=4, n_positions=32)
    for name, model in (("qwen2", transformers.Qwen2ForCausalLM(qwen)), ("gpt2", transformers.GPT2LMHeadModel(gpt2))):
        out = tmp_path / name
        model.save_pretrained(out)
        checked = check_config(out, out)
        assert checked.findings == () and bool(checked.notes) == (name == "gpt2"), (name, checked)
        config = json.loads((out / "config.json").read_text())
        key = "num_hidden_layers" if name == "qwen2" else "n_layer"
        (out / "config.json").write_text(json.dumps({**config, key: 3}))
        codes = {f.code for f in check_config(out, out).findings}
        assert codes == {"export-config-mismatch"}, (name, codes)


@pytest.mark.parametrize(
    ("family", "kw", "size"),
    [
        ("Qwen2Moe", {"num_experts": 3, "moe_intermediate_size": 12, "shared_expert_intermediate_size": 8}, "moe"),
        ("Qwen3Moe", {"num_experts": 3, "moe_intermediate_size": 12}, "moe"),  # saved as num_local_experts
        ("Mixtral", {"num_local_experts": 3}, "intermediate_size"),
    ],
)
def test_moe_directories_transformers_saves_pass_the_check_and_a_wrong_expert_size_fails_it(tmp_path, family, kw, size):
    """Experts in the names save_pretrained writes (transformers 5 splits its fused experts back on save); the expert
    width, the expert count and a config without an expert count are each caught."""
    import transformers

    from ckpt_audit.export.model import check_config

    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=37, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, **kw,
    )  # fmt: skip
    getattr(transformers, f"{family}ForCausalLM")(cfg).save_pretrained(tmp_path)
    checked = check_config(tmp_path, tmp_path)
    assert checked.findings == () and checked.notes == (), checked
    config = json.loads((tmp_path / "config.json").read_text())
    experts = "num_local_experts" if "num_local_experts" in config else "num_experts"
    key = "moe_intermediate_size" if size == "moe" else size
    for change, needle in (
        ({key: config[key] + 1}, "tensor shape(s) disagree with the config"),
        ({experts: 2}, "exported tensor(s) the config does not describe"),
        ({experts: 10**9}, f"{experts} is 1000000000, more than the"),
        ({experts: None}, "config.json gives no num_experts or num_local_experts"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        found = check_config(tmp_path, tmp_path).findings
        assert {f.code for f in found} == {"export-config-mismatch"}, (change, found)
        assert any(needle in f.message for f in found), (change, found)


@pytest.mark.slow  # three CLI exports, two with transformers' load
def test_a_float_the_config_dtype_would_round_is_refused_and_a_widened_one_is_not(tmp_path):
    """A tiny Qwen2 saved as W=1 plain tensors (test_export_trees.write_plain). Mostly bf16 with a float32 norm: the
    export's config says bfloat16 and transformers' load would round the norm, so refused; --dtype bf16 makes it one
    dtype. Mostly float32 with a bf16 norm: widened exactly on load, so verified."""
    import torch
    from test_export_trees import write_plain

    run = write_plain(tmp_path / "run")
    shard = run / "global_step_1" / "actor" / "model_world_size_1_rank_0.pt"
    state = torch.load(shard, weights_only=True)
    norm = "model.norm.weight"
    torch.save({k: v if k == norm else v.bfloat16() for k, v in state.items()}, shard)
    out = tmp_path / "bf16"
    refused(cli(tmp_path / "c.db", "export", run / "global_step_1", "--to", out), out, f"e.g. {norm} (float32)")
    doc = json.loads(
        cli(tmp_path / "c.db", "export", run / "global_step_1", "--to", out, "--dtype", "bf16", "--json").stdout
    )
    assert (doc["verified"], doc["model_check"]) == (True, "transformers"), doc

    torch.save({k: v.bfloat16() if k == norm else v for k, v in state.items()}, shard)
    out = tmp_path / "f32"
    doc = json.loads(cli(tmp_path / "c.db", "export", run / "global_step_1", "--to", out, "--json").stdout)
    assert (doc["dtype"], doc["verified"], doc["model_check"]) == ("float32", True, "transformers"), doc
