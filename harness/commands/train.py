"""`ckpt-audit train`: run the reference trainer and leave a verl checkpoint tree (for demos and tests)."""

from __future__ import annotations

from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, emit_json, require_torch
from harness.commands import TRAINER_MODULES


@click.command("train")
@click.argument("root", type=click.Path(file_okay=False, path_type=Path))
@click.option("--project", default="demo", show_default=True)
@click.option("--experiment", default="exp", show_default=True)
@click.option("-w", "--world-size", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--steps", type=click.IntRange(1, 100_000), default=6, show_default=True)
@click.option("--save-every", type=click.IntRange(1, 100_000), default=2, show_default=True)
@click.option("--hsdp", is_flag=True, help='2-replica HSDP ("ddp", "fsdp") mesh; world size must be even.')
@click.option("--critic", is_flag=True, help="Also train a critic: PPO layout with actor/ and critic/.")
@click.option("--sft", is_flag=True, help="verl's SFT layout: shards directly in global_step_N/.")
@click.option("--resume", is_flag=True, help="Continue from the run's tracker (verl resume_mode=auto).")
@click.option(
    "--model-config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A local transformers config.json of any causal-LM architecture (default: a tiny Qwen2).",
)
@click.option("--layers", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--hidden", type=click.IntRange(8, 4096), default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--timeout", "timeout_s", type=click.IntRange(10, 86_400), default=900, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def train_command(
    root,
    project,
    experiment,
    world_size,
    steps,
    save_every,
    hsdp,
    critic,
    sft,
    resume,
    model_config,
    layers,
    hidden,
    seed,
    timeout_s,
    as_json,
) -> None:
    """Train the reference FSDP2 model and write checkpoints exactly as verl does under ROOT/PROJECT/EXPERIMENT.

    Real processes (gloo on CPU, NCCL on CUDA), a tiny causal LM from a transformers config, AdamW with warmup,
    a StatefulDataLoader; per-step metrics go to metrics.jsonl in the run directory.

    \b
    Example:
        ckpt-audit train /tmp/ckpts                     # W=2, steps 1..6, checkpoints at 2, 4, 6
        ckpt-audit train /tmp/ckpts -w 4 --hsdp --critic
        ckpt-audit train /tmp/ckpts --steps 10 --resume # continue the same run to step 10
    """
    require_torch("train", TRAINER_MODULES)
    from harness.launch import HarnessError
    from harness.resume import metrics_of
    from harness.tree import write_tree

    run_dir = root / project / experiment
    if not resume and (run_dir / "latest_checkpointed_iteration.txt").exists():
        raise CommandError(f"{run_dir} already holds checkpoints; pass --resume to continue it, or another ROOT")
    try:
        write_tree(
            root,
            project=project,
            experiment=experiment,
            world_size=world_size,
            steps=steps,
            save_every=save_every,
            hsdp=hsdp,
            critic=critic,
            sft=sft,
            seed=seed,
            timeout_s=timeout_s,
            model_config=str(model_config) if model_config else None,
            layers=layers,
            hidden=hidden,
            resume="auto" if resume else None,
        )
    except HarnessError as exc:
        from harness.commands.resume_test import _one_line

        raise CommandError(_one_line(exc)) from None
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc)) from None
    rows = metrics_of(run_dir)
    checkpoints = sorted(int(p.name[12:]) for p in run_dir.glob("global_step_*") if p.name[12:].isdigit())
    if as_json:
        emit_json(
            {"run": str(run_dir), "world_size": world_size, "steps": steps, "checkpoints": checkpoints, "metrics": rows}
        )
    else:
        last = rows[-1] if rows else {}
        click.echo(
            f"{run_dir}: {len(checkpoints)} checkpoints (steps {', '.join(map(str, checkpoints))}), "
            f"final loss {last.get('loss', float('nan')):.4f}"
        )
