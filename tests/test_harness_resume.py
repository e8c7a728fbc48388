"""Resume equivalence on real restarts: bit-exact at W=1, 2, 3 and HSDP, every sabotage caught and named, W->W'
continues without a jump (the `continuity` judgement) and within tolerance. All runs share one launcher (one
torch/transformers import) and straight runs."""

from __future__ import annotations

import json

import pytest

from harness.resume import CONTINUITY_STEPS, METRIC_FIELDS, ResumeTestSpec, run_resume_tests

pytestmark = pytest.mark.slow  # the module's reports run the reference trainer a dozen times

DROPS = ("optimizer", "scheduler", "rng", "data")
SPECS = {
    "w2": ResumeTestSpec(world_size=2, steps=8, resume_step=5),
    **{f"w2-drop-{d}": ResumeTestSpec(world_size=2, steps=8, resume_step=5, drop=(d,)) for d in DROPS},
    "w2->3": ResumeTestSpec(world_size=2, steps=CONTINUITY_STEPS, resume_world_size=3),
    "w2->1": ResumeTestSpec(world_size=2, steps=CONTINUITY_STEPS, resume_world_size=1),
    "w2->3-drop-scheduler": ResumeTestSpec(
        world_size=2, steps=CONTINUITY_STEPS, resume_world_size=3, drop=("scheduler",)
    ),
    "w2->3-in-warmup": ResumeTestSpec(world_size=2, steps=8, resume_step=5, resume_world_size=3),
    "w1": ResumeTestSpec(world_size=1, steps=6, resume_step=4),  # restart at the epoch boundary (4 per epoch)
    "w3": ResumeTestSpec(world_size=3, steps=5, resume_step=3),
    "hsdp": ResumeTestSpec(world_size=4, hsdp=True, steps=5, resume_step=2),
}


LLAMA_7B_LIKE = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    config = tmp_path_factory.mktemp("llama") / "config.json"
    config.write_text(json.dumps(LLAMA_7B_LIKE))
    specs = dict(SPECS, llama=ResumeTestSpec(world_size=2, steps=4, resume_step=2, model_config=str(config), hidden=64))
    return dict(zip(specs, run_resume_tests(list(specs.values()), timeout_s=1200)))


@pytest.mark.parametrize("name", ["w1", "w2", "w3", "hsdp", "llama"])
def test_resume_is_bit_exact(reports, name):
    r = reports[name]
    assert r.equivalent, r.summary()
    assert r.mode == "exact" and r.culprit is None and not r.restore_differences and not r.final_differences
    assert [row["loss"] for row in r.straight] == [row["loss"] for row in r.resumed]
    assert [row["step"] for row in r.resumed] == list(range(1, r.spec.steps + 1))
    assert r.architecture == ("LlamaForCausalLM" if name == "llama" else "Qwen2ForCausalLM")


@pytest.mark.parametrize("piece", DROPS)
def test_each_dropped_piece_is_caught_and_named(reports, piece):
    r = reports[f"w2-drop-{piece}"]
    assert not r.equivalent
    assert r.culprit == piece, r.summary()
    assert {d.component for d in r.restore_differences} == {piece}  # nothing else was disturbed by the restore
    assert r.first_divergent_step in (6, 7)  # k+1, or k+2 when the first resumed step still used restored values
    assert r.final_differences  # and the runs really drift apart
    assert f"culprit: {piece}" in r.summary()


def test_names_the_first_differing_field(reports):
    first = {d: reports[f"w2-drop-{d}"].restore_differences[0] for d in DROPS}
    assert first["optimizer"].key.startswith("state[model.embed_tokens.weight]")
    assert first["scheduler"].key == "lr_scheduler.last_epoch"
    assert (first["rng"].rank, first["rng"].key) == (0, "cpu")
    assert "yielded" in first["data"].key


@pytest.mark.parametrize("name", ["w2->3", "w2->1"])
def test_resume_at_another_world_size_continues_within_tolerance(reports, name):
    r = reports[name]
    assert r.mode == "continuity"
    assert r.equivalent, r.summary()
    assert not r.restore_differences  # full tensors, scheduler, data and the shared ranks' RNG restored exactly
    assert 0 < r.max_rel_loss_deviation <= r.spec.tolerance  # not bit-exact (reduction order), but close
    # the judgement `ckpt-audit continuity` gives real logs, on every logged metric, and on the control
    assert tuple(m.metric for m in r.continuity) == METRIC_FIELDS
    for m in r.continuity:
        assert m.judgement.sufficient and not m.judgement.jumped, m.to_json()
        assert m.control_judgement.sufficient and not m.control_judgement.jumped
        assert m.judgement.n_before == r.spec.k == 13 and m.problems() == []
    doc = r.to_json()["continuity"]
    assert doc["loss"]["judgement"]["resume_step"] == 13 and doc["loss"]["findings"] == []
    assert "no jump in loss, lr, grad_norm at the restart" in r.summary()


