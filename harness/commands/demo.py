"""`ckpt-audit demo [DIR]`: build a real checkpoint tree with the reference trainer, break one checkpoint, scan it."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import click

from ckpt_audit.cli.common import CommandError, require_torch
from ckpt_audit.exitcodes import ExitCode
from harness.commands import TRAINER_MODULES


def break_checkpoint(step_dir: Path) -> Path:
    """Flip one byte inside a tensor of rank 0's model shard (same size and mtime): only the CRC check sees it."""
    target = next((step_dir / "actor").glob("model_world_size_*_rank_0.pt"))
    flip_payload_byte(target)
    return target


def flip_payload_byte(path: Path, mask: int = 0x40) -> None:
    """Flip bits of one byte inside the largest tensor payload, keeping size, mtime and inode."""
    st = os.stat(path)
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)  # local header: name and extra lengths decide where the payload starts
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + n + m + info.file_size // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def build_demo_tree(directory: Path, *, world_size: int = 2, steps: int = 6, save_every: int = 2) -> Path:
    """The demo run under directory/ckpts (reused when already there); its first checkpoint is broken once."""
    run = directory / "ckpts" / "demo" / "exp"
    if not (run / "latest_checkpointed_iteration.txt").exists():
        from harness.tree import write_tree  # torch, lazily: only the demo trains

        run = Path(
            write_tree(
                directory / "ckpts",
                project="demo",
                experiment="exp",
                world_size=world_size,
                steps=steps,
                save_every=save_every,
            )
        )
        first = min((p for p in run.iterdir() if p.name.startswith("global_step_")), key=lambda p: int(p.name[12:]))
        break_checkpoint(first)
    return run


@click.command("demo")
@click.argument(
    "directory", required=False, default="ckpt-audit-demo", type=click.Path(file_okay=False, path_type=Path)
)
@click.option("--world-size", type=click.IntRange(1, 8), default=2, show_default=True, help="Trainer processes (gloo).")
@click.pass_context
def demo_command(ctx: click.Context, directory: Path, world_size: int) -> None:
    """Build a demo checkpoint tree with the reference trainer, break one checkpoint, and scan it.

    The tree goes to DIRECTORY/ckpts (a real multi-process FSDP run on CPU), the catalog to DIRECTORY/catalog.db.
    One checkpoint gets a flipped bit in a model shard so the report shows a crc-mismatch finding.

    \b
    Example:
        ckpt-audit demo                 # into ./ckpt-audit-demo
        ckpt-audit demo /tmp/demo && ckpt-audit ls --catalog /tmp/demo/catalog.db
    """
    from ckpt_audit import report
    from ckpt_audit.session import Locked, SessionError, open_session

    require_torch("demo", TRAINER_MODULES)  # before the directory is made
    directory.mkdir(parents=True, exist_ok=True)
    click.echo(f"building a demo tree under {directory / 'ckpts'} (reference trainer, W={world_size}) ...", err=True)
    try:
        run = build_demo_tree(directory, world_size=world_size)
    except ImportError as exc:
        raise CommandError(f"the demo needs the reference trainer (harness) and torch: {exc}") from None
    try:
        with open_session(None, roots=[run.parent.parent]) as fresh:  # no catalog: a fresh read, whatever an
            result = fresh.scan(record=False).result  # earlier demo recorded
        with open_session(directory / "catalog.db") as session:
            session.record(result)
    except SessionError as exc:
        raise CommandError(str(exc)) from None
    except Locked as exc:
        click.echo(f"ckpt-audit: {exc}", err=True)
        ctx.exit(int(ExitCode.LOCKED))
    for line in report.render_text(result):
        click.echo(line)
    click.echo(f"\ncatalog: {directory / 'catalog.db'}  (try: ckpt-audit ls --catalog {directory / 'catalog.db'})")
