"""The resume-equivalence test: S steps straight versus k steps, save, full restart, S-k steps.

Three phases run in freshly forked ranks (harness.launch.run_phases): nothing of the first half survives in memory
into the second; the second half finds its checkpoint through the tracker, as verl's resume_mode=auto does.
Three comparisons decide:
  1. per-step metrics (loss, lr, grad_norm) of both runs, bit for bit (exact mode) or within a tolerance;
  2. restore fidelity: the live state right after loading (the "probe", written by the resumed ranks before their
     first step) against the checkpoint it was loaded from: this names the piece that was not restored;
  3. the final checkpoints of both runs, every tensor of every rank (exact mode only).
Exact mode (same world size) demands all three be identical. With a different world size for the second half the
reduction order and the per-rank data split change, so the loss cannot match bit for bit. It is then judged twice:
by the continuity judgement `ckpt-audit continuity` applies to real logs (a jump beyond the loss's own recent noise
at the restart, steps counted twice or skipped), with the straight run judged at the same step as the control, and
step by step within `tolerance` (relative) of the straight run. The restore itself (full tensors, scheduler, data
position, RNG of the ranks both runs share) must still be exact.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.checkpointers import describe, refuse
from harness.compare import COMPONENTS, Difference, compare_states
from harness.config import TrainConfig
from harness.continuity import MetricJudgement, judge_metrics
from harness.launch import run_phases

METRIC_FIELDS = ("loss", "lr", "grad_norm")
EXACT_STEPS = 8
CONTINUITY_STEPS = 24
"""Default S for W->W': the judgement needs a window of steps past the LR warmup before the restart (k = 13);
restarting at step 5, the warmup's bend makes even the uninterrupted run look like a jump."""