def test_resume_at_another_world_size_judges_a_jump_like_continuity_does(reports):
    r = reports["w2->3-drop-scheduler"]
    assert not r.equivalent and r.culprit == "scheduler"
    judged = {m.metric: m for m in r.continuity}
    assert judged["lr"].judgement.jumped  # the LR restarts its warmup: far outside its own noise
    assert any(p.startswith("continuity: metric-jump: resume from step 13: lr moved") for p in r.problems)
    assert r.to_json()["continuity"]["lr"]["findings"][0]["code"] == "metric-jump"


def test_a_restart_inside_the_warmup_is_inconclusive_not_a_pass_or_a_jump(reports):
    r = reports["w2->3-in-warmup"]
    assert not r.equivalent and not r.restore_differences  # the restore itself was exact
    loss = next(m for m in r.continuity if m.metric == "loss")
    assert loss.control_judgement.jumped  # the uninterrupted run "jumps" at the warmup's bend too
    assert any("loss inconclusive at step 5" in p for p in r.problems), r.problems
    assert not any("metric-jump" in p and "loss moved" in p for p in r.problems)
    assert r.inconclusive and r.to_json()["inconclusive"] is True and "INCONCLUSIVE" in r.summary()
    assert not reports["w2->3-drop-scheduler"].inconclusive


def test_report_json_names_culprit(reports):
    doc = reports["w2-drop-rng"].to_json()
    assert doc["equivalent"] is False and doc["culprit"] == "rng" and doc["first_divergent_step"] == 6
    assert doc["restore_differences"][0]["component"] == "rng"
    assert len(doc["losses"]["straight"]) == 8


def test_junit_report_of_every_resume_names_what_failed_and_where(reports, tmp_path):
    """resume-test --junit-xml's cases for each of this module's runs, written and read back with junitparser: the
    verdict fails exactly when the test does, each sabotage fails its own restore case naming the first divergent
    step, W->W' adds the continuity judgement's cases."""
    from junit_read import assert_schema_valid, failed, read_junit

    from ckpt_audit.report_junit import write_junit
    from harness.commands.resume_junit import resume_suite

    for name, r in reports.items():
        out = tmp_path / f"{name.replace('>', '')}.xml"
        write_junit(str(out), [resume_suite(r, cuda=False)])
        cases, props, suites = read_junit(out)
        bad = failed(cases)
        assert cases[("resume-test", "equivalent")].passed == r.equivalent == (not bad), (name, list(bad))
        assert props["mode"] == r.mode and suites[0].failures == len(bad)
        if r.mode == "continuity":
            assert {k[1] for k in cases if k[0] == "resume-test.continuity"} == set(METRIC_FIELDS)
            assert ("resume-test.steps", f"step {r.spec.k + 1} lr") not in cases  # judged by continuity instead
        if name.startswith("w2-drop-"):
            piece = name.removeprefix("w2-drop-")
            went_off = f"first divergent step {r.first_divergent_step} ({r.first_divergent_metric})"
            item = "rng.cpu" if piece == "rng" else piece
            assert bad[("resume-test.restore", item)].message.endswith(went_off), name
            assert bad[("resume-test", "equivalent")].message == f"DIVERGED (culprit: {piece}): {went_off}"
            restored = {k[1] for k, c in cases.items() if k[0] == "resume-test.restore" and c.passed}
            assert restored == {"model", "optimizer", "scheduler", "rng.cpu", "rng.numpy", "rng.random", "data"} - {
                item,
                *(["rng.numpy", "rng.random"] if piece == "rng" else []),
            }
    jump = failed(read_junit(tmp_path / "w2-3-drop-scheduler.xml")[0])
    assert jump[("resume-test.continuity", "lr")].message.startswith("continuity: metric-jump: resume from step 13")
    warmup = failed(read_junit(tmp_path / "w2-3-in-warmup.xml")[0])
    assert warmup[("resume-test", "equivalent")].message.startswith("INCONCLUSIVE")
    assert_schema_valid(tmp_path / "w2-3.xml")
