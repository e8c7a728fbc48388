"""docs/ci.md's recipes, kept working: the GitHub Actions workflow and the GitLab CI job are parsed as YAML, agree
with each other and with this repository (extras, the verl and torch under test), and their commands run here on
CPU: GitHub's at W=1 with a Llama-style config directory, GitLab's at W=2 with a Qwen2-style model given as a Hub id
from a local Hugging Face cache, both through the installed verl, and both must report EQUIVALENT with every
published artefact in place. The team's model keeps its parameter names and tied embeddings when shrunk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from junit_read import assert_schema_valid, failed, read_junit

REPO = Path(__file__).resolve().parent.parent
SMALL = {"STEPS": "4", "RESUME_STEP": "3"}  # the recipes' 8 steps, restart after 5, made small for the suite

LLAMA_3_8B_LIKE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN2_0_5B_LIKE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def recipes() -> dict[str, dict]:
    """The YAML block under each recipe heading of docs/ci.md."""
    text = (REPO / "docs" / "ci.md").read_text()
    found = {}
    for title in ("GitHub Actions", "GitLab CI"):
        section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
        found[title] = yaml.safe_load(block)
    return found


def github() -> dict:
    job = recipes()["GitHub Actions"]["jobs"]["resume-test"]
    steps = {s.get("name", s.get("uses")): s for s in job["steps"]}
    return {
        "job": job,
        "vars": job["env"],
        "matrix": [str(w) for w in job["strategy"]["matrix"]["world_size"]],
        "install": steps["Install ckpt-audit and the verl under test"]["run"].strip().splitlines(),
        "script": steps["Resume-equivalence test"]["run"].strip().splitlines(),
        "steps": steps,
    }


def gitlab() -> dict:
    job = recipes()["GitLab CI"]["resume-test"]
    return {
        "job": job,
        "vars": job["variables"],
        "matrix": job["parallel"]["matrix"][0]["W"],
        "install": job["before_script"],
        "script": job["script"],
    }


def test_both_recipes_install_and_run_the_same_commands_for_this_repository():
    gh, gl = github(), gitlab()
    assert gh["matrix"] == gl["matrix"] == ["1", "2"]
    assert gh["install"] == gl["install"] and gh["script"] == gl["script"]
    shared = ("VERL_VERSION", "CKPT_AUDIT", "MODEL_CONFIG", "STEPS", "RESUME_STEP", "HF_HUB_OFFLINE")
    assert {k: gh["vars"][k] for k in shared} == {k: gl["vars"][k] for k in shared}
    assert gh["vars"]["W"] == "${{ matrix.world_size }}"
    # the versions the recipes install are the ones this suite runs with
    assert gh["vars"]["VERL_VERSION"] == version("verl")
    torch_pin = next(line for line in gh["install"] if " torch==" in line)
    assert f"torch=={version('torch').split('+')[0]} " in torch_pin and "whl/cpu" in torch_pin
    assert 'python -m pip install --no-deps "verl==$VERL_VERSION"' in gh["install"]
    extra = re.match(r"ckpt-audit\[(\w+)\]", gh["vars"]["CKPT_AUDIT"]).group(1)
    assert re.search(rf"^{extra} = \[", (REPO / "pyproject.toml").read_text(), re.M), extra
    # the test: verl's own manager, the team's config, JSON, JUnit, kept trees
    (test,) = [line for line in gh["script"] if line.startswith("ckpt-audit resume-test ")]
    for part in ("--checkpointer verl", '--model-config "$MODEL_CONFIG"', '-w "$W"', "--json", "--junit-xml out/"):
        assert part in test
    # published: every JUnit file (always), JSON/SVG/XML (always), the trees on failure; caches: pip and HF
    steps = gh["steps"]
    junit = steps["Publish the JUnit reports"]
    assert junit["if"] == "always()" and junit["with"]["report_paths"] == "out/*.xml"
    assert steps["Upload the reports"]["if"] == "always()"
    assert set(steps["Upload the reports"]["with"]["path"].split()) == {"out/*.xml", "out/*.json", "out/*.svg"}
    assert steps["Upload the kept trees"]["if"] == "failure()"
    assert steps["Upload the kept trees"]["with"]["path"] == "out/trees"
    assert set(steps["actions/cache@v4"]["with"]["path"].split()) == {".cache/pip", ".cache/huggingface"}
    artifacts = gl["job"]["artifacts"]
    assert artifacts["when"] == "always" and artifacts["reports"]["junit"] == "out/*.xml"
    assert artifacts["paths"] == ["out/"]
    assert gl["job"]["cache"]["paths"] == [".cache/pip", ".cache/huggingface"]
    assert gh["vars"]["PIP_CACHE_DIR"].endswith("/.cache/pip") and gl["vars"]["PIP_CACHE_DIR"].endswith("/.cache/pip")
    assert gh["vars"]["HF_HOME"].endswith("/.cache/huggingface")
    assert gl["vars"]["HF_HOME"].endswith("/.cache/huggingface")


def _env(variables: dict, workspace: Path, **overrides) -> dict:
    """The job's environment as the CI system would set it: its variables with the CI's own expanded, the installed
    ckpt-audit first on PATH, this checkout's code first on the import path."""
    env = dict(os.environ)
    for key, value in variables.items():
        value = str(value).replace("${{ github.workspace }}", str(workspace)).replace("$CI_PROJECT_DIR", str(workspace))
        env[key] = value
    env.update(SMALL, **overrides)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run_script(lines: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    # GitHub runs `bash -e {0}`; GitLab runs the lines one after another in one shell and stops at a failure
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", "\n".join(lines)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def _check_published(out: Path, *, world_size: int, architecture: str) -> dict:
    doc = json.loads((out / "resume-test.json").read_text())
    assert doc["equivalent"] is True and doc["world_size"] == world_size and doc["architecture"] == architecture
    assert doc["checkpointer_name"] == f"verl {version('verl')} FSDPCheckpointManager"
    cases, props, _ = read_junit(out / "resume-test.xml")
    assert not failed(cases)
    steps = int(SMALL["STEPS"])
    assert sum(k[0] == "resume-test.steps" for k in cases) == 3 * steps
    assert {k[1] for k in cases if k[0] == "resume-test.restore"} == {
        "model",
        "optimizer",
        "scheduler",
        "rng.cpu",
        "rng.numpy",
        "rng.random",
        "data",
    }
    assert props["version.verl"] == version("verl") and props["architecture"] == architecture
    assert props["command"].startswith(f"ckpt-audit resume-test -w {world_size} --checkpointer verl")
    for report in ("resume-test.xml", "continuity.xml", "verify.xml"):
        assert_schema_valid(out / report)
    cont, _, _ = read_junit(out / "continuity.xml")
    assert list(cont) == [("continuity.loss", f"resume from step {SMALL['RESUME_STEP']}")]
    verified, _, _ = read_junit(out / "verify.xml")
    assert len(verified) >= 3 and not failed(verified)  # straight, first half and resumed run, as verl wrote them
    assert (out / "loss.svg").read_text().lstrip().startswith("<svg")
    assert not (out / "trees").exists()  # kept only for a failing run
    return doc


@pytest.mark.slow
def test_github_recipe_runs_at_w1_with_a_llama_config_directory(tmp_path):
    # a skip, not an import: verl is not in the test extra (its metadata pins clash); the README installs it --no-deps
    pytest.importorskip("verl.utils.checkpoint.fsdp_checkpoint_manager")
    gh = github()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_3_8B_LIKE))
    env = _env(gh["vars"], tmp_path, W="1", MODEL_CONFIG="model")  # the recipe's file, given as its directory
    proc = _run_script(gh["script"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = _check_published(tmp_path / "out", world_size=1, architecture="LlamaForCausalLM")
    assert doc["model"]["kind"] == "directory" and doc["model"]["source"] == "model"
    assert doc["model"]["shrunk"]["layers"] == [32, 2] and doc["model"]["shrunk"]["hidden"] == [4096, 32]
    assert doc["model"]["kept"] == []


@pytest.mark.slow
def test_gitlab_recipe_runs_at_w2_with_a_qwen2_model_from_the_local_hub_cache(tmp_path):
    # a skip, not an import: verl is not in the test extra (its metadata pins clash); the README installs it --no-deps
    pytest.importorskip("verl.utils.checkpoint.fsdp_checkpoint_manager")
    gl = gitlab()
    # the Hugging Face cache as huggingface_hub lays it out, under the recipe's cached HF_HOME; offline
    repo = tmp_path / ".cache" / "huggingface" / "hub" / "models--acme--qwen2-mini"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(QWEN2_0_5B_LIKE))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = _env(gl["vars"], tmp_path, W="2", MODEL_CONFIG="acme/qwen2-mini")
    env.pop("HF_HUB_CACHE", None)
    proc = _run_script(gl["script"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = _check_published(tmp_path / "out", world_size=2, architecture="Qwen2ForCausalLM")
    assert doc["model"]["kind"] == "hub cache" and doc["model"]["source"] == "acme/qwen2-mini"
    assert doc["model"]["config"] == str(repo / "snapshots" / revision / "config.json")
    assert doc["model"]["shrunk"]["layers"] == [24, 2] and doc["model"]["kept"] == ["tied embeddings"]


@pytest.mark.parametrize("config", [LLAMA_3_8B_LIKE, QWEN2_0_5B_LIKE], ids=["llama", "qwen2"])
def test_the_shrunk_model_keeps_the_architectures_parameter_names_and_tied_embeddings(tmp_path, config):
    """What resume-test trains: the same class and the same parameter names (layer index aside) as the full model,
    built on the meta device (no memory), and embeddings tied exactly where the config ties them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.commands.model_source import describe_shrink, resolve, shrink_line
    from harness.config import TrainConfig
    from harness.model import build_actor, build_hf_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    shrunk = build_actor(build_hf_config(TrainConfig(run_dir="", model_config=str(tmp_path / "config.json"))))
    raw = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **raw))

    def names(model) -> set[str]:
        return {re.sub(r"\.layers\.\d+\.", ".layers.N.", k) for k in model.state_dict()}

    assert type(shrunk) is type(full) and type(full).__name__ == config["architectures"][0]
    assert names(shrunk) == names(full)
    tied = shrunk.lm_head.weight is shrunk.get_input_embeddings().weight
    assert tied == config["tie_word_embeddings"] == (full.lm_head.weight is full.get_input_embeddings().weight)
    doc = describe_shrink(resolve(str(tmp_path)), layers=2, hidden=32)
    line = shrink_line(doc, type(shrunk).__name__)
    assert line.startswith(f"  model: {type(full).__name__} from {tmp_path} (directory); shrunk: layers ")
    assert f"layers {config['num_hidden_layers']}->2, hidden {config['hidden_size']}->32" in line
    assert ("kept: tied embeddings" in line) == config["tie_word_embeddings"]
