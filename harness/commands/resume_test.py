"""`ckpt-audit resume-test`: prove that a restart from a checkpoint continues exactly as if it had never stopped."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import click

from ckpt_audit.cli.common import (
    CommandError,
    check_junit_writable,
    emit_json,
    junit_option,
    require_torch,
    write_junit_report,
)
from ckpt_audit.exitcodes import ExitCode
from harness.commands import TRAINER_MODULES
from harness.commands.model_source import shrink_line


@click.command("resume-test")
@click.option(
    "-w",
    "--world-size",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Ranks for the straight run and the first half.",
)
@click.option(
    "--steps",
    type=click.IntRange(2, 10_000),
    default=None,
    help="S: total steps (default 8; 24 with --resume-world-size, so the restart falls past the warmup).",
)
@click.option(
    "--resume-step",
    type=click.IntRange(1, 10_000),
    default=None,
    help="k: save and restart after this step (default S//2+1, mid-epoch).",
)
@click.option(
    "--resume-world-size",
    type=click.IntRange(1, 64),
    default=None,
    help="Ranks after the restart (re-shards on load); loss, lr and grad_norm are then judged as "
    "`continuity` judges real logs, and within --tolerance of the straight run.",
)
@click.option("--hsdp", is_flag=True, help='2-replica HSDP ("ddp", "fsdp") mesh; world sizes must be even.')
@click.option(
    "--model-config",
    default=None,
    metavar="CONFIG|DIR|HUB_ID",
    help="Your model: a transformers config.json of any causal-LM architecture, a model directory holding one, or "
    "a Hub id (org/name) already in the local Hugging Face cache (nothing is downloaded); shrunk to --layers and "
    "--hidden, its parameter names, tied embeddings and special modules kept (default: a tiny Qwen2).",
)
@click.option("--layers", type=click.IntRange(1, 64), default=2, show_default=True, help="Decoder layers.")
@click.option("--hidden", type=click.IntRange(8, 4096), default=32, show_default=True, help="Hidden size.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tolerance",
    type=click.FloatRange(0, 1),
    default=0.02,
    show_default=True,
    help="W->W' only: max relative per-step loss deviation after the restart.",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the produced checkpoint trees in this (empty or new) directory.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.IntRange(10, 86_400),
    default=900,
    show_default=True,
    help="Seconds before every rank is killed.",
)
@click.option(
    "--checkpointer",
    type=click.Choice(["reference", "verl"]),
    default="reference",
    show_default=True,
    help="Who saves and loads: the reference writer, or the installed verl's own FSDPCheckpointManager "
    "(the 'verl' extra; same world size only).",
)
@click.option(
    "--drop",
    multiple=True,
    hidden=True,
    type=click.Choice(["optimizer", "scheduler", "rng", "data"]),
    help="Sabotage: do not restore this piece of state on resume (the test must then fail).",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --resume-world-size: write an SVG of the resumed loss around the restart (the "
    "continuity judgement's window and threshold drawn), e.g. as a CI artefact.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@junit_option
def resume_test_command(
    world_size,
    steps,
    resume_step,
    resume_world_size,
    hsdp,
    model_config,
    layers,
    hidden,
    seed,
    tolerance,
    keep,
    timeout_s,
    checkpointer,
    drop,
    plot_path,
    as_json,
    junit_xml,
) -> None:
    """Run S steps straight, then k steps + save + full restart + S-k steps, and compare everything.

    Both runs use the reference FSDP2 trainer (real processes, gloo on CPU, NCCL on CUDA) and write verl
    checkpoints. Compared: every per-step loss, lr and grad norm bit for bit; the live state right after the
    restore against the checkpoint (model, optimizer, scheduler, every RNG stream of every rank, data position);
    and every tensor of every rank of both final checkpoints. With a different world size after the restart the
    loss cannot match bit for bit: it is judged by the same continuity judgement as `ckpt-audit continuity`
    (no jump beyond its own noise at the restart, the straight run judged as the control) and within --tolerance
    of the straight run. Exit 0 equivalent, 1 diverged (or inconclusive), 2 usage, 3 error.

    \b
    Example:
        ckpt-audit resume-test                          # W=2, 8 steps, restart after step 5
        ckpt-audit resume-test -w 3 --steps 12 --resume-step 7 --json
        ckpt-audit resume-test -w 2 --resume-world-size 3 --plot resume.svg
        ckpt-audit resume-test --model-config ./my-model/config.json --layers 2 --hidden 64
        ckpt-audit resume-test --model-config Qwen/Qwen2.5-7B   # its config.json from the local HF cache
        ckpt-audit resume-test --checkpointer verl      # through the installed verl's own manager
        ckpt-audit resume-test --checkpointer verl --json --junit-xml resume-test.xml > resume-test.json  # CI
    """
    require_torch("resume-test", TRAINER_MODULES)
    from harness.checkpointers import refuse
    from harness.launch import HarnessError
    from harness.resume import ResumeTestSpec, default_steps, run_resume_test

    if why := refuse(checkpointer, world_size=world_size, resume_world_size=resume_world_size or world_size):
        raise click.UsageError(why)
    if checkpointer == "verl" and importlib.util.find_spec("verl") is None:
        raise CommandError(
            "--checkpointer verl needs verl: pip install 'ckpt-audit[verl]' && pip install --no-deps verl==0.9.1 "
            "(docs/harness.md)"
        )
    if plot_path is not None and resume_world_size in (None, world_size):
        raise click.UsageError("--plot needs --resume-world-size (a same-size resume is compared bit for bit)")
    if plot_path is not None and not os.access(plot_path.parent, os.W_OK):  # fail before minutes of training
        raise CommandError(f"cannot write {plot_path}: {plot_path.parent} is not a writable directory")
    check_junit_writable(junit_xml)
    model = _model(model_config, layers=layers, hidden=hidden) if model_config else None
    steps = steps or default_steps(world_size, resume_world_size)
    spec = ResumeTestSpec(
        world_size=world_size,
        steps=steps,
        resume_step=resume_step,
        resume_world_size=resume_world_size,
        hsdp=hsdp,
        drop=tuple(drop),
        model_config=model["config"] if model else None,
        layers=layers,
        hidden=hidden,
        seed=seed,
        tolerance=tolerance,
        keep=keep,
        timeout_s=timeout_s,
        checkpointer=checkpointer,
    )
    try:
        report = run_resume_test(spec, progress=lambda msg: click.echo(msg, err=True))
    except (HarnessError, ValueError, OSError) as exc:
        raise CommandError(str(exc).splitlines()[0] if not isinstance(exc, HarnessError) else _one_line(exc)) from None
    loss = next((m.resumed for m in report.continuity if m.metric == "loss"), None)
    if plot_path is not None and loss is not None:
        from ckpt_audit.cli.continuity import write_plot

        write_plot(plot_path, loss)
    if junit_xml is not None:
        from harness.commands.resume_junit import resume_suite

        write_junit_report(junit_xml, [resume_suite(report, cuda=_on_cuda(world_size), model=model)])
    if as_json:
        emit_json({**report.to_json(), "model": model})
    else:
        lines = report.summary().splitlines()
        if model:  # after the head line, which names the architecture
            lines.insert(1, shrink_line(model, report.architecture))
        click.echo("\n".join(lines))
    raise click.exceptions.Exit(int(ExitCode.OK if report.equivalent else ExitCode.FINDINGS))


def _model(value: str, *, layers: int, hidden: int) -> dict:
    """--model-config resolved (a usage error if it names nothing) and described before any training."""
    from harness.commands.model_source import ModelSourceError, describe_shrink, resolve

    try:
        source = resolve(value)
    except ModelSourceError as exc:
        raise click.BadParameter(str(exc), param_hint="--model-config") from None
    try:
        return describe_shrink(source, layers=layers, hidden=hidden)
    except ModelSourceError as exc:
        raise CommandError(str(exc)) from None


def _on_cuda(world_size: int) -> bool:
    """Whether the ranks ran on CUDA (the trainer's own rule), so a `cuda` RNG stream was compared."""
    from harness.config import TrainConfig
    from harness.trainer import pick_device

    return pick_device(TrainConfig(run_dir="", world_size=world_size)) == "cuda"


def _one_line(exc: Exception) -> str:
    """The trainer's own error line (the last line of its traceback), not the whole log."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    cause = next((line for line in reversed(lines) if "Error" in line and not line.startswith("[launcher]")), "")
    return f"{lines[0]}: {cause.strip()}" if cause and cause != lines[0] else lines[0]
