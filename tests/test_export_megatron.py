"""Export of Megatron dist_ckpt to HF safetensors, and `export --check`, on trees verl 0.9.1's own
MegatronCheckpointManager wrote (tests/_verl_megatron_export.py: one cached subprocess run, two gloo CPU processes).

Layouts: TP=2 (Qwen2 tied, Llama untied, Mistral, Qwen3 tied), TP=2 with EP=2 (Qwen3-MoE, Qwen2-MoE with its gated
shared expert, Mixtral), PP=2 (Llama). Each exported model is compared
with what the trainer held: every rank's `model.state_dict()` (megatron-core's own
names, its TP / EP pieces), converted to HF names here, independently of ckpt-audit (`reference`). The export must
equal it tensor by tensor, load in transformers with the same logits as a model loaded from the reference, and (dense
models) agree with megatron-core's own TP forward on the same tokens.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from cli_proc import ckpt_audit
from conftest import build_cached, writer_key
from safetensors.torch import load_file, save_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        find_spec("megatron") is None or find_spec("verl") is None or find_spec("transformers") is None,
        reason="needs the 'megatron', 'verl' and 'transformers' extras",
    ),
]

HERE = Path(__file__).parent
WRITER = HERE / "_verl_megatron_export.py"
sys.path.insert(0, str(HERE))
import _verl_megatron_export as W  # noqa: E402


def _write(dst: Path) -> None:
    subprocess.run([sys.executable, str(WRITER), str(dst)], check=True, capture_output=True, timeout=900)


@pytest.fixture(scope="session")
def mgx(tmp_path_factory) -> Path:
    key = writer_key(WRITER, ("torch", "megatron-core", "verl", "numpy", "transformers"))
    return build_cached(tmp_path_factory, "verl_megatron_export", _write, key=key)


def _step(mgx: Path, name: str) -> Path:
    return mgx / name / "exp" / f"global_step_{W.STEP}"


def _cli(*args, catalog: Path) -> subprocess.CompletedProcess:
    return ckpt_audit("export", *args, catalog=catalog, timeout=600)


def reference(mgx: Path, name: str) -> dict[str, torch.Tensor]:
    """The trainer's weights in HF names: TP pieces joined on the dim each layer splits (column-parallel rows,
    row-parallel columns), each rank's [gate; up] halves and per-group [q, k, v] rows split as megatron-core lays them
    out in one rank's parameter, local experts numbered by their expert-parallel rank, pipeline stages' layers
    numbered after the stages before them."""
    cfg = W.hf_config(name)
    ranks = [torch.load(mgx / name / "trainer" / f"rank{r}.pt") for r in range(W.WORLD)]
    stages = W.MODELS[name].get("pp", 1)
    by_tp: dict[int, dict] = {}
    for d in ranks:  # a pipeline stage numbers its layers from 0: shift them by the layers before it
        off = d["pp_rank"] * cfg["num_hidden_layers"] // stages
        d["sd"] = {_shift(k, off): v for k, v in d["sd"].items()}
        for k, v in d["sd"].items():
            by_tp.setdefault(d["tp_rank"], {}).setdefault(k, v)
    tps = [by_tp[r] for r in sorted(by_tp)]
    groups, hd, heads = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_attention_heads"]

    def cat(key, dim):
        return torch.cat([sd[key] for sd in tps], dim=dim)

    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = cat("output_layer.weight", 0)
    out["model.norm.weight"] = tps[0]["decoder.final_layernorm.weight"]
    for layer in range(cfg["num_hidden_layers"]):
        p, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        out[h + "input_layernorm.weight"] = tps[0][p + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = tps[0][p + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias"):
            if p + f"self_attention.linear_qkv.{kind}" not in tps[0]:
                continue
            parts = []
            for sd in tps:  # each rank holds whole groups, each [its query heads, one key head, one value head]
                t = sd[p + f"self_attention.linear_qkv.{kind}"]
                parts.append(t.reshape(-1, (heads // groups + 2) * hd, *t.shape[1:]))
            q, k, v = torch.cat(parts).split([heads // groups * hd, hd, hd], dim=1)
            for n, t in (("q", q), ("k", k), ("v", v)):
                out[h + f"self_attn.{n}_proj.{kind}"] = t.reshape(-1, *t.shape[2:])
        out[h + "self_attn.o_proj.weight"] = cat(p + "self_attention.linear_proj.weight", 1)
        for n in ("q", "k"):
            if (key := p + f"self_attention.{n}_layernorm.weight") in tps[0]:
                out[h + f"self_attn.{n}_norm.weight"] = tps[0][key]
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            # Mixtral's checkpoints name the MoE block block_sparse_moe and its experts' projections w1 (gate),
            # w3 (up), w2 (down); the Qwen MoE models mlp and gate_proj / up_proj / down_proj
            mixtral = "num_local_experts" in cfg
            moe = "block_sparse_moe" if mixtral else "mlp"
            g_, u_, d_ = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            out[h + f"{moe}.gate.weight"] = tps[0][p + "mlp.router.weight"]
            for d in ranks:
                pat = re.escape(p) + r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1"
                local = sorted({int(m[1]) for key in d["sd"] if (m := re.match(pat, key))})
                for i in local:
                    e = d["ep_rank"] * len(local) + i
                    gate, up = d["sd"][p + f"mlp.experts.local_experts.{i}.linear_fc1.weight"].chunk(2)
                    out[h + f"{moe}.experts.{e}.{g_}.weight"] = gate
                    out[h + f"{moe}.experts.{e}.{u_}.weight"] = up
                    out[h + f"{moe}.experts.{e}.{d_}.weight"] = d["sd"][
                        p + f"mlp.experts.local_experts.{i}.linear_fc2.weight"
                    ]
            if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: a TP-split MLP and a [1, hidden] gate
                halves = [sd[p + "mlp.shared_experts.linear_fc1.weight"].chunk(2) for sd in tps]
                out[h + "mlp.shared_expert.gate_proj.weight"] = torch.cat([g for g, _u in halves])
                out[h + "mlp.shared_expert.up_proj.weight"] = torch.cat([u for _g, u in halves])
                out[h + "mlp.shared_expert.down_proj.weight"] = cat(p + "mlp.shared_experts.linear_fc2.weight", 1)
                out[h + "mlp.shared_expert_gate.weight"] = tps[0][p + "mlp.shared_experts.gate_weight"]
        else:
            halves = [sd[p + "mlp.linear_fc1.weight"].chunk(2) for sd in tps]
            out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _u in halves])
            out[h + "mlp.up_proj.weight"] = torch.cat([u for _g, u in halves])
            out[h + "mlp.down_proj.weight"] = cat(p + "mlp.linear_fc2.weight", 1)
    return {k: v.contiguous() for k, v in out.items()}


def _shift(key: str, off: int) -> str:
    m = re.match(r"decoder\.layers\.(\d+)\.", key)
    return f"decoder.layers.{int(m[1]) + off}.{key[m.end() :]}" if m else key


def _logits(model_dir: Path, name: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert type(model).__name__ == W.CLASSES[W.MODELS[name]["arch"]]  # chosen by model_type, not by our config
    with torch.no_grad():
        return model(torch.tensor(W.TOKENS)).logits


@pytest.fixture(scope="module")
def exported(mgx, tmp_path_factory) -> dict[str, Path]:
    """Each model exported once through the real CLI (with a catalog), and its reference as an HF directory."""
    root = tmp_path_factory.mktemp("mgx-export")
    out = {}
    for name in W.MODELS:
        base = mgx / name / "base_model"
        proc = _cli(_step(mgx, name), "--to", root / name, "--hf-config", base, "--json", catalog=root / "c.db")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["verified"] and doc["source_kind"] == "megatron-dist-ckpt" and doc["world_size"] == W.WORLD
        assert doc["model_check"] == "transformers", doc["model_load"]
        assert doc["warnings"] == []  # every name and shape checked against the family's template too
        ref = root / f"{name}-reference"
        ref.mkdir()
        shutil.copy(base / "config.json", ref / "config.json")
        save_file(reference(mgx, name), str(ref / "model.safetensors"))
        out[name], out[f"{name}-reference"] = root / name, ref
    return out


@pytest.mark.parametrize("name", list(W.MODELS))
def test_export_equals_the_trainers_weights_and_logits(mgx, exported, name):
    got = load_file(str(exported[name] / "model.safetensors"))
    want = load_file(str(exported[f"{name}-reference"] / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert ("lm_head.weight" in got) is not W.MODELS[name]["tied"]
    logits = _logits(exported[name], name)
    assert torch.equal(logits, _logits(exported[f"{name}-reference"], name))
    if (trained := mgx / name / "trainer" / "logits.pt").exists():  # megatron-core's own TP forward
        torch.testing.assert_close(logits, torch.load(trained).reshape(logits.shape), rtol=0, atol=1e-5)


def _check(mgx, name: str, hf: Path, catalog: Path) -> subprocess.CompletedProcess:
    return _cli(_step(mgx, name), "--check", hf, "--hf-config", mgx / name / "base_model", catalog=catalog)


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _one_ulp(t: torch.Tensor) -> None:
    t.view(torch.int32).view(-1)[5] += 1


def _swap_qk(sd: dict) -> None:
    q, k = sd["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.k_proj.weight"]
    n = W.HEAD_DIM
    q[:n], k[:n] = k[:n].clone(), q[:n].clone()


CASES = {
    "expert-dropped": (
        "qwen3moe",
        lambda sd: [sd.pop(f"model.layers.0.mlp.experts.3.{p}_proj.weight") for p in ("gate", "up", "down")],
        ["model.layers.0.mlp.experts.3.down_proj.weight: missing", "model.layers.0: 3 experts, config.json says 4"],
    ),
    "lm-head-dropped": (
        "llama-untied",
        lambda sd: sd.pop("lm_head.weight"),
        ["lm_head.weight: missing although config.json does not tie the word embeddings"],
    ),
    "lm-head-kept": (
        "qwen2-tied",
        lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone()}),
        ["lm_head.weight: present although config.json ties the word embeddings"],
    ),
    "q-k-swapped": (
        "qwen2-tied",
        _swap_qk,
        ["model.layers.1.self_attn.k_proj.weight: values differ", "model.layers.1.self_attn.q_proj.weight: values"],
    ),
    "mixtral-expert-dropped": (
        "mixtral",
        lambda sd: [sd.pop(f"model.layers.1.block_sparse_moe.experts.0.w{i}.weight") for i in (1, 2, 3)],
        ["model.layers.1.block_sparse_moe.experts.0.w1.weight: missing", "model.layers.1: 3 experts, config.json"],
    ),
    "shared-expert-gate-dropped": (
        "qwen2moe",
        lambda sd: sd.pop("model.layers.0.mlp.shared_expert_gate.weight"),
        ["model.layers.0.mlp.shared_expert_gate.weight: missing"],
    ),
    "one-ulp": (
        "llama-untied",
        lambda sd: _one_ulp(sd["model.layers.1.mlp.down_proj.weight"]),
        ["model.layers.1.mlp.down_proj.weight: values differ from the checkpoint's"],
    ),
}


def test_check_passes_every_export_and_names_each_defect(mgx, exported, tmp_path):
    for name in W.MODELS:
        proc = _check(mgx, name, exported[name], tmp_path / "c.db")
        assert proc.returncode == 0 and "equal bit for bit" in proc.stdout, proc.stdout + proc.stderr
    for case, (name, edit, lines) in CASES.items():
        hf = _edited(exported[name], tmp_path / case, edit)
        proc = _check(mgx, name, hf, tmp_path / "c.db")
        assert proc.returncode == 1, (case, proc.stdout, proc.stderr)
        body = [ln.strip() for ln in proc.stdout.splitlines()[1:]]
        for want in lines:
            assert any(ln.startswith(want) for ln in body), (case, want, body)


def test_config_disagreeing_with_the_checkpoint_is_refused(mgx, tmp_path):
    """The config decides lm_head, never a flag; a config that says tied for a model trained untied is refused."""
    base = tmp_path / "base"
    base.mkdir()
    cfg = W.hf_config("llama-untied") | {"tie_word_embeddings": True}
    (base / "config.json").write_text(json.dumps(cfg))
    proc = _cli(_step(mgx, "llama-untied"), "--to", tmp_path / "hf", "--hf-config", base, catalog=tmp_path / "c.db")
    assert proc.returncode == 3 and "ties the word embeddings but the checkpoint holds" in proc.stderr
    (base / "config.json").write_text(json.dumps(W.hf_config("qwen3moe") | {"num_experts": 8}))
    proc = _cli(_step(mgx, "qwen3moe"), "--to", tmp_path / "hf", "--hf-config", base, catalog=tmp_path / "c.db")
    assert proc.returncode == 3 and "config.json says 8" in proc.stderr
    proc = _cli(_step(mgx, "qwen3moe"), "--to", tmp_path / "hf", catalog=tmp_path / "c.db")  # no config at all
    assert proc.returncode == 3 and "--hf-config" in proc.stderr
    assert not (tmp_path / "hf").exists()


def test_a_hf_config_that_is_no_json_object_is_named_not_called_missing(mgx, tmp_path):
    """--hf-config DIR whose config.json is garbage was "<the step's huggingface/> has no config.json": the file
    given is named, and what is wrong with it."""
    base = tmp_path / "base"
    base.mkdir()
    for text, why in (("{garbage", "is not valid JSON ("), ("[1, 2]", "is not a JSON object")):
        (base / "config.json").write_text(text)
        proc = _cli(_step(mgx, "llama-untied"), "--to", tmp_path / "hf", "--hf-config", base, catalog=tmp_path / "c.db")
        assert proc.returncode == 3, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"ckpt-audit: error: {base / 'config.json'} {why}"), line
    assert not (tmp_path / "hf").exists()


ARCH_REFUSALS = {  # tree, config change, the one-line refusal
    "qwen3-without-qk-norm": (
        "llama-untied",
        {"model_type": "qwen3"},
        "a qwen3 model has q_norm (megatron qk_layernorm)",
    ),
    "llama-with-qk-norm": (
        "qwen3-tied",
        {"model_type": "llama"},
        "qk_layernorm, which config.json's model has no k_norm",
    ),
    "mistral-with-qkv-bias": ("qwen2-tied", {"model_type": "mistral"}, "linear_qkv.bias: q/k/v biases, which config"),
    "qwen2-moe-without-shared-expert": (
        "qwen3moe",
        {"model_type": "qwen2_moe"},
        "a qwen2_moe model has q/k/v_proj biases",
    ),
    "mixtral-with-shared-expert": ("qwen2moe", {"model_type": "mixtral"}, "shared_experts.gate_weight: no HF name"),
    "moe-with-dense-layers": ("qwen3moe-mixed", {}, "a qwen3_moe model with dense layers (mlp_only_layers"),
    "moe-saved-with-per-layer-keys": (  # the config not saying so: megatron-core's keys do
        "qwen3moe-mixed",
        {"mlp_only_layers": []},
        "decoder.layers.0.mlp.experts.experts.linear_fc1.weight: megatron-core saves mixed dense and MoE layers",
    ),
}


@pytest.mark.parametrize("case", list(ARCH_REFUSALS))
def test_config_and_checkpoint_disagreeing_on_an_architectures_parameters_is_refused(mgx, tmp_path, case):
    """What a family's HF model holds beyond Llama's names (q/k/v biases, Qwen3's q_norm / k_norm, Qwen2-MoE's gated
    shared expert) is decided by its config; the checkpoint must hold exactly that, or the export would drop trained
    weights or leave HF ones at their initial values. An MoE model with a dense layer (saved by megatron-core under
    per-layer keys) is refused by its config, or by its keys where the config does not say so. Each refused before
    anything is written (exit 3), without transformers' load (skipped here: a model too big to load)."""
    name, change, want = ARCH_REFUSALS[case]
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(W.hf_config(name) | change))
    args = ("--to", tmp_path / "hf", "--hf-config", base, "--max-load-size", "0")
    proc = _cli(_step(mgx, name), *args, catalog=tmp_path / "c.db")
    assert proc.returncode == 3 and want in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists()