def default_steps(world_size: int, resume_world_size: int | None) -> int:
    return CONTINUITY_STEPS if resume_world_size not in (None, world_size) else EXACT_STEPS


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeTestSpec:
    world_size: int = 2
    """Ranks for the straight run and the first half."""
    steps: int = EXACT_STEPS
    """S: total steps of both runs (default_steps() picks CONTINUITY_STEPS for W->W')."""
    resume_step: int | None = None
    """k: the save/restart point (default S // 2 + 1, so the restart falls mid-epoch)."""
    resume_world_size: int | None = None
    """W' for the second half (default: the same W, exact mode)."""
    hsdp: bool = False
    """2-replica HSDP mesh (world sizes must be even)."""
    drop: tuple[str, ...] = ()
    """Sabotage: pieces not restored on resume (optimizer, scheduler, rng, data); the test must then fail."""
    model_config: str | None = None
    layers: int = 2
    hidden: int = 32
    seed: int = 0
    tolerance: float = 0.02
    """Continuity mode: max relative per-step loss deviation after the restart."""
    keep: Path | None = None
    """Keep the produced trees here (else a temporary directory, removed)."""
    checkpointer: str = "reference"
    """Who saves and loads in every phase: "reference" (harness.checkpoint) or "verl" (verl's own manager)."""
    timeout_s: float = 600
    num_workers: int = 1

    @property
    def k(self) -> int:
        return self.resume_step if self.resume_step is not None else self.steps // 2 + 1

    @property
    def second_world_size(self) -> int:
        return self.resume_world_size or self.world_size


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeReport:
    spec: ResumeTestSpec
    mode: str
    """"exact" (same world size) or "continuity" (W -> W')."""
    equivalent: bool
    first_divergent_step: int | None
    """First step whose loss/lr/grad_norm differs (exact) or deviates beyond tolerance (continuity)."""
    first_divergent_metric: str | None
    culprit: str | None
    """The first state component that failed (restore check first, then final state, then metrics)."""
    restore_differences: tuple[Difference, ...]
    final_differences: tuple[Difference, ...]
    straight: tuple[dict, ...]
    resumed: tuple[dict, ...]
    max_rel_loss_deviation: float
    tree: str | None
    seconds: float
    architecture: str | None = None
    """The model class trained (from the checkpoint's huggingface/config.json)."""
    problems: tuple[str, ...] = field(default=())
    """Structural failures (e.g. the resumed run did not continue at step k+1) and the continuity judgement's."""
    continuity: tuple[MetricJudgement, ...] = ()
    """W->W' only: loss, lr and grad_norm judged at the restart as `ckpt-audit continuity` judges real logs."""
    checkpointer_name: str = "reference"
    """What saved and loaded, with its version (e.g. "verl 0.9.1 FSDPCheckpointManager")."""

    @property
    def inconclusive(self) -> bool:
        """Not equivalent only because the judgement fires on the straight run too (the restart is too early)."""
        blocked = sum(m.inconclusive for m in self.continuity)
        # each inconclusive metric adds one problem line: as many problems as those means nothing else failed
        return (
            blocked > 0
            and len(self.problems) == blocked
            and not (self.restore_differences or self.final_differences or self.first_divergent_step)
        )

    def summary(self) -> str:
        s = self.spec
        world = f"{s.world_size}" + (f"->{s.second_world_size}" if self.mode == "continuity" else "")
        head = (
            f"resume-test: {self.architecture or 'model'}, W={world}"
            + f"{' HSDP' if s.hsdp else ''}, {s.steps} steps, restart after step {s.k}"
            + (f", dropping {', '.join(s.drop)}" if s.drop else "")
            + (f", through {self.checkpointer_name}" if s.checkpointer != "reference" else "")
        )
        lines = [head]
        if self.equivalent:
            what = (
                "bit-identical losses, parameters, optimizer state, RNG and data position"
                if self.mode == "exact"
                else f"restore exact; {_no_jump(self.continuity)}; loss within {s.tolerance:.1%} "
                f"of the straight run (max deviation {self.max_rel_loss_deviation:.2e})"
            )
            lines.append(f"EQUIVALENT: {what}")
            return "\n".join(lines)
        if self.inconclusive:
            lines.append("INCONCLUSIVE: the restore was exact, but the continuity judgement cannot tell at this step")
        else:
            lines.append("DIVERGED" + (f" (culprit: {self.culprit})" if self.culprit else ""))
        for p in self.problems:
            lines.append(f"  {p}")
        if self.first_divergent_step is not None:
            a, b = _row(self.straight, self.first_divergent_step), _row(self.resumed, self.first_divergent_step)
            m = self.first_divergent_metric
            lines.append(
                f"  first divergent step: {self.first_divergent_step} ({m}: straight "
                f"{a.get(m)!r} vs resumed {b.get(m)!r})"
            )
        if self.restore_differences:
            lines.append(f"  not restored ({len(self.restore_differences)} differences; first of each component):")
            lines += [f"    {d.describe()}" for d in _first_per_component(self.restore_differences)]
        if self.final_differences:
            lines.append(f"  final state differs ({len(self.final_differences)} differences; first of each):")
            lines += [f"    {d.describe()}" for d in _first_per_component(self.final_differences)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        s = self.spec
        return {
            "equivalent": self.equivalent,
            "inconclusive": self.inconclusive,
            "mode": self.mode,
            "world_size": s.world_size,
            "resume_world_size": s.second_world_size,
            "hsdp": s.hsdp,
            "steps": s.steps,
            "resume_step": s.k,
            "dropped": list(s.drop),
            "checkpointer": s.checkpointer,
            "checkpointer_name": self.checkpointer_name,
            "tolerance": s.tolerance,
            "first_divergent_step": self.first_divergent_step,
            "first_divergent_metric": self.first_divergent_metric,
            "culprit": self.culprit,
            "max_rel_loss_deviation": self.max_rel_loss_deviation,
            "architecture": self.architecture,
            "problems": list(self.problems),
            "continuity": {m.metric: m.to_json() for m in self.continuity} if self.mode == "continuity" else None,
            "restore_differences": [d.to_json() for d in self.restore_differences[:50]],
            "restore_difference_count": len(self.restore_differences),
            "final_differences": [d.to_json() for d in self.final_differences[:50]],
            "final_difference_count": len(self.final_differences),
            "losses": {
                "straight": [r.get("loss") for r in self.straight],
                "resumed": [r.get("loss") for r in self.resumed],
            },
            "tree": self.tree,
            "seconds": round(self.seconds, 2),
        }


def _no_jump(judged: tuple[MetricJudgement, ...]) -> str:
    loss = next((m.judgement for m in judged if m.metric == "loss"), None)
    detail = (
        f" (loss {loss.score:+.1f} x its noise, threshold {loss.threshold:g})"
        if loss is not None and loss.sufficient
        else ""
    )
    return f"no jump in {', '.join(m.metric for m in judged) or 'nothing'} at the restart{detail}"


def _row(rows, step: int) -> dict:
    return next((r for r in rows if r.get("step") == step), {})


def _first_per_component(diffs) -> list[Difference]:
    seen: dict[str, Difference] = {}
    for d in diffs:
        seen.setdefault(d.component, d)
    return [seen[c] for c in COMPONENTS if c in seen]


def _base(spec: ResumeTestSpec) -> tuple:
    """What the straight run and the first half depend on; specs that share it share those runs."""
    return (
        spec.world_size,
        spec.steps,
        spec.k,
        spec.hsdp,
        spec.checkpointer,
        spec.model_config,
        spec.layers,
        spec.hidden,
        spec.seed,
        spec.num_workers,
    )


def plan_phases(specs: list[ResumeTestSpec], work: Path) -> tuple[list[TrainConfig], list[dict[str, Path]]]:
    """Pure: the trainer configs for all specs (one straight run and one first half per distinct base, one
    second half per spec) and, per spec, where its outputs land."""
    phases: list[TrainConfig] = []
    bases: dict[tuple, Path] = {}
    layout: list[dict[str, Path]] = []
    for i, spec in enumerate(specs):
        if not 1 <= spec.k < spec.steps:
            raise ValueError(f"resume step {spec.k} must be between 1 and steps-1 ({spec.steps - 1})")
        if why := refuse(spec.checkpointer, world_size=spec.world_size, resume_world_size=spec.second_world_size):
            raise ValueError(why)
        replicas = 2 if spec.hsdp else 1
        common = dict(
            model_config=spec.model_config,
            layers=spec.layers,
            hidden=spec.hidden,
            seed=spec.seed,
            num_workers=spec.num_workers,
            replicas=replicas,
            checkpointer=spec.checkpointer,
        )
        key = _base(spec)
        if key not in bases:
            base = bases[key] = work / f"base{len(bases)}"
            phases.append(
                TrainConfig(
                    run_dir=str(base / "straight/demo/exp"),
                    world_size=spec.world_size,
                    steps=spec.steps,
                    save_every=spec.steps,
                    **common,
                )
            )
            phases.append(
                TrainConfig(
                    run_dir=str(base / "first/demo/exp"),
                    world_size=spec.world_size,
                    steps=spec.k,
                    save_every=spec.k,
                    **common,
                )
            )
        base = bases[key]
        variant = work / f"test{i}"
        paths = {
            "straight": base / "straight/demo/exp",
            "first": base / "first/demo/exp",
            "resumed": variant / "resumed/demo/exp",
            "probe": variant / "probe",
        }
        phases.append(
            TrainConfig(
                run_dir=str(paths["resumed"]),
                copy_from=str(paths["first"]),
                world_size=spec.second_world_size,
                steps=spec.steps,
                save_every=spec.steps,
                resume="auto",
                drop=tuple(spec.drop),
                probe_dir=str(paths["probe"]),
                **common,
            )
        )
        layout.append(paths)
    return phases, layout


def run_resume_test(spec: ResumeTestSpec, *, progress=None) -> ResumeReport:
    return run_resume_tests([spec], keep=spec.keep, timeout_s=spec.timeout_s, progress=progress)[0]


def run_resume_tests(
    specs: list[ResumeTestSpec], *, keep: Path | None = None, timeout_s: float = 600, progress=None
) -> list[ResumeReport]:
    """Several resume tests in one launcher (one import of torch/transformers), sharing straight runs."""
    started = time.perf_counter()
    say = progress or (lambda msg: None)
    if keep and Path(keep).exists() and any(Path(keep).iterdir()):
        raise FileExistsError(f"--keep directory {keep} is not empty")
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ckpt-audit-resume-"))
    try:
        phases, layout = plan_phases(specs, work)
        for cfg in phases:
            cfg.validate()
        for spec in specs:
            say(
                f"resume-test: {spec.steps} steps straight vs {spec.k} + restart + {spec.steps - spec.k} "
                f"({spec.world_size}->{spec.second_world_size} ranks)"
            )
        say(f"training: {len(phases)} runs in fresh processes")
        run_phases(phases, timeout_s=timeout_s)
        say("comparing")
        seconds = time.perf_counter() - started
        return [
            judge(spec, paths, seconds=seconds, tree=str(work) if keep else None) for spec, paths in zip(specs, layout)
        ]
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def judge(spec: ResumeTestSpec, paths: dict[str, Path], *, seconds: float, tree: str | None) -> ResumeReport:
    exact = spec.second_world_size == spec.world_size
    straight = metrics_of(paths["straight"])
    resumed = metrics_of(paths["resumed"])
    problems = []
    if [r["step"] for r in resumed] != list(range(1, spec.steps + 1)):
        problems.append(
            f"resumed run's steps are {[r['step'] for r in resumed]}, expected 1..{spec.steps} "
            f"(did it restart from step {spec.k}?)"
        )
    first_step, first_metric, max_dev = None, None, 0.0
    for a in straight:
        b = _row(resumed, a["step"])
        if exact:
            bad = next((m for m in METRIC_FIELDS if a.get(m) != b.get(m)), None)
        else:
            ref, got = a.get("loss"), b.get("loss")
            dev = abs(got - ref) / abs(ref) if isinstance(got, float) and ref else float("inf")
            if a["step"] <= spec.k:
                bad = next((m for m in METRIC_FIELDS if a.get(m) != b.get(m)), None)
            else:
                max_dev = max(max_dev, dev)
                bad = "loss" if dev > spec.tolerance else None
        if bad and first_step is None:
            first_step, first_metric = a["step"], bad
    continuity = () if exact else judge_metrics(paths["resumed"], paths["straight"], spec.k, METRIC_FIELDS)
    for m in continuity:
        problems += m.problems()
    k_dir = paths["resumed"] / f"global_step_{spec.k}"
    shared = min(spec.world_size, spec.second_world_size)
    restore = tuple(compare_states(k_dir, paths["probe"], rng_ranks=shared)) if paths["probe"].is_dir() else ()
    if not paths["probe"].is_dir():
        problems.append("the resumed ranks did not restore anything (no probe written)")
    final: tuple[Difference, ...] = ()
    if exact:
        final = tuple(
            compare_states(
                paths["straight"] / f"global_step_{spec.steps}", paths["resumed"] / f"global_step_{spec.steps}"
            )
        )
    culprit = None
    for diffs in (restore, final):
        if diffs:
            culprit = _first_per_component(diffs)[0].component
            break
    equivalent = not (problems or restore or final or first_step is not None)
    hf_config = k_dir / "actor" / "huggingface" / "config.json"
    architecture = None
    if hf_config.is_file():
        architecture = (json.loads(hf_config.read_text()).get("architectures") or [None])[0]
    return ResumeReport(
        spec=spec,
        mode="exact" if exact else "continuity",
        equivalent=equivalent,
        first_divergent_step=first_step,
        first_divergent_metric=first_metric,
        culprit=culprit,
        restore_differences=restore,
        final_differences=final,
        straight=tuple(straight),
        resumed=tuple(resumed),
        max_rel_loss_deviation=max_dev,
        tree=tree,
        seconds=seconds,
        architecture=architecture,
        problems=tuple(problems),
        continuity=continuity,
        checkpointer_name=describe(spec.checkpointer),
    )


def metrics_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