def test_bridge_weights_are_checked_against_the_dist_ckpt(mgx, exported, tmp_path):
    """verl's bridge mode: HF weights in model/huggingface beside model/dist_ckpt. Equal: exported; one ulp off:
    refused (exit 1), nothing written."""
    run = tmp_path / "run"
    shutil.copytree(_step(mgx, "qwen2-tied").parent, run)
    hf = run / f"global_step_{W.STEP}" / "actor" / "model" / "huggingface"
    for f in ("config.json", "model.safetensors"):
        shutil.copy(exported["qwen2-tied"] / f, hf / f)
    step = run / f"global_step_{W.STEP}"
    proc = _cli(step, "--to", tmp_path / "ok", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    sd = load_file(str(hf / "model.safetensors"))
    _one_ulp(sd["model.layers.0.mlp.up_proj.weight"])
    save_file(sd, str(hf / "model.safetensors"), metadata={"format": "pt"})
    proc = _cli(step, "--to", tmp_path / "bad", catalog=tmp_path / "c.db")
    assert proc.returncode == 1 and "model.layers.0.mlp.up_proj.weight: values differ" in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_pre_v2_layout_exports_the_same_model(mgx, exported, tmp_path):
    """verl <= 0.8's layout: dist_ckpt/ and huggingface/ (with its config) directly under the role. The same chunks
    give the same file, byte for byte; the old FSDP-only message is gone."""
    run = tmp_path / "run"
    shutil.copytree(_step(mgx, "qwen2-tied").parent, run)
    actor = run / f"global_step_{W.STEP}" / "actor"
    (actor / "model" / "dist_ckpt").rename(actor / "dist_ckpt")
    for d in ("model", "extra"):
        shutil.rmtree(actor / d)
    (actor / "ckpt_contents.json").unlink()
    (actor / "huggingface").mkdir()
    shutil.copy(mgx / "qwen2-tied" / "base_model" / "config.json", actor / "huggingface" / "config.json")
    proc = _cli(actor.parent, "--to", tmp_path / "hf", "--max-load-size", "0", catalog=tmp_path / "c.db")
    assert proc.returncode == 0, proc.stderr
    new, old = (d / "model.safetensors" for d in (exported["qwen2-tied"], tmp_path / "hf"))
    assert new.read_bytes() == old.read_bytes()


def test_bridge_weights_of_an_unmapped_architecture_export_as_saved_with_a_warning(mgx, exported, tmp_path):
    """A model_type the planner does not map (here phi3, by its config) keeps what export did before: the bridge's
    HF weights, now with a warning that they were not checked against the dist_ckpt."""
    from ckpt_audit.export.orchestrator import export_checkpoint

    run = tmp_path / "run"
    shutil.copytree(_step(mgx, "qwen2-tied").parent, run)
    hf = run / f"global_step_{W.STEP}" / "actor" / "model" / "huggingface"
    shutil.copy(exported["qwen2-tied"] / "model.safetensors", hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps(W.hf_config("qwen2-tied") | {"model_type": "phi3"}))
    result = export_checkpoint(run / f"global_step_{W.STEP}", tmp_path / "hf", allow_unverified=True, max_load_size=0)
    assert result.source_kind == "hf-weights"
    assert any("not checked against the dist_ckpt: model_type 'phi3'" in w for w in result.warnings)
